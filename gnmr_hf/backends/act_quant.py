"""act_quant backend: the activations saved for the backward pass kept at `low_bits` on the cheap path, `high_bits`
in recovery (the paper's first scenario: 4-bit saved activations, 8-bit recovery, during pretraining).

The forward is exact at every width; only what autograd keeps for the backward is quantized (packed codes plus
float32 scales, so saved-tensor hooks see the real bytes). Unit kinds (`kinds`, or `all`): `linear`, an
`nn.Linear`'s saved input; `attention`, a transformers attention's saved q, k, v, through
`attn_implementation="gnmr_act_quant"` (FlashAttention-style: the backward recomputes the probabilities from q, k and
the row logsumexp); `mlp`, a SwiGLU MLP's product operands; `norm`, an RMSNorm's input; `head`, the output head's
input, with the causal-LM loss in chunks so that no logits are kept. A flip changes what the next forward saves.
Kinds, bits, scaling, bounds, the ledger and fault injection: docs/act_quant.md.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from abc import abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from ..fidelity import (
    OperandStats,
    Pending,
    TensorCache,
    defer,
    operand_loss,
    operand_losses,
    operand_stats,
    row_totals,
    take_rows,
)
from ..quant import (
    QuantizedTensor,
    absmax_round_rows,
    quantize_absmax,
    quantized_nbytes,
    round_codes,
    tensor_absmax_scale,
)
from ..signals import Signal, SignalOptions, adapter_tensors, signal_option
from ..units import Backend, DispatchContext, RecoverableUnit, SwitchedUnit, not_plain_linear, unit_of

__all__ = [
    "ACT_QUANT",
    "ATTN_IMPLEMENTATION",
    "BACKENDS",
    "ActQuantAttentionUnit",
    "ActQuantHeadUnit",
    "ActQuantLinearUnit",
    "ActQuantMLPUnit",
    "ActQuantNormUnit",
    "ActQuantOptions",
    "ChunkedHeadLoss",
    "QuantSavedAttention",
    "QuantSavedLinear",
    "QuantSavedRMSNorm",
    "QuantSavedRecompute",
    "SaveCache",
    "SaveSpec",
    "act_quant_attention",
]

KINDS = ("linear", "attention", "mlp", "norm", "head")
SCALINGS = ("tensor", "row", "group")
UNQUANTIZED = 16
BITS = (2, 3, 4, 5, 6, 7, 8, UNQUANTIZED)
ATTN_IMPLEMENTATION = "gnmr_act_quant"
_ATTENTION_UNIT = "_gnmr_attention_unit"


# How far above `max_row_total` a recomputed row's float32 sum must be before it is scaled: an exact row of n
# probabilities sums to 1 within ~n * 6e-8, so rows of up to ~16k keys on a faithful path are never touched.
ROW_TOTAL_SLACK = 1e-3


@dataclass
class ActQuantOptions(SignalOptions):
    """Options of the `act_quant` backend (see docs/act_quant.md)."""

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
            "attention), 'mlp' (the SwiGLU product's operands), 'norm' (RMSNorm inputs), 'head' (the output head's "
            "input, with the loss in chunks) or 'all'; several separated by ';' on the command line, e.g. "
            "'kinds=linear;attention'."
        },
    )
    renormalize: bool = field(
        default=False,
        metadata={"help": "Attention backward: divide the recomputed probabilities by their row sum (ablation)."},
    )
    max_row_total: float = field(
        default=1.0,
        metadata={
            "help": "Attention backward: a recomputed probability row whose sum exceeds this is scaled down to it "
            "(a row of probabilities sums to at most 1); rows below keep what the cheap path lost. > 0; 'inf' "
            "leaves the rows as recomputed, as the tiny-model tables of docs/results.md were measured."
        },
    )
    signal: str = signal_option(
        note=" Linear, norm and head units: attention units use their q/k/v projection weights, mlp units their "
        "gate/up projections' LoRA adapters or weights."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("low_bits", BITS)
        self.check_choice("high_bits", BITS)
        if self.high_bits < self.low_bits:
            raise ValueError(
                f"option 'high_bits' must be >= low_bits (the recovery path is the high-fidelity one), "
                f"got high_bits={self.high_bits}, low_bits={self.low_bits}"
            )
        self.check_choice("scaling", SCALINGS)
        self.check_int("group_size", 1)
        if not (isinstance(self.max_row_total, (int, float)) and self.max_row_total > 0):  # refuses nan too
            raise ValueError(
                f"option 'max_row_total' must be a number > 0 (1.0: rows of probabilities sum to at most 1; 'inf': "
                f"no cap), got {self.max_row_total!r}"
            )
        self.max_row_total = float(self.max_row_total)
        kinds = [self.kinds] if isinstance(self.kinds, str) else list(self.kinds)
        if kinds == ["all"]:
            kinds = list(KINDS)
        if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds):
            raise ValueError(
                f"option 'kinds' must be a non-empty list of distinct values from {list(KINDS)}, or 'all', got "
                f"{self.kinds!r}"
            )
        self.kinds = kinds

    def spec(self, bits: int) -> SaveSpec:
        """How to save a tensor at `bits` with these options (one `SaveSpec` per value, kept: every forward asks)."""
        key = (bits, self.scaling, self.group_size, self.stochastic)
        specs = self.__dict__.setdefault("_specs", {})
        if key not in specs:
            specs[key] = SaveSpec(*key)
        return specs[key]

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
        key = self._key(x)
        entry = None if cache is None else cache.get(x, key)
        if entry is None:
            q = quantize_absmax(x.detach(), self.bits, group_size=self.group_for(x.shape), stochastic=self.stochastic)
            entry = (q.tensors(), q.metadata())
            if cache is not None:
                cache.put(x, key, entry)
        (packed, scales), meta = entry
        return (packed, self._corrupt(scales.reshape(-1)).reshape(scales.shape)), meta

    def _key(self, x: torch.Tensor) -> tuple[Any, ...]:
        return (self.bits, self.group_for(x.shape), self.stochastic, x._version)

    def loss(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """What saving `x` this way loses (`gnmr_hf.fidelity.operand_loss` of the restored copy), on the rows `rows`
        of `x` (all when None)."""
        return operand_loss(take_rows(x, rows), self.restore_rows(x, rows))

    def stats(
        self, x: torch.Tensor, cache: SaveCache | None = None, rows: torch.Tensor | None = None, bias: bool = True
    ) -> OperandStats | Pending:
        """The `operand_stats` of `loss` (`bias`: with the row-sum bias), kept in `cache` so that the units reading
        one tensor measure it once, and using the scale of the copy the cache holds (the one saved) where there is
        one. On sampled `rows`, a `Pending` part: the rows and the scale are taken now, the rounding and the sums
        run in the step's batched pass."""
        key = ("stats", self, bias, x._version)
        cached = None if cache is None else cache.get(x, key)
        if cached is None:
            exact = take_rows(x.detach(), rows)
            if rows is None:
                cached = operand_stats(exact, self._rounded(x, exact, None, cache), bias)
            else:
                scale, group = self._tensor_scale(x, cache), self.group_for(x.shape)
                # The key is a value (spec, dtype, group, bias) and the function a plain one, so that the operands of
                # every unit with the same rounding finish together (bound methods compare their instance by id).
                # With one scale per tensor the part keeps that scale (a fault multiplies it); otherwise the row
                # indices, which row-local scales and a fault on unquantized rows need.
                kept = (rows,) if scale is None else (scale.reshape(1),)
                pending = Pending(SaveSpec._finish_losses, (self, x.dtype, group, bias), exact, *kept)
                cached = defer(pending)
            if cache is not None:
                cache.put(x, key, cached)
        return cached

    @staticmethod
    def _finish_losses(key: tuple[Any, ...], exact: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """[P] losses of P pending `stats`: their [P, R, W] rows and, as `stats` kept them, their [P] scales (one
        per tensor) or their [P, R] row indices; rounded as `_round_rows` rounds each tensor's rows, all at once."""
        self, dtype, group, bias = key
        exact = exact.float()
        if self.bits == UNQUANTIZED:
            hit = (kept % self.fault_stride == 0).unsqueeze(-1)
            rounded = exact if self.fault_scale == 1.0 else torch.where(hit, exact * self.fault_scale, exact)
        elif group is None:
            # Each tensor's rows at its own scale ([P, 1]); an injected fault multiplies that one scale.
            scale = kept.reshape(-1, 1)
            codes = round_codes(exact, scale, self.bits, stochastic=self.stochastic)
            rounded = codes.mul_((scale * self.fault_scale if self.fault_scale != 1.0 else scale).unsqueeze(-1))
        else:
            rounded = torch.stack(
                [self._round_rows(e, i, torch.float32, group, None) for e, i in zip(exact, kept, strict=True)]
            )
        if dtype != torch.float32:
            rounded = rounded.to(dtype).float()
        return operand_losses(exact, rounded, bias)

    def restore_rows(self, x: torch.Tensor, rows: torch.Tensor | None, cache: SaveCache | None = None) -> torch.Tensor:
        """Rows `rows` (all when None) of what saving `x` this way gives back, as [-1, x.shape[-1]], computing only
        those rows: with deterministic rounding the same values `restore(*save(x))` has there, faults included.
        One scale per tensor is the copy's in `cache` when it holds one, else computed from all of `x`."""
        return self._rounded(x, take_rows(x.detach(), rows), rows, cache).to(x.dtype)

    def _rounded(
        self, x: torch.Tensor, exact: torch.Tensor, rows: torch.Tensor | None, cache: SaveCache | None
    ) -> torch.Tensor:
        """`restore_rows` from `exact`, rows `rows` of `x` already taken, as float32 (of values in x's dtype)."""
        if rows is None:
            return take_rows(self.restore(*self.save(x, cache)), None).float()
        return self._round_rows(exact, rows, x.dtype, self.group_for(x.shape), self._tensor_scale(x, cache))

    def rounded_copy(self, x: torch.Tensor, cache: SaveCache | None = None) -> torch.Tensor:
        """What `restore(*save(x))` gives back (deterministic rounding, faults included), computed without packing
        the codes: for a measure that needs every row of the copy."""
        rows = take_rows(x.detach(), None)
        index = torch.arange(len(rows), device=x.device)
        scale = self._tensor_scale(x, cache)
        return self._round_rows(rows, index, x.dtype, self.group_for(x.shape), scale).to(x.dtype).reshape(x.shape)

    def _tensor_scale(self, x: torch.Tensor, cache: SaveCache | None) -> torch.Tensor | None:
        """The one scale of a quantized per-tensor copy of `x`: the saved copy's when `cache` holds it, else from
        all of `x`; None for a copy with row-local scales (or none)."""
        if self.bits == UNQUANTIZED or self.group_for(x.shape) is not None:
            return None
        entry = None if cache is None else cache.get(x, self._key(x))
        return tensor_absmax_scale(x.detach(), self.bits) if entry is None else entry[0][1]

    def _round_rows(
        self, exact: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, group: int | None, scale: Any
    ) -> torch.Tensor:
        """The rounded copy of `exact` (rows `rows` of a tensor of `dtype`), float32, faults included; `scale`: the
        tensor's one scale when it has one."""
        if self.bits == UNQUANTIZED:
            return self._corrupt_at(exact, rows).float()
        codes, scales = absmax_round_rows(
            None, exact, self.bits, group_size=group, stochastic=self.stochastic, scale=scale
        )  # fmt: skip
        if self.fault_scale != 1.0 and group is None:
            scales = scales * self.fault_scale  # the one scale: index 0, always hit
        elif self.fault_scale != 1.0:
            # Scale j of sampled row i is scale rows[i] * per_row + j of the whole tensor's.
            per_row = scales.shape[-1]
            index = (rows.unsqueeze(-1) * per_row + torch.arange(per_row, device=rows.device)).reshape(-1)
            scales = self._corrupt_at(scales.reshape(-1), index).reshape(scales.shape)
        rounded = codes.mul_(scales.unsqueeze(-1)).reshape(len(rows), -1)
        return rounded if dtype == torch.float32 else rounded.to(dtype).float()

    def _corrupt(self, rows: torch.Tensor) -> torch.Tensor:
        """`rows` with every `fault_stride`-th one multiplied by `fault_scale` (a copy), or `rows` itself."""
        if self.fault_scale == 1.0:
            return rows
        rows = rows.clone()
        rows[:: self.fault_stride] *= self.fault_scale
        return rows

    def _corrupt_at(self, rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """`_corrupt` for the rows `rows` that are rows `index` of the whole: those at a multiple of the stride."""
        if self.fault_scale == 1.0:
            return rows
        hit = (index % self.fault_stride == 0).reshape(-1, *([1] * (rows.dim() - 1)))
        return torch.where(hit, rows * self.fault_scale, rows)

    @staticmethod
    def restore(saved: tuple[torch.Tensor, ...], meta: dict[str, Any] | None) -> torch.Tensor:
        """The tensor `save` kept, dequantized to its original shape and dtype."""
        return saved[0] if meta is None else QuantizedTensor.from_tensors(*saved, **meta).dequantize()


class SaveCache(TensorCache):
    """The quantized copies of live tensors, per quantization, for the units of one `find_units` call.

    Several Linears often read one tensor (q, k and v projections the same normalized hidden states; gate and up
    projections another): quantized once, the packed copy is saved once, as a fused QKV projection would save it.
    Keyed weakly by the tensor (an entry goes when the tensor does) and by its version counter (an in-place change
    makes a new entry).
    """


class _SavesActivations(RecoverableUnit):
    """What both unit kinds share: the bits of the next forward's saved tensors, and the ledger's bytes.

    `fault_scale` (1.0 = none) multiplies every `fault_stride`-th scale the cheap path saves: an injected fault
    (`benchmarks/fault_injection.py`). The recovery path holds, per forward, the extra bytes of the saved tensors at
    `high_bits` over `low_bits`; they follow batch x sequence, so each recovery forward re-states them.
    """

    options: ActQuantOptions

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext[ActQuantOptions]) -> None:
        options = ctx.options
        self.low_bits, self.high_bits = options.low_bits, options.high_bits
        self.fault_scale, self.fault_stride = 1.0, 1
        self._max_extra = 0
        super().__init__(name, module, ctx)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": self.kind, "bits": f"{self.low_bits}/{self.high_bits}"}

    def current_spec(self) -> SaveSpec:
        """How the next forward saves: `high_bits` in recovery, else `low_bits` with any injected fault."""
        return self.options.spec(self.high_bits) if self._recovering else self.cheap_spec()

    def cheap_spec(self) -> SaveSpec:
        """How the cheap path saves (`low_bits`, with any injected fault), also while the unit is in recovery: its
        fidelity is measured on it either way."""
        spec = self.options.spec(self.low_bits)
        if self.fault_scale == 1.0:
            return spec
        return dataclasses.replace(spec, fault_scale=self.fault_scale, fault_stride=self.fault_stride)

    def measure(self, *tensors: torch.Tensor) -> None:
        """Record the extra bytes the recovery path saves for these tensors; state them to the ledger in recovery."""
        extra = self.options.extra_bytes(*tensors)
        self._max_extra = max(self._max_extra, extra)
        if self._recovering:
            self.ledger.hold(self, extra)

    def recovery_bytes(self) -> int:
        return self._max_extra

    def _enter(self) -> int:
        return self._max_extra


# ------------------------------------------------------------------------------------------------ linear


def _save_cache(ctx: DispatchContext) -> SaveCache:
    return SaveCache()


def _operand_parts(
    unit: RecoverableUnit, spec: SaveSpec, cache: SaveCache, tensors: Sequence[torch.Tensor], bias: bool = True
) -> list[OperandStats]:
    """`SaveSpec.stats` of each operand one unit saves, on the rows `unit.sample_rows` picks, for one report (its
    loss is the worst one's, as attention's q, k, v: the worst one is the one whose backward breaks first). `bias`:
    with the row-sum bias (False for a copy that feeds only a weight gradient, docs/method.md)."""
    return [spec.stats(x, cache, unit.sample_rows(x), bias) for x in tensors]


class _SwitchedSaves(_SavesActivations, SwitchedUnit):
    """A kind whose module's forward is replaced (every kind but attention): one forward for both paths, since what
    differs is only how it saves (`current_spec`); the kinds share one save cache per `find_units` call."""

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext) -> None:
        self._cache = ctx.once(_save_cache)
        super().__init__(name, module, ctx)

    @abstractmethod
    def saving_forward(self, *args: Any) -> Any:
        """The module's computation, saving for the backward as `current_spec()` says."""

    def cheap_forward(self, *args: Any) -> Any:
        return self.saving_forward(*args)

    def recovery_forward(self, *args: Any) -> Any:
        return self.saving_forward(*args)


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
    fidelity_bound = "saved input at low_bits: relative L2 error / 2"

    def saving_forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        training = torch.is_grad_enabled() and m.weight.requires_grad
        if training:
            self.measure(x)
        out = QuantSavedLinear.apply(x, m.weight, m.bias, self.current_spec(), self._cache)
        if training and self.measuring:
            # After the save: on the cheap path the cache holds the copy saved, whose scale the measure reuses. The
            # relative error only: the copy feeds only the weight-gradient GEMM, which sums over tokens, not along
            # the rows the bias is taken over (docs/method.md, "Fidelity").
            self.report_fidelity(*_operand_parts(self, self.cheap_spec(), self._cache, (x,), bias=False))
        return out


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
    q: torch.Tensor,
    k: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scaling: float,
    positions: torch.Tensor | None = None,
    num_queries: int | None = None,
) -> torch.Tensor:
    """Attention logits q k^T * scaling in float32 with the mask applied (-inf where a key is masked out). With
    `positions`, q holds only those query positions (of `num_queries`), and the mask is taken at them."""
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scaling
    if mask is not None:
        if positions is not None:
            mask = mask.index_select(-2, positions) if mask.shape[-2] > 1 else mask
        return s.masked_fill(~mask, -torch.inf) if mask.dtype == torch.bool else s + mask.float()
    if is_causal:
        n = s.shape[-1]
        t = s.shape[-2] if positions is None else num_queries
        query = torch.arange(s.shape[-2], device=s.device) if positions is None else positions
        # Query i sees keys up to i + (n - t): the keys before the queries (a cache) are all visible.
        keep = torch.arange(n, device=s.device) <= query.unsqueeze(-1) + (n - t)
        return s.masked_fill(~keep, -torch.inf)
    return s


