"""The recovery oracle: which units *would* gain most from the recovery path, and how well GNMR's choice agrees.

The paper's oracle recovers the units with the largest recovery gap. A unit's gap at a step is the norm of the
difference between its signal gradient on the low-cost path and on the recovery path:

    gap_i = || g_i(every unit low) - g_i(every unit high) ||

measured on the same batch with the same weights. `recovery_gaps` computes it with two extra forward/backward
passes through `torch.autograd.grad` (so no `.grad` is touched and the optimizer step is unaffected): one with every
unit on the low-cost path and one with every unit on the recovery path. The training step's own backward could
serve as the low-path pass only in an arm where nothing is in recovery; two passes make the gap independent of the
arm's current recovery set, which is what a fair comparison of arms needs. The passes run with the random state
forked (stochastic rounding does not shift the run's own stream), with saved-tensor hooks masked (a memory meter
does not count them), and every unit's path and its ledger's peak are restored afterwards.

The gap says where the cheap path's damage *shows*, not what causes it: a unit whose own cheap path is exact still
has a gap when a unit downstream corrupts the gradient that reaches it (the attention regime of docs/results.md:
layer 0's projections rank first under every policy). `recovery_benefits` asks the counterfactual question a
budget has to answer instead, how much recovering unit i *alone* brings the whole model's gradient to the one of
the recovery path:

    benefit_i = || G(every unit low) - G(every unit high) || - || G(only unit i high) - G(every unit high) ||

with G the gradient of every trainable parameter (and every signal tensor), concatenated: one pass per unit on top
of the two (N + 2 in all). A unit whose cheap path loses nothing has benefit ~0 wherever its gap shows; the cause of
a corrupted gradient has the benefit of removing it. It is first-order (units recovered together may interact) and
can be slightly negative (recovering one unit of several may move the gradient away); it is what the cause policy's
attribution claims to estimate from a step's own measurements.

`OracleCallback` probes every `every`-th optimizer step, at step begin, on exactly the batch that step will train
on (the pretraining data is read sequentially, so batch t is known), and records the gaps (and with
`benefits=True` the benefits) together with GNMR's risk of every unit from the decision that set the step's
recovery set. `oracle_agreement` then reports, against either oracle, over the probes where GNMR had scores:

- precision@k of GNMR's ranking: the share of GNMR's k riskiest units that are among the oracle's k largest
  (k = `max_active`), beside random selection's expectation k / N;
- precision of the set GNMR actually recovered at that step, over the probes where it recovered anything;
- Spearman's rank correlation between GNMR's risk and the oracle's values, beside that of random scores (simulated).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import TrainerCallback, default_data_collator

from ..callback import GNMRCallback
from ..units import RecoverableUnit

__all__ = ["ORACLES", "OracleCallback", "oracle_agreement", "read_oracle", "recovery_benefits", "recovery_gaps"]

# What `oracle_agreement` can rank by: the fields of a probe record.
ORACLES = ("gaps", "benefits")


def _gradients(model: nn.Module, batch: dict[str, torch.Tensor], tensors: list[torch.Tensor]) -> list:
    loss = model(**batch).loss
    return list(torch.autograd.grad(loss, tensors, allow_unused=True))


@contextlib.contextmanager
def _probing(units: Sequence[RecoverableUnit]) -> Iterator[None]:
    """Extra passes that are not training steps: random state forked, saved-tensor hooks masked, meters paused
    (policy="cause"); every unit's path, meter and ledger peak restored afterwards."""
    was_recovering = [u.in_recovery for u in units]
    was_measuring = [u.meter.on for u in units]
    for unit in units:
        unit.meter.on = False
    ledgers = {id(u.ledger): (u.ledger, u.ledger.peak_bytes) for u in units}
    try:
        with torch.random.fork_rng(devices=[]), torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            yield
    finally:
        for unit, recovering in zip(units, was_recovering, strict=True):
            if recovering:
                unit.enter_recovery()
            else:
                unit.exit_recovery()
        for ledger, peak in ledgers.values():
            ledger.peak_bytes = peak
        for unit, measuring in zip(units, was_measuring, strict=True):
            unit.meter.on = measuring


def _set_paths(units: Sequence[RecoverableUnit], high: Sequence[bool]) -> None:
    for unit, recover in zip(units, high, strict=True):
        if recover:
            unit.enter_recovery()
        else:
            unit.exit_recovery()


