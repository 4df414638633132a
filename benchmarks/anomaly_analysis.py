"""What breaks on the anomalous steps of a run, where, and for how long (issue "Brief, local failures").

Reads one arm's run folder written with `--anomalies ... --logging_steps 1` (its `result.json`, GNMR trace and, where
probed, `oracle.jsonl`) and compares every anomalous step with the run's clean steps:

- the loss: the step's training loss against the median of the 3 clean steps before it (a spike), and with
  `--high RUN` (the static_high arm of the same seed, on the same anomalies) the cheap path's share of that step's
  loss (low minus high) against the same share on clean steps;
- each unit's impact measure (the run must measure every unit every step: `--impact_options every=1`; the measure
  is recovered from the traced running estimate) and GNMR's
  risk (`--trace_top_k` at least the number of units), each against the unit's own median over clean steps;
- a unit **breaks** at an anomalous step when its impact is at least `--ratio` times its clean median and among the
  step's 5 largest; it **stays broken** at a later step while its impact remains at least half that ratio;
- the oracle's recovery gaps (`--oracle_every`) at anomalous probes against clean ones.

Clean steps are those past GNMR's warm-up (`--skip` first steps), not anomalous and not within 4 steps after an
anomaly. Run it on the monitor-only diagnostic arm of docs/lab/anomalies.md:

    python benchmarks/anomaly_analysis.py runs/anomalies/fp4/diag/gnmr_impact/seed0 \\
        --high runs/anomalies/fp4/high/static_high/seed0 --out runs/anomalies/fp4/diag_s0.json \\
        --plot runs/anomalies/fp4/diag_s0.png
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports():
    import numpy as np

    from gnmr_hf.experiments.oracle import read_oracle
    from gnmr_hf.experiments.pretrain.anomalies import AFTERMATH_STEPS, clean_steps, mark_anomalies
    from gnmr_hf.policies.impact import ImpactOptions
    from gnmr_hf.trace import read_trace


def _step_losses(result: dict[str, Any], where: Path) -> dict[int, float]:
    losses = {int(s): float(v) for s, v in result["train_loss"]}
    if len(losses) < result["max_steps"] * 0.9:
        raise SystemExit(
            f"error: {where} logged {len(losses)} losses for {result['max_steps']} steps; run with --logging_steps 1"
        )
    return losses


def _per_unit(records: list[dict[str, Any]], n: int, field: str, smoothing: float = 1.0) -> dict[int, np.ndarray]:
    """step -> [n] values (NaN where not given): each step's impact measures, or GNMR's risks.

    The trace holds the impact policy's running estimate of each unit measured at the step (`e = (1 - s) e_before + s
    m` for a measure `m`, `s` = `smoothing`; the first measure, or one after a non-finite estimate, sets it). The
    measure itself is recovered from it, so that a one-step rise reads as one step, not as the estimate's decay."""
    out = {}
    before = np.full(n, np.nan)
    for r in records:
        if r.get("type") != "step":
            continue
        values = np.full(n, np.nan)
        pairs = r.get("impact", {}).get("estimate", []) if field == "impact" else r.get("top", [])
        for i, v in pairs:
            value = math.inf if v == "inf" else float(v)
            if field == "impact":
                if math.isfinite(before[i]) and math.isfinite(value) and value < 1e299:
                    before[i], value = value, (value - (1.0 - smoothing) * before[i]) / smoothing
                else:
                    before[i] = value
            values[i] = value
        out[r["step"]] = values
    return out


def analyse(run: Path, high: Path | None = None, ratio: float = 4.0, skip: int = 12) -> dict[str, Any]:
    result = json.loads((run / "result.json").read_text())
    if "anomalies" not in result:
        raise SystemExit(f"error: {run} has no anomalies; run the arm with --anomalies KIND,... --anomaly_every N")
    anomalies = {int(s): k for s, k in result["anomalies"]["steps"]}
    losses = _step_losses(result, run)
    header, records = read_trace(run)
    names: list[str] = header["units"]
    n = len(names)
    options = header.get("config", {}).get("policy_options") or {}
    smoothing = float(options.get("smoothing", ImpactOptions().smoothing))
    impact = _per_unit(records, n, "impact", smoothing)
    risk = _per_unit(records, n, "risk")
    quiet = set(clean_steps(sorted(losses), anomalies, 0))  # every step neither anomalous nor just after one
    clean = [s for s in sorted(quiet) if s > skip and s in impact]
    if not clean:
        raise SystemExit(f"error: {run} has no clean steps past step {skip}")

    def median_over(values: dict[int, np.ndarray], steps: list[int]) -> np.ndarray:
        stack = np.stack([values[s] for s in steps if s in values])
        return np.nanmedian(stack, axis=0) if np.isfinite(stack).any() else np.full(n, np.nan)

    impact_clean = median_over(impact, clean)
    risk_clean = median_over(risk, clean)
    total_clean = float(np.median([np.nansum(impact[s]) for s in clean]))
    high_losses = _step_losses(json.loads((high / "result.json").read_text()), high) if high else None
    cheap_clean = (
        float(np.median([losses[s] - high_losses[s] for s in clean if s in high_losses])) if high_losses else None
    )

    by_step = {int(r["step"]): r for r in records if r.get("type") == "step"}
    high_steps: dict[int, dict[str, Any]] = {}
    if high is not None and any(high.glob("*trace*.jsonl")):
        _, high_records = read_trace(high)
        high_steps = {int(r["step"]): r for r in high_records if r.get("type") == "step"}

    def max_risk(record: dict[str, Any] | None) -> float | None:
        value = None if record is None else record.get("max_risk")
        return math.inf if value == "inf" else value

    # GNMR's spikes (a unit above its bound: risk > 1) past the warm-up, anomalous or not, each against static high's
    # largest risk on the same step: a spike in both runs is the batch's own, one in the cheap path's run alone is
    # the cheap path's.
    spikes = []
    for s, record in sorted(by_step.items()):
        if s <= skip or not record.get("risky"):
            continue
        spikes.append({
            "step": s,
            "anomaly": anomalies.get(s),
            "max_risk": max_risk(record),
            "high_max_risk": max_risk(high_steps.get(s)),
            "risky": [names[i] for i in record["risky"]],
        })  # fmt: skip

    steps = []
    for s, kind in sorted(anomalies.items()):
        if s not in losses or s <= skip:
            continue
        before = [t for t in range(s - 1, 0, -1) if t in quiet][:3]
        row: dict[str, Any] = {
            "step": s,
            "kind": kind,
            "loss": losses[s],
            "loss_spike": losses[s] - statistics.median(losses[t] for t in before) if before else None,
        }
        if high_losses and s in high_losses:
            row["cheap_path_loss"] = losses[s] - high_losses[s]
        if s in impact:
            now = impact[s]
            with np.errstate(divide="ignore", invalid="ignore"):
                rise = now / impact_clean
            row["impact_total"] = float(np.nansum(now))
            row["impact_total_ratio"] = row["impact_total"] / total_clean if total_clean > 0 else None
            top = np.argsort(-np.nan_to_num(now, nan=-1.0))[:5]
            row["top_impact"] = [[names[i], float(now[i]), float(rise[i])] for i in top]
            broken = [int(i) for i in top if rise[i] >= ratio]
            row["broken"] = [names[i] for i in broken]
            # How long each broken unit stays at half the ratio or more, over the clean-looking steps after it.
            row["broken_for"] = {
                names[i]: 1
                + next(
                    (
                        d - 1
                        for d in range(1, AFTERMATH_STEPS + 1)
                        if not (s + d in impact and impact[s + d][i] / impact_clean[i] >= ratio / 2)
                    ),
                    AFTERMATH_STEPS,
                )
                for i in broken
            }
        row["max_risk"] = max_risk(by_step.get(s))
        if high_steps:
            row["high_max_risk"] = max_risk(high_steps.get(s))
        if s in risk and np.isfinite(risk[s]).any():
            with np.errstate(divide="ignore", invalid="ignore"):
                rrise = risk[s] / risk_clean
            order = np.argsort(-np.nan_to_num(rrise, nan=-1.0))[:3]
            row["top_risk_rise"] = [[names[i], float(risk[s][i]), float(rrise[i])] for i in order]
        steps.append(row)

    kinds: dict[str, Any] = {}
    for kind in dict.fromkeys(anomalies.values()):
        rows = [r for r in steps if r["kind"] == kind]
        if not rows:
            continue
        counts = Counter(u for r in rows for u in r.get("broken", []))
        kinds[kind] = {
            "occurrences": len(rows),
            "mean_loss_spike": statistics.fmean(r["loss_spike"] for r in rows if r["loss_spike"] is not None),
            "mean_impact_total_ratio": statistics.fmean(
                r["impact_total_ratio"] for r in rows if r.get("impact_total_ratio") is not None
            ),
            "steps_with_a_break": sum(1 for r in rows if r.get("broken")),
            "units_broken": dict(counts.most_common()),
            "recurring": [u for u, c in counts.items() if c >= max(2, len(rows) / 2)],
            "longest_break": max((v for r in rows for v in r.get("broken_for", {}).values()), default=0),
        }
        kinds[kind]["gnmr_spikes"] = sum(1 for r in rows if (r["max_risk"] or 0) > 1)
        if high_steps:
            kinds[kind]["high_spikes"] = sum(1 for r in rows if (r.get("high_max_risk") or 0) > 1)
        if cheap_clean is not None:
            kinds[kind]["mean_cheap_path_loss"] = statistics.fmean(
                r["cheap_path_loss"] for r in rows if "cheap_path_loss" in r
            )

    # Per step, for the figure: the losses, the summed impact, the units on (or, monitor-only, chosen for) the
    # recovery path, and GNMR's largest norm-to-mean ratio.
    logged = sorted(losses)
    series = {
        "step": logged,
        "loss": [losses[s] for s in logged],
        "high_loss": [high_losses.get(s) for s in logged] if high_losses else None,
        "impact_total": [float(np.nansum(impact[s])) if s in impact else None for s in logged],
        "active": [len(by_step[s]["active"]) if s in by_step else None for s in logged],
        "max_risk": [by_step[s].get("max_risk") if s in by_step else None for s in logged],
    }

    report: dict[str, Any] = {
        "run": str(run),
        "arm": result["arm"],
        "seed": result["seed"],
        "backend": result.get("backend"),
        "backend_options": result.get("backend_options"),
        "clean_steps": len(clean),
        "clean_loss_median": statistics.median(losses[s] for s in clean),
        "clean_impact_total": total_clean,
        "clean_cheap_path_loss": cheap_clean,
        "clean_top_impact": [
            [names[i], float(impact_clean[i])] for i in np.argsort(-np.nan_to_num(impact_clean, nan=-1.0))[:5]
        ],
        "ratio": ratio,
        "skip": skip,
        "kinds": kinds,
        "steps": steps,
        "spikes": spikes,
        "anomalies": [[s, k] for s, k in sorted(anomalies.items())],
        "series": series,
    }
    oracle = run / "oracle.jsonl"
    if oracle.is_file():
        _, probes = read_oracle(oracle)
        gaps = {p["step"]: np.asarray(p["gaps"], dtype=float) for p in probes}
        clean_gaps = [gaps[s] for s in gaps if s in clean]
        anomalous = {s: g for s, g in gaps.items() if s in anomalies and s > skip}
        if clean_gaps and anomalous:
            base = np.nanmedian(np.stack(clean_gaps), axis=0)
            by_kind: dict[str, list[float]] = defaultdict(list)
            tops = {}
            for s, g in anomalous.items():
                by_kind[anomalies[s]].append(float(np.nansum(g) / np.nansum(base)))
                rise = g / base
                i = int(np.nanargmax(rise))
                tops[s] = [names[i], float(rise[i])]
            report["oracle"] = {
                "clean_probes": len(clean_gaps),
                "gap_total_ratio_by_kind": {k: statistics.fmean(v) for k, v in by_kind.items()},
                "largest_rise_by_step": tops,
            }
    return report


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        f"{report['arm']} seed {report['seed']} ({report['backend']} {report['backend_options']}): "
        f"{report['clean_steps']} clean steps, clean loss {report['clean_loss_median']:.3f}, "
        f"clean impact total {report['clean_impact_total']:.4g}"
        + (
            f", clean cheap-path loss {report['clean_cheap_path_loss']:+.4f}"
            if report["clean_cheap_path_loss"] is not None
            else ""
        ),
        "",
        "| kind | steps | loss spike | impact total / clean | cheap-path loss | steps with a unit broken "
        f"(>= {report['ratio']:g}x) | units broken (times) | longest break (steps) | GNMR spikes (static high's) |",
        "|---|---:|---:|---:|---:|---:|---|---:|---|",
    ]
    for kind, k in report["kinds"].items():
        cheap = f"{k['mean_cheap_path_loss']:+.4f}" if "mean_cheap_path_loss" in k else "-"
        units = ", ".join(f"{u} ({c})" for u, c in list(k["units_broken"].items())[:4]) or "none"
        lines.append(
            f"| {kind} | {k['occurrences']} | {k['mean_loss_spike']:+.3f} | {k['mean_impact_total_ratio']:.2f} "
            f"| {cheap} | {k['steps_with_a_break']} | {units} | {k['longest_break']} | {k['gnmr_spikes']}"
            + (f" ({k['high_spikes']})" if "high_spikes" in k else "")
            + " |"
        )
    clean_spikes = [x for x in report["spikes"] if x["anomaly"] is None]
    lines += [
        "",
        f"GNMR spikes (a unit's risk > 1) past step {report['skip']}: {len(report['spikes'])} steps, "
        f"{len(clean_spikes)} of them not anomalous"
        + (": " + ", ".join(f"step {x['step']} ({len(x['risky'])} units)" for x in clean_spikes[:8]) if clean_spikes
           else ""),
    ]  # fmt: skip
    if "oracle" in report:
        o = report["oracle"]
        lines += [
            "",
            "oracle gap total, anomalous probe / clean median: "
            + ", ".join(f"{k} {v:.2f}" for k, v in o["gap_total_ratio_by_kind"].items()),
        ]
    return "\n".join(lines)


def plot(report: dict[str, Any], out: Path) -> None:
    """The loss (the run's and, with --high, static high's), the summed impact and GNMR's largest ratio over the steps,
    and the units on the recovery path, with each anomalous step marked by its kind."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series = report["series"]
    steps = series["step"]
    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(7.5, 7.0), sharex=True)
    top.plot(steps, series["loss"], linewidth=0.9, label=f"{report['arm']} (cheap path)")
    if series["high_loss"]:
        top.plot(steps, series["high_loss"], linewidth=0.9, label="static high")
    top.set_ylabel("training loss (nats/token)")
    impact = [np.nan if v is None else v for v in series["impact_total"]]
    middle.semilogy(steps, impact, linewidth=0.9, color="tab:green", label="summed impact (nats/token)")
    risk = [np.nan if v in (None, "inf") else v for v in series["max_risk"]]
    middle.semilogy(steps, risk, linewidth=0.9, color="tab:red", label="GNMR's largest ratio")
    middle.set_ylabel("per step")
    bottom.step(steps, [np.nan if v is None else v for v in series["active"]], where="mid", color="tab:purple")
    bottom.set_ylabel("units in recovery")
    bottom.set_ylim(bottom=0)
    bottom.set_xlabel("optimizer step")
    mark_anomalies([top, middle, bottom], report["anomalies"])
    top.legend(fontsize=7, ncol=3)
    middle.legend(fontsize=7)
    top.set_title(f"{report['arm']}, seed {report['seed']}: anomalous steps marked")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run", type=Path, help="an arm's run folder (result.json, trace, oracle.jsonl)")
    parser.add_argument("--high", type=Path, default=None, help="the static_high run folder of the same seed")
    parser.add_argument("--ratio", type=float, default=4.0, help="impact / clean median at which a unit breaks")
    parser.add_argument("--skip", type=int, default=12, help="first steps left out (GNMR's warm-up)")
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    parser.add_argument("--plot", type=Path, default=None, help="draw the steps' figure here (needs matplotlib)")
    cli = parser.parse_args(argv)
    for flag, path in (("run", cli.run), ("--high", cli.high)):
        if path is not None and not (path / "result.json").is_file():
            parser.error(f"{flag}: {path} has no result.json")
    if cli.ratio <= 1:
        parser.error(f"--ratio must be > 1, got {cli.ratio}")
    report = analyse(cli.run, cli.high, cli.ratio, cli.skip)
    print(_markdown(report))
    if cli.out is not None:
        cli.out.parent.mkdir(parents=True, exist_ok=True)
        cli.out.write_text(json.dumps(report, indent=1))
    if cli.plot is not None:
        plot(report, cli.plot)
    return report


if __name__ == "__main__":
    main()
