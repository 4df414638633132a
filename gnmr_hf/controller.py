"""The GNMR controller: a state machine over a vector of N per-unit gradient norms.

Every optimizer step the caller hands `observe()` one 1-D tensor of N norms (one per recoverable unit) and
gets back a `Decision`: which units run on the recovery (high-fidelity) path from the next step on. The
controller knows nothing about INT8, bits or transformers; it is pure torch so that it runs on the norms'
device, and it is vectorized: a step is a fixed number of tensor ops whatever N is, with no Python loop over
units and no device-to-host transfer. The one transfer a caller needs to act on a decision is
`Decision.to_host()`.

The method (arXiv 2606.00539, see docs/method.md), per unit i with norm n_t at step t:

    GNMR_t  = n_t / mean(n_1 .. n_{t-1})                        cumulative mean of the unit's own past norms
    DGNMR_t = GNMR_t / mean(GNMR_{t-delta} .. GNMR_{t-1})       short window of the unit's past scores
    risky   = GNMR_t > alpha_t  or  DGNMR_t > beta_t
    candidates = risky or lock > 0; the top `max_active` by risk run in recovery; selected risky units get
    lock = lock_steps; stable locked units count down and leave at 0.

The decisions the paper leaves open, each with its reason in docs/method.md:

- Warm-up: GNMR needs `min_history` finite past norms and a positive mean; DGNMR needs the GNMR of each of
  the last `window` steps (the window is indexed by step: a step without a score restarts it). Until then
  the score is NaN and the unit cannot be risky through it.
- Ranking: risk = max(GNMR / alpha_t, DGNMR / beta_t), so each score is measured in units of its own
  threshold and a unit is risky exactly when risk > 1. Risky units outrank locked-but-stable units; ties go
  to the lower unit index (the order of `find_units`), so a decision is a pure function of the norm stream.
- Non-finite norms (inf, NaN) and negative ones: risk = +inf (always risky, even during warm-up, since a
  non-finite gradient is a failure whatever the history), never added to the history.
- Missing units (no gradient this step): not scored, not added to the history, not risky; their lock still
  counts down, because the lock is measured in optimizer steps.
- Preemption: when more candidates than `max_active` exist, the ones left out lose their lock and go back
  to the low-cost path; if they are still risky at the next step they compete again on their score.
- History is float64, so a cumulative mean over 10^6 steps keeps ~10 significant digits.
- The decision made from step t's norms takes effect from step t + 1.

Cost (docs/performance.md has the numbers): at N = 10^5 a step is bound by memory traffic and by the few
CPU kernels that do not vectorize (comparisons into bool, `where`, `masked_fill`: ~3x a float add), not by
arithmetic. So the step avoids full-size temporaries (scratch buffers are reused), replaces masks by NaN
propagation or small-integer arithmetic where the result is bit-identical, keeps the window sum without
re-reading the window (`_advance_window`), and selects the top `max_active` with a blocked stable sort
(`_topk.TopK`) instead of `torch.topk`, which is both slower and not deterministic among ties.
"""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ._topk import TopK
from .config import GNMRConfig

__all__ = ["Decision", "GNMRController", "HostDecision"]

