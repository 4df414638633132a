"""The `bnb_int8` backend: bitsandbytes `Linear8bitLt` (LLM.int8()) on the cheap path, a BF16 matmul on recovery.

A unit is one `bnb.nn.Linear8bitLt` with INT8 weights, bare or as the `base_layer` of a peft LoRA layer (peft's
wrapper is also called `Linear8bitLt` but is not a bitsandbytes subclass; the unit is always the bnb module,
named by `display_name`, e.g. ``model.layers.0.self_attn.q_proj``).

The switch is a flag checked in `forward`, as peft's `disable_adapters` is, not module surgery. When the unit is
created it puts ONE instance-level `forward` on the bnb module; that wrapper asks whether the unit holds a
recovery weight. If not, it calls the module's own forward (the INT8 path, bit for bit). If so, it computes
`F.linear(x.to(bf16), W_bf16, bias.to(bf16)).to(x.dtype)` with autocast off, so it is a BF16 matmul whatever
autocast says. The INT8 weight, its row scales (SCB), `module.state` and the bias are never written (bnb's own
forward casts `bias.data` in place; the recovery path casts a copy), no Parameter or buffer is added, so the
state dict and the optimizer see nothing. `close()` deletes the wrapper: the module is as it was found.

Why not keep a BF16 copy of every weight? That is the memory the INT8 model exists to save. The BF16 weight
exists only while its unit is in recovery: `enter_recovery()` builds it, `exit_recovery()` drops the only
reference. It comes from one of two sources:

- ``checkpoint``: the original tensor, read from the model's local safetensors (`model.safetensors`, or the
  shards of `model.safetensors.index.json`) through memory-mapped `safe_open` handles, one per file, shared by
  the units of one `find_units` call. Cast to BF16 it equals a BF16 model's weight exactly, so a unit in
  recovery matches a BF16 `nn.Linear` on the same input exactly (the tests assert `torch.equal`).
- ``dequantize``: `W = CB * SCB[:, None] / 127`, computed by `bitsandbytes.functional.int8_vectorwise_dequant`
  from the INT8 weight and its per-row absmax. Each weight is then off by at most half a quantization step,
  `absmax_row / 254`, plus BF16 rounding; an output element is off by at most that times `sum_k |x_k|` per row
  plus the BF16 rounding of the output (the tests check this bound; the worst element on the tiny LLaMA with
  biases reaches 0.75 of it).
- ``auto`` (the default): checkpoint when the model's `name_or_path` is a local directory (or a Hub id whose
  `main` snapshot is in the default Hub cache) whose safetensors hold, under ``display_name + ".weight"``, a
  floating-point tensor of the right shape whose first row quantizes to the module's INT8 first row; else
  dequantize. So a checkpoint that is itself INT8 (a saved 8-bit model), or one the model was not quantized from
  (another revision, a re-saved fine-tune), is not used. The check reads one row, never a whole tensor. Which
  source a unit uses is `unit.source`; each `find_units` call logs the sources it chose once (logger ``gnmr_hf``).

Every unit of one `find_units` call shares a `RecoveryLedger` (`unit.ledger`) that counts the bytes of live
recovery weights and their peak, so the controller's `max_active` can be checked as a memory budget.

The gradient a unit is scored on (`signal=`): ``lora`` (the trainable parameters of the parent peft layer's
active adapters: lora_A/lora_B, DoRA magnitudes, embedding variants), ``weight`` (the module's own weight when it
is trainable; an INT8 weight never is), ``output_grad`` (an `OutputGradMeter` on the module's output; it only
fires where the output requires grad, so before the first trainable parameter call
`model.enable_input_require_grads()`), or ``auto`` (lora, else weight, else output_grad).

Limits: `Linear8bitLt(has_fp16_weights=True)` (INT8 matmuls over trainable fp16 weights) is refused with an
error. Merging adapters into the INT8 weight (peft `merge_adapter`) changes it under the unit: entering recovery
from the checkpoint while merged is refused, and a unit must not be in recovery across a merge or unmerge. The
wrapper is a closure over the unit, so deep-copy or pickle a model before `find_units` or after `close()`.
A failing `find_units` call closes the units it had already made, so it leaves the model as it was.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..units import DispatchContext, OutputGradMeter, RecoverableUnit, display_name

__all__ = ["BnbInt8Unit", "RecoveryLedger", "dispatch_bnb_int8", "is_bnb_available"]

logger = logging.getLogger("gnmr_hf")

SOURCES = ("auto", "checkpoint", "dequantize")
SIGNALS = ("auto", "lora", "weight", "output_grad")
# Checkpoint dtypes worth recovering from: anything narrower than BF16 is no better than the INT8 weight.
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})
_RECOVERY_DTYPE = torch.bfloat16
# Key under which one find_units call's shared state lives in `ctx.options` (options are copied per call).
_SHARED_KEY = "_bnb_int8_shared"
# Marks our forward wrapper, so a module already managed by a live unit is not wrapped twice.
_WRAPPER_ATTR = "_gnmr_bnb_int8_unit"


@functools.lru_cache
def is_bnb_available() -> bool:
    return importlib.util.find_spec("bitsandbytes") is not None


class RecoveryLedger:
    """Bytes held by the recovery weights of a group of units (those of one `find_units` call).

    `live_bytes` is the sum of `recovery_bytes()` over the units in recovery now; `peak_bytes` its maximum since
    creation or the last `reset_peak()`. It counts what the units hold, not what the allocator reports, so it is
    exact and free to read on any device.
    """

    def __init__(self) -> None:
        self.live_bytes = 0
        self.peak_bytes = 0
        self.live_units = 0

    def add(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.live_units += 1
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def remove(self, nbytes: int) -> None:
        self.live_bytes -= nbytes
        self.live_units -= 1

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __repr__(self) -> str:
        return (
            f"RecoveryLedger(live_bytes={self.live_bytes}, peak_bytes={self.peak_bytes}, live_units={self.live_units})"
        )


class _Checkpoint:
    """A model's local safetensors: key -> file, each file opened once (memory-mapped) and only when needed."""

    def __init__(self, directory: Path, weight_map: dict[str, str]) -> None:
        self.directory = directory
        self.weight_map = weight_map
        self._handles: dict[str, Any] = {}

    @classmethod
    def locate(cls, model: nn.Module) -> tuple[_Checkpoint | None, str]:
        """The checkpoint of `model` (a transformers model, or a peft model around one), or None and why not."""
        get_base_model = getattr(model, "get_base_model", None)
        base = get_base_model() if callable(get_base_model) else model
        name = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
        if not name:
            return None, "the model has no name_or_path (it was not loaded with from_pretrained)"
        directory = Path(name) if Path(name).is_dir() else _hub_snapshot(str(name))
        if directory is not None:
            index = directory / "model.safetensors.index.json"
            single = directory / "model.safetensors"
            if index.is_file():
                weight_map = json.loads(index.read_text())["weight_map"]
                return cls(directory, weight_map), ""
            if single.is_file():
                checkpoint = cls(directory, {})
                checkpoint.weight_map = dict.fromkeys(checkpoint._open(single.name).keys(), single.name)
                return checkpoint, ""
        return None, (
            f"the model's name_or_path {name!r} is neither a local directory nor a Hub model in the local cache "
            "holding model.safetensors or model.safetensors.index.json"
        )

    def _open(self, filename: str) -> Any:
        handle = self._handles.get(filename)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(str(self.directory / filename), framework="pt")
            self._handles[filename] = handle
        return handle

    def problem(self, key: str, module: nn.Linear) -> str | None:
        """Why `key` cannot serve as the BF16 weight of `module`; None when it can. Reads one row at most."""
        filename = self.weight_map.get(key)
        if filename is None:
            return f"the checkpoint in {str(self.directory)!r} has no tensor {key!r}"
        if not (self.directory / filename).is_file():
            return f"the checkpoint file {str(self.directory / filename)!r} holding {key!r} is missing"
        tensor_slice = self._open(filename).get_slice(key)
        found, dtype, shape = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype(), tuple(module.weight.shape)
        if found != shape:
            return f"the checkpoint tensor {key!r} has shape {list(found)}, the module's weight {list(shape)}"
        if dtype not in _FLOAT_DTYPES:
            return f"the checkpoint tensor {key!r} is {dtype}, not a floating-point weight of at least 16 bits"
        if not _quantizes_to(tensor_slice[0:1], module):
            return (
                f"row 0 of the checkpoint tensor {key!r} does not quantize to the module's INT8 row 0, so the model "
                "was not quantized from this checkpoint (another revision, merged adapters, a re-saved fine-tune?)"
            )
        return None

    def tensor(self, key: str) -> torch.Tensor:
        return self._open(self.weight_map[key]).get_tensor(key)


