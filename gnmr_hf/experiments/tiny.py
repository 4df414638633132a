"""A tiny LLaMA and local text, built from nothing, for the offline demo, the tests and the benchmarks.

Nothing here touches the network: the model comes from a config with a fixed seed and is saved as real
safetensors, so the real loading path (`from_pretrained` with `BitsAndBytesConfig(load_in_8bit=True)` or
`BitsAndBytesConfig(load_in_4bit=True, ...)`) runs on it exactly as on a downloaded checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# The tiny LLaMA's shape is the library's test model's (`gnmr_hf.testing`), re-exported for the harness.
from ..testing import TINY_LLAMA

__all__ = [
    "TINY_LLAMA",
    "build_tiny_llama",
    "char_tokenizer",
    "load_4bit_lora",
    "load_int8_lora",
    "write_instruction_data",
    "write_local_text",
    "write_tiny_gguf",
]


def build_tiny_llama(path: str | Path, seed: int = 0, **overrides: int) -> Path:
    """Save a randomly initialised tiny LlamaForCausalLM (fp32 safetensors) to `path` and return it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(path)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides}))
    model.save_pretrained(path)
    return path


def load_int8_lora(path: str | Path, *, r: int = 4, target_modules: list[str] | None = None, seed: int = 0):
    """Load `path` in 8-bit with bitsandbytes (on CPU) and wrap it in a peft LoRA for causal LM."""
    from transformers import BitsAndBytesConfig

    return _load_lora(path, BitsAndBytesConfig(load_in_8bit=True), r=r, target_modules=target_modules, seed=seed)


def load_4bit_lora(
    path: str | Path,
    *,
    quant_type: str = "nf4",
    double_quant: bool = False,
    r: int = 4,
    target_modules: list[str] | None = None,
    seed: int = 0,
):
    """Load `path` in 4-bit with bitsandbytes (QLoRA: `quant_type` "nf4" or "fp4", `double_quant` to quantize the
    block scales too; on CPU) and wrap it in a peft LoRA for causal LM."""
    from transformers import BitsAndBytesConfig

    config = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_use_double_quant=double_quant
    )
    return _load_lora(path, config, r=r, target_modules=target_modules, seed=seed)


def _load_lora(path: str | Path, quantization_config, *, r: int, target_modules: list[str] | None, seed: int):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from .models import peft_quietly

    model = AutoModelForCausalLM.from_pretrained(str(path), quantization_config=quantization_config, device_map="cpu")
    torch.manual_seed(seed)
    lora = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        lora_dropout=0.0,
        target_modules=target_modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
    with peft_quietly():
        return get_peft_model(model, lora)


def write_local_text(path: str | Path, lines: int = 256, seed: int = 0) -> Path:
    """Write a small corpus of simple English-like sentences (byte-level friendly) to `path`."""
    import random

    rng = random.Random(seed)
    subjects = ["the model", "a layer", "the optimizer", "each unit", "the budget", "a gradient", "the lock"]
    verbs = ["watches", "moves", "keeps", "returns", "scales", "measures", "selects"]
    objects = ["the norm", "a spike", "its history", "the mean", "low precision", "the window", "one step"]
    path = Path(path)
    with path.open("w") as f:
        for _ in range(lines):
            words = [rng.choice(subjects), rng.choice(verbs), rng.choice(objects)]
            f.write(" ".join(words) + ".\n")
    return path


def write_instruction_data(path: str | Path, examples: int = 256, seed: int = 0) -> Path:
    """Write a small instruction set in the Alpaca schema (`instruction`, `input`, `output`) as JSONL to `path`.

    The items are generated here from a seed (arithmetic, comparisons, word games: all printable ASCII, so the
    character tokenizer reads them), not copied from any dataset. They give the fine-tune recipes' tiny preset a
    real instruction format, with and without an `input`, and answers short enough that the loss moves in a few
    dozen steps.
    """
    import json
    import random

    rng = random.Random(seed)
    words = ["model", "layer", "budget", "gradient", "window", "signal", "adapter", "tensor", "update", "norm"]

    def item() -> tuple[str, str, str]:
        kind = rng.randrange(6)
        a, b, word = rng.randrange(1, 50), rng.randrange(1, 50), rng.choice(words)
        if kind == 0:
            return f"Add {a} and {b}.", "", str(a + b)
        if kind == 1:
            return f"Which number is larger, {a} or {b}?", "", str(max(a, b))
        if kind == 2:
            return "Reverse the word.", word, word[::-1]
        if kind == 3:
            return "Write the word in capital letters.", word, word.upper()
        if kind == 4:
            return f"How many letters are in the word {word}?", "", str(len(word))
        numbers = rng.sample(range(1, 30), 3)
        return (
            "Sort the numbers from smallest to largest.",
            ", ".join(map(str, numbers)),
            ", ".join(map(str, sorted(numbers))),
        )

    path = Path(path)
    with path.open("w") as f:
        for _ in range(examples):
            instruction, input_text, output = item()
            f.write(json.dumps({"instruction": instruction, "input": input_text, "output": output}) + "\n")
    return path


