"""torchao backend: `torchao_float8`, a `Float8Linear` on the cheap path, the plain high-precision matmul in recovery.

torchao fixes which linears train in FP8 at conversion (`module_filter_fn`); this backend makes that choice at run
time: convert every candidate linear, and GNMR moves the riskiest few back to `F.linear` on the same master weight.
A flip copies and writes nothing (0 bytes in the ledger). Details and torch.compile costs: docs/backends.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..fidelity import OperandStats, loss_of, operand_stats, take_rows
from ..signals import SignalOptions, signal_option
from ..units import Backend, DispatchContext, RecoverableUnit, SwitchedUnit

__all__ = ["BACKENDS", "TORCHAO_FLOAT8", "Float8Options", "Float8Unit"]


@dataclass
class Float8Options(SignalOptions):
    """Options of the `torchao_float8` backend."""

    signal: str = signal_option("its master weight")


class Float8Unit(SwitchedUnit):
    """One torchao `Float8Linear`: its FP8 matmuls on the cheap path, `F.linear` on the same master weight in
    recovery, in autocast's dtype under autocast (as the unconverted `nn.Linear`), else the weight's."""

    fidelity_bound = (
        "input cast to float8 e4m3 as the default (tensorwise) recipe casts it, emulated: max(relative L2 error / 2, "
        "row-sum bias / 0.1); a rowwise recipe is measured per row"
    )

    def precision(self) -> str:
        return "float8/high"

    def input_fidelity(self, x: torch.Tensor) -> OperandStats:
        rowwise = "AXISWISE" in str(getattr(self.module.config.cast_config_input, "scaling_granularity", ""))
        return float8_input_stats(x, rowwise, self.meter.rows(x))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "emulate": bool(self.module.config.emulate)}

    def recovery_forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        if torch.is_autocast_enabled(x.device.type):
            dtype = out_dtype = torch.get_autocast_dtype(x.device.type)
        else:
            # Float8Linear accepts an input of another dtype and returns that dtype; F.linear does not.
            dtype, out_dtype = weight.dtype, x.dtype
        # The casts are no-ops in the usual case; autograd carries the gradient through them to the master weight.
        out = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
        return out.to(out_dtype)


def float8_input_loss(x: torch.Tensor, rowwise: bool = False, index: torch.Tensor | None = None) -> torch.Tensor:
    """`operand_loss` of a float8 e4m3 cast with absmax scaling (one scale per tensor, from all of `x`, or per
    row), on the rows `index` (all when None)."""
    return loss_of(float8_input_stats(x, rowwise, index))


def float8_input_stats(x: torch.Tensor, rowwise: bool = False, index: torch.Tensor | None = None) -> OperandStats:
    """The `operand_stats` behind `float8_input_loss`."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    rows = take_rows(x2, index).float()
    amax = rows.abs().amax(dim=1, keepdim=True) if rowwise else x2.abs().amax().float()
    top = torch.finfo(torch.float8_e4m3fn).max
    scale = torch.where(amax > 0, top / amax.clamp_min(1e-12), 1.0)
    rounded = (rows * scale).clamp(-top, top).to(torch.float8_e4m3fn).float() / scale
    return operand_stats(rows, rounded)


def _float8_unit(module: nn.Module, ctx: DispatchContext) -> type[RecoverableUnit] | None:
    from torchao.float8.float8_linear import Float8Linear

    return Float8Unit if isinstance(module, Float8Linear) else None


TORCHAO_FLOAT8 = Backend(
    name="torchao_float8",
    unit_for=_float8_unit,
    options=Float8Options,
    requires="torchao",
    hint=(
        "The torchao_float8 backend manages torchao Float8Linear layers: convert the model for float8 training "
        "first, torchao.float8.convert_to_float8_training(model, config=Float8LinearConfig(...), "
        "module_filter_fn=...) (pip install gnmr-hf[torchao]), or choose the backend that matches the model's "
        "low-precision layers (GNMRConfig.backend): bitsandbytes Linear8bitLt is 'bnb_int8', Linear4bit 'bnb_4bit'."
    ),
)

BACKENDS = (TORCHAO_FLOAT8,)
