"""`act_quant`: the activations saved for the backward pass kept at `low_bits` on the cheap path, `high_bits` in
recovery (the paper's first scenario: 4-bit saved activations, 8-bit recovery, during pretraining).

What is compressed is only what autograd keeps between the forward and the backward pass. The forward output is
exact at every bit width; the backward pass computes the gradients from the stored, lower-precision copy. That is
where activation memory goes in training (it grows with batch x sequence x depth), and where the saving is.

Two kinds of unit (option `kinds`):

- **linear**: an `nn.Linear` (the q, k, v, o, gate, up, down projections of a LLaMA block, or any Linear that
  passes `include` / `exclude` / `module_filter_fn`). Its forward is `QuantSavedLinear`, a custom
  `torch.autograd.Function`: `F.linear` exactly, then its input quantized (`gnmr_hf.quant.quantize_absmax`) and
  handed to `ctx.save_for_backward` as packed codes plus float32 scales, so torch's saved-tensor hooks (activation
  offloading, memory meters) see the real packed bytes. The backward dequantizes it for the weight gradient; the
  input gradient needs only the weight and is exact. A Linear whose weight is frozen needs no saved input at all
  and saves none. Signal: its weight gradient (or its LoRA adapters', as `adapters.resolve_signal` decides).
- **attention**: a transformers attention module (one with `q_proj`, `k_proj`, `v_proj` and a config). Its
  attention runs through `act_quant_attention`, registered in transformers' `AttentionInterface` as
  ``attn_implementation="gnmr_act_quant"`` (with sdpa's boolean mask builder in `AttentionMaskInterface`): the model
  calls it exactly as it calls sdpa or flash attention, no modeling code is patched. It is FlashAttention-style:
  the forward saves q, k and v (quantized, after RoPE) and the float32 logsumexp of each query row, and the
  backward recomputes the attention probabilities P = exp(q k^T * scaling - lse) from them. With low-bit q and k
  the recomputed rows no longer sum to 1 (the stress the issue's probe measured); `renormalize=True` divides them
  by their sum, as an ablation. The softmax backward uses D = rowsum(P * dP) from the recomputed P, so nothing but
  q, k, v and lse is saved (FlashAttention's rowsum(dO * O) would also keep the output O). Signal: the gradients of
  that layer's q, k and v projection weights. `find_units` switches the model to this implementation
  (`PreTrainedModel.set_attn_implementation`) and `close()` of the last attention unit switches it back. On a CPU
  the score matrix is materialized (no tiling): the tiling of FlashAttention is a GPU memory optimization, what
  matters here is what is saved and what is recomputed.

Bits: 2..8 (absmax integers, packed: 4-bit codes two per byte) or 16, which means *unquantized*: the tensor itself
is saved, in its own dtype, and every gradient is the exact one. Scaling: one absmax scale per tensor
(`scaling="tensor"`), per row of the last dimension (`"row"`: per token of a Linear input, per token and head of
q/k/v), or per `group_size` contiguous elements of it (`"group"`). `stochastic=True` rounds stochastically
(unbiased), drawing from torch's default generator.

A flip changes what the *next* forward saves: the bits are read when the forward quantizes, so a tensor already
saved keeps its bits until its backward. A decision made from step t's gradients therefore applies from step t+1.

Memory ledger: a unit's recovery path holds, per forward, the extra bytes of its saved tensors at `high_bits` over
`low_bits` (computed from the shapes with `quantized_nbytes`, so exact). They vary with batch x sequence, so each
recovery forward re-states them with `ledger.hold`; `recovery_bytes()` is the largest value seen so far.

Fault injection: `unit.fault_scale` (1.0 = none) multiplies every `unit.fault_stride`-th scale of what the cheap
path saves (with `scaling="row"`, every k-th token's), a blown-up quantization scale, a local numerical fault that
bends the weight gradient's direction, not only its size; `benchmarks/fault_injection.py` uses it to corrupt one
unit's cheap path for a few steps.
"""

from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from ..quant import QuantizedTensor, quantize_absmax, quantized_nbytes
from ..units import Backend, BackendOptions, DispatchContext, RecoverableUnit, RecoveryLedger, display_name
from .adapters import SIGNALS, resolve_signal, signal_option, tuner_layer
from .switch import SwitchedUnit