_STATE_VERSION = 2
_TENSOR_STATE = ("norm_sum", "norm_count", "gnmr_ring", "window_prefix", "locks")


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

    Masks are bool [N]; scores are float64 [N] with NaN where a unit has no score this step; `risk` is 0 for
    unscored units and +inf for non-finite norms. `active` is the set that runs in recovery from step
    `step + 1` on; `locks` (uint8 [N], int32 when `lock_steps` > 255) is each unit's lock after this step.
    The tensors are never modified afterwards, so a `Decision` stays valid after later steps.
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
        """Copy what the caller acts on to the host in ONE transfer (one sync per optimizer step).

        Args:
            top_k: also fetch the `top_k` riskiest scored units (largest risk first, ties to the lower index).
        """
        if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
            raise ValueError(f"Decision.to_host: top_k must be an int >= 0, got {top_k!r}")
        n = self.active.numel()
        k = min(top_k, n)
        u8 = torch.uint8
        # Scored units (a score, or a broken norm: risk +inf) keep their risk, the others get risk - 1 = -1,
        # below every real risk (>= 0). Subtracting 0 leaves a risk bit-exact, so this needs no `where`.
        unscored = (~self.eligible).view(u8)
        if k:
            top = _top_k(n, k, self.active.device)
            torch.sub(self.risk, unscored, out=top.key)
            top_idx = top.indices()
            top_val = top.key[top_idx]
            best = top_val[:1]
        else:
            top_idx = top_val = torch.empty(0, dtype=torch.int64, device=self.active.device)
            best = torch.sub(self.risk, unscored).max().reshape(1)
        counts = torch.stack([torch.count_nonzero(self.eligible), torch.count_nonzero(self.candidates)])
        # Bit flags by multiply-add (the masks are 0/1 bytes), ~2x cheaper on a CPU than shifts and ors.
        flags = torch.add(self.active.view(u8), self.entered.view(u8), alpha=2)
        flags.add_(self.exited.view(u8), alpha=4).add_(self.risky.view(u8), alpha=8)
        # Everything goes into one byte buffer (8-byte values first, so their host views stay aligned, then
        # one flag byte per unit), so that a single `.cpu()` moves it; separate `.item()` or `.cpu()` calls
        # would each stall the device.
        parts = [best.view(u8), top_val.view(u8), top_idx.view(u8), counts.view(u8), flags]
        packed = torch.cat(parts).cpu().numpy()
        words = packed[: 8 * (3 + 2 * k)]
        best_h = float(words[:8].view(np.float64)[0])
        top_val_h = words[8 : 8 * (1 + k)].view(np.float64)
        top_idx_h = words[8 * (1 + k) : 8 * (1 + 2 * k)].view(np.int64)
        counts_h = words[8 * (1 + 2 * k) :].view(np.int64)
        # Few units have a flag: find them in one pass, then split by bit.
        flags_h = packed[8 * (3 + 2 * k) :]
        flagged = np.flatnonzero(flags_h != 0)  # numpy's fast nonzero path is for bool arrays (10x)
        bits = flags_h[flagged]
        keep = top_val_h >= 0  # drop unscored units from the top list
        return HostDecision(
            step=self.step,
            active=flagged[(bits & 1) != 0],
            entered=flagged[(bits & 2) != 0],
            exited=flagged[(bits & 4) != 0],
            risky=flagged[(bits & 8) != 0],
            n_eligible=int(counts_h[0]),
            n_candidates=int(counts_h[1]),
            max_score=best_h if best_h >= 0 else math.nan,
            top_units=top_idx_h[keep],
            top_scores=top_val_h[keep],
            alpha=self.alpha,
            beta=self.beta,
        )


_TO_HOST = threading.local()


def _top_k(n: int, k: int, device: torch.device) -> TopK:
    """A TopK for `Decision.to_host`, reused across calls: its buffers (N padded floats and indices) are
    filled and consumed within one call, and building them every step would cost as much as the selection.
    One per thread, so that concurrent `to_host` calls do not share a buffer."""
    cache: dict[tuple[int, int, torch.device], TopK] = _TO_HOST.__dict__.setdefault("cache", {})
    key = (n, k, device)
    if key not in cache:
        if len(cache) >= 8:
            cache.clear()
        cache[key] = TopK(n, k, device)
    return cache[key]


class _Scratch:
    """Preallocated buffers for a step's intermediates (see `GNMRController.__init__`)."""

    def __init__(self, n: int, lock_dtype: torch.dtype, device: torch.device) -> None:
        self.norms = torch.empty(n, dtype=torch.float64, device=device)
        self.f64_a = torch.empty(n, dtype=torch.float64, device=device)
        self.f64_b = torch.empty(n, dtype=torch.float64, device=device)
        self.valid = torch.empty(n, dtype=torch.bool, device=device)
        self.bad = torch.empty(n, dtype=torch.bool, device=device)
        self.bool_a = torch.empty(n, dtype=torch.bool, device=device)
        self.offset = torch.empty(n, dtype=torch.int8, device=device)
        self.lock_a = torch.empty(n, dtype=lock_dtype, device=device)
        self.lock_b = torch.empty(n, dtype=lock_dtype, device=device)


