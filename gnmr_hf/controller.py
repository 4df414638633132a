"""The GNMR controller: a state machine over a vector of N per-unit gradient norms.

Every optimizer step the caller hands `observe()` one 1-D tensor of N norms (one per recoverable unit) and gets
back a `Decision`: which units run on the recovery (high-fidelity) path from the next step on. The controller
knows nothing about INT8, bits or transformers; it is pure torch so that it runs on the norms' device, and it is
vectorized: the cost of a step is a fixed number of tensor ops whatever N is, with no Python loop over units and
no device-to-host transfer. The one transfer a caller needs to act on a decision is `Decision.to_host()`.

The method (arXiv 2606.00539, see docs/method.md), per unit i with norm n_t at step t:

    GNMR_t  = n_t / mean(n_1 .. n_{t-1})                        cumulative mean of the unit's own past norms
    DGNMR_t = GNMR_t / mean(GNMR_{t-delta} .. GNMR_{t-1})       short window of the unit's past scores
    risky   = GNMR_t > alpha_t  or  DGNMR_t > beta_t
    candidates = risky or lock > 0; the top `max_active` by risk run in recovery; selected risky units get
    lock = lock_steps; stable locked units count down and leave at 0.

The decisions the paper leaves open, each with its reason in docs/method.md:

- Warm-up: GNMR needs `min_history` finite past norms and a positive mean; DGNMR needs a full window of
  `window` past GNMR values. Until then the score is NaN and the unit cannot be risky through it.
- Ranking: risk = max(GNMR / alpha_t, DGNMR / beta_t), so each score is measured in units of its own threshold
  and a unit is risky exactly when risk > 1. Risky units outrank locked-but-stable units; ties go to the lower
  unit index (the order of `find_units`), so a decision is a pure function of the norm stream.
- Non-finite norms (inf, NaN) and negative ones: risk = +inf (always risky, even during warm-up, since a
  non-finite gradient is a failure whatever the history), never added to the history.
- Missing units (no gradient this step): not scored, not added to the history, not risky; their lock still
  counts down, because the lock is measured in optimizer steps.
- Preemption: when more candidates than `max_active` exist, the ones left out lose their lock and go back to
  the low-cost path; if they are still risky at the next step they compete again on their score.
- History is float64, so a cumulative mean over 10^6 steps keeps ~10 significant digits.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from .config import GNMRConfig

__all__ = ["Decision", "GNMRController", "HostDecision"]

_STATE_VERSION = 1
_TENSOR_STATE = ("norm_sum", "norm_count", "gnmr_ring", "gnmr_streak", "locks", "active")


@dataclass(frozen=True)
class HostDecision:
    """The part of a `Decision` the host needs, fetched in a single device-to-host transfer."""

    step: int
    active: np.ndarray  # indices of units in recovery from the next step on
    entered: np.ndarray
    exited: np.ndarray
    risky: np.ndarray
    n_eligible: int
    n_candidates: int
    max_score: float  # max risk over scored units; NaN when no unit has a score
    top_units: np.ndarray  # indices of the `top_k` riskiest scored units, riskiest first
    top_scores: np.ndarray
    alpha: float
    beta: float

    @property
    def exceedance_rate(self) -> float:
        """Risky units over eligible (scored) units; 0 when none is eligible yet."""
        return len(self.risky) / self.n_eligible if self.n_eligible else 0.0


@dataclass(frozen=True)
class Decision:
    """One step's decision, as tensors on the controller's device (no host sync was needed to make it).

    Masks are bool [N]; scores are float64 [N] with NaN where a unit has no score this step.
    `active` is the set that runs in recovery from step `step + 1` on.
    """

    step: int
    alpha: float
    beta: float
    gnmr: torch.Tensor
    dgnmr: torch.Tensor
    risk: torch.Tensor
    eligible: torch.Tensor
    risky: torch.Tensor
    candidates: torch.Tensor
    active: torch.Tensor
    entered: torch.Tensor
    exited: torch.Tensor
    locks: torch.Tensor

    def to_host(self, top_k: int = 0) -> HostDecision:
        """Copy what the caller acts on to the host in ONE transfer (one sync per optimizer step)."""
        n = self.active.numel()
        k = min(top_k, n)
        # Pack masks as bit flags in one float64 vector with the stats and the top-k, so that a single
        # `.cpu()` moves everything; separate `.item()` calls would each stall the device.
        flags = (
            self.active.double()
            + 2 * self.entered.double()
            + 4 * self.exited.double()
            + 8 * self.risky.double()
        )
        scored_risk = torch.where(self.eligible | torch.isinf(self.risk), self.risk, -1.0)
        stats = torch.stack(
            [
                self.eligible.sum().double(),
                self.candidates.sum().double(),
                torch.where(self.eligible.any() | torch.isinf(self.risk).any(), scored_risk.max(), torch.nan),
            ]
        )
        parts = [flags, stats]
        if k:
            top = torch.topk(scored_risk, k)
            parts += [top.indices.double(), top.values]
        packed = torch.cat(parts).cpu().numpy()
        flags_h = packed[:n].astype(np.int64)
        top_idx = packed[n + 3 : n + 3 + k].astype(np.int64)
        top_val = packed[n + 3 + k : n + 3 + 2 * k]
        keep = top_val >= 0  # drop unscored units from the top list
        return HostDecision(
            step=self.step,
            active=np.flatnonzero(flags_h & 1),
            entered=np.flatnonzero(flags_h & 2),
            exited=np.flatnonzero(flags_h & 4),
            risky=np.flatnonzero(flags_h & 8),
            n_eligible=int(packed[n]),
            n_candidates=int(packed[n + 1]),
            max_score=float(packed[n + 2]),
            top_units=top_idx[keep],
            top_scores=top_val[keep],
            alpha=self.alpha,
            beta=self.beta,
        )


class GNMRController:
    """Scores N units from their gradient norms and picks which run in recovery, under a hard budget.

    Args:
        config: the policy (`max_active`, `lock_steps`, `window`, `alpha`, `beta`, `min_history`, schedule).
        num_units: N, fixed for the controller's life (a changed N is an error, not a silent reset).
        device: where the state lives; `observe()` takes norms on this device.
    """

    def __init__(self, config: GNMRConfig, num_units: int, device: torch.device | str = "cpu") -> None:
        if not isinstance(config, GNMRConfig):
            raise TypeError(f"GNMRController: config must be a GNMRConfig, got {type(config).__name__}")
        if isinstance(num_units, bool) or not isinstance(num_units, int) or num_units < 1:
            raise ValueError(f"GNMRController: num_units must be an int >= 1, got {num_units!r}")
        self.config = config
        self.num_units = num_units
        self.device = torch.device(device)
        self.step = 0
        f64, i64 = dict(dtype=torch.float64, device=self.device), dict(dtype=torch.int64, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.norm_sum = torch.zeros(num_units, **f64)
        self.norm_count = torch.zeros(num_units, **i64)
        self.gnmr_ring = torch.zeros(config.window, num_units, **f64)
        self.gnmr_streak = torch.zeros(num_units, **i64)
        self.locks = torch.zeros(num_units, **i32)
        self.active = torch.zeros(num_units, dtype=torch.bool, device=self.device)

    def _check_norms(self, norms: Any, missing: Any) -> None:
        if not isinstance(norms, torch.Tensor):
            raise TypeError(f"GNMRController.observe: norms must be a torch.Tensor, got {type(norms).__name__}")
        if norms.ndim != 1 or norms.numel() != self.num_units:
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
    def observe(self, norms: torch.Tensor, missing: torch.Tensor | None = None) -> Decision:
        """Score one optimizer step's norms and decide the recovery set for the next step.

        Args:
            norms: float tensor [N], the gradient norm of each unit this step (pre-clip, after accumulation).
            missing: optional bool tensor [N], True for units that had no gradient this step.
        """
        self._check_norms(norms, missing)
        cfg = self.config
        t = self.step + 1
        alpha, beta = cfg.thresholds(t)
        n = norms.to(torch.float64)
        # NaN fails both comparisons and inf fails the second; negative norms cannot come from a norm and are
        # treated like non-finite ones (a broken signal) rather than validated on the host, which would
        # cost a sync every step.
        valid = (n >= 0) & (n < torch.inf)
        if missing is None:
            bad = ~valid
        else:
            valid &= ~missing
            bad = ~(valid | missing)

        count = self.norm_count
        eligible = valid & (count >= cfg.min_history)
        # 0/0 and x/0 give NaN/inf here; `eligible` (which requires a positive past mean) masks them out.
        gnmr = n * count / self.norm_sum
        eligible &= self.norm_sum > 0
        gnmr = gnmr.where(eligible, torch.nan)
        has_window = eligible & (self.gnmr_streak >= cfg.window)
        window_sum = self.gnmr_ring.sum(dim=0)
        dgnmr = (gnmr * cfg.window / window_sum).where(has_window, torch.nan)

        # NaN compares False, so units without a score cannot be risky through it.
        risky = (gnmr > alpha) | (dgnmr > beta) | bad
        risk = torch.fmax(gnmr / alpha, dgnmr / beta).nan_to_num_(nan=0.0).masked_fill_(bad, torch.inf)

        # History: only finite norms, and only after scoring, since the mean is over the *past* norms.
        # The GNMR window is indexed by step (GNMR_{t-delta} .. GNMR_{t-1}); a step without a score breaks
        # the unit's streak, and DGNMR needs a streak of `window` scored steps.
        self.norm_sum += n.where(valid, 0.0)
        self.norm_count += valid
        self.gnmr_ring[(t - 1) % cfg.window] = gnmr.where(eligible, 0.0)
        self.gnmr_streak = (self.gnmr_streak + 1) * eligible

        # Locks: stable units count down first, so a unit stays exactly lock_steps steps after its last
        # risky one; risky units are refreshed below only if they win a slot.
        locks = torch.where(risky, self.locks, (self.locks - 1).clamp_(min=0))
        candidates = risky | (locks > 0)
        # Ranking key: risky units by risk (>= 1, or +inf), then locked-stable units by risk mapped into
        # [-2, -1], then non-candidates at -inf. Ties are resolved by index below.
        key = torch.where(risky, risk, risk.clamp(max=1.0) - 2.0).masked_fill_(~candidates, -torch.inf)
        selected = self._top_k_by_index(key, candidates, min(cfg.max_active, self.num_units))
        self.locks = locks.masked_fill_(~selected, 0).masked_fill_(selected & risky, cfg.lock_steps)
        previous = self.active
        self.active = selected
        self.step = t
        return Decision(
            step=t,
            alpha=alpha,
            beta=beta,
            gnmr=gnmr,
            dgnmr=dgnmr,
            risk=risk,
            eligible=eligible,
            risky=risky,
            candidates=candidates,
            active=selected,
            entered=selected & ~previous,
            exited=previous & ~selected,
            locks=self.locks.clone(),
        )

    @staticmethod
    def _top_k_by_index(key: torch.Tensor, candidates: torch.Tensor, k: int) -> torch.Tensor:
        """The k candidates with the largest key, ties to the lower index; no host sync.

        `topk` alone is not deterministic among equal keys, so take everything strictly above the k-th value
        and fill the remaining slots with the lowest-index candidates equal to it.
        """
        kth = torch.topk(key, k, sorted=False).values.min()
        above = candidates & (key > kth)
        tied = candidates & (key == kth)
        room = k - above.sum()
        return above | (tied & (tied.cumsum(0) <= room))

    # ------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue the decision stream exactly (tensors are cloned to CPU)."""
        state: dict[str, Any] = {
            "version": _STATE_VERSION,
            "num_units": self.num_units,
            "window": self.config.window,
            "step": self.step,
        }
        for name in _TENSOR_STATE:
            state[name] = getattr(self, name).detach().cpu().clone()
        return state

    def json_state(self) -> dict[str, Any]:
        """`state_dict()` with plain lists: JSON-safe and exact (float64 round-trips through repr)."""
        state = self.state_dict()
        for name in _TENSOR_STATE:
            state[name] = state[name].tolist()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore from `state_dict()` or `json_state()` (also after a `json.dumps`/`json.loads` round trip)."""
        if isinstance(state, str):
            state = json.loads(state)
        missing = [k for k in ("version", "num_units", "window", "step", *_TENSOR_STATE) if k not in state]
        if missing:
            raise KeyError(f"GNMRController.load_state_dict: state is missing {missing}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"GNMRController.load_state_dict: state version {state['version']} is not supported "
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
        dtypes = {
            "norm_sum": torch.float64,
            "gnmr_ring": torch.float64,
            "norm_count": torch.int64,
            "gnmr_streak": torch.int64,
            "locks": torch.int32,
            "active": torch.bool,
        }
        loaded = {}
        for name in _TENSOR_STATE:
            value = torch.as_tensor(state[name], dtype=dtypes[name]).to(self.device)
            expected = getattr(self, name).shape
            if value.shape != expected:
                raise ValueError(
                    f"GNMRController.load_state_dict: {name} has shape {tuple(value.shape)}, "
                    f"expected {tuple(expected)}"
                )
            loaded[name] = value.clone()
        for name, value in loaded.items():
            setattr(self, name, value)
        self.step = int(state["step"])
