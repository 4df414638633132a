"""What a unit's cheap path costs the training loss, estimated online: the *impact* `policy="impact"` ranks by.

A cheap path that changes a unit's output Y by a small `delta` (cheap minus exact) raises the loss by, to second order
with the empirical Fisher standing for the Hessian (ModelOpt's AutoQuantize score, here per training step):

    impact = 0.5 * N * sum over rows r and features j of (dL/dY_rj)^2 * delta_rj^2      (nats per loss token)

where L is the step's loss (a mean over its N tokens, so that N * dL/dY is each token's own gradient) and the sum runs
over the step's rows (tokens) of the unit's output. The score is in the loss's own unit, so units of any backend and
kind rank on one axis, and a budget can be spent where it buys the most loss. A backend whose cheap path is exact in
the forward and lossy in the backward (saved activations at low precision) reports the output change its backward
acts on instead: the gradient it computes is the exact one of a forward through its rounded operands, so training
fits the model to those, at the same second-order cost (docs/method.md, "The impact policy").

An `ImpactMeter` (one per unit, `unit.impact`) schedules and collects it. Off until the callback starts it (the
other policies pay nothing); once on, a unit measures on one optimizer step in `every` (at its `phase`: the units
take turns, so a step measures N / every of them), or at a step it was asked to (`measure_at`: a symptom). Where the
backend holds the exact and the cheap output, it hands the meter `delta` on a spread sample of `rows` rows of the
output (`offer`); a hook on the output then reads the same rows of dL/dY in the backward and adds their weighted
sum, scaled from the sample to all rows. `take()` hands the step's sums to `UnitSignals`, which turns every unit's
into impacts at once. Pure torch, no host sync.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from .fidelity import spread_rows, take_rows

__all__ = ["ImpactMeter", "QuietTurns", "impacts"]


class _MeasuredUnit(Protocol):
    name: str
    backend: str
    closed: bool


@dataclass(frozen=True)
class QuietTurns:
    """A slower rotation for a unit its policy marks *quiet* (`policy="impact"`: its estimate far under what would
    earn it the budget): while `mask[index]` is set, the unit measures on one optimizer step in `every` instead of its
    meter's own `every` (a multiple of it, so a quiet turn is one of the unit's usual turns). `mask` is the policy's
    host array, updated in place once a step from the decision's one transfer: no per-unit work on the host."""

    mask: np.ndarray
    index: int
    every: int


