"""The comparison table: one row per arm over its seeds, read from the `result.json` files the arms wrote.

Arms often end within a thousandth of each other, so the table says what a difference is worth: the share of the
static low -> static high gap an arm closes is computed per seed, and the note under the table puts that gap against
the seed-to-seed noise (a gap within the noise makes any share meaningless, and the table says so).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..stabilizers import describe
from .arms import ARMS

__all__ = ["load_results", "results_table"]


def load_results(root: str | Path) -> list[dict[str, Any]]:
    """Every `result.json` under `root`, sorted by arm order then seed."""
    results = [json.loads(p.read_text()) for p in sorted(Path(root).rglob("result.json"))]
    order = {a: i for i, a in enumerate(ARMS)}
    return sorted(results, key=lambda r: (order.get(r["arm"], len(order)), r["seed"]))


def _mean_spread(values: Sequence[float]) -> str:
    if not values:
        return "-"
    mean = statistics.fmean(values)
    if len(values) == 1:
        return f"{mean:.4f}"
    return f"{mean:.4f} ± {(max(values) - min(values)) / 2:.4f}"


def results_table(results: Sequence[dict[str, Any]]) -> str:
    """A markdown table, one row per arm, over its seeds: mean ± half-range of the final validation loss,
    perplexity (per byte), the share of the static low -> static high loss gap closed (per seed, then averaged;
    needs both static arms with the same seed), unit-steps recovered, exceedance rate, seconds per step and MB
    saved for backward per step; with stabilizer arms, what each did (summed over its seeds)."""
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for r in results:
        by_arm.setdefault(r["arm"], []).append(r)
    low = {r["seed"]: r["final_eval_loss"] for r in by_arm.get("static_low", [])}
    high = {r["seed"]: r["final_eval_loss"] for r in by_arm.get("static_high", [])}
    header = ["arm", "seeds", "val loss", "val ppl", "gap closed", "unit-steps recovered", "exceedance", "s/step"]
    stabilized = any("stabilizer" in r for r in results)
    saved_note = _same_saved_bytes(results)
    header += [*([] if saved_note else ["saved MB/step"]), *(["stabilizer did"] if stabilized else [])]
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    note, in_noise = _gap_note(low, high, _loss_unit(results))
    note = "\n".join(n for n in (note, saved_note) if n)
    for arm, runs in by_arm.items():
        losses = [r["final_eval_loss"] for r in runs]
        closed = [
            (low[r["seed"]] - r["final_eval_loss"]) / (low[r["seed"]] - high[r["seed"]])
            for r in runs
            if r["seed"] in low and r["seed"] in high and low[r["seed"]] != high[r["seed"]]
        ]
        recovered = [r["recovery_fraction"] for r in runs if "recovery_fraction" in r]
        exceed = [r["exceedance_rate"] for r in runs if "exceedance_rate" in r]
        lines.append(
            "| "
            + " | ".join(
                [
                    arm,
                    ",".join(str(r["seed"]) for r in runs),
                    _mean_spread(losses),
                    f"{statistics.fmean(r['final_eval_ppl'] for r in runs):.3f}",
                    (_whole_percent(statistics.fmean(closed)) + (" (gap within noise)" if in_noise else ""))
                    if closed
                    else "-",
                    f"{statistics.fmean(recovered):.2%}" if recovered else "-",
                    f"{statistics.fmean(exceed):.3%}" if exceed else "-",
                    f"{statistics.fmean(r['sec_per_step'] for r in runs):.3f}",
                    *(
                        []
                        if saved_note
                        else [f"{statistics.fmean(r['saved_bytes_per_step'] for r in runs) / 2**20:.1f}"]
                    ),
                    *([_stabilizer_cell(runs)] if stabilized else []),
                ]
            )
            + " |"
        )
    return "\n".join(lines + ([f"\n{note}"] if note else []))


def _whole_percent(share: float) -> str:
    """`share` as a whole percentage; one that rounds to zero is 0%, not -0%."""
    text = f"{share:.0%}"
    return "0%" if text == "-0%" else text


def _same_saved_bytes(results: Sequence[dict[str, Any]]) -> str:
    """The line that replaces the saved MB/step column when the backend cannot change it, else "".

    block_fp's GEMMs save x and W themselves, in fp32, and round them again in the backward (`BlockFPLinear`), so
    what autograd keeps for backward is the same in every arm, whatever the formats: a column would repeat one
    number (act_quant, which stores saved activations at the path's bits, is where the column says something)."""
    if {r.get("backend") for r in results} - {None} != {"block_fp"}:
        return ""
    mb = sorted(r["saved_bytes_per_step"] / 2**20 for r in results)
    low, high = f"{mb[0]:.1f}", f"{mb[-1]:.1f}"
    amount = f"{low} MB/step in every arm" if low == high else f"{low} to {high} MB/step"
    return (
        f"Saved for backward: {amount} (block_fp keeps each GEMM's inputs in fp32 and rounds them again in the "
        "backward, so its formats do not change what autograd keeps)."
    )


def _stabilizer_cell(runs: Sequence[dict[str, Any]]) -> str:
    records = [r["stabilizer"] for r in runs if "stabilizer" in r]
    if not records:
        return "-"
    total = {k: sum(r[k] for r in records) for k, v in records[0].items() if isinstance(v, int) and k in records[-1]}
    options = records[0]["options"]
    return describe(total) + (f" ({','.join(f'{k}={v}' for k, v in options.items())})" if options else "")


def _loss_unit(results: Sequence[dict[str, Any]]) -> str:
    """What the losses are per: a byte for models built here, a token of its tokenizer for a real model."""
    real = any(r.get("model", {}).get("model", "scratch") != "scratch" for r in results)
    return "nats/token" if real else "nats/byte"


def _gap_note(low: dict[int, float], high: dict[int, float], unit: str = "nats/byte") -> tuple[str, bool]:
    """What the static low -> high gap is against seed-to-seed noise, and whether it is within that noise.

    "gap closed" divides by the gap, so a gap no larger than the spread between seeds gives any share (116%, -5%)
    by chance. The noise is the larger half-range across seeds of the two static arms' final losses; with one seed
    it is unmeasured, and the table says so instead of implying a precision it does not have."""
    seeds = sorted(set(low) & set(high))
    if not seeds:
        return "", False
    gaps = [low[s] - high[s] for s in seeds]
    gap = statistics.fmean(gaps)
    text = f"Static low -> high gap: {gap:.4f} {unit} (seeds {','.join(map(str, seeds))})"
    if len(seeds) < 2:
        return text + "; with one seed its noise is unmeasured: read 'gap closed' as indicative only.", False
    noise = max((max(d[s] for s in seeds) - min(d[s] for s in seeds)) / 2 for d in (low, high))
    if abs(gap) <= noise:
        return text + f", within the seed-to-seed half-range {noise:.4f}: 'gap closed' is noise here.", True
    return text + f", {abs(gap) / noise:.1f}x the seed-to-seed half-range {noise:.4f}." if noise else text + ".", False
