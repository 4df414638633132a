"""Each GEMM input of a block_fp Linear in a format of its own, for the benchmarks that set them apart.

    formats = OperandFormats(x=low, w=low, g=high)  # the output gradient high, the input and weight low
    unit.low = formats  # a BlockFPUnit's cheap path, as an experiment may replace it

`benchmarks/head_gemm_split.py` sets the output head's inputs apart, `benchmarks/operand_split.py` every unit's (or
some units'). `check_operand_routing` fails if `BlockFPLinear` no longer rounds each input through the method this
routes it by.
"""

from __future__ import annotations

import dataclasses

import torch

from ..backends.block_fp import GemmFormat, block_fp_linear

__all__ = ["OperandFormats", "check_operand_routing"]


@dataclasses.dataclass(frozen=True)
class OperandFormats:
    """A `GemmFormat` per GEMM input of one Linear: its input `x` (fprop and wgrad), its weight `w` (fprop and dgrad)
    and its output gradient `g` (dgrad and wgrad), for `BlockFPLinear`, which rounds the input through
    `input_operand`, the weight through `operand(..., weight=True)` and the output gradient through `grad_operand`
    (checked by `check_operand_routing`)."""

    x: GemmFormat
    w: GemmFormat
    g: GemmFormat

    @property
    def fmt(self) -> str:
        return f"x={self.x.fmt};w={self.w.fmt};g={self.g.fmt}"

    @property
    def scaling(self) -> str:
        return self.x.scaling

    def operand(self, t: torch.Tensor, contract: int, *, weight: bool = False) -> torch.Tensor:
        return (self.w if weight else self.g).operand(t, contract, weight=weight)

    def input_operand(self, x2: torch.Tensor, contract: int) -> torch.Tensor:
        return self.x.input_operand(x2, contract)

    def grad_operand(self, g2: torch.Tensor, contract: int) -> torch.Tensor:
        return self.g.grad_operand(g2, contract)


def check_operand_routing(low: GemmFormat, high: GemmFormat) -> None:
    """Fail unless `BlockFPLinear` rounds each GEMM input through the method `OperandFormats` routes it by: the
    gradients with only G high are those computed by hand from G high and x, W low."""
    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(160, 128, generator=g), torch.randn(96, 128, generator=g), torch.randn(160, 96, generator=g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = block_fp_linear(xr, wr, None, OperandFormats(low, low, high))
    y.backward(dy)
    xq, wq = low.operand(x, 1), low.operand(w, 1, weight=True)
    expected = (
        xq @ wq.t(),
        high.operand(dy, 1) @ low.operand(w, 0, weight=True),
        high.operand(dy, 0).t() @ low.operand(x, 0),
    )
    for name, got, want in zip(("output", "input grad", "weight grad"), (y, xr.grad, wr.grad), expected, strict=True):
        if not torch.equal(got.detach(), want):
            raise RuntimeError(f"BlockFPLinear no longer rounds its GEMM inputs as OperandFormats assumes ({name})")
