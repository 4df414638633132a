"""The GNMR controller: a state machine over a vector of N per-unit gradient norms.

Every optimizer step the caller hands `observe()` one 1-D tensor of N norms (one per recoverable unit) and gets
back a `Decision`: which units run on the recovery (high-fidelity) path from the next step on. The controller
knows nothing about INT8, bits or transformers. It is pure torch, so it runs on the norms' device, and it is
vectorized: a step is a fixed number of tensor ops whatever N is, with no Python loop over units and no
device-to-host transfer. The one transfer a caller needs to act on a decision is `Decision.to_host()`.

`observe()` is written as the method itself, line by line against docs/method.md (formulas, policy, the
paper-symbol table and every decision the paper leaves open, with its reason and its test). It is plain on
purpose: at the N users have (hundreds of module-level units, up to ~10^5 block-level ones on a GPU) the
straightforward vectorized step is as fast as hand-tuned variants (docs/performance.md has the numbers).
"""

from __future__ import annotations

import dataclasses
import json
import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .cause import REASONS, UnitRelations, cause_step
from .config import GNMRConfig

__all__ = ["Decision", "GNMRController", "HostDecision", "Selection"]

_STATE_VERSION = 3
_TENSOR_STATE = ("norm_sum", "norm_count", "gnmr_window", "locks")
# Kept only with `relapse_lock` (an older state without them loads as "no relapse seen yet").
_RELAPSE_STATE = ("lock_length", "exited_at")
# policy="cause": each unit's last fidelity measure and its step, which stands for a unit in recovery between its
# measures.
_CAUSE_STATE = ("held_fidelity", "held_at")
_NEVER = -(2**62)  # `exited_at` of a unit that never left recovery: no step is within lock_steps of it


@dataclass(frozen=True)
class HostDecision:
    """The part of a `Decision` the host needs, fetched in a single device-to-host transfer."""

    step: int
    active: np.ndarray  # indices of the units in recovery from the next step on
    entered: np.ndarray
    exited: np.ndarray
    risky: np.ndarray
    n_scored: int
    n_candidates: int
    max_risk: float  # the largest risk of a scored unit or broken norm (+inf); NaN when there is none
    top_units: np.ndarray  # indices of the `top_k` riskiest scored units, riskiest first
    top_risks: np.ndarray
    alpha: float
    beta: float
    no_history: np.ndarray | None = None  # units that cannot be scored yet; fetched with to_host(history=True)
    flag: bool | None = None  # the caller's flag, fetched with to_host(flag=...)
    # policy="cause": {"why": [[unit, reason, source unit or -1], ...] for the active units, "severity": [[unit,
    # fidelity], ...] for the `top_k` lossiest measured units, lossiest first}; None under the paper's policy.
    cause: dict[str, list[list[Any]]] | None = None

    @property
    def exceedance_rate(self) -> float:
        """Risky units over scored units; 0 while no unit is scored yet (a broken norm is risky, unscored)."""
        return len(self.risky) / self.n_scored if self.n_scored else 0.0