def _recomputed_probabilities(
    q: torch.Tensor,
    k_rep: torch.Tensor,
    lse: torch.Tensor,
    mask: torch.Tensor | None,
    is_causal: bool,
    scaling: float,
    positions: torch.Tensor | None = None,
    num_queries: int | None = None,
) -> torch.Tensor:
    """P = exp(min(q k^T * scaling - lse, 0)), as the FlashAttention-style backward recomputes it from the saved q and
    k (`k_rep`: k with its heads repeated for GQA); `positions`: as for `_scores`.

    The exponent is capped at 0 because a probability is at most 1: exactly, every logit is <= its row's logsumexp,
    so the cap changes nothing on a faithful path. On a lossy one it keeps the recomputation finite: a trained LLM's
    logits reach the thousands (SmolLM2's massive activations), where 4-bit q and k move a logit by more than 88
    above the exact lse, and exp overflows float32 to inf, then d_s = p * (d_p - sum) gives inf - inf = NaN in q's,
    k's and every upstream gradient (137 of SmolLM2's parameters). Capped, such a row's entries are at most 1: the
    loss of fidelity stays visible (its rows' sums, `row_totals`, are > 1) but every gradient is finite. The
    backward then caps each row's sum (`ActQuantOptions.max_row_total`), which keeps the gradients' size bounded
    too, not only finite."""
    logits = _scores(q, k_rep, mask, is_causal, scaling, positions, num_queries)
    return torch.exp((logits - lse.unsqueeze(-1)).clamp(max=0.0))


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
        probe: Any = None,
        max_row_total: float = math.inf,
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
        cache = SaveCache() if probe is not None else None  # the measure reuses the saved copies' scales
        for x in (q, k, v):
            tensors, meta = spec.save(x, cache)
            saved.append(tensors)
            metas.append(meta)
        ctx.metas, ctx.counts = metas, [len(t) for t in saved]
        # probe: the unit measuring on the cheap path; the backward adds the recomputed rows' sums.
        ctx.probe = None
        if probe is not None:
            ctx.probe = (probe, _operand_parts(probe, spec, cache, (q, k, v)), probe.sample_rows(p))
        ctx.is_causal, ctx.scaling, ctx.renormalize, ctx.groups = is_causal, scaling, renormalize, groups
        ctx.max_row_total = max_row_total
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
        p = _recomputed_probabilities(q, k_rep, lse, mask, ctx.is_causal, scaling)
        if ctx.probe is not None:
            unit, operands, rows = ctx.probe
            unit.report_fidelity(*operands, row_totals(p, rows))
        if ctx.renormalize:
            total = p.sum(-1, keepdim=True)
            p = p / torch.where(total > 0, total, 1.0)
        elif ctx.max_row_total != math.inf:
            # A row the lossy q and k push above max_row_total is scaled down to it; rows below are left as they
            # are. Without it, d_s = p * (d_p - rowsum(p * d_p)) grows with the row's sum (up to the row's length
            # with every entry capped at 1), and the growth compounds layer over layer in the backward: on
            # SmolLM2-135M (30 layers, logits in the thousands) 4-bit q, k took the gradient norm from 5.4 (exact)
            # to 7.5e27 (float32 norms overflow to inf, the Trainer's clipping zeroes the step), 7e11 with
            # per-token scales; capped at 1, 6.8. A cap of 2 still gave 4e4 and of 4 gave 4e16 (docs/act_quant.md).
            # Rows within float rounding of the cap (a faithful path's sum to 1) are left bit for bit.
            ratio = p.sum(-1, keepdim=True) / ctx.max_row_total
            p = p / torch.where(ratio > 1.0 + ROW_TOTAL_SLACK, ratio, 1.0)
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
    unit = unit_of(module)
    spec, renormalize, max_row_total, probe = SaveSpec(UNQUANTIZED), False, math.inf, None
    if scaling is None:
        scaling = query.shape[-1] ** -0.5
    is_causal = bool(kwargs.get("is_causal", getattr(module, "is_causal", True)))
    if isinstance(unit, ActQuantAttentionUnit):
        spec, renormalize, max_row_total = unit.current_spec(), unit.options.renormalize, unit.options.max_row_total
        if torch.is_grad_enabled():
            unit.measure(query, key, value)
            if unit.measuring:
                if unit.in_recovery:
                    unit.report_fidelity(*unit.shadow_parts(query, key, value, attention_mask, is_causal, scaling))
                else:
                    probe = unit
    out = QuantSavedAttention.apply(
        query, key, value, attention_mask, is_causal, scaling, spec, renormalize, probe, max_row_total
    )
    return out.transpose(1, 2).contiguous(), None


