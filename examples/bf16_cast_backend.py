"""A backend of your own, in one file: every `nn.Linear` (but the output head) computed in bfloat16 on the cheap
path and in its own dtype (float32) in recovery. Register it, then use it by name:

    import bf16_cast_backend  # runs register_backend(BF16_CAST)
    trainer.add_callback(GNMRCallback(GNMRConfig(backend="bf16_cast", backend_options="low_dtype=float16")))
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gnmr_hf import Backend, DispatchContext, RecoverableUnit, SignalOptions, SwitchedUnit, register_backend
from gnmr_hf.fidelity import OperandStats, operand_stats, take_rows

LOW_DTYPES = ("bfloat16", "float16")


@dataclass
class CastOptions(SignalOptions):
    low_dtype: str = field(default="bfloat16", metadata={"help": f"The cheap path's dtype: one of {LOW_DTYPES}."})

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("low_dtype", LOW_DTYPES)


class CastUnit(SwitchedUnit):
    """The cheap path casts input, weight and bias to `low_dtype`; recovery is the plain `F.linear`."""

    fidelity_bound = "input cast to low_dtype: max(relative L2 error / 2, row-sum bias / 0.1)"

    def describe(self) -> dict[str, Any]:
        # Counted in the train-begin log and the trace header; precision() reads "formats" (e.g. "bfloat16/float32").
        recovery = str(self.module.weight.dtype).removeprefix("torch.")
        return {**super().describe(), "formats": f"{self.options.low_dtype}/{recovery}"}

    def input_fidelity(self, x: torch.Tensor) -> OperandStats:
        # policy="cause" only: what the cast loses on a sample of the input's rows, measured on both paths.
        rows = take_rows(x, self.meter.rows(x))
        return operand_stats(rows, rows.to(getattr(torch, self.options.low_dtype)))

    def cheap_forward(self, x: torch.Tensor) -> torch.Tensor:
        low = getattr(torch, self.options.low_dtype)
        w, b = self.module.weight, self.module.bias
        return F.linear(x.to(low), w.to(low), None if b is None else b.to(low)).to(x.dtype)

    def recovery_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.module.weight, self.module.bias)


def cast_unit(module: nn.Module, ctx: DispatchContext) -> type[RecoverableUnit] | None:
    get_head = getattr(ctx.model, "get_output_embeddings", None)
    head = get_head() if callable(get_head) else None
    return CastUnit if isinstance(module, nn.Linear) and module is not head else None


BF16_CAST = register_backend(
    Backend(name="bf16_cast", unit_for=cast_unit, options=CastOptions, hint="bf16_cast manages nn.Linear layers.")
)
