"""Pretraining a small LLaMA from scratch with the transformers Trainer, arm against arm: the machinery the
pretraining stress recipes share (`recipes/pretrain_actquant.py` now, the block-FP recipe next).

A precision claim needs every arm to see the same model initialization, the same batches in the same order and the
same code path, and differ only in precision policy. This module provides exactly that, offline:

- **Corpus** (`load_corpus`): by default the Python standard library's own ``*.py`` sources, which every machine
  with Python has (about 30 MB; `site-packages` excluded), or any local text files or folder, or a `datasets` name
  (``hf:name`` or ``hf:name:config``, online). Files are sorted by path and every `val_every`-th file goes to the
  validation split, so no validation text is ever trained on.
- **Tokenizer** (`ByteTokenizer`): bytes are tokens (vocabulary 256). Nothing to train, nothing to download, and the
  loss is in nats per byte, comparable across corpora.
- **Data order** (`block_dataset`): the training batches are fixed before training — non-overlapping blocks of
  `seq_len` bytes in an order drawn from `data_seed` alone — and the Trainer reads them sequentially
  (`train_sampling_strategy="sequential"`), so the order does not depend on any random stream a backend consumes
  (stochastic rounding) and is identical in every arm. Validation is a fixed, evenly spaced set of blocks.
- **Model** (`llama_config`, `build_model`): LLaMA with RoPE, RMSNorm and SwiGLU (transformers' own
  `LlamaForCausalLM`), width/depth/heads as asked, FFN width 8/3 x d rounded up to a multiple of 64.
- **Trainer setup** (`PRESETS`, `training_arguments`): AdamW (betas 0.9/0.95, no weight decay), linear warm-up then
  cosine decay, global clipping at 1.0, fp32, CPU.
- **Arms** (`ARMS`, `arm_callbacks`): `reference` (no units at all: the plain fp32 model), `static_low`,
  `static_high`, `gnmr`, `gnmr_relapse` (the relapse-aware lock), `gnmr_cause` (the cause policy), `gnmr_impact`
  (the impact policy, `--impact_options`), `random`,
  `carve_first_last`, `carve_best`,
  `carve_named` (units chosen by regex) and `global_z` — every arm but the reference runs `GNMRCallback`'s code path
  over the same units (`gnmr_hf.experiments.baselines`); and the stabilizers users reach for first, every unit on
  the cheap path (`zclip`, `spam`, `stable_spam`, `adagc`, `skip_step`, and `gnmr_cause_zclip`:
  `gnmr_hf.experiments.stabilizers`), run only when named in `arms`.
- **Measurement** (`StepMeter`, `SavedTensorMeter`, `run_arm`): seconds per optimizer step (median), bytes saved for
  backward per step (through torch's saved-tensor hooks, so they are the tensors autograd really keeps), the final
  validation loss, the recovery fraction and exceedance rate from the GNMR trace; one `result.json` per run.
- **Report** (`results_table`, `plot_loss_curves`): the comparison table over seeds and the loss-curve plot.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import logging
import math
import os
import re
import statistics
import sysconfig
import textwrap
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from ..callback import GNMRCallback
from ..config import GNMRConfig
from ..trace import read_trace

# Importing the baselines registers the policies the baseline arms name (`_with_policy`).
from .baselines import best_static_units
from .stabilizers import STABILIZER_ARMS, describe, missing_package, parse_options, stabilizer_for

__all__ = [
    "ARMS",
    "PRESETS",
    "ByteTokenizer",
    "Corpus",
    "PretrainArguments",
    "SavedTensorMeter",
    "StepMeter",
    "arm_callbacks",
    "benchmark_arguments",
    "benchmark_parser",
    "block_dataset",
    "build_model",
    "gnmr_budget",
    "llama_config",
    "load_corpus",
    "load_results",
    "oracle_mean_gaps",
    "parse_recipe_arguments",
    "plot_loss_curves",
    "recipe_model",
    "results_table",
    "retokenize",
    "run_arm",
    "run_comparison",
    "run_recipe",
    "training_arguments",
    "write_report",
]

logger = logging.getLogger("gnmr_hf")

ARMS = (
    "reference",
    "static_high",
    "static_low",
    "gnmr",
    "gnmr_relapse",
    "gnmr_cause",
    "gnmr_impact",
    "random",
    "carve_first_last",
    "carve_best",
    "carve_named",
    "global_z",
    *STABILIZER_ARMS,
)
# Arms whose budget (average number of recovered units) is GNMR's, read from the gnmr run of the same seed.
BUDGET_ARMS = ("random", "carve_first_last", "carve_best")

# A preset sets the model, the data and the Trainer's schedule; anything given on the command line wins.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # A smoke test: a minute on a CPU, end to end, every arm.
    "tiny": {
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"corpus_bytes": 400_000, "eval_blocks": 16},
        "training": {
            "max_steps": 20,
            "per_device_train_batch_size": 4,
            "per_device_eval_batch_size": 16,
            "learning_rate": 3e-3,
            "warmup_steps": 2,
            "eval_steps": 10,
            "logging_steps": 5,
        },
    },
    # The independent probe's scale: d=128, 4 layers, batch 16 x 128 bytes, 400 steps.
    "probe": {
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128},
        "data": {"corpus_bytes": 0, "eval_blocks": 128},
        "training": {
            "max_steps": 400,
            "per_device_train_batch_size": 16,
            "per_device_eval_batch_size": 64,
            "learning_rate": 3e-3,
            "warmup_steps": 40,
            "eval_steps": 50,
            "logging_steps": 10,
        },
    },
}

# Continued training of a real pretrained model (`--model smollm2-135m`): its own tokenizer, the stdlib corpus, a
# fine-tuning learning rate; sized so that one arm takes ~10 minutes on one CPU thread.
PRESETS["real"] = {
    "model": {"d_model": 576, "n_layers": 30, "n_heads": 9, "seq_len": 128},
    "data": {"corpus_bytes": 3_000_000, "eval_blocks": 32},
    "training": {
        "max_steps": 100,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "learning_rate": 1e-4,
        "warmup_steps": 5,
        "eval_steps": 50,
        "logging_steps": 5,
    },
}

# Fixed for every arm and preset (the reference's recipe); the command line can still override them.
_TRAINING_FIXED: dict[str, Any] = {
    "lr_scheduler_type": "cosine",
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "max_grad_norm": 1.0,
    "eval_strategy": "steps",
    "save_strategy": "no",
    "report_to": [],
    "use_cpu": True,
    "disable_tqdm": True,
    "train_sampling_strategy": "sequential",
    "dataloader_num_workers": 0,
}


@dataclass
class PretrainArguments:
    """The recipe's own arguments (beside `TrainingArguments` and `GNMRConfig`)."""

    preset: str = field(default="probe", metadata={"help": f"Model/data/schedule preset: {sorted(PRESETS)}."})
    arms: list[str] | None = field(
        default=None,
        metadata={
            "help": f"Arms to run, in order, from {list(ARMS)}. Default: every arm the other flags allow (carve_best "
            "with --oracle_every, carve_named with --carve_named; the stabilizer arms only when named)."
        },
    )
    seeds: list[int] = field(default_factory=lambda: [0], metadata={"help": "Model-initialization seeds."})
    model: str = field(
        default="scratch",
        metadata={
            "help": "scratch: a LLaMA built here from --d_model etc. (byte tokens); or a real pretrained model "
            "(gnmr_hf.experiments.models: smollm2-135m, a .gguf file or a folder), trained on with its own tokenizer "
            "from its weights (--d_model, --n_layers, --n_heads then only label the results: --preset real gives "
            "SmolLM2's)."
        },
    )
    corpus: str = field(
        default="stdlib",
        metadata={"help": "'stdlib' (the Python standard library sources), a text file or folder, or 'hf:name'."},
    )
    corpus_bytes: int | None = field(default=None, metadata={"help": "Cap on training bytes read (0: no cap)."})
    eval_blocks: int | None = field(default=None, metadata={"help": "Validation blocks of seq_len bytes."})
    d_model: int | None = field(default=None, metadata={"help": "Hidden size."})
    n_layers: int | None = field(default=None, metadata={"help": "Decoder layers."})
    n_heads: int | None = field(default=None, metadata={"help": "Attention heads."})
    seq_len: int | None = field(default=None, metadata={"help": "Bytes per training sequence."})
    budget: float | None = field(
        default=None,
        metadata={
            "help": "Average number of recovered units for the random and carve-out arms; default: the gnmr "
            "run's of the same seed in output_dir."
        },
    )
    carve_named: list[str] | None = field(
        default=None,
        metadata={"help": "Regexes of the units the carve_named arm keeps on the recovery path (a chosen carve-out)."},
    )
    oracle_every: int = field(
        default=0,
        metadata={"help": "Oracle probe every k steps in the gnmr arms (0: none); see gnmr_hf.experiments.oracle."},
    )
    oracle_benefits: bool = field(
        default=False,
        metadata={
            "help": "With --oracle_every: also probe each unit's recovery benefit, the counterfactual oracle "
            "(N + 2 passes per probe instead of 2; gnmr_hf.experiments.oracle.recovery_benefits)."
        },
    )
    impact_options: str = field(
        default="",
        metadata={"help": "The gnmr_impact arm's policy options, 'k=v,k=v' (e.g. 'min_impact=0.001,every=4')."},
    )
    stabilizer_options: str = field(
        default="",
        metadata={
            "help": "Keyword arguments of the stabilizer arms' method beyond its authors' defaults, 'k=v,k=v' (e.g. "
            "'update_proj_gap=100' for spam): a tuned setting (gnmr_hf.experiments.stabilizers)."
        },
    )
    plot: bool = field(default=True, metadata={"help": "Write loss_curves.png beside results.md."})

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"PretrainArguments.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.arms is None:
            self.arms = [
                arm
                for arm in ARMS
                if (arm != "carve_best" or self.oracle_every > 0)
                and (arm != "carve_named" or self.carve_named)
                and arm not in STABILIZER_ARMS
            ]
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"PretrainArguments.arms: {unknown} are not arms; choose from {list(ARMS)}")
        for key, value in {**PRESETS[self.preset]["model"], **PRESETS[self.preset]["data"]}.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        for key in ("d_model", "n_layers", "n_heads", "seq_len", "eval_blocks"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PretrainArguments.{key} must be an int >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"PretrainArguments.d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.oracle_every < 0:
            raise ValueError(f"PretrainArguments.oracle_every must be >= 0, got {self.oracle_every}")
        if self.oracle_benefits and not self.oracle_every:
            raise ValueError("PretrainArguments.oracle_benefits needs --oracle_every K > 0 (the probes it adds to)")
        if "carve_named" in self.arms and not self.carve_named:
            raise ValueError("arm carve_named needs --carve_named REGEX ... (the units it keeps on the recovery path)")
        parse_options(self.stabilizer_options)
        if self.impact_options:
            from ..policies.impact import ImpactOptions

            try:
                ImpactOptions.parse(self.impact_options)
            except (TypeError, ValueError) as err:
                raise ValueError(f"PretrainArguments.impact_options: {err}") from None
        for arm in self.arms:
            package = missing_package(arm)
            if package:
                raise ValueError(f"arm {arm} needs the {package} package: pip install -e '.[stabilizers]'")


# ------------------------------------------------------------------------------------------------ corpus


class ByteTokenizer:
    """Bytes are tokens: ids 0..255. `encode` takes str (UTF-8) or bytes; `decode` gives str (invalid UTF-8 is
    replaced, as a partial multi-byte character at a block edge would be)."""

    vocab_size = 256

    def encode(self, text: str | bytes) -> torch.Tensor:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    """Training and validation bytes as uint8 token tensors, and where they came from."""

    train: torch.Tensor
    validation: torch.Tensor
    source: str
    documents: int

    def fingerprint(self) -> str:
        """A short hash of both splits: two runs with the same fingerprint saw the same text."""
        digest = hashlib.sha256(self.train.numpy().tobytes())
        digest.update(self.validation.numpy().tobytes())
        return digest.hexdigest()[:16]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # Installed packages live inside the stdlib folder; pruned here rather than filtered after a full walk.
        subfolders[:] = sorted(d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files)


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".py", ".md", ".rst"))
    raise FileNotFoundError(f"load_corpus: {path} is neither a file nor a folder")


