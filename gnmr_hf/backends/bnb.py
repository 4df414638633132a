"""bitsandbytes backends: a quantized linear on the cheap path, a BF16 matmul in recovery.

`bnb_int8` manages `bnb.nn.Linear8bitLt` (LLM.int8()), `bnb_4bit` manages `bnb.nn.Linear4bit` (QLoRA NF4/FP4),
bare or as the base layer of a peft LoRA layer. The cheap path is the module's own forward; recovery is a BF16
`F.linear` (autocast off) on a weight that exists only while the unit is in recovery, read from the original
checkpoint (exact) or rebuilt by bitsandbytes' own dequantizer. The quantized weight is never written. Sources,
error bounds, the one-row checkpoint check and the limits: docs/backends.md.
"""

from __future__ import annotations

import logging
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..fidelity import OperandStats, loss_of, operand_stats, take_rows
from ..signals import SignalOptions
from ..units import Backend, DispatchContext, RecoverableUnit, SwitchedUnit
from ._checkpoint import CheckpointSource

__all__ = ["BACKENDS", "BNB_4BIT", "BNB_INT8", "Bnb4bitUnit", "BnbInt8Unit", "BnbOptions", "BnbUnit"]

logger = logging.getLogger("gnmr_hf")

SOURCES = ("auto", "checkpoint", "dequantize")
_RECOVERY_DTYPE = torch.bfloat16
# 4-bit row check slack: one code in this many may differ (a rounding tie settled by another kernel).
_CODE_MISMATCH_DIVISOR = 64