def _hub_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory of a Hub model in the default local cache (`main` revision); never the network.

    transformers 5 no longer records which revision it loaded, so a model loaded from another revision can find
    `main` here; the row check in `_Checkpoint.problem` is what keeps such a checkpoint from being used.
    """
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for filename in ("model.safetensors.index.json", "model.safetensors"):
        try:
            path = try_to_load_from_cache(repo_id, filename)
        except ValueError:  # not a valid repo id (e.g. a local path that no longer exists)
            return None
        if isinstance(path, str):
            return Path(path).parent
    return None


def _int8_scales(module: nn.Module) -> torch.Tensor | None:
    # bnb keeps the row scales on the weight until the first forward, then moves them to `module.state`.
    return module.state.SCB if module.state.SCB is not None else module.weight.SCB


@torch.no_grad()
def _quantizes_to(row: torch.Tensor, module: nn.Module) -> bool:
    """Whether a checkpoint row quantizes to the module's INT8 row 0 the way bitsandbytes quantizes (via fp16,
    absmax scale, round to nearest). A cheap guard: reading a whole tensor at discovery would cost a full load."""
    scales = _int8_scales(module)
    if scales is None:
        return False
    row16 = row.to(torch.float16).float().reshape(-1)
    scale = row16.abs().max()
    int8_row = module.weight.data[0].detach().float().cpu()
    # Slack for a model loaded in another dtype than the checkpoint's (fp32 -> bf16 -> fp16 rounds twice): 1% on
    # the scale, two INT8 steps on the row. Weights that are not this checkpoint's miss by far more.
    if not torch.isclose(scale, scales[0].detach().float().cpu(), rtol=1e-2, atol=0):
        return False
    expected = torch.round(row16 * (127.0 / scale)) if scale > 0 else torch.zeros_like(row16)
    return bool((expected - int8_row).abs().max() <= 2)


@dataclass
class _Shared:
    """What the units of one `find_units` call share: validated options, the ledger, the checkpoint."""

    model: nn.Module
    source: str
    signal: str
    ledger: RecoveryLedger = field(default_factory=RecoveryLedger)
    logged_sources: set[str] = field(default_factory=set)
    units: list[BnbInt8Unit] = field(default_factory=list)
    _checkpoint: _Checkpoint | None = None
    _checkpoint_problem: str | None = None

    def checkpoint(self) -> tuple[_Checkpoint | None, str]:
        if self._checkpoint is None and self._checkpoint_problem is None:
            self._checkpoint, self._checkpoint_problem = _Checkpoint.locate(self.model)
        return self._checkpoint, self._checkpoint_problem or ""


def _shared_state(ctx: DispatchContext) -> _Shared:
    shared = ctx.options.get(_SHARED_KEY)
    if shared is None:
        options = {k: v for k, v in ctx.options.items() if k != _SHARED_KEY}
        unknown = sorted(set(options) - {"source", "signal"})
        if unknown:
            raise ValueError(
                f"find_units(bnb_int8): unknown options {unknown}; known options are ['signal', 'source']"
            )
        source, signal = options.get("source", "auto"), options.get("signal", "auto")
        if source not in SOURCES:
            raise ValueError(f"find_units(bnb_int8): source must be one of {list(SOURCES)}, got {source!r}")
        if signal not in SIGNALS:
            raise ValueError(f"find_units(bnb_int8): signal must be one of {list(SIGNALS)}, got {signal!r}")
        shared = _Shared(model=ctx.model, source=source, signal=signal)
        ctx.options[_SHARED_KEY] = shared
    return shared


def _tuner_parent(model: nn.Module, fqn: str, module: nn.Module) -> nn.Module | None:
    """The peft tuner layer whose `base_layer` is `module`, if any (found by name: modules know no parent)."""
    if not fqn.endswith(".base_layer"):
        return None
    parent = model.get_submodule(fqn.removesuffix(".base_layer"))
    if getattr(parent, "base_layer", None) is not module or not hasattr(parent, "adapter_layer_names"):
        return None
    return parent


def _adapter_tensors(parent: nn.Module) -> list[torch.Tensor]:
    """Trainable parameters of the active adapters of a peft tuner layer, in peft's own layer-name order."""
    active = set(parent.active_adapters)
    # Keyed by identity: peft appends a DoRA layer's name to `adapter_layer_names` again, and a parameter may be
    # shared; a tensor counted twice would double its share of the unit's norm.
    tensors: dict[int, torch.Tensor] = {}
    for layer_name in parent.adapter_layer_names:
        for adapter, layer in getattr(parent, layer_name).items():
            if adapter not in active:
                continue
            params = [layer] if isinstance(layer, nn.Parameter) else list(layer.parameters())
            tensors.update((id(p), p) for p in params if p.requires_grad)
    return list(tensors.values())


