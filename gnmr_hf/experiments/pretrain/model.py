"""The model an arm trains: a small LLaMA built from scratch, or a real pretrained one.

`llama_config` is transformers' own `LlamaForCausalLM` shape (RoPE, RMSNorm, SwiGLU) at the width, depth and heads
asked, with an FFN of 8/3 x d rounded up to a multiple of 64 and a byte vocabulary; `build_model` seeds torch before
building it, so every arm of one seed starts from the same weights. `recipe_model` is what `run_arm` calls: that
model, or the real model `--model` names (`gnmr_hf.experiments.models`), whose weights are the same in every seed.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .arguments import PretrainArguments

__all__ = ["build_model", "llama_config", "recipe_model"]


def llama_config(
    d_model: int = 128, n_layers: int = 4, n_heads: int = 4, seq_len: int = 128, vocab_size: int = 256
) -> Any:
    """A `LlamaConfig` for a small byte-level LLaMA (RoPE, RMSNorm, SwiGLU; FFN 8/3 x d rounded up to 64)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=d_model,
        intermediate_size=64 * math.ceil(8 * d_model / 3 / 64),
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_heads,
        max_position_embeddings=seq_len,
        attention_dropout=0.0,
        tie_word_embeddings=False,
    )


def recipe_model(pretrain: PretrainArguments, seed: int) -> nn.Module:
    """The model an arm trains: a fresh LLaMA of `pretrain`'s shape with `seed`, or the real model `pretrain.model`
    (fp32, its pretrained weights: the same in every seed)."""
    if pretrain.model == "scratch":
        return build_model(llama_config(pretrain.d_model, pretrain.n_layers, pretrain.n_heads, pretrain.seq_len), seed)
    from ..models import load_real_model

    return load_real_model(pretrain.model)[0]


def build_model(config: Any, seed: int) -> nn.Module:
    """A freshly initialized `LlamaForCausalLM` (fp32) from `config`; the same seed gives the same weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config)