@functools.cache
def _register_attention() -> None:
    """Register `act_quant_attention` in transformers' interfaces, once, when the first attention unit is made."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTN_IMPLEMENTATION, act_quant_attention)
    # sdpa's builder: a boolean mask (True = attend), or None where the mask is purely causal.
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, sdpa_mask)


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


class ActQuantAttentionUnit(_SavesActivations):
    """One transformers attention module whose saved q, k, v are kept at `low_bits` / `high_bits`. No forward
    wrapper: the model calls `act_quant_attention` with this module, which reads the unit's bits. Signal: the
    gradients of its q, k and v projection weights."""

    kind = "attention"
    fidelity_bound = (
        "saved q, k, v at low_bits and the probabilities the backward recomputes from them: max(relative L2 error "
        "/ 2, row-sum bias / 0.1, mean |row sum - 1| / 0.1)"
    )

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext) -> None:
        if getattr(module.config, "attention_dropout", 0.0):
            raise ValueError(
                f"act_quant attention unit {name!r}: config.attention_dropout={module.config.attention_dropout}, "
                "but the recomputing backward supports only 0"
            )
        _register_attention()
        self._switch = _attention_switch(ctx, module)
        self._switch.acquire()
        try:
            super().__init__(name, module, ctx)
        except BaseException:
            self._switch.release()
            raise
        # The module keeps its unit alive until close(), as a switched unit's forward does: the attention function
        # finds the unit through the module's weak owner mark, and a unit dropped with its UnitSet would otherwise
        # leave attention saving q, k, v unquantized without a word.
        module.__dict__[_ATTENTION_UNIT] = self

    def find_signal(self, ctx: DispatchContext) -> Signal:
        weights = [getattr(self.module, p).weight for p in ("q_proj", "k_proj", "v_proj")]
        trainable = [w for w in weights if w.requires_grad]
        if not trainable:
            raise ValueError(
                f"act_quant attention unit {self.name!r}: none of its q/k/v projection weights requires grad, so it "
                "has no signal; exclude it or drop 'attention' from kinds"
            )
        return Signal("qkv_weight", trainable)

    @torch.no_grad()
    def shadow_parts(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scaling: float,
    ) -> list[Any]:
        """What the cheap path would lose on this forward's q, k, v (measured in recovery, where the backward runs
        on the high_bits copies): the operands' loss and the row sums of the probabilities recomputed from the
        low_bits q and k, exactly as the cheap path's backward would, at the query positions sampled
        (`fidelity_rows` rows over batch and heads; all when 0). One extra QK^T per recovered unit, on those rows."""
        spec = self.cheap_spec()
        b, h, t, d = q.shape
        per_head = -(-self.fidelity_rows // (b * h)) if self.fidelity_rows else 0
        positions = self.sample_rows(q[0, 0], per_head)  # query positions: the rows of one head's q
        q_rows = None
        if positions is not None:
            q_rows = (torch.arange(b * h, device=q.device).unsqueeze(-1) * t + positions).reshape(-1)
        q_low = spec.restore_rows(q, q_rows).reshape(b, h, -1, d)
        k_low = spec.rounded_copy(k)  # every key: the probabilities' rows sum over all of them
        k_rows = self.sample_rows(k)
        operands = [
            operand_stats(take_rows(q, q_rows), q_low.reshape(-1, d)),
            operand_stats(take_rows(k, k_rows), take_rows(k_low, k_rows)),
            spec.stats(v, rows=self.sample_rows(v)),
        ]
        groups = h // k.shape[1]
        q_exact = q if positions is None else q.index_select(2, positions)
        exact = _scores(q_exact, _repeat_kv(k, groups), mask, is_causal, scaling, positions, t)
        lse = torch.logsumexp(exact, dim=-1)
        lse = torch.where(torch.isneginf(lse), 0.0, lse)
        p = _recomputed_probabilities(q_low, _repeat_kv(k_low, groups), lse, mask, is_causal, scaling, positions, t)
        return [*operands, row_totals(p)]

    def _close(self) -> None:
        self.module.__dict__.pop(_ATTENTION_UNIT, None)
        self._switch.release()


def _attention_switches(ctx: DispatchContext) -> dict[int, _AttentionSwitch]:
    return {}


def _attention_switch(ctx: DispatchContext, module: nn.Module) -> _AttentionSwitch:
    """The switch of the transformers model that owns `module`'s config, made once per `find_units` call."""
    from transformers import PreTrainedModel

    switches = ctx.once(_attention_switches)
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


