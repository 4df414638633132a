"""The GNMR controller: a state machine over a vector of N per-unit gradient norms.

Every optimizer step the caller hands `observe()` one 1-D tensor of N norms (one per recoverable unit) and gets
back a `Decision`: which units run on the recovery (high-fidelity) path from the next step on. The controller
knows nothing about INT8, bits or transformers. It is pure torch, so it runs on the norms' device, and it is
vectorized: a step is a fixed number of tensor ops whatever N is, with no Python loop over units and no
device-to-host transfer. The one transfer a caller needs to act on a decision is `Decision.to_host()`.

`observe()` is written as the method itself, line by line against docs/method.md (formulas, the paper-symbol table
and every decision the paper leaves open, with its reason and its test): it scores the units and hands the `Scores`
to its policy (`gnmr_hf.policy`: the paper's by default, `GNMRConfig.policy`), which chooses the recovery set. The
controller keeps the history, the step and the state; it names no policy. It is plain on purpose: at the N users
have (hundreds of module-level units, up to ~10^5 block-level ones on a GPU) the straightforward vectorized step is
as fast as hand-tuned variants (docs/performance.md has the numbers).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from .config import GNMRConfig
from .deprecated import warn_renamed
from .policy import Choice, Policy, Scores, load_tensor, make_policy, top_indices

__all__ = ["Decision", "GNMRController", "HostDecision"]

# The state's format: the controller's history (below) and its policy's own tensors, side by side in one flat dict.
_STATE_VERSION = 3
_HISTORY = ("norm_sum", "norm_count", "gnmr_window")


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
    # What the policy reports beyond the recovery set, JSON-safe, written into the trace line as it is (the cause
    # policy: {"cause": {"why": ..., "cheap_loss": ...}}, `gnmr_hf.policies.cause.CausePolicy.host_extras`).
    extras: dict[str, Any] = field(default_factory=dict)
    # Candidates not in `active`: units that asked for recovery and that the budget (`max_active`) left out.
    left_out: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))

    @property
    def exceedance_rate(self) -> float:
        """Risky units over scored units; 0 while no unit is scored yet (a broken norm is risky, unscored)."""
        return len(self.risky) / self.n_scored if self.n_scored else 0.0


@dataclass(frozen=True)
class Decision:
    """One step's decision, as tensors on the controller's device (no host sync was needed to make it).

    `scores` are the step's `Scores` (also read as `gnmr`, `dgnmr`, `risk`, `scored`, `risky`, `alpha`, `beta`:
    float64 [N] scores, NaN where a unit has no such score; risk 0 for unscored units and +inf for broken norms).
    Masks are bool [N]: `candidates` asked for recovery, `active` runs in recovery from step `step + 1` on,
    `entered`/`exited` changed; `locks` (int32 [N]) each unit's lock after this step (0 for a policy without
    locks); `has_history` the units whose history allows a score from the next step on (`min_history` valid norms
    with a positive mean); `extras` what the policy reports per unit (the cause policy: `cheap_loss`, `reason`,
    `source`). The tensors are never modified afterwards, so a `Decision` stays valid after later steps.
    """

    scores: Scores
    candidates: torch.Tensor
    active: torch.Tensor
    entered: torch.Tensor
    exited: torch.Tensor
    locks: torch.Tensor
    has_history: torch.Tensor
    policy: Policy = field(repr=False, compare=False)
    choice: Choice = field(repr=False, compare=False)

    step = property(lambda self: self.scores.t)
    alpha = property(lambda self: self.scores.alpha)
    beta = property(lambda self: self.scores.beta)
    gnmr = property(lambda self: self.scores.gnmr)
    dgnmr = property(lambda self: self.scores.dgnmr)
    risk = property(lambda self: self.scores.risk)
    scored = property(lambda self: self.scores.scored)
    risky = property(lambda self: self.scores.risky)

    @property
    def extras(self) -> dict[str, torch.Tensor]:
        return dict(self.choice.extras)

    def to_host(self, top_k: int = 0, history: bool = False, flag: torch.Tensor | None = None) -> HostDecision:
        """Copy what the caller acts on to the host in ONE transfer (one sync per optimizer step).

        Args:
            top_k: also fetch the `top_k` riskiest scored units (largest risk first, ties to the lower index), and
                as many of what the policy ranks (the cause policy: its lossiest units).
            history: also fetch which units cannot be scored yet (`HostDecision.no_history`), e.g. to warn once
                after warm-up about units that never get a gradient.
            flag: a bool scalar tensor of the caller's to bring along in the same transfer (`HostDecision.flag`),
                e.g. whether the fp16 loss scaler skipped this step.

        Raises:
            RuntimeError: the policy is `capped` and put more than `max_active` units in recovery.
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
        # What the policy reports rides in the same transfer.
        extra = self.policy.host_parts(self.choice, k)
        head = torch.cat(parts + extra)
        left_out = self.candidates & ~self.active
        rows = [self.active, self.entered, self.exited, self.risky, left_out] + (
            [~self.has_history] if history else []
        )
        masks = torch.stack(rows)
        # One byte buffer (the float64 head's bytes, then the masks) so that a single `.cpu()` moves it; separate
        # `.item()` or `.cpu()` calls would each stall the device.
        packed = torch.cat([head.view(torch.uint8), masks.view(-1).view(torch.uint8)]).cpu().numpy()
        head_h = packed[: head.numel() * 8].view(np.float64)
        active, entered, exited, risky, left_out, *no_history = (
            np.flatnonzero(m) for m in packed[head.numel() * 8 :].reshape(len(rows), n)
        )
        policy = self.policy
        if policy.capped and len(active) > policy.config.max_active:
            # The hard cap holds whatever the policy: checked on the host copy this transfer brings anyway (no sync
            # of its own), before the caller flips any unit.
            raise RuntimeError(
                f"policy {policy.name!r} put {len(active)} units in recovery at step {self.step}, more than "
                f"max_active={policy.config.max_active}: a policy's Choice.active must stay within max_active (spend "
                "it with gnmr_hf.policy.within_budget), or the policy must declare capped = False"
            )
        top_risks = head_h[3 : 3 + k]
        keep = top_risks >= 0  # fewer than k units are scored
        return HostDecision(
            step=self.step,
            active=active,
            entered=entered,
            exited=exited,
            risky=risky,
            left_out=left_out,
            n_scored=int(head_h[1]),
            n_candidates=int(head_h[2]),
            max_risk=float(head_h[0]) if head_h[0] >= 0 else math.nan,
            top_units=head_h[3 + k : 3 + 2 * k][keep].astype(np.int64),
            top_risks=top_risks[keep],
            alpha=self.alpha,
            beta=self.beta,
            no_history=no_history[0] if history else None,
            flag=bool(head_h[3 + 2 * k]) if flag is not None else None,
            extras=self.policy.host_extras(head_h[4 + 2 * k :], active, k) if extra else {},
        )


