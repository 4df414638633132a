"""The baselines a GNMR claim is measured against, as policies over the very same units and callback.

A baseline differs from GNMR in one thing only: *which* units run on the recovery path at the next step. Everything
else — finding the units, reading the pre-clip per-unit norms once per optimizer step, flipping units, the trace, the
summary, the Trainer logs — is `GNMRCallback`'s, so every arm of a comparison runs the same code path and pays the
same overheads. `PolicyCallback` is a `GNMRCallback` whose controller is a `PolicyController`: a `GNMRController`
that still computes GNMR's scores every step (so every arm's trace has GNMR's risks and exceedance rate, which the
oracle comparison and the results table read) but hands the choice of the recovery set to a `Policy`:

- `StaticPolicy(high=False)` / `StaticPolicy(high=True)`: static low-cost (nothing ever in recovery) and static
  high-fidelity (every unit always in recovery).
- `RandomPolicy`: a random set with GNMR's budget: every `lock_steps` decisions it draws a count whose mean is
  `mean_active` (at most `max_active`) and that many units uniformly at random, held for `lock_steps` steps, as a
  GNMR selection would be.
- `FixedSetPolicy`: a carve-out, the same units on the recovery path for the whole run. `first_last_units` picks the
  first and last layers' units (the usual "keep the ends in high precision" rule) and `best_static_units` the units
  with the largest mean oracle gap over a run (`gnmr_hf.experiments.oracle`): the best static carve-out in hindsight.
- `GlobalZScorePolicy`: a global spike detector as ZClip uses one: an exponential moving mean and variance of the
  total gradient norm (here over the units' signal tensors) and a z-score threshold. It knows *when* something
  spiked, not *where*, so when it fires it recovers the `max_active` units with the largest raw gradient norm, for
  `lock_steps` steps: the same budget as GNMR, localized by the obvious rule that needs no history.

Baselines do not resume from a checkpoint (their policy state is not exported); a comparison runs each arm once.
"""

from __future__ import annotations

import dataclasses
import math
import re
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..callback import GNMRCallback
from ..config import GNMRConfig
from ..controller import Decision, GNMRController
from ..units import RecoverableUnit

__all__ = [
    "FixedSetPolicy",
    "GlobalZScorePolicy",
    "Policy",
    "PolicyCallback",
    "PolicyController",
    "RandomPolicy",
    "StaticPolicy",
    "best_static_units",
    "first_last_units",
]


class Policy(ABC):
    """Chooses the recovery set of the next step from one step's GNMR decision and per-unit norms."""

    name = "policy"

    def bind(self, units: Sequence[RecoverableUnit], device: torch.device) -> None:
        """Called once at train begin with the units (in controller order) and the device of the norms."""
        self.num_units = len(units)
        self.device = device

    def initial(self) -> torch.Tensor:
        """The set that runs at step 1 (bool [N]); by default none."""
        return torch.zeros(self.num_units, dtype=torch.bool, device=self.device)

    @abstractmethod
    def select(self, decision: Decision, norms: torch.Tensor, missing: torch.Tensor | None) -> torch.Tensor:
        """The set for step `decision.step + 1` (bool [N] on the norms' device)."""


class StaticPolicy(Policy):
    """Every unit on the recovery path (`high=True`) or none (`high=False`), at every step."""

    def __init__(self, high: bool) -> None:
        self.high = high
        self.name = "static_high" if high else "static_low"

    def initial(self) -> torch.Tensor:
        return torch.full((self.num_units,), self.high, dtype=torch.bool, device=self.device)

    def select(self, decision: Decision, norms: torch.Tensor, missing: torch.Tensor | None) -> torch.Tensor:
        return self.initial()


class FixedSetPolicy(Policy):
    """The units named `names` on the recovery path for the whole run (a carve-out)."""

    def __init__(self, names: Sequence[str], name: str = "carve_out") -> None:
        self.names = list(names)
        self.name = name

    def bind(self, units: Sequence[RecoverableUnit], device: torch.device) -> None:
        super().bind(units, device)
        index = {u.name: i for i, u in enumerate(units)}
        unknown = [n for n in self.names if n not in index]
        if unknown:
            raise ValueError(f"FixedSetPolicy: names {unknown} are not units; the units are {sorted(index)}")
        self.mask = torch.zeros(self.num_units, dtype=torch.bool, device=device)
        self.mask[[index[n] for n in self.names]] = True

    def initial(self) -> torch.Tensor:
        return self.mask.clone()

    def select(self, decision: Decision, norms: torch.Tensor, missing: torch.Tensor | None) -> torch.Tensor:
        return self.mask.clone()


