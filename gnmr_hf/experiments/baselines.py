"""The baselines a GNMR claim is measured against, as `Selection`s over the very same units, callback and trace.

A baseline differs from GNMR in one thing only: *which* units run on the recovery path at the next step
(`GNMRCallback(config, selection=...)`); GNMR's scores are still computed and traced every step. Static low/high,
a random set at GNMR's budget, fixed carve-outs (named, first/last layers, best in hindsight from the oracle) and
a ZClip-style global z-score detector. They do not resume from a checkpoint; a comparison runs each arm once.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence

import torch

from ..controller import Decision, Selection

__all__ = [
    "FirstLastPolicy",
    "FixedSetPolicy",
    "GlobalZScorePolicy",
    "NamedSetPolicy",
    "RandomPolicy",
    "StaticPolicy",
    "best_static_units",
    "first_last_units",
]


class StaticPolicy(Selection):
    """Every unit on the recovery path (`high=True`) or none (`high=False`), at every step."""

    def __init__(self, high: bool) -> None:
        self.high = high
        self.name = "static_high" if high else "static_low"

    def initial(self) -> torch.Tensor:
        return torch.full((self.num_units,), self.high, dtype=torch.bool, device=self.device)

    def select(self, decision: Decision, norms: torch.Tensor, missing: torch.Tensor | None) -> torch.Tensor:
        return self.initial()


class FixedSetPolicy(Selection):
    """The units named `names` on the recovery path for the whole run (a carve-out)."""

    def __init__(self, names: Sequence[str], name: str = "carve_out") -> None:
        self.fixed = list(names)
        self.name = name

    def choose(self, names: Sequence[str]) -> list[str]:
        """The unit names to keep on the recovery path, from all of them."""
        return self.fixed

    def bind(self, names: Sequence[str], device: torch.device) -> None:
        super().bind(names, device)
        index = {n: i for i, n in enumerate(names)}
        chosen = self.choose(names)
        unknown = [n for n in chosen if n not in index]
        if unknown:
            raise ValueError(f"{type(self).__name__}: names {unknown} are not units; the units are {sorted(index)}")
        self.mask = torch.zeros(self.num_units, dtype=torch.bool, device=device)
        self.mask[[index[n] for n in chosen]] = True

    def initial(self) -> torch.Tensor:
        return self.mask.clone()

    def select(self, decision: Decision, norms: torch.Tensor, missing: torch.Tensor | None) -> torch.Tensor:
        return self.mask.clone()


class NamedSetPolicy(FixedSetPolicy):
    """The units whose names match one of `patterns` (regexes, searched), for the whole run."""

    def __init__(self, patterns: Sequence[str]) -> None:
        super().__init__([], name="carve_named")
        self.patterns = [re.compile(p) for p in patterns]

    def choose(self, names: Sequence[str]) -> list[str]:
        chosen = [n for n in names if any(p.search(n) for p in self.patterns)]
        if not chosen:
            raise ValueError(f"carve_named: no unit name matches {[p.pattern for p in self.patterns]}")
        return chosen


class FirstLastPolicy(FixedSetPolicy):
    """The first/last-layers carve-out of `count` units, chosen when the units are known."""

    def __init__(self, count: int) -> None:
        super().__init__([], name="carve_first_last")
        self.count = count

    def choose(self, names: Sequence[str]) -> list[str]:
        return first_last_units(names, min(self.count, len(names)))


class RandomPolicy(Selection):
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


class GlobalZScorePolicy(Selection):
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

    def bind(self, names: Sequence[str], device: torch.device) -> None:
        super().bind(names, device)
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


_LAYER = re.compile(r"(?:^|\.)layers?\.(\d+)\.")


def first_last_units(names: Sequence[str], count: int) -> list[str]:
    """`count` unit names from the end layers inward: the first and the last layer, alternating (first layer's first
    unit, last layer's first unit, ...) in unit order within a layer, then the second and the second-to-last layer the
    same way, and so on. A budget larger than the two end layers (NVIDIA's NVFP4 recipe keeps ~15% of a real model's
    linears high, 4-5 of SmolLM2's 30 layers) widens the carve-out from both ends, the way such recipes widen it.
    Layers are read from ``layers.<i>.`` in the names."""
    layers: dict[int, list[str]] = {}
    for name in names:
        match = _LAYER.search(name)
        if match:
            layers.setdefault(int(match.group(1)), []).append(name)
    if not layers:
        raise ValueError("first_last_units: no unit name has a layer index ('layers.<i>.')")
    ids = sorted(layers)
    order: list[str] = []
    for i in range((len(ids) + 1) // 2):
        first, last = layers[ids[i]], layers[ids[-1 - i]]
        if first is last:  # the middle layer of an odd count
            order += first
            continue
        order += [n for pair in zip(first, last, strict=False) for n in pair]
        longer = first if len(first) > len(last) else last
        order += longer[min(len(first), len(last)) :]
    if not 0 <= count <= len(order):
        raise ValueError(f"first_last_units: count must be in 0..{len(order)}, got {count}")
    return order[:count]


def best_static_units(mean_gaps: Mapping[str, float], count: int) -> list[str]:
    """The `count` units with the largest mean oracle gap (ties to the name listed first)."""
    if not 0 <= count <= len(mean_gaps):
        raise ValueError(f"best_static_units: count must be in 0..{len(mean_gaps)}, got {count}")
    ranked = sorted(mean_gaps, key=lambda n: -(mean_gaps[n] if math.isfinite(mean_gaps[n]) else -math.inf))
    return ranked[:count]