@dataclass
class BnbOptions(SignalOptions):
    """Options of the bitsandbytes backends."""

    source: str = field(
        default="auto",
        metadata={
            "help": "Where the BF16 recovery weight comes from: 'checkpoint' (the model's local safetensors), "
            "'dequantize' (the quantized weight and its scales), or 'auto' (checkpoint when it matches)."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("source", SOURCES)


# ------------------------------------------------------------------------------------------------------ units


class BnbUnit(SwitchedUnit):
    """One bitsandbytes quantized linear: its own forward on the cheap path, a BF16 matmul in recovery.

    `source` is "checkpoint" or "dequantize". A variant says how to check its module, how to match a checkpoint
    row against it, and how to dequantize.
    """

    weight_kind: ClassVar[str]  # for messages: "INT8", "4-bit"
    measures_impact = True

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext) -> None:
        problem = self._unsupported(module)
        if problem:
            raise ValueError(f"{ctx.backend} unit {name!r}: {problem}. Exclude it with exclude=[...]")
        self._checkpoint = _recovery_source(ctx, self.weight_kind, name, module, self._row_matches)
        self.source = "checkpoint" if self._checkpoint is not None else "dequantize"
        self._weight: torch.Tensor | None = None
        super().__init__(name, module, ctx)

    @staticmethod
    @abstractmethod
    def _unsupported(module: nn.Module) -> str | None:
        """Why this module cannot be a unit (not quantized yet...), or None."""

    @staticmethod
    @abstractmethod
    def _row_matches(row: torch.Tensor, module: nn.Module) -> bool:
        """Whether a checkpoint row quantizes to the module's first quantized row."""

    @property
    def checkpoint_dir(self) -> Path | None:
        """The directory of the safetensors the recovery weight is read from (source "checkpoint"), else None."""
        return None if self._checkpoint is None else self._checkpoint.directory

    @property
    def recovery_weight(self) -> torch.Tensor | None:
        """The BF16 weight while in recovery (read-only use), else None."""
        return self._weight

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "source": self.source}

    def precision(self) -> str:
        return f"{self.weight_kind}/bf16"

    def recovery_bytes(self) -> int:
        # The bias is cast per forward rather than held, but it is the same bytes and keeps the count an upper bound.
        bias = 0 if self.module.bias is None else self.module.bias.numel()
        return (self.module.out_features * self.module.in_features + bias) * _RECOVERY_DTYPE.itemsize

    def cheap_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = self._module_forward(x, *args, **kwargs)
        return self._measure(x, out, cheap=True)

    def recovery_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = self._weight
        assert weight is not None
        bias = self.module.bias
        # Autocast would turn this into an fp16 matmul under fp16 autocast; recovery promises BF16. The matmul is
        # on the flattened 2-D input and the result a view of it, as bitsandbytes' own forward returns: compiled
        # code after a unit is guarded on the layout it receives, so both paths must hand over the same one.
        with torch.autocast(device_type=x.device.type, enabled=False):
            flat = x.reshape(-1, x.shape[-1]).to(_RECOVERY_DTYPE)
            out = F.linear(flat, weight, None if bias is None else bias.to(_RECOVERY_DTYPE))
        out = out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])
        return self._measure(x, out, cheap=False)

    @torch.compiler.disable
    def _measure(self, x: torch.Tensor, out: torch.Tensor, cheap: bool) -> torch.Tensor:
        # Outside compiled code: whether a measure is due reads the optimizer step, which a graph must not guard on.
        if not self.impact.due:
            return out
        return self._offer_impact(x, out, cheap)

    @torch.no_grad()
    def _offer_impact(self, x: torch.Tensor, out: torch.Tensor, cheap: bool) -> torch.Tensor:
        """The cheap path's change of the output on the impact meter's sample of rows (`gnmr_hf.impact`): the
        module's own quantized forward minus the exact (fp32) product of the same input with the weight recovery is
        built from (the checkpoint's as stored, or bitsandbytes' de-quantized one in fp32: with source="dequantize"
        the weight's own rounding is not recovered, so it is not counted either), in the output's dtype so that its
        own rounding cancels. Not against recovery's BF16 product: on bitsandbytes' CPU training kernel (the
        de-quantized weight in an fp32 matmul) that would count recovery's own BF16 rounding as the cheap path's
        cost. On the cheap path the cheap rows are the output's own; in recovery they are the module's forward on
        the sampled rows alone, so LLM.int8()'s outlier columns are those of the sample, not of the batch (a column
        above the threshold in a row left out runs in INT8 here). Whatever the kernel rounds is in it: the input
        and the weight under LLM.int8(), the weight only under bitsandbytes' CPU training kernel
        (`int8_rounds_input`). Returns the output to hand on (`ImpactMeter.offer`: a leaf where the base output needs
        no gradient, as the first layer's does under LoRA)."""
        x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
        index = self.impact.rows(x2)
        x_rows = take_rows(x2, index)
        bias = self.module.bias
        exact = F.linear(x_rows.float(), self._source_weight().float(), None if bias is None else bias.float())
        if cheap:
            low = take_rows(out2, index)
        else:
            low = self._module_forward(x_rows)
        return self.impact.offer(out, low.float() - exact.to(out.dtype).float(), index, in_forward=True)

    def _enter(self) -> int:
        if self.source == "checkpoint" and self.tuner is not None and getattr(self.tuner, "merged", False):
            raise RuntimeError(
                f"{self.backend} unit {self.name!r}: adapters are merged into its {self.weight_kind} weight, so the "
                "checkpoint weight no longer matches it; unmerge them first or use source='dequantize'"
            )
        self._weight = self._materialize()
        return self.recovery_bytes()

    def _exit(self) -> None:
        self._weight = None

    @torch.no_grad()
    def _materialize(self) -> torch.Tensor:
        return self._source_weight().to(_RECOVERY_DTYPE)

    @torch.no_grad()
    def _source_weight(self) -> torch.Tensor:
        """The full-precision weight recovery is built from, on the module's device: the checkpoint's as stored, or
        bitsandbytes' de-quantized one."""
        if self.source == "checkpoint":
            assert self._checkpoint is not None
            return self._checkpoint.tensor(self.name + ".weight").to(self.module.weight.device)
        return self._dequantize()

    @abstractmethod
    def _dequantize(self) -> torch.Tensor:
        """The module's weight rebuilt from its quantized form by the library's own dequantizer, [out, in]."""


