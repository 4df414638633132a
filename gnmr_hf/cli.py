"""The `gnmr-hf` command: `gnmr-hf demo` runs the tiny offline fine-tune, `gnmr-hf report TRACE` summarizes one,
`gnmr-hf advise TRACE` turns one into a static carve-out (`gnmr_hf.advise`)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

__all__ = ["main"]


def _report(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog="gnmr-hf report", description="Summarize a GNMR trace and plot it.")
    parser.add_argument("trace", help="A gnmr_trace.jsonl written by GNMRCallback.")
    parser.add_argument("--out", default=None, help="Folder for the PNG plots (default: next to the trace).")
    parser.add_argument("--top", type=int, default=8, help="How many units to list and plot.")
    parser.add_argument("--no-plots", action="store_true", help="Print the summary only (no matplotlib).")
    parser.add_argument("--json", action="store_true", help="Print the summary as JSON.")
    args = parser.parse_args(argv)
    if args.top < 1:
        parser.error(f"--top must be >= 1, got {args.top}")
    from .report import report

    try:
        summary, paths = report(args.trace, args.out, plots=not args.no_plots, top_k=args.top)
    except (FileNotFoundError, ValueError) as err:
        print(f"gnmr-hf report: {err}", file=sys.stderr)
        return 2
    print(json.dumps(summary.as_dict(args.top), indent=2) if args.json else summary.format(args.top))
    for path in paths:
        print(f"plot: {path}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"report": _report, "demo": None, "advise": None}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        print("usage: gnmr-hf {demo,report,advise} [options]\n")
        print("  demo    run the tiny offline GNMR LoRA fine-tune (INT8 <-> BF16; --backend bnb_4bit: NF4 <-> BF16)")
        print("          and print its report")
        print("  report  summarize a GNMR decision trace and write its plots")
        print("  advise  print the units a run needed persistently as a static carve-out")
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    if argv[0] == "advise":
        from .advise import main as advise_main

        return advise_main(argv[1:])
    if argv[0] == "demo":
        from .experiments.demo import main as demo_main

        return demo_main(argv[1:])
    return _report(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
