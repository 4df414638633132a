"""`FidelityMeter`: when a unit measures what its cheap path loses, and what it measured this step.

Under `policy="cause"` each unit reports its *loss*: what its cheap path loses on this step's data, in units of its
backend's bound (1 = broken; `gnmr_hf.fidelity` computes it). A unit has one meter (`unit.meter`), which owns the
scheduling and none of the numerics: it is off until the callback starts it (the paper's policy pays nothing); once
on, a unit measures in every training pass on the cheap path, and in recovery on one optimizer step in
`recovery_every`, at a phase of its own; the meter picks the rows a measure reads and keeps what the backend reports,
on the device, until the step's batched pass takes it. What is the backend's stays on the unit: `fidelity_bound`,
`input_fidelity(x)` (run from the meter's forward pre-hook) and `meter_state()`, what its measuring carries across
steps. Why each rule: docs/method.md, "The cause policy".
"""

from __future__ import annotations

import functools
import weakref
import zlib
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn

from .fidelity import part_device, resolve, spread_rows, unit_losses

__all__ = ["FidelityMeter"]


class MeteredUnit(Protocol):
    """What a meter reads of its unit (a `gnmr_hf.units.RecoverableUnit`)."""

    name: str
    backend: str
    module: nn.Module
    closed: bool

    @property
    def in_recovery(self) -> bool: ...

    def input_fidelity(self, x: torch.Tensor) -> Any: ...