# ---------------------------------------------------------------------------------------- mlp and norm


class QuantSavedRecompute(torch.autograd.Function):
    """`fn(*inputs)` computed exactly, whose inputs are saved as `spec` says; the backward recomputes `fn` on the
    restored copies under autograd (activation checkpointing from a quantized checkpoint). For a cheap elementwise
    `fn` (SwiGLU's `act_fn(g) * u`), next to the GEMMs around it; the recompute runs under the forward's autocast.
    """

    @staticmethod
    def forward(ctx: Any, fn: Any, spec: SaveSpec, cache: SaveCache | None, *inputs: torch.Tensor) -> torch.Tensor:
        # Grad mode is off here: the module's own computation, bit for bit.
        out = fn(*inputs)
        saved: list[torch.Tensor] = []
        ctx.metas, ctx.counts = [], []
        for x in inputs:
            packed, meta = spec.save(x, cache)
            saved += packed
            ctx.metas.append(meta)
            ctx.counts.append(len(packed))
        ctx.fn = fn
        device = inputs[0].device.type
        ctx.autocast = (device, torch.get_autocast_dtype(device), torch.is_autocast_enabled(device))
        ctx.save_for_backward(*saved)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tensors = list(ctx.saved_tensors)
        inputs = []
        for i, (count, meta) in enumerate(zip(ctx.counts, ctx.metas, strict=True)):
            x = SaveSpec.restore(tuple(tensors[:count]), meta).detach()
            inputs.append(x.requires_grad_(ctx.needs_input_grad[3 + i]))
            del tensors[:count]
        wanted = [x for x in inputs if x.requires_grad]
        grads: list[torch.Tensor | None] = [None] * len(inputs)
        if wanted:
            device, dtype, enabled = ctx.autocast
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
                out = ctx.fn(*inputs)
            found = iter(torch.autograd.grad(out, wanted, grad_out))
            grads = [next(found) if x.requires_grad else None for x in inputs]
        return None, None, None, *grads


