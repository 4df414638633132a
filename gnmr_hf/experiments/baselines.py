"""The baselines a GNMR claim is measured against, as policies over the very same units, callback and trace.

A baseline differs from GNMR in one thing only: *which* units run on the recovery path at the next step. Each is a
`gnmr_hf.Policy`, registered when this module is imported, and chosen like any policy:
`GNMRConfig(policy="random", policy_options={"mean_active": 1.5})`; GNMR's scores are still computed and traced
every step. Static low/high, a set of units by name (a carve-out), by regex, the first/last layers, a random set at
GNMR's budget, and a ZClip-style global z-score detector. They keep no checkpointed state, so a run with one does
not resume (the callback refuses); a comparison runs each arm once. Static high and the carve-outs (by name, regex or
first/last layers) hold their set whatever `max_active` is (`capped = False`); the random set and the z-score
detector stay within it, as GNMR does.
"""

from __future__ import annotations

import math
import re
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch

from ..policy import Choice, Policy, PolicyOptions, Scores, register_policy

__all__ = [
    "BASELINES",
    "FirstLastPolicy",
    "FixedSetPolicy",
    "GlobalZScorePolicy",
    "NamedSetPolicy",
    "RandomPolicy",
    "StaticHighPolicy",
    "StaticLowPolicy",
    "best_static_units",
    "first_last_units",
]


class _Baseline(Policy):
    """A baseline: no state worth a checkpoint, and the set it returns is its own candidates."""

    resumes = False

    def step(self, scores: Scores) -> Choice:
        self.active = self.choose(scores)
        return Choice(self.active, self.active)

    @abstractmethod
    def choose(self, scores: Scores) -> torch.Tensor:
        """The set for step `scores.t + 1` (bool [N] on the device)."""


class StaticLowPolicy(_Baseline):
    """No unit on the recovery path, at any step: every unit on the cheap path."""

    name = "static_low"
    high = False

    def initial(self) -> torch.Tensor:
        return torch.full((self.num_units,), self.high, dtype=torch.bool, device=self.device)

    def choose(self, scores: Scores) -> torch.Tensor:
        return self.initial()


class StaticHighPolicy(StaticLowPolicy):
    """Every unit on the recovery path, at every step."""

    name = "static_high"
    high = True
    capped = False


@dataclass
class FixedSetOptions(PolicyOptions):
    units: list[str] = field(default_factory=list, metadata={"help": "The unit names kept on the recovery path."})


class FixedSetPolicy(_Baseline):
    """The units named by the `units` option on the recovery path for the whole run (a carve-out)."""

    name = "carve_out"
    options = FixedSetOptions
    capped = False  # a carve-out holds what it names, at the average budget of the arm it is compared with

    def pick(self, names: Sequence[str]) -> list[str]:
        """The unit names to keep on the recovery path, from all of them."""
        return list(self.opts.units)

    def bind(self, names: Sequence[str], kinds: Sequence[str], device: torch.device) -> None:
        index = {n: i for i, n in enumerate(names)}
        chosen = self.pick(names)
        unknown = [n for n in chosen if n not in index]
        if unknown:
            raise ValueError(f"{type(self).__name__}: names {unknown} are not units; the units are {sorted(index)}")
        self.mask = torch.zeros(len(names), dtype=torch.bool, device=device)
        self.mask[[index[n] for n in chosen]] = True
        super().bind(names, kinds, device)

    def initial(self) -> torch.Tensor:
        return self.mask.clone()

    def choose(self, scores: Scores) -> torch.Tensor:
        return self.mask.clone()


@dataclass
class NamedSetOptions(PolicyOptions):
    patterns: list[str] = field(default_factory=list, metadata={"help": "Regexes, searched in the unit names."})


class NamedSetPolicy(FixedSetPolicy):
    """The units whose names match one of the `patterns` option's regexes, for the whole run."""

    name = "carve_named"
    options = NamedSetOptions

    def pick(self, names: Sequence[str]) -> list[str]:
        patterns = [re.compile(p) for p in self.opts.patterns]
        chosen = [n for n in names if any(p.search(n) for p in patterns)]
        if not chosen:
            raise ValueError(f"carve_named: no unit name matches {[p.pattern for p in patterns]}")
        return chosen


@dataclass
class FirstLastOptions(PolicyOptions):
    count: int = field(default=1, metadata={"help": "Units in the carve-out (>= 0)."})

    def __post_init__(self) -> None:
        self.check_int("count", 0)


