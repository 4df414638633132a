"""The loss-curve plot: validation and smoothed training loss per arm, and each arm minus the high-precision arm.

matplotlib is imported when a plot is drawn (the `plot` extra), not when the harness is.
"""

from __future__ import annotations

import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .table import _loss_unit

__all__ = ["plot_loss_curves"]

# Line styles for the arms, so that arms a hair apart stay distinguishable where colours alone would overlap.
_LINESTYLES = ("-", "--", "-.", ":")
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")


def plot_loss_curves(results: Sequence[dict[str, Any]], path: str | Path, title: str = "") -> Path:
    """Validation loss (left) and smoothed training loss (right) against the step, one line per arm (mean over
    its seeds), written as a PNG. Below each, every arm minus static_high (or the reference): arms often end within
    a thousandth of each other, which the loss axis cannot show. Each arm has its own colour, dash and marker;
    arms whose curves are identical (no unit ever recovered, say) share one line and one label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_arm: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    base = next((arm for arm in ("static_high", "reference") if arm in by_arm), None)
    rows = 2 if base is not None and len(by_arm) > 1 else 1
    fig, axes = plt.subplots(rows, 2, figsize=(12, 4.5 * rows), sharex="col", squeeze=False)
    for col, key in enumerate(("eval_loss", "train_loss")):
        curves = {arm: _mean_curve(runs, key) for arm, runs in by_arm.items()}
        same: dict[tuple[tuple[int, ...], tuple[float, ...]], list[str]] = {}
        for arm, curve in curves.items():
            same.setdefault(curve, []).append(arm)
        for i, arm in enumerate(by_arm):
            steps, values = curves[arm]
            group = same[curves[arm]]
            if arm != group[0] or not steps:
                continue
            runs = by_arm[arm]
            seeds = f"seed {runs[0]['seed']}" if len(runs) == 1 else f"mean of {len(runs)} seeds"
            label = " = ".join(group) + f" ({seeds}" + (", identical)" if len(group) > 1 else ")")
            label = "\n".join(textwrap.wrap(label, 48, subsequent_indent="  "))  # a narrow legend hides less
            style = dict(
                color=f"C{i % 10}",
                linestyle=_LINESTYLES[i % len(_LINESTYLES)],
                marker=_MARKERS[i % len(_MARKERS)],
                markevery=max(1, len(steps) // 12),
                markersize=5,
                label=label,
            )
            axes[0][col].plot(steps, values, **style)
            if rows == 2:
                ref = dict(zip(*curves[base], strict=True))
                common = [(s, v - ref[s]) for s, v in zip(steps, values, strict=True) if s in ref]
                axes[1][col].plot([s for s, _ in common], [d for _, d in common], **style)
    unit = _loss_unit(results)
    axes[0][0].set(ylabel=f"validation loss ({unit})", title="validation")
    axes[0][1].set(ylabel="training loss (EMA 0.8)", title="training")
    if rows == 2:
        axes[1][0].set(ylabel=f"validation loss minus {base}'s ({unit})")
        axes[1][1].set(ylabel=f"training loss (EMA 0.8) minus {base}'s")
        for ax in axes[1]:
            ax.axhline(0.0, color="black", linewidth=0.6)
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    for ax in axes[-1]:
        ax.set(xlabel="optimizer step")
    for ax in axes[0]:
        if ax.get_legend_handles_labels()[0]:  # a run too short to log a training loss has none
            ax.legend(fontsize=7, loc="upper right")  # loss curves fall: their top right is free
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _mean_curve(runs: Sequence[dict[str, Any]], key: str) -> tuple[tuple[int, ...], tuple[float, ...]]:
    """(steps, values) of `key` (eval_loss, train_loss) averaged over `runs` at the steps they all logged; the
    training loss smoothed by an EMA of 0.8."""
    curves = [dict(map(tuple, r[key])) for r in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    mean = [statistics.fmean(c[s] for c in curves) for s in steps]
    if key == "train_loss" and mean:
        smooth, value = [], mean[0]
        for v in mean:
            value = 0.8 * value + 0.2 * v
            smooth.append(value)
        mean = smooth
    return tuple(steps), tuple(mean)


def _describe(results: Sequence[dict[str, Any]]) -> str:
    """A plot title from what the runs share: backend and options, model, steps, learning rate, seeds."""
    first = results[0]
    backend = next((r["backend"] for r in results if r.get("backend")), None)
    options = next((r["backend_options"] for r in results if r.get("backend")), None) or {}
    model = first["model"]
    parts = [
        f"{backend} {','.join(f'{k}={v}' for k, v in options.items())}".strip() if backend else "reference only",
        f"LLaMA d={model['d_model']} x{model['n_layers']} layers",
        f"{first['max_steps']} steps, lr {first['learning_rate']:g}",
        f"seeds {','.join(str(s) for s in sorted({r['seed'] for r in results}))}",
    ]
    return "; ".join(parts)