class ActQuantMLPUnit(_SwitchedSaves):
    """One SwiGLU MLP (`down_proj(act_fn(gate_proj(x)) * up_proj(x))`, LLaMA's `LlamaMLP`) whose product saves its
    operands, the gate and up projections' outputs, at `low_bits` / `high_bits`; the backward recomputes `act_fn`
    from the saved gate output. The projections themselves are `linear` units (or plain Linears). Signal: the
    gradients of its gate and up projections' LoRA adapters, else weights (the nearest trainable tensors the saved
    operands feed), else of its output."""

    kind = "mlp"
    fidelity_bound = (
        "saved gate and up outputs at low_bits: the worst of max(relative L2 error / 2, row-sum bias / 0.1)"
    )

    def find_signal(self, ctx: DispatchContext) -> Signal:
        # The LoRA adapters of the projections when they have some, else their trainable weights, else (a frozen
        # MLP, nothing of its own to score) the gradient of the MLP's output.
        projections = [getattr(self.module, p) for p in ("gate_proj", "up_proj")]
        tuners = [ctx.tuner(getattr(m, "base_layer", m)) for m in projections]
        lora = [t for tuner in tuners if tuner is not None for t in adapter_tensors(tuner)]
        if lora:
            return Signal("gate_up_lora", lora)
        weights = [m.weight for m in projections if m.weight.requires_grad]
        return Signal("gate_up_weight", weights) if weights else Signal("output_grad", [])

    def _product(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        return self.module.act_fn(gate) * up

    def saving_forward(self, x: torch.Tensor) -> torch.Tensor:
        m = self.module
        gate, up = m.gate_proj(x), m.up_proj(x)
        if not (torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)):
            return m.down_proj(self._product(gate, up))
        self.measure(gate, up)
        product = QuantSavedRecompute.apply(self._product, self.current_spec(), self._cache, gate, up)
        if self.measuring:  # after the save: the measure reuses the saved copies' scales
            self.report_fidelity(*_operand_parts(self, self.cheap_spec(), self._cache, (gate, up)))
        return m.down_proj(product)


