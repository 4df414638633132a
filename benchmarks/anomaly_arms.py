"""The arms of an anomaly run side by side: what each closes of the gap, what it spends, and the cheap path's loss at
the anomalous steps (docs/lab/anomalies.md, "Every arm").

Reads each arm's `result.json` (written with `--anomalies ... --logging_steps 1`) and the static low and high arms of
the same seed and anomalies:

    python benchmarks/anomaly_arms.py --low runs/anomalies/aq4/arms_s1/static_low/seed1 \\
        --high runs/anomalies/aq4/arms_s1/static_high/seed1 \\
        gnmr_impact=runs/anomalies/aq4/arms_s1/gnmr_impact/seed1 skip_step=runs/anomalies/aq4/arms_s1/skip_step/seed1

Per arm: the final validation loss; the gap closed, (low - arm) / (low - high); the unit-steps in recovery (GNMR's
trace; 0 for an arm without GNMR, 100% for static high); the cheap-path loss at each anomalous step of `--kind` (the
arm's training loss at that step less static high's: what the cheap path costs there, where the step's document is
the same in every arm), and its median over the clean steps (past `--skip`, not anomalous, not within 4 steps after
an anomaly, as benchmarks/anomaly_analysis.py counts them); and, for the skip-step rule, the steps it skipped.
`--json PATH` also writes the rows. `--plot PATH` draws each arm's cheap-path loss over the steps and, for the arm
`--held` names (default: the first arm with a GNMR trace), which units it held on the recovery path at each step,
every anomalous step marked by its kind (needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _result(folder: Path) -> dict[str, Any]:
    path = folder / "result.json"
    if not path.is_file():
        raise SystemExit(f"error: {path} does not exist (an arm's run folder holds its result.json)")
    result = json.loads(path.read_text())
    if "anomalies" not in result:
        raise SystemExit(f"error: {folder} has no anomalies; run the arm with --anomalies KIND,... --anomaly_every N")
    return result


def _losses(result: dict[str, Any]) -> dict[int, float]:
    return {int(s): float(v) for s, v in result["train_loss"]}


def _cheap(result: dict[str, Any], high_losses: dict[int, float]) -> dict[int, float]:
    """The cheap path's loss at each step both ran: the arm's training loss less static high's."""
    losses = _losses(result)
    return {s: losses[s] - high_losses[s] for s in sorted(high_losses) if s in losses}


def arm_rows(
    low: Path, high: Path, arms: dict[str, Path], kind: str = "repeat", skip: int = 12
) -> tuple[list[int], list[dict[str, Any]]]:
    """(the anomalous steps of `kind` past `skip`, one row per arm: static high, static low, then `arms` in order)."""
    from gnmr_hf.experiments.pretrain.anomalies import clean_steps

    low_r, high_r = _result(low), _result(high)
    anomalies = {int(s): k for s, k in high_r["anomalies"]["steps"]}
    high_losses = _losses(high_r)
    clean = clean_steps(sorted(high_losses), anomalies, skip)
    steps = [s for s, k in sorted(anomalies.items()) if k == kind and s > skip]
    gap = low_r["final_eval_loss"] - high_r["final_eval_loss"]
    rows = []
    for name, folder in {"static_high": high, "static_low": low, **arms}.items():
        result = high_r if folder == high else low_r if folder == low else _result(folder)
        if result["anomalies"] != high_r["anomalies"]:
            raise SystemExit(f"error: {folder} ran other anomalies than {high} (another seed or schedule?)")
        cheap = _cheap(result, high_losses)
        fraction = 1.0 if name == "static_high" else result.get("recovery_fraction", 0.0)
        stabilizer = result.get("stabilizer") or {}
        skipped = stabilizer.get("acted_steps") if stabilizer.get("skipped_steps") else None
        rows.append(
            {
                "arm": name,
                "val_loss": result["final_eval_loss"],
                "gap_closed": (low_r["final_eval_loss"] - result["final_eval_loss"]) / gap if gap else float("nan"),
                "unit_steps": fraction,
                "cheap_at": {s: cheap.get(s, float("nan")) for s in steps},
                "cheap_clean_median": statistics.median(cheap[s] for s in clean if s in cheap),
                "skipped_steps": skipped,
            }
        )
    return steps, rows


