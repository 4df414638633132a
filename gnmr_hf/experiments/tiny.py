"""A tiny LLaMA and local text, built from nothing, for the offline demo, the tests and the benchmarks.

Nothing here touches the network: the model comes from a config with a fixed seed and is saved as real
safetensors, so the real loading path (`from_pretrained` with `BitsAndBytesConfig(load_in_8bit=True)` or
`BitsAndBytesConfig(load_in_4bit=True, ...)`) runs on it exactly as on a downloaded checkpoint.
"""

from __future__ import annotations

from pathlib import Path

import torch

__all__ = [
    "TINY_LLAMA",
    "build_tiny_llama",
    "char_tokenizer",
    "load_4bit_lora",
    "load_int8_lora",
    "write_instruction_data",
    "write_local_text",
]

TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
)


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

    model = AutoModelForCausalLM.from_pretrained(str(path), quantization_config=quantization_config, device_map="cpu")
    torch.manual_seed(seed)
    lora = LoraConfig(
        r=r,
        lora_alpha=2 * r,
        lora_dropout=0.0,
        target_modules=target_modules or ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )
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