class BnbInt8Unit(BnbUnit):
    """One bitsandbytes `Linear8bitLt`: INT8 matmul on the cheap path, BF16 matmul in recovery."""

    weight_kind = "INT8"
    fidelity_bound = (
        "input as LLM.int8() rounds it (per-row absmax INT8; columns with an entry above the outlier threshold run "
        "in 16 bits and are left out): max(relative L2 error / 2, row-sum bias / 0.1)"
    )

    def input_fidelity(self, x: torch.Tensor) -> OperandStats:
        if not int8_rounds_input(self.module, x):
            # The kernel this forward runs never rounds its input: the input loses nothing.
            rows = take_rows(x.detach(), self.meter.rows(x))
            return operand_stats(rows, rows)
        threshold = float(getattr(self.module.state, "threshold", 0.0) or 0.0)
        return int8_input_stats(x, threshold, self.meter.rows(x))

    @staticmethod
    def _unsupported(module: nn.Module) -> str | None:
        if module.state.has_fp16_weights or module.weight.dtype != torch.int8:
            return (
                f"only INT8 weights are supported (has_fp16_weights={module.state.has_fp16_weights}, weight dtype "
                f"{module.weight.dtype}); a module that has not been moved to its device yet is not quantized"
            )
        return None

    @staticmethod
    def _row_matches(row: torch.Tensor, module: nn.Module) -> bool:
        return _int8_row_matches(row, module)

    def _dequantize(self) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        scb = _int8_scales(self.module)
        if scb is None:
            raise RuntimeError(f"bnb_int8 unit {self.name!r}: the INT8 weight has no row scales (SCB)")
        return bnb_functional.int8_vectorwise_dequant(self.module.weight.data, scb.to(self.module.weight.device))


class Bnb4bitUnit(BnbUnit):
    """One bitsandbytes `Linear4bit` (NF4 or FP4): 4-bit matmul on the cheap path, BF16 matmul in recovery."""

    weight_kind = "4-bit"

    @staticmethod
    def _unsupported(module: nn.Module) -> str | None:
        weight = module.weight
        if not getattr(weight, "bnb_quantized", False) or getattr(weight, "quant_state", None) is None:
            return (
                "the weight is not quantized yet (bitsandbytes quantizes a Linear4bit when it is moved to its "
                "device); load the model with a 4-bit BitsAndBytesConfig"
            )
        return _4bit_layout_problem(module)

    @staticmethod
    def _row_matches(row: torch.Tensor, module: nn.Module) -> bool:
        return _4bit_row_matches(row, module)

    def describe(self) -> dict[str, Any]:
        state = self.module.weight.quant_state
        return {**super().describe(), "quant_type": state.quant_type, "double_quant": bool(state.nested)}

    def _dequantize(self) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        problem = _4bit_layout_problem(self.module)
        if problem:
            raise RuntimeError(f"bnb_4bit unit {self.name!r}: cannot dequantize: {problem}")
        # Reads the packed codes and the quant state; the nested absmax is dequantized into a new tensor.
        return bnb_functional.dequantize_4bit(self.module.weight.data, self.module.weight.quant_state)


def int8_rounds_input(module: nn.Module, x: torch.Tensor) -> bool:
    """Whether the forward of the `Linear8bitLt` `module` on `x` rounds `x` to INT8, as LLM.int8() does.

    bitsandbytes' own dispatcher (`bitsandbytes.matmul`) runs LLM.int8() (`MatMul8bitLt`) everywhere but in training
    on a CPU or an XPU, where bitsandbytes >= 0.47 runs `MatMul8bitFp`: the INT8 weight de-quantized, then a float
    matmul, the input never rounded and the outlier threshold unused. On those devices a training step's INT8 error is
    the weight's alone. A dispatcher put in bitsandbytes' place (`gnmr_hf.experiments.models.llm_int8_in_training`
    runs LLM.int8() in training on a CPU, as on CUDA) is taken to round the input. This mirrors
    `bitsandbytes.autograd._functions.matmul`, which reads `module.training` when the forward starts;
    tests/test_bnb.py checks it against bitsandbytes' outputs.
    """
    import bitsandbytes as bnb
    from bitsandbytes.autograd import _functions

    own_dispatch = bnb.matmul is getattr(_functions, "matmul", None)
    float_kernel = hasattr(_functions, "MatMul8bitFp")
    return not (own_dispatch and float_kernel and module.training and x.device.type in ("cpu", "xpu"))


