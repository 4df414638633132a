"""The arms of a comparison, as a table: each arm's name and how its callbacks are built.

Every arm but the reference runs `GNMRCallback`'s code path over the same units and differs only in what chooses
the recovery set: the paper's policy (`gnmr`), its relapse-aware lock (`gnmr_relapse`), the cause policy
(`gnmr_cause`), the impact policy (`gnmr_impact`, with `--impact_options`), or a baseline of
`gnmr_hf.experiments.baselines` with the same budget (`static_low`, `static_high`, `random`, `carve_first_last`,
`carve_best`, `carve_named`, `global_z`). The stabilizers users reach for first (`zclip`, `spam`, `stable_spam`,
`adagc`, `skip_step`, and `gnmr_cause_zclip`: `gnmr_hf.experiments.stabilizers`) keep every unit on the cheap path
(the cause policy's choice for `gnmr_cause_zclip`); `run_arm` adds the stabilizer itself. A new arm is one entry in
`_BUILDERS`; `ARMS` is its keys, in the order the table and the default arm list show them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from transformers import TrainerCallback

from ...callback import GNMRCallback
from ...config import GNMRConfig

# Importing the baselines registers the policies the baseline arms name (`_with_policy`).
from .. import baselines  # noqa: F401
from ..stabilizers import STABILIZER_ARMS

__all__ = ["ARMS", "BUDGET_ARMS", "ArmInputs", "arm_callbacks"]


@dataclass(frozen=True)
class ArmInputs:
    """What an arm's callbacks may be built from, beside the run's `GNMRConfig`: the seed; the budget (the average
    number of units GNMR recovered) of "random" and "carve_first_last"; the units "carve_best" keeps on the recovery
    path; the regexes "carve_named" searches in the unit names; the impact policy's options of "gnmr_impact"."""

    seed: int
    budget: float | None = None
    carve_units: Sequence[str] | None = None
    carve_patterns: Sequence[str] | None = None
    impact_options: str | None = None

    def need_budget(self, arm: str) -> float:
        if self.budget is None:
            raise ValueError(f"arm_callbacks: {arm} needs budget, the average number of units GNMR recovered")
        return self.budget


# How an arm's callbacks are built from the run's config and the `ArmInputs`.
ArmBuilder = Callable[[GNMRConfig, ArmInputs], list[TrainerCallback]]


def _with_policy(config: GNMRConfig, policy: str, **options: Any) -> GNMRCallback:
    """A callback over `config`'s units with the baseline `policy` (`gnmr_hf.experiments.baselines`)."""
    return GNMRCallback(dataclasses.replace(config, policy=policy, policy_options=options))


def _baseline(policy: str) -> ArmBuilder:
    """An arm that runs the baseline `policy` with no options."""
    return lambda config, given: [_with_policy(config, policy)]


def _gnmr(**changes: Any) -> ArmBuilder:
    """An arm that runs GNMR with `changes` to the run's config."""
    return lambda config, given: [GNMRCallback(dataclasses.replace(config, **changes))]


def _gnmr_impact(config: GNMRConfig, given: ArmInputs) -> list[TrainerCallback]:
    return [GNMRCallback(dataclasses.replace(config, policy="impact", policy_options=given.impact_options or None))]


def _random(config: GNMRConfig, given: ArmInputs) -> list[TrainerCallback]:
    return [_with_policy(config, "random", mean_active=given.need_budget("random"), seed=given.seed)]


def _carve_first_last(config: GNMRConfig, given: ArmInputs) -> list[TrainerCallback]:
    # A carve-out holds whole units: GNMR's average budget, rounded, and at least one.
    count = max(1, round(given.need_budget("carve_first_last")))
    return [_with_policy(config, "carve_first_last", count=count)]


def _carve_best(config: GNMRConfig, given: ArmInputs) -> list[TrainerCallback]:
    if not given.carve_units:
        raise ValueError("arm_callbacks: carve_best needs carve_units (the units with the largest oracle gaps)")
    return [_with_policy(config, "carve_out", units=list(given.carve_units))]


def _carve_named(config: GNMRConfig, given: ArmInputs) -> list[TrainerCallback]:
    if not given.carve_patterns:
        raise ValueError("arm_callbacks: carve_named needs carve_patterns (PretrainArguments.carve_named)")
    return [_with_policy(config, "carve_named", patterns=list(given.carve_patterns))]


def _stabilizer(arm: str) -> ArmBuilder:
    """A stabilizer arm's units: every unit on the cheap path, or the cause policy's choice for gnmr_cause_zclip
    (`run_arm` adds the stabilizer itself)."""
    return _gnmr(policy="cause") if arm == "gnmr_cause_zclip" else _baseline("static_low")


# Arm name -> how its callbacks are built; the order is the one tables and the default arm list show.
_BUILDERS: dict[str, ArmBuilder] = {
    "reference": lambda config, given: [],  # no units at all: the plain fp32 model
    "static_high": _baseline("static_high"),
    "static_low": _baseline("static_low"),
    "gnmr": lambda config, given: [GNMRCallback(config)],
    "gnmr_relapse": _gnmr(relapse_lock=True),
    "gnmr_cause": _gnmr(policy="cause"),
    "gnmr_impact": _gnmr_impact,
    "random": _random,
    "carve_first_last": _carve_first_last,
    "carve_best": _carve_best,
    "carve_named": _carve_named,
    "global_z": _baseline("global_z"),
    **{arm: _stabilizer(arm) for arm in STABILIZER_ARMS},
}

ARMS = tuple(_BUILDERS)
# Arms whose budget (average number of recovered units) is GNMR's, read from the gnmr run of the same seed.
BUDGET_ARMS = ("random", "carve_first_last", "carve_best")


def arm_callbacks(
    arm: str,
    config: GNMRConfig,
    seed: int,
    *,
    budget: float | None = None,
    carve_units: Sequence[str] | None = None,
    carve_patterns: Sequence[str] | None = None,
    impact_options: str | None = None,
) -> list[TrainerCallback]:
    """The callbacks of one arm over `config`'s units (see `ARMS`); [] for the reference.

    `budget` (average number of recovered units) is needed by "random" and "carve_first_last" (rounded to the
    nearest count, at least 1); "carve_best" needs `carve_units`, the names to keep on the recovery path, and
    "carve_named" `carve_patterns`, regexes searched in the unit names.
    """
    if arm not in _BUILDERS:
        raise ValueError(f"arm_callbacks: arm must be one of {list(ARMS)}, got {arm!r}")
    given = ArmInputs(seed, budget, carve_units, carve_patterns, impact_options)
    return _BUILDERS[arm](config, given)
