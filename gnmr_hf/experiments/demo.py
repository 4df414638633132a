"""The main job: a tiny GNMR LoRA fine-tune of an 8-bit (or 4-bit) LLaMA on CPU, offline, end to end.

    gnmr-hf demo --output_dir runs/demo                       # INT8 <-> BF16 (bnb_int8)
    gnmr-hf demo --output_dir runs/demo4 --backend bnb_4bit   # NF4 (QLoRA) <-> BF16

1. builds a tiny LLaMA from a config and saves it as safetensors (the "original checkpoint");
2. reloads it with `BitsAndBytesConfig(load_in_8bit=True)`, or `load_in_4bit=True` (NF4) for `--backend
   bnb_4bit`, and wraps it in a peft LoRA;
3. writes a small local text corpus and loads it with `datasets.load_dataset("text", ...)`, byte-tokenized;
4. trains with the transformers Trainer (`use_cpu=True`) and `GNMRCallback`;
5. prints the GNMR summary and writes the decision trace and its plots to `output_dir`.

`--model smollm2-135m` (or any `.gguf` file or transformers folder, `gnmr_hf.experiments.models`) runs the same job on
a real pretrained model instead: loaded in 8-bit (or 4-bit), LoRA r=8 on its seven projections of every layer (210
units for SmolLM2), trained on the Python standard library's sources in blocks of `--seq_len` tokens of its own
tokenizer.

A tiny model on clean text rarely has a real instability, so by default the demo *injects* one, the same
way the tests do: at step `--spike_step` one unit's gradient is multiplied by `--spike_factor`. GNMR should
select that unit at the next step, hold it for `lock_steps` and release it. `--spike_step 0` turns it off.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..config import GNMRConfig
from ..units import display_name
from .tiny import build_tiny_llama, load_4bit_lora, load_int8_lora, write_local_text

__all__ = [
    "DEMO_LOADERS",
    "DEMO_PRECISIONS",
    "GradientSpikeCallback",
    "byte_dataset",
    "check_spike_module",
    "run_demo",
    "token_blocks",
]

logger = logging.getLogger("gnmr_hf")

# The demo's backends and the loader that makes a model of their kind (`--backend`, i.e. `GNMRConfig.backend`).
DEMO_LOADERS = {"bnb_int8": load_int8_lora, "bnb_4bit": load_4bit_lora}
# The same for a real model (`--model`): the precision `load_real_model` loads it in.
DEMO_PRECISIONS = {"bnb_int8": "int8", "bnb_4bit": "nf4"}
# The LoRA layers of each LLaMA layer, by their paths in it: the demo's units, and what --spike_module names.
LORA_PATHS = [f"self_attn.{p}_proj" for p in "qkvo"] + [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
LORA_TARGETS = [path.split(".")[-1] for path in LORA_PATHS]


class GradientSpikeCallback(TrainerCallback):
    """Multiplies the gradients of the module named `module_name` by `factor` during optimizer step `step`.

    A stand-in for a real low-precision failure (an overflowing block, a saturated scale): the gradient hooks
    act on every micro-batch of that step, so the accumulated gradient is `factor` times larger, before
    clipping. Steps are 1-based, as in the trace (step k is the one after which `global_step == k`).
    """

    def __init__(self, module_name: str, step: int, factor: float = 100.0) -> None:
        self.module_name, self.step, self.factor = module_name, step, factor
        self.armed = False
        self._handles: list[Any] = []

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        params = [
            p
            for name, p in model.named_parameters()
            if p.requires_grad and display_name(name).startswith(self.module_name + ".")
        ]
        if not params:
            raise ValueError(f"GradientSpikeCallback: no trainable parameter under {self.module_name!r}")
        self._handles = [p.register_hook(self._scale) for p in params]

    def _scale(self, grad: torch.Tensor) -> torch.Tensor:
        return grad * self.factor if self.armed else grad

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = state.global_step + 1 == self.step

    def on_step_end(self, args, state, control, **kwargs):
        self.armed = False

    def on_train_end(self, args, state, control, **kwargs):
        for handle in self._handles:
            handle.remove()


def check_spike_module(name: str, model: str = "tiny") -> None:
    """Raise a ValueError naming the allowed values unless `name` is one of `model`'s LoRA layers (or a module that
    holds some, such as `model.layers.1.mlp`), read from the model's config without loading it: a typo refused
    before the model is built, not at the first training step."""
    from .models import layer_count
    from .tiny import TINY_LLAMA

    layers = TINY_LLAMA["num_hidden_layers"] if model == "tiny" else layer_count(model)
    targets = [f"model.layers.{i}.{path}" for i in range(layers) for path in LORA_PATHS]
    if not any(t == name or t.startswith(name + ".") for t in targets):
        leaves: dict[str, list[str]] = {}
        for path in LORA_PATHS:
            parent, leaf = path.split(".")
            leaves.setdefault(parent, []).append(leaf.removesuffix("_proj"))
        allowed = " or ".join(f"model.layers.N.{parent}.{{{','.join(ls)}}}_proj" for parent, ls in leaves.items())
        raise ValueError(
            f"--spike_module must be a LoRA layer of {model}, {allowed} with N in 0..{layers - 1} (or a module "
            f"holding some, such as model.layers.N.mlp); got {name!r}"
        )


def byte_dataset(text_file: str | Path, seq_len: int = 32, vocab_size: int = 256) -> Any:
    """Load a local text file with `datasets` and turn each line into byte token ids (no tokenizer download)."""
    from datasets import load_dataset

    ds = load_dataset("text", data_files=str(text_file), split="train")

    def encode(batch: dict[str, list[str]]) -> dict[str, list[list[int]]]:
        ids = []
        for line in batch["text"]:
            tokens = [b % vocab_size for b in line.encode("utf-8")][:seq_len]
            ids.append(tokens + [0] * (seq_len - len(tokens)))
        return {"input_ids": ids, "labels": ids}

    return ds.map(encode, batched=True, remove_columns=["text"])


def token_blocks(tokenizer: Any, seq_len: int, count: int) -> list[dict[str, torch.Tensor]]:
    """`count` blocks of `seq_len` tokens of the Python standard library's sources (which every machine has),
    tokenized by `tokenizer`, in order: {"input_ids", "labels"}."""
    import sysconfig

    # The json package's sources first, then the other top-level modules, sorted: a fixed text on every machine.
    # (Not pretrain.load_corpus: pretrain imports the CLI, which imports this module.)
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted((root / "json").glob("*.py")) + sorted(root.glob("*.py"))
    text, need = [], 6 * seq_len * count
    for f in files:
        text.append(f.read_text(errors="replace"))
        need -= len(text[-1])
        if need <= 0:
            break
    ids = torch.tensor(tokenizer("\n".join(text)).input_ids)
    if len(ids) < seq_len * count:
        raise ValueError(f"token_blocks: {len(ids)} tokens hold fewer than {count} blocks of {seq_len}")
    blocks = ids[: seq_len * count].view(count, seq_len)
    return [{"input_ids": b, "labels": b} for b in blocks]


def _real_lora(model_name: str, backend: str, seed: int) -> tuple[Any, Any]:
    from peft import LoraConfig, get_peft_model

    from .models import load_real_model, peft_quietly

    model, tokenizer = load_real_model(model_name, DEMO_PRECISIONS[backend])
    torch.manual_seed(seed)
    lora = LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    with peft_quietly():
        return get_peft_model(model, lora), tokenizer


def run_demo(
    output_dir: str | Path,
    *,
    model: str = "tiny",
    seq_len: int = 128,
    max_steps: int = 40,
    gnmr: GNMRConfig | None = None,
    spike_module: str = "model.layers.1.mlp.down_proj",
    spike_step: int = 20,
    spike_factor: float = 100.0,
    seed: int = 0,
    gradient_accumulation_steps: int = 1,
    plots: bool = True,
    extra_callbacks: Sequence[TrainerCallback] = (),
) -> dict[str, Any]:
    """Run the demo and return {"trainer", "callback", "summary", "plots", "trace"} (`gnmr.trace_file=''`: no trace,
    so trace None and no plots). The model is loaded for
    `gnmr.backend` (one of `DEMO_LOADERS`): the tiny LLaMA built here, or with `model` a real one
    (`gnmr_hf.experiments.models.resolve_model`: a name, a .gguf file or a folder), trained on `seq_len`-token blocks
    (batch 2)."""
    from transformers import Trainer, TrainingArguments

    from ..callback import GNMRCallback
    from ..report import report

    gnmr = gnmr or GNMRConfig(max_active=2, lock_steps=4, window=4, min_history=4, alpha=3.0, beta=3.0)
    if gnmr.backend not in DEMO_LOADERS:
        raise ValueError(f"gnmr-hf demo: --backend must be one of {list(DEMO_LOADERS)}, got {gnmr.backend!r}")
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if model == "tiny":
        base = build_tiny_llama(output_dir / "base_model", seed=seed)
        lora = DEMO_LOADERS[gnmr.backend](base, seed=seed)
        data = byte_dataset(write_local_text(output_dir / "train.txt", seed=seed))
        batch = 8
    else:
        lora, tokenizer = _real_lora(model, gnmr.backend, seed)
        batch = 2
        data = token_blocks(tokenizer, seq_len, batch * gradient_accumulation_steps * max_steps)
    callback = GNMRCallback(gnmr)
    callbacks: list[TrainerCallback] = [callback, *extra_callbacks]
    if spike_step > 0:
        callbacks.append(GradientSpikeCallback(spike_module, spike_step, spike_factor))
    args = TrainingArguments(
        output_dir=str(output_dir),
        use_cpu=True,
        max_steps=max_steps,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=gradient_accumulation_steps,
        learning_rate=1e-3,
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        seed=seed,
        disable_tqdm=True,
    )
    trainer = Trainer(model=lora, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train()
    if not gnmr.trace_file:
        # No trace (trace_file=''), so nothing to plot: the summary is the one the callback kept while training.
        return {"trainer": trainer, "callback": callback, "summary": callback.summary, "plots": [], "trace": None}
    trace = output_dir / gnmr.trace_file
    summary, plot_paths = report(trace, output_dir, plots=plots)
    return {"trainer": trainer, "callback": callback, "summary": summary, "plots": plot_paths, "trace": trace}
