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

Which loss (`--loss`): `final` (default), the evaluation after training, which runs the plain model (the recipe's
callback closes the units first); `in_training`, the last evaluation during training (`--eval_steps` equal to
`--max_steps`), which with block_fp's `quantize_eval=true` runs each unit on its path of the last step: the model as
trained, on its cheap paths; `train_tail`, the mean logged training loss over the second half of the steps, the loss
training descends (on the cheap paths, each batch once).
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


LOSSES = ("final", "in_training", "train_tail")


def run_loss(result: dict[str, Any], loss: str = "final") -> float:
    """The loss of one run's `result.json` that `--loss` names (see the module docstring)."""
    if loss == "final":
        return result["final_eval_loss"]
    if loss == "in_training":
        # eval_loss lists the evaluations during training, then the final one: the last before it.
        during = result.get("eval_loss", [])[:-1]
        if not during:
            raise SystemExit(f"error: --loss in_training: a run of seed {result['seed']} has no evaluation during "
                             "training (run it with --eval_steps equal to --max_steps)")  # fmt: skip
        return during[-1][1]
    half = result["max_steps"] / 2
    tail = [value for step, value in result.get("train_loss", []) if step > half]
    if not tail:
        raise SystemExit(f"error: --loss train_tail: a run of seed {result['seed']} logged no training loss after "
                         f"step {half:g}")  # fmt: skip
    return sum(tail) / len(tail)


def curve_points(low: Path, high: Path, series: dict[str, list[Path]], loss: str = "final") -> list[dict[str, Any]]:
    """One point per (series, arm folder): the seeds it has that static low and high also have, each with its gap
    closed (on `loss`, `run_loss`) and unit-steps, and their means."""
    lows, highs = _seeds(low), _seeds(high)
    points = []
    for name, arms in series.items():
        for arm in arms:
            runs = _seeds(arm)
            seeds = sorted(set(runs) & set(lows) & set(highs))
            if not seeds:
                raise SystemExit(f"error: --series {name}: {arm} has no seed that --low and --high both have")
            closed = {
                s: (run_loss(lows[s], loss) - run_loss(runs[s], loss))
                / (run_loss(lows[s], loss) - run_loss(highs[s], loss))
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
    parser.add_argument("--loss", choices=LOSSES, default="final", help="which loss the gap is read on (docstring)")
    cli = parser.parse_args(argv)
    for flag, arm in [("--low", cli.low), ("--high", cli.high), *(("--series", a) for _, d in cli.series for a in d)]:
        if not any(arm.glob("seed*/result.json")):
            parser.error(f"{flag}: {arm} has no seed<k>/result.json")
    points = curve_points(cli.low, cli.high, dict(cli.series), cli.loss)
    print(table(points))
    if cli.out is not None:
        plot(points, cli.out, cli.title)
    if cli.json is not None:
        cli.json.write_text(json.dumps(points, indent=1))
    return points


if __name__ == "__main__":
    main()