class GNMRController:
    """Scores N units from their gradient norms and picks which run in recovery, under a hard budget.

    Args:
        config: the policy (`max_active`, `lock_steps`, `window`, `alpha`, `beta`, `min_history`, schedule).
        num_units: N, fixed for the controller's life (a changed N is an error, not a silent reset).
        device: where the state lives; `observe()` takes norms on this device.

    State (see `state_dict()`): `norm_sum` and `norm_count` (float64, the history of finite norms);
    `gnmr_ring` and `window_prefix` (float64, the last `window` GNMR values, see `_advance_window`); `locks`
    (uint8, or int32 when `lock_steps` > 255). `active` is derived: a unit is in recovery exactly when its
    lock is > 0.
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
        f64 = dict(dtype=torch.float64, device=self.device)
        self.norm_sum = torch.zeros(num_units, **f64)
        # Counts are float64 (exact up to 2^53) so that the mean is a float64 op with no int->float promotion.
        self.norm_count = torch.zeros(num_units, **f64)
        # NaN marks a step without a score. It propagates through the window sums, so DGNMR stays NaN until
        # `window` scored steps in a row have refilled the window: the "full window" rule, with no counter.
        self.gnmr_ring = torch.full((config.window, num_units), torch.nan, **f64)
        self.window_prefix = torch.full((num_units,), torch.nan, **f64)
        # Locks are small counters; one byte each makes their arithmetic ~4x cheaper than int32 on a CPU.
        self._lock_dtype = torch.uint8 if config.lock_steps <= 255 else torch.int32
        self.locks = torch.zeros(num_units, dtype=self._lock_dtype, device=self.device)
        self._window_sum = torch.empty(num_units, **f64)
        self._topk = TopK(num_units, config.max_active, self.device)
        # Scratch for the step's intermediates that are not part of the `Decision`. Allocating them afresh
        # every step costs more than the arithmetic at large N on a CPU: glibc returns the freed top of the
        # heap to the OS and the next step page-faults it back (~200 faults, ~0.3 ms per step at N=10^5).
        self._scratch = _Scratch(num_units, self._lock_dtype, self.device)
        self._warm = torch.empty(num_units, dtype=torch.bool, device=self.device)
        self._derive()

    def _derive(self) -> None:
        """Recompute the derived state (after construction or `load_state_dict`)."""
        self.active = self.locks > 0
        self._update_warm()
        last = (self.step - 1) % self.config.window
        if last == self.config.window - 1:
            self._window_sum.copy_(self.window_prefix)
        else:
            torch.add(self.gnmr_ring[last + 1], self.window_prefix, out=self._window_sum)

    def _update_warm(self) -> None:
        """`_warm`: the unit has `min_history` finite past norms and a positive sum, so it gets a GNMR score.

        Written with arithmetic and a float->bool cast (a nonzero test) rather than two comparisons: on a
        CPU the comparison kernels cost ~3x a vectorized float op per element. `norm_count` holds integers,
        so `count - (min_history - 1)` clamped to [0, 1] is 1 exactly when count >= min_history.
        """
        scratch = self._scratch
        count_ok = torch.sub(self.norm_count, self.config.min_history - 1, out=scratch.f64_a).clamp_(0.0, 1.0)
        self._warm.copy_(count_ok).logical_and_(scratch.bool_a.copy_(self.norm_sum))

    def _advance_window(self, t: int, gnmr: torch.Tensor) -> None:
        """Add step t's GNMR to the window and leave in `_window_sum` the sum of the last `window` values.

        Summing the `window` ring rows every step reads window x N float64 values (at N=10^5, window=8: 6.4 MB,
        more than the rest of the step). A running sum (add the new value, subtract the one leaving) reads 2
        rows but is not exact: after a huge GNMR (e.g. a unit whose norm starts near 0, like LoRA's A matrix)
        leaves the window, the cancellation error can exceed the remaining sum and fake a spike. Instead the
        steps are cut into blocks of `window` steps, and the window = (a suffix of the previous block) + (a
        prefix of the current block), all sums of non-negative values (no cancellation, error <= window ulps):

        - `window_prefix`: sum of the current block so far (one add per step);
        - `gnmr_ring[j]`: the raw GNMR at position j of the current block for j <= position, and for j > it the
          suffix sum of positions j..window-1 of the previous block, written in place when that block ended.

        Each step costs two adds; the last step of a block also turns its raw values into suffix sums
        (window - 2 adds). Sums are as deterministic as the ring sum: the same state gives the same bits.
        """
        window = self.config.window
        pos = (t - 1) % window
        ring = self.gnmr_ring
        ring[pos] = gnmr
        if pos == 0:
            self.window_prefix.copy_(gnmr)
        else:
            self.window_prefix += gnmr
        if pos == window - 1:
            for j in range(window - 2, 0, -1):
                ring[j] += ring[j + 1]
            self._window_sum.copy_(self.window_prefix)
        else:
            torch.add(ring[pos + 1], self.window_prefix, out=self._window_sum)

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
        scratch = self._scratch
        if norms.dtype == torch.float64 and missing is None:
            n = norms
        else:
            n = scratch.norms.copy_(norms)
            if missing is not None:
                # A missing unit's norm means nothing; as NaN it drops out of the scores and the history.
                n.masked_fill_(missing, torch.nan)
        # `clean` is what the history adds: the norm where it is a norm (finite, >= 0), else 0. Negative norms
        # cannot come from a norm and count as a broken signal, like inf and NaN, rather than being validated
        # on the host, which would cost a sync every step. One comparison then yields `valid`.
        clean = torch.nan_to_num(n, nan=0.0, posinf=0.0, neginf=0.0, out=scratch.f64_a).clamp_min_(0.0)
        valid = torch.eq(clean, n, out=scratch.valid)
        if missing is None:
            bad = torch.logical_not(valid, out=scratch.bad)
        else:
            bad = torch.logical_or(valid, missing, out=scratch.bad).logical_not_()

        eligible = valid & self._warm
        # GNMR = n_t / mean(n_1 .. n_{t-1}) = n_t * count / sum; DGNMR = GNMR_t * window / (sum of the window),
        # NaN unless the last `window` steps all had a score (see `_advance_window`).
        gnmr = torch.where(eligible, n, torch.nan).mul_(self.norm_count).div_(self.norm_sum)
        dgnmr = torch.mul(gnmr, cfg.window).div_(self._window_sum)
        # risk = max(GNMR/alpha, DGNMR/beta); a unit with GNMR but no DGNMR yet is ranked on GNMR alone.
        # Division is correctly rounded, so GNMR/alpha > 1 exactly when GNMR > alpha: `risky` needs one
        # comparison, not one per score.
        risk = gnmr / alpha
        dgnmr_ratio = torch.div(dgnmr, beta, out=scratch.f64_b).nan_to_num_(nan=0.0, posinf=math.inf)
        torch.maximum(risk, dgnmr_ratio, out=risk)
        risky = (risk > 1.0).logical_or_(bad)
        risk.nan_to_num_(nan=0.0, posinf=math.inf).masked_fill_(bad, math.inf)

        # History: only valid norms, and only after scoring, since the mean is over the *past* norms.
        self.norm_sum += clean
        self.norm_count += valid.view(torch.uint8)
        self._update_warm()
        self._advance_window(t, gnmr)

        # A candidate is risky, or still locked after this step's countdown (lock - 1 > 0, i.e. lock >= 2).
        locked = scratch.bool_a.copy_(torch.bitwise_right_shift(self.locks, 1, out=scratch.lock_a))
        candidates = risky | locked
        # Ranking key: a candidate's exact risk; a risky unit's risk is > 1 (or +inf) and a stable one's is
        # <= 1, so risky units always outrank locked-stable ones. Non-candidates get risk - 2 (< 0, below
        # every candidate); those that fill the k slots when there are fewer candidates are dropped by the
        # `& candidates` below. The offset is small-integer arithmetic on the mask, several times cheaper
        # on a CPU than `where`/`masked_fill` on float64, and adding 0 leaves a risk bit-exact. Ties go to
        # the lower index (see TopK).
        offset = torch.sub(candidates.view(torch.int8), 1, out=scratch.offset)
        torch.add(risk, offset, alpha=2, out=self._topk.key)
        selected = self._topk.mask().logical_and_(candidates)
        # Selected risky units get a full lock, selected stable ones count down, the rest (released, or
        # preempted by riskier units when the budget is full) drop to 0 and leave recovery. As arithmetic:
        # lock - 1 + risky * (lock_steps - (lock - 1)), times selected. A non-candidate's lock - 1 may wrap
        # around in uint8, which the final product by 0 discards.
        locks = self.locks - 1
        locks += torch.neg(locks, out=scratch.lock_a).add_(cfg.lock_steps).mul_(scratch.lock_b.copy_(risky))
        locks.mul_(scratch.lock_b.copy_(selected))
        previous = self.active
        self.locks = locks
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
            locks=locks,
        )

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
        """`state_dict()` with plain lists: JSON-safe and exact (float64 round-trips through repr).

        The NaNs of `gnmr_ring` (steps without a score) become `null`, since NaN is not JSON.
        """
        state = self.state_dict()
        for name in _TENSOR_STATE:
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
        missing = [k for k in ("version", "num_units", "window", "step", *_TENSOR_STATE) if k not in state]
        if missing:
            raise KeyError(f"GNMRController.load_state_dict: state is missing {missing}")
        if state["version"] != _STATE_VERSION:
            raise ValueError(
                f"GNMRController.load_state_dict: state version {state['version']!r} is not supported "
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
        for name in _TENSOR_STATE:
            dtype = getattr(self, name).dtype
            value = state[name]
            if not isinstance(value, torch.Tensor):
                # JSON form: nested lists, with null for NaN (numpy reads None as NaN in a float array).
                try:
                    value = torch.from_numpy(np.array(value, dtype=np.float64 if dtype == torch.float64 else None))
                except (TypeError, ValueError) as err:
                    raise ValueError(f"GNMRController.load_state_dict: {name} is not a numeric array: {err}") from None
            if name == "locks":
                # A state saved with a longer lock_steps is cut to this config's; a negative lock is corrupt.
                value = value.to(torch.int64)
                if (value < 0).any():
                    raise ValueError("GNMRController.load_state_dict: locks must be >= 0")
                value = value.clamp(max=self.config.lock_steps)
            value = value.to(device=self.device, dtype=dtype)
            expected = getattr(self, name).shape
            if value.shape != expected:
                raise ValueError(
                    f"GNMRController.load_state_dict: {name} has shape {tuple(value.shape)}, "
                    f"expected {tuple(expected)}"
                )
            loaded[name] = value.clone()
        for name, value in loaded.items():
            setattr(self, name, value)
        self.step = step
        self._derive()
