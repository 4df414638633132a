"""What GNMR costs inside the Trainer: plain Trainer vs + GNMR monitor-only vs + GNMR active.

    python benchmarks/callback_overhead.py                 # tiny LLaMA, 3 rounds x 30 timed steps per mode
    python benchmarks/callback_overhead.py --hidden 256 --layers 4 --seq 128 --rounds 5

The three modes train the same INT8 + LoRA model (same checkpoint, data and seed) and are *interleaved*:
each round runs every mode once, in turn, so drift on a shared machine (thermal, other processes) hits all
three alike. Step time is measured from `on_step_begin` to `on_step_end` of every optimizer step after the
warm-up steps, and the report gives the median over all rounds and its ratio to the plain Trainer.

Peak memory: each mode also runs once in a fresh subprocess that reports its peak resident memory (ru_maxrss),
and the GNMR ledger reports the peak bytes of BF16 recovery weights alive at once (bounded by max_active x
the largest unit). In "active" mode a gradient spike is injected so that units really flip; monitor-only sees
the same spike but never flips.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("bnb_int8"):
    import torch
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gnmr_hf import GNMRCallback, GNMRConfig
    from gnmr_hf.experiments.demo import GradientSpikeCallback, byte_dataset
    from gnmr_hf.experiments.tiny import build_tiny_llama, load_int8_lora, write_local_text

MODES = ("plain", "monitor_only", "active")


class StepTimer(TrainerCallback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._t0 = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._t0 = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._t0)


class _OwnTime:
    """Wall time spent inside GNMR's own code (hooks, norm capture, decision, trace, logs), per optimizer step."""

    def __init__(self) -> None:
        self.current = 0.0
        self.steps: list[float] = []

    def wrap(self, fn, closes_step: bool = False):
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.current += time.perf_counter() - t0
                if closes_step:
                    self.steps.append(self.current)
                    self.current = 0.0

        return timed

    def per_step(self) -> list[float]:
        return self.steps


def _time_own_work(gnmr: GNMRCallback) -> _OwnTime:
    own = _OwnTime()
    for name in (
        "_on_model_forward",
        "_on_output_grad",
        "_capture",
        "on_log",
        "on_step_begin",
        "on_step_end",
        "on_pre_optimizer_step",
    ):
        setattr(gnmr, name, own.wrap(getattr(gnmr, name)))
    gnmr.on_optimizer_step = own.wrap(gnmr.on_optimizer_step, closes_step=True)
    return own


def run_mode(mode: str, model_dir: Path, data, out: Path, opts: argparse.Namespace) -> dict:
    model = load_int8_lora(model_dir, seed=opts.seed)
    timer = StepTimer()
    callbacks: list[TrainerCallback] = [timer]
    gnmr = None
    if mode != "plain":
        cfg = GNMRConfig(
            max_active=opts.max_active, lock_steps=4, window=4, min_history=4, monitor_only=mode == "monitor_only"
        )
        gnmr = GNMRCallback(cfg)
        own = _time_own_work(gnmr)
        callbacks.insert(0, gnmr)
    # The same spike in every mode, so the three runs do the same arithmetic apart from GNMR itself.
    callbacks.append(GradientSpikeCallback(f"model.layers.{opts.layers - 1}.mlp.down_proj", opts.spike_step))
    args = TrainingArguments(
        output_dir=str(out / mode),
        use_cpu=True,
        max_steps=opts.warmup + opts.steps,
        per_device_train_batch_size=opts.batch,
        learning_rate=1e-4,
        logging_steps=10,
        save_strategy="no",
        report_to=[],
        seed=opts.seed,
        disable_tqdm=True,
    )
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train()
    result = {"mode": mode, "step_times": timer.times[opts.warmup :]}
    if gnmr is not None:
        result["ledger_peak_bytes"] = gnmr.units[0].ledger.peak_bytes
        result["largest_unit_bytes"] = max(u.recovery_bytes() for u in gnmr.units)
        result["unit_steps_in_recovery"] = gnmr.summary.active_unit_steps
        result["own_us_per_step"] = [t * 1e6 for t in own.per_step()[opts.warmup :]]
    return result


