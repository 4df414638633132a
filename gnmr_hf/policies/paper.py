"""The paper's policy (`GNMRConfig(policy="paper")`, the default), exactly as docs/method.md states it.

Every step: locks count down; the candidates are the risky units (GNMR > alpha or DGNMR > beta, or a broken norm)
and those still locked; the `max_active` riskiest candidates run in recovery at the next step (ties to the lower
index); a selected risky unit gets a full lock (`lock_steps`), a selected stable one keeps counting down, and every
other unit (released, or preempted when the budget is full) drops to 0 and leaves. With `relapse_lock` the full lock
of a unit re-entering within `lock_steps` of its exit doubles (`gnmr_hf.policy.RelapseLock`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from .base import Choice, Policy, RelapseLock, Scores, load_tensor, within_budget

__all__ = ["LockedPolicy", "PaperPolicy"]


class LockedPolicy(Policy):
    """A policy whose recovery set is the units with a lock > 0 (the paper's and the cause policy): the locks, and
    with a relapse-aware lock its `RelapseLock`, are its state."""

    relapse: RelapseLock | None = None

    def bind(self, names: Sequence[str], kinds: Sequence[str], device: torch.device) -> None:
        super().bind(names, kinds, device)
        self.locks = torch.zeros(self.num_units, dtype=torch.int32, device=self.device)
        self._before: tuple[torch.Tensor, torch.Tensor] | None = None
        if self.keeps_lock_lengths:
            cfg = self.config
            self.relapse = RelapseLock(self.num_units, cfg.lock_steps, cfg.relapse_lock_cap, self.device)

    @property
    def keeps_lock_lengths(self) -> bool:
        return self.config.relapse_lock

    def _set(self, locks: torch.Tensor, active: torch.Tensor) -> None:
        self._before = (self.locks, self.active)
        self.locks, self.active = locks, active

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"locks": self.locks} | (self.relapse.state_dict() if self.relapse is not None else {})

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        locks = load_tensor(state, "locks", self.locks.to(torch.int64))
        if (locks < 0).any():
            raise ValueError("GNMRController.load_state_dict: locks must be >= 0")
        # A state saved with a longer lock_steps is cut to this config's.
        self.locks = locks.clamp(max=self.longest_lock()).to(torch.int32)
        self.active = self.locks > 0
        self._before = None
        if self.relapse is not None:
            self.relapse.load_state_dict(state, self.num_units)

    def longest_lock(self) -> int:
        return self.config.relapse_lock_cap if self.keeps_lock_lengths else self.config.lock_steps

    def revert(self) -> None:
        if self._before is not None:
            (self.locks, self.active), self._before = self._before, None
        if self.relapse is not None:
            self.relapse.revert()


class PaperPolicy(LockedPolicy):
    """The paper's selection (see the module docstring)."""

    name = "paper"

    def step(self, scores: Scores) -> Choice:
        cfg, t, risky = self.config, scores.t, scores.risky
        countdown = (self.locks - 1).clamp_min(0)
        candidates = risky | (countdown > 0)
        selected = within_budget(candidates, scores.risk, cfg.max_active)
        if self.relapse is not None:
            full_lock = self.relapse.lengths(t, selected & risky & ~self.active)
            self.relapse.exits(t, self.active, selected)
        else:
            full_lock = cfg.lock_steps
        locks = torch.where(selected, torch.where(risky, full_lock, countdown), 0).to(torch.int32)
        self._set(locks, selected)
        return Choice(selected, candidates, locks)


POLICIES = (PaperPolicy,)