def recovery_gaps(model: nn.Module, units: Sequence[RecoverableUnit], batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """float64 [N]: each unit's gap (see the module docstring) on `batch`; NaN for a unit with no signal tensors or
    no gradient. `batch` holds the model's keyword inputs including `labels`. Units end on the path they had."""
    return _probe(model, units, batch, benefits=False)[0]


def recovery_benefits(
    model: nn.Module, units: Sequence[RecoverableUnit], batch: dict[str, torch.Tensor]
) -> torch.Tensor:
    """float64 [N]: each unit's benefit (see the module docstring) on `batch`; NaN where a gradient is not finite.
    N + 2 forward/backward passes. Units end on the path they had."""
    return _probe(model, units, batch, benefits=True)[1]


def _probe(
    model: nn.Module, units: Sequence[RecoverableUnit], batch: dict[str, torch.Tensor], benefits: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(gaps [N], benefits [N], NaN everywhere when not asked for), sharing the all-low and all-high passes."""
    owners: list[int] = []
    tensors: list[torch.Tensor] = []
    for i, unit in enumerate(units):
        for t in unit.signal_tensors():
            owners.append(i)
            tensors.append(t)
    n_signal = len(tensors)
    # The whole gradient: every trainable parameter and every signal tensor that is not one, each once (units may
    # share a tensor: an attention unit's signal is its q, k and v projections' weights), at its first position.
    first: dict[int, int] = {}
    for position, t in enumerate(tensors):
        first.setdefault(id(t), position)
    if benefits:
        tensors += [p for p in model.parameters() if p.requires_grad and id(p) not in first]
    whole = sorted(first.values()) + list(range(n_signal, len(tensors)))
    n = len(units)
    benefit = torch.full((n,), torch.nan, dtype=torch.float64)
    with _probing(units):
        _set_paths(units, [False] * n)
        low = _gradients(model, batch, tensors)
        _set_paths(units, [True] * n)
        high = _gradients(model, batch, tensors)
        if benefits:
            flat_high = _flat(high, tensors, whole)
            base = torch.linalg.vector_norm(_flat(low, tensors, whole) - flat_high)
            for i in range(n):
                _set_paths(units, [j == i for j in range(n)])
                grads = _gradients(model, batch, tensors)
                distance = torch.linalg.vector_norm(_flat(grads, tensors, whole) - flat_high)
                benefit[i] = base - distance
            benefit = torch.where(benefit.isfinite(), benefit, torch.nan)
    squares = torch.zeros(n, dtype=torch.float64)
    measured = torch.zeros(n, dtype=torch.bool)
    for i, g_low, g_high in zip(owners, low[:n_signal], high[:n_signal], strict=True):
        if g_low is not None and g_high is not None:
            squares[i] += (g_low.double() - g_high.double()).square().sum().cpu()
            measured[i] = True
    return torch.where(measured, squares.sqrt(), torch.nan), benefit


def _flat(grads: Sequence[torch.Tensor | None], tensors: Sequence[torch.Tensor], positions: list[int]) -> torch.Tensor:
    """The gradients at `positions` as one float64 vector on the host (zeros for a tensor the loss does not
    reach)."""
    parts = [torch.zeros_like(tensors[k]) if grads[k] is None else grads[k] for k in positions]
    return torch.cat([g.detach().double().reshape(-1).cpu() for g in parts])


class OracleCallback(TrainerCallback):
    """Probes the oracle gaps every `every` optimizer steps on the batch the step trains on (see the module
    docstring) and writes them to `oracle.jsonl` in the output folder at train end.

    Args:
        owner: the `GNMRCallback` (with or without a baseline `selection`) whose units and decisions are compared; its
            `trace_top_k` should be >= the number of units, so that GNMR's risk of every unit is known.
        dataset: the training dataset, read sequentially (batch t = items (t-1)*batch_size .. t*batch_size - 1).
        batch_size: items per optimizer step.
        every: probe period in optimizer steps.
        benefits: also probe each unit's benefit (`recovery_benefits`: N + 2 passes per probe instead of 2).
    """

    def __init__(
        self, owner: GNMRCallback, dataset: Any, batch_size: int, every: int = 10, benefits: bool = False
    ) -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"OracleCallback: every must be an int >= 1, got {every!r}")
        if not isinstance(benefits, bool):
            raise ValueError(f"OracleCallback: benefits must be a bool, got {benefits!r}")
        self.owner, self.dataset, self.batch_size, self.every = owner, dataset, batch_size, every
        self.benefits = benefits
        self.records: list[dict[str, Any]] = []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        step = state.global_step + 1
        if step % self.every or not self.owner.units:
            return
        start = (step - 1) * self.batch_size
        if start + self.batch_size > len(self.dataset):
            return
        batch = default_data_collator([self.dataset[i] for i in range(start, start + self.batch_size)])
        device = next(model.parameters()).device
        batch = {k: v.to(device) for k, v in batch.items()}
        gaps, benefits = _probe(model, self.owner.units, batch, self.benefits)
        risk = [0.0] * len(self.owner.units)
        decision = self.owner.last_decision
        if decision is not None and "cause" in decision.extras:
            # The cause policy ranks by what the cheap path loses, not by GNMR's risk.
            for i, r in decision.extras["cause"]["cheap_loss"]:
                risk[i] = r
        elif decision is not None:
            for i, r in zip(decision.top_units.tolist(), decision.top_risks.tolist(), strict=True):
                risk[i] = r
        self.records.append(
            {
                "step": step,
                "gaps": _json_floats(gaps),
                **({"benefits": _json_floats(benefits)} if self.benefits else {}),
                "risk": risk,
                "scored": decision is not None and decision.n_scored > 0,
                "active": [i for i, u in enumerate(self.owner.units) if u.in_recovery],
            }
        )

    def on_train_end(self, args, state, control, **kwargs):
        if not state.is_world_process_zero:
            return
        path = Path(args.output_dir) / "oracle.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("w") as f:
            f.write(json.dumps({"type": "header", "units": [u.name for u in self.owner.units]}) + "\n")
            for record in self.records:
                f.write(json.dumps({"type": "probe", **record}) + "\n")


def _json_floats(values: torch.Tensor) -> list[float | None]:
    return [None if v != v else v for v in values.tolist()]


def read_oracle(path: str | Path) -> tuple[list[str], list[dict[str, Any]]]:
    """(unit names, probe records) of an `oracle.jsonl`; gaps (and benefits, where probed) are floats with NaN for
    missing ones."""
    lines = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not lines or lines[0].get("type") != "header":
        raise ValueError(f"read_oracle: {path} does not start with an oracle header line")
    records = []
    for line in lines[1:]:
        for key in ORACLES:
            if key in line:
                line[key] = [float("nan") if g is None else g for g in line[key]]
        records.append(line)
    return lines[0]["units"], records


def _ranks(x: np.ndarray) -> np.ndarray:
    """Ranks 0..n-1 with ties given their average rank (as Spearman's correlation needs)."""
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x))
    values = x[order]
    start = 0
    for end in range(1, len(x) + 1):
        if end == len(x) or values[end] != values[start]:
            ranks[order[start:end]] = (start + end - 1) / 2
            start = end
    return ranks


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    """Spearman's rank correlation of two vectors (ties averaged); NaN when either is constant."""
    ra, rb = _ranks(np.asarray(a, dtype=float)), _ranks(np.asarray(b, dtype=float))
    if ra.std() == 0 or rb.std() == 0:
        return float("nan")
    return float(np.corrcoef(ra, rb)[0, 1])


def _top(x: np.ndarray, k: int) -> set[int]:
    # Largest first, ties to the lower index: a stable sort of -x.
    return set(np.argsort(-x, kind="stable")[:k].tolist())


def oracle_agreement(
    records: Sequence[dict[str, Any]], k: int, samples: int = 200, seed: int = 0, oracle: str = "gaps"
) -> dict[str, Any]:
    """GNMR against the oracle over `records` (see the module docstring), beside random selection.

    `oracle`: what ranks the units, one of `ORACLES` ("gaps", the paper's; "benefits", the counterfactual one, in
    records probed with `benefits=True`). Only probes where GNMR had scores and every value is finite count.
    Returns the number of probes used, mean precision@k of GNMR's risk ranking and of random rankings (simulated
    with `samples` draws per probe; its expectation is k / N), mean precision of the recovered set where non-empty,
    the mean share of the oracle's k largest values that the recovered set holds (`recovered_share`: the sum of
    its units' values over that of the k largest; with benefits, what the set gains of the best k units' gain, to
    first order), and mean Spearman correlation of GNMR's risk and of random scores with the oracle's values.
    """
    if oracle not in ORACLES:
        raise ValueError(f"oracle_agreement: oracle must be one of {list(ORACLES)}, got {oracle!r}")
    missing = sum(oracle not in record for record in records)
    if missing:
        raise ValueError(
            f"oracle_agreement: {missing} of {len(records)} records have no {oracle!r} (probe them with "
            f"OracleCallback(benefits=True), the recipes' --oracle_benefits)"
        )
    rng = np.random.default_rng(seed)
    precision, active_precision, rho, random_precision, random_rho = [], [], [], [], []
    active_share: list[float] = []
    for record in records:
        values = np.asarray(record[oracle], dtype=float)
        risk = np.asarray(record["risk"], dtype=float)
        if not record.get("scored") or not np.isfinite(values).all():
            continue
        n = len(values)
        top = _top(values, k)
        precision.append(len(_top(risk, k) & top) / k)
        rho.append(spearman(risk, values))
        if record["active"]:
            active_precision.append(len(set(record["active"]) & top) / len(record["active"]))
            best = values[sorted(top)].sum()
            active_share.append(float(values[record["active"]].sum() / best) if best > 0 else float("nan"))
        draws = rng.random((samples, n))
        random_precision.append(float(np.mean([len(_top(d, k) & top) / k for d in draws])))
        random_rho.append(float(np.nanmean([spearman(d, values) for d in draws[:20]])))

    def mean(values: list[float]) -> float:
        finite = [v for v in values if v == v]
        return float(np.mean(finite)) if finite else float("nan")

    return {
        "probes": len(precision),
        "k": k,
        "precision_at_k": mean(precision),
        "random_precision_at_k": mean(random_precision),
        "recovered_set_precision": mean(active_precision),
        "probes_with_recovered_units": len(active_precision),
        "recovered_share": mean(active_share),
        "spearman": mean(rho),
        "random_spearman": mean(random_rho),
    }
