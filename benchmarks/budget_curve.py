"""Gap closed against unit-steps: every rule of a regime as one curve over budgets, from its runs' `result.json`.

A regime's runs are arms of the pretraining recipes, each a folder `<arm>/` with `seed<k>/result.json` under it. For
each seed, an arm closes `(low - arm) / (low - high)` of the gap between static low and static high (final validation
losses of the same seed), at the share of unit-steps it spent on the recovery path (`recovery_fraction`). A series is
one rule at several budgets (`NAME=DIR,DIR,...`, one arm folder per budget); the figure puts each at its mean
unit-steps over seeds, its mean gap closed, and a bar from the lowest seed to the highest.

    python benchmarks/budget_curve.py --low runs/smollm2_fp4_impact/static_low \\
        --high runs/smollm2_fp4_impact/static_high \\
        --series impact=runs/fp4_budget/k1/impact/gnmr_impact,runs/smollm2_fp4_impact/gnmr_impact \\
        --title "FP4 on SmolLM2-135M" --out docs/fp4_budget.png
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any


def _seeds(arm: Path) -> dict[int, dict[str, Any]]:
    runs = {}
    for path in sorted(arm.glob("seed*/result.json")):
        result = json.loads(path.read_text())
        runs[int(result["seed"])] = result
    return runs


def curve_points(low: Path, high: Path, series: dict[str, list[Path]]) -> list[dict[str, Any]]:
    """One point per (series, arm folder): the seeds it has that static low and high also have, each with its gap
    closed and unit-steps, and their means."""
    lows, highs = _seeds(low), _seeds(high)
    points = []
    for name, arms in series.items():
        for arm in arms:
            runs = _seeds(arm)
            seeds = sorted(set(runs) & set(lows) & set(highs))
            if not seeds:
                raise SystemExit(f"error: --series {name}: {arm} has no seed that --low and --high both have")
            closed = {
                s: (lows[s]["final_eval_loss"] - runs[s]["final_eval_loss"])
                / (lows[s]["final_eval_loss"] - highs[s]["final_eval_loss"])
                for s in seeds
            }
            spent = {s: runs[s].get("recovery_fraction", 0.0) for s in seeds}
            points.append(
                {
                    "series": name,
                    "arm": str(arm),
                    "seeds": seeds,
                    "gap_closed": closed,
                    "unit_steps": spent,
                    "mean_gap_closed": statistics.fmean(closed.values()),
                    "mean_unit_steps": statistics.fmean(spent.values()),
                }
            )
    return points


def table(points: list[dict[str, Any]]) -> str:
    lines = ["| rule | arm | unit-steps | gap closed per seed | mean |", "|---|---|---:|---|---:|"]
    for p in sorted(points, key=lambda p: (p["series"], p["mean_unit_steps"])):
        per_seed = " / ".join(f"{100 * p['gap_closed'][s]:.1f}%" for s in p["seeds"])
        lines.append(
            f"| {p['series']} | {p['arm']} | {100 * p['mean_unit_steps']:.2f}% | {per_seed} (seeds "
            f"{','.join(map(str, p['seeds']))}) | {100 * p['mean_gap_closed']:.1f}% |"
        )
    return "\n".join(lines)


def plot(points: list[dict[str, Any]], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for name in dict.fromkeys(p["series"] for p in points):
        mine = sorted((p for p in points if p["series"] == name), key=lambda p: p["mean_unit_steps"])
        x = [100 * p["mean_unit_steps"] for p in mine]
        y = [100 * p["mean_gap_closed"] for p in mine]
        low = [y_ - 100 * min(p["gap_closed"].values()) for y_, p in zip(y, mine, strict=True)]
        high = [100 * max(p["gap_closed"].values()) - y_ for y_, p in zip(y, mine, strict=True)]
        ax.errorbar(x, y, yerr=[low, high], marker="o", capsize=3, label=name)
    ax.axhline(0, color="grey", linewidth=0.5)
    # Linear below 1% (where a rule that spends nothing sits, at 0), logarithmic above.
    ax.set_xscale("symlog", linthresh=1.0)
    ax.set_xlim(0, 1.4 * max(100 * p["mean_unit_steps"] for p in points) + 0.1)
    ax.set_xlabel("unit-steps on the recovery path (%)")
    ax.set_ylabel("gap closed, static low -> high (%)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def _series(text: str) -> tuple[str, list[Path]]:
    name, sep, dirs = text.partition("=")
    if not sep or not name or not dirs:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR[,DIR...], got {text!r}")
    return name, [Path(d) for d in dirs.split(",")]


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--low", type=Path, required=True, help="the static_low arm folder (seed<k>/result.json)")
    parser.add_argument("--high", type=Path, required=True, help="the static_high arm folder")
    parser.add_argument("--series", type=_series, nargs="+", required=True, help="NAME=DIR[,DIR...], one per rule")
    parser.add_argument("--title", default="")
    parser.add_argument("--out", type=Path, default=None, help="the figure (.png); the table goes to stdout")
    parser.add_argument("--json", type=Path, default=None, help="also write the points as JSON here")
    cli = parser.parse_args(argv)
    for flag, arm in [("--low", cli.low), ("--high", cli.high), *(("--series", a) for _, d in cli.series for a in d)]:
        if not any(arm.glob("seed*/result.json")):
            parser.error(f"{flag}: {arm} has no seed<k>/result.json")
    points = curve_points(cli.low, cli.high, dict(cli.series))
    print(table(points))
    if cli.out is not None:
        plot(points, cli.out, cli.title)
    if cli.json is not None:
        cli.json.write_text(json.dumps(points, indent=1))
    return points


if __name__ == "__main__":
    main()