def _hf_documents(spec: str) -> list[bytes]:
    import datasets

    name, _, config = spec.partition(":")
    data = datasets.load_dataset(name, config or None, split="train")
    column = "text" if "text" in data.column_names else data.column_names[0]
    return [str(t).encode("utf-8") for t in data[column]]


def load_corpus(source: str = "stdlib", max_bytes: int | None = None, val_every: int = 20) -> Corpus:
    """The corpus `source` ('stdlib', a text file or folder, or 'hf:name[:config]'), split by document: every
    `val_every`-th document (in sorted path order) is validation. `max_bytes` caps the training split (0 or None:
    all of it) and the validation split at a tenth of it, taking whole documents in order; files past the caps are
    not read."""
    if source == "stdlib":
        documents: list[Path] | list[bytes] = _stdlib_files()
    elif source.startswith("hf:"):
        documents = _hf_documents(source[3:])
    else:
        documents = _local_files(Path(source))
    if len(documents) < 2:
        raise ValueError(f"load_corpus: {source!r} has {len(documents)} documents; at least 2 are needed to split")
    val_every = min(val_every, len(documents))
    caps = (max_bytes // 10, max_bytes) if max_bytes else (None, None)
    splits: tuple[list[bytes], list[bytes]] = ([], [])
    sizes = [0, 0]
    for i, doc in enumerate(documents):
        which = 0 if i % val_every == 0 else 1
        if caps[which] is not None and sizes[which] >= caps[which]:
            continue
        data = doc.read_bytes() if isinstance(doc, Path) else doc
        splits[which].append(data)
        sizes[which] += len(data) + 1
    tokenizer = ByteTokenizer()
    val, train = (tokenizer.encode(b"\n".join(split)) for split in splits)
    return Corpus(train, val, source, len(documents))


class _Blocks(torch.utils.data.Dataset):
    """Blocks of `seq_len` tokens at fixed starts: {"input_ids", "labels"} (the model shifts the labels)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, starts: torch.Tensor) -> None:
        self.tokens, self.seq_len, self.starts = tokens, seq_len, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = int(self.starts[i])
        ids = self.tokens[start : start + self.seq_len].long()
        return {"input_ids": ids, "labels": ids}


def block_dataset(tokens: torch.Tensor, seq_len: int, count: int, seed: int | None) -> torch.utils.data.Dataset:
    """`count` blocks of `seq_len` tokens. With a `seed`: non-overlapping blocks in a random order drawn from that
    seed alone (a new permutation each time all are used); with `seed=None`: evenly spaced blocks, for validation."""
    n_blocks = len(tokens) // seq_len
    if n_blocks < 1:
        raise ValueError(f"block_dataset: {len(tokens)} tokens hold no block of seq_len={seq_len}")
    if seed is None:
        if count > n_blocks:
            raise ValueError(f"block_dataset: {count} validation blocks asked, the split holds {n_blocks}")
        index = torch.linspace(0, n_blocks - 1, count).round().long()
    else:
        generator = torch.Generator().manual_seed(seed)
        epochs = -(-count // n_blocks)
        index = torch.cat([torch.randperm(n_blocks, generator=generator) for _ in range(epochs)])[:count]
    return _Blocks(tokens, seq_len, index * seq_len)


# ------------------------------------------------------------------------------------------------- model


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
    from .models import load_real_model

    return load_real_model(pretrain.model)[0]


def retokenize(corpus: Corpus, model: str) -> Corpus:
    """`corpus` in the tokens of the real model `model`'s tokenizer (int32), for `--model`; as it is for scratch."""
    if model == "scratch":
        return corpus
    from transformers import AutoTokenizer

    from .models import resolve_model

    tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(model)))
    decode = ByteTokenizer().decode

    def ids(split: torch.Tensor) -> torch.Tensor:
        return torch.tensor(tokenizer(decode(split)).input_ids, dtype=torch.int32)

    return Corpus(ids(corpus.train), ids(corpus.validation), f"{corpus.source} ({model} tokens)", corpus.documents)


