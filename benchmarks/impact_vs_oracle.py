"""Does the impact estimate pick the units an oracle would? Top-k by `gnmr_hf.plan` against top-k by the loss itself.

    OMP_NUM_THREADS=1 python benchmarks/impact_vs_oracle.py --model smollm2-135m \
        --backend_options low_format=e2m1,high_format=bf16 --out runs/impact_oracle/fp4.json

The estimate is ranked on `--rank_batches` held-out batches (one forward and backward each, `gnmr_hf.plan`) and
judged on `--judge_batches` other held-out batches, forward only. The oracle's value of unit i is the loss that
batches lose when unit i alone runs on the recovery path (every other unit cheap), one forward pass per unit, on the
rank batches (`--oracle_on rank`, the default: both rankings are chosen on one set of batches and judged on another)
or on the judge batches themselves (`--oracle_on judge`: an in-sample oracle, an upper bound on any ranking). Then,
for k = 1 unit, 5% and 15% of the units: the gap closed on the judge batches, (L_low - L_set) / (L_low - L_high),
when the top-k units by the estimate run high, against the top-k by the oracle, the last layers, the first and last
layers, and random sets of k (mean of `--random_draws`). The goal of the impact policy's issue: the estimate's top-k
recovers at least 90% of what the oracle's top-k recovers at k = 5% and 15%.

This is the forward's loss only (block_fp rounds the backward's GEMM inputs too, which this oracle does not see);
`--model` takes any name or folder `gnmr_hf.experiments.models.load_real_model` takes, or `tiny` (a small random
LLaMA, for the smoke test).
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from pathlib import Path

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("block_fp"):
    import torch

    from gnmr_hf import find_units
    from gnmr_hf.planning import plan


def _layer(name: str) -> int:
    match = re.search(r"\.(\d+)\.", name)
    return int(match.group(1)) if match else 10**6  # a unit outside the layers (the head) is last


def _end_layers(names: list[str], k: int, first_too: bool) -> list[str]:
    """k units from the last layers inward (with `first_too`: alternately from the last and the first layers)."""
    layers = sorted({_layer(n) for n in names})
    order = []
    lo, hi = 0, len(layers) - 1
    while lo <= hi:
        order.append(layers[hi])
        hi -= 1
        if first_too and lo <= hi:
            order.append(layers[lo])
            lo += 1
    chosen: list[str] = []
    for layer in order:
        chosen += [n for n in names if _layer(n) == layer]
    return chosen[:k]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--backend", default="block_fp")
    parser.add_argument("--backend_options", default="low_format=e2m1,high_format=bf16")
    parser.add_argument("--rank_batches", type=int, default=2)
    parser.add_argument("--judge_batches", type=int, default=2)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--random_draws", type=int, default=3)
    parser.add_argument("--oracle_on", choices=("rank", "judge"), default="rank", help="Batches the oracle ranks on.")
    parser.add_argument("--out", default=None, help="Write the result as JSON here.")
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    if args.model == "tiny":
        from gnmr_hf.experiments.pretrain import build_model, llama_config

        model = build_model(llama_config(64, 2, 4, args.seq_len), 0)
        tokens = torch.randint(0, 256, (args.seq_len * args.batch_size * (args.rank_batches + args.judge_batches),))
    else:
        from gnmr_hf.experiments.models import load_real_model
        from gnmr_hf.experiments.pretrain import load_corpus, retokenize

        model = load_real_model(args.model)[0]
        tokens = retokenize(load_corpus("stdlib", 3_000_000), args.model).validation.long()
    per_batch = args.batch_size * args.seq_len
    count = args.rank_batches + args.judge_batches
    if len(tokens) < count * per_batch:
        print(f"error: the held-out text has {len(tokens)} tokens, {count * per_batch} needed", file=sys.stderr)
        return 2
    # Batches spread over the held-out text: rank and judge batches alternate, so neither is one document.
    stride = len(tokens) // count
    batches = [
        {"input_ids": (ids := tokens[i * stride : i * stride + per_batch].reshape(args.batch_size, -1)), "labels": ids}
        for i in range(count)
    ]
    rank, judge = batches[0::2][: args.rank_batches], batches[1::2][: args.judge_batches]

    start = time.perf_counter()
    ranking = plan(model, rank, backend=args.backend, backend_options=args.backend_options)
    plan_seconds = time.perf_counter() - start
    names = ranking.units
    units = find_units(model, args.backend, backend_options=args.backend_options)
    model.train()

    @torch.no_grad()
    def loss_on(batches: list[dict], high: set[str]) -> float:
        for unit in units:
            (unit.enter_recovery if unit.name in high else unit.exit_recovery)()
        return sum(float(model(**b).loss) for b in batches) / len(batches)

    def judge_loss(high: set[str]) -> float:
        return loss_on(judge, high)

    start = time.perf_counter()
    low, high = judge_loss(set()), judge_loss(set(names))
    oracle_batches = rank if args.oracle_on == "rank" else judge
    oracle_low = loss_on(oracle_batches, set())
    oracle = {}
    for i, name in enumerate(names):
        oracle[name] = oracle_low - loss_on(oracle_batches, {name})
        if i % 20 == 0:
            print(f"oracle {i}/{len(names)}: {name} {oracle[name]:.5f}", flush=True)
    oracle_seconds = time.perf_counter() - start
    gap = low - high

    def closed(chosen: list[str]) -> float:
        return (low - judge_loss(set(chosen))) / gap if gap else float("nan")

    n = len(names)
    by_oracle = sorted(names, key=lambda u: -oracle[u])
    rows = []
    rng = random.Random(0)
    for label, k in (("1 unit", 1), ("5%", max(1, round(0.05 * n))), ("15%", max(1, round(0.15 * n)))):
        row = {
            "budget": label,
            "k": k,
            "impact (plan)": closed(ranking.carve_out(k)),
            "oracle": closed(by_oracle[:k]),
            "last layers": closed(_end_layers(names, k, first_too=False)),
            "first and last layers": closed(_end_layers(names, k, first_too=True)),
            "random": sum(closed(rng.sample(names, k)) for _ in range(args.random_draws)) / args.random_draws,
        }
        row["impact / oracle"] = row["impact (plan)"] / row["oracle"] if row["oracle"] else float("nan")
        rows.append(row)
    estimate = dict(ranking.ranked)
    result = {
        "model": args.model,
        "backend": args.backend,
        "backend_options": args.backend_options,
        "oracle_on": args.oracle_on,
        "units": n,
        "loss_low": low,
        "loss_high": high,
        "gap": gap,
        "summed_impact": ranking.total,
        "summed_oracle": sum(oracle.values()),
        "plan_seconds": plan_seconds,
        "oracle_seconds": oracle_seconds,
        "rows": rows,
        "per_unit": [{"unit": u, "impact": estimate[u], "oracle": oracle[u]} for u in names],
        "command": " ".join(sys.argv),
    }
    header = list(rows[0])
    print(f"judge loss: low {low:.4f}, high {high:.4f}, gap {gap:.4f}; summed impact {ranking.total:.4f}, "
          f"summed oracle {result['summed_oracle']:.4f}")  # fmt: skip
    print(" | ".join(header))
    for row in rows:
        print(" | ".join(f"{row[h]:.3f}" if isinstance(row[h], float) else str(row[h]) for h in header))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
