"""bitsandbytes backends: a quantized linear on the cheap path, a BF16 matmul in recovery.

- `bnb_int8`: a `bnb.nn.Linear8bitLt` with INT8 weights (LLM.int8()).
- `bnb_4bit`: a `bnb.nn.Linear4bit` (QLoRA: NF4 or FP4, with or without double quantization of the block scales).

A unit is the bitsandbytes module, bare or as the base layer of a peft LoRA layer (peft's wrappers carry the same
class names but are not bitsandbytes subclasses; the unit is always the bnb module, named by `display_name`, e.g.
``model.layers.0.self_attn.q_proj``). As in peft's `tuners/lora/bnb.py`, the variants sit side by side in this
file: everything is shared (`BnbUnit`, `_recovery_source`, `_make_unit`, the options) except two things each
variant says for itself, how to dequantize its weight and how to check that a checkpoint row quantizes to its own.

The switch (`SwitchedUnit`): the cheap path is the module's own forward, bit for bit. In recovery the forward
is `F.linear(x.to(bf16), W_bf16, bias.to(bf16)).to(x.dtype)` with autocast off, so it is a BF16 matmul whatever
autocast says. The quantized weight, its scales (INT8: SCB and `module.state`; 4-bit: the packed codes and the
whole `quant_state`) and the bias are never written (bnb's own forward casts `bias.data` in place; the recovery
path casts a copy).

The BF16 weight exists only while its unit is in recovery, which is the memory the quantized model exists to
save: `enter_recovery()` builds it, `exit_recovery()` drops the only reference, and a unit in recovery holds
`(out_features x in_features + bias) x 2` bytes. It comes from one of two sources:

- ``checkpoint``: the original tensor, from the model's local safetensors (`CheckpointSource`). Cast to BF16
  it equals a BF16 model's weight exactly, so a unit in recovery matches a BF16 `nn.Linear` on the same input
  exactly (the tests assert `torch.equal`), for INT8 and 4-bit alike.
- ``dequantize``: the library's own dequantizer.
  - INT8: `W = CB * SCB[:, None] / 127` by `bitsandbytes.functional.int8_vectorwise_dequant`. Each weight is
    off by at most half a quantization step, `absmax_row / 254`, plus BF16 rounding.
  - 4-bit: `W = code[q] * absmax_block` by `bitsandbytes.functional.dequantize_4bit` (bitsandbytes rounds each
    scaled weight to the nearest of the 16 code values). Each weight is off by at most half the widest gap
    between adjacent code values times its block's absmax (NF4: 0.152 x absmax, FP4: 0.167 x absmax), plus,
    with double quantization, the error of the block's 8-bit absmax: at most half the widest gap of the 8-bit
    dynamic code (0.0070) times the largest `|absmax - mean absmax|` of the 256 blocks quantized together
    (0.7% of the absmax at worst in the tests' models), plus BF16 rounding. That is the 4-bit quantization
    error itself: recovery from ``dequantize`` is a BF16 matmul of the 4-bit weight, not of the original one;
    ``checkpoint`` gives the original.
  An output element is off by at most the weight error times `sum_k |x_k|` per row plus the BF16 rounding of
  the output (the tests check these bounds).
- ``auto`` (the default): checkpoint when the model's checkpoint holds, under ``display_name + ".weight"``, a
  floating-point tensor of the right shape whose first row quantizes to the module's own first row by the
  library's quantizer; else dequantize. A checkpoint that is itself quantized, or one the model was not
  quantized from, is not used. Which source a unit uses is `unit.source`, logged once per source.

The row checks read one row, never the whole tensor:
- INT8: `int8_vectorwise_quant` of the row (from fp16, as `Int8Params` quantizes) against the module's INT8 row
  0 and its scale: at most two INT8 steps and 1% on the scale, which absorbs a load dtype other than the
  checkpoint's (fp32 -> bf16 -> fp16 rounds twice).
- 4-bit: `quantize_4bit` of the row's whole blocks (its first `in_features // blocksize x blocksize` weights,
  cast to the dtype the module was quantized from, `quant_state.dtype`, on the module's device, so by the very
  kernel that quantized the model) against the module's packed codes and block absmax for those blocks. Blocks
  are quantized independently, so the codes are bit-identical; the check allows one code in 64 to differ (a
  rounding tie settled differently by another kernel), and on the absmax a relative 1e-5 plus, under double
  quantization, twice the rounding bound of its 8-bit form (above). Weights the module was not quantized from
  differ in most codes. A layer narrower than one block (`in_features < blocksize`, 64 by default) has no whole
  block in its first row and cannot be checked this way: it uses ``dequantize`` under ``auto``, and
  ``checkpoint`` refuses it.

Options (`find_units(model, "bnb_int8" or "bnb_4bit", source=..., signal=...)`, or `GNMRConfig(backend_options=...)`):
`source` as above; `signal`, the gradient a unit is scored on: ``lora``, ``weight``, ``output_grad`` or ``auto``
(see `adapters.resolve_signal`).

Limits: `Linear8bitLt(has_fp16_weights=True)` (INT8 matmuls over trainable fp16 weights) and a `Linear4bit` that
has not been quantized yet (not moved to its device) are refused with an error. So is a `Linear4bit` whose weight
bitsandbytes has repacked for its AVX512-BF16 CPU inference kernel (it does so, in place, on the first eval-mode
forward without gradients on such CPUs): `dequantize_4bit` does not read that layout, so put the model in
`train()` mode before any forward, or use a checkpoint source; a unit that finds its weight repacked later
refuses to dequantize with the same explanation. Merging adapters into the quantized weight (peft
`merge_adapter`) changes it under the unit: entering recovery from the checkpoint while merged is refused, and a
unit must not be in recovery across a merge or unmerge. The wrapper is a closure over the unit, so deep-copy or
pickle a model before `find_units` or after `close()`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from ..units import Backend, BackendOptions, DispatchContext, display_name
from .adapters import SIGNALS, resolve_signal, signal_option, tuner_layer
from .checkpoint import CheckpointSource
from .switch import SwitchedUnit

__all__ = [
    "BNB_4BIT",
    "BNB_INT8",
    "Bnb4bitOptions",
    "Bnb4bitUnit",
    "BnbInt8Options",
    "BnbInt8Unit",
    "BnbOptions",
    "BnbUnit",
    "dispatch_bnb_4bit",
    "dispatch_bnb_int8",
    "is_bnb_available",
]

logger = logging.getLogger("gnmr_hf")

SOURCES = ("auto", "checkpoint", "dequantize")
_RECOVERY_DTYPE = torch.bfloat16
# 4-bit row check slack: one code in this many may differ (a rounding tie settled by another kernel).
_CODE_MISMATCH_DIVISOR = 64

RowCheck = Callable[[torch.Tensor], bool]
UnitT = TypeVar("UnitT", bound="BnbUnit")


@functools.lru_cache
def is_bnb_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


# ---------------------------------------------------------------------------------------------------- options


@dataclass
class BnbOptions(BackendOptions):
    """Options shared by the bitsandbytes backends (`BnbInt8Options`, `Bnb4bitOptions` only name the backend)."""

    source: str = field(
        default="auto",
        metadata={
            "help": "Where the BF16 recovery weight comes from: 'checkpoint' (the model's local safetensors), "
            "'dequantize' (the quantized weight and its scales), or 'auto' (checkpoint when it matches)."
        },
    )
    signal: str = signal_option()

    def __post_init__(self) -> None:
        self.check_choice("source", SOURCES)
        self.check_choice("signal", SIGNALS)


@dataclass
class BnbInt8Options(BnbOptions):
    """Options of the `bnb_int8` backend."""

    backend: ClassVar[str] = "bnb_int8"


@dataclass
class Bnb4bitOptions(BnbOptions):
    """Options of the `bnb_4bit` backend."""

    backend: ClassVar[str] = "bnb_4bit"


# ------------------------------------------------------------------------------------------------------ units


class BnbUnit(SwitchedUnit):
    """One bitsandbytes quantized linear: its own forward on the cheap path, a BF16 matmul in recovery.

    Build it with `find_units(model, "bnb_int8" | "bnb_4bit", ...)`, not directly. Attributes: `source`
    ("checkpoint" or "dequantize"), `signal` (the resolved signal kind), `ledger` (shared `RecoveryLedger`),
    `tuner` (the peft layer around the module, or None). A subclass names its backend and says how to dequantize.
    """

    backend_name: ClassVar[str]
    weight_kind: ClassVar[str]  # for messages: "INT8", "4-bit"

    def __init__(
        self,
        name: str,
        module: nn.Module,
        *,
        source: str,
        checkpoint: CheckpointSource | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name, module, backend=self.backend_name, **kwargs)
        self.source = source
        self._checkpoint = checkpoint
        self._weight: torch.Tensor | None = None

    @property
    def checkpoint_dir(self) -> Path | None:
        """The directory of the safetensors the recovery weight is read from (source "checkpoint"), else None."""
        return None if self._checkpoint is None else self._checkpoint.directory

    @property
    def recovery_weight(self) -> torch.Tensor | None:
        """The BF16 weight while in recovery (read-only use), else None."""
        return self._weight

    def describe(self) -> dict[str, Any]:
        return {"signal": self.signal, "source": self.source}

    def recovery_bytes(self) -> int:
        # The bias is cast per forward rather than held, but it is the same bytes and keeps the count an upper bound.
        bias = 0 if self.module.bias is None else self.module.bias.numel()
        return (self.module.out_features * self.module.in_features + bias) * _RECOVERY_DTYPE.itemsize

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
        return out.to(x.dtype).view(*x.shape[:-1], out.shape[-1])

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
        if self.source == "checkpoint":
            assert self._checkpoint is not None
            weight = self._checkpoint.tensor(self.name + ".weight")
            return weight.to(device=self.module.weight.device, dtype=_RECOVERY_DTYPE)
        return self._dequantize().to(_RECOVERY_DTYPE)

    @abstractmethod
    def _dequantize(self) -> torch.Tensor:
        """The module's weight rebuilt from its quantized form by the library's own dequantizer, [out, in]."""


class BnbInt8Unit(BnbUnit):
    """One bitsandbytes `Linear8bitLt`: INT8 matmul on the cheap path, BF16 matmul in recovery."""

    backend_name = "bnb_int8"
    weight_kind = "INT8"

    def _dequantize(self) -> torch.Tensor:
        import bitsandbytes.functional as bnb_functional

        scb = _int8_scales(self.module)
        if scb is None:
            raise RuntimeError(f"bnb_int8 unit {self.name!r}: the INT8 weight has no row scales (SCB)")
        return bnb_functional.int8_vectorwise_dequant(self.module.weight.data, scb.to(self.module.weight.device))


class Bnb4bitUnit(BnbUnit):
    """One bitsandbytes `Linear4bit` (NF4 or FP4): 4-bit matmul on the cheap path, BF16 matmul in recovery."""

    backend_name = "bnb_4bit"
    weight_kind = "4-bit"

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


def _recovery_source(
    ctx: DispatchContext, backend: str, weight_kind: str, name: str, module: nn.Module, matches: RowCheck
) -> CheckpointSource | None:
    """The checkpoint to read `module`'s BF16 weight from, or None for dequantize (the `source` option resolved as
    documented in the module docstring, `matches` being the backend's row check). Logs each source chosen once
    per `find_units` call."""
    source = ctx.options.source  # type: ignore[attr-defined]
    checkpoint: CheckpointSource | None = None
    if source != "dequantize":
        checkpoint, problem = CheckpointSource.for_context(ctx)
        if checkpoint is not None:
            problem = checkpoint.problem(name + ".weight", (module.out_features, module.in_features), matches)
        if problem:
            if source == "checkpoint":
                raise ValueError(
                    f"{backend} unit {name!r}: source='checkpoint' but {problem}. Use source='dequantize' (or "
                    f"'auto') to rebuild the BF16 weight from the {weight_kind} weight instead"
                )
            checkpoint = None
    chosen = "checkpoint" if checkpoint is not None else "dequantize"
    logged = ctx.shared.setdefault("logged_sources", set())
    if chosen not in logged:
        logged.add(chosen)
        where = f" ({checkpoint.directory})" if checkpoint is not None else ""
        logger.info("%s: recovery weights from source=%s%s, first unit %r", backend, chosen, where, name)
    return checkpoint


def _make_unit(unit_cls: type[UnitT], module: nn.Module, name: str, ctx: DispatchContext, matches: RowCheck) -> UnitT:
    options: BnbOptions = ctx.options  # type: ignore[assignment]
    backend = unit_cls.backend_name
    checkpoint = _recovery_source(ctx, backend, unit_cls.weight_kind, name, module, matches)
    tuner = tuner_layer(ctx, module)
    return unit_cls(
        name,
        module,
        source="checkpoint" if checkpoint is not None else "dequantize",
        checkpoint=checkpoint,
        ledger=ctx.ledger,
        signal=resolve_signal(options.signal, name, module, tuner, backend),
        tuner=tuner,
    )


def dispatch_bnb_int8(module: nn.Module, fqn: str, ctx: DispatchContext) -> BnbInt8Unit | None:
    """A `BnbInt8Unit` for a bitsandbytes `Linear8bitLt` with INT8 weights, else None."""
    if not is_bnb_available():
        return None
    import bitsandbytes as bnb

    if not isinstance(module, bnb.nn.Linear8bitLt):
        return None
    name = display_name(fqn)
    weight = module.weight
    if module.state.has_fp16_weights or weight.dtype != torch.int8:
        raise ValueError(
            f"bnb_int8 unit {name!r}: only INT8 weights are supported (has_fp16_weights="
            f"{module.state.has_fp16_weights}, weight dtype {weight.dtype}); a module that has not been moved to "
            "its device yet is not quantized. Exclude it with exclude=[...]"
        )
    return _make_unit(BnbInt8Unit, module, name, ctx, lambda row: _int8_row_matches(row, module))


def dispatch_bnb_4bit(module: nn.Module, fqn: str, ctx: DispatchContext) -> Bnb4bitUnit | None:
    """A `Bnb4bitUnit` for a bitsandbytes `Linear4bit` (NF4 or FP4) with quantized weights, else None."""
    if not is_bnb_available():
        return None
    import bitsandbytes as bnb

    if not isinstance(module, bnb.nn.Linear4bit):
        return None
    name = display_name(fqn)
    weight = module.weight
    if not getattr(weight, "bnb_quantized", False) or getattr(weight, "quant_state", None) is None:
        raise ValueError(
            f"bnb_4bit unit {name!r}: the weight is not quantized yet (bitsandbytes quantizes a Linear4bit when it "
            "is moved to its device); load the model with a 4-bit BitsAndBytesConfig, or exclude it with "
            "exclude=[...]"
        )
    problem = _4bit_layout_problem(module)
    if problem:
        raise ValueError(f"bnb_4bit unit {name!r}: {problem}. Or exclude it with exclude=[...]")
    return _make_unit(Bnb4bitUnit, module, name, ctx, lambda row: _4bit_row_matches(row, module))


_OTHER_BACKENDS = (
    "If the module types above include bitsandbytes.nn.modules.{other}, use backend='{other_backend}'; if they "
    "include torchao.float8.float8_linear.Float8Linear, use backend='torchao_float8'."
)

BNB_INT8 = Backend(
    name="bnb_int8",
    dispatchers=(dispatch_bnb_int8,),
    options=BnbInt8Options,
    hint=(
        "The bnb_int8 backend manages bitsandbytes Linear8bitLt layers: load the model in 8-bit with "
        "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True)) (then peft LoRA as "
        "usual), or choose the backend that matches the model's low-precision layers (GNMRConfig.backend). "
        + _OTHER_BACKENDS.format(other="Linear4bit", other_backend="bnb_4bit")
    ),
)

BNB_4BIT = Backend(
    name="bnb_4bit",
    dispatchers=(dispatch_bnb_4bit,),
    options=Bnb4bitOptions,
    hint=(
        "The bnb_4bit backend manages bitsandbytes Linear4bit layers (QLoRA): load the model in 4-bit with "
        "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True, "
        "bnb_4bit_quant_type='nf4')) (then peft LoRA as usual), or choose the backend that matches the model's "
        "low-precision layers (GNMRConfig.backend). "
        + _OTHER_BACKENDS.format(other="Linear8bitLt", other_backend="bnb_int8")
    ),
)
