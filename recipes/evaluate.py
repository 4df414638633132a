"""Evaluate a model or a fine-tune with lm-evaluation-harness (MMLU 5-shot, HellaSwag 0-shot), then compare arms.

    python recipes/evaluate.py --model runs/gnmr --tasks mmlu,hellaswag --output_dir runs/gnmr/eval
    python recipes/evaluate.py --model meta-llama/Llama-2-13b-hf --adapter runs/int8 --load_in_8bit \\
        --output_dir runs/int8/eval
    python recipes/evaluate.py --model runs/int8 --int8_eval fp32 --output_dir runs/int8/eval_fp32
    python recipes/evaluate.py --compare runs/int8/eval runs/gnmr/eval runs/bf16/eval --names int8 gnmr bf16 \\
        --output_dir runs/compare
    python recipes/evaluate.py --model runs/gnmr --int8_eval fp32 --log_samples --output_dir runs/gnmr/eval
    python recipes/evaluate.py --compare runs/bf16/eval runs/gnmr/eval --reference bf16 --output_dir runs/compare

`--model` is a model folder, a Hub name, a real model's name (`smollm2-135m`, the untrained base the recipes
fine-tune), or a fine-tune's output_dir (a peft adapter folder, or a folder with a
gnmr_run.json naming base model and adapter). Offline (HF_HUB_OFFLINE, HF_DATASETS_OFFLINE, or the Hub out of
reach), or with `--offline_tasks`, mmlu runs MMLU's real test questions from a checksummed local copy (k-shot examples
from the same subject's test questions, never the question itself; see gnmr_hf.experiments.mmlu) and hellaswag a
local look-alike, and the log and results.json say so; `--real_tasks` insists on lm-eval's own tasks (from the HF
datasets cache). Offline, a model named by its Hub id must be in the HF cache: that is checked first, in a second.
`--perplexity_file heldout.txt` adds perplexity on held-out text. Each evaluation writes results.json (lm-eval's
own results dict plus what ran) and results.md; `--log_samples` adds each document's score (per_document.jsonl), and
`--compare` then sets every arm against `--reference` (default: the first) question by question, with the paired
difference's standard error; `--compare` writes comparison.md and comparison.json. The work is
done by `gnmr_hf.experiments.evaluation`; this script only parses the flags.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class EvaluateArguments:
    output_dir: str = field(metadata={"help": "Folder for results.json and results.md (or comparison.*)."})
    model: str | None = field(
        default=None,
        metadata={
            "help": "Model folder, Hub name, real model name (smollm2-135m), peft adapter folder or fine-tune "
            "output_dir."
        },
    )
    adapter: str | None = field(default=None, metadata={"help": "A peft adapter folder to apply on top of --model."})
    load_in_8bit: bool | None = field(
        default=None,
        metadata={
            "help": "Load the base model in 8-bit with bitsandbytes (default: as a fine-tune's gnmr_run.json says)."
        },
    )
    int8_eval: str = field(
        default="bnb",
        metadata={
            "help": "With an 8-bit base: bnb (bitsandbytes' own INT8 inference, LLM.int8()), or fp32 / bf16 (its INT8 "
            "weights de-quantized, the adapter merged: the same weights at the plain model's speed, without the "
            "inputs' INT8 rounding; docs/evaluation.md).",
            "choices": ["bnb", "fp32", "bf16"],
        },
    )
    tasks: str = field(default="mmlu,hellaswag", metadata={"help": "Comma-separated lm-eval task names."})
    num_fewshot: int | None = field(
        default=None, metadata={"help": "Shots for every task (default: MMLU 5, HellaSwag 0, others their own)."}
    )
    limit: float | None = field(
        default=None, metadata={"help": "Documents per task (per MMLU subject), or a fraction below 1."}
    )
    include_path: str | None = field(
        default=None, metadata={"help": "A folder of your own task YAMLs, as lm-eval's --include_path."}
    )
    offline_tasks: bool = field(
        default=False, metadata={"help": "Run the local look-alike tasks even when the Hub is reachable."}
    )
    real_tasks: bool = field(
        default=False,
        metadata={"help": "Run the real tasks even when offline is detected (their data must be in the HF cache)."},
    )
    perplexity_file: str | None = field(
        default=None, metadata={"help": "Held-out plain text (documents separated by a blank line) to score."}
    )
    batch_size: str = field(default="1", metadata={"help": "Batch size: an integer or 'auto'."})
    device: str | None = field(default=None, metadata={"help": "cpu, cuda, cuda:1 (default: cuda when available)."})
    compare: list[str] | None = field(
        default=None, metadata={"help": "Compare these arms' eval folders (or results.json files) instead."}
    )
    names: list[str] | None = field(default=None, metadata={"help": "Names of the --compare arms, in order."})
    reference: str | None = field(
        default=None,
        metadata={"help": "The --compare arm the others are paired against, by name (default: the first)."},
    )
    log_samples: bool = field(
        default=False,
        metadata={"help": "Also write each document's score (per_document.jsonl), for paired --compare."},
    )

    def __post_init__(self) -> None:
        if self.compare is None and self.model is None and self.adapter is None:
            raise ValueError("--model is required (or --compare DIR ... to compare finished evaluations)")
        if self.compare is not None and self.model is not None:
            raise ValueError("--compare reads finished evaluations; it does not take --model")
        if self.names is not None and self.compare is None:
            raise ValueError("--names labels the --compare arms; pass --compare DIR ... too")
        if self.reference is not None and self.compare is None:
            raise ValueError("--reference names a --compare arm; pass --compare DIR ... too")
        if self.log_samples and self.compare is not None:
            raise ValueError("--log_samples applies to an evaluation (--model), not to --compare")
        if self.offline_tasks and self.real_tasks:
            raise ValueError("--offline_tasks and --real_tasks exclude each other; pass at most one")
        if self.batch_size != "auto" and not self.batch_size.isdigit():
            raise ValueError(f"--batch_size={self.batch_size!r} must be an integer or 'auto'")


def main(argv: Sequence[str] | None = None) -> int:
    from transformers import HfArgumentParser

    from gnmr_hf.commandline import parse_or_fail, quiet_unused_imports

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    parser = HfArgumentParser(EvaluateArguments, description=__doc__.split("\n\n")[0], allow_abbrev=False)
    for action in parser._actions:
        if action.dest == "load_in_8bit":
            # HfArgumentParser gives an optional bool (None: "as gnmr_run.json says") no bare form; a flag should
            # work as `--load_in_8bit` as well as `--load_in_8bit true`.
            action.nargs, action.const = "?", True
    (args,) = parse_or_fail(parser, argv)

    # evaluate_model imports lm-eval's HF model, peft and bitsandbytes when it needs them, and they speak as they
    # load: the whole evaluation runs inside the quieting block, not only this import.
    with quiet_unused_imports("bnb_int8"):
        from gnmr_hf.experiments.evaluation import compare_results, evaluate_model

        try:
            if args.compare is not None:
                table = compare_results(args.compare, args.output_dir, names=args.names, reference=args.reference)
                print(f"compared {', '.join(table['arms'])}: {args.output_dir}/comparison.md")
                return 0
            limit = args.limit  # a float flag, as lm-eval's own --limit; whole numbers are document counts
            results = evaluate_model(
                args.model,
                adapter=args.adapter,
                load_in_8bit=args.load_in_8bit,
                int8_eval=args.int8_eval,
                tasks=args.tasks,
                num_fewshot=args.num_fewshot,
                limit=int(limit) if limit is not None and limit >= 1 else limit,
                include_path=args.include_path,
                # Neither flag: let the library detect connectivity (gnmr_hf.experiments.evaluation.offline_reason).
                offline_tasks=True if args.offline_tasks else False if args.real_tasks else None,
                perplexity_file=args.perplexity_file,
                batch_size=args.batch_size if args.batch_size == "auto" else int(args.batch_size),
                device=args.device,
                output_dir=args.output_dir,
                log_samples=args.log_samples,
            )
        except (FileNotFoundError, ValueError, OSError) as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
    print(Path(args.output_dir, "results.md").read_text())
    meta = results["metadata"]
    print(f"tasks run: {', '.join(meta['tasks_run'])} (offline: {meta['offline']}); results: {Path(args.output_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