class FirstLastPolicy(FixedSetPolicy):
    """The first/last-layers carve-out of `count` units (`first_last_units`), chosen when the units are known."""

    name = "carve_first_last"
    options = FirstLastOptions

    def pick(self, names: Sequence[str]) -> list[str]:
        return first_last_units(names, min(self.opts.count, len(names)))


@dataclass
class RandomOptions(PolicyOptions):
    mean_active: float = field(default=0.0, metadata={"help": "The average number of units in recovery."})
    seed: int = field(default=0, metadata={"help": "Seed of the policy's own generator."})

    def __post_init__(self) -> None:
        self.check_int("seed", 0)


class RandomPolicy(_Baseline):
    """Random units with GNMR's budget: every `lock_steps` decisions, c units drawn uniformly, held `lock_steps`
    steps, with c = floor(mean_active) or that + 1 so that its mean is `mean_active`, and c <= max_active."""

    name = "random"
    options = RandomOptions

    def bind(self, names: Sequence[str], kinds: Sequence[str], device: torch.device) -> None:
        self.mean_active, self.max_active = float(self.opts.mean_active), self.config.max_active
        self.lock_steps = self.config.lock_steps
        if not 0 <= self.mean_active <= self.max_active:
            raise ValueError(
                f"RandomPolicy: mean_active must be in 0..max_active={self.max_active}, got {self.mean_active}"
            )
        # Its own generator: the draws must not shift any other random stream of the run.
        self.generator = torch.Generator().manual_seed(self.opts.seed)
        self.current: torch.Tensor | None = None
        super().bind(names, kinds, device)

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

    def choose(self, scores: Scores) -> torch.Tensor:
        # Step 1 ran the initial draw; steps lock_steps + 1, 2 * lock_steps + 1, ... start a new one.
        if scores.t % self.lock_steps == 0 or self.current is None:
            self.current = self._draw()
        return self.current.clone()


@dataclass
class GlobalZOptions(PolicyOptions):
    z_threshold: float = field(default=2.5, metadata={"help": "z above which the detector fires."})
    ema: float = field(default=0.97, metadata={"help": "Decay of the moving mean and variance."})
    warmup: int = field(default=25, metadata={"help": "Steps that only initialize the mean and variance (>= 1)."})

    def __post_init__(self) -> None:
        self.check_int("warmup", 1)


class GlobalZScorePolicy(_Baseline):
    """ZClip-style global spike detector at GNMR's budget.

    The total norm g_t = sqrt(sum of the units' squared norms) is compared with an exponential moving mean m and
    variance v (decay `ema`): z = (g_t - m) / sqrt(v). The first `warmup` steps only initialize m and v (their mean
    and variance). When z > `z_threshold` the `max_active` units with the largest norms get a lock of `lock_steps`,
    and m, v are updated with the clipped value m + z_threshold * sqrt(v) instead of the spike, as ZClip does, so that
    a spike does not raise the bar for the next one. Everything stays on the device: no host sync.
    """

    name = "global_z"
    options = GlobalZOptions

    def bind(self, names: Sequence[str], kinds: Sequence[str], device: torch.device) -> None:
        super().bind(names, kinds, device)
        self.max_active, self.lock_steps = self.config.max_active, self.config.lock_steps
        self.z_threshold, self.ema, self.warmup = self.opts.z_threshold, self.opts.ema, self.opts.warmup
        self.history: list[torch.Tensor] = []
        self.locks = torch.zeros(self.num_units, dtype=torch.int32, device=device)
        self.mean = torch.zeros((), dtype=torch.float64, device=device)
        self.var = torch.zeros((), dtype=torch.float64, device=device)

    def choose(self, scores: Scores) -> torch.Tensor:
        n = scores.norms
        if scores.missing is not None:
            n = torch.where(scores.missing, 0.0, n)
        n = torch.nan_to_num(n, nan=math.inf)
        total = n.square().sum().sqrt()
        if scores.t <= self.warmup:
            self.history.append(total)
            if scores.t == self.warmup:
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


BASELINES = (
    StaticLowPolicy,
    StaticHighPolicy,
    FixedSetPolicy,
    NamedSetPolicy,
    FirstLastPolicy,
    RandomPolicy,
    GlobalZScorePolicy,
)
for _policy in BASELINES:
    register_policy(_policy)


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