def held_units(folder: Path) -> tuple[list[str], dict[int, list[int]]]:
    """(the unit names, each step's units on the recovery path) from the arm's GNMR trace."""
    from gnmr_hf.trace import read_trace

    header, records = read_trace(folder)
    return list(header["units"]), {r["step"]: list(r.get("active", ())) for r in records if r.get("type") == "step"}


def plot(low: Path, high: Path, arms: dict[str, Path], held: str | None, out: Path) -> None:
    """Each arm's cheap-path loss (its training loss less static high's) over the steps, and the units one arm
    (`held`; None: the first arm with a trace) held, with the anomalous steps marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gnmr_hf.experiments.pretrain.anomalies import mark_anomalies
    from gnmr_hf.trace import trace_path

    if held is None:
        held = next((name for name, folder in arms.items() if trace_path(folder).is_file()), None)
    high_result = _result(high)
    high_losses = _losses(high_result)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8.0, 6.5), sharex=True, height_ratios=(1.0, 1.2))
    for name, folder in {"static_low": low, **arms}.items():
        cheap = _cheap(_result(folder), high_losses)
        top.plot(list(cheap), list(cheap.values()), linewidth=0.8, label=name)
    top.axhline(0.0, color="black", linewidth=0.6)
    top.set_ylabel("training loss less static high's")
    if held is not None:
        names, active = held_units(arms[held])
        ever = sorted({u for units in active.values() for u in units})
        row = {u: i for i, u in enumerate(ever)}
        xs = [s for s, units in active.items() for _ in units]
        ys = [row[u] for units in active.values() for u in units]
        bottom.scatter(xs, ys, marker="s", s=4, color="tab:purple", linewidths=0)
        bottom.set_yticks(range(len(ever)), [names[u].removeprefix("model.") for u in ever], fontsize=5)
        bottom.set_ylim(-0.5, max(len(ever), 1) - 0.5)
        bottom.set_ylabel(f"units {held} held")
    bottom.set_xlabel("optimizer step")
    mark_anomalies([top, bottom], high_result["anomalies"]["steps"])
    top.legend(fontsize=6, ncol=4)
    top.set_title("anomalous steps marked by kind")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def markdown(steps: list[int], rows: list[dict[str, Any]], kind: str) -> str:
    at = " / ".join(str(s) for s in steps)
    lines = [
        f"| arm | val loss | gap closed | unit-steps | cheap-path loss at {kind} steps {at} | median, clean steps |",
        "|---|---|---:|---:|---|---:|",
    ]
    for r in rows:
        name = r["arm"] + (f" (skipped {', '.join(map(str, r['skipped_steps']))})" if r["skipped_steps"] else "")
        cheap = " / ".join(f"{v:.3f}" for v in r["cheap_at"].values())
        lines.append(
            f"| {name} | {r['val_loss']:.4f} | {r['gap_closed']:.1%} | {r['unit_steps']:.2%} | {cheap} "
            f"| {r['cheap_clean_median']:.4f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--low", type=Path, required=True, help="the static low arm's run folder")
    parser.add_argument("--high", type=Path, required=True, help="the static high arm's run folder (same seed)")
    parser.add_argument("arms", nargs="*", help="NAME=RUN_FOLDER for each other arm, in the table's order")
    parser.add_argument("--kind", default="repeat", help="the anomaly kind whose steps get a column (repeat)")
    parser.add_argument("--skip", type=int, default=12, help="first steps left out of the clean median")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the arms over the steps here (matplotlib)")
    parser.add_argument("--held", default=None, help="the arm whose units on the recovery path --plot draws")
    args = parser.parse_args(argv)
    arms = {}
    for item in args.arms:
        name, sep, folder = item.partition("=")
        if not sep or not name or not folder:
            parser.error(f"arms: expected NAME=RUN_FOLDER, got {item!r}")
        arms[name] = Path(folder)
    if args.held is not None and args.plot is None:
        parser.error("--held: names the arm --plot draws; give --plot PATH too")
    if args.held is not None and args.held not in arms:
        parser.error(f"--held: {args.held!r} is not one of the arms ({', '.join(arms) or 'none given'})")
    steps, rows = arm_rows(args.low, args.high, arms, args.kind, args.skip)
    print(markdown(steps, rows, args.kind))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"steps": steps, "rows": rows}, indent=1))
    if args.plot is not None:
        plot(args.low, args.high, arms, args.held, args.plot)
    return rows


if __name__ == "__main__":
    main(sys.argv[1:])