def build_model(config: Any, seed: int) -> nn.Module:
    """A freshly initialized `LlamaForCausalLM` (fp32) from `config`; the same seed gives the same weights."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def training_arguments(base: TrainingArguments, preset: str, given: Iterable[str] = ()) -> TrainingArguments:
    """`base` with the preset's schedule and the fixed recipe settings, except for the fields in `given` (those the
    user set on the command line)."""
    given = set(given)
    values = {**_TRAINING_FIXED, **PRESETS[preset]["training"]}
    return dataclasses.replace(base, **{k: v for k, v in values.items() if k not in given})


def benchmark_parser(description: str, arms: Sequence[str]) -> argparse.ArgumentParser:
    """The flags of a benchmark that trains arms of its own (`benchmarks/fault_injection.py`, `xg_split.py`,
    `head_gemm_split.py`): where, which seeds and arms, the preset, and the preset's steps and learning rate."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--arms", nargs="+", default=list(arms), choices=arms)
    parser.add_argument("--preset", default="probe", choices=sorted(PRESETS))
    parser.add_argument("--max_steps", type=int, default=None)
    parser.add_argument("--learning_rate", type=float, default=None)
    parser.add_argument("--impact_options", default="", help="The gnmr_impact arm's policy options, 'k=v,k=v'.")
    return parser