@dataclass(frozen=True)
class Decision:
    """One step's decision, as tensors on the controller's device (no host sync was needed to make it).

    Masks are bool [N]. `gnmr` and `dgnmr` are float64 [N], NaN where a unit has no such score this step;
    `risk` is max(GNMR/alpha, DGNMR/beta), 0 for unscored units and +inf for broken norms (which are risky
    but have no score). `scored` marks the units with a GNMR score this step; `has_history` those whose history
    allows a score from the next step on (`min_history` valid norms with a positive mean). `active` is the set
    that runs in recovery from step `step + 1` on; `locks` (int32 [N]) is each unit's lock after this step. The
    tensors are never modified afterwards, so a `Decision` stays valid after later steps.
    """

    step: int
    alpha: float
    beta: float
    gnmr: torch.Tensor
    dgnmr: torch.Tensor
    risk: torch.Tensor
    scored: torch.Tensor
    risky: torch.Tensor
    candidates: torch.Tensor
    active: torch.Tensor
    entered: torch.Tensor
    exited: torch.Tensor
    locks: torch.Tensor
    has_history: torch.Tensor
    # policy="cause" only: per-unit fidelity (float64, NaN where unmeasured), reason codes (int8, `cause.REASONS`)
    # and, for a unit blamed for a symptom, the symptomatic unit (int64, else -1).
    severity: torch.Tensor | None = None
    reason: torch.Tensor | None = None
    source: torch.Tensor | None = None

    def to_host(self, top_k: int = 0, history: bool = False, flag: torch.Tensor | None = None) -> HostDecision:
        """Copy what the caller acts on to the host in ONE transfer (one sync per optimizer step).

        Args:
            top_k: also fetch the `top_k` riskiest scored units (largest risk first, ties to the lower index).
            history: also fetch which units cannot be scored yet (`HostDecision.no_history`), e.g. to warn once
                after warm-up about units that never get a gradient.
            flag: a bool scalar tensor of the caller's to bring along in the same transfer (`HostDecision.flag`),
                e.g. whether the fp16 loss scaler skipped this step.
        """
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"Decision.to_host: top_k must be an int >= 0, got {top_k!r}")
        n = self.active.numel()
        k = min(top_k, n)
        # Units with a score or a broken norm (risk +inf) are listed; the others rank below them all (risks are
        # >= 0). A stable sort breaks ties by the lower index.
        key = torch.where(self.scored | self.risk.isinf(), self.risk, -1.0)
        top_idx = top_indices(key, k)
        parts = [
            key.max().reshape(1),
            torch.stack([self.scored.sum(), self.candidates.sum()]).to(torch.float64),
            key[top_idx],
            top_idx.to(torch.float64),  # exact: indices are far below 2^53
            (flag if flag is not None else torch.zeros((), device=key.device)).to(torch.float64).reshape(1),
        ]
        if self.severity is not None:
            # The cause policy's evidence rides in the same transfer: every unit's reason and source (the active
            # ones are read from them) and the k lossiest measured units.
            assert self.reason is not None and self.source is not None
            lossy = torch.where(self.severity.isnan(), -1.0, self.severity.nan_to_num(posinf=1e300))
            lossy_idx = top_indices(lossy, k)
            parts += [
                self.reason.to(torch.float64),
                self.source.to(torch.float64),
                lossy[lossy_idx],
                lossy_idx.to(torch.float64),
            ]
        head = torch.cat(parts)
        rows = [self.active, self.entered, self.exited, self.risky] + ([~self.has_history] if history else [])
        masks = torch.stack(rows)
        # One byte buffer (the float64 head's bytes, then the four masks) so that a single `.cpu()` moves it;
        # separate `.item()` or `.cpu()` calls would each stall the device.
        packed = torch.cat([head.view(torch.uint8), masks.view(-1).view(torch.uint8)]).cpu().numpy()
        head_h = packed[: head.numel() * 8].view(np.float64)
        active, entered, exited, risky, *no_history = (
            np.flatnonzero(m) for m in packed[head.numel() * 8 :].reshape(len(rows), n)
        )
        top_risks = head_h[3 : 3 + k]
        keep = top_risks >= 0  # fewer than k units are scored
        cause = None
        if self.severity is not None:
            at = 4 + 2 * k
            reason, source = head_h[at : at + n], head_h[at + n : at + 2 * n]
            sev, sev_idx = head_h[at + 2 * n : at + 2 * n + k], head_h[at + 2 * n + k : at + 2 * n + 2 * k]
            cause = {
                "why": [[int(i), REASONS[int(reason[i])], int(source[i])] for i in active],
                "severity": [[int(i), float(v)] for i, v in zip(sev_idx, sev, strict=True) if v >= 0],
            }
        return HostDecision(
            step=self.step,
            active=active,
            entered=entered,
            exited=exited,
            risky=risky,
            n_scored=int(head_h[1]),
            n_candidates=int(head_h[2]),
            max_risk=float(head_h[0]) if head_h[0] >= 0 else math.nan,
            top_units=head_h[3 + k : 3 + 2 * k][keep].astype(np.int64),
            top_risks=top_risks[keep],
            alpha=self.alpha,
            beta=self.beta,
            no_history=no_history[0] if history else None,
            flag=bool(head_h[3 + 2 * k]) if flag is not None else None,
            cause=cause,
        )