def char_tokenizer():
    """A character-level `PreTrainedTokenizerFast` (printable ASCII, ids < 127) built offline, for trainers that
    insist on a tokenizer (trl's SFTTrainer); it fits the tiny LLaMA's 256-token vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {chr(i): i for i in range(32, 127)}
    vocab.update({"<pad>": 0, "<unk>": 1, "<eos>": 2})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def write_tiny_gguf(
    path: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    merges: int = 32,
) -> Path:
    """Write a tiny LLaMA as a GGUF file, the way llama.cpp lays out a real one (SmolLM2's): `llama.*` metadata, a
    GPT-2 byte-level BPE tokenizer (the 256 byte tokens, `merges` merges, `<|endoftext|>` for bos/eos/pad), the
    token embedding in Q8_0, every projection in Q4_1 and the norms in F32, with no output head (tied to the
    embedding). Written with the `gguf` package's own writer and quantizers; the vocabulary is 256 + `merges` + 1."""
    import gguf
    import numpy as np

    path = Path(path)
    rng = np.random.default_rng(seed)
    # GPT-2's byte-to-unicode table: every byte gets a printable character, the BPE alphabet.
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {b: chr(b) for b in printable}
    chars.update({b: chr(256 + i) for i, b in enumerate(b for b in range(256) if b not in chars)})
    tokens = [chars[b] for b in range(256)]
    pairs = []
    for a, b in (("t", "h"), ("e", "r"), ("i", "n"), ("a", "n"), ("o", "n"), ("r", "e"), ("e", "d"), ("s", "t")):
        pairs.append((a, b))
    pairs += [(chars[32], c) for c in "tasoiwcbpfmdhlnre"]  # " t", " a", ...: GPT-2 spaces are "Ġ"
    pairs = [p for p in dict.fromkeys(pairs) if "".join(p) not in tokens][:merges]
    tokens += ["".join(p) for p in pairs] + ["<|endoftext|>"]
    vocab = len(tokens)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("gnmr-hf tiny llama")
    writer.add_block_count(num_hidden_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden_size)
    writer.add_feed_forward_length(intermediate_size)
    writer.add_head_count(num_attention_heads)
    writer.add_head_count_kv(num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(hidden_size // num_attention_heads)
    writer.add_vocab_size(vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.NORMAL] * (vocab - 1) + [gguf.TokenType.CONTROL])
    writer.add_token_merges([" ".join(p) for p in pairs])
    writer.add_bos_token_id(vocab - 1)
    writer.add_eos_token_id(vocab - 1)
    writer.add_pad_token_id(vocab - 1)
    writer.add_add_bos_token(False)

    def tensor(name: str, shape: tuple[int, ...], kind: Any, scale: float = 0.05) -> None:
        # numpy shapes are (rows, columns) = (out_features, in_features), as in torch; GGUF lists them reversed.
        data = (rng.standard_normal(shape) * scale).astype(np.float32) if kind else np.ones(shape, np.float32)
        if kind in (None, gguf.GGMLQuantizationType.F32):
            writer.add_tensor(name, data)
        else:
            writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)

    q4, q8 = gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0
    head_dim = hidden_size // num_attention_heads
    tensor("token_embd.weight", (vocab, hidden_size), q8)
    for i in range(num_hidden_layers):
        tensor(f"blk.{i}.attn_norm.weight", (hidden_size,), None)
        tensor(f"blk.{i}.attn_q.weight", (hidden_size, hidden_size), q4)
        tensor(f"blk.{i}.attn_k.weight", (num_key_value_heads * head_dim, hidden_size), q4)
        tensor(f"blk.{i}.attn_v.weight", (num_key_value_heads * head_dim, hidden_size), q4)
        tensor(f"blk.{i}.attn_output.weight", (hidden_size, hidden_size), q4)
        tensor(f"blk.{i}.ffn_norm.weight", (hidden_size,), None)
        tensor(f"blk.{i}.ffn_gate.weight", (intermediate_size, hidden_size), q4)
        tensor(f"blk.{i}.ffn_up.weight", (intermediate_size, hidden_size), q4)
        tensor(f"blk.{i}.ffn_down.weight", (hidden_size, intermediate_size), q4)
    tensor("output_norm.weight", (hidden_size,), None)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