class RandomPolicy(Policy):
    """Random units with GNMR's budget: every `lock_steps` decisions, c units drawn uniformly, held `lock_steps`
    steps, with c = floor(mean_active) or that + 1 so that its mean is `mean_active`, and c <= max_active."""

    name = "random"

    def __init__(self, mean_active: float, max_active: int, lock_steps: int, seed: int = 0) -> None:
        if not 0 <= mean_active <= max_active:
            raise ValueError(f"RandomPolicy: mean_active must be in 0..max_active={max_active}, got {mean_active}")
        self.mean_active, self.max_active, self.lock_steps = mean_active, max_active, lock_steps
        # Its own generator: the draws must not shift any other random stream of the run.
        self.generator = torch.Generator().manual_seed(seed)
        self.current: torch.Tensor | None = None

    def _draw(self) -> torch.Tensor:
        base = math.floor(self.mean_active)
        extra = int(torch.rand((), generator=self.generator) < self.mean_active - base)
        count = min(base + extra, self.max_active, self.num_units)
        chosen = torch.randperm(self.num_units, generator=self.generator)[:count]
        mask = torch.zeros(self.num_units, dtype=torch.bool)
        mask[chosen] = True
        return mask.to(self.device)

    def initial(self) -> torch.Tensor:
        self.current = self._draw()
        return self.current.clone()

    def select(self, decision: Decision, norms: torch.Tensor, missing: torch.Tensor | None) -> torch.Tensor:
        # Step 1 ran the initial draw; steps lock_steps + 1, 2 * lock_steps + 1, ... start a new one.
        if decision.step % self.lock_steps == 0 or self.current is None:
            self.current = self._draw()
        return self.current.clone()


class GlobalZScorePolicy(Policy):
    """ZClip-style global spike detector at GNMR's budget (see the module docstring).

    The total norm g_t = sqrt(sum of the units' squared norms) is compared with an exponential moving mean m and
    variance v (decay `ema`): z = (g_t - m) / sqrt(v). The first `warmup` steps only initialize m and v (their mean
    and variance). When z > `z_threshold` the `max_active` units with the largest norms get a lock of `lock_steps`,
    and m, v are updated with the clipped value m + z_threshold * sqrt(v) instead of the spike, as ZClip does, so that
    a spike does not raise the bar for the next one. Everything stays on the device: no host sync.
    """

    name = "global_z"

    def __init__(
        self, max_active: int, lock_steps: int, z_threshold: float = 2.5, ema: float = 0.97, warmup: int = 25
    ) -> None:
        self.max_active, self.lock_steps = max_active, lock_steps
        self.z_threshold, self.ema, self.warmup = z_threshold, ema, warmup
        self.history: list[torch.Tensor] = []

    def bind(self, units: Sequence[RecoverableUnit], device: torch.device) -> None:
        super().bind(units, device)
        self.locks = torch.zeros(self.num_units, dtype=torch.int32, device=device)
        self.mean = torch.zeros((), dtype=torch.float64, device=device)
        self.var = torch.zeros((), dtype=torch.float64, device=device)

    def select(self, decision: Decision, norms: torch.Tensor, missing: torch.Tensor | None) -> torch.Tensor:
        n = norms.to(torch.float64)
        if missing is not None:
            n = torch.where(missing, 0.0, n)
        n = torch.nan_to_num(n, nan=math.inf)
        total = n.square().sum().sqrt()
        if decision.step <= self.warmup:
            self.history.append(total)
            if decision.step == self.warmup:
                stacked = torch.stack(self.history)
                self.mean, self.var = stacked.mean(), stacked.var(correction=0)
            self.locks = (self.locks - 1).clamp_min(0)
            return self.locks > 0
        std = self.var.sqrt()
        z = (total - self.mean) / torch.where(std > 0, std, math.inf)
        fired = (z > self.z_threshold) | ~torch.isfinite(total)
        value = torch.where(fired, self.mean + self.z_threshold * std, total)
        delta = value - self.mean
        self.mean = self.mean + (1 - self.ema) * delta
        self.var = self.ema * (self.var + (1 - self.ema) * delta * delta)
        top = torch.zeros(self.num_units, dtype=torch.bool, device=self.device)
        top[torch.argsort(n, descending=True, stable=True)[: self.max_active]] = True
        self.locks = torch.where(fired & top, self.lock_steps, (self.locks - 1).clamp_min(0)).to(torch.int32)
        # A fresh firing replaces the previous selection, so the budget holds.
        self.locks = torch.where(fired & ~top, 0, self.locks).to(torch.int32)
        return self.locks > 0


