"""act_quant's `head` kind: the output head, whose input is saved at the unit's bits, with the causal-LM loss taken
in chunks (`ChunkedHeadLoss`) so that the backward keeps neither the logits nor their log-softmax."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakTensorKeyDictionary

from ...fidelity import softmax_shift_loss, take_rows
from ...units import DispatchContext
from .base import _operand_parts, _SwitchedSaves
from .linear import QuantSavedLinear
from .saving import SaveCache, SaveSpec

# Logit elements one chunk of the loss holds (16 MiB in float32): at a 32k vocabulary, 131 tokens per chunk.
LOSS_CHUNK_ELEMENTS = 2**22
# Rows of the recomputed softmax a measure reads (fewer when `cause_fidelity_rows` is below it; every row when it is
# 0): each costs a row of the head's GEMM over the whole vocabulary (SmolLM2: 16 rows, 0.45 GFLOP, about a tenth of
# a second on one CPU thread).
SOFTMAX_ROWS = 16


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
    measures_impact = True
    fidelity_bound = (
        "saved input at low_bits: max(relative L2 error / 2, row-sum bias / 0.1, total-variation shift of the softmax "
        "recomputed from it / 0.1)"
    )

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
        self.count_recovery_bytes(h)
        logits = QuantSavedLinear.apply(h, m.weight, m.bias, self.current_spec(), self._cache)
        if self.meter.due:
            # Unlike a linear unit's, the copy also feeds the logits the backward recomputes (a GEMM summing along
            # its rows), so the row-sum bias counts; and the softmax of those logits, where the gradient of every
            # layer below starts, moves as far as the rounding moves it (`softmax_shift_loss`).
            spec = self.cheap_spec()
            parts: list[Any] = list(_operand_parts(self, spec, self._cache, (h,)))
            with torch.no_grad():
                wanted = self.meter.max_rows
                rows = self.meter.rows(h, min(wanted, SOFTMAX_ROWS) if wanted else 0)
                rounded = F.linear(spec.restore_rows(h, rows, self._cache), m.weight, m.bias)
                parts.append(softmax_shift_loss(take_rows(logits, rows), rounded))
            self.meter.report(*parts)
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
        loss = ChunkedHeadLoss.apply(
            logits.detach(), h, m.weight, m.bias, targets, ignore_index, num_items_in_batch, spec, self._cache
        )
        if self.impact.due:
            self._offer_impact(loss, logits, h, targets, ignore_index, num_items_in_batch)
        return loss

    @torch.no_grad()
    def _offer_impact(
        self,
        loss: torch.Tensor,
        logits: torch.Tensor,
        h: torch.Tensor,
        targets: torch.Tensor,
        ignore_index: int,
        denom: torch.Tensor | float | None,
    ) -> None:
        """The output change the backward acts on: it recomputes the logits from the rounded input, so the change
        is the logits' (`gnmr_hf.impact`), weighted by dL/dlogits = (softmax - one-hot) / denom, which the loss has
        here (the logits the model returns carry no gradient: the chunked loss starts from `h`). Rows as the
        fidelity measure reads them: each costs a row of the head's GEMM over the whole vocabulary."""
        z2 = logits.detach().reshape(-1, logits.shape[-1])
        wanted = self.impact.max_rows
        index = self.impact.rows(z2, min(wanted, SOFTMAX_ROWS) if wanted else 0)
        z = take_rows(z2, index).float()
        m = self.module
        rounded = self.cheap_spec().restore_rows(h, index, self._cache).float()
        zq = F.linear(rounded, m.weight.detach().float(), None if m.bias is None else m.bias.detach().float())
        picked = targets if index is None else targets.index_select(0, index)
        valid = picked != ignore_index
        grad = torch.softmax(z, dim=-1)
        grad[torch.arange(len(grad), device=grad.device), torch.where(valid, picked, 0)] -= 1.0
        if denom is None:
            denom = (targets != ignore_index).sum().clamp_min(1)
        if isinstance(denom, torch.Tensor):
            denom = denom.to(grad.device).float()
        grad = grad * valid[:, None] / denom
        weighted = (grad.square() * (zq - z).square()).sum()
        self.impact.offer_weighted(loss, weighted, n_rows=z2.shape[0], sampled=len(z))

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
