"""A long run of the controller: do its means stay exact, its memory and its step time flat, over 10^6 steps?

    python benchmarks/long_run.py                       # 1,000 units, 10^6 steps (about 5 minutes on 2 cores)
    python benchmarks/long_run.py --units 1000 --steps 100000 --checkpoint_every 10000

The controller keeps each unit's history as a float64 running sum and count, so over a long run its mean could
drift from the true mean of the norms it has seen. This script feeds it a realistic stream (per-unit log-normal
scales over six decades, per-step noise, rare x10-x50 spikes, a NaN now and then, 1% of units missing each step)
and keeps, beside it, an independent reference: the same sums with Neumaier's compensated summation in numpy,
accurate to about one rounding whatever the length. At every checkpoint it reports the largest relative error of
the stored means against that reference, the bytes of the controller's state tensors, the process's resident
memory, and the median time of `observe()` + `to_host()` over the steps since the last checkpoint.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports():
    import numpy as np
    import torch

    from gnmr_hf import GNMRConfig, GNMRController


def rss_mb() -> float:
    """Resident memory now (not the peak), from /proc."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    import os

    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def simulate(units: int, steps: int, checkpoint_every: int, seed: int = 0) -> dict:
    g = np.random.default_rng(seed)
    controller = GNMRController(GNMRConfig(), units)
    scale = np.exp(g.uniform(-6.9, 6.9, units))
    ref_sum = np.zeros(units)
    ref_comp = np.zeros(units)  # Neumaier compensation terms
    ref_count = np.zeros(units)
    result: dict = {
        "checkpoints": [],
        "max_relative_error": 0.0,
        "state_bytes": [],
        "rss_mb": [],
        "median_step_us": [],
    }
    window: list[float] = []
    for step in range(1, steps + 1):
        norms = scale * np.exp(0.3 * g.standard_normal(units))
        spikes = g.random(units) < 1e-3
        norms[spikes] *= g.uniform(10.0, 50.0, int(spikes.sum()))
        norms[g.random(units) < 1e-5] = np.nan
        missing = g.random(units) < 0.01
        valid = np.isfinite(norms) & ~missing
        # The reference: Neumaier's compensated sum of the valid norms, per unit.
        x = np.where(valid, norms, 0.0)
        t = ref_sum + x
        ref_comp += np.where(np.abs(ref_sum) >= np.abs(x), (ref_sum - t) + x, (x - t) + ref_sum)
        ref_sum = t
        ref_count += valid
        start = time.perf_counter()
        controller.observe(torch.from_numpy(norms), torch.from_numpy(missing)).to_host(top_k=16)
        window.append(time.perf_counter() - start)
        if step % checkpoint_every == 0:
            exact = ref_sum + ref_comp
            seen = ref_count > 0
            stored = controller.norm_sum.numpy() / np.maximum(controller.norm_count.numpy(), 1)
            reference = exact / np.maximum(ref_count, 1)
            error = float(np.max(np.abs(stored[seen] - reference[seen]) / reference[seen]))
            assert np.array_equal(controller.norm_count.numpy(), ref_count)
            state = controller.state_dict()
            nbytes = sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor))
            result["max_relative_error"] = max(result["max_relative_error"], error)
            result["checkpoints"].append(step)
            result["state_bytes"].append(nbytes)
            result["rss_mb"].append(round(rss_mb(), 1))
            result["median_step_us"].append(round(statistics.median(window) * 1e6, 1))
            result.setdefault("relative_error", []).append(error)
            window = []
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--units", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=1_000_000)
    parser.add_argument("--checkpoint_every", type=int, default=100_000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="also write the result to this file")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)
    start = time.time()
    result = simulate(opts.units, opts.steps, opts.checkpoint_every, opts.seed)
    result["wall_s"] = round(time.time() - start, 1)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, Python {platform.python_version()}")
    print(f"{opts.units} units, {opts.steps:,} steps, wall {result['wall_s']} s")
    print("| step | max rel. error of the means | state bytes | RSS (MB) | median observe+to_host (us) |")
    print("|---:|---:|---:|---:|---:|")
    for row in zip(
        result["checkpoints"],
        result["relative_error"],
        result["state_bytes"],
        result["rss_mb"],
        result["median_step_us"],
        strict=True,
    ):
        print(f"| {row[0]:,} | {row[1]:.2e} | {row[2]:,} | {row[3]} | {row[4]} |")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