class PolicyController(GNMRController):
    """A `GNMRController` that keeps scoring every unit as GNMR does but lets `policy` choose the recovery set.

    The returned `Decision` has GNMR's scores, risks and risky set, and the policy's `active`, `entered`, `exited`
    and `candidates` (the policy's set); `self.active` is the policy's set.
    """

    def __init__(self, config: GNMRConfig, num_units: int, policy: Policy, device: torch.device | str = "cpu") -> None:
        super().__init__(config, num_units, device)
        self.policy = policy
        self.active = policy.initial()
        self._policy_before: torch.Tensor | None = None

    @torch.no_grad()
    def observe(self, norms: torch.Tensor, missing: torch.Tensor | None = None) -> Decision:
        previous = self.active
        decision = super().observe(norms, missing)
        active = self.policy.select(decision, norms, missing).to(self.device)
        self._policy_before, self.active = previous, active
        return dataclasses.replace(
            decision, active=active, entered=active & ~previous, exited=previous & ~active, candidates=active
        )

    def revert(self) -> None:
        super().revert()
        if self._policy_before is not None:
            self.active, self._policy_before = self._policy_before, None


class PolicyCallback(GNMRCallback):
    """`GNMRCallback` with a baseline `policy` choosing the recovery set (see the module docstring).

    Args:
        policy: the baseline.
        config: a `GNMRConfig` (backend, its options, include/exclude, and GNMR's thresholds for the scores it
            still records), or a dict of its fields; `**config_kwargs` as for `GNMRCallback`.
    """

    def __init__(self, policy: Policy, config: GNMRConfig | dict[str, Any] | None = None, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not isinstance(policy, Policy):
            raise TypeError(f"PolicyCallback: policy must be a Policy, got {type(policy).__name__}")
        self.policy = policy

    def _start(self, args: Any, state: Any, optimizer: Any) -> None:
        # GNMRCallback.on_train_begin found the units and calls this; overriding on_train_begin itself would hide
        # the Trainer's callback handler from it (it finds the handler as its caller).
        if state.global_step > 0:
            raise ValueError(f"PolicyCallback ({self.policy.name}): baselines do not resume; start the arm anew")
        super()._start(args, state, optimizer)
        assert self.controller is not None
        self.policy.bind(self.units, self.controller.device)
        self.controller = PolicyController(self.config, len(self.units), self.policy, self.controller.device)
        if not self.config.monitor_only:
            for i in self.controller.active.nonzero().flatten().tolist():
                self.units[i].enter_recovery()


_LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def first_last_units(names: Sequence[str], count: int) -> list[str]:
    """`count` unit names from the first and the last layer, alternating (first layer's first unit, last layer's
    first unit, ...), in unit order within a layer. Layers are read from ``layers.<i>.`` in the names."""
    layers: dict[int, list[str]] = {}
    for name in names:
        match = _LAYER.search(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(name)
    if not layers:
        raise ValueError("first_last_units: no unit name has a layer index ('layers.<i>.')")
    first, last = layers[min(layers)], layers[max(layers)]
    order = [n for pair in zip(first, last, strict=False) for n in pair]
    longer = first if len(first) > len(last) else last
    order += longer[min(len(first), len(last)) :]
    if min(layers) == max(layers):
        order = first
    if not 0 <= count <= len(order):
        raise ValueError(f"first_last_units: count must be in 0..{len(order)}, got {count}")
    return order[:count]


def best_static_units(mean_gaps: Mapping[str, float], count: int) -> list[str]:
    """The `count` units with the largest mean oracle gap (ties to the name listed first)."""
    if not 0 <= count <= len(mean_gaps):
        raise ValueError(f"best_static_units: count must be in 0..{len(mean_gaps)}, got {count}")
    ranked = sorted(mean_gaps, key=lambda n: -(mean_gaps[n] if math.isfinite(mean_gaps[n]) else -math.inf))
    return ranked[:count]