class QuantSavedRMSNorm(torch.autograd.Function):
    """An RMSNorm, `weight * (x * rstd).to(x.dtype)` with `rstd = rsqrt(mean(x^2) + eps)` in float32, computed by the
    module's own `forward` (bit for bit); saves `x` as `spec` says and the exact float32 `rstd` (one per row). The
    backward uses the restored `x` with the exact `rstd`: a row of `x` rounded to zeros does not blow up its scale."""

    @staticmethod
    def forward(
        ctx: Any,
        forward: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        spec: SaveSpec,
        cache: SaveCache | None,
    ) -> torch.Tensor:
        out = forward(x)
        rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
        saved, ctx.meta = spec.save(x, cache)
        ctx.count = len(saved)
        ctx.save_for_backward(*saved, rstd, weight)
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        *saved, rstd, weight = ctx.saved_tensors
        x = SaveSpec.restore(tuple(saved), ctx.meta)
        y = (x.float() * rstd).to(x.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[2]:
            grad_w = (grad_out * y).reshape(-1, y.shape[-1]).sum(0).to(weight.dtype)
        if ctx.needs_input_grad[1]:
            dy = (grad_out * weight).float()
            y32 = x.float() * rstd
            grad_x = (rstd * (dy - y32 * (dy * y32).mean(-1, keepdim=True))).to(x.dtype)
        return None, grad_x, grad_w, None, None, None


class ActQuantNormUnit(_SwitchedSaves):
    """One RMSNorm module (LLaMA's `LlamaRMSNorm`: `weight * x / rms(x)`) whose input is saved at `low_bits` /
    `high_bits` instead of what its ops keep (the input and the normalized copy), with its exact per-row `rstd`.
    Signal: its own weight's gradient (`signal=`)."""

    kind = "norm"
    fidelity_bound = "saved input at low_bits: max(relative L2 error / 2, row-sum bias / 0.1)"

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext) -> None:
        self.eps = _check_rms_norm(name, module)
        super().__init__(name, module, ctx)

    def saving_forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.module.weight
        if not (torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad)):
            return self._module_forward(x)
        self.measure(x)
        out = QuantSavedRMSNorm.apply(self._module_forward, x, weight, self.eps, self.current_spec(), self._cache)
        if self.measuring:  # after the save: the measure reuses the saved copy's scale
            self.report_fidelity(*_operand_parts(self, self.cheap_spec(), self._cache, (x,)))
        return out


