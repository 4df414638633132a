"""Every boundary of the two policies and of `gnmr-hf advise`, pinned to its exact decision sequence: the budget of
the cause policy, its incumbent factor, the relapse window of both policies, how long a measure stands in recovery,
a loss exactly at each of its bounds, and advise's `min_share`. Each test fails when its boundary moves by one
step or one comparison (`>` for `>=`, `<` for `<=`)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from test_cause import NAMES, controller

from gnmr_hf import GNMRConfig, GNMRController
from gnmr_hf.advise import advise, format_advice

# The cause policy's rules on the hand-written unit set of tests/test_cause.py: an attention unit (0), its four
# projections (1-4, its family), an MLP's three projections (5-7).
HEALTHY = 0.2
cause_controller = controller


def run(ctl: GNMRController, stream, norms=None) -> list:
    """Feed (cheap-path loss per unit) rows, flat norms unless given; the host decisions."""
    hosts = []
    for t, loss in enumerate(stream):
        n = norms[t] if norms is not None else [1.0] * ctl.num_units
        decision = ctl.observe(torch.tensor(n, dtype=torch.float64), None, torch.tensor(loss, dtype=torch.float32))
        hosts.append(decision.to_host(top_k=4))
    return hosts


def losses(base: float = HEALTHY, **at: float) -> list[float]:
    """`base` for every unit but those named by index (`u7=1.8`)."""
    row = [base] * len(NAMES)
    for key, value in at.items():
        row[int(key[1:])] = value
    return row


def above(x: float) -> float:
    """The next float32 above x: the smallest loss past a bound x."""
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


# ------------------------------------------------------------------------------------------ the cause policy


def test_the_cause_policy_holds_the_max_active_lossiest_of_more_broken_units_than_its_budget():
    # Three units past their bound (no symptom anywhere), a budget of 2: the two lossiest are held, the third waits.
    ctl = cause_controller()
    hosts = run(ctl, [losses(u2=1.5, u5=1.8, u7=1.2)] * 3)
    assert [list(h.active) for h in hosts] == [[2, 5]] * 3
    assert all(h.n_candidates == 3 for h in hosts)
    assert hosts[0].extras["cause"]["why"] == [[2, "broken", -1], [5, "broken", -1]]


def test_a_broken_unit_takes_a_held_ones_place_only_when_it_loses_more_than_the_incumbent_factor_times_as_much():
    # Budget 2, held: k_proj (1.5) and gate_proj (1.8). down_proj grows from 1.2 to just under 1.25 x 1.5 = 1.875
    # (stays out), then just over it (takes k_proj's place; gate_proj, 1.8 x 1.25, stays).
    ctl = cause_controller()
    stream = [losses(u2=1.5, u5=1.8, u7=1.2), losses(u2=1.5, u5=1.8, u7=1.87), losses(u2=1.5, u5=1.8, u7=1.88)]
    assert [list(h.active) for h in run(ctl, stream)] == [[2, 5], [2, 5], [5, 7]]


@pytest.mark.parametrize(
    "incumbent, newcomer, held",
    [
        (1, 5, 1),  # a newcomer at exactly 1.25x the incumbent ties; the tie goes to the lower index (the incumbent)
        (5, 1, 1),  # ... and here the lower index is the newcomer's
    ],
)
def test_a_newcomer_at_exactly_the_incumbent_factor_ties_and_the_tie_goes_to_the_lower_index(
    incumbent, newcomer, held
):
    ctl = cause_controller(max_active=1)
    # 1.25 and 1.5625 = 1.25 x 1.25 are exact in float32 and float64: an exact tie of the ranking keys.
    first = losses(**{f"u{incumbent}": 1.25})
    tie = losses(**{f"u{incumbent}": 1.25, f"u{newcomer}": 1.5625})
    over = losses(**{f"u{incumbent}": 1.25, f"u{newcomer}": above(1.5625)})
    hosts = run(ctl, [first, tie, over])
    assert [list(h.active) for h in hosts] == [[incumbent], [held], [newcomer]]


def test_a_fidelity_exactly_at_its_bound_is_not_broken_and_the_next_float_past_it_is():
    # The others at 0.3, so that 1.0 is under cause_peer_factor (4) x their median: only the bound can break it.
    at = run(cause_controller(), [losses(0.3, u7=1.0)] * 4)
    assert [list(h.active) for h in at] == [[]] * 4
    past = run(cause_controller(), [losses(0.3, u7=above(1.0))] * 4)
    assert [list(h.active) for h in past] == [[7]] * 4
    assert past[0].extras["cause"]["why"] == [[7, "broken", -1]]


def test_a_cause_exactly_at_cause_suspect_is_not_blamed_for_a_symptom_and_the_next_float_past_it_is():
    # q_proj's gradient spikes at step 4 (GNMR 10 > alpha 2); its family's lossiest unit is the attention unit.
    norms = [[1.0] * 8] * 3 + [[1.0, 10.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]]
    at = run(cause_controller(), [losses()] * 3 + [losses(u0=0.5)], norms)
    assert list(at[-1].risky) == [1] and list(at[-1].active) == []
    past = run(cause_controller(), [losses()] * 3 + [losses(u0=above(0.5))], norms)
    assert list(past[-1].active) == [0] and past[-1].extras["cause"]["why"] == [[0, "cause", 1]]


def test_a_unit_exactly_peer_factor_times_its_peers_median_is_not_broken_and_the_next_float_past_it_is():
    names = [f"model.layers.{i}.mlp.down_proj" for i in range(4)]
    median = 0.1875  # x 4 (cause_peer_factor) = 0.75, past cause_suspect (0.5) and under the bound: exact floats
    at = run(cause_controller(names, ["linear"] * 4), [[median, median, 0.75, median]] * 3)
    assert [list(h.active) for h in at] == [[]] * 3
    past = run(cause_controller(names, ["linear"] * 4), [[median, median, above(0.75), median]] * 3)
    assert [list(h.active) for h in past] == [[2]] * 3 and past[0].extras["cause"]["why"] == [[2, "peer", -1]]


def test_a_measure_stands_in_recovery_for_recovery_every_steps_from_the_step_it_was_taken():
    # lock_steps 4, recovery_every 3. down_proj measures 1.8 at step 1, then nothing (NaN). Its measure
    # stands at steps 2 and 3 (1 and 2 steps after it was taken: renewed to a full lock of 4), not at step 4, from
    # which its lock counts down 3, 2, 1, 0: out at step 7.
    every_3 = dict(lock_steps=4, policy_options="recovery_every=3")
    stream = [losses(u7=1.8)] + [losses(u7=math.nan)] * 7
    hosts = run(cause_controller(**every_3), stream)
    assert [7 in h.active for h in hosts] == [True] * 6 + [False] * 2
    assert [ctl_lock for ctl_lock in _locks_of(cause_controller(**every_3), stream, 7)] == [
        4, 4, 4, 3, 2, 1, 0, 0,
    ]  # fmt: skip
    assert [h.extras["cause"]["why"] for h in hosts[:4]] == [
        [[7, "broken", -1]], [[7, "broken", -1]], [[7, "broken", -1]], [[7, "countdown", -1]],
    ]  # fmt: skip


def _locks_of(ctl: GNMRController, stream, unit: int) -> list[int]:
    out = []
    for loss in stream:
        d = ctl.observe(torch.ones(ctl.num_units, dtype=torch.float64), None, torch.tensor(loss))
        out.append(int(d.locks[unit]))
    return out


@pytest.mark.parametrize("gap, doubled", [(3, True), (4, False)])
def test_the_cause_policy_doubles_the_lock_of_a_unit_reentering_within_lock_steps_of_its_exit(gap, doubled):
    # down_proj is lossy at step 1 only: held 3 steps (lock_steps), out at step 4 (its exit step). Lossy again `gap`
    # steps after that exit: within lock_steps (3) it is a relapse (a lock of 6), one step later it is not (3).
    reentry = 4 + gap
    stream = [losses(u7=1.8) if t in (1, reentry) else losses() for t in range(1, reentry + 9)]
    in_recovery = [int(7 in h.active) for h in run(cause_controller(), stream)]
    held = 6 if doubled else 3
    assert in_recovery == [1, 1, 1] + [0] * gap + [1] * held + [0] * (len(stream) - 3 - gap - held)


# ------------------------------------------------------------------------------------------ the paper's policy


@pytest.mark.parametrize("gap, doubled", [(2, True), (3, False)])
def test_the_relapse_aware_lock_doubles_the_lock_of_a_unit_reentering_within_lock_steps_of_its_exit(gap, doubled):
    # Unit 0 spikes at step 5 (GNMR 10): a lock of 2 (lock_steps), so in recovery at steps 5-6 and out at step 7.
    # It spikes again `gap` steps after that exit: within lock_steps (2) a relapse doubles its lock to 4; one step
    # later it starts again from 2.
    config = GNMRConfig(max_active=1, lock_steps=2, window=2, min_history=2, alpha=2.0, beta=1e9, relapse_lock=True)
    ctl = GNMRController(config, 2)
    reentry = 7 + gap
    in_recovery = []
    for t in range(1, reentry + 7):
        spike = 10.0 if t in (5, reentry) else 1.0
        in_recovery.append(int(0 in ctl.observe(torch.tensor([spike, 1.0], dtype=torch.float64)).to_host().active))
    held = 4 if doubled else 2
    assert in_recovery == [0] * 4 + [1, 1] + [0] * gap + [1] * held + [0] * (len(in_recovery) - 6 - gap - held)


# ------------------------------------------------------------------------------------------ gnmr-hf advise


def _trace(tmp_path, active_per_step: list[list[int]], names: list[str], left_out: list[list[int]] | None = None):
    header = {"type": "header", "version": 2, "units": names, "backend": "act_quant", "config": {"max_active": 2}}
    records, previous = [header], set()
    for step, active in enumerate(active_per_step, start=1):
        now = set(active)
        records.append(
            {
                "type": "step", "step": step, "t": step, "active": sorted(now), "entered": sorted(now - previous),
                "exited": sorted(previous - now), "risky": [], "n_scored": len(names), "n_candidates": len(now),
                "max_risk": 0.0, "top": [], "alpha": 3.0, "beta": 3.0,
            } | ({"left_out": left_out[step - 1]} if left_out is not None else {})
        )  # fmt: skip
        previous = now
    path = tmp_path / "gnmr_trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.mark.parametrize("min_share, persistent", [(0.5, True), (above(0.5), False)])
def test_advise_calls_a_unit_persistent_from_exactly_min_share_of_the_steps_since_its_first_entry(
    tmp_path, min_share, persistent
):
    # 10 steps; unit 1 enters late, at step 7, and is recovered at steps 7 and 8 of the 4 steps from its first entry
    # to the end: a share of exactly 0.5 of those (2 of the run's 10 steps, 0.2, would never pass).
    names = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    path = _trace(tmp_path, [[]] * 6 + [[1], [1], [], []], names)
    advice = advise(path, min_share=min_share)
    assert advice.units[1].first_entry == 7 and advice.units[1].recovered == 2
    assert advice.names == (["model.layers.1.self_attn"] if persistent else [])


def test_advise_counts_a_late_units_share_from_its_first_entry_not_from_the_start_of_the_run(tmp_path):
    # The same 2 steps recovered, one step earlier: 2 of 5 steps since its first entry (0.4) is not persistent.
    names = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    assert advise(_trace(tmp_path, [[]] * 5 + [[1], [1], [], [], []], names)).names == []
    assert advise(_trace(tmp_path, [[]] * 6 + [[1], [1], [], []], names)).names == [names[1]]


@pytest.mark.parametrize("left_out_steps, listed", [(3, True), (2, False)])
def test_advise_lists_a_unit_the_budget_left_out_at_min_share_of_the_steps_from_the_first_time_on(
    tmp_path, left_out_steps, listed, capsys
):
    # Unit 0 is held at every step; unit 1 asks from step 5 of 10 and is left out at `left_out_steps` of those 6 steps.
    names = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
    left = [[]] * 4 + [[1]] + [[1]] * (left_out_steps - 1) + [[]] * (6 - left_out_steps)
    advice = advise(_trace(tmp_path, [[0]] * 10, names, left_out=left))
    assert advice.names == [names[0], names[1]] if listed else [names[0]]
    if listed:
        text, _ = format_advice(advice)
        assert (
            "  model.layers.1.self_attn: left out by the budget at 3 steps from step 5 on; 0 steps recovered" in text
        )
