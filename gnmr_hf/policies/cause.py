"""The cause policy (`GNMRConfig(policy="cause")`): spend the budget where the cheap path loses, not where it shows.

Beside the paper's per-unit gradient scores the controller gets each unit's *cheap loss* (what its cheap path loses
this step, in units of its backend's bound; `gnmr_hf.fidelity`) and the units' relations (`UnitRelations`: families
of units that share a gradient path, peers that are the same unit in other layers). `CausePolicy` then recovers:

- a unit whose loss is past its bound, or far past its peers' (all units' for a unit without peers): broken,
  with or without a symptom (a unit broken from the start never deviates from its own past, so the paper's scores
  never see it);
- for a gradient-side symptom (GNMR or DGNMR over its threshold), the unit of the symptom's family whose cheap path
  loses the most, if it loses enough to be suspect; a symptom with no suspect in its family is noise and spends
  nothing; a unit that measures nothing (a backend without a fidelity measure) falls back to the paper's rule;

and holds a recovered unit while its loss (measured on its cheap path's rounding even in recovery) stays suspect,
releasing it `lock_length` healthy steps after; a unit that relapses within `lock_steps` of leaving gets twice its
last lock (up to `relapse_lock_cap`). Every decision and why: docs/method.md, "The cause policy". Pure torch, no host
sync, a fixed number of ops per step.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .base import (
    FIDELITY_ROWS,
    NEVER,
    Choice,
    PolicyOptions,
    Scores,
    half_lock,
    load_tensor,
    top_indices,
    within_budget,
)
from .paper import LockedPolicy

if TYPE_CHECKING:
    from ..config import GNMRConfig

__all__ = ["REASONS", "CauseOptions", "CausePolicy", "UnitRelations"]

# Why a unit is in the recovery set (`Choice.extras["reason"]`), by code.
REASONS = ("", "broken", "peer", "cause", "symptom", "held", "countdown")
_BROKEN, _PEER, _CAUSE, _SYMPTOM, _HELD, _COUNTDOWN = range(1, 7)
# An active unit's ranking key is multiplied by this: a newcomer must lose clearly more to take its place, so units of
# similar loss do not swap places every step.
_INCUMBENT = 1.25
_MIN_PEERS = 3
_LAYER_INDEX = re.compile(r"(?<=\.)\d+(?=\.|$)")


@dataclass(frozen=True)
class UnitRelations:
    """How the units are related, as ids per unit (controller order).

    `families`: units of one family share a gradient path: a unit that holds other units (an attention or MLP
    unit) is a family with them, and the other units are a family with their siblings under one parent module. A
    layer's q/k/v/o projections and its attention unit are one family, its gate/up/down projections (with its MLP
    unit, when there is one) another, its norms a third.
    `peers`: units of one peer group are the same unit in other layers (name with the layer index removed, and the
    same kind), compared with each other when the group has at least 3 members; a unit in no such group is compared
    with all measured units (`CausePolicy.step`).
    """

    families: tuple[int, ...]
    peers: tuple[int, ...]
    family_names: tuple[str, ...]
    peer_names: tuple[str, ...]

    @classmethod
    def from_names(cls, names: Sequence[str], kinds: Sequence[str] | None = None) -> UnitRelations:
        kinds = list(kinds) if kinds is not None else [""] * len(names)
        units = set(names)
        family_of, peer_of = [], []
        holders = {n.rsplit(".", 1)[0] for n in names if "." in n} & units
        for name, kind in zip(names, kinds, strict=True):
            parts = name.split(".")
            outer = next((".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in units), None)
            if outer is None:
                outer = name if name in holders else (name.rsplit(".", 1)[0] if "." in name else "")
            family_of.append(outer)
            peer_of.append(f"{_LAYER_INDEX.sub('*', name)}|{kind}")
        (families, family_names), (peers, peer_names) = _ids(family_of), _ids(peer_of)
        return cls(families, peers, family_names, peer_names)

    @classmethod
    def independent(cls, num_units: int) -> UnitRelations:
        """No relations known: every unit its own family, all units one peer group."""
        return cls(tuple(range(num_units)), (0,) * num_units, tuple(map(str, range(num_units))), ("",))

    def device_tensors(self, device: torch.device) -> dict[str, Any]:
        """The relations as device tensors: family ids; a [G, M] index matrix of the peer groups with at least
        `_MIN_PEERS` members (-1 padding) and each unit's row in it (-1: no such group); whether any group exists,
        and whether any unit is in none."""
        groups: dict[int, list[int]] = {}
        for i, g in enumerate(self.peers):
            groups.setdefault(g, []).append(i)
        big = [members for members in groups.values() if len(members) >= _MIN_PEERS]
        width = max((len(m) for m in big), default=1)
        index = torch.full((max(len(big), 1), width), -1, dtype=torch.long)
        row_of = torch.full((len(self.peers),), -1, dtype=torch.long)
        for row, members in enumerate(big):
            index[row, : len(members)] = torch.tensor(members)
            row_of[members] = row
        return {
            "families": torch.tensor(self.families, dtype=torch.long, device=device),
            "num_families": len(self.family_names),
            "peer_index": index.to(device),
            "peer_row": row_of.to(device),
            "has_peers": bool(big),
            "has_peerless": bool((row_of < 0).any()),
        }


def _ids(labels: list[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    order: dict[str, int] = {}
    ids = tuple(order.setdefault(label, len(order)) for label in labels)
    return ids, tuple(order)


def _per_family(values: torch.Tensor, families: torch.Tensor, count: int, reduce: str, fill: float) -> torch.Tensor:
    """[F] reduction of `values` over each family (`amax` / `amin`), `fill` for an empty one."""
    out = torch.full((count,), fill, dtype=values.dtype, device=values.device)
    return out.scatter_reduce(0, families, values, reduce=reduce, include_self=True)


@dataclass
class CauseOptions(PolicyOptions):
    """Options of `policy="cause"` (`GNMRConfig.policy_options`; until this release `GNMRConfig`'s `cause_*` fields,
    which still work, with a DeprecationWarning)."""

    suspect: float = field(
        default=0.5,
        metadata={
            "help": "A unit's loss (1 = the backend's bound) above which it can be blamed for a symptom in its family "
            "and is held in recovery; above 1 it is recovered without a symptom. In (0, 1]."
        },
    )
    peer_factor: float = field(
        default=4.0,
        metadata={
            "help": "A unit whose loss is this many times the median of its peers (the same unit in other layers; all "
            "units for a unit without peers) and above suspect is broken. > 1."
        },
    )
    fidelity_rows: int = field(
        default=FIDELITY_ROWS,
        metadata={
            "help": "Rows of each tensor a fidelity measure reads, spread over the tensor and moving each step (0: "
            "every row). Bounds what measuring costs, whatever the batch (docs/method.md). >= 0."
        },
    )
    recovery_every: int | None = field(
        default=None,
        metadata={
            "help": "A unit in recovery measures what its cheap path would lose every this many optimizer steps (its "
            "last measure stands between); units on the cheap path measure every step (a block_fp weight, which only "
            "the optimizer moves, on these steps only). In 1..lock_steps, so that a unit still lossy is renewed "
            "before its lock runs out; None (default): half of lock_steps, rounded up (docs/method.md)."
        },
    )

    def __post_init__(self) -> None:
        for name, low, high in (("suspect", 0.0, 1.0), ("peer_factor", 1.0, math.inf)):
            value = getattr(self, name)
            allowed = f"in ({low:g}, {high:g}]" if high < math.inf else f"a finite number > {low:g}"
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"option {name!r} must be {allowed}, got {value!r}")
            if not (low < value <= high) or math.isinf(value):
                raise ValueError(f"option {name!r} must be {allowed}, got {value}")
        self.check_int("fidelity_rows", 0)
        if self.recovery_every is not None:
            self.check_int("recovery_every", 1)


class CausePolicy(LockedPolicy):
    """The cause policy (see the module docstring). Its options are `CauseOptions` (and the config's
    `relapse_lock_cap`); its state, beyond the locks: the relapse lock (always on) and each unit's last measured loss
    and its step (`held_cheap_loss`, `held_at`), which stands for a unit in recovery between its measures.
    `recovery_every` is the option resolved: a unit in recovery measures on one optimizer step in this many."""

    name = "cause"
    options = CauseOptions
    opts: CauseOptions
    measures = True

    def __init__(self, config: GNMRConfig, options: CauseOptions | None = None) -> None:
        super().__init__(config, options)
        every = self.opts.recovery_every
        if every is not None and every > config.lock_steps:
            raise ValueError(
                "GNMRConfig.policy_options: cause option 'recovery_every' must be in "
                f"1..lock_steps={config.lock_steps} (a unit still lossy must be measured again before its lock runs "
                f"out), got {every}"
            )
        self.recovery_every = every if every is not None else half_lock(config.lock_steps)

    @property
    def keeps_lock_lengths(self) -> bool:
        return True

    def fidelity_schedule(self) -> tuple[int, int]:
        return self.opts.fidelity_rows, self.recovery_every

    def bind(self, names: Sequence[str], kinds: Sequence[str], device: torch.device) -> None:
        super().bind(names, kinds, device)
        self.relations = UnitRelations.from_names(names, kinds)
        self._relations = self.relations.device_tensors(self.device)
        self.held_cheap_loss = torch.full((self.num_units,), torch.nan, dtype=torch.float64, device=self.device)
        self.held_at = torch.full((self.num_units,), NEVER, dtype=torch.int64, device=self.device)
        self._held_before: tuple[torch.Tensor, torch.Tensor] | None = None

    def describe(self) -> dict[str, Any]:
        return {"families": [self.relations.family_names[f] for f in self.relations.families]}

    def _held(self, t: int, cheap_loss: torch.Tensor | None) -> torch.Tensor:
        """This step's loss per unit (float64, NaN where unmeasured), with a unit in recovery's last measure standing
        for it between its measures; updates the held measures."""
        # A unit in recovery measures only every `recovery_every` steps (`FidelityMeter.due`): between its measures
        # its last one stands, so that it is held, ranked and released on what it measured.
        fresh = (
            torch.full_like(self.held_cheap_loss, torch.nan) if cheap_loss is None else cheap_loss.to(torch.float64)
        )
        measured = ~fresh.isnan()
        # Only a measure from within the unit's measuring period stands: a unit in recovery that stops measuring
        # (no forward: an unused expert) is not held forever on an old loss.
        stands = self.active & ~measured & (t - self.held_at < self.recovery_every)
        self._held_before = (self.held_cheap_loss, self.held_at)
        held = torch.where(stands, self.held_cheap_loss, fresh)
        self.held_cheap_loss = torch.where(measured, fresh, self.held_cheap_loss)
        self.held_at = torch.where(measured, t, self.held_at)
        return held

    def step(self, scores: Scores) -> Choice:
        """One step: the new recovery set and locks, and per unit `cheap_loss` (the loss used, NaN where
        unmeasured), `reason` (int8 codes of `REASONS`) and `source` (for a cause: the riskiest symptomatic unit of
        its family, else -1)."""
        cfg, opts, t, relations = self.config, self.opts, scores.t, self._relations
        risky, risk, broken_norm, active = scores.risky, scores.risk, scores.broken, self.active
        loss = self._held(t, scores.cheap_loss)
        n = risky.numel()
        device = risky.device
        index = torch.arange(n, device=device)
        measured = ~loss.isnan()
        s = loss.nan_to_num(nan=0.0, posinf=1e300)
        suspect = opts.suspect

        # Peers: far past the median of the same unit in other layers (and suspect: a tiny loss several times another
        # tiny loss is no problem). A unit without peers (the output head; every unit of a model with fewer than
        # _MIN_PEERS layers) is compared with the median of all measured units: the losses are on one scale (units of
        # their bounds), and without a reference a unit lossy from the start but under its bound would never be seen.
        # (The median of all units is a sort of N: taken only where some unit needs it.)
        population = (
            loss.nanmedian()
            if relations["has_peerless"]
            else torch.full((), torch.nan, dtype=loss.dtype, device=device)
        )
        if relations["has_peers"]:
            grid, row = relations["peer_index"], relations["peer_row"]
            medians = torch.where(grid >= 0, loss[grid.clamp_min(0)], torch.nan).nanmedian(dim=1).values
            median = torch.where(row >= 0, medians[row.clamp_min(0)], population)
        else:
            median = population.expand(n)
        peer_bad = measured & (s > suspect) & (s > opts.peer_factor * median.nan_to_num(nan=torch.inf))
        absolute = measured & (s > 1.0)
        broken = absolute | peer_bad
        unhealthy = broken | (measured & (s > suspect))

        # Attribution: in a family with a symptom, the unit whose cheap path loses most (lowest index on a tie) is the
        # cause, if it is suspect. A unit that cannot measure keeps the paper's rule when its family has no suspect.
        families, count = relations["families"], relations["num_families"]
        fam_max = _per_family(torch.where(measured, s, -1.0), families, count, "amax", -1.0)
        is_max = measured & (s == fam_max[families])
        first = _per_family(torch.where(is_max, index, n), families, count, "amin", n)
        fam_symptom = _per_family(torch.where(risky, risk, -1.0), families, count, "amax", -1.0)
        symptom_in_family = fam_symptom[families] >= 0
        cause = is_max & (index == first[families]) & symptom_in_family & (s > suspect)
        fallback = risky & ~measured & ~(fam_max[families] > suspect)
        source_first = _per_family(
            torch.where(risky & (risk == fam_symptom[families]), index, n), families, count, "amin", n
        )
        source = torch.where(cause, source_first[families], -1)

        # Locks: an active unit that is still unhealthy (or, unmeasured, still risky) gets its full lock again; the
        # others count down. A unit entering within lock_steps of its last exit (a relapse) gets twice its last lock.
        assert self.relapse is not None
        countdown = (self.locks - 1).clamp_min(0)
        entering = (broken | cause | fallback | broken_norm) & ~active
        lock_length = self.relapse.lengths(t, entering)
        renew = entering | (active & (unhealthy | (~measured & risky) | broken_norm))
        candidates = broken | cause | fallback | broken_norm | (active & (renew | (countdown > 0)))
        key = torch.where(measured, s, risk).nan_to_num(nan=0.0, posinf=1e300)
        key = torch.where(broken_norm, 1e300, key) * torch.where(active, _INCUMBENT, 1.0)
        selected = within_budget(candidates, key, cfg.max_active)
        new_locks = torch.where(selected, torch.where(renew, lock_length, countdown), 0).to(torch.int32)
        self.relapse.exits(t, active, selected)

        reason = torch.zeros(n, dtype=torch.int8, device=device)
        for code, mask in (
            (_COUNTDOWN, selected),
            (_HELD, selected & active & renew),
            (_SYMPTOM, selected & (fallback | broken_norm)),
            (_CAUSE, selected & cause),
            (_PEER, selected & peer_bad),
            (_BROKEN, selected & absolute),
        ):
            reason = torch.where(mask, code, reason).to(torch.int8)
        self._set(new_locks, selected)
        return Choice(selected, candidates, new_locks, {"cheap_loss": loss, "reason": reason, "source": source})

    def state_dict(self) -> dict[str, torch.Tensor]:
        return super().state_dict() | {"held_cheap_loss": self.held_cheap_loss, "held_at": self.held_at}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        super().load_state_dict(state)
        self.held_cheap_loss, self.held_at = self._load_held(state)
        self._held_before = None

    def _load_held(self, state: Mapping[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
        """The last measured losses and their steps from `state` (JSON null: NaN), or none held when it was saved
        without them (by another policy). A state saved before the loss was named `cheap_loss` holds them as
        `held_fidelity`."""
        name = "held_cheap_loss" if "held_cheap_loss" in state else "held_fidelity"
        if not all(key in state for key in (name, "held_at")):
            return torch.full_like(self.held_cheap_loss, torch.nan), torch.full_like(self.held_at, NEVER)
        return load_tensor(state, name, self.held_cheap_loss), load_tensor(state, "held_at", self.held_at)

    def revert(self) -> None:
        super().revert()
        if self._held_before is not None:
            (self.held_cheap_loss, self.held_at), self._held_before = self._held_before, None

    def host_parts(self, choice: Choice, k: int) -> list[torch.Tensor]:
        # Every unit's reason and source (the active ones are read from them) and the k lossiest measured units.
        loss = choice.extras["cheap_loss"]
        lossy = torch.where(loss.isnan(), -1.0, loss.nan_to_num(posinf=1e300))
        lossy_idx = top_indices(lossy, k)
        return [
            choice.extras["reason"].to(torch.float64),
            choice.extras["source"].to(torch.float64),
            lossy[lossy_idx],
            lossy_idx.to(torch.float64),
        ]

    def host_extras(self, parts: np.ndarray, active: np.ndarray, k: int) -> dict[str, Any]:
        """{"cause": {"why": [[unit, reason, source unit or -1], ...] for the active units, "cheap_loss": [[unit,
        loss], ...] for the `k` lossiest measured units, lossiest first}}."""
        n = self.num_units
        reason, source = parts[:n], parts[n : 2 * n]
        loss, loss_idx = parts[2 * n : 2 * n + k], parts[2 * n + k : 2 * n + 2 * k]
        return {
            "cause": {
                "why": [[int(i), REASONS[int(reason[i])], int(source[i])] for i in active],
                "cheap_loss": [[int(i), float(v)] for i, v in zip(loss_idx, loss, strict=True) if v >= 0],
            }
        }


POLICIES = (CausePolicy,)
