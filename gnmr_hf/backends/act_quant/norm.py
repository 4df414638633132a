"""act_quant's `norm` kind: an RMSNorm whose input is saved at the unit's bits, with its exact per-row `rstd`."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...units import DispatchContext
from .base import _operand_parts, _SwitchedSaves
from .saving import SaveCache, SaveSpec


class QuantSavedRMSNorm(torch.autograd.Function):
    """An RMSNorm, `weight * (x * rstd).to(x.dtype)` with `rstd = rsqrt(mean(x^2) + eps)` in float32, computed by the
    module's own `forward` (bit for bit); saves `x` as `spec` says and the exact float32 `rstd` (one per row). The
    backward uses the restored `x` with the exact `rstd`: a row of `x` rounded to zeros does not blow up its scale."""

    @staticmethod
    def forward(
        ctx: Any,
        forward: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        spec: SaveSpec,
        cache: SaveCache | None,
    ) -> torch.Tensor:
        out = forward(x)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        saved, ctx.meta = spec.save(x, cache)
        ctx.count = len(saved)
        ctx.save_for_backward(*saved, rstd, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *saved, rstd, weight = ctx.saved_tensors
        x = SaveSpec.restore(tuple(saved), ctx.meta)
        y = (x.float() * rstd).to(x.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[2]:
            grad_w = (grad_out * y).reshape(-1, y.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[1]:
            dy = (grad_out * weight).float()
            y32 = x.float() * rstd
            grad_x = (rstd * (dy - y32 * (dy * y32).mean(-1, keepdim=True))).to(x.dtype)
        return None, grad_x, grad_w, None, None, None


class ActQuantNormUnit(_SwitchedSaves):
    """One RMSNorm module (LLaMA's `LlamaRMSNorm`: `weight * x / rms(x)`) whose input is saved at `low_bits` /
    `high_bits` instead of what its ops keep (the input and the normalized copy), with its exact per-row `rstd`.
    Signal: its own weight's gradient (`signal=`)."""

    kind = "norm"
    fidelity_bound = "saved input at low_bits: max(relative L2 error / 2, row-sum bias / 0.1)"

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext) -> None:
        self.eps = _check_rms_norm(name, module)
        super().__init__(name, module, ctx)

    def saving_forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module.weight
        if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return self._module_forward(x)
        self.count_recovery_bytes(x)
        out = QuantSavedRMSNorm.apply(self._module_forward, x, weight, self.eps, self.current_spec(), self._cache)
        if self.meter.due:  # after the save: the measure reuses the saved copy's scale
            self.meter.report(*_operand_parts(self, self.cheap_spec(), self._cache, (x,)))
        return out


def _check_rms_norm(name: str, module: nn.Module) -> float:
    """The module's epsilon, after checking on a probe row that it computes LLaMA's RMSNorm (Gemma's `1 + weight`
    or a LayerNorm would get wrong gradients from `QuantSavedRMSNorm`). The probe runs with a weight of its own
    (`functional_call`), so a sharded or offloaded weight is neither read nor gathered."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if isinstance(eps, float) and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        n = weight.shape[0]
        x, w = torch.linspace(-2.0, 3.0, n), torch.linspace(0.5, 1.5, n)
        with torch.no_grad():
            out = torch.func.functional_call(module, {"weight": w}, (x,))
        if torch.allclose(out, w * x * torch.rsqrt(x.pow(2).mean() + eps), rtol=1e-4, atol=1e-6):
            return eps
    raise ValueError(
        f"act_quant norm unit {name!r}: {type(module).__name__} does not compute LLaMA's RMSNorm, "
        "weight * x * rsqrt(mean(x^2) + eps) with eps in variance_epsilon or eps; exclude it or drop 'norm' from kinds"
    )


def _is_norm(module: nn.Module) -> bool:
    """A leaf module whose class is named `*RMSNorm` (transformers' RMSNorms; `ActQuantNormUnit` checks the math)."""
    return type(module).__name__.endswith("RMSNorm") and next(module.children(), None) is None
