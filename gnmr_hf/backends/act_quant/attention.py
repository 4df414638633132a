"""act_quant's `attention` kind: a transformers attention module whose saved q, k, v are kept at the unit's bits.

The model runs it through `attn_implementation="gnmr_act_quant"` (registered in transformers when the first attention
unit is made, set on the model while one is open): FlashAttention-style, the forward saves q, k, v and each query
row's logsumexp, and the backward recomputes the probabilities from the saved copies, capped so that a lossy copy
keeps every gradient finite and bounded (`_recomputed_probabilities`, `ActQuantOptions.max_row_total`).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from ...fidelity import operand_stats, row_totals, take_rows
from ...signals import Signal
from ...units import DispatchContext, unit_of
from .base import _operand_parts, _SavesActivations
from .saving import UNQUANTIZED, SaveCache, SaveSpec

ATTN_IMPLEMENTATION = "gnmr_act_quant"
_ATTENTION_UNIT = "_gnmr_attention_unit"


# How far above `max_row_total` a recomputed row's float32 sum must be before it is scaled: an exact row of n
# probabilities sums to 1 within ~n * 6e-8, so rows of up to ~16k keys on a faithful path are never touched.
ROW_TOTAL_SLACK = 1e-3

# exp below e^-87.34 is under float32's smallest normal number (2^-126): a denormal, or 0. torch's CPU exp (MKL's
# vsExp) takes a slow path for every such input, -inf included, 5-35x slower than for the rest (2-core AMD EPYC,
# torch 2.13): the causal mask's -inf half of every score matrix, and the far tail of a trained model's peaked rows.
# So entries below e^EXP_FLOOR (1.2e-38: the denormals and the smallest normals) are set to 0 instead of computed
# (`_exp_flushed_`, `_logsumexp`).
EXP_FLOOR = -87.3


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
    # In place on the fresh score matrix, here and in the recomputation: each further full-size temporary is an
    # allocation that page-faults again on a CPU (about 200 minor faults per 4 MiB score matrix, measured).
    s = torch.matmul(q.float(), k.float().transpose(-2, -1)).mul_(scaling)
    if mask is not None:
        if positions is not None:
            mask = mask.index_select(-2, positions) if mask.shape[-2] > 1 else mask
        return s.masked_fill_(~mask, -torch.inf) if mask.dtype == torch.bool else s.add_(mask.float())
    if is_causal:
        n = s.shape[-1]
        t = s.shape[-2] if positions is None else num_queries
        query = torch.arange(s.shape[-2], device=s.device) if positions is None else positions
        # Query i sees keys up to i + (n - t): the keys before the queries (a cache) are all visible.
        keep = torch.arange(n, device=s.device) <= query.unsqueeze(-1) + (n - t)
        return s.masked_fill_(~keep, -torch.inf)
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
    return _exp_flushed_(logits.sub_(lse.unsqueeze(-1)).clamp_(max=0.0))


def _exp_flushed_(x: torch.Tensor) -> torch.Tensor:
    """exp of `x`, in place, with every value below e^EXP_FLOOR (1.2e-38) set to 0 rather than computed on exp's slow
    path; the same values as torch.exp everywhere else (NaN stays NaN)."""
    flushed = x < EXP_FLOOR
    return x.clamp_(min=EXP_FLOOR).exp_().masked_fill_(flushed, 0.0)


def _logsumexp(s: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(s, dim=-1), bit for bit, with torch's own steps (the row max, set to 0 where it is infinite;
    exp of the shifted row; sum; log; the max added back) but `_exp_flushed_`'s exp: a term below 1.2e-38 changes no
    row's sum, which holds its max's exp(0) = 1 (a row of -inf sums to 0 either way)."""
    if s.numel() == 0:
        return torch.logsumexp(s, dim=-1)
    m = s.amax(dim=-1, keepdim=True)
    m.masked_fill_(m.abs() == math.inf, 0.0)
    return _exp_flushed_(s - m).sum(dim=-1).log_().add_(m.squeeze(-1))