class GNMRController:
    """Scores N units from their gradient norms and has its policy pick which run in recovery, under a hard budget.

    Args:
        config: the scores' settings (`window`, `alpha`, `beta`, `min_history`, schedule) and the policy's
            (`policy`, `policy_options`, `max_active`, `lock_steps`, ...).
        num_units: N, fixed for the controller's life (a changed N is an error, not a silent reset).
        device: where the state lives; `observe()` takes norms on this device.
        policy: the `Policy` that chooses the recovery set; default: `config.policy` with `config.policy_options`.
        names, kinds: the units' names and kinds in controller order, for a policy that relates units (the cause
            policy's families and peers); default: unrelated units "0", "1", ...

    State (`state_dict()`): `norm_sum`, `norm_count` (float64: the history of valid norms), `gnmr_window`
    (float64 [window, N]: the GNMR of the last `window` steps, NaN where a step had no score), and the policy's own
    (the paper's: `locks`, int32, and with `relapse_lock` also `lock_length` and `exited_at`; the cause policy's
    also `held_cheap_loss` and `held_at`). `active` is the policy's: for the paper's a unit is in recovery exactly
    while its lock is > 0.
    """

    def __init__(
        self,
        config: GNMRConfig,
        num_units: int,
        device: torch.device | str = "cpu",
        policy: Policy | None = None,
        names: Sequence[str] | None = None,
        kinds: Sequence[str] | None = None,
    ) -> None:
        if not isinstance(config, GNMRConfig):
            raise TypeError(f"GNMRController: config must be a GNMRConfig, got {type(config).__name__}")
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"GNMRController: num_units must be an int >= 1, got {num_units!r}")
        if policy is not None and not isinstance(policy, Policy):
            raise TypeError(f"GNMRController: policy must be a gnmr_hf.Policy, got {type(policy).__name__}")
        names = [str(i) for i in range(num_units)] if names is None else list(names)
        kinds = [""] * num_units if kinds is None else list(kinds)
        if len(names) != num_units or len(kinds) != num_units:
            raise ValueError(
                f"GNMRController: names and kinds describe {len(names)} and {len(kinds)} units, expected {num_units}"
            )
        self.config = config
        self.num_units = num_units
        self.device = torch.device(device)
        self.step = 0
        f64 = dict(dtype=torch.float64, device=self.device)
        self.norm_sum = torch.zeros(num_units, **f64)
        # float64 counts are exact up to 2^53 and keep the mean a float64 op.
        self.norm_count = torch.zeros(num_units, **f64)
        self.gnmr_window = torch.full((config.window, num_units), torch.nan, **f64)
        self.policy = policy if policy is not None else make_policy(config)
        self.policy.bind(names, kinds, self.device)
        self._before_last: tuple[Any, ...] | None = None  # what `revert()` restores

    @property
    def active(self) -> torch.Tensor:
        """The units in recovery now (bool [N]): the policy's."""
        return self.policy.active

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
        self,
        norms: torch.Tensor,
        missing: torch.Tensor | None = None,
        cheap_loss: torch.Tensor | None = None,
        impact: torch.Tensor | None = None,
        *,
        fidelity: torch.Tensor | None = None,
    ) -> Decision:
        """Score one optimizer step's norms and decide the recovery set for the next step.

        Args:
            norms: float tensor [N], the gradient norm of each unit this step (pre-clip, after accumulation).
            missing: optional bool tensor [N], True for units that had no gradient this step.
            cheap_loss: optional float tensor [N], what each unit's cheap path lost this step in units of its bound
                (NaN where unmeasured; `UnitSignals.cheap_loss`); read by `policy="cause"` only.
            impact: optional float tensor [N], what each unit's cheap path cost the loss this step, in nats per token
                (NaN where unmeasured; `UnitSignals.gather_impact`); read by `policy="impact"` only.
            fidelity: deprecated name of `cheap_loss` (removed in a later minor version).
        """
        if fidelity is not None:
            warn_renamed("GNMRController.observe(fidelity=...)", "observe(cheap_loss=...)")
            if cheap_loss is not None:
                raise TypeError("GNMRController.observe: give cheap_loss only, not also fidelity (its old name)")
            cheap_loss = fidelity
        self._check_norms(norms, missing)
        for name, value in (("cheap_loss", cheap_loss), ("impact", impact)):
            if value is not None and (value.shape != norms.shape or value.device != self.device):
                raise ValueError(
                    f"GNMRController.observe: {name} must be a tensor of shape ({self.num_units},) on {self.device}, "
                    f"got shape {tuple(value.shape)} on {value.device}"
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
        self._before_last = (self.step, self.norm_sum, self.norm_count, self.gnmr_window[pos].clone())
        self.norm_sum = self.norm_sum + torch.where(valid, n, 0.0)
        self.norm_count = self.norm_count + valid
        self.gnmr_window[pos] = gnmr

        scores = Scores(t, alpha, beta, n, missing, gnmr, dgnmr, risk, scored, risky, broken, cheap_loss, impact)
        previous = self.policy.active
        choice = self.policy.step(scores)
        self.step = t
        active = choice.active
        return Decision(
            scores=scores,
            candidates=choice.candidates,
            active=active,
            entered=active & ~previous,
            exited=previous & ~active,
            locks=choice.locks if choice.locks is not None else torch.zeros_like(active, dtype=torch.int32),
            has_history=(self.norm_count >= cfg.min_history) & (self.norm_sum > 0),
            policy=self.policy,
            choice=choice,
        )

    def revert(self) -> None:
        """Undo the last `observe()`: the state is exactly as before it, as if that step had never been seen.

        For an optimizer step that turns out not to have happened, which the host learns only with the decision's
        transfer: the fp16 loss scaler skips a step with inf/NaN gradients inside `optimizer.step()`. Only the
        last step can be reverted, once.
        """
        if self._before_last is None:
            raise RuntimeError("GNMRController.revert: there is no observed step to revert (only the last one can be)")
        step, norm_sum, norm_count, row = self._before_last
        self.gnmr_window[step % self.config.window] = row
        self.step, self.norm_sum, self.norm_count = step, norm_sum, norm_count
        self._before_last = None
        self.policy.revert()

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the decision stream exactly (tensors are cloned to CPU): the history and
        the policy's state, in one flat dict."""
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "num_units": self.num_units,
            "window": self.config.window,
            "step": self.step,
        }
        tensors = {name: getattr(self, name) for name in _HISTORY} | self.policy.state_dict()
        for name, value in tensors.items():
            state[name] = value.detach().cpu().clone()
        return state

    def json_state(self) -> dict[str, Any]:
        """`state_dict()` with plain lists: JSON-safe and exact (float64 round-trips through repr).

        NaNs (`gnmr_window`'s steps without a score, the cause policy's units never measured) become `null`, since
        NaN is not JSON.
        """
        state = self.state_dict()
        for name, value in state.items():
            if not isinstance(value, torch.Tensor):
                continue
            array = value.numpy()
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
        missing = [k for k in ("version", "num_units", "window", "step", *_HISTORY) if k not in state]
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
        loaded = {name: load_tensor(state, name, getattr(self, name)) for name in _HISTORY}
        # The policy checks and takes its own part; nothing changes unless every part loads.
        self.policy.load_state_dict(state)
        for name, value in loaded.items():
            setattr(self, name, value)
        self.step = step
        self._before_last = None