class ImpactMeter:
    """One unit's impact measuring (see the module docstring). A backend reads `due` where it runs the unit's forward,
    picks the rows with `rows(x)` and hands the cheap path's output change on them to `offer(output, delta, index)`.

    Attributes: `on`, `max_rows` (rows of the output a measure reads; 0: all), `every` and `phase` (the unit measures
    at optimizer steps t with (t + phase) % every == 0; while quiet, with (t + phase) % quiet.every == 0), `quiet`
    (a `QuietTurns`, or None: always `every`).
    """

    def __init__(self, unit: _MeasuredUnit) -> None:
        self._unit = weakref.ref(unit)
        self.on = False
        self.max_rows = 0
        self.every = 1
        self.phase = 0
        self.quiet: QuietTurns | None = None
        self._clock: Callable[[], int] | None = None
        self._forced: set[int] = set()
        self._sum: torch.Tensor | None = None
        self._tokens = 0
        self._draw_step, self._draws = -1, 0

    def start(
        self,
        rows: int = 0,
        clock: Callable[[], int] | None = None,
        every: int = 1,
        phase: int = 0,
        quiet: QuietTurns | None = None,
    ) -> None:
        """Turn measuring on: `rows` rows of the output per measure (0: all), on one optimizer step in `every` (from
        `clock()`, the optimizer step) at `phase`; while `quiet` marks the unit, one in `quiet.every`. Idempotent; a
        closed unit stays off."""
        for name, value, low in (("rows", rows, 0), ("every", every, 1), ("phase", phase, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ValueError(f"ImpactMeter.start: {name} must be an int >= {low}, got {value!r}")
        if quiet is not None and (quiet.every < every or quiet.every % every):
            raise ValueError(f"ImpactMeter.start: quiet.every must be a multiple of every={every}, got {quiet.every}")
        self.max_rows, self._clock, self.every, self.quiet = rows, clock, every, quiet
        # Modulo the slower rotation's period, which keeps the phase modulo `every` (a quiet turn is a usual turn).
        self.phase = phase % (every if quiet is None else quiet.every)
        if not self.unit.closed:
            self.on = True

    def stop(self) -> None:
        self.on, self._clock, self.quiet = False, None, None
        self._forced.clear()
        self._sum, self._tokens = None, 0

    @property
    def unit(self) -> _MeasuredUnit:
        unit = self._unit()
        if unit is None:
            raise RuntimeError("ImpactMeter: its unit no longer exists")
        return unit

    @property
    def step(self) -> int:
        return 0 if self._clock is None else self._clock()

    def measure_at(self, step: int) -> None:
        """Measure at optimizer step `step` too, whatever the rotation (a symptom in the unit's family)."""
        self._forced.add(int(step))

    @property
    def due(self) -> bool:
        """Whether a training forward running now measures: at the unit's turn in the rotation, or at a step asked
        for by `measure_at`."""
        if not (self.on and torch.is_grad_enabled()):
            return False
        step = self.step
        if self._forced and min(self._forced) < step:
            self._forced = {s for s in self._forced if s >= step}
        quiet = self.quiet
        every = quiet.every if quiet is not None and quiet.mask[quiet.index] else self.every
        return (step + self.phase) % every == 0 or step in self._forced

    def rows(self, x: torch.Tensor, count: int | None = None) -> torch.Tensor | None:
        """The rows of `x` (as [-1, x.shape[-1]]) a measure reads: `count` (default `max_rows`) of them spread over
        all, moving with the step and the micro-batch (`gnmr_hf.fidelity.spread_rows`), or None: all."""
        step = self.step
        if step != self._draw_step:
            self._draw_step, self._draws = step, 0
        self._draws += 1
        n = x.numel() // max(x.shape[-1], 1) if x.dim() else 1
        return spread_rows(n, self.max_rows if count is None else count, step * 64 + self._draws, x.device)

    def offer(
        self,
        output: torch.Tensor,
        delta: torch.Tensor,
        index: torch.Tensor | None,
        rows_per_token: int = 1,
        in_forward: bool = False,
        also: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Measure on this output: `delta` ([R, F] float32) is the cheap path's change of the rows `index` of
        `output` (as [-1, F]; None: every row). The backward's dL/dY on those rows completes the measure. `also`:
        a second change of the same rows from an error independent of the first (block_fp's weight-gradient input
        rounding beside its forward's), whose square adds to delta's.
        `rows_per_token`: rows of `output` per token (an attention output [B, T, heads, head_dim] has one per head),
        so that N counts tokens, not rows.

        Returns the output the caller hands on. An output that needs no gradient measures nothing, unless the cheap
        path changes the forward (`in_forward`: block_fp, bitsandbytes): its error then reaches the loss all the
        same, as a frozen weight's on an input that needs no gradient does (the first layer's projections under
        LoRA, whose dL/dY flows through the adapter's sum). Such an output comes back as a leaf that takes dL/dY;
        nothing upstream needed a gradient, so nothing else changes. A backward-only cheap path (act_quant's saved
        activations) behind such an output is never read, and costs nothing."""
        if not output.requires_grad:
            if not in_forward:
                return output
            output = output.detach().requires_grad_()
        n_rows = output.numel() // output.shape[-1]
        weight = delta.detach().float().square()
        if also is not None:
            weight = weight + also.detach().float().square()
        output.register_hook(functools.partial(self._on_grad, index, weight, n_rows, rows_per_token))
        return output

    def _on_grad(
        self, index: torch.Tensor | None, weight: torch.Tensor, n_rows: int, per_token: int, grad: torch.Tensor
    ) -> None:
        """The backward's half of a measure: dL/dY on the sampled rows, weighted, scaled to every row, added."""
        g = take_rows(grad.detach(), index).float()
        part = (g.square() * weight).sum() * (n_rows / max(weight.shape[0], 1))
        self._add(part, n_rows // per_token)

    def _add(self, part: torch.Tensor, n_rows: int) -> None:
        self._sum = part if self._sum is None else self._sum + part
        self._tokens += n_rows

    def offer_weighted(self, loss: torch.Tensor, weighted: torch.Tensor, n_rows: int, sampled: int) -> None:
        """Measure where the backend has dL/dY itself (a loss it computes): `weighted` (0-d) is the sum over
        `sampled` of the output's `n_rows` rows of (dL/dY)^2 delta^2 for a gradient of `loss` of 1; the gradient
        `loss` gets in the backward (accumulation's or a loss scaler's factor) multiplies dL/dY, so its square
        multiplies the sum."""
        if not loss.requires_grad:
            return
        part = weighted.detach().float() * (n_rows / max(sampled, 1))
        loss.register_hook(functools.partial(self._on_loss_grad, part, n_rows))

    def _on_loss_grad(self, part: torch.Tensor, n_rows: int, grad: torch.Tensor) -> None:
        self._add(part * grad.detach().float().square().reshape(()), n_rows)

    def take(self) -> tuple[torch.Tensor, int] | None:
        """(sum over the step's rows of (dL/dY)^2 delta^2, 0-d float32; the rows it covers), or None: no measure
        this step. Resets."""
        if self._sum is None:
            return None
        taken, self._sum, self._tokens = (self._sum, self._tokens), None, 0
        return taken

    def __repr__(self) -> str:
        unit = self._unit()
        return (
            f"ImpactMeter({getattr(unit, 'name', '?')!r}, {'on' if self.on else 'off'}, max_rows={self.max_rows}, "
            f"every={self.every}, phase={self.phase}"
            f"{'' if self.quiet is None else f', quiet_every={self.quiet.every}'})"
        )


def impacts(taken: list[tuple[torch.Tensor, int] | None], device: torch.device, scale: Any = None) -> torch.Tensor:
    """[N] float32 impacts (nats per token) from each unit's `ImpactMeter.take()`, NaN where a unit measured
    nothing: 0.5 * N * S with S the unit's weighted sum and N the rows it covers (the step's loss tokens; rows
    without a loss token make it an overestimate, the same for every unit). `scale`: the fp16 loss scale the
    gradients carried (a tensor or float), divided out squared."""
    n = len(taken)
    present = [i for i, t in enumerate(taken) if t is not None]
    out = torch.full((n,), torch.nan, dtype=torch.float32, device=device)
    if not present:
        return out
    sums = torch.stack([taken[i][0].to(device) for i in present])  # type: ignore[index]
    tokens = torch.tensor([float(taken[i][1]) for i in present], device=device)  # type: ignore[index]
    values = 0.5 * tokens * sums
    if scale is not None:
        values = values / torch.as_tensor(scale, device=device).float().square()
    return out.index_put_((torch.tensor(present, device=device),), values.float())
