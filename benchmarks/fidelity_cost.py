"""What measuring fidelity (`policy="cause"`) costs per training step on the probe model, on a CPU.

    OMP_NUM_THREADS=1 python benchmarks/fidelity_cost.py --rounds 5 --steps 4 --out runs/fidelity_cost.json

The probe-scale LLaMA of the pretraining recipes (d=128, 4 layers, batch 16 x 128 bytes), one forward + backward per
step, in the two stress regimes' unit sets: act_quant 4/8-bit with the 28 projections and 4 attention units, and
block_fp e2m1/e4m3 with the 28 projections and the output head. Per regime, modes interleaved in rounds so that
drift on a shared machine hits them alike: every unit on the cheap path, or `max_active` = 4 units in recovery
(these measure the cheap path's rounding a second time: the policy's steady state in the stress regimes), each with
the units not measuring (what the paper's policy runs) or measuring every row or `--rows` rows of each tensor
(`GNMRConfig.cause_fidelity_rows`, default 256). Reported: CPU time of this process per step (median
over rounds x steps), and what measuring adds to the same recovery set; plus the per-step gathering of the [N]
vector (`UnitSignals.compute`, with and without fidelity).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

import torch

from gnmr_hf import find_units
from gnmr_hf.experiments.pretrain import build_model, llama_config
from gnmr_hf.signals import UnitSignals

REGIMES = {
    "act_quant attention + linear, 4/8-bit": (
        "act_quant",
        {"kinds": ["linear", "attention"], "low_bits": 4, "high_bits": 8},
        [r"\.(q|k|v|o|gate|up|down)_proj$", r"\.self_attn$"],
        [r"\.self_attn$"],
    ),
    "block_fp e2m1/e4m3, lm_head a unit": (
        "block_fp",
        {"low_format": "e2m1", "high_format": "e4m3", "quantize_lm_head": True},
        [r"\.(q|k|v|o|gate|up|down)_proj$", "^lm_head$"],
        ["^lm_head$", r"layers\.[012]\.self_attn\.q_proj$"],
    ),
}


def build_modes(rows: list[int]) -> dict[str, tuple[int | None, bool]]:
    """{mode: (rows each measure reads, None = not measuring; 4 units in recovery)}, the not-measuring mode of each
    recovery set first (the others are compared with it)."""
    out: dict[str, tuple[int | None, bool]] = {}
    for recovering, label in ((False, "all cheap"), (True, "4 in recovery")):
        out[f"{label}, not measuring"] = (None, recovering)
        for n in rows:
            out[f"{label}, measuring {'every row' if n == 0 else f'{n} rows'}"] = (n, recovering)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=[0, 256], help="fidelity_rows to compare (0: every row)"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    mode_table = build_modes(args.rows)
    ids = torch.randint(0, 256, (16, 128), generator=torch.Generator().manual_seed(0))
    results = {}
    for regime, (backend, options, include, recovered) in REGIMES.items():
        model = build_model(llama_config(d_model=128, n_layers=4, n_heads=4, seq_len=128), seed=0)
        units = find_units(model, backend, include=include, **options)
        signals = UnitSignals(units)
        chosen = [u for u in units if any(re.search(p, u.name) for p in recovered)][:4]
        times: dict[str, list[float]] = {m: [] for m in mode_table}
        gather: dict[str, list[float]] = {"norms only": [], "norms + fidelity": []}
        for _ in range(args.rounds):
            for mode, (rows, recovering) in mode_table.items():
                measuring = rows is not None
                for unit in units:
                    unit.measure_fidelity, unit.fidelity_rows = measuring, rows or 0
                for unit in chosen:
                    (unit.enter_recovery if recovering else unit.exit_recovery)()
                for step in range(args.steps + 1):
                    model.zero_grad()
                    start = time.process_time()
                    model(input_ids=ids, labels=ids).loss.backward()
                    elapsed = time.process_time() - start
                    start = time.process_time()
                    signals.compute()
                    gathered = time.process_time() - start
                    if step:  # the first step of a mode warms up and is not counted
                        times[mode].append(elapsed)
                        gather["norms + fidelity" if measuring else "norms only"].append(gathered)
        units.close()
        median = {m: statistics.median(v) for m, v in times.items()}
        modes = list(mode_table)
        results[regime] = {
            "cpu_s_per_step": median,
            "extra_vs_not_measuring": {
                m: median[m] / median[modes[i - i % (len(args.rows) + 1)]] - 1 for i, m in enumerate(modes)
            },
            "gather_ms": {k: 1e3 * statistics.median(v) for k, v in gather.items()},
        }
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}, {args.rounds} rounds x {args.steps} steps\n")
    print("| regime | mode | CPU s/step | extra vs not measuring |\n|---|---|---:|---:|")
    for regime, r in results.items():
        for mode in mode_table:
            extra = r["extra_vs_not_measuring"][mode]
            print(f"| {regime} | {mode} | {r['cpu_s_per_step'][mode]:.3f} | {extra:+.1%} |")
    print("\n| regime | UnitSignals.compute, norms only (ms) | norms + fidelity (ms) |\n|---|---:|---:|")
    for regime, r in results.items():
        print(f"| {regime} | {r['gather_ms']['norms only']:.2f} | {r['gather_ms']['norms + fidelity']:.2f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
