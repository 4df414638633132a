"""act_quant backend: the activations saved for the backward pass kept at `low_bits` on the cheap path, `high_bits`
in recovery (the paper's first scenario: 4-bit saved activations, 8-bit recovery, during pretraining).

The forward is exact at every width; only what autograd keeps for the backward is quantized (packed codes plus
float32 scales, so saved-tensor hooks see the real bytes). Unit kinds (`kinds`, or `all`): `linear`, an
`nn.Linear`'s saved input; `attention`, a transformers attention's saved q, k, v, through
`attn_implementation="gnmr_act_quant"` (FlashAttention-style: the backward recomputes the probabilities from q, k and
the row logsumexp); `mlp`, a SwiGLU MLP's product operands; `norm`, an RMSNorm's input; `head`, the output head's
input, with the causal-LM loss in chunks so that no logits are kept. A flip changes what the next forward saves.
Kinds, bits, scaling, bounds and the ledger: docs/act_quant.md.

One file per concern: `options`, `saving` (how a tensor is saved and what that loses), `base` (what every unit
shares), then one per kind (`linear`, `attention`, `mlp`, `norm`, `head`); here, which kind a module is.
"""

from __future__ import annotations

from torch import nn

from ...units import Backend, DispatchContext, RecoverableUnit, not_plain_linear
from .attention import (
    ATTN_IMPLEMENTATION,
    ROW_TOTAL_SLACK,
    ActQuantAttentionUnit,
    QuantSavedAttention,
    _is_attention,
    act_quant_attention,
)
from .head import ActQuantHeadUnit, ChunkedHeadLoss, _output_heads
from .linear import ActQuantLinearUnit, QuantSavedLinear
from .mlp import ActQuantMLPUnit, QuantSavedRecompute, _is_swiglu_mlp
from .norm import ActQuantNormUnit, QuantSavedRMSNorm, _is_norm
from .options import BITS, KINDS, SCALINGS, ActQuantOptions
from .saving import UNQUANTIZED, SaveCache, SaveSpec

__all__ = [
    "ACT_QUANT",
    "ATTN_IMPLEMENTATION",
    "BACKENDS",
    "BITS",
    "KINDS",
    "ROW_TOTAL_SLACK",
    "SCALINGS",
    "UNQUANTIZED",
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
