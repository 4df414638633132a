"""bitsandbytes backends: `bnb_int8`, a `Linear8bitLt` (LLM.int8()) on the cheap path and a BF16 matmul in recovery.

A unit is one `bnb.nn.Linear8bitLt` with INT8 weights, bare or as the base layer of a peft LoRA layer (peft's
wrapper is also called `Linear8bitLt` but is not a bitsandbytes subclass; the unit is always the bnb module,
named by `display_name`, e.g. ``model.layers.0.self_attn.q_proj``). As in peft's `tuners/lora/bnb.py`, the
bitsandbytes variants sit side by side in this file and share everything but what differs.

The switch (`SwitchedUnit`): the cheap path is the module's own forward, bit for bit. In recovery the forward
is `F.linear(x.to(bf16), W_bf16, bias.to(bf16)).to(x.dtype)` with autocast off, so it is a BF16 matmul whatever
autocast says. The INT8 weight, its row scales (SCB), `module.state` and the bias are never written (bnb's own
forward casts `bias.data` in place; the recovery path casts a copy).

The BF16 weight exists only while its unit is in recovery, which is the memory the INT8 model exists to save:
`enter_recovery()` builds it, `exit_recovery()` drops the only reference. It comes from one of two sources:

- ``checkpoint``: the original tensor, from the model's local safetensors (`CheckpointSource`). Cast to BF16
  it equals a BF16 model's weight exactly, so a unit in recovery matches a BF16 `nn.Linear` on the same input
  exactly (the tests assert `torch.equal`).
- ``dequantize``: `W = CB * SCB[:, None] / 127` by `bitsandbytes.functional.int8_vectorwise_dequant`. Each
  weight is then off by at most half a quantization step, `absmax_row / 254`, plus BF16 rounding; an output
  element is off by at most that times `sum_k |x_k|` per row plus the BF16 rounding of the output (the tests
  check this bound).
- ``auto`` (the default): checkpoint when the model's checkpoint holds, under ``display_name + ".weight"``, a
  floating-point tensor of the right shape whose first row `bitsandbytes.functional.int8_vectorwise_quant`
  quantizes to the module's INT8 first row; else dequantize. A checkpoint that is itself INT8, or one the model
  was not quantized from, is not used. Which source a unit uses is `unit.source`, logged once per source.

Options (`find_units(model, "bnb_int8", source=..., signal=...)`, or `GNMRConfig(backend_options=...)`):
`source` as above; `signal`, the gradient a unit is scored on: ``lora``, ``weight``, ``output_grad`` or ``auto``
(see `adapters.resolve_signal`).

Limits: `Linear8bitLt(has_fp16_weights=True)` (INT8 matmuls over trainable fp16 weights) is refused with an
error. Merging adapters into the INT8 weight (peft `merge_adapter`) changes it under the unit: entering recovery
from the checkpoint while merged is refused, and a unit must not be in recovery across a merge or unmerge. The
wrapper is a closure over the unit, so deep-copy or pickle a model before `find_units` or after `close()`.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..units import Backend, BackendOptions, DispatchContext, display_name
from .adapters import SIGNALS, resolve_signal, tuner_layer
from .checkpoint import CheckpointSource
from .switch import SwitchedUnit

__all__ = ["BNB_INT8", "BnbInt8Options", "BnbInt8Unit", "dispatch_bnb_int8", "is_bnb_available"]

logger = logging.getLogger("gnmr_hf")

SOURCES = ("auto", "checkpoint", "dequantize")
_RECOVERY_DTYPE = torch.bfloat16


@functools.lru_cache
def is_bnb_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


@dataclass
class BnbInt8Options(BackendOptions):
    """Options of the `bnb_int8` backend."""

    backend: ClassVar[str] = "bnb_int8"

    source: str = field(
        default="auto",
        metadata={
            "help": "Where the BF16 recovery weight comes from: 'checkpoint' (the model's local safetensors), "
            "'dequantize' (the INT8 weight and its scales), or 'auto' (checkpoint when it matches)."
        },
    )
    signal: str = field(
        default="auto",
        metadata={
            "help": "The gradient a unit is scored on: 'lora' (its LoRA parameters), 'weight' (its own trainable "
            "weight), 'output_grad' (the gradient of its output), or 'auto' (lora, else weight, else output_grad)."
        },
    )

    def __post_init__(self) -> None:
        self.check_choice("source", SOURCES)
        self.check_choice("signal", SIGNALS)


def _int8_scales(module: nn.Module) -> torch.Tensor | None:
    # bnb keeps the row scales on the weight until the first forward, then moves them to `module.state`.
    return module.state.SCB if module.state.SCB is not None else module.weight.SCB


@torch.no_grad()
def _quantizes_to(row: torch.Tensor, module: nn.Module) -> bool:
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


class BnbInt8Unit(SwitchedUnit):
    """One bitsandbytes `Linear8bitLt`: INT8 matmul on the cheap path, BF16 matmul in recovery.

    Build it with `find_units(model, "bnb_int8", ...)`, not directly. Attributes: `source` ("checkpoint" or
    "dequantize"), `signal` (the resolved signal kind), `ledger` (shared `RecoveryLedger`), `tuner` (the peft
    layer around the module, or None).
    """

    def __init__(
        self,
        name: str,
        module: nn.Module,
        *,
        source: str,
        checkpoint: CheckpointSource | None,
        **kwargs: Any,
    ) -> None:
        super().__init__(name, module, backend="bnb_int8", **kwargs)
        self.source = source
        self._checkpoint = checkpoint
        self._weight: torch.Tensor | None = None

    @property
    def checkpoint_dir(self) -> Any:
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
        out_features, in_features = self.module.weight.shape
        bias = 0 if self.module.bias is None else self.module.bias.numel()
        return (out_features * in_features + bias) * _RECOVERY_DTYPE.itemsize

    def recovery_forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        weight = self._weight
        assert weight is not None
        bias = self.module.bias
        # Autocast would turn this into an fp16 matmul under fp16 autocast; recovery promises BF16.
        with torch.autocast(device_type=x.device.type, enabled=False):
            out = F.linear(x.to(_RECOVERY_DTYPE), weight, None if bias is None else bias.to(_RECOVERY_DTYPE))
        return out.to(x.dtype)

    def _enter(self) -> int:
        if self.source == "checkpoint" and self.tuner is not None and getattr(self.tuner, "merged", False):
            raise RuntimeError(
                f"bnb_int8 unit {self.name!r}: adapters are merged into its INT8 weight, so the checkpoint weight "
                "no longer matches it; unmerge them first or use source='dequantize'"
            )
        self._weight = self._materialize()
        return self.recovery_bytes()

    def _exit(self) -> None:
        self._weight = None

    @torch.no_grad()
    def _materialize(self) -> torch.Tensor:
        device = self.module.weight.device
        if self.source == "checkpoint":
            assert self._checkpoint is not None
            return self._checkpoint.tensor(self.name + ".weight").to(device=device, dtype=_RECOVERY_DTYPE)
        import bitsandbytes.functional as bnb_functional

        scb = _int8_scales(self.module)
        if scb is None:
            raise RuntimeError(f"bnb_int8 unit {self.name!r}: the INT8 weight has no row scales (SCB)")
        weight = bnb_functional.int8_vectorwise_dequant(self.module.weight.data, scb.to(device))
        return weight.to(_RECOVERY_DTYPE)


def _recovery_source(ctx: DispatchContext, name: str, module: nn.Module, source: str) -> CheckpointSource | None:
    """The checkpoint to read `module`'s BF16 weight from, or None for dequantize (`source` resolved as documented
    in the module docstring). Logs each source chosen once per `find_units` call."""
    checkpoint: CheckpointSource | None = None
    if source != "dequantize":
        checkpoint, problem = CheckpointSource.for_context(ctx)
        if checkpoint is not None:
            problem = checkpoint.problem(
                name + ".weight", tuple(module.weight.shape), lambda row: _quantizes_to(row, module)
            )
        if problem:
            if source == "checkpoint":
                raise ValueError(
                    f"bnb_int8 unit {name!r}: source='checkpoint' but {problem}. Use source='dequantize' (or "
                    "'auto') to rebuild the BF16 weight from the INT8 weight instead"
                )
            checkpoint = None
    chosen = "checkpoint" if checkpoint is not None else "dequantize"
    logged = ctx.shared.setdefault("logged_sources", set())
    if chosen not in logged:
        logged.add(chosen)
        where = f" ({checkpoint.directory})" if checkpoint is not None else ""
        logger.info("bnb_int8: recovery weights from source=%s%s, first unit %r", chosen, where, name)
    return checkpoint


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
    options: BnbInt8Options = ctx.options  # type: ignore[assignment]
    checkpoint = _recovery_source(ctx, name, module, options.source)
    tuner = tuner_layer(ctx, module)
    return BnbInt8Unit(
        name,
        module,
        source="checkpoint" if checkpoint is not None else "dequantize",
        checkpoint=checkpoint,
        ledger=ctx.ledger,
        signal=resolve_signal(options.signal, name, module, tuner, "bnb_int8"),
        tuner=tuner,
    )


BNB_INT8 = Backend(
    name="bnb_int8",
    dispatchers=(dispatch_bnb_int8,),
    options=BnbInt8Options,
    hint=(
        "The bnb_int8 backend manages bitsandbytes Linear8bitLt layers: load the model in 8-bit with "
        "from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True)) (then peft LoRA as "
        "usual), or choose the backend that matches the model's low-precision layers (GNMRConfig.backend)."
    ),
)
