"""act_quant's `mlp` kind: a SwiGLU MLP whose product saves its operands (the gate and up projections' outputs) at
the unit's bits, recomputing the activation in the backward from the restored copies."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...signals import Signal, adapter_tensors
from ...units import DispatchContext
from .base import _operand_parts, _SwitchedSaves
from .saving import SaveCache, SaveSpec


class QuantSavedRecompute(torch.autograd.Function):
    """`fn(*inputs)` computed exactly, whose inputs are saved as `spec` says; the backward recomputes `fn` on the
    restored copies under autograd (activation checkpointing from a quantized checkpoint). For a cheap elementwise
    `fn` (SwiGLU's `act_fn(g) * u`), next to the GEMMs around it; the recompute runs under the forward's autocast.
    """

    @staticmethod
    def forward(ctx: Any, fn: Any, spec: SaveSpec, cache: SaveCache | None, *inputs: torch.Tensor) -> torch.Tensor:
        # Grad mode is off here: the module's own computation, bit for bit.
        out = fn(*inputs)
        saved: list[torch.Tensor] = []
        ctx.metas, ctx.counts = [], []
        for x in inputs:
            packed, meta = spec.save(x, cache)
            saved += packed
            ctx.metas.append(meta)
            ctx.counts.append(len(packed))
        ctx.fn = fn
        device = inputs[0].device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tensors = list(ctx.saved_tensors)
        inputs = []
        for i, (count, meta) in enumerate(zip(ctx.counts, ctx.metas, strict=True)):
            x = SaveSpec.restore(tuple(tensors[:count]), meta).detach()
            inputs.append(x.requires_grad_(ctx.needs_input_grad[3 + i]))
            del tensors[:count]
        wanted = [x for x in inputs if x.requires_grad]
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        if wanted:
            device, dtype, enabled = ctx.autocast
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                out = ctx.fn(*inputs)
            found = iter(torch.autograd.grad(out, wanted, grad_out))
            grads = [next(found) if x.requires_grad else None for x in inputs]
        return None, None, None, *grads


class ActQuantMLPUnit(_SwitchedSaves):
    """One SwiGLU MLP (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, LLaMA's `LlamaMLP`) whose product saves its
    operands, the gate and up projections' outputs, at `low_bits` / `high_bits`; the backward recomputes `act_fn`
    from the saved gate output. The projections themselves are `linear` units (or plain Linears). Signal: the
    gradients of its gate and up projections' LoRA adapters, else weights (the nearest trainable tensors the saved
    operands feed), else of its output."""

    kind = "mlp"
    fidelity_bound = (
        "saved gate and up outputs at low_bits: the worst of max(relative L2 error / 2, row-sum bias / 0.1)"
    )

    def find_signal(self, ctx: DispatchContext) -> Signal:
        # The LoRA adapters of the projections when they have some, else their trainable weights, else (a frozen
        # MLP, nothing of its own to score) the gradient of the MLP's output.
        projections = [getattr(self.module, p) for p in ("gate_proj", "up_proj")]
        tuners = [ctx.tuner(getattr(m, "base_layer", m)) for m in projections]
        lora = [t for tuner in tuners if tuner is not None for t in adapter_tensors(tuner)]
        if lora:
            return Signal("gate_up_lora", lora)
        weights = [m.weight for m in projections if m.weight.requires_grad]
        return Signal("gate_up_weight", weights) if weights else Signal("output_grad", [])

    def _product(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.module.act_fn(gate) * up

    def saving_forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        gate, up = m.gate_proj(x), m.up_proj(x)
        if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
            return m.down_proj(self._product(gate, up))
        self.count_recovery_bytes(gate, up)
        product = QuantSavedRecompute.apply(self._product, self.current_spec(), self._cache, gate, up)
        if self.meter.due:  # after the save: the measure reuses the saved copies' scales
            self.meter.report(*_operand_parts(self, self.cheap_spec(), self._cache, (gate, up)))
        return m.down_proj(product)


def _is_swiglu_mlp(module: nn.Module) -> bool:
    """A gated MLP of the LLaMA family: gate/up/down projections and an `act_fn`."""
    return callable(getattr(module, "act_fn", None)) and all(
        isinstance(getattr(module, p, None), nn.Module) for p in ("gate_proj", "up_proj", "down_proj")
    )
