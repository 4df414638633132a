"""What one optimizer step of `GNMRController` costs on a CPU, as the number of units N grows.

    python benchmarks/controller_overhead.py
    python benchmarks/controller_overhead.py --sizes 10 1000 100000 --steps 200 --repeats 3 --threads 2

For each N the controller (default `GNMRConfig`: max_active=4, lock_steps=8, window=8, min_history=4) sees a
realistic stream: float32 norms (as `UnitSignals` hands them over), log-normal across units (scales from 1e-3
to 1e3) and across steps (sigma 0.3), with a spike (x10..x50) in about one unit-step in a thousand and a NaN in
one in 10^5, so that some units are risky, enter and leave every step. The first `window + min_history + 20`
steps (warm-up) are not timed. Two numbers per step:

- `observe`: `controller.observe(norms)`, the whole decision, left on the device;
- `+ to_host`: the same plus `decision.to_host(top_k=16)`, the one transfer the Trainer callback makes.

Each N runs `--repeats` times in a fresh controller; the table shows the run with the lowest median (a shared
machine only ever adds time), its p90, the cost per unit, and how the median grows from the previous N (10x
more units: 10.0 is linear growth, less means a fixed per-step cost still dominates).

Allocator note: in a fresh process, glibc hands a freed multi-MB block back to the OS and the next step
page-faults it in again (~0.3 ms per step at N=10^5 here). Inside a training loop this never happens: the
first freed gradient or activation larger than the controller's buffers raises glibc's dynamic mmap
threshold. The script does the same once at start (allocates and frees 16 MB); `--no-prime` skips it.
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import statistics
import time

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports():
    import torch

    from gnmr_hf import GNMRConfig, GNMRController

TOP_K = 16  # GNMRConfig.trace_top_k's default: what the callback fetches every step


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def make_stream(n: int, steps: int, seed: int) -> torch.Tensor:
    """[steps, n] float32 norms: per-unit log-normal scale, per-step log-normal noise, rare spikes and NaNs."""
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.empty(n).uniform_(-6.9, 6.9, generator=g))
    noise = torch.exp(0.3 * torch.randn(steps, n, generator=g))
    spikes = torch.where(
        torch.rand(steps, n, generator=g) < 1e-3, torch.empty(steps, n).uniform_(10.0, 50.0, generator=g), 1.0
    )
    norms = scale * noise * spikes
    return norms.masked_fill_(torch.rand(steps, n, generator=g) < 1e-5, torch.nan).float()


def time_run(n: int, steps: int, seed: int) -> tuple[list[float], list[float], int, float]:
    """Per-step seconds of observe() and of observe()+to_host(), units entered in all, page faults per step."""
    config = GNMRConfig()
    warmup = config.window + config.min_history + 20
    stream = make_stream(n, warmup + steps, seed)
    controller = GNMRController(config, n)
    observe_s: list[float] = []
    total_s: list[float] = []
    entered = 0
    faults = 0
    for step in range(warmup + steps):
        if step == warmup:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        norms = stream[step]
        t0 = time.perf_counter()
        decision = controller.observe(norms)
        t1 = time.perf_counter()
        host = decision.to_host(top_k=TOP_K)
        t2 = time.perf_counter()
        if step >= warmup:
            observe_s.append(t1 - t0)
            total_s.append(t2 - t0)
            entered += len(host.entered)
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
    return observe_s, total_s, entered, faults / steps


def p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 280, 1_000, 10_000, 100_000])
    parser.add_argument("--steps", type=int, default=200, help="timed steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per N; the lowest median is reported")
    parser.add_argument("--threads", type=int, default=2, help="torch.set_num_threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-prime", action="store_true", help="skip the 16 MB allocate/free (see docstring)")
    opts = parser.parse_args()

    torch.set_num_threads(opts.threads)
    if not opts.no_prime:
        block = torch.empty(16 << 20, dtype=torch.uint8)
        del block
    load_before = os.getloadavg()
    rows = []
    for n in opts.sizes:
        runs = [time_run(n, opts.steps, opts.seed + r) for r in range(opts.repeats)]
        obs, _, entered, faults = min(runs, key=lambda run: statistics.median(run[0]))
        tot_best = min((run[1] for run in runs), key=statistics.median)
        rows.append((n, statistics.median(obs), p90(obs), statistics.median(tot_best), p90(tot_best), entered, faults))
    load_after = os.getloadavg()

    print(
        f"CPU: {cpu_model()}; {os.cpu_count()} logical cores visible; torch {torch.__version__} "
        f"with {torch.get_num_threads()} threads; Python {platform.python_version()}"
    )
    print(
        f"{opts.steps} timed steps per run, best of {opts.repeats} runs by median; glibc primed: "
        f"{not opts.no_prime}; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after"
    )
    print()
    print(
        "| N | observe median (us) | observe p90 (us) | per unit (ns) | x vs previous N "
        "| + to_host median (us) | + to_host p90 (us) | per unit (ns) | units entered | page faults / step |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    previous = None
    for n, med, q90, tmed, tq90, entered, faults in rows:
        growth = f"{med / previous:.1f}" if previous else "-"
        previous = med
        print(
            f"| {n:,} | {med * 1e6:.0f} | {q90 * 1e6:.0f} | {med / n * 1e9:.1f} | {growth} "
            f"| {tmed * 1e6:.0f} | {tq90 * 1e6:.0f} | {tmed / n * 1e9:.1f} | {entered} | {faults:.0f} |"
        )


if __name__ == "__main__":
    main()
