"""act_quant's `linear` kind: an `nn.Linear` whose input, saved for the weight gradient, is kept at the unit's bits."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ...fidelity import take_rows
from .base import _operand_parts, _SwitchedSaves
from .saving import SaveCache, SaveSpec


class QuantSavedLinear(torch.autograd.Function):
    """`F.linear(x, weight, bias)` whose saved input is stored as `spec` says; the gradients use that copy.

    Autocast: the forward's matmul runs as autocast makes it (e.g. bf16), and the backward's matmuls run in the same
    dtype, as the built-in linear's would; gradients come back in the inputs' own dtypes.
    """

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: SaveSpec,
        cache: SaveCache | None = None,
    ) -> torch.Tensor:
        out = F.linear(x, weight, bias)
        ctx.compute_dtype = out.dtype
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        # The input is needed only for the weight gradient; with a frozen weight nothing is saved.
        saved, ctx.meta = spec.save(x, cache) if ctx.needs_input_grad[1] else ((), None)
        ctx.save_for_backward(*saved, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *saved, weight = ctx.saved_tensors
        dtype = ctx.compute_dtype
        g = grad_out.to(dtype)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.to(dtype)).to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            x_hat = SaveSpec.restore(tuple(saved), ctx.meta).to(dtype)
            grad_w = (g.reshape(-1, g.shape[-1]).t() @ x_hat.reshape(-1, x_hat.shape[-1])).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = g.reshape(-1, g.shape[-1]).sum(0).to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None


class ActQuantLinearUnit(_SwitchedSaves):
    """One `nn.Linear` whose saved input is kept at `low_bits` on the cheap path and `high_bits` in recovery."""

    kind = "linear"
    measures_impact = True
    fidelity_bound = "saved input at low_bits: relative L2 error / 2"

    def saving_forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        training = torch.is_grad_enabled() and m.weight.requires_grad
        if training:
            self.count_recovery_bytes(x)
        out = QuantSavedLinear.apply(x, m.weight, m.bias, self.current_spec(), self._cache)
        if training and self.impact.due:
            self._offer_impact(x, out)
        if training and self.meter.due:
            # After the save: on the cheap path the cache holds the copy saved, whose scale the measure reuses. The
            # relative error only: the copy feeds only the weight-gradient GEMM, which sums over tokens, not along
            # the rows the bias is taken over (docs/method.md, "Fidelity").
            self.meter.report(*_operand_parts(self, self.cheap_spec(), self._cache, (x,), bias=False))
        return out

    @torch.no_grad()
    def _offer_impact(self, x: torch.Tensor, out: torch.Tensor) -> None:
        """The output change the backward acts on: its weight gradient is the exact one of a forward through the
        rounded input, so the change is (x_rounded - x) W^T on the impact meter's rows (`gnmr_hf.impact`)."""
        index = self.impact.rows(x)
        exact = take_rows(x.detach(), index).float()
        rounded = self.cheap_spec().restore_rows(x, index, self._cache).float()
        self.impact.offer(out, (rounded - exact) @ self.module.weight.detach().float().t(), index)