def benchmark_arguments(cli: argparse.Namespace) -> tuple[TrainingArguments, PretrainArguments]:
    """The `TrainingArguments` (the preset's, with `--max_steps` and `--learning_rate` where given) and the
    `PretrainArguments` (the preset's model and corpus) of `benchmark_parser`'s flags."""
    given = {k: getattr(cli, k) for k in ("max_steps", "learning_rate") if getattr(cli, k) is not None}
    base = TrainingArguments(output_dir=cli.output_dir, **given)
    args = training_arguments(base, cli.preset, {"output_dir", *given})
    return args, PretrainArguments(preset=cli.preset, arms=["static_low"], impact_options=cli.impact_options)


# -------------------------------------------------------------------------------------------- measurement


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward inside a `with` block, through torch's saved-tensor hooks.

    Each storage is counted once (a tensor saved by several ops, or views of one buffer, cost its memory once), and
    storages in `exclude` (a model's parameters: saved by reference, not activations) not at all. `nbytes` is the
    total, `by_dtype` the split per saved dtype (uint8 = packed codes); `reset()` starts a new count.
    """

    def __init__(self, exclude: nn.Module | None = None) -> None:
        self._exclude = set() if exclude is None else {p.untyped_storage().data_ptr() for p in exclude.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.reset()

    def reset(self) -> None:
        self._seen: set[int] = set()
        self.nbytes = 0
        self.by_dtype: dict[str, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._exclude and ptr not in self._seen:
            self._seen.add(ptr)
            self.nbytes += storage.nbytes()
            key = str(t.dtype).removeprefix("torch.")
            self.by_dtype[key] = self.by_dtype.get(key, 0) + storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class StepMeter(TrainerCallback):
    """Seconds per optimizer step (on_step_begin to on_step_end) and bytes saved for backward per step.

    Put it last in the callback list, so that work other callbacks do at step begin (an oracle probe) is not
    timed or counted.
    """

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.saved_bytes: list[int] = []
        self._meter: SavedTensorMeter | None = None
        self._start = 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._meter = SavedTensorMeter(exclude=model)
        self._meter.__enter__()

    def on_step_begin(self, args, state, control, **kwargs):
        assert self._meter is not None
        self._meter.reset()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        assert self._meter is not None
        self.seconds.append(time.perf_counter() - self._start)
        self.saved_bytes.append(self._meter.nbytes)

    def on_train_end(self, args, state, control, **kwargs):
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self._meter = None


# ---------------------------------------------------------------------------------------------------- arms


def arm_callbacks(
    arm: str,
    config: GNMRConfig,
    seed: int,
    *,
    budget: float | None = None,
    carve_units: Sequence[str] | None = None,
    carve_patterns: Sequence[str] | None = None,
    impact_options: str | None = None,
) -> list[TrainerCallback]:
    """The callbacks of one arm over `config`'s units (see `ARMS`); [] for the reference.

    `budget` (average number of recovered units) is needed by "random" and "carve_first_last" (rounded to the
    nearest count, at least 1); "carve_best" needs `carve_units`, the names to keep on the recovery path, and
    "carve_named" `carve_patterns`, regexes searched in the unit names.
    """
    if arm not in ARMS:
        raise ValueError(f"arm_callbacks: arm must be one of {list(ARMS)}, got {arm!r}")
    if arm == "reference":
        return []
    if arm == "gnmr":
        return [GNMRCallback(config)]
    if arm == "gnmr_relapse":
        return [GNMRCallback(dataclasses.replace(config, relapse_lock=True))]
    if arm in ("gnmr_cause", "gnmr_cause_zclip"):
        return [GNMRCallback(dataclasses.replace(config, policy="cause"))]
    if arm == "gnmr_impact":
        return [GNMRCallback(dataclasses.replace(config, policy="impact", policy_options=impact_options or None))]
    if arm in STABILIZER_ARMS:  # the units' part, every unit cheap; run_arm adds the stabilizer
        return [_with_policy(config, "static_low")]
    if arm in ("static_low", "static_high", "global_z"):
        return [_with_policy(config, arm)]
    if arm == "carve_best":
        if not carve_units:
            raise ValueError("arm_callbacks: carve_best needs carve_units (the units with the largest oracle gaps)")
        return [_with_policy(config, "carve_out", units=list(carve_units))]
    if arm == "carve_named":
        if not carve_patterns:
            raise ValueError("arm_callbacks: carve_named needs carve_patterns (PretrainArguments.carve_named)")
        return [_with_policy(config, "carve_named", patterns=list(carve_patterns))]
    if budget is None:
        raise ValueError(f"arm_callbacks: {arm} needs budget, the average number of units GNMR recovered")
    if arm == "random":
        return [_with_policy(config, "random", mean_active=budget, seed=seed)]
    return [_with_policy(config, "carve_first_last", count=max(1, round(budget)))]


def _with_policy(config: GNMRConfig, policy: str, **options: Any) -> GNMRCallback:
    """A callback over `config`'s units with the baseline `policy` (`gnmr_hf.experiments.baselines`)."""
    return GNMRCallback(dataclasses.replace(config, policy=policy, policy_options=options))


def run_arm(
    arm: str,
    seed: int,
    *,
    args: TrainingArguments,
    pretrain: PretrainArguments,
    config: GNMRConfig,
    corpus: Corpus,
    budget: float | None = None,
    carve_units: Sequence[str] | None = None,
    extra_callbacks: Callable[[GNMRCallback | None], Sequence[TrainerCallback]] | None = None,
) -> dict[str, Any]:
    """Train one arm from scratch with one seed in `args.output_dir`, evaluate it, write and return `result.json`.

    A stabilizer arm (`STABILIZER_ARMS`) adds its method's callbacks and optimizer and sets the Trainer's own
    clipping as the method asks (`gnmr_hf.experiments.stabilizers`); what it did is the result's `stabilizer`.

    `extra_callbacks(owner)` adds callbacks that need the arm's unit-owning callback (None for the reference), such
    as a fault injector; they run after the arm's own callbacks and before the step meter.
    """
    from .oracle import OracleCallback

    out = Path(args.output_dir)
    args = dataclasses.replace(args, seed=seed)
    model = recipe_model(pretrain, seed)
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    # TrainingArguments.data_seed (default 0 here) seeds the batch order, the same in every arm. A real model's
    # weights are the same in every seed, so there the seed draws the batch order instead.
    default_data_seed = 0 if pretrain.model == "scratch" else seed
    data_seed = args.data_seed if args.data_seed is not None else default_data_seed
    train = block_dataset(corpus.train, pretrain.seq_len, args.max_steps * batch, data_seed)
    validation = block_dataset(corpus.validation, pretrain.seq_len, pretrain.eval_blocks, None)
    callbacks = arm_callbacks(
        arm,
        config,
        seed,
        budget=budget,
        carve_units=carve_units,
        carve_patterns=pretrain.carve_named,
        impact_options=pretrain.impact_options,
    )
    owner = next((cb for cb in callbacks if isinstance(cb, GNMRCallback)), None)
    if owner is not None and pretrain.oracle_every and arm.startswith("gnmr"):
        callbacks.append(
            OracleCallback(owner, train, batch, every=pretrain.oracle_every, benefits=pretrain.oracle_benefits)
        )
    stabilizer = None
    if arm in STABILIZER_ARMS:
        stabilizer = stabilizer_for(arm, args, parse_options(pretrain.stabilizer_options))
        args = dataclasses.replace(args, max_grad_norm=stabilizer.max_grad_norm)
        callbacks += stabilizer.callbacks
    meter = StepMeter()
    callbacks += [*(extra_callbacks(owner) if extra_callbacks is not None else ()), meter]
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=validation,
        callbacks=callbacks,
        optimizer_cls_and_kwargs=stabilizer.optimizer_cls_and_kwargs if stabilizer is not None else None,
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    final = trainer.evaluate()
    history = trainer.state.log_history
    result: dict[str, Any] = {
        "arm": arm,
        "seed": seed,
        "data_seed": data_seed,
        "learning_rate": args.learning_rate,
        "max_steps": args.max_steps,
        "model": {k: getattr(pretrain, k) for k in ("model", "d_model", "n_layers", "n_heads", "seq_len")},
        "corpus": {"source": corpus.source, "fingerprint": corpus.fingerprint(), "train_bytes": len(corpus.train)},
        "backend": None if arm == "reference" else config.backend,
        "backend_options": None if arm == "reference" else config.backend_options,
        "final_eval_loss": final["eval_loss"],
        "final_eval_ppl": math.exp(min(final["eval_loss"], 50.0)),
        "train_loss": [(h["step"], h["loss"]) for h in history if "loss" in h],
        "eval_loss": [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h],
        "sec_per_step": statistics.median(meter.seconds) if meter.seconds else math.nan,
        "wall_seconds": wall,
        "saved_bytes_per_step": statistics.fmean(meter.saved_bytes) if meter.saved_bytes else math.nan,
    }
    if owner is not None:
        result.update(_trace_facts(out / config.trace_file, owner))
    if stabilizer is not None:
        result["stabilizer"] = stabilizer.record()
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _trace_facts(path: Path, owner: GNMRCallback) -> dict[str, Any]:
    """Recovery fraction, mean number of recovered units and exceedance rate of a run, from its trace."""
    header, records = read_trace(path)
    steps = [r for r in records if r["type"] == "step"]
    n_units = len(header["units"])
    active = sum(len(r["active"]) for r in steps)
    scored = sum(r["n_scored"] for r in steps)
    ledger = owner.units[0].ledger if owner.units else None
    return {
        "units": n_units,
        "unit_names": header["units"],
        "recovery_fraction": active / (n_units * len(steps)) if steps else 0.0,
        "mean_active": active / len(steps) if steps else 0.0,
        "exceedance_rate": sum(len(r["risky"]) for r in steps) / scored if scored else 0.0,
        "recovery_steps_per_unit": [sum(1 for r in steps if i in set(r["active"])) for i in range(n_units)],
        "ledger_peak_bytes": ledger.peak_bytes if ledger is not None else None,
    }


# -------------------------------------------------------------------------------------------------- report


def load_results(root: str | Path) -> list[dict[str, Any]]:
    """Every `result.json` under `root`, sorted by arm order then seed."""
    results = [json.loads(p.read_text()) for p in sorted(Path(root).rglob("result.json"))]
    order = {a: i for i, a in enumerate(ARMS)}
    return sorted(results, key=lambda r: (order.get(r["arm"], len(order)), r["seed"]))


def _mean_spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.4f}"
    return f"{mean:.4f} ± {(max(values) - min(values)) / 2:.4f}"


