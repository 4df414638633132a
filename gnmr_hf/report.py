"""`gnmr-hf report TRACE`: the summary of a decision trace, and its plots.

Two PNG files next to the trace (or in `--out`), named after it (`plot_names`: `gnmr_trace.jsonl` gives the two below,
the earlier run's `gnmr_trace.1.jsonl` gives `gnmr_recovery.1.png` and `gnmr_scores.1.png`, so that reporting on one
trace never overwrites another's plots):
- `gnmr_recovery.png`: a units x steps heatmap, dark where a unit ran in recovery, with risky steps marked;
- `gnmr_scores.png`: the risk timelines of the units that spent longest in recovery (when none did, of the units
  with the highest risk, and the plot says that nothing was risky), against the threshold 1 (risk is
  max(GNMR/alpha, DGNMR/beta), so 1 is the risky line for both scores).

matplotlib is imported only here, and only when plots are asked for (`pip install gnmr-hf[plot]`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

from .trace import TraceSummary, iter_scores, trace_path

__all__ = ["plot_names", "plot_trace", "report"]


def plot_names(trace: str | os.PathLike[str]) -> tuple[str, str]:
    """The file names of `trace`'s two plots: its name with `trace` replaced by `recovery` and `scores`
    (`gnmr_trace.1.jsonl`: `gnmr_recovery.1.png`), or with `_recovery` and `_scores` added where it has no `trace`."""
    stem = Path(trace).stem
    if "trace" in stem:
        return stem.replace("trace", "recovery", 1) + ".png", stem.replace("trace", "scores", 1) + ".png"
    return f"{stem}_recovery.png", f"{stem}_scores.png"


def _pyplot() -> Any:
    try:
        import matplotlib
    except ImportError as err:
        raise ImportError("gnmr-hf report: plots need matplotlib; `pip install gnmr-hf[plot]`") from err
    matplotlib.use("Agg")  # files only: never open a window, works headless and on CI
    import matplotlib.pyplot as plt

    return plt


def plot_trace(
    header: dict[str, Any],
    steps: list[dict[str, Any]],
    summary: TraceSummary,
    out_dir: str | os.PathLike[str],
    top_k: int = 8,
    files: tuple[str, str] = ("gnmr_recovery.png", "gnmr_scores.png"),
) -> list[Path]:
    """Write the heatmap and the score timelines as `files` in `out_dir`; return their paths."""
    plt = _pyplot()
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = list(header["units"])
    step_ids = [r["step"] for r in steps]
    grid = np.zeros((len(names), max(len(steps), 1)))
    risky_x, risky_y = [], []
    for col, record in enumerate(steps):
        grid[record["active"], col] = 1.0
        risky_x += [col] * len(record["risky"])
        risky_y += record["risky"]

    fig, ax = plt.subplots(figsize=(10, max(3.0, 0.18 * len(names) + 1.5)))
    extent = (step_ids[0] - 0.5, step_ids[-1] + 0.5, len(names) - 0.5, -0.5) if steps else None
    ax.imshow(grid, aspect="auto", cmap="Greys", vmin=0, vmax=1, interpolation="nearest", extent=extent)
    from matplotlib.patches import Patch

    handles: list[Any] = [Patch(facecolor="black", label="in recovery (high-fidelity path)")]
    if risky_x:
        handles.append(
            ax.scatter([step_ids[c] for c in risky_x], risky_y, marker="x", s=12, c="tab:red", label="risky")
        )
    ax.legend(handles=handles, loc="upper right", fontsize=7)
    ax.set_yticks(range(len(names)))
    ax.set_yticklabels(names, fontsize=6)
    ax.set_ylabel("unit")
    ax.set_xlabel("optimizer step (decision made at this step, applied from the next)")
    ax.set_title(
        f"GNMR recovery: {summary.recovery_fraction:.2%} of unit-steps, max_active={header['config']['max_active']}"
    )
    fig.tight_layout()
    heatmap = out_dir / files[0]
    fig.savefig(heatmap, dpi=120)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(10, 4))
    top = [n for n, _, _ in summary.top_units(top_k)]
    title = "Risk of the units longest in recovery (points where they were among the top scores)"
    if not top:
        # Nothing was risky: show the units that came closest, so that the plot shows how far below 1 they stayed.
        peak: dict[int, float] = {}
        for record in steps:
            for i, risk in record.get("top", ()):
                peak[i] = max(peak.get(i, 0.0), float(risk))
        top = [names[i] for i in sorted(peak, key=lambda i: (-peak[i], i))[:top_k]]
        title = "No unit was risky (risk never above 1): the highest risks, for scale"
    for name in top:
        points = list(iter_scores(steps, names.index(name)))
        if points:
            xs, ys = zip(*points, strict=False)
            ax.plot(xs, [min(y, 1e6) for y in ys], marker=".", label=name)
    if not ax.get_lines():
        title = f"No unit has a score yet (warm-up: {header['config'].get('min_history', '?')} past norms needed)"
    ax.axhline(1.0, color="k", linestyle="--", linewidth=1, label="risky above 1")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(bottom=0.0)
    # symlog's default ticks are 0, 1, 10^k only; ticks every 0.25 below the threshold say how close a unit came.
    top_value = max([1.0, *(v for line in ax.get_lines() for v in line.get_ydata())])
    decades = [10.0**k for k in range(1, int(np.ceil(np.log10(top_value))) + 1)]
    ax.set_yticks([0.0, 0.25, 0.5, 0.75, 1.0, *decades])
    ax.set_yticklabels(["0", "0.25", "0.5", "0.75", "1", *(f"{d:g}" for d in decades)])
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("risk = max(GNMR/alpha, DGNMR/beta)")
    ax.set_title(title)
    if top:
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    scores = out_dir / files[1]
    fig.savefig(scores, dpi=120)
    plt.close(fig)
    return [heatmap, scores]


def report(
    trace: str | os.PathLike[str],
    out_dir: str | os.PathLike[str] | None = None,
    *,
    plots: bool = True,
    top_k: int = 8,
) -> tuple[TraceSummary, list[Path]]:
    """Summarize a trace, or a run folder's (and plot it unless `plots=False`, beside it unless `out_dir` is given);
    returns the summary and the plot paths."""
    trace = trace_path(trace)
    summary, header, steps = TraceSummary.from_trace(trace)
    paths: list[Path] = []
    if plots:
        out = out_dir if out_dir is not None else trace.parent
        paths = plot_trace(header, steps, summary, out, top_k, plot_names(trace))
    return summary, paths
