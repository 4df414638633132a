"""Properties of GNMRController over random norm streams (hypothesis) and agreement with a plain reference.

The reference below is the method written the obvious way, one unit at a time, with Python lists: it is the
specification the vectorized controller must match.
"""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from gnmr_hf import GNMRConfig, GNMRController

SETTINGS = settings(deadline=None, max_examples=60, derandomize=True)

SPECIAL = [0.0, math.nan, math.inf, -math.inf, -1.0, 1e-300, 1e300]


@st.composite
def configs(draw) -> GNMRConfig:
    schedule = draw(st.sampled_from(["constant", "linear", "cosine"]))
    finals = {}
    if schedule != "constant":
        finals = dict(
            alpha_final=draw(st.floats(1.05, 4.0)),
            beta_final=draw(st.floats(1.05, 4.0)),
            schedule_steps=draw(st.integers(1, 30)),
        )
    return GNMRConfig(
        max_active=draw(st.integers(1, 4)),
        lock_steps=draw(st.integers(1, 5)),
        window=draw(st.integers(1, 5)),
        min_history=draw(st.integers(1, 4)),
        alpha=draw(st.floats(1.05, 4.0)),
        beta=draw(st.floats(1.05, 4.0)),
        threshold_schedule=schedule,
        **finals,
    )


@st.composite
def streams(draw, generic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(norms [steps, units] float64, missing [steps, units] bool).

    `generic`: norms are exp(z) times a factor unique to (step, unit), so that two different units never have
    exactly equal scores and no score sits exactly on a threshold: then the reference and the controller,
    whose float roundings differ in the last bit, must agree exactly. Otherwise norms are anything, special
    values included.
    """
    steps = draw(st.integers(1, 30))
    units = draw(st.integers(1, 9))
    cells = steps * units
    z = draw(st.lists(st.floats(-3.0, 3.0), min_size=cells, max_size=cells))
    norms = torch.tensor(z, dtype=torch.float64).exp().view(steps, units)
    if generic:
        norms *= 1.0 + 0.0123456789 * torch.arange(cells, dtype=torch.float64).view(steps, units).sin()
    kinds = draw(st.lists(st.integers(0, 19), min_size=cells, max_size=cells))
    kinds = torch.tensor(kinds).view(steps, units)
    norms = torch.where(kinds == 1, norms * 25.0, norms)  # spikes
    if not generic:
        special = draw(st.lists(st.sampled_from(SPECIAL), min_size=cells, max_size=cells))
        norms = torch.where(kinds == 2, torch.tensor(special, dtype=torch.float64).view(steps, units), norms)
    else:
        norms = torch.where(kinds == 2, torch.nan, norms)
    missing = kinds == 3
    return norms, missing


class Reference:
    """GNMR, unit by unit: the specification in docs/method.md, with no vectorization and no tricks."""

    def __init__(self, config: GNMRConfig, units: int) -> None:
        self.config = config
        self.history: list[list[float]] = [[] for _ in range(units)]  # finite norms
        self.scores: list[list[float | None]] = [[] for _ in range(units)]  # GNMR per step, None = unscored
        self.locks = [0] * units
        self.step = 0

    def observe(self, norms: list[float], missing: list[bool]) -> dict[str, list]:
        cfg = self.config
        self.step += 1
        alpha, beta = cfg.thresholds(self.step)
        risky, risk = [], []
        for i, (x, miss) in enumerate(zip(norms, missing, strict=True)):
            bad = not miss and not (math.isfinite(x) and x >= 0)
            past = self.history[i]
            gnmr = None
            if not miss and not bad and len(past) >= cfg.min_history and sum(past) > 0:
                gnmr = x * len(past) / sum(past)
            window = self.scores[i][-cfg.window :]
            dgnmr = None
            if gnmr is not None and len(window) == cfg.window and None not in window:
                dgnmr = gnmr * cfg.window / sum(window)
            ratios = [v for v in (gnmr and gnmr / alpha, dgnmr and dgnmr / beta) if v is not None]
            risky.append(bad or any(v > 1 for v in ratios))
            risk.append(math.inf if bad else max(ratios, default=0.0))
            if not miss and not bad:
                past.append(x)
            self.scores[i].append(gnmr)
        # Countdown, then candidates; the best max_active candidates by risk (ties: lower index) are selected.
        countdown = [lk if r else max(lk - 1, 0) for lk, r in zip(self.locks, risky, strict=True)]
        candidates = [r or lk > 0 for r, lk in zip(risky, countdown, strict=True)]
        ranked = sorted((i for i, c in enumerate(candidates) if c), key=lambda i: (-risk[i], i))
        selected = set(ranked[: cfg.max_active])
        self.locks = [
            (cfg.lock_steps if risky[i] else countdown[i]) if i in selected else 0 for i in range(len(norms))
        ]
        return {"risky": risky, "candidates": candidates, "active": sorted(selected), "locks": self.locks}


@SETTINGS
@given(config=configs(), stream=streams(generic=False))
def test_the_budget_is_never_exceeded_and_only_risky_units_enter(config, stream):
    norms, missing = stream
    units = norms.shape[1]
    controller = GNMRController(config, units)
    for t in range(norms.shape[0]):
        d = controller.observe(norms[t], missing[t])
        assert d.active.sum().item() <= config.max_active
        assert not (d.entered & ~d.risky).any()  # no unit enters unless it is risky at that step
        assert not (d.active & ~d.candidates).any()
        assert ((d.locks >= 0) & (d.locks <= config.lock_steps)).all()
        assert torch.equal(d.active, d.locks > 0)  # in recovery exactly while locked
        assert (d.locks[d.active & d.risky] == config.lock_steps).all()  # selected risky units: full lock
        assert torch.equal(controller.active, d.active)
        # Risky units are never passed over for a stable one.
        if (d.risky & ~d.active).any():
            assert not (d.active & ~d.risky).any()
            assert d.active.sum().item() == config.max_active
        # A broken norm is always risky; a missing unit never is.
        broken = ~(norms[t].isfinite() & (norms[t] >= 0)) & ~missing[t]
        assert d.risky[broken].all() and not d.risky[missing[t]].any()


@SETTINGS
@given(config=configs(), stream=streams(generic=True))
def test_decisions_match_the_unit_by_unit_reference(config, stream):
    norms, missing = stream
    controller = GNMRController(config, norms.shape[1])
    reference = Reference(config, norms.shape[1])
    for t in range(norms.shape[0]):
        d = controller.observe(norms[t], missing[t])
        expected = reference.observe(norms[t].tolist(), missing[t].tolist())
        assert d.risky.tolist() == expected["risky"]
        assert d.candidates.tolist() == expected["candidates"]
        assert d.active.nonzero().flatten().tolist() == expected["active"]
        assert d.locks.tolist() == expected["locks"]
