"""Write a fine-tuning file of MMLU questions that an evaluation with `--limit N` (N <= --skip_first) never asks.

    python recipes/mmlu_train_data.py --output runs/mmlu_train/letters.jsonl --skip_first 20
    python recipes/finetune_13b.py --preset tiny --model smollm2-135m --arm bf16 \\
        --train_file runs/mmlu_train/letters.jsonl --prompt_template plain --max_seq_length 256 \\
        --output_dir runs/mmlu_ft/bf16
    python recipes/evaluate.py --model runs/mmlu_ft/bf16 --tasks mmlu --limit 20 --num_fewshot 0 \\
        --output_dir runs/mmlu_ft/bf16/eval

Each subject's first `--skip_first` test questions (the ones `recipes/evaluate.py --limit N` scores, and its few-shot
examples, taken from the top of the same list) are left out; every other question becomes one row, its prompt the
exact 0-shot context lm-eval builds for it and its output the answer lm-eval scores as right: `" B"` with
`--form letters` (the `mmlu` task), the answer's text with `--form continuation` (`mmlu_continuation`). Train with
`--prompt_template plain`, so the model learns the evaluation's own format on questions it is never asked. MMLU's
questions come from the checksummed offline copy (gnmr_hf.experiments.mmlu), whose only split is the test split;
docs/lab/int8_lora.md says what a fine-tune on it does to MMLU.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    from gnmr_hf.experiments.mmlu import MMLU_TRAIN_FORMS

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="The JSONL file to write (instruction, output, subject).")
    parser.add_argument(
        "--skip_first", type=int, default=20, help="Questions of each subject left out, from the top (default 20)."
    )
    parser.add_argument("--form", default="letters", help=f"One of {', '.join(MMLU_TRAIN_FORMS)} (default letters).")
    args = parser.parse_args(argv)
    if args.form not in MMLU_TRAIN_FORMS:
        parser.error(f"--form must be one of {', '.join(MMLU_TRAIN_FORMS)}; got {args.form!r}")
    if args.skip_first < 0:
        parser.error(f"--skip_first must be >= 0; got {args.skip_first}")
    from gnmr_hf.experiments.mmlu import write_mmlu_train

    count = write_mmlu_train(args.output, args.skip_first, args.form)
    left_out = f"first {args.skip_first} of each subject left out"
    print(f"wrote {count} questions to {args.output} ({args.form} form; {left_out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
