"""Public names renamed in a release: each still works, as an alias that warns, until a later minor version.

A backend, a policy or a script written against an earlier release keeps running: the old name does what the new one
does and says, once per call site, what to write instead (a `DeprecationWarning`, which Python shows in `__main__`
and pytest shows in tests). The list, old name beside new, is in docs/backends.md ("Renamed names"). Renamed state
keys and trace fields are not here: those are read under both names where they are loaded (`gnmr_hf.trace`,
`CausePolicy.load_state_dict`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .meter import FidelityMeter

__all__ = ["RenamedUnitNames", "warn_renamed"]

REMOVED = "removed in a later minor version"


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn that `old` is deprecated in favour of `new`; `stacklevel` 3 names the caller of the alias."""
    warnings.warn(f"{old} is deprecated and will be {REMOVED}; use {new}", DeprecationWarning, stacklevel=stacklevel)


# A unit's state methods a backend overrides, renamed: the old name of each, and the new one the callback calls.
_OVERRIDDEN = {"fidelity_state": "meter_state", "load_fidelity_state": "load_meter_state"}


class RenamedUnitNames:
    """The names a `RecoverableUnit` had before its measuring moved to its meter (`unit.meter`, a
    `gnmr_hf.meter.FidelityMeter`), each an alias of the new one. A backend that still *overrides* `fidelity_state` or
    `load_fidelity_state` has its method used as `meter_state` / `load_meter_state` (the names the callback calls),
    with the warning given once, when its class is defined."""

    meter: FidelityMeter

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for old, new in _OVERRIDDEN.items():
            if old in cls.__dict__ and new not in cls.__dict__:
                warn_renamed(f"{cls.__name__}.{old}", f"{new} (the callback calls {new})", stacklevel=3)
                setattr(cls, new, cls.__dict__[old])

    def sample_rows(self, x: torch.Tensor, count: int | None = None) -> torch.Tensor | None:
        warn_renamed("RecoverableUnit.sample_rows(x)", "self.meter.rows(x)")
        return self.meter.rows(x, count)

    def report_fidelity(self, *parts: Any) -> None:
        warn_renamed("RecoverableUnit.report_fidelity(*parts)", "self.meter.report(*parts)")
        self.meter.report(*parts)

    @property
    def measuring(self) -> bool:
        warn_renamed("RecoverableUnit.measuring", "self.meter.due")
        return self.meter.due

    @property
    def measure_fidelity(self) -> bool:
        warn_renamed("RecoverableUnit.measure_fidelity", "self.meter.on")
        return self.meter.on

    @property
    def fidelity_rows(self) -> int:
        warn_renamed("RecoverableUnit.fidelity_rows", "self.meter.max_rows")
        return self.meter.max_rows

    def on_phase(self, step: int | None = None) -> bool:
        warn_renamed("RecoverableUnit.on_phase()", "self.meter.in_phase()")
        return self.meter.in_phase(step)

    def fidelity_step(self) -> int:
        warn_renamed("RecoverableUnit.fidelity_step()", "self.meter.step")
        return self.meter.step

    def start_measuring(self, rows: int = 0, clock: Callable[[], int] | None = None, recovery_every: int = 1) -> None:
        warn_renamed("RecoverableUnit.start_measuring()", "self.meter.start()")
        self.meter.start(rows, clock=clock, recovery_every=recovery_every)

    def take_measurements(self) -> list[list[Any]]:
        warn_renamed("RecoverableUnit.take_measurements()", "self.meter.take()")
        return self.meter.take()

    def take_fidelity(self) -> torch.Tensor | None:
        warn_renamed("RecoverableUnit.take_fidelity()", "self.meter.take_loss()")
        return self.meter.take_loss()

    def fidelity_state(self) -> dict[str, Any] | None:
        warn_renamed("RecoverableUnit.fidelity_state()", "meter_state()")
        return self._renamed_state("meter_state")()

    def load_fidelity_state(self, state: dict[str, Any]) -> None:
        warn_renamed("RecoverableUnit.load_fidelity_state()", "load_meter_state()")
        self._renamed_state("load_meter_state")(state)

    def _renamed_state(self, new: str) -> Callable[..., Any]:
        """The unit's `new` method; the base one (the next definition up the class hierarchy) when it is the
        subclass's old-named method itself, which is calling the base (`super().fidelity_state()`): going back to it
        would never end."""
        old = next(o for o, n in _OVERRIDDEN.items() if n == new)
        method = getattr(type(self), new)
        if method is not getattr(type(self), old):
            return getattr(self, new)
        base = next(c.__dict__[new] for c in type(self).__mro__ if c.__dict__.get(new, method) is not method)
        return base.__get__(self)
