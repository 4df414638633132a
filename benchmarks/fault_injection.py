"""Controlled fault injection: a local, transient fault on one unit's cheap path, and who catches it.

    python benchmarks/fault_injection.py --output_dir runs/fault --seeds 0 1 --learning_rate 3e-3

During pretraining with `act_quant` linear units (4-bit / 8-bit saved inputs, one scale per token), `--faults` times
per run a randomly chosen unit's cheap path is corrupted for `--duration` steps, the way a blown-up quantization
scale would corrupt it: every `--stride`-th token's scale of its saved input is multiplied by `--factor`
(`gnmr_hf.experiments.faults`: a `ScaleFault` as the unit's `scale_transform`), which bends that unit's weight
gradient, not only its size. The fault schedule (steps, units) depends only on the seed, so every arm gets the same
faults. A unit on the recovery path is immune: its 8-bit copy is saved correctly.

`--backend block_fp` runs the same on block_fp linear units (FP6 e3m2 GEMM inputs, FP8 e4m3 recovery by default,
`--low_format`, `--high_format`): the fault makes the rounded copy of the unit's input read `--factor` times its
value on every `--stride`-th token, in its fprop and wgrad GEMMs, as a blown-up scale of those tokens' tiles would
(a `FaultyGemmFormat` as the unit's cheap format); the recovery path's copy is correct.

    python benchmarks/fault_injection.py --backend block_fp --output_dir runs/fault_bfp --learning_rate 1.4e-3

With `--fault_operand grad` (block_fp) the fault is on the unit's output gradient instead: the rounded copy of that
gradient reads `--factor` times its value on every `--stride`-th token in its dgrad and wgrad GEMMs
(`FaultyGemmFormat.fault_operand`), so that the blown-up gradient flows on, through the dgrad, into every unit
before it.

Arms: `clean` (static low-cost, no fault: what the faults cost), `static_low` (faults, nothing reacts), `gnmr`
(faults, GNMR), `global_z` (faults, a ZClip-style z-score of the total gradient norm, recovering the `max_active`
units with the largest norms for `lock_steps` steps when it fires: GNMR's budget), `gnmr_cause` (faults, the cause
policy: a fault shows in the faulty unit's fidelity, measured in recovery too, so it is held while the fault lasts),
`gnmr_impact` (faults, the impact policy: a fault shows in the faulty unit's impact at its next measure, its turn or
the step after a symptom in its family; `--impact_options every=1` measures every unit every step),
and the stabilizers (`zclip`, `spam`, `stable_spam`, `adagc`, `skip_step`, `gnmr_cause_zclip`, every unit on the
cheap path but in the last; `gnmr_hf.experiments.stabilizers`; `--stabilizer_options` for a tuned setting), which
act on the update in the step itself: for them the table also says at how many faults' first step they acted
(clipped or skipped), during how many faults, and on how many steps without a fault.
Reported per arm over seeds and
faults: how often the faulty unit runs on the recovery path at the step after the fault's first step, the delay
from the fault's first step to its first recovered step (within the fault and `lock_steps` after), recoveries
(entries into recovery) on units that were not faulty at the decision step, unit-steps in recovery, and the final
validation loss. Writes `<output_dir>/fault_results.md` and `fault_results.json`.
"""

from __future__ import annotations

import dataclasses
import json
import random
import statistics
from pathlib import Path
from typing import Any

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("block_fp"):
    from transformers import TrainerCallback

    from gnmr_hf import GNMRConfig
    from gnmr_hf.experiments.faults import OPERANDS, clear_fault, inject_fault
    from gnmr_hf.experiments.pretrain import benchmark_arguments, benchmark_parser, load_corpus, run_arm
    from gnmr_hf.experiments.stabilizers import STABILIZER_ARMS
    from gnmr_hf.trace import read_trace

ARMS = ("clean", "static_low", "gnmr", "global_z", "gnmr_cause", "gnmr_impact", *STABILIZER_ARMS)