def int8_input_loss(x: torch.Tensor, threshold: float, index: torch.Tensor | None = None) -> torch.Tensor:
    """`operand_loss` of LLM.int8()'s input rounding: per-row absmax to INT8 codes in [-127, 127], after the outlier
    columns (an entry of magnitude >= `threshold` in any row, when it is > 0) are taken out to the 16-bit matmul;
    on the rows `index` (all when None)."""
    return loss_of(int8_input_stats(x, threshold, index))


def int8_input_stats(x: torch.Tensor, threshold: float, index: torch.Tensor | None = None) -> OperandStats:
    """The `operand_stats` behind `int8_input_loss`."""
    x2 = x.detach().reshape(-1, x.shape[-1])
    rows = take_rows(x2, index).float()
    if threshold > 0:
        rows = torch.where((x2.abs() >= threshold).any(dim=0), 0.0, rows)
    scale = rows.abs().amax(dim=1, keepdim=True) / 127
    rounded = torch.round(rows / torch.where(scale > 0, scale, 1.0)) * scale
    return operand_stats(rows, rounded)


# ------------------------------------------------------------------------------------------------- row checks


def _int8_scales(module: nn.Module) -> torch.Tensor | None:
    # bnb keeps the row scales on the weight until the first forward, then moves them to `module.state`.
    return module.state.SCB if module.state.SCB is not None else module.weight.SCB


@torch.no_grad()
def _int8_row_matches(row: torch.Tensor, module: nn.Module) -> bool:
    """Whether a checkpoint row quantizes to the module's INT8 row 0 by bitsandbytes' own quantizer (from fp16,
    as `Int8Params` does when the model is loaded)."""
    import bitsandbytes.functional as bnb_functional

    scales = _int8_scales(module)
    if scales is None:
        return False
    codes, row_scale, _ = bnb_functional.int8_vectorwise_quant(row.to(torch.float16).reshape(1, -1))
    # Slack for a model loaded in another dtype than the checkpoint's (fp32 -> bf16 -> fp16 rounds twice): 1% on
    # the scale, two INT8 steps on the row. Weights that are not this checkpoint's miss by far more.
    if not torch.isclose(row_scale[0].float(), scales[0].detach().float().cpu(), rtol=1e-2, atol=0):
        return False
    return bool((codes[0].int() - module.weight.data[0].detach().cpu().int()).abs().max() <= 2)


def _4bit_layout_problem(module: nn.Module) -> str | None:
    """Why the module's 4-bit weight is not in the layout `quantize_4bit` writes and `dequantize_4bit` reads."""
    if getattr(module.weight.quant_state, "packing_format_for_cpu", False):
        return (
            "bitsandbytes repacked its weight for the AVX512-BF16 CPU inference kernel (an eval-mode forward "
            "without gradients does that); call model.train() before the first forward, or use source='checkpoint'"
        )
    return None