def results_table(results: Sequence[dict[str, Any]]) -> str:
    """A markdown table, one row per arm, over its seeds: mean ± half-range of the final validation loss,
    perplexity (per byte), the share of the static low -> static high loss gap closed (per seed, then averaged;
    needs both static arms with the same seed), unit-steps recovered, exceedance rate, seconds per step and MB
    saved for backward per step; with stabilizer arms, what each did (summed over its seeds)."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    low = {r["seed"]: r["final_eval_loss"] for r in by_arm.get("static_low", [])}
    high = {r["seed"]: r["final_eval_loss"] for r in by_arm.get("static_high", [])}
    header = ["arm", "seeds", "val loss", "val ppl", "gap closed", "unit-steps recovered", "exceedance", "s/step"]
    stabilized = any("stabilizer" in r for r in results)
    saved_note = _same_saved_bytes(results)
    header += [*([] if saved_note else ["saved MB/step"]), *(["stabilizer did"] if stabilized else [])]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    note, in_noise = _gap_note(low, high, _loss_unit(results))
    note = "\n".join(n for n in (note, saved_note) if n)
    for arm, runs in by_arm.items():
        losses = [r["final_eval_loss"] for r in runs]
        closed = [
            (low[r["seed"]] - r["final_eval_loss"]) / (low[r["seed"]] - high[r["seed"]])
            for r in runs
            if r["seed"] in low and r["seed"] in high and low[r["seed"]] != high[r["seed"]]
        ]
        recovered = [r["recovery_fraction"] for r in runs if "recovery_fraction" in r]
        exceed = [r["exceedance_rate"] for r in runs if "exceedance_rate" in r]
        lines.append(
            "| "
            + " | ".join(
                [
                    arm,
                    ",".join(str(r["seed"]) for r in runs),
                    _mean_spread(losses),
                    f"{statistics.fmean(r['final_eval_ppl'] for r in runs):.3f}",
                    (_whole_percent(statistics.fmean(closed)) + (" (gap within noise)" if in_noise else ""))
                    if closed
                    else "-",
                    f"{statistics.fmean(recovered):.2%}" if recovered else "-",
                    f"{statistics.fmean(exceed):.3%}" if exceed else "-",
                    f"{statistics.fmean(r['sec_per_step'] for r in runs):.3f}",
                    *(
                        []
                        if saved_note
                        else [f"{statistics.fmean(r['saved_bytes_per_step'] for r in runs) / 2**20:.1f}"]
                    ),
                    *([_stabilizer_cell(runs)] if stabilized else []),
                ]
            )
            + " |"
        )
    return "\n".join(lines + ([f"\n{note}"] if note else []))


def _whole_percent(share: float) -> str:
    """`share` as a whole percentage; one that rounds to zero is 0%, not -0%."""
    text = f"{share:.0%}"
    return "0%" if text == "-0%" else text


def _same_saved_bytes(results: Sequence[dict[str, Any]]) -> str:
    """The line that replaces the saved MB/step column when the backend cannot change it, else "".

    block_fp's GEMMs save x and W themselves, in fp32, and round them again in the backward (`BlockFPLinear`), so
    what autograd keeps for backward is the same in every arm, whatever the formats: a column would repeat one
    number (act_quant, which stores saved activations at the path's bits, is where the column says something)."""
    if {r.get("backend") for r in results} - {None} != {"block_fp"}:
        return ""
    mb = sorted(r["saved_bytes_per_step"] / 2**20 for r in results)
    low, high = f"{mb[0]:.1f}", f"{mb[-1]:.1f}"
    amount = f"{low} MB/step in every arm" if low == high else f"{low} to {high} MB/step"
    return (
        f"Saved for backward: {amount} (block_fp keeps each GEMM's inputs in fp32 and rounds them again in the "
        "backward, so its formats do not change what autograd keeps)."
    )


def _stabilizer_cell(runs: Sequence[dict[str, Any]]) -> str:
    records = [r["stabilizer"] for r in runs if "stabilizer" in r]
    if not records:
        return "-"
    total = {k: sum(r[k] for r in records) for k, v in records[0].items() if isinstance(v, int) and k in records[-1]}
    options = records[0]["options"]
    return describe(total) + (f" ({','.join(f'{k}={v}' for k, v in options.items())})" if options else "")


def _loss_unit(results: Sequence[dict[str, Any]]) -> str:
    """What the losses are per: a byte for models built here, a token of its tokenizer for a real model."""
    real = any(r.get("model", {}).get("model", "scratch") != "scratch" for r in results)
    return "nats/token" if real else "nats/byte"


def _gap_note(low: dict[int, float], high: dict[int, float], unit: str = "nats/byte") -> tuple[str, bool]:
    """What the static low -> high gap is against seed-to-seed noise, and whether it is within that noise.

    "gap closed" divides by the gap, so a gap no larger than the spread between seeds gives any share (116%, -5%)
    by chance. The noise is the larger half-range across seeds of the two static arms' final losses; with one seed
    it is unmeasured, and the table says so instead of implying a precision it does not have."""
    seeds = sorted(set(low) & set(high))
    if not seeds:
        return "", False
    gaps = [low[s] - high[s] for s in seeds]
    gap = statistics.fmean(gaps)
    text = f"Static low -> high gap: {gap:.4f} {unit} (seeds {','.join(map(str, seeds))})"
    if len(seeds) < 2:
        return text + "; with one seed its noise is unmeasured: read 'gap closed' as indicative only.", False
    noise = max((max(d[s] for s in seeds) - min(d[s] for s in seeds)) / 2 for d in (low, high))
    if abs(gap) <= noise:
        return text + f", within the seed-to-seed half-range {noise:.4f}: 'gap closed' is noise here.", True
    return text + f", {abs(gap) / noise:.1f}x the seed-to-seed half-range {noise:.4f}." if noise else text + ".", False


# Line styles for the arms, so that arms a hair apart stay distinguishable where colours alone would overlap.
_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")


def plot_loss_curves(results: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Validation loss (left) and smoothed training loss (right) against the step, one line per arm (mean over
    its seeds), written as a PNG. Below each, every arm minus static_high (or the reference): arms often end within
    a thousandth of each other, which the loss axis cannot show. Each arm has its own colour, dash and marker;
    arms whose curves are identical (no unit ever recovered, say) share one line and one label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_arm: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    base = next((arm for arm in ("static_high", "reference") if arm in by_arm), None)
    rows = 2 if base is not None and len(by_arm) > 1 else 1
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.5 * rows), sharex="col", squeeze=False)
    for col, key in enumerate(("eval_loss", "train_loss")):
        curves = {arm: _mean_curve(runs, key) for arm, runs in by_arm.items()}
        same: dict[tuple[tuple[int, ...], tuple[float, ...]], list[str]] = {}
        for arm, curve in curves.items():
            same.setdefault(curve, []).append(arm)
        for i, arm in enumerate(by_arm):
            steps, values = curves[arm]
            group = same[curves[arm]]
            if arm != group[0] or not steps:
                continue
            runs = by_arm[arm]
            seeds = f"seed {runs[0]['seed']}" if len(runs) == 1 else f"mean of {len(runs)} seeds"
            label = " = ".join(group) + f" ({seeds}" + (", identical)" if len(group) > 1 else ")")
            label = "\n".join(textwrap.wrap(label, 48, subsequent_indent="  "))  # a narrow legend hides less
            style = dict(
                color=f"C{i % 10}",
                linestyle=_LINESTYLES[i % len(_LINESTYLES)],
                marker=_MARKERS[i % len(_MARKERS)],
                markevery=max(1, len(steps) // 12),
                markersize=5,
                label=label,
            )
            axes[0][col].plot(steps, values, **style)
            if rows == 2:
                ref = dict(zip(*curves[base], strict=True))
                common = [(s, v - ref[s]) for s, v in zip(steps, values, strict=True) if s in ref]
                axes[1][col].plot([s for s, _ in common], [d for _, d in common], **style)
    unit = _loss_unit(results)
    axes[0][0].set(ylabel=f"validation loss ({unit})", title="validation")
    axes[0][1].set(ylabel="training loss (EMA 0.8)", title="training")
    if rows == 2:
        axes[1][0].set(ylabel=f"validation loss minus {base}'s ({unit})")
        axes[1][1].set(ylabel=f"training loss (EMA 0.8) minus {base}'s")
        for ax in axes[1]:
            ax.axhline(0.0, color="black", linewidth=0.6)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set(xlabel="optimizer step")
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:  # a run too short to log a training loss has none
            ax.legend(fontsize=7, loc="upper right")  # loss curves fall: their top right is free
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean_curve(runs: Sequence[dict[str, Any]], key: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(steps, values) of `key` (eval_loss, train_loss) averaged over `runs` at the steps they all logged; the
    training loss smoothed by an EMA of 0.8."""
    curves = [dict(map(tuple, r[key])) for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    mean = [statistics.fmean(c[s] for c in curves) for s in steps]
    if key == "train_loss" and mean:
        smooth, value = [], mean[0]
        for v in mean:
            value = 0.8 * value + 0.2 * v
            smooth.append(value)
        mean = smooth
    return tuple(steps), tuple(mean)


def _describe(results: Sequence[dict[str, Any]]) -> str:
    """A plot title from what the runs share: backend and options, model, steps, learning rate, seeds."""
    first = results[0]
    backend = next((r["backend"] for r in results if r.get("backend")), None)
    options = next((r["backend_options"] for r in results if r.get("backend")), None) or {}
    model = first["model"]
    parts = [
        f"{backend} {','.join(f'{k}={v}' for k, v in options.items())}".strip() if backend else "reference only",
        f"LLaMA d={model['d_model']} x{model['n_layers']} layers",
        f"{first['max_steps']} steps, lr {first['learning_rate']:g}",
        f"seeds {','.join(str(s) for s in sorted({r['seed'] for r in results}))}",
    ]
    return "; ".join(parts)


def gnmr_budget(root: str | Path, seed: int) -> float | None:
    """The mean number of units the gnmr arm of `seed` recovered, from its result under `root`, else None."""
    path = Path(root) / "gnmr" / f"seed{seed}" / "result.json"
    return json.loads(path.read_text())["mean_active"] if path.is_file() else None


def oracle_mean_gaps(root: str | Path, seed: int) -> dict[str, float] | None:
    """Mean oracle gap per unit over the gnmr run of `seed` under `root` (its oracle.jsonl), else None."""
    from .oracle import read_oracle

    path = Path(root) / "gnmr" / f"seed{seed}" / "oracle.jsonl"
    if not path.is_file():
        return None
    names, records = read_oracle(path)
    gaps = torch.tensor([r["gaps"] for r in records], dtype=torch.float64)
    return dict(zip(names, gaps.nanmean(0).tolist(), strict=True))


# -------------------------------------------------------------------------------------------------- recipes


def parse_recipe_arguments(
    argv: Sequence[str], **defaults: Any
) -> tuple[TrainingArguments, PretrainArguments, GNMRConfig]:
    """`TrainingArguments`, `PretrainArguments` and `GNMRConfig` from a recipe's command line, with the recipe's
    own `defaults` for any of their fields (e.g. ``backend="block_fp"``) and the preset's schedule filling every
    `TrainingArguments` field the command line does not give. A user error exits with one line (`gnmr_hf.cli`)."""
    from transformers import HfArgumentParser

    from ..commandline import check_config, parse_or_fail

    # No abbreviations: with three dataclasses' flags in one parser, a prefix would pick whichever flag it matches.
    parser = HfArgumentParser((TrainingArguments, PretrainArguments, GNMRConfig), allow_abbrev=False)
    parser.set_defaults(**defaults)
    base, pretrain, config = parse_or_fail(parser, argv)
    check_config(config)
    given = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    return training_arguments(base, pretrain.preset, given), pretrain, config


def run_comparison(
    root: str | Path, *, args: TrainingArguments, pretrain: PretrainArguments, config: GNMRConfig, corpus: Corpus
) -> list[dict[str, Any]]:
    """Every arm of `pretrain.arms` for every seed of `pretrain.seeds` (seeds outer), each in `root/<arm>/seed<k>`,
    and return their results. The budget arms take the mean budget of the gnmr run of the same seed under `root`
    (or `pretrain.budget`), carve_best the units with the largest mean oracle gaps of that run, so run gnmr first."""

    root = Path(root)
    check_arm_plan(root, pretrain, config)
    results = []
    for seed in pretrain.seeds:
        for arm in pretrain.arms:
            budget = pretrain.budget if pretrain.budget is not None else gnmr_budget(root, seed)
            if arm in BUDGET_ARMS and budget is None:
                raise ValueError(f"arm {arm} needs the gnmr run of seed {seed} in {root} first, or --budget")
            carve_units = None
            if arm == "carve_best":
                gaps = oracle_mean_gaps(root, seed)
                if gaps is None:
                    raise ValueError(f"arm carve_best needs the gnmr run of seed {seed} with --oracle_every in {root}")
                carve_units = best_static_units(gaps, max(1, round(budget)))
            out = root / arm / f"seed{seed}"
            logger.info("arm %s, seed %d -> %s", arm, seed, out)
            result = run_arm(
                arm,
                seed,
                args=dataclasses.replace(args, output_dir=str(out)),
                pretrain=pretrain,
                config=config,
                corpus=corpus,
                budget=budget,
                carve_units=carve_units,
            )
            logger.info("arm %s seed %d: final validation loss %.4f", arm, seed, result["final_eval_loss"])
            results.append(result)
    return results


def check_arm_plan(root: str | Path, pretrain: PretrainArguments, config: GNMRConfig) -> None:
    """Everything the arm list needs, checked before the first arm trains (a failure after an hour of arms is a
    lost hour): the budget arms and carve_best need a gnmr run of each seed, earlier in the list or already in
    `root` (carve_best's with oracle probes), and carve_named's regexes must match some unit of this model."""
    root = Path(root)
    for seed in pretrain.seeds:
        for i, arm in enumerate(pretrain.arms):
            gnmr_first = "gnmr" in pretrain.arms[:i]
            if arm in BUDGET_ARMS and pretrain.budget is None and not gnmr_first and gnmr_budget(root, seed) is None:
                raise ValueError(
                    f"arm {arm} takes GNMR's budget: put gnmr before it in --arms, run gnmr of seed {seed} into "
                    f"{root} first, or give --budget"
                )
            if arm == "carve_best":
                if gnmr_first and not pretrain.oracle_every:
                    raise ValueError("arm carve_best needs --oracle_every K > 0 for the gnmr run it follows")
                if not gnmr_first and oracle_mean_gaps(root, seed) is None:
                    raise ValueError(
                        f"arm carve_best needs the gnmr run of seed {seed} with --oracle_every in {root}: put gnmr "
                        "before it in --arms with --oracle_every K"
                    )
    if "carve_named" in pretrain.arms:
        names = unit_names(pretrain, config)
        patterns = [re.compile(p) for p in pretrain.carve_named or ()]
        if not any(p.search(name) for p in patterns for name in names):
            raise ValueError(
                f"--carve_named {' '.join(pretrain.carve_named or ())} matches no unit; with --backend "
                f"{config.backend} --backend_options {config.backend_options or '{}'} the units are {names}"
            )


def unit_names(pretrain: PretrainArguments, config: GNMRConfig) -> list[str]:
    """The names of the units `config` finds on this recipe's model (built once, then dropped)."""
    from ..registry import find_units

    model = recipe_model(pretrain, 0)
    units = find_units(
        model, config.backend, include=config.include, exclude=config.exclude, backend_options=config.backend_options
    )
    units.close()
    return units.names


def run_recipe(args: TrainingArguments, pretrain: PretrainArguments, config: GNMRConfig) -> list[dict[str, Any]]:
    """What a pretraining recipe does once its flags are parsed: load the corpus (logged with its fingerprint),
    run every arm and seed under `args.output_dir`, print the table (and write the plot), return the results."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from ..commandline import fail

    try:
        check_arm_plan(args.output_dir, pretrain, config)
    except ValueError as err:
        fail(str(err))
    logger.info("arms %s, seeds %s -> %s", " ".join(pretrain.arms), pretrain.seeds, args.output_dir)
    corpus = retokenize(load_corpus(pretrain.corpus, pretrain.corpus_bytes), pretrain.model)
    logger.info(
        "corpus %s: %d documents, %d training bytes, %d validation bytes (fingerprint %s); %s options %s",
        corpus.source,
        corpus.documents,
        len(corpus.train),
        len(corpus.validation),
        corpus.fingerprint(),
        config.backend,
        config.backend_options,
    )
    root = Path(args.output_dir)
    results = run_comparison(root, args=args, pretrain=pretrain, config=config, corpus=corpus)
    print(write_report(root, plot=pretrain.plot))
    return results


def write_report(root: str | Path, *, plot: bool = True, title: str = "") -> str:
    """The table over every `result.json` under `root` (arms run by separate commands end up in one table), written
    to `root/results.md`, and with `plot` the loss curves to `root/loss_curves.png`; returns the table."""
    root = Path(root)
    everything = load_results(root)
    table = results_table(everything)
    (root / "results.md").write_text(table + "\n")
    if plot and everything:
        plot_loss_curves(everything, root / "loss_curves.png", title=title or _describe(everything))
    return table