__all__ = [
    "ACT_QUANT",
    "ATTN_IMPLEMENTATION",
    "ActQuantAttentionUnit",
    "ActQuantLinearUnit",
    "ActQuantOptions",
    "QuantSavedAttention",
    "QuantSavedLinear",
    "SaveCache",
    "SaveSpec",
    "act_quant_attention",
    "dispatch_act_quant_attention",
    "dispatch_act_quant_linear",
]

KINDS = ("linear", "attention")
SCALINGS = ("tensor", "row", "group")
UNQUANTIZED = 16
BITS = (2, 3, 4, 5, 6, 7, 8, UNQUANTIZED)
ATTN_IMPLEMENTATION = "gnmr_act_quant"

# The attention function receives the attention module, not the unit: this maps one to the other. Weak, so that a
# model dropped without closing its units leaves nothing behind.
_ATTENTION_UNITS: weakref.WeakKeyDictionary[nn.Module, ActQuantAttentionUnit] = weakref.WeakKeyDictionary()


@dataclass
class ActQuantOptions(BackendOptions):
    """Options of the `act_quant` backend (see the module docstring)."""

    backend: ClassVar[str] = "act_quant"

    low_bits: int = field(
        default=4, metadata={"help": "Bits of the saved activations on the cheap path: 2..8, or 16 (unquantized)."}
    )
    high_bits: int = field(
        default=8, metadata={"help": "Bits of the saved activations in recovery: 2..8, or 16; >= low_bits."}
    )
    scaling: str = field(
        default="tensor",
        metadata={
            "help": "Absmax scale granularity: 'tensor' (one per saved tensor), 'row' (one per row of the last "
            "dimension: per token, per token and head for q/k/v) or 'group' (one per group_size elements of it)."
        },
    )
    group_size: int = field(
        default=32, metadata={"help": "Elements per scale with scaling='group'; must divide the last dimension."}
    )
    stochastic: bool = field(default=False, metadata={"help": "Stochastic (unbiased) rounding instead of nearest."})
    kinds: list[str] = field(
        default_factory=lambda: ["linear"],
        metadata={
            "help": "Which units to make: 'linear' (nn.Linear saved inputs), 'attention' (saved q, k, v of "
            "attention); several separated by ';' on the command line, e.g. 'kinds=linear;attention'."
        },
    )
    renormalize: bool = field(
        default=False,
        metadata={"help": "Attention backward: divide the recomputed probabilities by their row sum (ablation)."},
    )
    signal: str = signal_option(note=" Linear units only: attention units use their q/k/v projection weights.")

    def __post_init__(self) -> None:
        self.check_choice("low_bits", BITS)
        self.check_choice("high_bits", BITS)
        if self.high_bits < self.low_bits:
            raise ValueError(
                f"act_quant option 'high_bits' must be >= low_bits (the recovery path is the high-fidelity one), "
                f"got high_bits={self.high_bits}, low_bits={self.low_bits}"
            )
        self.check_choice("scaling", SCALINGS)
        self.check_int("group_size", 1)
        self.check_choice("signal", SIGNALS)
        kinds = [self.kinds] if isinstance(self.kinds, str) else list(self.kinds)
        if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds):
            raise ValueError(
                f"act_quant option 'kinds' must be a non-empty list of distinct values from {list(KINDS)}, "
                f"got {self.kinds!r}"
            )
        self.kinds = kinds

    def spec(self, bits: int) -> SaveSpec:
        """How to save a tensor at `bits` with these options."""
        return SaveSpec(bits, self.scaling, self.group_size, self.stochastic)

    def extra_bytes(self, *tensors: torch.Tensor) -> int:
        """Bytes saving `tensors` at `high_bits` takes beyond saving them at `low_bits`: what recovery holds."""
        high, low = self.spec(self.high_bits), self.spec(self.low_bits)
        return sum(high.nbytes(t.shape, t.element_size()) - low.nbytes(t.shape, t.element_size()) for t in tensors)