def _used_rows(p: torch.Tensor, renormalize: bool, max_row_total: float) -> torch.Tensor:
    """The recomputed probabilities as the backward uses them: each row divided by its sum with `renormalize`, else
    a row whose sum is above `max_row_total` scaled down to it, rows below left as they are.

    Without the cap, d_s = p * (d_p - rowsum(p * d_p)) grows with the row's sum (up to the row's length with every
    entry capped at 1), and the growth compounds layer over layer in the backward: on SmolLM2-135M (30 layers,
    logits in the thousands) 4-bit q, k took the gradient norm from 5.4 (exact) to 7.5e27 (float32 norms overflow to
    inf, the Trainer's clipping zeroes the step), 7e11 with per-token scales; capped at 1, 6.8. A cap of 2 still gave
    4e4 and of 4 gave 4e16 (docs/act_quant.md). Rows within float rounding of the cap (a faithful path's sum to 1)
    are left bit for bit. The fidelity measure reads these rows too, on the cheap path and in recovery."""
    if renormalize:
        total = p.sum(-1, keepdim=True)
        return p / torch.where(total > 0, total, 1.0)
    if max_row_total == math.inf:
        return p
    ratio = p.sum(-1, keepdim=True) / max_row_total
    return p / torch.where(ratio > 1.0 + ROW_TOTAL_SLACK, ratio, 1.0)


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
        lse = _logsumexp(s)
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
            ctx.probe = (probe, _operand_parts(probe, spec, cache, (q, k, v)), probe.meter.rows(p))
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
        p = _used_rows(
            _recomputed_probabilities(q, k_rep, lse, mask, ctx.is_causal, scaling), ctx.renormalize, ctx.max_row_total
        )
        if ctx.probe is not None:
            # The rows this backward uses, after the cap: a row the cap scaled down no longer carries its excess
            # mass into d_s, so measuring it before the cap would call a unit broken for what the path never uses.
            unit, operands, rows = ctx.probe
            unit.meter.report(*operands, row_totals(p, rows))
        d_out = grad_out.float()
        d_v = torch.matmul(p.transpose(-2, -1), d_out)
        d_p = torch.matmul(d_out, v_rep.transpose(-2, -1))
        d_s = d_p.sub_((p * d_p).sum(-1, keepdim=True)).mul_(p)  # p * (d_p - rowsum(p * d_p)), in place
        d_q = torch.matmul(d_s, k_rep).mul_(scaling)
        d_k = torch.matmul(d_s.transpose(-2, -1), q).mul_(scaling)
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
            unit.count_recovery_bytes(query, key, value)
            if unit.meter.due:
                if unit.in_recovery:
                    unit.meter.report(*unit.shadow_parts(query, key, value, attention_mask, is_causal, scaling))
                else:
                    probe = unit
    out = QuantSavedAttention.apply(
        query, key, value, attention_mask, is_causal, scaling, spec, renormalize, probe, max_row_total
    )
    result = out.transpose(1, 2).contiguous()
    if isinstance(unit, ActQuantAttentionUnit) and torch.is_grad_enabled() and unit.impact.due:
        unit.offer_impact(query, key, value, attention_mask, is_causal, scaling, out, result)
    return result, None


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
    measures_impact = True
    fidelity_bound = (
        "saved q, k, v at low_bits and the probabilities the backward recomputes from them, after its row cap: "
        "max(relative L2 error / 2, row-sum bias / 0.1, mean |row sum - 1| / 0.1)"
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
        low_bits q and k, exactly as the cheap path's backward would use them (after its row cap), at the query
        positions sampled (`meter.max_rows` rows over batch and heads; all when 0). One extra QK^T per recovered unit,
        on those rows."""
        spec = self.cheap_spec()
        d = q.shape[-1]
        positions, q_rows, q_low = self._sampled_queries(q, self.meter.max_rows, self.meter.rows)
        k_low = spec.rounded_copy(k)  # every key: the probabilities' rows sum over all of them
        k_rows = self.meter.rows(k)
        operands = [
            operand_stats(take_rows(q, q_rows), q_low.reshape(-1, d)),
            operand_stats(take_rows(k, k_rows), take_rows(k_low, k_rows)),
            spec.stats(v, rows=self.meter.rows(v)),
        ]
        p = self._cheap_probabilities(q, q_low, k, k_low, mask, is_causal, scaling, positions)
        return [*operands, row_totals(p)]

    @torch.no_grad()
    def offer_impact(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scaling: float,
        out: torch.Tensor,
        result: torch.Tensor,
    ) -> None:
        """The output change the backward acts on (`gnmr_hf.impact`), as for a linear: the backward's gradients
        are the exact ones of the attention recomputed from the saved copies, p_low v_low with p_low the
        probabilities it recomputes from the low_bits q and k, the exact logsumexp and its row cap. So `delta` is
        that attention's output minus the exact one, at the query positions sampled (`impact.max_rows` rows over
        batch and heads; all when 0), every key and value rounded; weighted by dL/d(attention output). On either
        path: the forward is exact on both, so recovery's measure is the cheap path's. `out` is [B, H, T, d], the
        function's result `result` its [B, T, H, d] transpose (one row per token and head)."""
        spec = self.cheap_spec()
        b, h, t, d = q.shape
        positions, _, q_low = self._sampled_queries(q, self.impact.max_rows, self.impact.rows)
        p_low = self._cheap_probabilities(q, q_low, k, spec.rounded_copy(k), mask, is_causal, scaling, positions)
        v_low = _repeat_kv(spec.rounded_copy(v), h // k.shape[1])
        if positions is None:
            positions = torch.arange(t, device=q.device)
        n = positions.numel()
        cheap = torch.matmul(p_low, v_low.float())
        delta = cheap - out.index_select(2, positions).float()  # [B, H, n, d]
        # The rows of `result` ([B, T, H, d] as [-1, d]) that delta's [B, n, H] order covers.
        index = (
            (torch.arange(b, device=q.device).view(b, 1, 1) * t + positions.view(1, n, 1)) * h
            + torch.arange(h, device=q.device).view(1, 1, h)
        ).reshape(-1)
        self.impact.offer(result, delta.transpose(1, 2).reshape(-1, d), index, rows_per_token=h)

    def _sampled_queries(
        self, q: torch.Tensor, max_rows: int, rows: Any
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """The query positions a measure reads (`rows`, a meter's row sampler, drawing `max_rows` rows over batch and
        heads, as positions of one head's q; None: all), their rows of q as [-1, d] (None: all), and those rows as
        the cheap path saves them, [B, H, positions, d]."""
        b, h, t, d = q.shape
        per_head = -(-max_rows // (b * h)) if max_rows else 0
        positions = rows(q[0, 0], per_head)
        q_rows = None
        if positions is not None:
            q_rows = (torch.arange(b * h, device=q.device).unsqueeze(-1) * t + positions).reshape(-1)
        return positions, q_rows, self.cheap_spec().restore_rows(q, q_rows).reshape(b, h, -1, d)

    def _cheap_probabilities(
        self,
        q: torch.Tensor,
        q_low: torch.Tensor,
        k: torch.Tensor,
        k_low: torch.Tensor,
        mask: torch.Tensor | None,
        is_causal: bool,
        scaling: float,
        positions: torch.Tensor | None,
    ) -> torch.Tensor:
        """The probabilities the cheap path's backward uses at `positions` (all when None): recomputed from the
        low_bits q (`q_low`, those positions) and k (`k_low`, every key) with the exact logsumexp, after its row
        cap, exactly as `QuantSavedAttention.backward` does."""
        groups, t = q.shape[1] // k.shape[1], q.shape[2]
        q_exact = q if positions is None else q.index_select(2, positions)
        exact = _scores(q_exact, _repeat_kv(k, groups), mask, is_causal, scaling, positions, t)
        lse = torch.logsumexp(exact, dim=-1)
        lse = torch.where(torch.isneginf(lse), 0.0, lse)
        p = _recomputed_probabilities(q_low, _repeat_kv(k_low, groups), lse, mask, is_causal, scaling, positions, t)
        return _used_rows(p, self.options.renormalize, self.options.max_row_total)

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
