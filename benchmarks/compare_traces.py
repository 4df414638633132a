"""Compare two folders of runs of the same arms, decision by decision: the check that a change of the code kept every
decision it should keep (docs/results.md, "The policy seam: the same decisions, step by step").

    python benchmarks/compare_traces.py runs/ref/before runs/ref/after

For every `gnmr_trace.jsonl` under the first folder, the file at the same place under the second: every step record
compared field by field, every field both records have (a field only one side has, one the newer code added, is
named once, not compared); and the final validation loss of the two `result.json` beside them. Prints one line per
trace and exits with status 1 on any difference or a trace missing from the second folder.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from gnmr_hf.commandline import fail, one_line_errors, quiet_unused_imports

with quiet_unused_imports():
    from gnmr_hf.trace import read_trace


def compare(before: Path, after: Path) -> tuple[str, bool]:
    """One line on the two traces `before` and `after`, and whether they agree."""
    _, old = read_trace(before)
    _, new = read_trace(after)
    old = [r for r in old if r["type"] == "step"]
    new = [r for r in new if r["type"] == "step"]
    if len(old) != len(new):
        return f"{len(old)} steps against {len(new)}", False
    only = sorted({k for a, b in zip(old, new, strict=True) for k in set(a) ^ set(b)})
    for a, b in zip(old, new, strict=True):
        for key in sorted(set(a) & set(b)):
            if a[key] != b[key]:
                return f"step {a['step']}: {key} differs ({a[key]!r} against {b[key]!r})", False
    losses = []
    for trace in (before, after):
        result = trace.parent / "result.json"
        losses.append(json.loads(result.read_text()).get("final_eval_loss") if result.is_file() else None)
    if losses[0] != losses[1]:
        return f"the same {len(old)} steps, but final validation loss {losses[0]} against {losses[1]}", False
    fields = f"; compared without {', '.join(only)} (one side only)" if only else ""
    return f"the same {len(old)} steps, final validation loss {losses[0]}{fields}", True


def main(argv: list[str] | None = None) -> int:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("before", type=Path, help="The folder of the reference runs.")
    parser.add_argument("after", type=Path, help="The folder of the same runs with the code to check.")
    args = parser.parse_args(argv)
    traces = sorted(args.before.rglob("gnmr_trace.jsonl"))
    if not traces:
        fail(f"before: {args.before} holds no gnmr_trace.jsonl")
    same = True
    for trace in traces:
        name = trace.relative_to(args.before)
        other = args.after / name
        if not other.is_file():
            line, ok = "missing in the second folder", False
        else:
            line, ok = compare(trace, other)
        same &= ok
        print(f"{'same' if ok else 'DIFFERENT'}  {name.parent}: {line}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