class Selection(ABC):
    """Chooses the recovery set in place of the paper's policy: the pluggable part of the controller.

    The controller still scores every unit as GNMR does (so a trace has GNMR's risks whatever chose the set) and
    hands `select` the step's `Decision`; the set it returns is the one applied, within no budget but its own.
    Baselines (`gnmr_hf.experiments.baselines`) are selections. A selection keeps no checkpointed state: a run
    with one does not resume.
    """

    name = "selection"

    def bind(self, names: Sequence[str], device: torch.device) -> None:
        """Called once, before the first step, with the units' names (in controller order) and the device."""
        self.names = list(names)
        self.num_units = len(self.names)
        self.device = device

    def initial(self) -> torch.Tensor:
        """The set that runs at step 1 (bool [N]); by default none."""
        return torch.zeros(self.num_units, dtype=torch.bool, device=self.device)

    @abstractmethod
    def select(self, decision: Decision, norms: torch.Tensor, missing: torch.Tensor | None) -> torch.Tensor:
        """The set for step `decision.step + 1` (bool [N] on the controller's device)."""


class GNMRController:
    """Scores N units from their gradient norms and picks which run in recovery, under a hard budget.

    Args:
        config: the policy (`max_active`, `lock_steps`, `window`, `alpha`, `beta`, `min_history`, schedule).
        num_units: N, fixed for the controller's life (a changed N is an error, not a silent reset).
        device: where the state lives; `observe()` takes norms on this device.
        selection: chooses the recovery set instead of the paper's policy (bound to the units by the caller);
            None for the paper's.
        relations: with `policy="cause"`, how the units are related (`UnitRelations.from_names`); default: none.

    State (`state_dict()`): `norm_sum`, `norm_count` (float64: the history of valid norms), `gnmr_window`
    (float64 [window, N]: the GNMR of the last `window` steps, NaN where a step had no score) and `locks`
    (int32); with `relapse_lock` or `policy="cause"` also `lock_length` and `exited_at`. `active` is derived: a unit
    is in recovery exactly while its lock is > 0.
    """

    def __init__(
        self,
        config: GNMRConfig,
        num_units: int,
        device: torch.device | str = "cpu",
        selection: Selection | None = None,
        relations: UnitRelations | None = None,
    ) -> None:
        if not isinstance(config, GNMRConfig):
            raise TypeError(f"GNMRController: config must be a GNMRConfig, got {type(config).__name__}")
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"GNMRController: num_units must be an int >= 1, got {num_units!r}")
        self.config = config
        self.num_units = num_units
        self.device = torch.device(device)
        self.step = 0
        f64 = dict(dtype=torch.float64, device=self.device)
        self.norm_sum = torch.zeros(num_units, **f64)
        # float64 counts are exact up to 2^53 and keep the mean a float64 op.
        self.norm_count = torch.zeros(num_units, **f64)
        self.gnmr_window = torch.full((config.window, num_units), torch.nan, **f64)
        self.locks = torch.zeros(num_units, dtype=torch.int32, device=self.device)
        self.selection = selection
        self.active = self.locks > 0 if selection is None else selection.initial().to(self.device)
        self._before_last: tuple[Any, ...] | None = None  # what `revert()` restores
        self.cause = config.policy == "cause" and selection is None
        if self.cause:
            relations = relations if relations is not None else UnitRelations.independent(num_units)
            if len(relations.families) != num_units:
                raise ValueError(
                    f"GNMRController: relations describe {len(relations.families)} units, expected {num_units}"
                )
            self.relations = relations
            self._relations = relations.device_tensors(self.device)
            self.held_fidelity = torch.full((num_units,), torch.nan, **f64)
            self.held_at = torch.full((num_units,), _NEVER, dtype=torch.int64, device=self.device)
            self._held_before: tuple[torch.Tensor, torch.Tensor] | None = None
        if self._keeps_lock_lengths:
            # Relapse-aware lock (docs/method.md): each unit's current full lock, and the step it last left recovery.
            self.lock_length = torch.full((num_units,), config.lock_steps, dtype=torch.int32, device=self.device)
            self.exited_at = torch.full((num_units,), _NEVER, dtype=torch.int64, device=self.device)
            self._relapse_before: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def _keeps_lock_lengths(self) -> bool:
        return self.config.relapse_lock or self.config.policy == "cause"

    def _check_norms(self, norms: Any, missing: Any) -> None:
        if not isinstance(norms, torch.Tensor):
            raise TypeError(f"GNMRController.observe: norms must be a torch.Tensor, got {type(norms).__name__}")
        if norms.ndim != 1 or norms.shape[0] != self.num_units:
            raise ValueError(
                f"GNMRController.observe: norms must be a 1-D tensor of {self.num_units} per-unit norms "
                f"(the N this controller was built for), got shape {tuple(norms.shape)}"
            )
        if not norms.is_floating_point():
            raise TypeError(f"GNMRController.observe: norms must be a floating-point tensor, got {norms.dtype}")
        if norms.device != self.device:
            raise ValueError(
                f"GNMRController.observe: norms are on {norms.device} but the controller lives on {self.device}"
            )
        if missing is not None:
            if not isinstance(missing, torch.Tensor) or missing.dtype != torch.bool:
                raise TypeError("GNMRController.observe: missing must be a bool tensor or None")
            if missing.shape != norms.shape or missing.device != self.device:
                raise ValueError(
                    f"GNMRController.observe: missing must be a bool tensor of shape ({self.num_units},) on "
                    f"{self.device}, got shape {tuple(missing.shape)} on {missing.device}"
                )

    @torch.no_grad()
    def observe(
        self, norms: torch.Tensor, missing: torch.Tensor | None = None, fidelity: torch.Tensor | None = None
    ) -> Decision:
        """Score one optimizer step's norms and decide the recovery set for the next step.

        Args:
            norms: float tensor [N], the gradient norm of each unit this step (pre-clip, after accumulation).
            missing: optional bool tensor [N], True for units that had no gradient this step.
            fidelity: optional float tensor [N], what each unit's cheap path lost this step in units of its bound
                (NaN where unmeasured; `UnitSignals.fidelity`); read by `policy="cause"` only.
        """
        self._check_norms(norms, missing)
        if fidelity is not None and (fidelity.shape != norms.shape or fidelity.device != self.device):
            raise ValueError(
                f"GNMRController.observe: fidelity must be a tensor of shape ({self.num_units},) on {self.device}, "
                f"got shape {tuple(fidelity.shape)} on {fidelity.device}"
            )
        cfg = self.config
        t = self.step + 1
        alpha, beta = cfg.thresholds(t)
        n = norms.to(torch.float64)
        # A norm is valid when it is one (finite, >= 0: NaN fails both comparisons); a present unit with any other
        # value has a broken signal.
        valid = (n >= 0) & (n < torch.inf)
        broken = ~valid
        if missing is not None:
            valid, broken = valid & ~missing, broken & ~missing
        # GNMR_t = n_t / mean(past valid norms), once there are min_history of them with a positive mean.
        scored = valid & (self.norm_count >= cfg.min_history) & (self.norm_sum > 0)
        gnmr = torch.where(scored, n * self.norm_count / self.norm_sum, torch.nan)
        # DGNMR_t = GNMR_t / mean(GNMR of the previous `window` steps): NaN unless all of them had a score (NaN
        # propagates through the sum) and their mean is positive.
        window_sum = self.gnmr_window.sum(dim=0)
        dgnmr = torch.where(window_sum > 0, gnmr * cfg.window / window_sum, torch.nan)
        # risk = max(GNMR/alpha, DGNMR/beta), each score in units of its threshold; fmax ignores a missing DGNMR.
        risk = torch.fmax(gnmr / alpha, dgnmr / beta)
        risky = (risk > 1.0) | broken
        risk = torch.where(broken, torch.inf, risk.nan_to_num(nan=0.0))

        # History: valid norms only, added after scoring since the mean is over the *past* norms. New tensors
        # (and the one overwritten window row kept), so that `revert()` can put the previous state back.
        pos = (t - 1) % cfg.window
        before = (self.step, self.norm_sum, self.norm_count, self.gnmr_window[pos].clone(), self.locks, self.active)
        self._before_last = before
        self.norm_sum = self.norm_sum + torch.where(valid, n, 0.0)
        self.norm_count = self.norm_count + valid
        self.gnmr_window[pos] = gnmr

        if self.cause:
            return self._observe_cause(t, alpha, beta, gnmr, dgnmr, risk, scored, risky, broken, fidelity)

        # Locks count down; candidates are risky or still locked; the `max_active` riskiest candidates win, ties
        # to the lower index (a stable sort); non-candidates rank below every candidate (risks are >= 0).
        countdown = (self.locks - 1).clamp_min(0)
        candidates = risky | (countdown > 0)
        top = top_indices(torch.where(candidates, risk, -1.0), cfg.max_active)
        selected = torch.zeros_like(candidates).index_fill_(0, top, True) & candidates
        # Selected risky units get a full lock, selected stable ones keep counting down, the rest (released, or
        # preempted when the budget is full) drop to 0 and leave recovery.
        full_lock = self._relapse_lock(t, selected & risky & ~self.active) if cfg.relapse_lock else cfg.lock_steps
        locks = torch.where(selected, torch.where(risky, full_lock, countdown), 0).to(torch.int32)
        if cfg.relapse_lock:
            self.exited_at = torch.where(self.active & ~selected, t, self.exited_at)

        previous = self.active
        self.locks, self.active, self.step = locks, selected, t
        decision = self._decision(alpha, beta, gnmr, dgnmr, risk, scored, risky, candidates, previous)
        if self.selection is None:
            return decision
        # GNMR's scores and risky set stay; the selection's set is the one applied (its own "candidates").
        active = self.selection.select(decision, norms, missing).to(self.device)
        self.active = active
        return dataclasses.replace(
            decision, active=active, entered=active & ~previous, exited=previous & ~active, candidates=active
        )

    def _observe_cause(
        self,
        t: int,
        alpha: float,
        beta: float,
        gnmr: torch.Tensor,
        dgnmr: torch.Tensor,
        risk: torch.Tensor,
        scored: torch.Tensor,
        risky: torch.Tensor,
        broken: torch.Tensor,
        fidelity: torch.Tensor | None,
    ) -> Decision:
        """The rest of `observe` under `policy="cause"` (`gnmr_hf.cause.cause_step`): GNMR's scores are the
        symptoms; the fidelity says where the cause is and how long to hold it."""
        cfg = self.config
        self._relapse_before = (self.lock_length, self.exited_at)
        # A unit in recovery measures only every `cause_recovery_every` steps (`RecoverableUnit.measuring`): between
        # its measures its last one stands, so that it is held, ranked and released on what it measured.
        fresh = torch.full_like(self.held_fidelity, torch.nan) if fidelity is None else fidelity.to(torch.float64)
        measured = ~fresh.isnan()
        # Only a measure from within the unit's measuring period stands: a unit in recovery that stops measuring
        # (no forward: an unused expert) is not held forever on an old loss.
        stands = self.active & ~measured & (t - self.held_at < cfg.recovery_every)
        self._held_before = (self.held_fidelity, self.held_at)
        fidelity = torch.where(stands, self.held_fidelity, fresh)
        self.held_fidelity = torch.where(measured, fresh, self.held_fidelity)
        self.held_at = torch.where(measured, t, self.held_at)
        out = cause_step(
            t=t,
            fidelity=fidelity,
            risky=risky,
            risk=risk,
            broken_norm=broken,
            active=self.active,
            locks=self.locks,
            lock_length=self.lock_length,
            exited_at=self.exited_at,
            relations=self._relations,
            max_active=cfg.max_active,
            lock_steps=cfg.lock_steps,
            lock_cap=cfg.relapse_lock_cap,
            suspect=cfg.cause_suspect,
            peer_factor=cfg.cause_peer_factor,
            top_indices=top_indices,
        )
        previous, selected = self.active, out["active"]
        self.locks, self.active, self.step = out["locks"], selected, t
        self.lock_length, self.exited_at = out["lock_length"], out["exited_at"]
        return self._decision(
            alpha,
            beta,
            gnmr,
            dgnmr,
            risk,
            scored,
            risky,
            selected,
            previous,
            severity=out["severity"],
            reason=out["reason"],
            source=out["source"],
        )

    def _decision(
        self,
        alpha: float,
        beta: float,
        gnmr: torch.Tensor,
        dgnmr: torch.Tensor,
        risk: torch.Tensor,
        scored: torch.Tensor,
        risky: torch.Tensor,
        candidates: torch.Tensor,
        previous: torch.Tensor,
        **cause: torch.Tensor,
    ) -> Decision:
        """The step's `Decision`, once `self.step`, `self.active` and `self.locks` hold the new state."""
        active = self.active
        return Decision(
            step=self.step,
            alpha=alpha,
            beta=beta,
            gnmr=gnmr,
            dgnmr=dgnmr,
            risk=risk,
            scored=scored,
            risky=risky,
            candidates=candidates,
            active=active,
            entered=active & ~previous,
            exited=previous & ~active,
            locks=self.locks,
            has_history=(self.norm_count >= self.config.min_history) & (self.norm_sum > 0),
            **cause,
        )

    def _relapse_lock(self, t: int, entering: torch.Tensor) -> torch.Tensor:
        """The full lock of each unit at step t under the relapse-aware lock: a unit entering recovery within
        `lock_steps` steps of its last exit (a relapse) gets double its previous lock, capped at `relapse_lock_cap`;
        any other entering unit starts again from `lock_steps`; a unit already in recovery keeps its length."""
        cfg = self.config
        self._relapse_before = (self.lock_length, self.exited_at)
        relapse = entering & (t - self.exited_at <= cfg.lock_steps)
        doubled = (self.lock_length * 2).clamp_max(cfg.relapse_lock_cap)
        self.lock_length = torch.where(relapse, doubled, torch.where(entering, cfg.lock_steps, self.lock_length)).to(
            torch.int32
        )
        return self.lock_length

    def revert(self) -> None:
        """Undo the last `observe()`: the state is exactly as before it, as if that step had never been seen.

        For an optimizer step that turns out not to have happened, which the host learns only with the decision's
        transfer: the fp16 loss scaler skips a step with inf/NaN gradients inside `optimizer.step()`. Only the
        last step can be reverted, once.
        """
        if self._before_last is None:
            raise RuntimeError("GNMRController.revert: there is no observed step to revert (only the last one can be)")
        step, norm_sum, norm_count, row, locks, active = self._before_last
        self.gnmr_window[step % self.config.window] = row
        self.step, self.norm_sum, self.norm_count, self.locks, self.active = step, norm_sum, norm_count, locks, active
        self._before_last = None
        if self._keeps_lock_lengths and self._relapse_before is not None:
            self.lock_length, self.exited_at = self._relapse_before
            self._relapse_before = None
        if self.cause and self._held_before is not None:
            (self.held_fidelity, self.held_at), self._held_before = self._held_before, None

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the decision stream exactly (tensors are cloned to CPU)."""
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "num_units": self.num_units,
            "window": self.config.window,
            "step": self.step,
        }
        for name in self._state_names():
            state[name] = getattr(self, name).detach().cpu().clone()
        return state

    def _state_names(self) -> tuple[str, ...]:
        return (
            _TENSOR_STATE + (_RELAPSE_STATE if self._keeps_lock_lengths else ()) + (_CAUSE_STATE if self.cause else ())
        )

    def json_state(self) -> dict[str, Any]:
        """`state_dict()` with plain lists: JSON-safe and exact (float64 round-trips through repr).

        The NaNs of `gnmr_window` (steps without a score) become `null`, since NaN is not JSON.
        """
        state = self.state_dict()
        for name in self._state_names():
            array = state[name].numpy()
            if array.dtype == np.float64:
                boxed = array.astype(object)
                boxed[np.isnan(array)] = None
                state[name] = boxed.tolist()
            else:
                state[name] = array.tolist()
        return state

    def load_state_dict(self, state: dict[str, Any] | str) -> None:
        """Restore from `state_dict()` or `json_state()` (also after a `json.dumps`/`json.loads` round trip)."""
        if isinstance(state, str):
            state = json.loads(state)
        if not isinstance(state, dict):
            raise TypeError(f"GNMRController.load_state_dict: state must be a dict, got {type(state).__name__}")
        version = state.get("version")
        missing = [k for k in ("version", "num_units", "window", "step", *_TENSOR_STATE) if k not in state]
        if missing:
            raise KeyError(f"GNMRController.load_state_dict: state is missing {missing}")
        if version != _STATE_VERSION:
            raise ValueError(
                f"GNMRController.load_state_dict: state version {version!r} is not supported "
                f"(expected {_STATE_VERSION})"
            )
        if state["num_units"] != self.num_units:
            raise ValueError(
                f"GNMRController.load_state_dict: state has num_units={state['num_units']} but this controller "
                f"has {self.num_units}; the model's units changed since the state was saved"
            )
        if state["window"] != self.config.window:
            raise ValueError(
                f"GNMRController.load_state_dict: state has window={state['window']} but the config has "
                f"window={self.config.window}"
            )
        step = state["step"]
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise ValueError(f"GNMRController.load_state_dict: step must be an int >= 0, got {step!r}")
        loaded = {}
        for key in _TENSOR_STATE:
            dtype = getattr(self, key).dtype
            value = state[key]
            if not isinstance(value, torch.Tensor):
                # JSON form: nested lists, with null for NaN (numpy reads None as NaN in a float array).
                try:
                    value = torch.from_numpy(np.array(value, dtype=np.float64 if dtype == torch.float64 else None))
                except (TypeError, ValueError) as err:
                    raise ValueError(f"GNMRController.load_state_dict: {key} is not a numeric array: {err}") from None
            if key == "locks":
                # A state saved with a longer lock_steps is cut to this config's; a negative lock is corrupt.
                value = value.to(torch.int64)
                if (value < 0).any():
                    raise ValueError("GNMRController.load_state_dict: locks must be >= 0")
                value = value.clamp(max=self._longest_lock())
            value = value.to(device=self.device, dtype=dtype)
            expected = getattr(self, key).shape
            if value.shape != expected:
                raise ValueError(
                    f"GNMRController.load_state_dict: {key} has shape {tuple(value.shape)}, expected {tuple(expected)}"
                )
            loaded[key] = value.clone()
        if self._keeps_lock_lengths:
            loaded.update(self._load_relapse_state(state))
        if self.cause:
            loaded.update(self._load_held(state))
        for name, value in loaded.items():
            setattr(self, name, value)
        self.step = step
        self.active = self.locks > 0
        self._before_last = None

    def _longest_lock(self) -> int:
        return self.config.relapse_lock_cap if self._keeps_lock_lengths else self.config.lock_steps

    def _load_held(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The cause policy's last fidelity measures and their steps from `state` (JSON null: NaN), or none held
        when it was saved without them (by another policy, or before they were kept)."""
        if not all(name in state for name in _CAUSE_STATE):
            return {
                "held_fidelity": torch.full_like(self.held_fidelity, torch.nan),
                "held_at": torch.full_like(self.held_at, _NEVER),
            }
        loaded = {}
        for name, dtype in (("held_fidelity", np.float64), ("held_at", np.int64)):
            value = state[name]
            if not isinstance(value, torch.Tensor):
                try:
                    value = torch.from_numpy(np.array(value, dtype=dtype))
                except (TypeError, ValueError) as err:
                    raise ValueError(f"GNMRController.load_state_dict: {name} is not a numeric array: {err}") from None
            if value.shape != (self.num_units,):
                raise ValueError(
                    f"GNMRController.load_state_dict: {name} has shape {tuple(value.shape)}, "
                    f"expected ({self.num_units},)"
                )
            loaded[name] = value.to(device=self.device, dtype=getattr(self, name).dtype).clone()
        return loaded

    def _load_relapse_state(self, state: dict[str, Any]) -> dict[str, torch.Tensor]:
        """The relapse-aware lock's tensors from `state`, or fresh ones when it was saved without the option."""
        if not all(name in state for name in _RELAPSE_STATE):
            return {
                "lock_length": torch.full_like(self.lock_length, self.config.lock_steps),
                "exited_at": torch.full_like(self.exited_at, _NEVER),
            }
        lengths = torch.as_tensor(state["lock_length"], dtype=torch.int64)
        exited = torch.as_tensor(state["exited_at"], dtype=torch.int64)
        for name, value in (("lock_length", lengths), ("exited_at", exited)):
            if value.shape != (self.num_units,):
                raise ValueError(
                    f"GNMRController.load_state_dict: {name} has shape {tuple(value.shape)}, "
                    f"expected ({self.num_units},)"
                )
        lengths = lengths.clamp(self.config.lock_steps, self.config.relapse_lock_cap)
        return {
            "lock_length": lengths.to(device=self.device, dtype=torch.int32),
            "exited_at": exited.to(self.device),
        }


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
