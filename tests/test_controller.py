"""GNMRController: the method's rules, step by step, on hand-written norm streams.

Streams are lists of per-step norm lists (one entry per unit); `None` marks a unit with no gradient that step.
Expected decisions are written out literally: `active[t]` is the set chosen from step t+1's norms.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gnmr_hf import GNMRConfig, GNMRController

NAN, INF = math.nan, math.inf
# GNMR alone decides (beta is out of reach), two units may be in recovery, locks last two steps.
GNMR_ONLY = dict(max_active=2, lock_steps=2, window=2, min_history=2, alpha=2.0, beta=1e9)


def run(config: GNMRConfig, stream: list[list[float | None]], controller: GNMRController | None = None):
    """Feed the stream to a (new) controller; return its decisions."""
    controller = controller or GNMRController(config, len(stream[0]))
    decisions = []
    for row in stream:
        missing = torch.tensor([v is None for v in row])
        norms = torch.tensor([NAN if v is None else v for v in row], dtype=torch.float64)
        decisions.append(controller.observe(norms, missing if missing.any() else None))
    return decisions


def flat(mask: torch.Tensor) -> torch.Tensor:
    """Indices where a 1-D mask is True."""
    return mask.nonzero().flatten()


def active_sets(decisions) -> list[list[int]]:
    return [flat(d.active).tolist() for d in decisions]


def random_stream(steps: int, units: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    norms = torch.exp(0.4 * torch.randn(steps, units, generator=g, dtype=torch.float64))
    spikes = torch.rand(steps, units, generator=g) < 0.04
    return torch.where(spikes, norms * 12.0, norms)


# ---------------------------------------------------------------------------------------------------- locks


def test_a_risky_unit_stays_lock_steps_decisions_after_its_last_risky_step():
    stream = [[1, 1, 1]] * 3 + [[5, 1, 1]] + [[1, 1, 1]] * 3
    decisions = run(GNMRConfig(**GNMR_ONLY), stream)
    assert active_sets(decisions) == [[], [], [], [0], [0], [], []]
    assert [d.locks[0].item() for d in decisions] == [0, 0, 0, 2, 1, 0, 0]
    assert [flat(d.entered).tolist() for d in decisions] == [[], [], [], [0], [], [], []]
    assert [flat(d.exited).tolist() for d in decisions] == [[], [], [], [], [], [0], []]


def test_the_lock_is_refreshed_while_the_unit_stays_risky():
    stream = [[1, 1, 1]] * 3 + [[5, 1, 1], [20, 1, 1]] + [[1, 1, 1]] * 3
    decisions = run(GNMRConfig(**GNMR_ONLY), stream)
    assert active_sets(decisions) == [[], [], [], [0], [0], [0], [], []]
    assert [d.locks[0].item() for d in decisions] == [0, 0, 0, 2, 2, 1, 0, 0]


def test_a_locked_unit_preempted_by_a_riskier_one_loses_its_lock():
    config = GNMRConfig(**{**GNMR_ONLY, "max_active": 1, "lock_steps": 3})
    stream = [[1, 1, 1]] * 3 + [[5, 1, 1], [1, 5, 1]] + [[1, 1, 1]] * 4
    decisions = run(config, stream)
    # Unit 1 is risky at step 5 and outranks the locked but stable unit 0, which is dropped for good: with its
    # lock it would have stayed a candidate until step 6.
    assert active_sets(decisions) == [[], [], [], [0], [1], [1], [1], [], []]
    assert decisions[4].locks.tolist() == [0, 3, 0]
    assert decisions[4].candidates.tolist() == [True, True, False]


def test_with_more_risky_units_than_slots_the_riskiest_win_and_the_rest_get_no_lock():
    config = GNMRConfig(**{**GNMR_ONLY, "max_active": 1})
    stream = [[1, 1, 1]] * 3 + [[5, 8, 1], [1, 1, 1], [1, 1, 1]]
    decisions = run(config, stream)
    assert active_sets(decisions) == [[], [], [], [1], [1], []]
    assert decisions[3].risky.tolist() == [True, True, False]
    assert decisions[3].locks.tolist() == [0, 2, 0]


def test_a_risky_unit_outranks_a_locked_stable_unit():
    config = GNMRConfig(**{**GNMR_ONLY, "max_active": 1, "lock_steps": 4})
    # Unit 0 is locked and stable at step 5; unit 1 is barely risky (GNMR 2.2 > alpha 2), yet takes the slot.
    stream = [[1, 1]] * 3 + [[50, 1], [1, 2.2]]
    assert active_sets(run(config, stream)) == [[], [], [], [0], [1]]


def test_equal_risks_are_broken_by_the_lower_unit_index():
    stream = [[1, 1, 1, 1]] * 3 + [[1, 5, 5, 5]]
    decisions = run(GNMRConfig(**GNMR_ONLY), stream)
    assert active_sets(decisions)[3] == [1, 2]


def test_locks_count_down_even_while_a_unit_is_missing():
    stream = [[1, 1]] * 3 + [[5, 1], [None, 1], [None, 1], [None, 1]]
    decisions = run(GNMRConfig(**GNMR_ONLY), stream)
    assert active_sets(decisions) == [[], [], [], [0], [0], [], []]


def test_lock_steps_above_255_count_in_int32():
    config = GNMRConfig(**{**GNMR_ONLY, "lock_steps": 300})
    decisions = run(config, [[1]] * 3 + [[5], [1], [1]])
    assert [d.locks[0].item() for d in decisions[3:]] == [300, 299, 298]
    assert decisions[-1].locks.dtype == torch.int32


# ----------------------------------------------------------------------------------------------- the scores


def test_risk_is_the_larger_of_gnmr_over_alpha_and_dgnmr_over_beta():
    config = GNMRConfig(max_active=1, lock_steps=1, window=2, min_history=1, alpha=2.0, beta=2.0)
    # At step 6 unit 0 has GNMR = DGNMR = 2.9 (risk 1.45); unit 1 has a small GNMR (1.07) but its previous two
    # GNMRs were tiny, so DGNMR = 3.84 (risk 1.92): it wins the one slot on DGNMR alone.
    stream = [[1, 4], [1, 4], [1, 4], [1, 1], [1, 1], [2.9, 3]]
    last = run(config, stream)[-1]
    gnmr_1 = 3 / (14 / 5)
    dgnmr_1 = gnmr_1 / ((1 / 4 + 1 / (13 / 4)) / 2)
    assert last.gnmr.tolist() == pytest.approx([2.9, gnmr_1], rel=1e-12)
    assert last.dgnmr.tolist() == pytest.approx([2.9, dgnmr_1], rel=1e-12)
    assert last.risk.tolist() == pytest.approx([1.45, dgnmr_1 / 2], rel=1e-12)
    assert last.risky.tolist() == [True, True]
    assert flat(last.active).tolist() == [1]


def test_dgnmr_is_gnmr_over_the_mean_of_the_previous_window_gnmrs():
    for window in (1, 3, 4):
        config = GNMRConfig(window=window, min_history=2, max_active=3)
        stream = random_stream(40, 5, seed=window)
        decisions = run(config, stream.tolist())
        gnmr = torch.stack([d.gnmr for d in decisions])
        dgnmr = torch.stack([d.dgnmr for d in decisions])
        first = config.min_history + window  # 0-based step with a full window of scored steps behind it
        assert dgnmr[:first].isnan().all()
        for t in range(first, 40):
            expected = gnmr[t] / gnmr[t - window : t].mean(dim=0)
            torch.testing.assert_close(dgnmr[t], expected, rtol=1e-13, atol=0)


def test_gnmr_is_the_norm_over_the_mean_of_all_past_finite_norms():
    stream = random_stream(30, 4, seed=1)
    decisions = run(GNMRConfig(min_history=1), stream.tolist())
    for t in range(1, 30):
        torch.testing.assert_close(decisions[t].gnmr, stream[t] / stream[:t].mean(dim=0), rtol=1e-13, atol=0)


def test_no_score_and_no_decision_before_min_history_past_norms():
    config = GNMRConfig(max_active=2, lock_steps=2, window=2, min_history=3, alpha=2.0, beta=2.0)
    # A huge norm during warm-up (step 2) is no reason to act: there is no history to compare it with.
    decisions = run(config, [[1.0], [100.0], [1.0], [1.0], [1.0], [1.0]])
    assert [d.scored.item() for d in decisions] == [False, False, False, True, True, True]
    assert [math.isnan(d.gnmr.item()) for d in decisions] == [True, True, True, False, False, False]
    assert not any(d.risky.item() for d in decisions)
    assert [d.risk.item() for d in decisions[:3]] == [0.0, 0.0, 0.0]


def test_dgnmr_needs_a_full_window_of_scored_steps():
    config = GNMRConfig(window=2, min_history=1, alpha=1e9, beta=1e9)
    decisions = run(config, [[1.0]] * 6)
    # GNMR from step 2 on; DGNMR from step 4, the first with GNMR at steps 2 and 3.
    assert [math.isnan(d.dgnmr.item()) for d in decisions] == [True, True, True, False, False, False]


def test_an_unscored_step_restarts_the_dgnmr_window():
    config = GNMRConfig(window=2, min_history=1, alpha=1e9, beta=1e9)
    decisions = run(config, [[1.0], [1.0], [1.0], [1.0], [None], [1.0], [1.0], [1.0]])
    # Step 5 has no score, so DGNMR waits for two new scored steps (6 and 7) and is back at step 8.
    assert [math.isnan(d.dgnmr.item()) for d in decisions] == [True, True, True, False, True, True, True, False]


def test_a_unit_whose_past_norms_are_all_zero_gets_no_score():
    # Its mean is 0, so n / mean is no measure of anything: no score until a positive norm arrives.
    decisions = run(GNMRConfig(**GNMR_ONLY), [[0.0], [0.0], [0.0], [3.0], [1.0]])
    assert [d.scored.item() for d in decisions] == [False, False, False, False, True]
    assert not any(d.risky.item() for d in decisions)
    assert decisions[4].gnmr.item() == pytest.approx(4 / 3)


def test_a_window_of_zero_gnmr_values_gives_no_dgnmr():
    # A unit whose norm was exactly 0 for `window` scored steps has a zero window mean: DGNMR would be n/0, no
    # measure of anything, so it has none (as GNMR has none over a zero mean) and GNMR alone decides.
    config = GNMRConfig(max_active=1, lock_steps=1, window=2, min_history=1, alpha=4.0, beta=1.5)
    decisions = run(config, [[1.0], [1.0], [0.0], [0.0], [2.0]])
    assert decisions[4].gnmr.item() == pytest.approx(2 / 0.5)
    assert math.isnan(decisions[4].dgnmr.item())
    assert not decisions[4].risky.item()  # GNMR 4.0 is not above alpha 4.0


def test_a_state_of_another_version_is_refused():
    controller = GNMRController(GNMRConfig(), 2)
    state = controller.json_state()
    state["version"] = 2  # gnmr-hf 0.1.0's suffix-sum window never shipped: no conversion
    with pytest.raises(ValueError, match=r"state version 2 is not supported \(expected 3\)"):
        GNMRController(GNMRConfig(), 2).load_state_dict(state)


def test_scores_and_history_are_float64_whatever_the_norms_dtype():
    controller = GNMRController(GNMRConfig(min_history=1), 2)
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        decision = controller.observe(torch.tensor([1.0, 2.0], dtype=dtype))
    assert decision.gnmr.dtype == decision.dgnmr.dtype == decision.risk.dtype == torch.float64
    assert all(v.dtype == torch.float64 for k, v in controller.state_dict().items() if k.startswith("norm_"))


def test_a_mean_over_a_million_steps_keeps_float64_precision():
    controller = GNMRController(GNMRConfig(min_history=1), 1)
    state = controller.state_dict()
    # 10^6 past norms of 0.1 (0.1 is inexact in binary, so a float32 sum would be off by ~1e-3 relative).
    state["norm_count"] = torch.tensor([1e6], dtype=torch.float64)
    state["norm_sum"] = torch.tensor([math.fsum([0.1] * 10**6)], dtype=torch.float64)
    controller.load_state_dict(state)
    assert controller.observe(torch.tensor([0.1], dtype=torch.float64)).gnmr.item() == pytest.approx(1.0, rel=1e-12)


@pytest.mark.parametrize("bad", [NAN, INF, -INF, -1.0])
def test_a_non_finite_or_negative_norm_is_maximally_risky_and_never_enters_the_history(bad):
    config = GNMRConfig(**GNMR_ONLY)
    decisions = run(config, [[2.0, 1.0], [bad, 1.0], [2.0, 1.0], [2.0, 1.0]])
    # Even during warm-up a broken gradient is a failure: risk +inf, recovery from the next step.
    assert decisions[1].risk[0].item() == INF
    assert decisions[1].risky[0].item() and not decisions[1].scored[0].item()
    assert flat(decisions[1].active).tolist() == [0]
    # Step 4's mean is over steps 1 and 3 only: (2 + 2) / 2, so GNMR = 1 (it would be 1.5 with a 0 counted).
    assert decisions[3].gnmr[0].item() == 1.0


def test_a_missing_unit_is_not_scored_not_risky_and_not_in_the_history():
    config = GNMRConfig(**GNMR_ONLY)
    decisions = run(config, [[2.0], [2.0], [None], [2.0]])
    assert not decisions[2].scored.item() and not decisions[2].risky.item()
    assert decisions[2].risk.item() == 0.0
    assert decisions[3].gnmr.item() == 1.0  # mean over the two norms seen, not three


def test_the_value_passed_for_a_missing_unit_is_ignored():
    controller = GNMRController(GNMRConfig(**GNMR_ONLY), 1)
    for _ in range(3):
        controller.observe(torch.tensor([2.0]))
    decision = controller.observe(torch.tensor([1e6]), missing=torch.tensor([True]))
    assert not decision.risky.item()
    assert controller.observe(torch.tensor([2.0])).gnmr.item() == 1.0


def test_a_scaled_unit_gets_the_same_scores_and_the_same_decisions():
    stream = random_stream(60, 6, seed=3)
    config = GNMRConfig(max_active=2, lock_steps=3, window=3, min_history=2, alpha=2.5, beta=2.5)
    reference = run(config, stream.tolist())
    for c in (1e-4, 3.7, 1e5):
        scaled = stream.clone()
        scaled[:, 2] *= c
        decisions = run(config, scaled.tolist())
        for ref, dec in zip(reference, decisions, strict=True):
            torch.testing.assert_close(dec.gnmr, ref.gnmr, rtol=1e-12, atol=0, equal_nan=True)
            torch.testing.assert_close(dec.dgnmr, ref.dgnmr, rtol=1e-12, atol=0, equal_nan=True)
            assert torch.equal(dec.active, ref.active) and torch.equal(dec.risky, ref.risky)
    assert any(d.active.any() for d in reference)  # the stream does exercise decisions


# ------------------------------------------------------------------------------------------------ schedules


def test_the_scheduled_thresholds_are_the_ones_applied():
    config = GNMRConfig(
        max_active=1,
        min_history=1,
        alpha=4.0,
        beta=1e9,
        threshold_schedule="linear",
        alpha_final=2.0,
        beta_final=1e9,
        schedule_steps=5,
    )
    # alpha_t = 4, 3.5, 3, 2.5, 2: a GNMR of 2.8 is not risky at step 3 (alpha 3) but is at step 4 (alpha 2.5).
    at_3 = run(config, [[1.0], [1.0], [2.8]])[-1]
    at_4 = run(config, [[1.0], [1.0], [1.0], [2.8]])[-1]
    assert (at_3.alpha, at_4.alpha) == (3.0, 2.5)
    assert at_3.gnmr.item() == pytest.approx(2.8) and at_4.gnmr.item() == pytest.approx(2.8)
    assert not at_3.risky.item() and at_4.risky.item()


# -------------------------------------------------------------------------------------------------- outputs


def test_a_decision_is_not_changed_by_later_steps():
    controller = GNMRController(GNMRConfig(max_active=2, window=2, min_history=1), 6)
    stream = random_stream(30, 6, seed=4)
    first = [controller.observe(stream[t]) for t in range(10)]
    snapshot = [{k: v.clone() for k, v in vars(d).items() if isinstance(v, torch.Tensor)} for d in first]
    for t in range(10, 30):
        controller.observe(stream[t])
    for decision, saved in zip(first, snapshot, strict=True):
        for name, value in saved.items():
            torch.testing.assert_close(getattr(decision, name), value, rtol=0, atol=0, equal_nan=True)


def test_to_host_carries_the_decision():
    controller = GNMRController(GNMRConfig(max_active=3, window=2, min_history=2, alpha=1.5, beta=1.5), 40)
    stream = random_stream(25, 40, seed=5)
    for t in range(25):
        decision = controller.observe(stream[t])
        host = decision.to_host(top_k=7)
        assert host.step == t + 1 and (host.alpha, host.beta) == (decision.alpha, decision.beta)
        for name in ("active", "entered", "exited", "risky"):
            assert getattr(host, name).tolist() == flat(getattr(decision, name)).tolist()
        assert host.n_scored == decision.scored.sum().item()
        assert host.n_candidates == decision.candidates.sum().item()
        scored = decision.scored | decision.risk.isinf()
        ranked = sorted((-decision.risk[i].item(), i) for i in flat(scored).tolist())[:7]
        assert host.top_units.tolist() == [i for _, i in ranked]
        assert host.top_risks.tolist() == [-r for r, _ in ranked]
        if scored.any():
            assert host.max_risk == decision.risk[scored].max().item()


def test_to_host_reports_no_max_risk_and_no_top_units_before_any_score():
    controller = GNMRController(GNMRConfig(), 5)
    host = controller.observe(torch.ones(5)).to_host(top_k=3)
    assert math.isnan(host.max_risk) and host.top_units.size == 0 and host.n_scored == 0
    assert host.exceedance_rate == 0.0


def test_to_host_rejects_a_negative_top_k():
    decision = GNMRController(GNMRConfig(), 2).observe(torch.ones(2))
    with pytest.raises(ValueError, match="top_k"):
        decision.to_host(top_k=-1)


def test_observe_makes_no_host_sync_and_to_host_makes_exactly_one_transfer(monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    # Ops whose result the host must wait for (a scalar read, or a data-dependent output size).
    syncing = {
        torch.ops.aten._local_scalar_dense.default,
        torch.ops.aten.nonzero.default,
        torch.ops.aten.masked_select.default,
        torch.ops.aten._unique2.default,
    }
    calls: dict[str, int] = {}

    class CountSyncs(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func in syncing:
                calls[str(func)] = calls.get(str(func), 0) + 1
            return func(*args, **(kwargs or {}))

    for name in ("item", "tolist", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _name=name, _original=original, **k):
            calls[_name] = calls.get(_name, 0) + 1
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    # With spikes, NaNs and missing units so that every branch runs.
    n = 5000
    controller = GNMRController(GNMRConfig(max_active=4, window=3, min_history=2), n)
    stream = random_stream(12, n, seed=6)
    stream[5, ::97] = NAN
    missing = torch.zeros(n, dtype=torch.bool)
    missing[::13] = True
    with CountSyncs():
        decisions = [controller.observe(stream[t], missing if t % 3 else None) for t in range(12)]
    assert calls == {}
    assert any(d.entered.any() for d in decisions)
    with CountSyncs():
        decisions[-1].to_host(top_k=16)
    assert calls == {"cpu": 1, "numpy": 1}


# --------------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("form", ["tensors", "json"])
@pytest.mark.parametrize("cut", [1, 9, 12, 17])
def test_resuming_from_a_saved_state_gives_the_decisions_of_an_uninterrupted_run(form, cut):
    config = GNMRConfig(max_active=2, lock_steps=3, window=4, min_history=2, alpha=2.0, beta=2.0)
    stream = random_stream(40, 7, seed=8)
    stream[6, 2] = NAN
    uninterrupted = run(config, stream.tolist())
    first = GNMRController(config, 7)
    run(config, stream[:cut].tolist(), first)
    state = first.state_dict() if form == "tensors" else json.loads(json.dumps(first.json_state()))
    resumed = GNMRController(config, 7)
    resumed.load_state_dict(state)
    assert resumed.step == cut and torch.equal(resumed.active, uninterrupted[cut - 1].active)
    for ref, dec in zip(uninterrupted[cut:], run(config, stream[cut:].tolist(), resumed), strict=True):
        assert dec.step == ref.step
        for name in ("gnmr", "dgnmr", "risk"):
            assert torch.equal(getattr(dec, name).nan_to_num(-7.0), getattr(ref, name).nan_to_num(-7.0)), name
        for name in ("scored", "risky", "candidates", "active", "entered", "exited", "locks"):
            assert torch.equal(getattr(dec, name), getattr(ref, name)), name


def test_revert_undoes_the_last_step_exactly():
    config = GNMRConfig(max_active=2, lock_steps=3, window=3, min_history=2, alpha=2.0, beta=2.0)
    stream = random_stream(20, 5, seed=9)
    reference = run(config, stream.tolist())
    controller = GNMRController(config, 5)
    decisions = []
    for t in range(20):
        if t in (4, 11):  # a step that did not happen: observed, then reverted
            controller.observe(stream[t] * 50.0)
            controller.revert()
            with pytest.raises(RuntimeError, match="no observed step to revert"):
                controller.revert()
        decisions.append(controller.observe(stream[t]))
    for ref, dec in zip(reference, decisions, strict=True):
        assert dec.step == ref.step
        assert torch.equal(dec.risk, ref.risk) and torch.equal(dec.locks, ref.locks)
        assert torch.equal(dec.dgnmr.nan_to_num(-1.0), ref.dgnmr.nan_to_num(-1.0))


def test_to_host_brings_a_caller_flag_in_the_same_transfer():
    decision = GNMRController(GNMRConfig(), 3).observe(torch.ones(3))
    assert decision.to_host(top_k=2, flag=torch.tensor(True)).flag is True
    assert decision.to_host(flag=torch.tensor(False)).flag is False
    assert decision.to_host().flag is None


def test_json_state_is_strict_json():
    controller = GNMRController(GNMRConfig(window=3), 4)
    run(controller.config, random_stream(5, 4).tolist(), controller)
    text = json.dumps(controller.json_state(), allow_nan=False)  # raises on NaN or inf
    assert json.loads(text)["step"] == 5


# ----------------------------------------------------------------------------------------------- bad input

BAD_OBSERVE = [
    ([1.0, 2.0, 3.0], None, TypeError, "torch.Tensor"),
    (torch.ones(3, 1), None, ValueError, r"1-D tensor of 3"),
    (torch.ones(4), None, ValueError, r"1-D tensor of 3"),
    (torch.ones(()), None, ValueError, r"1-D tensor of 3"),
    (torch.ones(3, dtype=torch.int64), None, TypeError, "floating-point"),
    (torch.ones(3), torch.zeros(3), TypeError, "missing must be a bool tensor"),
    (torch.ones(3), [False] * 3, TypeError, "missing must be a bool tensor"),
    (torch.ones(3), torch.zeros(4, dtype=torch.bool), ValueError, r"missing must be a bool tensor of shape \(3,\)"),
]


@pytest.mark.parametrize(("norms", "missing", "error", "message"), BAD_OBSERVE)
def test_observe_rejects_bad_input_with_a_clear_error(norms, missing, error, message):
    controller = GNMRController(GNMRConfig(), 3)
    with pytest.raises(error, match=message):
        controller.observe(norms, missing)
    assert controller.step == 0


@pytest.mark.parametrize(
    ("num_units", "config", "message"),
    [(0, GNMRConfig(), "num_units"), (True, GNMRConfig(), "num_units"), (3, {"max_active": 2}, "GNMRConfig")],
)
def test_the_controller_rejects_a_bad_construction(num_units, config, message):
    with pytest.raises((TypeError, ValueError), match=message):
        GNMRController(config, num_units)


def _saved_state(**changes):
    controller = GNMRController(GNMRConfig(window=3), 4)
    run(controller.config, random_stream(5, 4).tolist(), controller)
    state = controller.json_state()
    state.update(changes)
    return state


@pytest.mark.parametrize(
    ("state", "error", "message"),
    [
        (_saved_state(num_units=5), ValueError, "num_units=5"),
        (_saved_state(window=4), ValueError, "window=4"),
        (_saved_state(version=1), ValueError, "version 1"),
        (_saved_state(step=-1), ValueError, "step"),
        (_saved_state(norm_sum=[1.0, 2.0]), ValueError, "norm_sum has shape"),
        (_saved_state(norm_sum=[1.0, [2.0]]), ValueError, "norm_sum is not a numeric array"),
        (_saved_state(locks=[0, -1, 0, 0]), ValueError, "locks must be >= 0"),
        ({"version": 3}, KeyError, "missing"),
        ([1, 2], TypeError, "dict"),
    ],
    ids=["num_units", "window", "version", "step", "shape", "ragged", "negative_lock", "missing_keys", "not_a_dict"],
)
def test_load_state_dict_rejects_an_incompatible_state_with_a_clear_error(state, error, message):
    controller = GNMRController(GNMRConfig(window=3), 4)
    with pytest.raises(error, match=message):
        controller.load_state_dict(state)


def test_a_state_with_locks_longer_than_lock_steps_is_cut_to_lock_steps():
    controller = GNMRController(GNMRConfig(window=3, lock_steps=5), 4)
    controller.load_state_dict(_saved_state(locks=[0, 300, 2, 9]))
    assert controller.policy.locks.tolist() == [0, 5, 2, 5]
    assert controller.active.tolist() == [False, True, True, True]


def test_load_state_dict_accepts_a_json_string():
    controller = GNMRController(GNMRConfig(window=3), 4)
    controller.load_state_dict(json.dumps(_saved_state()))
    assert controller.step == 5


def test_numpy_state_values_round_trip_exactly():
    controller = GNMRController(GNMRConfig(window=3), 4)
    run(controller.config, random_stream(7, 4).tolist(), controller)
    again = GNMRController(GNMRConfig(window=3), 4)
    again.load_state_dict(json.loads(json.dumps(controller.json_state())))
    for name, value in controller.state_dict().items():
        if isinstance(value, torch.Tensor):
            np.testing.assert_array_equal(again.state_dict()[name].numpy(), value.numpy())


# ------------------------------------------------------------------------------------- relapse-aware lock (option)

# One unit, one slot: the spike at step 3 is caught (lock 2, out again at decision 5); the one at step 6 is a
# relapse (risky again within lock_steps of leaving); the one at step 19 is a fresh failure.
RELAPSE_STREAM = [[1.0], [1.0], [10.0], [1.0], [1.0], [50.0]] + [[1.0]] * 12 + [[400.0], [1.0], [1.0], [1.0]]


def locks_of(decisions) -> list[int]:
    return [int(d.locks[0]) for d in decisions]


def test_the_relapse_aware_lock_is_off_by_default_and_keeps_the_fixed_lock():
    assert GNMRConfig().relapse_lock is False
    fixed = locks_of(run(GNMRConfig(**{**GNMR_ONLY, "max_active": 1}), RELAPSE_STREAM))
    assert fixed[2:8] == [2, 1, 0, 2, 1, 0] and fixed[18:21] == [2, 1, 0]
    assert "lock_length" not in GNMRController(GNMRConfig(), 2).state_dict()


def test_a_unit_that_relapses_within_lock_steps_gets_double_its_previous_lock():
    config = GNMRConfig(**{**GNMR_ONLY, "max_active": 1}, relapse_lock=True, relapse_lock_cap=6)
    locks = locks_of(run(config, RELAPSE_STREAM))
    assert locks[2:5] == [2, 1, 0]  # first catch: the paper's lock
    assert locks[5:10] == [4, 3, 2, 1, 0]  # relapse one step after leaving: doubled
    assert locks[18:21] == [2, 1, 0]  # risky long after leaving: a fresh failure, back to lock_steps


def test_the_relapse_aware_lock_doubles_up_to_its_cap():
    config = GNMRConfig(**{**GNMR_ONLY, "max_active": 1}, relapse_lock=True, relapse_lock_cap=6)
    controller = GNMRController(config, 1)
    entry_locks, spike, exited_last_step = [], 10.0, False
    for _ in range(60):
        # A unit whose cheap path stays bad: it spikes again as soon as it is back on the cheap path.
        norm = spike if exited_last_step or controller.step == 2 else 1.0
        decision = controller.observe(torch.tensor([norm], dtype=torch.float64))
        if bool(decision.entered[0]):
            entry_locks.append(int(decision.locks[0]))
            spike *= 100.0
        exited_last_step = bool(decision.exited[0])
    assert entry_locks[:4] == [2, 4, 6, 6]


def test_a_relapse_aware_controller_resumes_with_the_decisions_of_an_uninterrupted_run():
    config = GNMRConfig(**{**GNMR_ONLY, "max_active": 1}, relapse_lock=True, relapse_lock_cap=6)
    whole = locks_of(run(config, RELAPSE_STREAM))
    first = GNMRController(config, 1)
    head = locks_of(run(config, RELAPSE_STREAM[:7], first))
    resumed = GNMRController(config, 1)
    resumed.load_state_dict(json.loads(json.dumps(first.json_state())))
    assert head + locks_of(run(config, RELAPSE_STREAM[7:], resumed)) == whole
    # A state saved without the option starts the relapse record fresh.
    plain = GNMRController(GNMRConfig(**{**GNMR_ONLY, "max_active": 1}), 1)
    run(plain.config, RELAPSE_STREAM[:3], plain)
    resumed.load_state_dict(plain.state_dict())
    assert resumed.policy.relapse.lock_length.tolist() == [2] and resumed.policy.locks.tolist() == [2]


def test_revert_undoes_the_relapse_record_of_the_last_step():
    config = GNMRConfig(**{**GNMR_ONLY, "max_active": 1}, relapse_lock=True, relapse_lock_cap=6)
    controller = GNMRController(config, 1)
    run(config, RELAPSE_STREAM[:5], controller)
    relapse = controller.policy.relapse
    before = (relapse.lock_length.clone(), relapse.exited_at.clone())
    controller.observe(torch.tensor([50.0], dtype=torch.float64))
    controller.revert()
    assert torch.equal(relapse.lock_length, before[0]) and torch.equal(relapse.exited_at, before[1])


@pytest.mark.parametrize(
    ("overrides", "error", "message"),
    [
        ({"relapse_lock": True, "lock_steps": 8, "relapse_lock_cap": 4}, ValueError, "relapse_lock_cap must be >="),
        ({"relapse_lock": "yes"}, TypeError, "relapse_lock must be a bool"),
        ({"relapse_lock_cap": 0}, ValueError, "relapse_lock_cap"),
    ],
)
def test_relapse_lock_options_are_validated_with_errors_naming_the_field(overrides, error, message):
    with pytest.raises(error, match=message):
        GNMRConfig(**overrides)


# --------------------------------------------------------------------------------- the top-k above _SORT_UP_TO


def _keys(kind: str, n: int, g: torch.Generator) -> torch.Tensor:
    if kind == "distinct":
        return torch.rand(n, generator=g, dtype=torch.float64)
    if kind == "few values":  # ties everywhere, also at the k-th place
        return torch.randint(0, 4, (n,), generator=g).double()
    if kind == "fewer candidates than k":  # most keys -1 (non-candidates), two +inf (broken norms)
        key = torch.full((n,), -1.0, dtype=torch.float64)
        key[torch.randperm(n, generator=g)[:3]] = torch.rand(3, generator=g, dtype=torch.float64)
        key[[7, n - 1]] = INF
        return key
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["distinct", "few values", "fewer candidates than k"])
@pytest.mark.parametrize("n", [4097, 20_000])
@pytest.mark.parametrize("k", [0, 1, 4, 16])
def test_top_indices_is_exactly_a_stable_descending_argsort(kind, n, k):
    from gnmr_hf.policies.base import _SORT_UP_TO, top_indices

    assert n > _SORT_UP_TO  # the topk path
    key = _keys(kind, n, torch.Generator().manual_seed(n + k))
    assert torch.equal(top_indices(key, k), torch.argsort(key, descending=True, stable=True)[:k])


def test_decisions_above_the_sort_threshold_are_those_of_the_sort(monkeypatch):
    import gnmr_hf.policies.base as policy_module

    n = 6000
    stream = random_stream(30, n, seed=3)
    stream[:, 100:200] = stream[:, 100:101]  # a block of units with identical norms: equal risks, ties
    config = GNMRConfig(max_active=8, window=3, min_history=2)

    def decide():
        controller = GNMRController(config, n)
        return [controller.observe(row) for row in stream]

    fast = decide()
    monkeypatch.setattr(policy_module, "_SORT_UP_TO", 10**9)
    sorted_ = decide()
    assert any(d.entered.any() for d in fast)
    for a, b in zip(fast, sorted_, strict=True):
        assert torch.equal(a.active, b.active) and torch.equal(a.locks, b.locks)
        host_a, host_b = a.to_host(top_k=16), b.to_host(top_k=16)
        assert np.array_equal(host_a.top_units, host_b.top_units)