@dataclass(frozen=True)
class SaveSpec:
    """How one forward saves a tensor: bit width (16: unquantized) and absmax scaling. `fault_scale` != 1 multiplies
    every `fault_stride`-th stored scale (every such row when unquantized): an injected fault."""

    bits: int
    scaling: str = "tensor"
    group_size: int = 32
    stochastic: bool = False
    fault_scale: float = 1.0
    fault_stride: int = 1

    def group_for(self, shape: torch.Size) -> int | None:
        """The `group_size` argument of `quantize_absmax` for a tensor of `shape`."""
        if self.scaling == "tensor":
            return None
        return shape[-1] if self.scaling == "row" else self.group_size

    def nbytes(self, shape: torch.Size, element_size: int) -> int:
        """Bytes saved for a tensor of `shape` whose elements take `element_size` bytes unquantized."""
        if self.bits == UNQUANTIZED:
            return shape.numel() * element_size
        return quantized_nbytes(shape, self.bits, self.group_for(shape))

    def save(
        self, x: torch.Tensor, cache: SaveCache | None = None
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any] | None]:
        """(tensors for `ctx.save_for_backward`, metadata for `restore`). With a `cache`, a tensor already quantized
        the same way (the one input q, k and v projections share) is not quantized and stored twice."""
        if self.bits == UNQUANTIZED:
            if self.fault_scale == 1.0:
                return (x,), None
            return (self._corrupt(x.reshape(-1, x.shape[-1])).reshape(x.shape),), None
        key = (self.bits, self.group_for(x.shape), self.stochastic, x._version)
        entry = None if cache is None else cache.get(x, key)
        if entry is None:
            q = quantize_absmax(x.detach(), self.bits, group_size=self.group_for(x.shape), stochastic=self.stochastic)
            entry = (q.tensors(), q.metadata())
            if cache is not None:
                cache.put(x, key, entry)
        (packed, scales), meta = entry
        return (packed, self._corrupt(scales.reshape(-1)).reshape(scales.shape)), meta

    def _corrupt(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` with every `fault_stride`-th one multiplied by `fault_scale` (a copy), or `rows` itself."""
        if self.fault_scale == 1.0:
            return rows
        rows = rows.clone()
        rows[:: self.fault_stride] *= self.fault_scale
        return rows

    @staticmethod
    def restore(saved: tuple[torch.Tensor, ...], meta: dict[str, Any] | None) -> torch.Tensor:
        """The tensor `save` kept, dequantized to its original shape and dtype."""
        return saved[0] if meta is None else QuantizedTensor.from_tensors(*saved, **meta).dequantize()


class SaveCache:
    """The quantized copies of live tensors, per quantization, for the units of one `find_units` call.

    Several Linears often read one tensor (q, k and v projections the same normalized hidden states; gate and up
    projections another): quantized once, the packed copy is saved once, as a fused QKV projection would save it.
    Keyed weakly by the tensor (an entry goes when the tensor does) and by its version counter (an in-place change
    makes a new entry).
    """

    def __init__(self) -> None:
        self._entries: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def get(self, x: torch.Tensor, key: tuple[Any, ...]) -> Any:
        return self._entries.get(x, {}).get(key)

    def put(self, x: torch.Tensor, key: tuple[Any, ...], entry: Any) -> None:
        per_tensor = self._entries.get(x)
        if per_tensor is None:
            per_tensor = self._entries[x] = {}
        per_tensor[key] = entry


def _cheap_spec(unit: ActQuantLinearUnit | ActQuantAttentionUnit) -> SaveSpec:
    """How a unit's cheap path saves: `low_bits`, corrupted by the unit's injected fault if it has one."""
    spec = unit.options.spec(unit.low_bits)
    if unit.fault_scale == 1.0:
        return spec
    return dataclasses.replace(spec, fault_scale=unit.fault_scale, fault_stride=unit.fault_stride)


# ------------------------------------------------------------------------------------------------ linear


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


class ActQuantLinearUnit(SwitchedUnit):
    """One `nn.Linear` whose saved input is kept at `low_bits` on the cheap path and `high_bits` in recovery.

    Build it with `find_units(model, "act_quant", ...)`. Attributes: `low_bits`, `high_bits`, `options`,
    `fault_scale` (1.0) and `fault_stride` (1; see the module docstring).
    """

    kind = "linear"

    def __init__(
        self, name: str, module: nn.Linear, *, options: ActQuantOptions, cache: SaveCache, **kwargs: Any
    ) -> None:
        self.options = options
        self._cache = cache
        self.low_bits, self.high_bits = options.low_bits, options.high_bits
        self.fault_scale, self.fault_stride = 1.0, 1
        self._max_extra = 0
        super().__init__(name, module, backend="act_quant", **kwargs)

    def describe(self) -> dict[str, Any]:
        return {"signal": self.signal, "kind": self.kind, "bits": f"{self.low_bits}/{self.high_bits}"}

    def recovery_bytes(self) -> int:
        return self._max_extra

    def cheap_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, _cheap_spec(self))

    def recovery_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.options.spec(self.high_bits))

    def _linear(self, x: torch.Tensor, spec: SaveSpec) -> torch.Tensor:
        m = self.module
        if torch.is_grad_enabled() and m.weight.requires_grad:
            extra = self.options.extra_bytes(x)
            self._max_extra = max(self._max_extra, extra)
            if self._recovering:
                self.ledger.hold(self, extra)
        return QuantSavedLinear.apply(x, m.weight, m.bias, spec, self._cache)

    def _enter(self) -> int:
        return self._max_extra


def dispatch_act_quant_linear(module: nn.Module, fqn: str, ctx: DispatchContext) -> ActQuantLinearUnit | None:
    """An `ActQuantLinearUnit` for an `nn.Linear` when `kinds` includes "linear", else None."""
    options: ActQuantOptions = ctx.options  # type: ignore[assignment]
    if "linear" not in options.kinds or not isinstance(module, nn.Linear):
        return None
    name = display_name(fqn)
    tuner = tuner_layer(ctx, module)
    return ActQuantLinearUnit(
        name,
        module,
        options=options,
        cache=ctx.shared.setdefault("act_quant_save_cache", SaveCache()),
        ledger=ctx.ledger,
        signal=resolve_signal(options.signal, name, module, tuner, "act_quant"),
        tuner=tuner,
    )


# --------------------------------------------------------------------------------------------- attention


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, Hkv, S, d] -> [B, Hkv * groups, S, d], each kv head repeated for its `groups` query heads (GQA)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _sum_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """Inverse of `_repeat_kv` for gradients: sum the `groups` copies of each kv head."""
    if groups == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // groups, groups, s, d).sum(2)


def _scores(
    q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor | None, is_causal: bool, scaling: float
) -> torch.Tensor:
    """Attention logits q k^T * scaling in float32 with the mask applied (-inf where a key is masked out)."""
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scaling
    if mask is not None:
        return s.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else s + mask.float()
    if is_causal:
        t, n = s.shape[-2:]
        # Query i sees keys up to i + (n - t): the keys before the queries (a cache) are all visible.
        keep = torch.ones(t, n, dtype=torch.bool, device=s.device).tril(diagonal=n - t)
        return s.masked_fill(~keep, -torch.inf)
    return s


class QuantSavedAttention(torch.autograd.Function):
    """softmax(q k^T * scaling + mask) v, FlashAttention-style: saves q, k, v as `spec` says and the float32 logsumexp
    of each query row, and recomputes the probabilities in the backward from them.

    Shapes: q [B, H, T, d], k and v [B, Hkv, S, d] with H a multiple of Hkv (GQA), mask None, bool [B or 1, 1, T, S]
    (True = attend) or additive float. Returns [B, H, T, d] in q's dtype. The forward is the eager computation (float32
    softmax, then the matmul with v in v's dtype); a row with every key masked gives zeros.
    """

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scaling: float,
        spec: SaveSpec,
        renormalize: bool,
    ) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        s = _scores(q, _repeat_kv(k, groups), mask, is_causal, scaling)
        lse = torch.logsumexp(s, dim=-1)
        # The forward is eager attention's own softmax (bit for bit); only the backward recomputes from lse.
        p = torch.softmax(s, dim=-1)
        if mask is not None:
            # A fully masked row: zeros (softmax of all -inf is NaN), and lse = 0 so that its recomputed
            # probabilities exp(-inf - 0) are zeros too. Unconditional: testing for such rows would sync the device.
            empty = torch.isneginf(lse)
            p = torch.where(empty.unsqueeze(-1), 0.0, p)
            lse = torch.where(empty, 0.0, lse)
        out = torch.matmul(p.to(v.dtype), _repeat_kv(v, groups))
        saved, metas = [], []
        for x in (q, k, v):
            tensors, meta = spec.save(x)
            saved.append(tensors)
            metas.append(meta)
        ctx.metas, ctx.counts = metas, [len(t) for t in saved]
        ctx.is_causal, ctx.scaling, ctx.renormalize, ctx.groups = is_causal, scaling, renormalize, groups
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        ctx.has_mask = mask is not None
        ctx.save_for_backward(*saved[0], *saved[1], *saved[2], lse, *((mask,) if mask is not None else ()))
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tensors = list(ctx.saved_tensors)
        restored = []
        for count, meta in zip(ctx.counts, ctx.metas, strict=True):
            restored.append(SaveSpec.restore(tuple(tensors[:count]), meta).float())
            del tensors[:count]
        q, k, v = restored
        lse = tensors[0]
        mask = tensors[1] if ctx.has_mask else None
        groups, scaling = ctx.groups, ctx.scaling
        k_rep, v_rep = _repeat_kv(k, groups), _repeat_kv(v, groups)
        p = torch.exp(_scores(q, k_rep, mask, ctx.is_causal, scaling) - lse.unsqueeze(-1))
        if ctx.renormalize:
            total = p.sum(-1, keepdim=True)
            p = p / torch.where(total > 0, total, 1.0)
        d_out = grad_out.float()
        d_v = torch.matmul(p.transpose(-2, -1), d_out)
        d_p = torch.matmul(d_out, v_rep.transpose(-2, -1))
        d_s = p * (d_p - (p * d_p).sum(-1, keepdim=True))
        d_q = torch.matmul(d_s, k_rep) * scaling
        d_k = torch.matmul(d_s.transpose(-2, -1), q) * scaling
        q_dtype, k_dtype, v_dtype = ctx.dtypes
        return (
            d_q.to(q_dtype),
            _sum_groups(d_k, groups).to(k_dtype),
            _sum_groups(d_v, groups).to(v_dtype),
            None,
            None,
            None,
            None,
            None,
        )


def act_quant_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The `attn_implementation="gnmr_act_quant"` function: transformers' attention-interface signature, returning
    ([B, T, H, d] output, None). Saves q, k, v at the bits of the module's unit (unquantized when it has none)."""
    if dropout > 0:
        raise ValueError(
            f"act_quant attention: attention dropout must be 0 (the backward recomputes the probabilities and "
            f"would need the dropout mask), got dropout={dropout}; set the model config's attention_dropout to 0"
        )
    unit = _ATTENTION_UNITS.get(module)
    spec, renormalize = SaveSpec(UNQUANTIZED), False
    if unit is not None:
        spec, renormalize = unit.current_spec(), unit.options.renormalize
        if torch.is_grad_enabled():
            unit.measure(query, key, value)
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    is_causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    out = QuantSavedAttention.apply(query, key, value, attention_mask, is_causal, scaling, spec, renormalize)
    return out.transpose(1, 2).contiguous(), None


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, act_quant_attention)
    # sdpa's builder: a boolean mask (True = attend), or None where the mask is purely causal.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


_register_attention()


class _AttentionSwitch:
    """Sets one model's `attn_implementation` to ours while any of its attention units is open, then restores it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.previous: str | None = None
        self.open = 0

    def acquire(self) -> None:
        if self.open == 0:
            self.previous = self.model.config._attn_implementation
            self.model.set_attn_implementation(ATTN_IMPLEMENTATION)
            if self.model.config._attn_implementation != ATTN_IMPLEMENTATION:
                raise ValueError(
                    f"act_quant attention units: {type(self.model).__name__} did not switch to "
                    f"attn_implementation={ATTN_IMPLEMENTATION!r} (it does not use transformers' attention "
                    "interface); drop 'attention' from kinds"
                )
        self.open += 1

    def release(self) -> None:
        self.open -= 1
        if self.open == 0 and self.model.config._attn_implementation == ATTN_IMPLEMENTATION:
            self.model.set_attn_implementation(self.previous)


class ActQuantAttentionUnit(RecoverableUnit):
    """One transformers attention module whose saved q, k, v are kept at `low_bits` / `high_bits`.

    No forward wrapper: the model calls `act_quant_attention` with this module, which reads the unit's bits.
    """

    kind = "attention"

    def __init__(
        self,
        name: str,
        module: nn.Module,
        *,
        options: ActQuantOptions,
        ledger: RecoveryLedger,
        switch: _AttentionSwitch,
    ) -> None:
        if module in _ATTENTION_UNITS:
            raise ValueError(
                f"act_quant unit {name!r}: the module already belongs to another unit; close() the old units first"
            )
        super().__init__(name, module)
        self.options = options
        self.low_bits, self.high_bits = options.low_bits, options.high_bits
        self.ledger = ledger
        self.fault_scale, self.fault_stride = 1.0, 1
        self._tensors = [getattr(module, p).weight for p in ("q_proj", "k_proj", "v_proj")]
        trainable = [t for t in self._tensors if t.requires_grad]
        if not trainable:
            raise ValueError(
                f"act_quant attention unit {name!r}: none of its q/k/v projection weights requires grad, so it has "
                "no signal; exclude it or drop 'attention' from kinds"
            )
        self._tensors = trainable
        self._recovering = False
        self._max_extra = 0
        self._switch = switch
        switch.acquire()
        _ATTENTION_UNITS[module] = self

    @property
    def in_recovery(self) -> bool:
        return self._recovering

    def signal_tensors(self) -> list[torch.Tensor]:
        return list(self._tensors)

    def describe(self) -> dict[str, Any]:
        return {"signal": "qkv_weight", "kind": self.kind, "bits": f"{self.low_bits}/{self.high_bits}"}

    def current_spec(self) -> SaveSpec:
        """How the next forward saves q, k, v."""
        return self.options.spec(self.high_bits) if self._recovering else _cheap_spec(self)

    def measure(self, *tensors: torch.Tensor) -> None:
        """Record the extra bytes the recovery path saves for these q, k, v; state them to the ledger in recovery."""
        extra = self.options.extra_bytes(*tensors)
        self._max_extra = max(self._max_extra, extra)
        if self._recovering:
            self.ledger.hold(self, extra)

    def recovery_bytes(self) -> int:
        return self._max_extra

    def enter_recovery(self) -> None:
        if self.closed:
            raise RuntimeError(f"act_quant unit {self.name!r} is closed; find the units again to use it")
        if not self._recovering:
            self._recovering = True
            self.ledger.hold(self, self._max_extra)

    def exit_recovery(self) -> None:
        if self._recovering:
            self._recovering = False
            self.ledger.release(self)

    def close(self) -> None:
        if self.closed:
            return
        super().close()
        if _ATTENTION_UNITS.get(self.module) is self:
            del _ATTENTION_UNITS[self.module]
        self._switch.release()


def _attention_switch(ctx: DispatchContext, module: nn.Module) -> _AttentionSwitch:
    """The switch of the transformers model that owns `module`'s config, made once per `find_units` call."""
    from transformers import PreTrainedModel

    switches: dict[int, _AttentionSwitch] = ctx.shared.setdefault("act_quant_attention_switches", {})
    config = module.config
    if id(config) not in switches:
        # The outermost PreTrainedModel with this config: its set_attn_implementation updates every submodel.
        owner = next((m for m in ctx.model.modules() if isinstance(m, PreTrainedModel) and m.config is config), None)
        if owner is None:
            raise ValueError(
                "act_quant attention units need a transformers PreTrainedModel (its attention interface is how "
                f"they run); {type(ctx.model).__name__} holds none with the attention module's config"
            )
        switches[id(config)] = _AttentionSwitch(owner)
    return switches[id(config)]


def _is_attention(module: nn.Module) -> bool:
    """A transformers attention module that calls the attention interface: q/k/v projections and a config."""
    config = getattr(module, "config", None)
    return (
        config is not None
        and hasattr(config, "_attn_implementation")
        and all(isinstance(getattr(module, p, None), nn.Module) for p in ("q_proj", "k_proj", "v_proj"))
    )


def dispatch_act_quant_attention(module: nn.Module, fqn: str, ctx: DispatchContext) -> ActQuantAttentionUnit | None:
    """An `ActQuantAttentionUnit` for a transformers attention module when `kinds` includes "attention", else None."""
    options: ActQuantOptions = ctx.options  # type: ignore[assignment]
    if "attention" not in options.kinds or not _is_attention(module):
        return None
    if getattr(module.config, "attention_dropout", 0.0):
        raise ValueError(
            f"act_quant attention unit {display_name(fqn)!r}: config.attention_dropout="
            f"{module.config.attention_dropout}, but the recomputing backward supports only 0"
        )
    return ActQuantAttentionUnit(
        display_name(fqn), module, options=options, ledger=ctx.ledger, switch=_attention_switch(ctx, module)
    )


ACT_QUANT = Backend(
    name="act_quant",
    dispatchers=(dispatch_act_quant_attention, dispatch_act_quant_linear),
    options=ActQuantOptions,
    hint=(
        "The act_quant backend manages nn.Linear layers (kinds=linear) and transformers attention modules with "
        "q_proj/k_proj/v_proj (kinds=attention)."
    ),
)