def _check_rms_norm(name: str, module: nn.Module) -> float:
    """The module's epsilon, after checking on a probe row that it computes LLaMA's RMSNorm (Gemma's `1 + weight`
    or a LayerNorm would get wrong gradients from `QuantSavedRMSNorm`). The probe runs with a weight of its own
    (`functional_call`), so a sharded or offloaded weight is neither read nor gathered."""
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    weight = getattr(module, "weight", None)
    if isinstance(eps, float) and isinstance(weight, torch.Tensor) and weight.dim() == 1:
        n = weight.shape[0]
        x, w = torch.linspace(-2.0, 3.0, n), torch.linspace(0.5, 1.5, n)
        with torch.no_grad():
            out = torch.func.functional_call(module, {"weight": w}, (x,))
        if torch.allclose(out, w * x * torch.rsqrt(x.pow(2).mean() + eps), rtol=1e-4, atol=1e-6):
            return eps
    raise ValueError(
        f"act_quant norm unit {name!r}: {type(module).__name__} does not compute LLaMA's RMSNorm, "
        "weight * x * rsqrt(mean(x^2) + eps) with eps in variance_epsilon or eps; exclude it or drop 'norm' from kinds"
    )


def _is_swiglu_mlp(module: nn.Module) -> bool:
    """A gated MLP of the LLaMA family: gate/up/down projections and an `act_fn`."""
    return callable(getattr(module, "act_fn", None)) and all(
        isinstance(getattr(module, p, None), nn.Module) for p in ("gate_proj", "up_proj", "down_proj")
    )


def _is_norm(module: nn.Module) -> bool:
    """A leaf module whose class is named `*RMSNorm` (transformers' RMSNorms; `ActQuantNormUnit` checks the math)."""
    return type(module).__name__.endswith("RMSNorm") and next(module.children(), None) is None


# ---------------------------------------------------------------------------------------------- the head

# Logit elements one chunk of the loss holds (16 MiB in float32): at a 32k vocabulary, 131 tokens per chunk.
LOSS_CHUNK_ELEMENTS = 2**22


