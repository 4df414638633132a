"""`SwitchedUnit`: the forward switch, the ledger accounting and the signal, written once for every backend.

A precision flip is a flag checked in `forward`, as peft's `disable_adapters` is, not module surgery. When a
unit is made it puts ONE instance-level `forward` on its module; that wrapper asks whether the unit is in
recovery and calls either the cheap path (by default the module's own forward, bit for bit) or the backend's
`recovery_forward`. No Parameter or buffer is added, so the state dict and the optimizer see nothing, and
`close()` deletes the wrapper: the module is as it was found.

A backend subclass says only what differs: `_enter()` builds whatever the recovery path needs (a BF16 weight,
nothing at all for a mode flag) and returns the bytes it holds, `_exit()` drops it, `recovery_forward()` is the
high-fidelity computation, and `recovery_bytes()` the bound on what it can hold.

torch.compile: Dynamo guards on the Python state it reads, so a flag read inside a compiled graph would make
every new set of units in recovery a new graph (flips would recompile until Dynamo's limit, then fall back to
eager). The wrapper is therefore excluded from tracing (`torch.compiler.disable(recursive=False)`): the model's
graph breaks at each unit, the cheap path is still compiled as a frame of its own (its guards do not involve the
flag), and the recovery path runs eagerly (`torch.compiler.disable`), so no flip ever recompiles anything.
The price is a graph break per unit under compile, measured in docs/performance.md.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..units import OutputGradMeter, RecoverableUnit, RecoveryLedger
from .adapters import Signal

__all__ = ["SwitchedUnit"]

logger = logging.getLogger("gnmr_hf")

# Marks our forward wrapper, so that a module already managed by a live unit is not wrapped twice.
_WRAPPER_ATTR = "_gnmr_unit"


class SwitchedUnit(RecoverableUnit):
    """A unit whose module's forward switches between the cheap path and `recovery_forward` on a flag.

    Args:
        name: the unit's name (`display_name` of the module).
        module: the module whose forward is switched.
        ledger: the `RecoveryLedger` shared by the units of one `find_units` call.
        signal: what the unit is scored on (see `adapters.resolve_signal`).
        backend: the backend's name, for messages.
        tuner: the peft tuner layer around the module, if any.
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        *,
        ledger: RecoveryLedger,
        signal: Signal,
        backend: str,
        tuner: nn.Module | None = None,
    ) -> None:
        super().__init__(name, module)
        previous = module.__dict__.get("forward")
        if previous is not None and getattr(previous, _WRAPPER_ATTR, None) is not None:
            raise ValueError(
                f"{backend} unit {name!r}: the module already belongs to another unit; close() the old units first"
            )
        self.backend = backend
        self.ledger = ledger
        self.tuner = tuner
        self.signal = signal.kind
        self._signal_tensors = list(signal.tensors)
        if signal.kind == "output_grad":
            self.output_grad = OutputGradMeter(module)
        self._recovering = False
        self._previous_forward = previous
        self._install_forward(module.forward)

    # ------------------------------------------------------------------ what a backend provides
    def cheap_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The low-cost path; by default the module's own forward, as it was when the unit was made."""
        return self._module_forward(*args, **kwargs)

    @abstractmethod
    def recovery_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The high-fidelity path, with the module forward's signature."""

    @abstractmethod
    def _enter(self) -> int:
        """Build what the recovery path needs; return the bytes it holds."""

    def _exit(self) -> None:
        """Drop what `_enter` built."""

    # ------------------------------------------------------------------ the switch
    def _install_forward(self, module_forward: Callable[..., Any]) -> None:
        self._module_forward = module_forward
        recovery = torch.compiler.disable(self.recovery_forward)
        # Call the module's own forward directly unless the backend has its own cheap path: under compile each
        # callable is a frame with its own guards, and the module's forward is guarded per module class.
        overridden = type(self).cheap_forward is not SwitchedUnit.cheap_forward
        cheap = self.cheap_forward if overridden else module_forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._recovering:
                return recovery(*args, **kwargs)
            return cheap(*args, **kwargs)

        wrapper = torch.compiler.disable(forward, recursive=False)
        setattr(wrapper, _WRAPPER_ATTR, self)
        self._forward = wrapper
        self.module.forward = wrapper

    @property
    def in_recovery(self) -> bool:
        return self._recovering

    def signal_tensors(self) -> list[torch.Tensor]:
        return list(self._signal_tensors)

    def describe(self) -> dict[str, Any]:
        return {"signal": self.signal}

    def enter_recovery(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self.backend} unit {self.name!r} is closed; find the units again to use it")
        if self._recovering:
            return
        nbytes = self._enter()
        self._recovering = True
        self.ledger.hold(self, nbytes)

    def exit_recovery(self) -> None:
        if not self._recovering:
            return
        self._recovering = False
        self._exit()
        self.ledger.release(self)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if self.module.__dict__.get("forward") is self._forward:
            if self._previous_forward is None:
                del self.module.forward
            else:
                self.module.forward = self._previous_forward
        else:
            # Someone wrapped forward after us; removing ours would drop theirs. Ours stays, inert (cheap path).
            logger.warning(
                "%s unit %r: forward was re-wrapped by someone else; left in place", self.backend, self.name
            )