def _4bit_absmax(state: Any, blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The absmax of the first `blocks` blocks as the module dequantizes them, and how far each may be from the
    exact absmax: 0 without double quantization; with it, the widest gap of the 8-bit code times the scale of
    the group of blocks whose absmax were quantized together (twice the rounding bound, for kernels that round a
    tie the other way)."""
    import bitsandbytes.functional as bnb_functional

    if not state.nested:
        return state.absmax[:blocks].float(), torch.zeros(blocks, device=state.absmax.device)
    absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2)[:blocks] + state.offset
    code = state.state2.code.float().sort().values
    group_scale = state.state2.absmax.float()[torch.arange(blocks, device=absmax.device) // state.state2.blocksize]
    return absmax.float(), (code[1:] - code[:-1]).max() * group_scale


@torch.no_grad()
def _4bit_row_matches(row: torch.Tensor, module: nn.Module) -> bool:
    """Whether the whole blocks of a checkpoint row quantize, by bitsandbytes' `quantize_4bit`, to the module's
    packed codes and absmax for those blocks (the rule and its slack are in the module docstring)."""
    import bitsandbytes.functional as bnb_functional

    state = module.weight.quant_state
    count = (module.in_features // state.blocksize) * state.blocksize
    if count == 0:
        return False
    codes, row_state = bnb_functional.quantize_4bit(
        row.reshape(-1)[:count].to(device=module.weight.device, dtype=state.dtype),
        blocksize=state.blocksize,
        quant_type=state.quant_type,
        quant_storage=module.weight.quant_storage,
    )
    absmax, slack = _4bit_absmax(state, count // state.blocksize)
    if not ((row_state.absmax.float() - absmax).abs() <= slack + 1e-5 * absmax).all():
        return False
    # Two codes per byte: XOR the packed bytes and count the nibbles that differ.
    diff = codes.reshape(-1).view(torch.uint8) ^ module.weight.data.reshape(-1).view(torch.uint8)[: count // 2]
    mismatches = int(((diff & 0xF) != 0).sum() + ((diff >> 4) != 0).sum())
    return mismatches <= count // _CODE_MISMATCH_DIVISOR


# --------------------------------------------------------------------------------------------------- dispatch


def _logged_sources(ctx: DispatchContext) -> set[str]:
    return set()


def _checkpoint(ctx: DispatchContext) -> tuple[CheckpointSource | None, str]:
    return CheckpointSource.locate(ctx.model)


def _recovery_source(
    ctx: DispatchContext[BnbOptions], weight_kind: str, name: str, module: nn.Module, matches: Callable[..., bool]
) -> CheckpointSource | None:
    """The checkpoint to read `module`'s BF16 weight from, or None for dequantize (the `source` option resolved as
    docs/backends.md says). Logs each source chosen once per `find_units` call."""
    source = ctx.options.source
    checkpoint: CheckpointSource | None = None
    if source != "dequantize":
        checkpoint, problem = ctx.once(_checkpoint)
        if checkpoint is not None:
            shape = (module.out_features, module.in_features)
            problem = checkpoint.problem(name + ".weight", shape, lambda row: matches(row, module))
        if problem:
            if source == "checkpoint":
                raise ValueError(
                    f"{ctx.backend} unit {name!r}: source='checkpoint' but {problem}. Use source='dequantize' (or "
                    f"'auto') to rebuild the BF16 weight from the {weight_kind} weight instead"
                )
            checkpoint = None
    chosen = "checkpoint" if checkpoint is not None else "dequantize"
    logged = ctx.once(_logged_sources)
    if chosen not in logged:
        logged.add(chosen)
        where = f" ({checkpoint.directory})" if checkpoint is not None else ""
        logger.info("%s: recovery weights from source=%s%s, first unit %r", ctx.backend, chosen, where, name)
    return checkpoint


def _int8_unit(module: nn.Module, ctx: DispatchContext) -> type[RecoverableUnit] | None:
    import bitsandbytes as bnb

    return BnbInt8Unit if isinstance(module, bnb.nn.Linear8bitLt) else None


def _4bit_unit(module: nn.Module, ctx: DispatchContext) -> type[RecoverableUnit] | None:
    import bitsandbytes as bnb

    return Bnb4bitUnit if isinstance(module, bnb.nn.Linear4bit) else None


_OTHER_BACKENDS = (
    "If the module types above include bitsandbytes.nn.modules.{other}, use backend='{other_backend}'; if they "
    "include torchao.float8.float8_linear.Float8Linear, use backend='torchao_float8'."
)

BNB_INT8 = Backend(
    name="bnb_int8",
    unit_for=_int8_unit,
    options=BnbOptions,
    requires="bitsandbytes",
    hint=(
        "The bnb_int8 backend manages bitsandbytes Linear8bitLt layers: load the model in 8-bit with "
        "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True)) (then peft LoRA as "
        "usual), or choose the backend that matches the model's low-precision layers (GNMRConfig.backend). "
        + _OTHER_BACKENDS.format(other="Linear4bit", other_backend="bnb_4bit")
    ),
)

BNB_4BIT = Backend(
    name="bnb_4bit",
    unit_for=_4bit_unit,
    options=BnbOptions,
    requires="bitsandbytes",
    hint=(
        "The bnb_4bit backend manages bitsandbytes Linear4bit layers (QLoRA): load the model in 4-bit with "
        "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
        "bnb_4bit_quant_type='nf4')) (then peft LoRA as usual), or choose the backend that matches the model's "
        "low-precision layers (GNMRConfig.backend). "
        + _OTHER_BACKENDS.format(other="Linear8bitLt", other_backend="bnb_int8")
    ),
)

BACKENDS = (BNB_INT8, BNB_4BIT)
