"""The policy seam: what chooses the recovery set from one step's scores, and what every policy shares. Import it
from `gnmr_hf.policy` (or `gnmr_hf`), which adds the registry; it lives here, below the built-in policies, so that
they build on it without importing the registry that lists them.

The controller (`gnmr_hf.controller`) keeps the history and turns each step's gradient norms into `Scores` (GNMR,
DGNMR, risk, who is risky, and what each unit's cheap path lost where units measure it: `cheap_loss`). A `Policy`
turns those into a `Choice`: the units that run on the recovery path from the next step on. The paper's policy
(`gnmr_hf.policies.paper`) and the cause policy (`gnmr_hf.policies.cause`) are policies; a new one is one subclass
and one `register_policy` call, and `GNMRConfig(policy=name, policy_options=...)` chooses it, as
`GNMRConfig(backend=...)` chooses a backend.

Every policy under a budget spends it through `within_budget` (the `max_active` highest keys among the candidates,
ties to the lower index) and a policy with a relapse-aware lock keeps it in a `RelapseLock`: one implementation each.
A policy's state is a flat dict of tensors that the controller saves beside its own, so a checkpoint is one
dict whatever the policy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from ..deprecated import warn_renamed
from ..options import BackendOptions

if TYPE_CHECKING:
    from ..config import GNMRConfig

__all__ = [
    "FIDELITY_ROWS",
    "NEVER",
    "Choice",
    "Policy",
    "PolicyOptions",
    "RelapseLock",
    "Scores",
    "half_lock",
    "load_tensor",
    "top_indices",
    "within_budget",
]

# `exited_at` of a unit that never left recovery (and `held_at` of one never measured): no step is near it.
NEVER = -(2**62)
# Rows of each tensor a fidelity measure reads unless the policy says otherwise (`Policy.fidelity_schedule`; the cause
# policy's `fidelity_rows`): a fixed sample, so that measuring costs the same whatever the batch (docs/method.md, "A
# sample of rows").
FIDELITY_ROWS = 256


@dataclass(frozen=True)
class Scores:
    """One optimizer step's scores, what every policy reads: tensors [N] on the controller's device.

    `t` is the step (1-based); `alpha`, `beta` its thresholds. `norms` (float64) are the observed norms and `missing`
    (bool or None) the units without a gradient. `gnmr`, `dgnmr` (float64, NaN where unscored), `risk` =
    max(GNMR/alpha, DGNMR/beta) (0 unscored, +inf for a broken norm), `scored`, `risky` (risk > 1 or a broken
    norm) and `broken` (a present unit whose norm is NaN, inf or negative). `cheap_loss`: what each unit's cheap
    path lost this step in units of its bound (NaN where unmeasured), or None when no unit measures. `impact`: what
    each unit's cheap path cost the loss this step, in nats per token (`gnmr_hf.impact`; NaN where unmeasured), or
    None when no unit measures it.
    """

    t: int
    alpha: float
    beta: float
    norms: torch.Tensor
    missing: torch.Tensor | None
    gnmr: torch.Tensor
    dgnmr: torch.Tensor
    risk: torch.Tensor
    scored: torch.Tensor
    risky: torch.Tensor
    broken: torch.Tensor
    cheap_loss: torch.Tensor | None = None
    impact: torch.Tensor | None = None

    @property
    def fidelity(self) -> torch.Tensor | None:
        warn_renamed("Scores.fidelity", "Scores.cheap_loss")
        return self.cheap_loss


@dataclass(frozen=True)
class Choice:
    """What a policy decided at one step: `active` (bool [N]) runs on the recovery path from the next step on;
    `candidates` (bool [N]) are the units that asked for it (more than `active` when the budget binds); `locks`
    (int32 [N]) each unit's lock after this step, or None for a policy without locks; `extras`, per-unit tensors
    the policy reports (the cause policy's reasons, sources and losses), fetched for the host by
    `Policy.host_parts` / `Policy.host_extras`."""

    active: torch.Tensor
    candidates: torch.Tensor
    locks: torch.Tensor | None = None
    extras: Mapping[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class PolicyOptions(BackendOptions):
    """Base class of a policy's own options (`GNMRConfig.policy_options`): read and checked as a backend's are."""


class Policy(ABC):
    """Chooses the recovery set from the step's `Scores`. Subclass it, set `name` (and `options`, a
    `PolicyOptions` dataclass, if it takes any), implement `bind` and `step`, and `register_policy` it.

    The controller calls `bind` once with the units' names and kinds, then `step` once per optimizer step;
    `active` is the current recovery set. A policy that keeps state across steps returns it from `state_dict`
    (flat tensors, named uniquely: they share the checkpoint with the controller's), restores it in
    `load_state_dict`, and undoes its last step in `revert` (the fp16 loss scaler skipped that step).

    Class attributes: `measures` (the units measure what their cheap path loses for it: the callback starts their
    meters, as `fidelity_schedule` says), `resumes` (False: a run with it does not resume from a checkpoint; the
    callback refuses), `capped` (True: `Choice.active` never holds more than `max_active` units, and a step whose set
    does is an error naming the policy, raised where the decision reaches the host (`Decision.to_host`), before any
    unit flips; False: the set is the policy's own by design, as a static carve-out's or every unit's).
    """

    name: ClassVar[str] = ""
    options: ClassVar[type[PolicyOptions]] = PolicyOptions
    measures: ClassVar[bool] = False
    resumes: ClassVar[bool] = True
    capped: ClassVar[bool] = True

    def __init__(self, config: GNMRConfig, options: PolicyOptions | None = None) -> None:
        self.config = config
        self.opts = options if options is not None else type(self).options()

    def bind(self, names: Sequence[str], kinds: Sequence[str], device: torch.device) -> None:
        """Called once before the first step: the units (controller order) and where the tensors live. Sets
        `num_units`, `device` and the recovery set of step 1 (`initial`)."""
        self.names, self.kinds = list(names), list(kinds)
        self.num_units, self.device = len(self.names), torch.device(device)
        self.active = self.initial()

    def initial(self) -> torch.Tensor:
        """The recovery set of step 1 (bool [N]); by default none."""
        return torch.zeros(self.num_units, dtype=torch.bool, device=self.device)

    @abstractmethod
    def step(self, scores: Scores) -> Choice:
        """Decide from `scores` (step `scores.t`) and update `active` and any state."""

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The policy's state (flat tensors); by default none."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from `state` (the controller's whole state dict, checked, tensors or JSON lists); by default
        there is nothing to restore."""
        return None

    def revert(self) -> None:
        """Undo the last `step` (only the last one, once)."""
        raise RuntimeError(f"policy {self.name!r} cannot revert a step")

    def describe(self) -> dict[str, Any]:
        """JSON-safe facts for the trace header (e.g. the cause policy's families); by default none."""
        return {}

    def fidelity_schedule(self) -> tuple[int, int]:
        """(rows, recovery_every) for the units' fidelity meters when the policy `measures`: a measure reads `rows`
        rows of each tensor (0: every row), and a unit in recovery measures on one optimizer step in
        `recovery_every`. By default `FIDELITY_ROWS` and half of `lock_steps`, rounded up (the cause policy's
        defaults; it reads its options)."""
        return FIDELITY_ROWS, half_lock(self.config.lock_steps)

    def impact_schedule(self) -> tuple[int, int] | None:
        """(rows, every) when the policy reads each unit's impact (`Scores.impact`): the units' impact meters
        measure `rows` rows of their output on one optimizer step in `every`, taking turns (`gnmr_hf.impact`);
        None (the default): nothing is measured."""
        return None

    def impact_quiet(self) -> tuple[int, np.ndarray] | None:
        """(quiet_every, mask) when some units measure their impact on a slower rotation (`gnmr_hf.impact.QuietTurns`):
        while `mask[i]` (a host bool array of N, which the policy updates in place from `host_extras`, and after
        `load_state_dict`) unit i measures on one step in `quiet_every`, a multiple of `impact_schedule`'s `every`;
        None (the default): every unit keeps `every`. Read after `bind`."""
        return None

    def host_parts(self, choice: Choice, k: int) -> list[torch.Tensor]:
        """Float64 1-D tensors of what the host needs of `choice.extras`, moved in the decision's one transfer."""
        return []

    def host_extras(self, parts: np.ndarray, active: np.ndarray, k: int) -> dict[str, Any]:
        """The trace's extra fields (JSON-safe) from the host copy of `host_parts`, concatenated."""
        return {}


def half_lock(lock_steps: int) -> int:
    """Half of `lock_steps`, rounded up: how often a unit in recovery measures by default, so that a unit still lossy
    is measured again, and renewed, before its lock runs out."""
    return -(-lock_steps // 2)


def load_tensor(state: Mapping[str, Any], name: str, like: torch.Tensor) -> torch.Tensor:
    """`state[name]` (a tensor, or nested JSON lists with null for NaN) as a copy with `like`'s dtype, device and
    shape; errors name the entry. For `GNMRController.load_state_dict` and the policies' own parts of it."""
    if name not in state:
        raise KeyError(f"GNMRController.load_state_dict: state is missing {[name]}")
    value = state[name]
    if not isinstance(value, torch.Tensor):
        try:
            value = torch.from_numpy(np.array(value, dtype=np.float64 if like.dtype == torch.float64 else None))
        except (TypeError, ValueError) as err:
            raise ValueError(f"GNMRController.load_state_dict: {name} is not a numeric array: {err}") from None
    if value.shape != like.shape:
        raise ValueError(
            f"GNMRController.load_state_dict: {name} has shape {tuple(value.shape)}, expected {tuple(like.shape)}"
        )
    return value.to(device=like.device, dtype=like.dtype).clone()


def within_budget(candidates: torch.Tensor, key: torch.Tensor, max_active: int) -> torch.Tensor:
    """The budget, spent: the `max_active` candidates with the largest `key` (>= 0; ties to the lower index),
    as a bool mask. A non-candidate ranks below every candidate and is never chosen."""
    top = top_indices(torch.where(candidates, key, -1.0), max_active)
    return torch.zeros_like(candidates).index_fill_(0, top, True) & candidates


class RelapseLock:
    """The relapse-aware lock: each unit's current full lock (`lock_length`) and the step it last left recovery
    (`exited_at`). A unit entering recovery within `lock_steps` of its last exit (a relapse) gets twice its last
    lock, up to `cap`; any other entering unit starts again from `lock_steps`."""

    def __init__(self, num_units: int, lock_steps: int, cap: int, device: torch.device) -> None:
        self.lock_steps, self.cap = lock_steps, cap
        self.lock_length = torch.full((num_units,), lock_steps, dtype=torch.int32, device=device)
        self.exited_at = torch.full((num_units,), NEVER, dtype=torch.int64, device=device)
        self._before: tuple[torch.Tensor, torch.Tensor] | None = None

    def lengths(self, t: int, entering: torch.Tensor) -> torch.Tensor:
        """The full lock of each unit at step `t`, the units in `entering` entering recovery now."""
        self._before = (self.lock_length, self.exited_at)
        relapse = entering & (t - self.exited_at <= self.lock_steps)
        doubled = (self.lock_length * 2).clamp_max(self.cap)
        self.lock_length = torch.where(relapse, doubled, torch.where(entering, self.lock_steps, self.lock_length)).to(
            torch.int32
        )
        return self.lock_length

    def exits(self, t: int, before: torch.Tensor, after: torch.Tensor) -> None:
        """Record step `t` as the exit of the units in recovery `before` and not `after`."""
        self.exited_at = torch.where(before & ~after, t, self.exited_at)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"lock_length": self.lock_length, "exited_at": self.exited_at}

    def load_state_dict(self, state: Mapping[str, Any], num_units: int) -> None:
        """From `state`, or none seen yet when it was saved without them (the paper's fixed lock)."""
        if not all(name in state for name in ("lock_length", "exited_at")):
            self.lock_length = torch.full_like(self.lock_length, self.lock_steps)
            self.exited_at = torch.full_like(self.exited_at, NEVER)
            return
        lengths = torch.as_tensor(state["lock_length"], dtype=torch.int64)
        exited = torch.as_tensor(state["exited_at"], dtype=torch.int64)
        for name, value in (("lock_length", lengths), ("exited_at", exited)):
            if value.shape != (num_units,):
                raise ValueError(
                    f"GNMRController.load_state_dict: {name} has shape {tuple(value.shape)}, expected ({num_units},)"
                )
        device = self.lock_length.device
        self.lock_length = lengths.clamp(self.lock_steps, self.cap).to(device=device, dtype=torch.int32)
        self.exited_at = exited.to(device)
        self._before = None

    def revert(self) -> None:
        if self._before is not None:
            (self.lock_length, self.exited_at), self._before = self._before, None


# Above this many units, `top_indices` finds the k largest with `torch.topk` and a tie fix-up instead of a stable
# sort of all N: 5x faster at N = 10^4 and 10x at 10^5 on the 2-core CPU of docs/performance.md, but 2x slower at
# N <= 1,000 (more small ops), where the sort stays.
_SORT_UP_TO = 4096


def top_indices(key: torch.Tensor, k: int) -> torch.Tensor:
    """The indices of the `k` largest entries of the 1-D `key` (no NaN), largest first, ties to the lower index:
    exactly `torch.argsort(key, descending=True, stable=True)[:k]`, and like it without a host sync."""
    n = key.numel()
    k = min(k, n)
    if n <= _SORT_UP_TO or k == 0:
        return torch.argsort(key, descending=True, stable=True)[:k]
    # Every entry above the k-th largest value is in; of those equal to it, the lowest-index ones fill the rest.
    kth = torch.topk(key, k, sorted=False).values.min()
    above = key > kth
    tied = key == kth
    chosen = above | (tied & (tied.cumsum(0) <= k - above.sum()))
    # The k chosen indices in ascending order: each goes to its place among the chosen (a running count), the
    # others to a spare slot k that is dropped. Then largest key first by a stable sort of those k, which keeps
    # the lower index first among equal keys.
    place = torch.where(chosen, chosen.cumsum(0) - 1, k)
    chosen_idx = torch.empty(k + 1, dtype=torch.int64, device=key.device)
    chosen_idx.scatter_(0, place, torch.arange(n, device=key.device))
    chosen_idx = chosen_idx[:k]
    return chosen_idx[torch.argsort(key[chosen_idx], descending=True, stable=True)]