class FaultInjector(TrainerCallback):
    """Corrupts one unit's cheap path at a time, by the schedule `plan(num_units)` draws from `seed`."""

    def __init__(
        self, owner: Any, seed: int, faults: int, duration: int, factor: float, stride: int, operand: str = "input"
    ) -> None:
        self.owner, self.seed = owner, seed
        self.faults, self.duration, self.factor, self.stride = faults, duration, factor, stride
        self.operand = operand  # block_fp: "input" or "grad"; act_quant: "input" (the saved copy)
        self.schedule: list[tuple[int, int]] = []  # (first step, unit index)

    def plan(self, num_units: int, max_steps: int) -> list[tuple[int, int]]:
        """`faults` (first step, unit) pairs, starts spread over the middle of the run, units uniform."""
        rng = random.Random(self.seed)
        first, last = max_steps // 5, max_steps - 3 * self.duration
        span = (last - first) // self.faults
        return [
            (first + i * span + rng.randrange(max(1, span - self.duration)), rng.randrange(num_units))
            for i in range(self.faults)
        ]

    def on_train_begin(self, args, state, control, **kwargs):
        self.schedule = self.plan(len(self.owner.units), args.max_steps)

    def on_step_begin(self, args, state, control, **kwargs):
        step = state.global_step + 1
        faulty = {unit for start, unit in self.schedule if start <= step < start + self.duration}
        for i, unit in enumerate(self.owner.units):
            if i in faulty:
                inject_fault(unit, self.factor, self.stride, self.operand)
            else:
                clear_fault(unit)


def detection(schedule: list[tuple[int, int]], trace: Path, duration: int, lock_steps: int) -> dict[str, Any]:
    """Detection facts of one run from its trace: `active` of the decision at step s is the set of step s + 1."""
    _, records = read_trace(trace)
    steps = {r["step"]: r for r in records if r["type"] == "step"}
    in_recovery = {s + 1: set(r["active"]) for s, r in steps.items()}
    faulty_at = {}
    for start, unit in schedule:
        for s in range(start, start + duration):
            faulty_at.setdefault(s, set()).add(unit)
    caught_next, delays = 0, []
    for start, unit in schedule:
        if unit in in_recovery.get(start + 1, set()):
            caught_next += 1
        window = range(start, start + duration + lock_steps)
        first = next((s for s in window if unit in in_recovery.get(s, set())), None)
        if first is not None:
            delays.append(first - start)
    entries = [(s, u) for s, r in steps.items() for u in r["entered"]]
    wasted = sum(1 for s, u in entries if u not in faulty_at.get(s, set()))
    return {
        "faults": len(schedule),
        "caught_next_step": caught_next,
        "delays": delays,
        "entries": len(entries),
        "entries_on_healthy_units": wasted,
        "unit_steps_in_recovery": sum(len(r["active"]) for r in steps.values()),
    }


def stabilizer_acted(schedule: list[tuple[int, int]], acted_steps: list[int], duration: int) -> dict[str, int]:
    """How a stabilizer's actions (the steps it clipped or skipped) line up with the faults: at a fault's first step
    (a stabilizer acts on the step's own update), at any step of a fault, and at steps without one."""
    acted = set(acted_steps)
    faulty = {s for start, _ in schedule for s in range(start, start + duration)}
    return {
        "acted_first_step": sum(start in acted for start, _ in schedule),
        "acted_during": sum(any(s in acted for s in range(start, start + duration)) for start, _ in schedule),
        "acted_elsewhere": len(acted - faulty),
    }


