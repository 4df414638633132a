"""What GNMR costs on a GPU, on a LLaMA of realistic shape: step time, host syncs, flip latency, peak memory.

    bash benchmarks/gpu_check.sh                                     # one GPU, ~1.1B LLaMA, under 11 minutes
    python benchmarks/gpu_check.py --size tiny --steps 4 --out runs/gpu_check_cpu   # the same logic on a CPU
    python benchmarks/gpu_check.py --model smollm2-135m --out runs/gpu_check/smollm2   # the real SmolLM2-135M

1. Builds a LLaMA from a config (`--size 1b`: TinyLlama's shape, 22 layers, hidden 2048, 1.1B parameters; random
   weights, fixed seed), saves it as BF16 safetensors, and loads it back in 8-bit (bitsandbytes) with LoRA on every
   linear projection, as `recipes/finetune_13b.py --arm gnmr` does. Nothing is downloaded.
2. Trains the same model three times with the transformers Trainer (bf16 autocast, activation checkpointing): plain,
   + GNMR monitor-only, + GNMR active. Thresholds are low on purpose (alpha = beta = 1.05, `lock_steps` 2), so that
   active GNMR flips units on most steps: its time is the cost of heavy churn, an upper bound for a real run, where
   flips are rare. The report gives the flips per step each mode really made.
   - step time: device-synchronized wall time over `--steps` steps after `--warmup` steps, per step, and its ratio
     to plain;
   - device-to-host syncs per optimizer step: over `--sync_steps` further steps, with
     `torch.cuda.set_sync_debug_mode("warn")`, counting its "called a synchronizing CUDA operation" warnings (it
     catches `.item()`, `.cpu()`, blocking copies and stream syncs, not collectives). GNMR's own share is the
     difference to plain; it should be one (the decision's single transfer);
   - peak memory: `torch.cuda.max_memory_allocated` per mode, and GNMR's ledger of BF16 recovery weights.
3. Flip latency: for the largest unit (an MLP projection), `enter_recovery()` (build its BF16 weight, from the
   checkpoint's safetensors or by dequantizing the INT8 weight) and `exit_recovery()`, device-synchronized, against
   one host-to-device copy of a BF16 tensor of the same shape (pageable and pinned host memory).

Writes `OUT/gpu_check.json` and prints a markdown table. On a CPU (`--size tiny`) the same code runs; device syncs
and host-to-device copies do not exist there, so those columns say so: this mode checks the logic, not the numbers.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
import warnings
from pathlib import Path
from typing import Any

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("bnb_int8"):
    import torch
    from transformers import LlamaConfig, TrainerCallback

    from gnmr_hf.experiments.tiny import TINY_LLAMA

SIZES = {
    # TinyLlama-1.1B's shape: grouped-query attention (4 KV heads), 154 INT8 linear layers.
    "1b": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    ),
    "tiny": {**TINY_LLAMA, "max_position_embeddings": 512},
}
MODES = ("plain", "monitor_only", "active")
SYNC_WARNING = "called a synchronizing CUDA operation"
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class Meter(TrainerCallback):
    """Times steps warmup+1 .. warmup+steps (synchronized at both ends only), then counts syncs per step."""

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.seconds = 0.0
        self.syncs: list[int] = []
        self._t0 = 0.0
        self._caught: list[warnings.WarningMessage] | None = None
        self._catcher: Any = None

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step + 1
        if step == self.warmup + 1:
            synchronize()
            self._t0 = time.perf_counter()
        elif step > self.warmup + self.steps and torch.cuda.is_available():
            self._catcher = warnings.catch_warnings(record=True)
            self._caught = self._catcher.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")

    def on_step_end(self, args, state, control, **kwargs):
        step = state.global_step  # the step that just ended
        if step == self.warmup + self.steps:
            synchronize()
            self.seconds = time.perf_counter() - self._t0
        elif self._catcher is not None:
            torch.cuda.set_sync_debug_mode("default")
            self._catcher.__exit__(None, None, None)
            self.syncs.append(sum(SYNC_WARNING in str(w.message) for w in self._caught or []))
            self._catcher = self._caught = None


def build_model(size: str, path: Path, device: str) -> Path:
    """A randomly initialised LLaMA of `size`, saved as BF16 safetensors (the "original checkpoint")."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(device):  # initialise on the GPU: 1.1B parameters in a second rather than a minute
        model = LlamaForCausalLM(LlamaConfig(**SIZES[size])).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return path


