"""A policy of your own, in one file: each step, the `max_active` riskiest risky units, and no lock (a unit leaves
recovery the step it is no longer risky). Register it, then use it by name, with any backend:

    import no_lock_policy  # runs register_policy(NoLockPolicy)
    trainer.add_callback(GNMRCallback(GNMRConfig(policy="no_lock", policy_options="min_risk=2")))

A policy reads the step's `Scores` (GNMR, DGNMR, risk, who is risky; what each unit's cheap path lost where the
units measure it) and returns a `Choice`; `within_budget` spends the budget as the built-in policies do (the
highest keys first, ties to the lower index), so `max_active` holds. Run this file to see it decide on a stream
with one spike:

    python examples/no_lock_policy.py
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from gnmr_hf import Choice, GNMRConfig, GNMRController, Policy, PolicyOptions, Scores, register_policy
from gnmr_hf.policy import within_budget


@dataclass
class NoLockOptions(PolicyOptions):
    min_risk: float = field(default=1.0, metadata={"help": "Risk a unit needs to be recovered (1: the thresholds)."})

    def __post_init__(self) -> None:
        if not self.min_risk >= 1.0:
            raise ValueError(f"option 'min_risk' must be a number >= 1, got {self.min_risk!r}")


@register_policy
class NoLockPolicy(Policy):
    """Recover the riskiest units whose risk is at least `min_risk`, for one step at a time."""

    name = "no_lock"
    options = NoLockOptions

    def step(self, scores: Scores) -> Choice:
        candidates = scores.risky & (scores.risk >= self.opts.min_risk)
        self.active = within_budget(candidates, scores.risk, self.config.max_active)
        return Choice(self.active, candidates)


def main() -> None:
    config = GNMRConfig(policy="no_lock", policy_options="min_risk=2", max_active=1, min_history=2, window=2)
    controller = GNMRController(config, num_units=3)
    for step in range(1, 9):
        norms = torch.ones(3, dtype=torch.float64)
        norms[1] = 20.0 if step == 5 else 1.0  # unit 1 spikes at step 5
        decision = controller.observe(norms)
        print(f"step {step}: risky {decision.risky.nonzero().flatten().tolist()}, in recovery from step {step + 1}: "
              f"{decision.active.nonzero().flatten().tolist()}")  # fmt: skip


if __name__ == "__main__":
    main()