def main() -> None:
    parser = benchmark_parser(__doc__.split("\n\n")[0], ARMS)
    parser.add_argument("--faults", type=int, default=6)
    parser.add_argument("--duration", type=int, default=4)
    parser.add_argument("--factor", type=float, default=30.0)
    parser.add_argument("--stride", type=int, default=16)
    parser.add_argument("--backend", default="act_quant", choices=("act_quant", "block_fp"))
    # Each backend's options, with their defaults; None on the command line: not given.
    defaults = {
        "act_quant": {"low_bits": 4, "high_bits": 8},
        "block_fp": {"low_format": "e3m2", "high_format": "e4m3", "fault_operand": "input"},
    }
    parser.add_argument("--low_bits", type=int, help="act_quant: bits of the cheap path's saved inputs (4)")
    parser.add_argument("--high_bits", type=int, help="act_quant: bits of the recovery path's (8)")
    parser.add_argument("--low_format", help="block_fp: the cheap path's element format (e3m2)")
    parser.add_argument("--high_format", help="block_fp: the recovery path's (e4m3)")
    parser.add_argument(
        "--fault_operand", choices=OPERANDS, help="block_fp: the operand whose copy the fault corrupts (input)"
    )
    parser.add_argument(
        "--stabilizer_options", default="", help="the stabilizer arms' method options beyond its defaults, 'k=v,...'"
    )
    cli = parser.parse_args()
    for backend, options in defaults.items():
        for name, default in options.items():
            if backend != cli.backend and getattr(cli, name) is not None:
                parser.error(f"--{name} is an option of --backend {backend}, not of --backend {cli.backend}")
            if getattr(cli, name) is None:
                setattr(cli, name, default)

    root = Path(cli.output_dir)
    args, pretrain = benchmark_arguments(cli)
    try:  # the stabilizer arms' packages and options, checked before the first arm trains
        stabilizers = [a for a in cli.arms if a in STABILIZER_ARMS] or ["static_low"]
        pretrain = dataclasses.replace(pretrain, arms=stabilizers, stabilizer_options=cli.stabilizer_options)
    except ValueError as err:
        parser.error(str(err))
    if cli.backend == "act_quant":
        options = {"low_bits": cli.low_bits, "high_bits": cli.high_bits, "scaling": "row"}
    else:
        options = {"low_format": cli.low_format, "high_format": cli.high_format}
    config = GNMRConfig(backend=cli.backend, backend_options=options, include=[r"\.(q|k|v|o|gate|up|down)_proj$"])
    corpus = load_corpus(pretrain.corpus, pretrain.corpus_bytes)
    rows = []
    for seed in cli.seeds:
        for arm in cli.arms:
            injectors: list[FaultInjector] = []

            def extra(owner, seed=seed, arm=arm, injectors=injectors):
                if arm == "clean":
                    return []
                operand = cli.fault_operand if cli.backend == "block_fp" else "input"
                injector = FaultInjector(owner, seed, cli.faults, cli.duration, cli.factor, cli.stride, operand)
                injectors.append(injector)
                return [injector]

            out = root / arm / f"seed{seed}"
            result = run_arm(
                "static_low" if arm in ("clean", "static_low") else arm,
                seed,
                args=dataclasses.replace(args, output_dir=str(out)),
                pretrain=pretrain,
                config=config,
                corpus=corpus,
                extra_callbacks=extra,
            )
            row = {"arm": arm, "seed": seed, "final_eval_loss": result["final_eval_loss"]}
            if injectors:
                schedule = injectors[0].schedule
                row.update(detection(schedule, out / config.trace_file, cli.duration, config.lock_steps))
                row["schedule"] = schedule
                if "stabilizer" in result:
                    row["stabilizer"] = result["stabilizer"]
                    row.update(stabilizer_acted(schedule, result["stabilizer"]["acted_steps"], cli.duration))
            rows.append(row)
            (root / "fault_results.json").write_text(json.dumps(rows, indent=1))
            print(json.dumps({k: v for k, v in row.items() if k != "schedule"}))
    (root / "fault_results.md").write_text(fault_table(rows) + "\n")
    print(fault_table(rows))


def fault_table(rows: list[dict[str, Any]]) -> str:
    """One row per arm, over seeds: faults caught at the next step, delays, wasted recoveries, final loss; with
    stabilizer arms, at how many faults' first step and during how many faults each acted, and on how many other
    steps (`stabilizer_acted`)."""
    stabilized = any("stabilizer" in row for row in rows)
    extra = " stabilizer acted: fault's first step / during the fault / other steps |" if stabilized else ""
    lines = [
        "| arm | seeds | faults | in recovery at the next step | mean delay (steps) | entries on healthy units "
        "| unit-steps in recovery | val loss |" + extra,
        "|---|---|---|---|---|---|---|---|" + ("---|" if stabilized else ""),
    ]
    by_arm: dict[str, list[dict[str, Any]]] = {}
    for row in rows:
        by_arm.setdefault(row["arm"], []).append(row)
    for arm, runs in by_arm.items():
        losses = [r["final_eval_loss"] for r in runs]
        loss = f"{statistics.fmean(losses):.4f} ± {(max(losses) - min(losses)) / 2:.4f}"
        seeds = ",".join(str(r["seed"]) for r in runs)
        acted = "-"
        if "stabilizer" in runs[0]:
            acted = " / ".join(str(sum(r[k] for r in runs)) for k in ("acted_first_step", "acted_during"))
            acted = f"{acted} of {sum(r['faults'] for r in runs)} / {sum(r['acted_elsewhere'] for r in runs)}"
        tail = f" {acted} |" if stabilized else ""
        if "faults" not in runs[0]:
            lines.append(f"| {arm} | {seeds} | 0 | - | - | - | - | {loss} |" + tail)
            continue
        faults = sum(r["faults"] for r in runs)
        caught = sum(r["caught_next_step"] for r in runs)
        delays = [d for r in runs for d in r["delays"]]
        delay = f"{statistics.fmean(delays):.2f} ({len(delays)}/{faults} caught)" if delays else "never"
        lines.append(
            f"| {arm} | {seeds} | {faults} | {caught}/{faults} | {delay} | "
            f"{sum(r['entries_on_healthy_units'] for r in runs)}/{sum(r['entries'] for r in runs)} | "
            f"{sum(r['unit_steps_in_recovery'] for r in runs)} | {loss} |" + tail
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
