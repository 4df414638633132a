"""Fault injection for benchmarks and tests: a blown-up quantization scale on one unit's cheap path.

    inject_fault(unit, 30.0, stride=16)  # from its next forward on, every 16th token's copy reads 30x its value
    clear_fault(unit)

The library's numerics know nothing of faults: this module installs one through the seam each backend has for an
experiment. `act_quant`: a `ScaleFault` as the unit's `scale_transform`, so that every `stride`-th scale its cheap
path stores is `scale` times too large (every such row of an unquantized copy). `block_fp`: a `FaultyGemmFormat` as
the unit's `low`, whose rounded copy of the Linear's input (the fprop and wgrad GEMMs) or, with `operand="grad"`, of
its output gradient (the dgrad and wgrad GEMMs) reads `scale` times its value on every `stride`-th token, as a
blown-up scale of those tokens' tiles would make it. Either way only the cheap path is corrupted (the recovery
path's copy is correct), and the unit's fidelity measure reads the faulty copy on both paths: that is how the cause
policy sees a fault. `benchmarks/fault_injection.py` schedules faults during pretraining.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..backends.block_fp import BlockFPUnit, GemmFormat
from ..units import RecoverableUnit

__all__ = ["OPERANDS", "FaultyGemmFormat", "ScaleFault", "clear_fault", "inject_fault"]

# What a block_fp fault corrupts: the Linear's input, or its output gradient.
OPERANDS = ("input", "grad")


def _check_stride(where: str, stride: int) -> None:
    if isinstance(stride, bool) or not isinstance(stride, int) or stride < 1:
        raise ValueError(f"{where} must be an int >= 1, got {stride!r}")


def _scaled_at(values: torch.Tensor, index: torch.Tensor, scale: float, stride: int) -> torch.Tensor:
    """`values` (a copy) whose entries at positions `index` (its leading dimensions) that are a multiple of `stride`
    read `scale` times their value."""
    hit = (index % stride == 0).reshape(*index.shape, *([1] * (values.dim() - index.dim())))
    return torch.where(hit, values * scale, values)


@dataclass(frozen=True)
class ScaleFault:
    """An act_quant `SaveSpec.scale_transform`: every `stride`-th scale a copy stores is `scale` times too large."""

    scale: float
    stride: int = 1

    def __post_init__(self) -> None:
        _check_stride("ScaleFault.stride", self.stride)

    def __call__(self, scales: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        if self.scale == 1.0:
            return scales
        if index is not None:
            return _scaled_at(scales, index, self.scale, self.stride)
        scales = scales.clone()
        scales[:: self.stride] *= self.scale
        return scales


@dataclass(frozen=True)
class FaultyGemmFormat(GemmFormat):
    """A block_fp `GemmFormat` whose rounded copy of `fault_operand` ("input" or "grad") reads `fault_scale` times
    its value on every `fault_stride`-th token (1.0: no fault)."""

    fault_scale: float = 1.0
    fault_stride: int = 1
    fault_operand: str = "input"

    def __post_init__(self) -> None:
        _check_stride("FaultyGemmFormat.fault_stride", self.fault_stride)
        if self.fault_operand not in OPERANDS:
            raise ValueError(f"FaultyGemmFormat.fault_operand must be one of {OPERANDS}, got {self.fault_operand!r}")

    def input_operand(self, x2: torch.Tensor, contract: int) -> torch.Tensor:
        return self._faulty(super().input_operand(x2, contract), "input")

    def grad_operand(self, g2: torch.Tensor, contract: int) -> torch.Tensor:
        return self._faulty(super().grad_operand(g2, contract), "grad")

    def input_rows(self, x_rows: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        return self.fault_rows(super().input_rows(x_rows, index), index)

    def grad_rows(self, g_rows: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        return self.fault_rows(super().grad_rows(g_rows, index), index, "grad")

    def _faulty(self, rounded: torch.Tensor, operand: str) -> torch.Tensor:
        if self.fault_scale != 1.0 and operand == self.fault_operand:
            rounded[:: self.fault_stride] *= self.fault_scale  # `operand` returns a fresh tensor
        return rounded

    def fault_rows(self, rows_q: torch.Tensor, index: torch.Tensor | None, operand: str = "input") -> torch.Tensor:
        """The fault of `input_operand` (`operand` "input") or `grad_operand` ("grad") on `rows_q`, the rounded
        rows `index` of that operand (all rows when None), so that rows rounded apart read what the whole copy reads
        there."""
        if self.fault_scale == 1.0 or operand != self.fault_operand:
            return rows_q
        if index is None:
            index = torch.arange(len(rows_q), device=rows_q.device)
        return _scaled_at(rows_q, index, self.fault_scale, self.fault_stride)


def inject_fault(unit: RecoverableUnit, scale: float, stride: int = 1, operand: str = "input") -> None:
    """Corrupt `unit`'s cheap path from its next forward on, until `clear_fault` (`scale` 1.0: clear it now).
    `operand`: "grad" corrupts a block_fp unit's output gradient instead of its input."""
    if isinstance(unit, BlockFPUnit):
        # The unit's recipe (format, scaling, NVFP4's parts) stays; only the fault changes.
        recipe = {f.name: getattr(unit.low, f.name) for f in fields(GemmFormat)}
        fmt = FaultyGemmFormat(**recipe, fault_scale=float(scale), fault_stride=stride, fault_operand=operand)
        unit.low = fmt if scale != 1.0 else GemmFormat(**recipe)
    elif hasattr(unit, "scale_transform"):  # every act_quant unit kind
        if operand != "input":
            raise ValueError(
                f"inject_fault: an act_quant unit's fault is on its saved copy ('input'), got {operand!r}"
            )
        fault = ScaleFault(float(scale), stride)
        unit.scale_transform = fault if scale != 1.0 else None
    else:
        raise TypeError(f"inject_fault: {type(unit).__name__} {unit.name!r} is not an act_quant or block_fp unit")


def clear_fault(unit: RecoverableUnit) -> None:
    """Give `unit`'s cheap path its correct copies back."""
    inject_fault(unit, 1.0)
