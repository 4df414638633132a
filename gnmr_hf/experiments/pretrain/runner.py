"""Training the arms: one arm and seed from scratch (`run_arm`), or every arm and seed of a comparison.

`run_arm` builds the arm's model, batches and callbacks, trains and evaluates it with the Trainer, and writes one
`result.json`: the final validation loss, the loss curves, seconds per step and bytes saved for backward
(`meters`), and from the GNMR trace the recovery fraction and exceedance rate. `run_comparison` runs the arms of
each seed in order; the budget arms (random, carve-outs) take the budget the gnmr run of the same seed spent, so
`check_arm_plan` checks, before the first arm trains, that every arm will find what it needs.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import statistics
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from ...advise import unmatched
from ...callback import GNMRCallback
from ...config import GNMRConfig
from ...trace import read_trace
from ..baselines import best_static_units
from ..stabilizers import STABILIZER_ARMS, parse_options, stabilizer_for
from .anomalies import AnomalousBlocks
from .arguments import PretrainArguments
from .arms import BUDGET_ARMS, arm_callbacks
from .data import Corpus, block_dataset, text_codec
from .meters import StepMeter
from .model import recipe_model

__all__ = ["check_arm_plan", "gnmr_budget", "oracle_mean_gaps", "run_arm", "run_comparison", "unit_names"]

logger = logging.getLogger("gnmr_hf")


def run_arm(
    arm: str,
    seed: int,
    *,
    args: TrainingArguments,
    pretrain: PretrainArguments,
    config: GNMRConfig,
    corpus: Corpus,
    budget: float | None = None,
    carve_units: Sequence[str] | None = None,
    extra_callbacks: Callable[[GNMRCallback | None], Sequence[TrainerCallback]] | None = None,
) -> dict[str, Any]:
    """Train one arm from scratch with one seed in `args.output_dir`, evaluate it, write and return `result.json`.

    A stabilizer arm (`STABILIZER_ARMS`) adds its method's callbacks and optimizer and sets the Trainer's own
    clipping as the method asks (`gnmr_hf.experiments.stabilizers`); what it did is the result's `stabilizer`.

    `extra_callbacks(owner)` adds callbacks that need the arm's unit-owning callback (None for the reference), such
    as a fault injector; they run after the arm's own callbacks and before the step meter.
    """
    from ..oracle import OracleCallback

    out = Path(args.output_dir)
    args = dataclasses.replace(args, seed=seed)
    model = recipe_model(pretrain, seed)
    batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
    # TrainingArguments.data_seed (default 0 here) seeds the batch order, the same in every arm. A real model's
    # weights are the same in every seed, so there the seed draws the batch order instead.
    default_data_seed = 0 if pretrain.model == "scratch" else seed
    data_seed = args.data_seed if args.data_seed is not None else default_data_seed
    train = block_dataset(corpus.train, pretrain.seq_len, args.max_steps * batch, data_seed)
    anomalies = pretrain.anomaly_schedule()
    if anomalies is not None:
        encode, decode = text_codec(pretrain.model)
        train = AnomalousBlocks(
            train,
            anomalies,
            batch=batch,
            seq_len=pretrain.seq_len,
            max_steps=args.max_steps,
            seed=data_seed,
            encode=encode,
            decode=decode,
            tokens=corpus.train,
        )
    validation = block_dataset(corpus.validation, pretrain.seq_len, pretrain.eval_blocks, None)
    callbacks = arm_callbacks(
        arm,
        config,
        seed,
        budget=budget,
        carve_units=carve_units,
        carve_patterns=pretrain.carve_named,
        impact_options=pretrain.impact_options,
    )
    owner = next((cb for cb in callbacks if isinstance(cb, GNMRCallback)), None)
    if owner is not None and anomalies is not None:
        for step, kind in anomalies.steps(args.max_steps):
            owner.mark_step(step, anomaly=kind)
    if owner is not None and pretrain.oracle_every and arm.startswith("gnmr"):
        callbacks.append(
            OracleCallback(owner, train, batch, every=pretrain.oracle_every, benefits=pretrain.oracle_benefits)
        )
    stabilizer = None
    if arm in STABILIZER_ARMS:
        stabilizer = stabilizer_for(arm, args, parse_options(pretrain.stabilizer_options))
        args = dataclasses.replace(args, max_grad_norm=stabilizer.max_grad_norm)
        callbacks += stabilizer.callbacks
    meter = StepMeter()
    callbacks += [*(extra_callbacks(owner) if extra_callbacks is not None else ()), meter]
    trainer = Trainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=validation,
        callbacks=callbacks,
        optimizer_cls_and_kwargs=stabilizer.optimizer_cls_and_kwargs if stabilizer is not None else None,
    )
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    final = trainer.evaluate()
    history = trainer.state.log_history
    result: dict[str, Any] = {
        "arm": arm,
        "seed": seed,
        "data_seed": data_seed,
        "learning_rate": args.learning_rate,
        "max_steps": args.max_steps,
        "model": {k: getattr(pretrain, k) for k in ("model", "d_model", "n_layers", "n_heads", "seq_len")},
        "corpus": {"source": corpus.source, "fingerprint": corpus.fingerprint(), "train_bytes": len(corpus.train)},
        "backend": None if arm == "reference" else config.backend,
        "backend_options": None if arm == "reference" else config.backend_options,
        "final_eval_loss": final["eval_loss"],
        "final_eval_ppl": math.exp(min(final["eval_loss"], 50.0)),
        "train_loss": [(h["step"], h["loss"]) for h in history if "loss" in h],
        "eval_loss": [(h["step"], h["eval_loss"]) for h in history if "eval_loss" in h],
        "sec_per_step": statistics.median(meter.seconds) if meter.seconds else math.nan,
        "wall_seconds": wall,
        "saved_bytes_per_step": statistics.fmean(meter.saved_bytes) if meter.saved_bytes else math.nan,
    }
    if anomalies is not None:
        result["anomalies"] = anomalies.record(args.max_steps)
    if owner is not None:
        result.update(_trace_facts(out / config.trace_file, owner))
    if stabilizer is not None:
        result["stabilizer"] = stabilizer.record()
    out.mkdir(parents=True, exist_ok=True)
    (out / "result.json").write_text(json.dumps(result, indent=1))
    return result


def _trace_facts(path: Path, owner: GNMRCallback) -> dict[str, Any]:
    """Recovery fraction, mean number of recovered units and exceedance rate of a run, from its trace."""
    header, records = read_trace(path)
    steps = [r for r in records if r["type"] == "step"]
    n_units = len(header["units"])
    active = sum(len(r["active"]) for r in steps)
    scored = sum(r["n_scored"] for r in steps)
    ledger = owner.units[0].ledger if owner.units else None
    return {
        "units": n_units,
        "unit_names": header["units"],
        "recovery_fraction": active / (n_units * len(steps)) if steps else 0.0,
        "mean_active": active / len(steps) if steps else 0.0,
        "exceedance_rate": sum(len(r["risky"]) for r in steps) / scored if scored else 0.0,
        "recovery_steps_per_unit": [sum(1 for r in steps if i in set(r["active"])) for i in range(n_units)],
        "ledger_peak_bytes": ledger.peak_bytes if ledger is not None else None,
    }


def gnmr_budget(root: str | Path, seed: int) -> float | None:
    """The mean number of units the gnmr arm of `seed` recovered, from its result under `root`, else None."""
    path = Path(root) / "gnmr" / f"seed{seed}" / "result.json"
    return json.loads(path.read_text())["mean_active"] if path.is_file() else None


def oracle_mean_gaps(root: str | Path, seed: int) -> dict[str, float] | None:
    """Mean oracle gap per unit over the gnmr run of `seed` under `root` (its oracle.jsonl), else None."""
    from ..oracle import read_oracle

    path = Path(root) / "gnmr" / f"seed{seed}" / "oracle.jsonl"
    if not path.is_file():
        return None
    names, records = read_oracle(path)
    gaps = torch.tensor([r["gaps"] for r in records], dtype=torch.float64)
    return dict(zip(names, gaps.nanmean(0).tolist(), strict=True))


def run_comparison(
    root: str | Path, *, args: TrainingArguments, pretrain: PretrainArguments, config: GNMRConfig, corpus: Corpus
) -> list[dict[str, Any]]:
    """Every arm of `pretrain.arms` for every seed of `pretrain.seeds` (seeds outer), each in `root/<arm>/seed<k>`,
    and return their results. The budget arms take the mean budget of the gnmr run of the same seed under `root`
    (or `pretrain.budget`), carve_best the units with the largest mean oracle gaps of that run, so run gnmr first."""

    root = Path(root)
    check_arm_plan(root, pretrain, config)
    results = []
    for seed in pretrain.seeds:
        for arm in pretrain.arms:
            budget = pretrain.budget if pretrain.budget is not None else gnmr_budget(root, seed)
            if arm in BUDGET_ARMS and budget is None:
                raise ValueError(f"arm {arm} needs the gnmr run of seed {seed} in {root} first, or --budget")
            carve_units = None
            if arm == "carve_best":
                gaps = oracle_mean_gaps(root, seed)
                if gaps is None:
                    raise ValueError(f"arm carve_best needs the gnmr run of seed {seed} with --oracle_every in {root}")
                carve_units = best_static_units(gaps, max(1, round(budget)))
            out = root / arm / f"seed{seed}"
            logger.info("arm %s, seed %d -> %s", arm, seed, out)
            result = run_arm(
                arm,
                seed,
                args=dataclasses.replace(args, output_dir=str(out)),
                pretrain=pretrain,
                config=config,
                corpus=corpus,
                budget=budget,
                carve_units=carve_units,
            )
            logger.info("arm %s seed %d: final validation loss %.4f", arm, seed, result["final_eval_loss"])
            results.append(result)
    return results


def check_arm_plan(root: str | Path, pretrain: PretrainArguments, config: GNMRConfig) -> None:
    """Everything the arm list needs, checked before the first arm trains (a failure after an hour of arms is a
    lost hour): the budget arms and carve_best need a gnmr run of each seed, earlier in the list or already in
    `root` (carve_best's with oracle probes), and carve_named's regexes must match some unit of this model."""
    root = Path(root)
    for seed in pretrain.seeds:
        for i, arm in enumerate(pretrain.arms):
            gnmr_first = "gnmr" in pretrain.arms[:i]
            if arm in BUDGET_ARMS and pretrain.budget is None and not gnmr_first and gnmr_budget(root, seed) is None:
                raise ValueError(
                    f"arm {arm} takes GNMR's budget: put gnmr before it in --arms, run gnmr of seed {seed} into "
                    f"{root} first, or give --budget"
                )
            if arm == "carve_best":
                if gnmr_first and not pretrain.oracle_every:
                    raise ValueError("arm carve_best needs --oracle_every K > 0 for the gnmr run it follows")
                if not gnmr_first and oracle_mean_gaps(root, seed) is None:
                    raise ValueError(
                        f"arm carve_best needs the gnmr run of seed {seed} with --oracle_every in {root}: put gnmr "
                        "before it in --arms with --oracle_every K"
                    )
    if "carve_named" in pretrain.arms:
        names = unit_names(pretrain, config)
        # Each pattern on its own: a carve-out pasted from `gnmr-hf plan` or `advise` that names a module this
        # recipe does not manage (its head, say) would otherwise run as a smaller carve-out than the one asked for.
        missing = unmatched(pretrain.carve_named or (), names)
        if missing:
            raise ValueError(
                f"--carve_named {' '.join(missing)} matches no unit; with --backend {config.backend} "
                f"--backend_options {config.backend_options or '{}'} the units are {names}"
            )


def unit_names(pretrain: PretrainArguments, config: GNMRConfig) -> list[str]:
    """The names of the units `config` finds on this recipe's model (built once, then dropped)."""
    from ...registry import find_units

    model = recipe_model(pretrain, 0)
    units = find_units(
        model, config.backend, include=config.include, exclude=config.exclude, backend_options=config.backend_options
    )
    units.close()
    return units.names