class BnbInt8Unit(RecoverableUnit):
    """One bitsandbytes `Linear8bitLt`: INT8 matmul on the cheap path, BF16 matmul in recovery.

    Build it with `find_units(model, "bnb_int8", source=..., signal=...)`, not directly. Attributes: `source`
    ("checkpoint" or "dequantize"), `signal` (the resolved signal kind), `ledger` (shared `RecoveryLedger`),
    `parent` (the peft layer around the module, or None).
    """

    def __init__(
        self,
        name: str,
        module: nn.Linear,
        *,
        source: str,
        signal: str,
        ledger: RecoveryLedger,
        checkpoint: _Checkpoint | None = None,
        checkpoint_key: str | None = None,
        parent: nn.Module | None = None,
        signal_tensors: list[torch.Tensor] | None = None,
    ) -> None:
        super().__init__(name, module)
        self.source = source
        self.signal = signal
        self.ledger = ledger
        self.parent = parent
        self._checkpoint = checkpoint
        self._checkpoint_key = checkpoint_key
        self._signal_tensors = list(signal_tensors or [])
        self._weight: torch.Tensor | None = None
        self._closed = False
        if signal == "output_grad":
            self.output_grad = OutputGradMeter(module)
        self._previous_forward = module.__dict__.get("forward")
        self._install_forward()

    def _install_forward(self) -> None:
        cheap_forward: Callable[..., torch.Tensor] = self.module.forward

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            weight = self._weight
            if weight is None:
                return cheap_forward(x, *args, **kwargs)
            return self._recovery_forward(x, weight)

        setattr(forward, _WRAPPER_ATTR, self)
        self._forward = forward
        self.module.forward = forward

    def _recovery_forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        bias = self.module.bias
        # Autocast would turn this into an fp16 matmul under fp16 autocast; recovery promises BF16.
        with torch.autocast(device_type=x.device.type, enabled=False):
            out = F.linear(x.to(_RECOVERY_DTYPE), weight, None if bias is None else bias.to(_RECOVERY_DTYPE))
        return out.to(x.dtype)

    @property
    def in_recovery(self) -> bool:
        return self._weight is not None

    @property
    def checkpoint_dir(self) -> Path | None:
        """The directory of the safetensors the recovery weight is read from (source "checkpoint"), else None."""
        return None if self._checkpoint is None else self._checkpoint.directory

    @property
    def recovery_weight(self) -> torch.Tensor | None:
        """The BF16 weight while in recovery (read-only use), else None."""
        return self._weight

    def signal_tensors(self) -> list[torch.Tensor]:
        return list(self._signal_tensors)

    def recovery_bytes(self) -> int:
        # The bias is cast per forward rather than held, but it is the same bytes and keeps the count an upper bound.
        out_features, in_features = self.module.weight.shape
        bias = 0 if self.module.bias is None else self.module.bias.numel()
        return (out_features * in_features + bias) * _RECOVERY_DTYPE.itemsize

    def enter_recovery(self) -> None:
        if self._closed:
            raise RuntimeError(f"bnb_int8 unit {self.name!r} is closed; find the units again to use it")
        if self._weight is not None:
            return
        if self.source == "checkpoint" and self.parent is not None and getattr(self.parent, "merged", False):
            raise RuntimeError(
                f"bnb_int8 unit {self.name!r}: adapters are merged into its INT8 weight, so the checkpoint weight "
                "no longer matches it; unmerge them first or use source='dequantize'"
            )
        self._weight = self._materialize()
        self.ledger.add(self.recovery_bytes())

    def exit_recovery(self) -> None:
        if self._weight is None:
            return
        self._weight = None
        self.ledger.remove(self.recovery_bytes())

    @torch.no_grad()
    def _materialize(self) -> torch.Tensor:
        device = self.module.weight.device
        if self.source == "checkpoint":
            assert self._checkpoint is not None and self._checkpoint_key is not None
            return self._checkpoint.tensor(self._checkpoint_key).to(device=device, dtype=_RECOVERY_DTYPE)
        import bitsandbytes.functional as bnb_functional

        scb = _int8_scales(self.module)
        if scb is None:
            raise RuntimeError(f"bnb_int8 unit {self.name!r}: the INT8 weight has no row scales (SCB)")
        weight = bnb_functional.int8_vectorwise_dequant(self.module.weight.data, scb.to(device))
        return weight.to(_RECOVERY_DTYPE)

    def close(self) -> None:
        if self._closed:
            return
        super().close()
        if self.module.__dict__.get("forward") is self._forward:
            if self._previous_forward is None:
                del self.module.forward
            else:
                self.module.forward = self._previous_forward
        else:
            # Someone wrapped forward after us; removing ours would drop theirs. Ours stays, inert (no weight).
            logger.warning("bnb_int8 unit %r: forward was re-wrapped by someone else; left in place", self.name)
        self._closed = True