class ChunkedHeadLoss(torch.autograd.Function):
    """Causal-LM cross entropy whose backward never needs the full logits: the forward takes the loss from the exact
    logits, chunk of rows by chunk; it saves the head's input `h` as `spec` says (not the logits, not their
    log-softmax) and the backward recomputes each chunk's logits from the restored `h` and the head weight, takes
    their softmax (rows that sum to 1) and forms the gradients of `h`, the weight and the bias, as Liger's fused
    linear cross-entropy does. `targets`: [N] with `ignore_index` where no loss is taken; `denom`: what the summed
    loss is divided by (transformers' `num_items_in_batch`, else the number of targets)."""

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        h: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        ignore_index: int,
        denom: torch.Tensor | float | None,
        spec: SaveSpec,
        cache: SaveCache | None,
    ) -> torch.Tensor:
        rows = logits.reshape(-1, logits.shape[-1])
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        chunk = max(1, LOSS_CHUNK_ELEMENTS // rows.shape[-1])
        total = rows.new_zeros((), dtype=torch.float32)
        for i in range(0, rows.shape[0], chunk):
            z = rows[i : i + chunk].float()
            picked = z.gather(1, safe[i : i + chunk, None]).squeeze(1)
            total = total + torch.where(valid[i : i + chunk], torch.logsumexp(z, -1) - picked, 0.0).sum()
        if denom is None:
            denom = valid.sum()
        if isinstance(denom, torch.Tensor):
            denom = denom.to(total.device)
        loss = total / denom
        saved, ctx.meta = spec.save(h, cache)
        ctx.count, ctx.chunk, ctx.denom = len(saved), chunk, denom
        ctx.h_shape, ctx.h_dtype, ctx.logits_dtype = h.shape, h.dtype, logits.dtype
        ctx.save_for_backward(*saved, weight, *((bias,) if bias is not None else ()), safe, valid)
        ctx.has_bias = bias is not None
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        tensors = ctx.saved_tensors
        h = SaveSpec.restore(tuple(tensors[: ctx.count]), ctx.meta).reshape(-1, ctx.h_shape[-1])
        weight, rest = tensors[ctx.count], tensors[ctx.count + 1 :]
        bias = rest[0] if ctx.has_bias else None
        safe, valid = rest[-2], rest[-1]
        # The logits' dtype: the head's GEMM runs as it did in the forward (e.g. bf16 under autocast).
        dtype = ctx.logits_dtype
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        scale = (grad_loss / ctx.denom).float()
        grad_h = torch.empty(h.shape, dtype=dtype, device=h.device)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        grad_b = None if bias is None else torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
        for i in range(0, h.shape[0], ctx.chunk):
            hc = h[i : i + ctx.chunk].to(dtype)
            d = torch.softmax(F.linear(hc, w, b).float(), dim=-1)
            d[torch.arange(d.shape[0], device=d.device), safe[i : i + ctx.chunk]] -= 1.0
            d = d * (valid[i : i + ctx.chunk, None] * scale)
            grad_h[i : i + ctx.chunk] = d.to(dtype) @ w
            grad_w += (d.t() @ hc.float()) if dtype == torch.float32 else (d.to(dtype).t() @ hc).float()
            if grad_b is not None:
                grad_b += d.sum(0)
        return (
            None,
            grad_h.reshape(ctx.h_shape).to(ctx.h_dtype),
            grad_w.to(weight.dtype),
            None if grad_b is None else grad_b.to(bias.dtype),
            None,
            None,
            None,
            None,
            None,
        )


class ActQuantHeadUnit(_SwitchedSaves):
    """The output head (the model's `get_output_embeddings()` Linear) whose input is saved at `low_bits` /
    `high_bits`, with the causal-LM loss computed in chunks (`ChunkedHeadLoss`) so that neither the full logits nor
    their log-softmax are kept for the backward. The unit sets the model's `loss_function` (transformers' own
    setter) while it is open; logits it did not make (no grad, or made elsewhere) go to the model's own loss. The
    logits the model returns are exact and still differentiable (as a `linear` unit's output, same saved copy).
    Signal: its weight's gradient (`signal=`)."""

    kind = "head"
    fidelity_bound = "saved input at low_bits: max(relative L2 error / 2, row-sum bias / 0.1)"

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext) -> None:
        from transformers.loss.loss_utils import LOSS_MAPPING

        owner = _head_owner(ctx, module)
        if owner.loss_function is not LOSS_MAPPING["ForCausalLM"]:
            raise ValueError(
                f"act_quant head unit {name!r}: {type(owner).__name__}'s loss is {owner.loss_function!r}; the chunked "
                "loss replaces only transformers' ForCausalLMLoss; drop 'head' from kinds"
            )
        # The head input of each live logits tensor this unit made, for the loss to start from.
        self._inputs: WeakTensorKeyDictionary = WeakTensorKeyDictionary()
        super().__init__(name, module, ctx)
        self._owner = owner
        self._previous_loss = owner.__dict__.get("_loss_function")
        owner.loss_function = self._loss

    def saving_forward(self, h: torch.Tensor) -> torch.Tensor:
        m = self.module
        if not (torch.is_grad_enabled() and m.weight.requires_grad):
            return self._module_forward(h)
        self.measure(h)
        logits = QuantSavedLinear.apply(h, m.weight, m.bias, self.current_spec(), self._cache)
        if self.measuring:
            # Unlike a linear unit's, the copy also feeds the logits the backward recomputes (a GEMM summing along
            # its rows), so the row-sum bias counts.
            self.report_fidelity(*_operand_parts(self, self.cheap_spec(), self._cache, (h,)))
        self._inputs[logits] = (h, self.current_spec())
        return logits

    def _loss(
        self,
        logits: torch.Tensor,
        labels: torch.Tensor,
        vocab_size: int,
        num_items_in_batch: torch.Tensor | None = None,
        ignore_index: int = -100,
        shift_labels: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> torch.Tensor:
        from transformers.loss.loss_utils import ForCausalLMLoss

        made = self._inputs.pop(logits, None)
        if made is None or not torch.is_grad_enabled():
            return ForCausalLMLoss(
                logits, labels, vocab_size, num_items_in_batch, ignore_index, shift_labels, **kwargs
            )
        h, spec = made
        if shift_labels is None:
            # As ForCausalLMLoss: position i predicts token i + 1; the last position predicts nothing.
            shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        targets = shift_labels.reshape(-1).to(logits.device)
        m = self.module
        return ChunkedHeadLoss.apply(
            logits.detach(), h, m.weight, m.bias, targets, ignore_index, num_items_in_batch, spec, self._cache
        )

    def _close(self) -> None:
        super()._close()
        if self._owner.__dict__.get("_loss_function") == self._loss:
            if self._previous_loss is None:
                del self._owner._loss_function
            else:
                self._owner.loss_function = self._previous_loss


def _head_owner(ctx: DispatchContext, module: nn.Module) -> nn.Module:
    """The outermost transformers model whose output embeddings `module` is (its `loss_function` is the loss)."""
    from transformers import PreTrainedModel

    for m in ctx.model.modules():
        if isinstance(m, PreTrainedModel) and m.get_output_embeddings() is module:
            return m
    raise ValueError(f"act_quant head unit: {type(ctx.model).__name__} has no transformers model whose head it is")


def _output_heads(ctx: DispatchContext) -> set[int]:
    from transformers import PreTrainedModel

    heads = set()
    for m in ctx.model.modules():
        if isinstance(m, PreTrainedModel):
            head = m.get_output_embeddings()
            if isinstance(head, nn.Linear):
                heads.add(id(head))
    return heads


def _act_quant_unit(module: nn.Module, ctx: DispatchContext[ActQuantOptions]) -> type[RecoverableUnit] | None:
    kinds = ctx.options.kinds
    if "attention" in kinds and _is_attention(module):
        return ActQuantAttentionUnit
    if "mlp" in kinds and _is_swiglu_mlp(module):
        return ActQuantMLPUnit
    if "norm" in kinds and _is_norm(module):
        return ActQuantNormUnit
    head = "head" in kinds and id(module) in ctx.once(_output_heads)
    if head or ("linear" in kinds and isinstance(module, nn.Linear)):
        # Both compute F.linear on the module's own weight in place of its forward: refuse a quantized layer now,
        # not at the first forward with a dtype error deep in autograd.
        quantized = not_plain_linear(module)
        if quantized is not None:
            raise ValueError(
                f"backend 'act_quant' cannot take a {quantized} layer: act_quant wraps the plain nn.Linear, "
                "attention, MLP, RMSNorm and output-head modules of a model that is not quantized. For a "
                "bitsandbytes model use backend='bnb_int8' (Linear8bitLt) or 'bnb_4bit' (Linear4bit), for torchao "
                "Float8Linear 'torchao_float8'; or keep these layers out with exclude"
            )
        return ActQuantHeadUnit if head else ActQuantLinearUnit
    return None


ACT_QUANT = Backend(
    name="act_quant",
    unit_for=_act_quant_unit,
    options=ActQuantOptions,
    hint=(
        "The act_quant backend manages nn.Linear layers (kinds=linear), transformers attention modules with "
        "q_proj/k_proj/v_proj (kinds=attention), gated MLPs with gate_proj/up_proj/down_proj/act_fn (kinds=mlp), "
        "RMSNorm modules (kinds=norm) and a causal LM's output head (kinds=head)."
    ),
)

BACKENDS = (ACT_QUANT,)