def load_int8_lora(path: Path, device: str) -> Any:
    """8-bit base + LoRA on every projection, prepared as peft prepares any k-bit base (as the recipe does)."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        str(path),
        dtype=torch.bfloat16,
        quantization_config=BitsAndBytesConfig(load_in_8bit=True),
        device_map={"": device},
    )
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(0)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def random_tokens(vocab: int, rows: int, seq: int) -> Any:
    from datasets import Dataset

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(3, vocab, (rows, seq), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def run_mode(mode: str, model: Any, data: Any, opts: argparse.Namespace, out: Path) -> dict[str, Any]:
    from transformers import Trainer, TrainingArguments

    from gnmr_hf import GNMRConfig, GNMRTrainer

    on_gpu = torch.cuda.is_available()
    meter = Meter(opts.warmup, opts.steps)
    args = TrainingArguments(
        output_dir=str(out / mode),
        use_cpu=not on_gpu,
        bf16=on_gpu,
        activation_checkpointing=True,
        activation_checkpointing_kwargs={"use_reentrant": False},
        max_steps=opts.warmup + opts.steps + opts.sync_steps,
        per_device_train_batch_size=opts.batch,
        learning_rate=1e-4,
        logging_steps=10_000,  # no log in the measured steps: a log line costs a sync of its own
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    common = dict(model=model, args=args, train_dataset=data, callbacks=[meter])
    if mode == "plain":
        trainer = Trainer(**common)
    else:
        config = GNMRConfig(
            max_active=opts.max_active,
            lock_steps=2,
            window=2,
            min_history=2,
            alpha=1.05,
            beta=1.05,
            monitor_only=mode == "monitor_only",
            trace_file="",
        )
        trainer = GNMRTrainer(**common, gnmr_config=config)
    if on_gpu:
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer.train()
    result: dict[str, Any] = {
        "mode": mode,
        "step_s": meter.seconds / opts.steps,
        "syncs_per_step": statistics.median(meter.syncs) if meter.syncs else None,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if on_gpu else None,
    }
    if mode != "plain":
        gnmr = trainer.gnmr
        summary = gnmr.summary
        # Decided flips; monitor-only decides the same way and applies none (its recovery peak stays 0).
        result["flips_per_step"] = summary.flips / max(summary.steps, 1)
        result["recovery_peak_mib"] = gnmr.units[0].ledger.peak_bytes / 2**20
    return result


def time_it(fn: Any, repeats: int) -> float:
    """Median device-synchronized seconds of `fn()`."""
    times = []
    for _ in range(repeats):
        synchronize()
        t0 = time.perf_counter()
        fn()
        synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def flip_latency(model: Any, device: str, repeats: int) -> dict[str, Any]:
    """enter/exit_recovery of the largest unit, per recovery source, against one H2D copy of its BF16 weight."""
    from gnmr_hf import find_units

    result: dict[str, Any] = {}
    for source in ("checkpoint", "dequantize"):
        units = find_units(model, "bnb_int8", source=source)
        unit = max(units, key=lambda u: u.recovery_bytes())
        enter = time_it(lambda u=unit: (u.enter_recovery(), u.exit_recovery()), repeats)
        exit_only = []
        for _ in range(repeats):
            unit.enter_recovery()
            exit_only.append(time_it(unit.exit_recovery, 1))
        for u in units:
            u.close()
        result[source] = {"enter_exit_ms": enter * 1e3, "exit_ms": statistics.median(exit_only) * 1e3}
        result["unit"], result["unit_mib"] = unit.name, unit.recovery_bytes() / 2**20
        result["shape"] = list(unit.module.weight.shape)
    host = torch.randn(result["shape"]).to(torch.bfloat16)
    result["h2d_pageable_ms"] = time_it(lambda: host.to(device), repeats) * 1e3
    if device != "cpu":
        pinned = host.pin_memory()
        result["h2d_pinned_ms"] = time_it(lambda: pinned.to(device, non_blocking=True), repeats) * 1e3
    return result


def count_int8(model: Any) -> int:
    import bitsandbytes as bnb

    return sum(isinstance(m, bnb.nn.Linear8bitLt) for m in model.modules())


def machine() -> str:
    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU ({platform.processor() or platform.machine()}), torch {torch.__version__}"


def table(report: dict[str, Any]) -> str:
    def num(value: Any, fmt: str) -> str:
        return "n/a" if value is None else format(value, fmt)

    plain = report["modes"][0]["step_s"]
    lines = [
        f"GNMR GPU check: {report['machine']}; LLaMA {report['size']} ({report['parameters'] / 1e6:,.1f}M parameters, "
        f"{report['units']} INT8 units), batch {report['batch']} x {report['seq']} tokens",
        "",
        "| mode | step (ms) | / plain | syncs per step | peak (GiB) | flips decided per step "
        "| BF16 recovery peak (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in report["modes"]:
        lines.append(
            f"| {m['mode']} | {m['step_s'] * 1e3:.1f} | {m['step_s'] / plain:.3f} | {num(m['syncs_per_step'], 'g')} | "
            f"{num(m['peak_gib'], '.2f')} | {num(m.get('flips_per_step'), '.2f')} | "
            f"{num(m.get('recovery_peak_mib'), '.2f')} |"
        )
    flip = report["flip"]
    lines += [
        "",
        f"Flip latency, unit {flip['unit']} {flip['shape']} ({flip['unit_mib']:.2f} MiB in BF16):",
        "",
        "| what | ms | / one H2D copy (pageable) |",
        "|---|---|---|",
    ]
    h2d = flip["h2d_pageable_ms"]
    rows = [("H2D copy of the BF16 weight, pageable", h2d), ("H2D copy, pinned", flip.get("h2d_pinned_ms"))]
    for source in ("checkpoint", "dequantize"):
        rows += [
            (f"enter + exit recovery, source={source}", flip[source]["enter_exit_ms"]),
            (f"exit recovery, source={source}", flip[source]["exit_ms"]),
        ]
    for label, ms in rows:
        lines.append(f"| {label} | {num(ms, '.3f')} | {num(None if ms is None else ms / h2d, '.2f')} |")
    if report["device"] == "cpu":
        lines += ["", "CPU run: no device syncs or host-to-device copies exist here; this checks the logic only."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="1b")
    parser.add_argument(
        "--model",
        default=None,
        help="a real model of gnmr_hf.experiments.models (smollm2-135m) instead of a random LLaMA of --size: its "
        "converted safetensors folder, loaded in 8-bit with LoRA the same way",
    )
    parser.add_argument("--out", default="runs/gpu_check")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per mode")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first (allocator, autotuning)")
    parser.add_argument("--sync_steps", type=int, default=3, help="steps with sync counting, after the timed ones")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--max_active", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20, help="repeats of each flip-latency measurement")
    opts = parser.parse_args()
    for name in ("steps", "warmup", "sync_steps", "batch", "seq", "max_active", "repeats"):
        if getattr(opts, name) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(opts, name)}")
    if opts.model is None and opts.seq > SIZES[opts.size]["max_position_embeddings"]:
        parser.error(f"--seq must be <= {SIZES[opts.size]['max_position_embeddings']} for --size {opts.size}")

    device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    if opts.model is None:
        path = build_model(opts.size, out / f"llama_{opts.size}", device)
    else:
        from gnmr_hf.experiments.models import resolve_model

        path = resolve_model(opts.model)  # the cached, checksummed safetensors folder (converted once)
    model = load_int8_lora(path, device)
    rows = opts.batch * (opts.warmup + opts.steps + opts.sync_steps)
    data = random_tokens(model.config.vocab_size, rows, opts.seq)
    # One model for the three modes: each run leaves it as found (GNMR closes its units at train end), and loading a
    # 1B model three times would cost more than the measurements. Only the LoRA weights move between runs.
    modes = [run_mode(mode, model, data, opts, out) for mode in MODES]
    report = {
        "machine": machine(),
        "device": device,
        "size": opts.model or opts.size,
        "parameters": sum(p.numel() for p in model.get_base_model().parameters()),
        "units": count_int8(model),
        "batch": opts.batch,
        "seq": opts.seq,
        "modes": modes,
        "flip": flip_latency(model, device, opts.repeats),
        "seconds": time.perf_counter() - t0,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=2) + "\n")
    print(table(report))
    print(f"\n{report['seconds']:.0f} s in all; {out / 'gpu_check.json'}")


if __name__ == "__main__":
    main()
