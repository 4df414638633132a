"""`gnmr-hf plan`: the carve-out before training, on your own model and text (`gnmr_hf.plan`).

    gnmr-hf plan --model smollm2-135m --backend block_fp --backend_options low_format=e2m1 --data notes.txt \
        --batches 4 --batch_size 4 --seq_len 128 --budget 0.15 --output plan.json

Loads the model (`--model`: smollm2-135m, a .gguf file or a transformers folder, fp32), cuts the text file into
`--batches` batches of `--batch_size` blocks of `--seq_len` tokens (from its start, in its tokenizer's tokens), runs
one forward and backward per batch with every unit of `--backend` measuring what its cheap path costs the loss, and
prints the ranking, the smallest carve-outs that buy 90% and 99% of it, and the carve-out at `--budget` (a count of
units, or a fraction of them) in the forms users paste. `--output` writes it all as JSON: {"ranked": [{"unit",
"impact"}, ...] (largest impact first), "carve_out": [unit names at --budget], ...}. A mistake in the flags is one
line, exit 2, before any model loads.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .commandline import fail, one_line_errors, quiet_unused_imports

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gnmr-hf plan",
        description="Rank a model's units by what their cheap path costs the loss on your text, before training, "
        "and print the carve-outs.",
        allow_abbrev=False,
    )
    parser.add_argument("--model", required=True, help="smollm2-135m, a .gguf file, or a transformers model folder.")
    parser.add_argument("--backend", default="block_fp", help="The backend whose units are ranked (default block_fp).")
    parser.add_argument("--backend_options", default=None, help="The backend's options, 'key=value,...' or JSON.")
    parser.add_argument("--data", required=True, help="A UTF-8 text file to calibrate on.")
    parser.add_argument("--batches", type=int, default=4, help="Batches to average over (default 4).")
    parser.add_argument("--batch_size", type=int, default=4, help="Blocks per batch (default 4).")
    parser.add_argument("--seq_len", type=int, default=128, help="Tokens per block (default 128).")
    parser.add_argument(
        "--budget", default="0.15", help="The carve-out's size: a count of units, or a fraction of them (0.15)."
    )
    parser.add_argument("--include", nargs="*", default=None, help="Regexes: only matching modules are units.")
    parser.add_argument("--exclude", nargs="*", default=None, help="Regexes: matching modules are never units.")
    parser.add_argument("--output", default=None, help="Write the plan as JSON here (PLAN.json).")
    parser.add_argument("--top", type=int, default=20, help="Units listed in the printed ranking (default 20).")
    return one_line_errors(parser)


def _check(args: argparse.Namespace) -> str:
    """Every flag that can be checked without the model; returns the text of --data."""
    from .planning import parse_budget

    for flag, value, minimum in (
        ("--batches", args.batches, 1),
        ("--batch_size", args.batch_size, 1),
        ("--seq_len", args.seq_len, 2),
        ("--top", args.top, 1),
    ):
        if value < minimum:
            fail(f"{flag} must be an int >= {minimum}, got {value}")
    try:
        args.budget = parse_budget(args.budget, what="--budget")
    except ValueError as err:
        fail(str(err))
    data = Path(args.data)
    if not data.is_file():
        fail(f"--data must be a text file; {data} is {'a folder' if data.is_dir() else 'not there'}")
    try:
        text = data.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        fail(f"--data must be UTF-8 text; {data} is not: {err}")
    if args.output is not None:
        out = Path(args.output)
        if out.is_dir():
            fail(f"--output is the JSON file to write; {out} is a folder")
        if not out.parent.exists():
            fail(f"--output: the folder {out.parent} does not exist")
    with quiet_unused_imports(args.backend):
        from .options import parse_options_text
        from .registry import get_backend

        try:
            backend = get_backend(args.backend)
        except ValueError as err:
            fail(f"--backend: {err}")
        try:
            backend.parse_options(parse_options_text(args.backend_options, what="options"))
        except (TypeError, ValueError) as err:
            fail(f"--backend_options: {err}")
        from .experiments.models import check_model

    try:
        check_model(args.model)
    except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
        fail(f"--model: {err}")
    return text


def main(argv: Sequence[str]) -> int:
    args = _parser().parse_args(argv)
    text = _check(args)
    # Loading and finding the units import what transformers and the backends import lazily (torchao, bitsandbytes'
    # kernels): inside the quieting block too, so that the ranking is what the user reads.
    with quiet_unused_imports(args.backend):
        import transformers  # noqa: F401  (then deepspeed, at the block's end, without its CPU line)
    with quiet_unused_imports(args.backend):
        ranking = _rank(args, text)
    ranking.source = f"{args.model}, {args.data}: " + ranking.source
    print(ranking.format(budget=args.budget, top=args.top))
    if args.output is not None:
        data = ranking.to_dict(args.budget) | {"model": args.model, "data": args.data, "seq_len": args.seq_len}
        Path(args.output).write_text(json.dumps(data, indent=1))
        print(f"plan: {args.output}")
    sys.stdout.flush()
    return 0


def _rank(args: argparse.Namespace, text: str) -> Any:
    """The model loaded, the text cut into batches, and `gnmr_hf.plan`'s ranking of its units."""
    import torch

    from .experiments.models import load_real_model
    from .planning import plan

    model, tokenizer = load_real_model(args.model)
    ids = torch.tensor(tokenizer(text).input_ids, dtype=torch.long)
    per_batch = args.batch_size * args.seq_len
    if len(ids) < args.batches * per_batch:
        fail(
            f"--data holds {len(ids)} tokens of this model's tokenizer; --batches {args.batches} x --batch_size "
            f"{args.batch_size} x --seq_len {args.seq_len} need {args.batches * per_batch}"
        )
    batches = []
    for b in range(args.batches):
        block = ids[b * per_batch : (b + 1) * per_batch].reshape(args.batch_size, args.seq_len)
        batches.append({"input_ids": block, "labels": block})
    try:
        ranking = plan(
            model,
            batches,
            backend=args.backend,
            backend_options=args.backend_options,
            include=args.include,
            exclude=args.exclude,
        )
        if isinstance(args.budget, int) and args.budget > len(ranking.units):
            raise ValueError(f"--budget {args.budget} is more than the {len(ranking.units)} units found")
    except ValueError as err:
        fail(str(err))
    return ranking
