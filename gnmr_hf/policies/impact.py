"""The impact policy (`GNMRConfig(policy="impact")`): spend the budget where the cheap path costs the loss most.

Each unit's *impact* is what its cheap path costs the training loss, in nats per token, estimated online from one
step's own forward and backward (`gnmr_hf.impact`: a Fisher-weighted output error). The units take turns measuring
it (one step in `every`, on `rows` sampled rows), so that measuring stays a small share of the step; a *quiet* unit,
whose estimate is far from the bar to the budget (the larger of `min_impact` and the `max_active`-th largest
estimate) on its own side of it (out of recovery under `quiet_below` of the bar, in recovery over `quiet_above`
times it), measures `quiet_factor` times less often (its family's symptoms still have it measured at once). A unit
keeps a running estimate between its measures (`smoothing`: the weight of a new measure). Then, every step:

- the candidates are the units whose estimate is *material* (above `min_impact` nats per token: what recovering
  the unit alone would buy the loss), a unit whose gradient norm is broken (inf/NaN), and a unit that has no
  estimate yet but whose GNMR score is risky (the paper's rule: a backend that does not measure impact keeps it);
- the `max_active` candidates of largest impact run in recovery at the next step (a broken norm first; a unit
  without an estimate ranks as if its impact were `min_impact` times its risk; an incumbent's impact counts 1.25x,
  so that units of similar impact do not swap every step);
- a unit is held while it stays material (its lock renewed), and released `lock_steps` steps after it stops being
  so; one that relapses within `lock_steps` of its release gets twice its last lock (`gnmr_hf.policy.RelapseLock`);
- a symptom (a unit risky by GNMR's own scores) has its whole family measured at the next step (`measure`), so that
  a sudden failure is weighed at once, not at its family's next turn; and a risky unit whose estimate predates the
  symptom (it did not measure at this step) and is not material is *probed* (`probe`): it runs in recovery at the
  next step for that one step, measured there, and stays only if the measure finds it material. So a sudden fault
  is in recovery at the next step, as under the paper's rule, and costs one unit-step when it turns out cheap. A
  unit is probed at most once in `lock_steps` steps (a lasting symptom whose measure said "cheap" is not re-probed
  every other step; its turns still measure it).

It idles when no unit is material: then it spends nothing but the probes, one step for each fresh symptom (a spike
with no lossy cheap path behind it is not the cheap path's to fix). Why each rule and the default values:
docs/method.md, "The impact policy". Pure torch, no host sync, a fixed number of ops per step.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .base import NEVER, Choice, PolicyOptions, Scores, load_tensor, within_budget
from .cause import UnitRelations, _per_family
from .paper import LockedPolicy

__all__ = ["ImpactOptions", "ImpactPolicy", "quiet_units"]

_INCUMBENT = 1.25


@dataclass
class ImpactOptions(PolicyOptions):
    """Options of `policy="impact"` (`GNMRConfig.policy_options`)."""

    min_impact: float = field(
        default=2e-3,
        metadata={
            "help": "Nats per token a unit's cheap path must cost the loss (its estimated impact) to be worth "
            "recovering; below it on every unit the policy spends nothing. > 0."
        },
    )
    rows: int = field(
        default=32,
        metadata={"help": "Rows (tokens) of a unit's output one measure reads, spread over the batch (0: all). >= 0."},
    )
    every: int = field(
        default=4,
        metadata={
            "help": "A unit measures its impact on one optimizer step in this many, the units taking turns (and at "
            "once after a symptom in its family). >= 1."
        },
    )
    smoothing: float = field(
        default=0.5,
        metadata={"help": "Weight of a new measure in a unit's running impact estimate, in (0, 1] (1: the last)."},
    )
    quiet_factor: int = field(
        default=4,
        metadata={
            "help": "A quiet unit (its estimate far from the bar to the budget, the larger of min_impact and the "
            "max_active-th largest estimate: under quiet_below times it out of recovery, over quiet_above times it "
            "in recovery) measures on one step in every * quiet_factor, not every (and still at once after a "
            "symptom in its family). 1: no unit is quiet. >= 1."
        },
    )
    quiet_below: float = field(
        default=0.5,
        metadata={
            "help": "A unit out of recovery is quiet while its estimate is under this share of the bar to the "
            "budget. > 0."
        },
    )
    quiet_above: float = field(
        default=2.0,
        metadata={
            "help": "A unit in recovery is quiet while its estimate is over this many times the bar to the budget "
            "(inf: a unit in recovery measures on every turn). >= 1."
        },
    )
    probe: bool = field(
        default=True,
        metadata={
            "help": "Probe a symptom: a risky unit whose estimate predates it runs in recovery at the next step, "
            "measured there, and stays only if material (at most once in lock_steps steps). False: it waits for "
            "its family's measure at the next step and enters, if material, the step after."
        },
    )

    def __post_init__(self) -> None:
        for name, top in (("min_impact", math.inf), ("smoothing", 1.0), ("quiet_below", math.inf)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"option {name!r} must be a number, got {value!r}")
            if not (0 < value <= top) or math.isnan(value) or math.isinf(value):
                allowed = "a finite number > 0" if top == math.inf else f"in (0, {top:g}]"
                raise ValueError(f"option {name!r} must be {allowed}, got {value}")
        self.check_int("rows", 0)
        self.check_int("every", 1)
        self.check_int("quiet_factor", 1)
        above = self.quiet_above
        if isinstance(above, bool) or not isinstance(above, int | float) or not above >= 1:
            raise ValueError(f"option 'quiet_above' must be a number >= 1 (inf: none in recovery), got {above!r}")
        self.check_bool("probe")


class ImpactPolicy(LockedPolicy):
    """The impact policy (see the module docstring). State beyond the locks and the relapse lock: each unit's
    running impact estimate (`impact_estimate`, NaN before its first measure), the step of its last measure
    (`impact_at`), that measure itself (`impact_last`) and the step of its last probe (`impact_probed_at`)."""

    name = "impact"
    options = ImpactOptions
    opts: ImpactOptions

    @property
    def keeps_lock_lengths(self) -> bool:
        return True

    def impact_schedule(self) -> tuple[int, int]:
        return self.opts.rows, self.opts.every

    def impact_quiet(self) -> tuple[int, np.ndarray] | None:
        factor = self.opts.quiet_factor
        return None if factor == 1 else (self.opts.every * factor, self.quiet_mask)

    def bind(self, names: Sequence[str], kinds: Sequence[str], device: torch.device) -> None:
        super().bind(names, kinds, device)
        # The host's copy of the quiet units (`impact_quiet`): the meters read it, so it is only ever updated in place.
        self.quiet_mask = np.zeros(self.num_units, dtype=bool)
        self._quiet_before: np.ndarray | None = None
        self.relations = UnitRelations.from_names(names, kinds)
        self._families = torch.tensor(self.relations.families, dtype=torch.long, device=self.device)
        self.estimate = torch.full((self.num_units,), torch.nan, dtype=torch.float64, device=self.device)
        self.estimated_at = torch.full((self.num_units,), NEVER, dtype=torch.int64, device=self.device)
        # Each unit's last measure itself (NaN before one): a unit in recovery is quiet only while that, not just the
        # running estimate, is far over the bar, so that a unit whose cost has gone measures at its usual turns.
        self.last_measure = torch.full((self.num_units,), torch.nan, dtype=torch.float64, device=self.device)
        self.probed_at = torch.full((self.num_units,), NEVER, dtype=torch.int64, device=self.device)
        self._estimate_before: tuple[torch.Tensor, ...] | None = None

    def step(self, scores: Scores) -> Choice:
        """One step: the new recovery set and locks, and per unit `impact` (the running estimate, NaN where none
        yet) and `measure` (the units to measure at the next step: the families of this step's symptoms)."""
        cfg, opts, t, active = self.config, self.opts, scores.t, self.active
        fresh = torch.full_like(self.estimate, torch.nan) if scores.impact is None else scores.impact.to(torch.float64)
        measured = ~fresh.isnan()
        # A first measure sets the estimate; later ones move it by `smoothing`. A non-finite measure (a cheap path
        # that overflowed) is the largest impact there is, and stays so until a finite one replaces it.
        fresh = fresh.nan_to_num(nan=0.0, posinf=math.inf, neginf=math.inf)
        mixed = torch.where(
            self.estimate.isnan() | self.estimate.isinf() | fresh.isinf(),
            fresh,
            (1.0 - opts.smoothing) * self.estimate + opts.smoothing * fresh,
        )
        self._estimate_before = (self.estimate, self.estimated_at, self.probed_at, self.last_measure)
        self.last_measure = torch.where(measured, fresh, self.last_measure)
        self.estimate = torch.where(measured, mixed, self.estimate)
        self.estimated_at = torch.where(measured, t, self.estimated_at)
        estimate = self.estimate
        known = ~estimate.isnan()
        material = known & (estimate > opts.min_impact)
        broken_norm = scores.broken
        fallback = scores.risky & ~known
        # A probe: the symptom is newer than the unit's estimate, so the estimate cannot say whether it is cheap.
        probe = scores.risky & known & ~material & ~measured & ~active & (t - self.probed_at > cfg.lock_steps)
        if not opts.probe:
            probe = torch.zeros_like(probe)

        assert self.relapse is not None
        countdown = (self.locks - 1).clamp_min(0)
        wants = material | broken_norm | fallback | probe
        entering = wants & ~active
        # A probe holds one step; the relapse lock's length stands for the renewal, should its measure be material.
        lock_length = torch.where(probe, 1, self.relapse.lengths(t, entering))
        renew = entering | (active & wants)
        candidates = wants | (active & (countdown > 0))
        key = torch.where(known & ~probe, estimate, opts.min_impact * scores.risk).nan_to_num(nan=0.0, posinf=1e300)
        key = torch.where(broken_norm, 1e300, key) * torch.where(active, _INCUMBENT, 1.0)
        selected = within_budget(candidates, key, cfg.max_active)
        new_locks = torch.where(selected, torch.where(renew, lock_length, countdown), 0).to(torch.int32)
        self.probed_at = torch.where(selected & probe, t, self.probed_at)
        self.relapse.exits(t, active, selected)
        self._set(new_locks, selected)

        count = len(self.relations.family_names)
        symptom_family = _per_family(scores.risky.to(torch.int64), self._families, count, "amax", 0)
        measure = symptom_family[self._families] > 0
        extras = {"impact": estimate, "measured": measured, "measure": measure, "quiet": self._quiet(selected)}
        return Choice(selected, candidates, new_locks, extras)

    def _quiet(self, active: torch.Tensor) -> torch.Tensor:
        opts = self.opts
        if opts.quiet_factor == 1:
            return torch.zeros_like(active)
        return quiet_units(
            self.estimate,
            active,
            opts.min_impact,
            self.config.max_active,
            opts.quiet_below,
            opts.quiet_above,
            last=self.last_measure,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        return super().state_dict() | {
            "impact_estimate": self.estimate,
            "impact_at": self.estimated_at,
            "impact_last": self.last_measure,
            "impact_probed_at": self.probed_at,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        if "impact_estimate" in state and "impact_at" in state:
            self.estimate = load_tensor(state, "impact_estimate", self.estimate)
            self.estimated_at = load_tensor(state, "impact_at", self.estimated_at)
            # A state saved before the last measure was kept: the running estimate stands for it.
            last = "impact_last" if "impact_last" in state else "impact_estimate"
            self.last_measure = load_tensor(state, last, self.last_measure)
            # A state saved before probes existed: no unit probed yet.
            never = torch.full_like(self.probed_at, NEVER)
            self.probed_at = load_tensor(state, "impact_probed_at", never) if "impact_probed_at" in state else never
        else:  # a state another policy saved: no estimate yet
            self.estimate = torch.full_like(self.estimate, torch.nan)
            self.estimated_at = torch.full_like(self.estimated_at, NEVER)
            self.last_measure = torch.full_like(self.last_measure, torch.nan)
            self.probed_at = torch.full_like(self.probed_at, NEVER)
        self._estimate_before = None
        # The quiet units follow from the state (a resumed run measures on the steps the uninterrupted one did).
        self.quiet_mask[:] = self._quiet(self.active).cpu().numpy()
        self._quiet_before = None

    def revert(self) -> None:
        super().revert()
        if self._estimate_before is not None:
            (self.estimate, self.estimated_at, self.probed_at, self.last_measure) = self._estimate_before
            self._estimate_before = None
        if self._quiet_before is not None:
            self.quiet_mask[:], self._quiet_before = self._quiet_before, None

    def describe(self) -> dict[str, Any]:
        return {"families": [self.relations.family_names[f] for f in self.relations.families]}

    def host_parts(self, choice: Choice, k: int) -> list[torch.Tensor]:
        # The measures taken this step (every unit's estimate where it measured, -1 elsewhere), the units to
        # measure at the next step and the quiet units from the next step, as one float64 run of 3N values.
        extras = choice.extras
        fresh = torch.where(extras["measured"], extras["impact"].nan_to_num(posinf=1e300), -1.0)
        return [fresh.to(torch.float64), extras["measure"].to(torch.float64), extras["quiet"].to(torch.float64)]

    def host_extras(self, parts: np.ndarray, active: np.ndarray, k: int) -> dict[str, Any]:
        """{"impact": {"estimate": [[unit, estimate], ...] for the units measured this step, "measure": [unit, ...]
        the units asked to measure at the next step, "quiet": how many units measure on the slower rotation from
        the next step}}. Updates the quiet units' host mask (`impact_quiet`) in place."""
        n = self.num_units
        fresh, measure, quiet = parts[:n], parts[n : 2 * n], parts[2 * n : 3 * n] > 0
        self._quiet_before = self.quiet_mask.copy()
        self.quiet_mask[:] = quiet
        measured = np.flatnonzero(fresh >= 0)
        return {
            "impact": {
                "estimate": [[int(i), float(fresh[i])] for i in measured],
                "measure": [int(i) for i in np.flatnonzero(measure > 0)],
                "quiet": int(quiet.sum()),
            }
        }


def quiet_units(
    estimate: torch.Tensor,
    active: torch.Tensor,
    min_impact: float,
    max_active: int,
    quiet_below: float,
    quiet_above: float = math.inf,
    last: torch.Tensor | None = None,
) -> torch.Tensor:
    """The units that measure on the slower rotation (`quiet_factor`): a finite estimate far from the bar to the
    budget (the larger of `min_impact` and the `max_active`-th largest estimate: what a unit must reach to be held,
    as far as the estimates know) on its own side of it: out of recovery under `quiet_below` of the bar (it must
    double its estimate, at the default 0.5, to compete), in recovery over `quiet_above` times it (it must halve its
    estimate, at the default 2, to be released), and with `last` (each unit's last measure itself) only while that is
    over it too: a held unit whose cost has gone (a brief fault's) measures at its usual turns while its running
    estimate comes down. A unit nearer the bar measures at its usual turns: its next measure can change the
    decision. `estimate`, `last`: [N], NaN where unknown; `active`: [N] bool."""
    ranked = estimate.nan_to_num(nan=-math.inf)
    k = min(max_active, estimate.numel())
    # Fewer known estimates than the budget: the k-th is -inf, and the bar is min_impact.
    kth = torch.topk(ranked, k).values[-1] if k > 0 else ranked.new_tensor(-math.inf)
    bar = kth.clamp_min(min_impact)
    over = estimate > quiet_above * bar
    if last is not None:
        over = over & (last > quiet_above * bar)
    far = torch.where(active, over, estimate < quiet_below * bar)
    return estimate.isfinite() & far


POLICIES = (ImpactPolicy,)