def setup(opts: argparse.Namespace, work: Path):
    model_dir = build_tiny_llama(
        work / "model",
        seed=opts.seed,
        hidden_size=opts.hidden,
        intermediate_size=2 * opts.hidden,
        num_hidden_layers=opts.layers,
        max_position_embeddings=max(128, opts.seq),
    )
    data = byte_dataset(write_local_text(work / "train.txt", lines=4096, seed=opts.seed), seq_len=opts.seq)
    return model_dir, data


def machine() -> str:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor(),
    )
    return f"{cpu}, {torch.get_num_threads()} threads, torch {torch.__version__}, Python {platform.python_version()}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=30, help="timed optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps at the start of each run")
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--max_active", type=int, default=2)
    parser.add_argument("--spike_step", type=int, default=15)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--memory-child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path, help="also write the results here")
    opts = parser.parse_args()
    torch.set_num_threads(opts.threads)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir, data = setup(opts, work)
        if opts.memory_child:
            result = run_mode(opts.memory_child, model_dir, data, work, opts)
            result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
            del result["step_times"]
            print("RESULT " + json.dumps(result))
            return
        times: dict[str, list[float]] = {m: [] for m in MODES}
        own: dict[str, list[float]] = {m: [] for m in MODES}
        for _ in range(opts.rounds):
            for mode in MODES:
                result = run_mode(mode, model_dir, data, work, opts)
                times[mode] += result.pop("step_times")
                own[mode] += result.pop("own_us_per_step", [])

    memory = {}
    for mode in MODES:
        argv = [f"--{k}={v}" for k, v in vars(opts).items() if k not in ("json", "memory_child")]
        proc = subprocess.run(
            [sys.executable, __file__, *argv, "--memory-child", mode], capture_output=True, text=True, check=True
        )
        line = next(x for x in proc.stdout.splitlines() if x.startswith("RESULT "))
        memory[mode] = json.loads(line[len("RESULT ") :])

    plain = statistics.median(times["plain"])
    print(f"machine: {machine()}")
    print(
        f"model: hidden={opts.hidden} layers={opts.layers} seq={opts.seq} batch={opts.batch}, "
        f"{opts.rounds} rounds x {opts.steps} timed steps per mode, interleaved\n"
    )
    print(
        "| mode | median step (ms) | p90 step (ms) | ratio to plain | GNMR's own time per step (us, median) "
        "| own time / plain step | peak RSS (MiB) | peak BF16 recovery (KiB) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    rows = {}
    for mode in MODES:
        med = statistics.median(times[mode])
        p90 = statistics.quantiles(times[mode], n=10)[-1]
        ledger = memory[mode].get("ledger_peak_bytes")
        own_us = statistics.median(own[mode]) if own[mode] else None
        rows[mode] = {
            "median_ms": med * 1e3,
            "p90_ms": p90 * 1e3,
            "ratio": med / plain,
            "own_us_per_step": own_us,
            **memory[mode],
        }
        print(
            f"| {mode} | {med * 1e3:.2f} | {p90 * 1e3:.2f} | {med / plain:.3f}x | "
            f"{'-' if own_us is None else f'{own_us:.0f}'} | "
            f"{'-' if own_us is None else f'{own_us / 1e3 / (plain * 1e3):.2%}'} | "
            f"{memory[mode]['peak_rss_mib']:.0f} | {'-' if ledger is None else f'{ledger / 1024:.1f}'} |"
        )
    if "active" in memory:
        m = memory["active"]
        print(
            f"\nactive: peak BF16 recovery weights {m['ledger_peak_bytes']} B <= max_active x largest unit = "
            f"{opts.max_active} x {m['largest_unit_bytes']} B; unit-steps in recovery: {m['unit_steps_in_recovery']}"
        )
    if opts.json:
        opts.json.write_text(
            json.dumps({"machine": machine(), "args": vars(opts) | {"json": str(opts.json)}, "rows": rows}, indent=2)
        )


if __name__ == "__main__":
    main()
