"""When a step's norms are read in the Trainer, and whether the step then happened.

Once per optimizer step, at the end of the outermost backward pass of the last micro-batch: after gradient
accumulation and DDP/FSDP reductions, before the Trainer clips (clipping rescales every unit at once and would hide
a spike); under DeepSpeed ZeRO just before its optimizer step, where its reduced gradients exist. With an fp16 loss
scaler the norms are unscaled on the device, and a step the scaler skips is reported so that the controller never
sees it. Why each happens where it does: docs/method.md, "The signal".
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from .integrations.deepspeed import DeepSpeedZero
from .signals import UnitSignals

__all__ = ["StepCapture", "data_parallel_group"]


class StepCapture:
    """Reads `signals` once per optimizer step of a Trainer run on `model` (see the module docstring).

    `take()` hands over the step's (norms, missing, cheap_loss), `take_impact()` its impacts, and
    `skipped(optimizer)` whether the fp16 loss scaler skipped the step; `pending` (and `pending_cheap_loss`,
    `pending_impact`) hold what was read until then, `scaler` the active fp16 loss scaler (None without one).
    `remove()` takes the hooks off.
    """

    def __init__(
        self,
        signals: UnitSignals,
        model: nn.Module,
        optimizer: Any,
        zero: DeepSpeedZero | None = None,
        units: Sequence[Any] = (),
    ) -> None:
        self.signals = signals
        self.scaler = _loss_scaler(optimizer)
        self.pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self.pending_cheap_loss: torch.Tensor | None = None  # read with the norms, where units measure it
        self.pending_impact: torch.Tensor | None = None  # likewise, under policy="impact"
        self._scale_at_capture: torch.Tensor | None = None
        self._queued = False
        self._gradient_state = _gradient_state()
        if zero is not None:
            # DeepSpeed ZeRO: the reduced gradients exist only just before its optimizer step, read there.
            def sink(norms: torch.Tensor, missing: torch.Tensor) -> None:
                self.pending, self.pending_cheap_loss = (norms, missing), signals.gather_cheap_loss()
                self.pending_impact = signals.gather_impact()

            self._hooks = [zero.install(units, sink)]
        else:
            self._hooks = [model.register_forward_hook(self._on_model_forward)]

    def take(self, num_units: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The step's (norms float32 [N], missing bool [N], cheap_loss or None), and ready for the next step; every
        unit missing when no backward reached the model's outputs this step. The step's impacts (or None) are
        `take_impact()`'s."""
        pending, self.pending = self.pending, None
        cheap_loss, self.pending_cheap_loss = self.pending_cheap_loss, None
        self._queued = False
        if pending is None:
            pending = (
                torch.full((num_units,), torch.nan, device=device),
                torch.ones(num_units, dtype=torch.bool, device=device),
            )
        return pending[0], pending[1], cheap_loss

    def take_impact(self) -> torch.Tensor | None:
        """The step's impacts ([N] float32, nats per token, NaN where unmeasured; None: no unit measures)."""
        impact, self.pending_impact = self.pending_impact, None
        return impact

    def skipped(self, optimizer: Any) -> torch.Tensor | None:
        """A bool scalar on the device: did the fp16 loss scaler skip this step? None without a scaler.

        `GradScaler.update()` lowers the scale exactly when it found inf/NaN gradients and skipped the step, so the
        comparison with the scale the backward pass used is exact and needs no sync; it travels with the
        decision's one transfer. (accelerate's `optimizer.step_was_skipped` misses the skips of fused optimizers,
        the Trainer's default, which skip inside their own kernel.)
        """
        if self.scaler is None or self._scale_at_capture is None:
            return None
        skipped = _loss_scale(self.scaler) < self._scale_at_capture
        if getattr(optimizer, "step_was_skipped", False):
            skipped = torch.ones_like(skipped)
        self._scale_at_capture = None
        return skipped.reshape(())

    def remove(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        self.pending, self.pending_cheap_loss, self.pending_impact, self._queued = None, None, None, False

    def _on_model_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        if not torch.is_grad_enabled():
            return
        for tensor in _output_tensors(output):
            if tensor.requires_grad:
                tensor.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        # Runs at the start of the outermost backward pass through the model (its outputs' gradients come first).
        if self._queued or not self._gradient_state.sync_gradients:
            return
        self._queued = True
        # The engine runs queued callbacks after the whole pass, in queue order, including callbacks queued while
        # they run: queueing from inside one puts our read after every end-of-backward callback queued during
        # the pass (DDP's averaging once the last bucket is ready), and still before any clipping.
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._read))

    def _read(self) -> None:
        norms, missing = self.signals.compute()
        scale = None
        if self.scaler is not None:
            # Gradients are still multiplied by the loss scale here (the Trainer unscales them when it clips).
            scale = _loss_scale(self.scaler)
            norms = norms / scale.to(norms.device)
            self._scale_at_capture = scale.clone()
        self.pending, self.pending_cheap_loss = (norms, missing), self.signals.cheap_loss
        self.pending_impact = self.signals.gather_impact(scale)
        self._queued = False


def data_parallel_group() -> Any:
    """The group over which ranks train on different data (all of them under the Trainer's DDP or FSDP), or None
    in one process. Output-gradient meters are summed over it so that every rank decides the same."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        if torch.distributed.get_world_size() > 1:
            return torch.distributed.group.WORLD
    return None


def _output_tensors(output: Any) -> list[torch.Tensor]:
    """The top-level tensors of a model's output (a tensor, a ModelOutput / dict, or a tuple)."""
    if isinstance(output, torch.Tensor):
        return [output]
    values = output.values() if isinstance(output, Mapping) else output if isinstance(output, (tuple, list)) else ()
    return [v for v in values if isinstance(v, torch.Tensor)]


def _loss_scaler(optimizer: Any) -> Any:
    """The optimizer's fp16 loss scaler (accelerate's `AcceleratedOptimizer.scaler`), if one is active.

    Found on the optimizer rather than from `args.fp16`, because fp16 can also come from `accelerate launch
    --mixed_precision fp16` or ACCELERATE_MIXED_PRECISION (then `args.mixed_precision == "fp16"` and
    `args.fp16` is False), and on a CPU accelerate runs fp16 without a scaler.
    """
    scaler = getattr(optimizer, "scaler", None)
    return scaler if scaler is not None and scaler.is_enabled() else None


def _loss_scale(scaler: Any) -> torch.Tensor:
    # `GradScaler.get_scale()` returns a Python float, i.e. a device sync; the scale tensor itself is private
    # (`_scale`) but stable across torch 2.x, and is set by the time a scaled backward has run.
    scale = getattr(scaler, "_scale", None)
    if not isinstance(scale, torch.Tensor):
        raise RuntimeError("GNMRCallback: the fp16 loss scaler has no scale tensor after a scaled backward pass")
    return scale


def _gradient_state() -> Any:
    # accelerate's GradientState is a process-wide singleton; the Trainer sets `sync_gradients` before each
    # micro-batch (True on the last one of the accumulation window). Without accelerate state, every backward
    # counts as final.
    from accelerate.state import GradientState

    return GradientState()