class FidelityMeter:
    """One unit's measuring. A backend reads `due` where it touches the data, picks the rows with `rows(x)` and hands
    what it measured to `report(*parts)`; `UnitSignals` takes every unit's with `take()` once per step.

    Attributes: `on` (whether the unit measures at all: `start()` turns it on, `stop()` off), `max_rows` (rows of
    each tensor a measure reads, 0: all), `recovery_every` (in recovery, one optimizer step in this many).
    `reads_input`: the unit measures its forward's input through `input_fidelity`, from a forward pre-hook.
    """

    def __init__(self, unit: MeteredUnit, reads_input: bool = False) -> None:
        # Weakly: the unit owns its meter, and a unit nobody holds must go as before (its module is then free).
        self._unit = weakref.ref(unit)
        self.reads_input = reads_input
        self.on = False
        self.max_rows = 0
        self.recovery_every = 1
        self._clock: Callable[[], int] | None = None
        self._taken: list[list[Any]] | None = None
        self._draws = 0
        self._draw_step = 0
        self._hook: Any = None

    @property
    def unit(self) -> MeteredUnit:
        """The unit this meter measures for."""
        unit = self._unit()
        if unit is None:
            raise RuntimeError("FidelityMeter: its unit no longer exists")
        return unit

    def start(self, rows: int = 0, clock: Callable[[], int] | None = None, recovery_every: int = 1) -> None:
        """Turn measuring on (the cause policy does, at train begin), reading `rows` rows of each tensor measured (0:
        all of them); `clock()` gives the optimizer step, which picks the rows and, in recovery, the steps measured:
        one in `recovery_every` (what the cheap path would lose costs a second rounding, or for attention a second
        QK^T, that the recovery path does not otherwise pay). Idempotent; a closed unit stays off."""
        if isinstance(rows, bool) or not isinstance(rows, int) or rows < 0:
            raise ValueError(f"FidelityMeter.start: rows must be an int >= 0 (0: every row), got {rows!r}")
        if isinstance(recovery_every, bool) or not isinstance(recovery_every, int) or recovery_every < 1:
            raise ValueError(f"FidelityMeter.start: recovery_every must be an int >= 1, got {recovery_every!r}")
        self.max_rows, self._clock, self.recovery_every = rows, clock, recovery_every
        unit = self.unit
        if unit.closed:
            return
        self.on = True
        if self.reads_input and self._hook is None:
            # The hook holds the unit, as a switched unit's forward does: a measuring unit lives until it is closed.
            self._hook = unit.module.register_forward_pre_hook(functools.partial(self._on_input, unit))

    def stop(self) -> None:
        """Turn measuring off and remove the pre-hook (the unit's `close()` does)."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.on, self._clock = False, None

    @property
    def due(self) -> bool:
        """Whether a forward or backward running now measures (training passes only): every step on the cheap path,
        every `recovery_every`-th step in recovery (`in_phase`)."""
        if not (self.on and torch.is_grad_enabled()):
            return False
        return not self.unit.in_recovery or self.in_phase()

    def in_phase(self, step: int | None = None) -> bool:
        """Whether optimizer step `step` (default: this one) is one of the unit's every `recovery_every`-th: the steps
        a unit in recovery measures, and those on which a backend measures what changes only by an optimizer step's
        move (a weight). Always True with `recovery_every` 1 or no clock."""
        if self.recovery_every == 1 or self._clock is None:
            return True
        # The step from the clock, so that a resumed run measures on the steps the uninterrupted one did; each unit
        # at its own phase (from its name: stable across processes), so that units in recovery together take turns.
        step = self._clock() if step is None else step
        return (step + zlib.crc32(self.unit.name.encode())) % self.recovery_every == 0

    @property
    def step(self) -> int:
        """The optimizer step measurements are taken at (from the clock `start` got; 0 without one)."""
        return 0 if self._clock is None else self._clock()

    def rows(self, x: torch.Tensor, count: int | None = None) -> torch.Tensor | None:
        """The rows of `x` (as [-1, x.shape[-1]]) this measurement reads: `count` (default `max_rows`) of them, spread
        (`gnmr_hf.fidelity.spread_rows`); None: all."""
        # The rows depend only on the optimizer step and the measurement's place in the unit's step, so that a
        # resumed run reads the rows the uninterrupted one read, and the units of a step draw the same (one index).
        step = self.step
        if step != self._draw_step:
            self._draw_step, self._draws = step, 0
        self._draws += 1
        draw = step * 64 + self._draws
        n = x.numel() // max(x.shape[-1], 1) if x.dim() else 1
        return spread_rows(n, self.max_rows if count is None else count, draw, x.device)

    def report(self, *parts: Any) -> None:
        """Add one measurement of what the cheap path loses: the worst of `parts`, each an operand's sums
        (`gnmr_hf.fidelity.operand_stats`), probability rows' sums (`row_totals`), a 0-d loss in units of the bound,
        or a `gnmr_hf.fidelity.Pending` one of these, kept on the device (no sync); the losses are computed for every
        unit at once when taken. In recovery a backend reports what its cheap path *would* lose on the same data, so
        that the policy can tell when releasing the unit is safe."""
        if not parts:
            unit = self.unit
            raise ValueError(f"{unit.backend} unit {unit.name!r}: FidelityMeter.report needs at least one part")
        if self._taken is None:
            self._taken = []
        else:
            # A `Pending` part holds sampled rows until the step's batched pass; a unit measured again before it (the
            # next micro-batch under gradient accumulation) finishes the earlier ones now, so that no unit holds
            # more than one measurement's rows.
            for earlier in self._taken:
                earlier[:] = map(resolve, earlier)
        self._taken.append(list(parts))

    def take(self) -> list[list[Any]]:
        """The measurements reported since the last call (lists of parts); resets."""
        taken, self._taken = self._taken or [], None
        return taken

    def take_loss(self) -> torch.Tensor | None:
        """The mean loss of the measurements since the last call (0-d tensor), or None when there was none; resets.
        (`UnitSignals.gather_cheap_loss` takes every unit's at once.)"""
        taken = self.take()
        if not taken:
            return None
        return unit_losses([taken], part_device(taken[0][0]))[0]

    def _on_input(self, unit: MeteredUnit, module: nn.Module, args: Any) -> None:
        if self.due and args and isinstance(args[0], torch.Tensor):
            with torch.no_grad():
                loss = unit.input_fidelity(args[0])
            if loss is not None:
                self.report(loss)

    def __repr__(self) -> str:
        unit = self._unit()
        return (
            f"FidelityMeter({getattr(unit, 'name', '?')!r}, {'on' if self.on else 'off'}, max_rows={self.max_rows}, "
            f"recovery_every={self.recovery_every})"
        )
