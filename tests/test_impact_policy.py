"""The impact policy (`policy="impact"`), rule by rule on a hand-written unit set: what is material, the budget, the
incumbent factor, the hold and the release, the relapse lock, a broken norm, a unit that measures nothing, the
symptom's family measured at the next step, its options, its state. Each boundary test fails when its comparison
moves (`>` for `>=`) or its step moves by one."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from gnmr_hf import GNMRConfig, GNMRController
from gnmr_hf.policies.impact import ImpactOptions

# An attention block's four projections (0-3, one family) and an MLP's three (4-6, another).
NAMES = [
    "model.layers.0.self_attn.q_proj",
    "model.layers.0.self_attn.k_proj",
    "model.layers.0.self_attn.v_proj",
    "model.layers.0.self_attn.o_proj",
    "model.layers.0.mlp.gate_proj",
    "model.layers.0.mlp.up_proj",
    "model.layers.0.mlp.down_proj",
]
MIN = 0.01
BASE = dict(max_active=2, lock_steps=3, window=2, min_history=2, alpha=2.0, beta=1e9, policy="impact")


def controller(**options) -> GNMRController:
    overrides = {k: options.pop(k) for k in list(options) if k in BASE or k == "relapse_lock_cap"}
    config = GNMRConfig(**{**BASE, **overrides, "policy_options": {"min_impact": MIN, "smoothing": 1.0, **options}})
    return GNMRController(config, len(NAMES), names=NAMES, kinds=["linear"] * len(NAMES))


def impacts(base: float = 0.001, **at: float) -> list[float]:
    """`base` for every unit but those named by index (`u6=0.5`); math.nan: not measured this step."""
    row = [base] * len(NAMES)
    for key, value in at.items():
        row[int(key[1:])] = value
    return row


def run(ctl: GNMRController, stream, norms=None) -> list:
    hosts = []
    for t, row in enumerate(stream):
        n = norms[t] if norms is not None else [1.0] * ctl.num_units
        decision = ctl.observe(
            torch.tensor(n, dtype=torch.float64), None, None, torch.tensor(row, dtype=torch.float32)
        )
        hosts.append(decision.to_host(top_k=4))
    return hosts


def active(hosts) -> list[list[int]]:
    return [[int(i) for i in h.active] for h in hosts]


def above(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(np.inf)))


def test_a_unit_is_material_only_when_its_impact_is_past_min_impact():
    ctl = controller()
    hosts = run(ctl, [impacts(u6=MIN), impacts(u6=above(MIN))])
    assert active(hosts) == [[], [6]]


def test_with_no_material_unit_the_policy_spends_nothing_whatever_gnmr_says():
    # Unit 2's gradient norm spikes 10x after warm-up (risky by GNMR), but every unit's impact is small.
    norms = [[1.0] * 7] * 3 + [[1.0, 1.0, 10.0, 1.0, 1.0, 1.0, 1.0]]
    hosts = run(controller(), [impacts()] * 4, norms)
    assert 2 in hosts[3].risky
    assert active(hosts) == [[], [], [], []] and all(h.n_candidates == 0 for h in hosts)


def test_the_budget_goes_to_the_max_active_largest_impacts():
    hosts = run(controller(), [impacts(u1=0.05, u4=0.2, u6=0.1)] * 2)
    assert active(hosts) == [[4, 6], [4, 6]]
    assert hosts[0].n_candidates == 3 and list(hosts[0].left_out) == [1]


def test_a_newcomer_takes_an_incumbents_place_only_past_the_incumbent_factor():
    # Held: 4 (0.2) and 6 (0.1). Unit 1 rises to just under 1.25 x 0.1 (stays out), then past it (takes 6's place).
    stream = [impacts(u1=0.05, u4=0.2, u6=0.1), impacts(u1=0.1249, u4=0.2, u6=0.1), impacts(u1=0.1251, u4=0.2, u6=0.1)]
    assert active(run(controller(), stream)) == [[4, 6], [4, 6], [1, 4]]


def test_a_held_unit_stays_while_material_and_leaves_lock_steps_after_it_stops_being_so():
    # lock_steps=3: material at steps 1-3, small from step 4 on: held through step 3 + 2 countdown steps.
    stream = [impacts(u6=0.1)] * 3 + [impacts()] * 4
    assert active(run(controller(), stream)) == [[6], [6], [6], [6], [6], [], []]


def test_an_estimate_stands_between_measures():
    # Unit 6 measured once (material), then not measured (NaN): its estimate stands and it stays held.
    stream = [impacts(u6=0.1)] + [impacts(u6=math.nan)] * 5
    assert active(run(controller(), stream)) == [[6]] * 6


def test_smoothing_weighs_a_new_measure_against_the_running_estimate():
    ctl = controller(smoothing=0.5)
    run(ctl, [impacts(u6=0.1), impacts(u6=0.0)])
    assert ctl.policy.estimate[6].item() == pytest.approx(0.05)


def test_a_relapse_within_lock_steps_of_the_release_doubles_the_lock():
    # Material at step 1 only: held through step 3 (lock 3), released at step 4. Material again at step 5, within
    # lock_steps of the release: a relapse, so its lock is 6 (the relapse cap allows it): held steps 5-10.
    stream = [impacts(u6=0.1)] + [impacts()] * 3 + [impacts(u6=0.1)] + [impacts()] * 7
    hosts = run(controller(), stream)
    assert [6 in h.active for h in hosts] == [True] * 3 + [False] + [True] * 6 + [False] * 2
    # Entering again exactly lock_steps after the release (step 7) is still a relapse; one step later, a fresh lock.
    for gap, lock in ((5, 6), (6, 3)):
        stream = [impacts(u6=0.1)] + [impacts()] * gap + [impacts(u6=0.1)] + [impacts()] * 7
        hosts = run(controller(), stream)
        expected = [True] * 3 + [False] * (gap - 2) + [True] * lock + [False] * (8 - lock)
        assert [6 in h.active for h in hosts] == expected


def test_a_broken_norm_comes_first_and_a_unit_without_an_estimate_follows_the_papers_rule():
    # Unit 0's norm is inf at step 3 (broken); unit 3 never measures (NaN) and its norm spikes: a risky unit without
    # an estimate ranks as min_impact x its risk, below unit 6's large impact. Budget 2: 0 (broken), 6.
    nan_3 = impacts(u3=math.nan, u6=0.5)
    norms = [[1.0] * 7] * 2 + [[math.inf, 1.0, 1.0, 50.0, 1.0, 1.0, 1.0]]
    hosts = run(controller(), [nan_3] * 3, norms)
    assert active(hosts)[2] == [0, 6]
    assert 3 in hosts[2].left_out
    # With room for it, the risky unmeasured unit is held on the paper's rule.
    hosts = run(controller(max_active=3), [nan_3] * 3, norms)
    assert active(hosts)[2] == [0, 3, 6]


def test_a_symptom_has_its_family_measured_at_the_next_step():
    # Unit 5's norm spikes (risky by GNMR): the MLP family (4-6) is asked to measure; the attention family is not.
    norms = [[1.0] * 7] * 2 + [[1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 1.0]]
    hosts = run(controller(), [impacts()] * 3, norms)
    assert hosts[1].extras["impact"]["measure"] == []
    assert hosts[2].extras["impact"]["measure"] == [4, 5, 6]


# Unit 2's norm rises 10x a step from step 3 on (a lasting symptom); it last measured at step 0 (0.001, cheap).
RISING = [[1.0] * 7] * 3 + [[1.0, 1.0, 10.0**k, 1.0, 1.0, 1.0, 1.0] for k in range(1, 8)]


def test_a_symptom_newer_than_the_units_estimate_is_probed_for_one_step_and_at_most_once_in_lock_steps():
    stream = [impacts()] + [impacts(u2=math.nan)] * 9
    hosts = run(controller(), stream, RISING)
    assert all(2 in h.risky for h in hosts[3:])
    # Probed at step 3 (in recovery at step 4), released when it is not material; re-probed lock_steps + 1 later.
    assert active(hosts) == [[], [], [], [2], [], [], [], [2], [], []]
    # The probe's own measure at the next step is cheap: released all the same.
    stream = [impacts()] + [impacts(u2=math.nan)] * 3 + [impacts(u2=0.001)] + [impacts(u2=math.nan)] * 2
    assert active(run(controller(), stream, RISING[:7])) == [[], [], [], [2], [], [], []]


def test_a_probe_whose_measure_is_material_is_held_while_it_stays_material():
    stream = [impacts()] + [impacts(u2=math.nan)] * 3 + [impacts(u2=0.1)] + [impacts(u2=math.nan)] * 5
    hosts = run(controller(), stream, RISING)
    assert [2 in h.active for h in hosts] == [False] * 3 + [True] * 7


def test_a_symptom_on_a_unit_measured_at_that_step_or_with_probe_off_waits_for_its_measure():
    # Measured at the symptom's step and cheap: nothing to probe (the estimate is as new as the symptom).
    hosts = run(controller(), [impacts()] * 6, RISING[:6])
    assert active(hosts) == [[]] * 6
    # probe=False: the symptom's family measures at the next step; the unit enters, if material, the step after.
    stream = [impacts()] + [impacts(u2=math.nan)] * 3 + [impacts(u2=0.1)] + [impacts(u2=math.nan)]
    hosts = run(controller(probe=False), stream, RISING[:6])
    assert active(hosts) == [[], [], [], [], [2], [2]]
    assert hosts[3].extras["impact"]["measure"] == [0, 1, 2, 3]


def test_a_probe_ranks_as_the_papers_rule_below_a_larger_impact():
    # Budget 1, unit 6 material (0.5): the probe (min_impact x risk) does not take its place.
    stream = [impacts(u6=0.5)] + [impacts(u2=math.nan, u6=0.5)] * 4
    hosts = run(controller(max_active=1), stream, RISING[:5])
    assert active(hosts) == [[6]] * 5 and 2 in hosts[3].left_out


def below(x: float) -> float:
    return float(np.nextafter(np.float32(x), np.float32(-np.inf)))


def test_a_unit_far_from_the_bar_to_the_budget_on_its_side_is_quiet_and_an_unmeasured_one_never_is():
    # Budget 2: units 4 (0.2) and 6 (0.1) are held, and the bar is the 2nd largest estimate (0.1), so a unit is
    # quiet under 0.5 x 0.1: unit 2 just under it, unit 0 far under; unit 1 at it is not (nor would 0.06 be, were
    # the bar the largest estimate); units 3 and 5 have no estimate.
    ctl = controller()
    hosts = run(ctl, [impacts(base=math.nan, u0=0.001, u1=0.05, u2=below(0.05), u4=0.2, u6=0.1)])
    assert active(hosts) == [[4, 6]]
    assert ctl.policy.quiet_mask.tolist() == [True, False, True, False, False, False, False]
    assert hosts[0].extras["impact"]["quiet"] == 2
    # A held unit is quiet over quiet_above (2) x the bar: unit 4 at 0.2 is not, just over it is.
    ctl = controller()
    run(ctl, [impacts(base=math.nan, u4=above(0.2), u6=0.1)])
    assert ctl.policy.quiet_mask.tolist() == [False, False, False, False, True, False, False]
    ctl = controller(quiet_above=math.inf)
    run(ctl, [impacts(base=math.nan, u4=1.0, u6=0.1)])
    assert not ctl.policy.quiet_mask.any()
    # Its last measure must be over it too: a held unit whose cost has gone (1.0, then 0.02 = 2 x the min_impact
    # bar) leaves the slower rotation while its running estimate (0.51) comes down.
    ctl = controller(smoothing=0.5)
    hosts = run(ctl, [impacts(base=math.nan, u6=1.0), impacts(base=math.nan, u6=0.02)])
    assert active(hosts) == [[6], [6]] and ctl.policy.estimate[6] == pytest.approx(0.51)
    assert hosts[0].extras["impact"]["quiet"] == 1 and not ctl.policy.quiet_mask[6]
    ctl = controller(quiet_above=1.0)
    run(ctl, [impacts(base=math.nan, u4=0.2, u6=0.1)])
    assert ctl.policy.quiet_mask.tolist() == [False, False, False, False, True, False, False]
    ctl = controller()
    run(ctl, [impacts(base=math.nan, u1=0.06, u4=0.2, u6=0.1)])
    assert not ctl.policy.quiet_mask[1]
    # Under the budget's k-th estimate the bar is min_impact (0.01): quiet under 0.005, and the held unit 6 over 0.02.
    ctl = controller()
    run(ctl, [impacts(base=math.nan, u1=below(0.005), u2=above(0.005), u6=0.5)])
    assert ctl.policy.quiet_mask.tolist() == [False, True, False, False, False, False, True]
    # A held unit whose estimate falls near the bar, or under it, measures at its usual turns while its lock runs
    # (so that it is released).
    ctl = controller()
    hosts = run(ctl, [impacts(u6=0.5), impacts(base=math.nan, u6=0.0001)])
    assert active(hosts) == [[6], [6]] and not ctl.policy.quiet_mask[6]
    # quiet_below sets the share; quiet_factor=1: no unit is quiet, and the meters keep one rotation.
    ctl = controller(quiet_below=0.02)
    run(ctl, [impacts(base=math.nan, u1=below(0.002), u2=above(0.002), u4=0.2, u6=0.1)])
    assert ctl.policy.quiet_mask.tolist() == [False, True, False, False, False, False, False]
    ctl = controller(quiet_factor=1)
    run(ctl, [impacts()])
    assert ctl.policy.impact_quiet() is None and not ctl.policy.quiet_mask.any()
    every, mask = controller(every=3).policy.impact_quiet()
    assert every == 12 and mask.shape == (7,)


def test_the_quiet_units_survive_a_resume_and_a_reverted_step_takes_them_back():
    ctl = controller()
    run(ctl, [impacts(u4=0.2, u6=0.1)])
    quiet = ctl.policy.quiet_mask.tolist()
    assert quiet == [True, True, True, True, False, True, False]
    restored = controller()
    mask = restored.policy.quiet_mask
    restored.load_state_dict(json.loads(json.dumps(ctl.json_state())))
    # In place: the impact meters hold this array.
    assert restored.policy.quiet_mask is mask and mask.tolist() == quiet
    # A step that wakes unit 0 up, reverted (the fp16 loss scaler skipped it): unit 0 is quiet again.
    run(ctl, [impacts(u0=0.3, u4=0.2, u6=0.1)])
    assert not ctl.policy.quiet_mask[0]
    ctl.revert()
    assert ctl.policy.quiet_mask.tolist() == quiet
    # The last measures are state too: a held unit whose last measure fell stays off the slower rotation after a
    # resume; a state saved before they were kept takes the running estimate for them.
    ctl = controller(smoothing=0.5)
    run(ctl, [impacts(base=math.nan, u6=1.0), impacts(base=math.nan, u6=0.02)])
    restored = controller(smoothing=0.5)
    restored.load_state_dict(json.loads(json.dumps(ctl.json_state())))
    assert not restored.policy.quiet_mask[6] and restored.policy.last_measure[6] == pytest.approx(0.02)
    old = {k: v for k, v in ctl.state_dict().items() if k != "impact_last"}
    restored = controller(smoothing=0.5)
    restored.load_state_dict(old)
    assert restored.policy.quiet_mask[6] and restored.policy.last_measure[6] == pytest.approx(0.51)


def test_the_trace_gets_the_estimates_of_the_units_measured_this_step():
    hosts = run(controller(), [impacts(base=math.nan, u2=0.003, u6=0.2)])
    assert hosts[0].extras["impact"]["estimate"] == [[2, pytest.approx(0.003)], [6, pytest.approx(0.2)]]
    json.dumps(hosts[0].extras)  # JSON-safe, as the trace writes it


def test_a_non_finite_impact_is_the_largest_and_stays_so_until_a_finite_one_replaces_it():
    hosts = run(controller(max_active=1), [impacts(u4=0.5, u1=math.inf), impacts(u4=0.5, u1=math.nan)])
    assert active(hosts) == [[1], [1]]


def test_the_state_round_trips_through_json_and_a_reverted_step_leaves_no_trace():
    stream = [impacts(u6=0.1, u1=0.02), impacts(u1=math.nan)]
    ctl = controller()
    run(ctl, stream)
    restored = controller()
    restored.load_state_dict(json.loads(json.dumps(ctl.json_state())))
    nxt = [impacts(u4=0.3)]
    assert active(run(restored, nxt)) == active(run(ctl, nxt))
    before = ctl.policy.estimate.clone()
    run(ctl, [impacts(u0=0.9)])
    ctl.revert()
    assert torch.equal(ctl.policy.estimate.nan_to_num(-1), before.nan_to_num(-1))


def test_a_probe_survives_a_resume_and_a_state_saved_before_probes_loads_with_none():
    # Probed at step 3; a resume at step 5 must not re-probe before step 7 (lock_steps after the probe).
    stream = [impacts()] + [impacts(u2=math.nan)] * 9
    ctl = controller()
    run(ctl, stream[:5], RISING[:5])
    restored = controller()
    restored.load_state_dict(json.loads(json.dumps(ctl.json_state())))
    after = active(run(restored, stream[5:], RISING[5:]))
    assert after == active(run(ctl, stream[5:], RISING[5:])) == [[], [], [2], [], []]
    old = {k: v for k, v in ctl.state_dict().items() if k != "impact_probed_at"}
    restored.load_state_dict(old)
    assert (restored.policy.probed_at < 0).all()
    # A reverted step (the fp16 loss scaler skipped it) takes its probe back.
    ctl = controller()
    run(ctl, stream[:3], RISING[:3])
    run(ctl, stream[3:4], RISING[3:4])
    assert (ctl.policy.probed_at >= 0).any()
    ctl.revert()
    assert (ctl.policy.probed_at < 0).all()


def test_a_state_saved_by_the_papers_policy_loads_with_no_estimate():
    paper = GNMRController(GNMRConfig(**{**BASE, "policy": "paper"}), len(NAMES), names=NAMES)
    paper.observe(torch.ones(len(NAMES), dtype=torch.float64))
    ctl = controller()
    ctl.load_state_dict(paper.state_dict())
    assert ctl.policy.estimate.isnan().all()


@pytest.mark.parametrize(
    "options, message",
    [
        ({"min_impact": 0}, "option 'min_impact' must be a finite number > 0"),
        ({"min_impact": math.inf}, "option 'min_impact' must be a finite number > 0"),
        ({"smoothing": 1.5}, "option 'smoothing' must be in (0, 1]"),
        ({"every": 0}, "option 'every' must be an int >= 1"),
        ({"rows": -1}, "option 'rows' must be an int >= 0"),
        ({"probe": "yes"}, "option 'probe' must be bool (true or false)"),
        ({"quiet_factor": 0}, "option 'quiet_factor' must be an int >= 1"),
        ({"quiet_below": 0}, "option 'quiet_below' must be a finite number > 0"),
        ({"quiet_above": 0.5}, "option 'quiet_above' must be a number >= 1 (inf: none in recovery), got 0.5"),
        ({"quiet_above": math.nan}, "option 'quiet_above' must be a number >= 1"),
    ],
)
def test_bad_options_are_refused_naming_the_option(options, message):
    with pytest.raises((ValueError, TypeError), match=message.replace("(", r"\(").replace(")", r"\)")):
        ImpactOptions.parse(options)


def test_bad_options_name_the_config_field_when_the_callback_is_built():
    from gnmr_hf import GNMRCallback

    with pytest.raises(ValueError, match=r"GNMRConfig.policy_options: impact .*'every'"):
        GNMRCallback(GNMRConfig(policy="impact", policy_options="every=0", backend="block_fp"))