def dispatch_bnb_int8(module: nn.Module, fqn: str, ctx: DispatchContext) -> BnbInt8Unit | None:
    """A `BnbInt8Unit` for a bitsandbytes `Linear8bitLt` with INT8 weights, else None.

    Options (`ctx.options`, from `find_units(..., source=, signal=)`) are validated on the first call, so a bad
    value raises even on a model without any INT8 module. When a module cannot be a unit (ValueError), the units
    this `find_units` call already made are closed first, so that their forward wrappers do not outlive the call.
    """
    shared = _shared_state(ctx)
    try:
        unit = _dispatch(module, fqn, ctx, shared)
    except ValueError:
        for made in shared.units:
            made.close()
        raise
    if unit is not None:
        shared.units.append(unit)
    return unit


def _dispatch(module: nn.Module, fqn: str, ctx: DispatchContext, shared: _Shared) -> BnbInt8Unit | None:
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
    previous = module.__dict__.get("forward")
    if previous is not None and getattr(previous, _WRAPPER_ATTR, None) is not None:
        raise ValueError(
            f"bnb_int8 unit {name!r}: the module already belongs to another unit; close() the old units first"
        )

    source = shared.source
    checkpoint: _Checkpoint | None = None
    key = name + ".weight"
    if source != "dequantize":
        checkpoint, problem = shared.checkpoint()
        if checkpoint is not None:
            problem = checkpoint.problem(key, module) or ""
        if not problem:
            source = "checkpoint"
        elif source == "checkpoint":
            raise ValueError(
                f"bnb_int8 unit {name!r}: source='checkpoint' but {problem}. Use source='dequantize' (or 'auto') "
                "to rebuild the BF16 weight from the INT8 weight instead"
            )
        else:
            source, checkpoint = "dequantize", None

    parent = _tuner_parent(ctx.model, fqn, module)
    adapter_tensors = _adapter_tensors(parent) if parent is not None else []
    signal = shared.signal
    if signal == "auto":
        signal = "lora" if adapter_tensors else "weight" if weight.requires_grad else "output_grad"
    if signal == "lora" and not adapter_tensors:
        raise ValueError(
            f"bnb_int8 unit {name!r}: signal='lora' but the module has no peft adapter with trainable parameters"
        )
    if signal == "weight" and not weight.requires_grad:
        raise ValueError(
            f"bnb_int8 unit {name!r}: signal='weight' but its weight ({weight.dtype}) does not require grad; "
            "use signal='lora' or 'output_grad'"
        )
    tensors = {"lora": adapter_tensors, "weight": [weight], "output_grad": []}[signal]

    if source not in shared.logged_sources:
        shared.logged_sources.add(source)
        where = f" ({checkpoint.directory})" if checkpoint is not None else ""
        logger.info("bnb_int8: recovery weights from source=%s%s, first unit %r", source, where, name)
    return BnbInt8Unit(
        name,
        module,
        source=source,
        signal=signal,
        ledger=shared.ledger,
        checkpoint=checkpoint,
        checkpoint_key=key if checkpoint is not None else None,
        parent=parent,
        signal_tensors=tensors,
    )
