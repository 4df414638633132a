"""The policy seam: a policy is one object behind one interface, registered and chosen by name like a backend; the
controller names none; a state saved before the seam loads and continues with the same decisions; a budget that
binds says so at run time."""

from __future__ import annotations

import json
import logging
import re
import runpy
import sys
from pathlib import Path

import pytest
import torch

from gnmr_hf import Choice, GNMRCallback, GNMRConfig, GNMRController, Policy, Scores, register_policy
from gnmr_hf.policy import get_policy, known_policies
from gnmr_hf.trace import TraceSummary

from trainer_utils import gnmr_of, make_trainer

ROOT = Path(__file__).resolve().parents[1]


def test_the_built_in_policies_are_found_by_name_and_the_controller_builds_the_configs_one():
    assert {"paper", "cause"} <= set(known_policies())
    assert GNMRController(GNMRConfig(), 2).policy.name == "paper"
    cause = GNMRController(GNMRConfig(policy="cause"), 2, names=["a", "b"], kinds=["linear", "linear"])
    assert cause.policy.name == "cause" and type(cause.policy) is get_policy("cause")


def test_an_unknown_policy_or_option_is_refused_when_the_callback_is_built_naming_the_field():
    with pytest.raises(ValueError, match=r"GNMRConfig\.policy: unknown policy 'oracle'; known policies are \["):
        GNMRCallback(GNMRConfig(backend="act_quant", policy="oracle"))
    with pytest.raises(ValueError, match=r"GNMRConfig\.policy_options: paper has unknown options \['budget'\]"):
        GNMRCallback(GNMRConfig(backend="act_quant", policy_options="budget=3"))


def test_a_built_in_policy_cannot_be_replaced_and_a_registered_one_must_be_a_policy():
    class Impostor(Policy):
        name = "paper"

        def step(self, scores: Scores) -> Choice:
            return Choice(self.active, self.active)

    with pytest.raises(ValueError, match="built-in policy"):
        register_policy(Impostor)
    with pytest.raises(TypeError, match="Policy subclass"):
        register_policy(object)  # type: ignore[arg-type]


def _recovery_sets(controller: GNMRController, steps: int, unit: int, spike_step: int) -> list[list[int]]:
    """The recovery set decided at each step of flat norms, with `unit`'s x20 at `spike_step`."""
    active = []
    for step in range(1, steps + 1):
        norms = torch.ones(controller.num_units, dtype=torch.float64)
        norms[unit] = 20.0 if step == spike_step else 1.0
        active.append(controller.observe(norms).active.nonzero().flatten().tolist())
    return active


def test_the_example_policy_is_one_file_and_one_registration_and_decides_as_its_docstring_says():
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        module = runpy.run_path(str(ROOT / "examples" / "no_lock_policy.py"))
    finally:
        sys.path.remove(str(ROOT / "examples"))
    assert get_policy("no_lock") is module["NoLockPolicy"]
    config = GNMRConfig(policy="no_lock", policy_options="min_risk=2", max_active=1, min_history=2, window=2)
    active = _recovery_sets(GNMRController(config, 3), steps=8, unit=1, spike_step=5)
    assert active == [[], [], [], [], [1], [], [], []]  # recovered for the one step after its spike: no lock
    with pytest.raises(ValueError, match="min_risk"):
        GNMRController(GNMRConfig(policy="no_lock", policy_options="min_risk=0.5"), 3)


@pytest.mark.parametrize("policy", ["paper", "cause"])
def test_a_controller_state_saved_before_the_policy_seam_loads_and_continues_with_the_same_decisions(policy):
    # Written by the controller of commit 58f8393 (before the seam): its JSON state after 8 steps of a stream with
    # spikes and a broken unit, the next 8 steps of that stream, and the recovery sets it decided for them.
    saved = json.loads((ROOT / "tests" / "data" / "controller_state_before_policy_seam.json").read_text())[policy]
    names = [f"model.layers.{i}.{u}" for i in (0, 1) for u in ("self_attn", "self_attn.q_proj", "mlp.down_proj")]
    kinds = ["attention", "linear", "linear"] * 2
    controller = GNMRController(GNMRConfig(**saved["config"]), 6, names=names, kinds=kinds)
    controller.load_state_dict(saved["state"])
    after = [
        controller.observe(torch.tensor(n, dtype=torch.float64), None, torch.tensor(f)).active.nonzero()
        for n, f in saved["stream"]
    ]
    assert [a.flatten().tolist() for a in after] == saved["after"]
    assert any(saved["after"])


class Greedy(Policy):
    """Every risky unit, whatever the budget: the mistake the controller must catch."""

    name = "greedy"

    def step(self, scores: Scores) -> Choice:
        self.active = scores.risky.clone()
        return Choice(self.active, scores.risky)


def _greedy_decision(policy: type[Policy]):
    """The decision of step 2 of `policy` over 4 units with max_active=2, where 3 units spike."""
    register_policy(policy)
    controller = GNMRController(GNMRConfig(policy=policy.name, max_active=2, min_history=1, window=1), 4)
    controller.observe(torch.ones(4, dtype=torch.float64)).to_host()
    return controller.observe(torch.tensor([10.0, 10.0, 10.0, 1.0], dtype=torch.float64))


def test_a_policy_that_puts_more_than_max_active_units_in_recovery_fails_naming_it_the_count_and_max_active():
    decision = _greedy_decision(Greedy)
    message = r"^policy 'greedy' put 3 units in recovery at step 2, more than max_active=2: .* capped = False$"
    with pytest.raises(RuntimeError, match=message):
        decision.to_host()


def test_a_policy_declared_uncapped_may_hold_more_than_max_active():
    class Carve(Greedy):
        name = "greedy_carve"
        capped = False

    assert list(_greedy_decision(Carve).to_host().active) == [0, 1, 2]


def test_the_built_in_policies_are_capped_and_only_the_baselines_that_hold_a_set_are_not():
    import gnmr_hf.experiments.baselines  # noqa: F401  (registers the baselines)

    uncapped = {name for name in known_policies() if not get_policy(name).capped}
    assert {"paper", "cause", "impact", "random", "global_z", "static_low"} <= set(known_policies()) - uncapped
    assert {"static_high", "carve_out", "carve_named", "carve_first_last"} <= uncapped


def test_the_summary_names_the_units_the_budget_left_out_and_the_max_active_that_would_hold_them():
    summary = TraceSummary(unit_names=["a", "b", "c", "d"])
    for step in range(1, 11):
        # a and b are held; c asks at every step from step 3 and is left out; d is left out at one step only.
        summary.add(active=[0, 1], entered=[], exited=[], risky=[], left_out=[2] * (step >= 3) + [3] * (step == 5))
    assert summary.left_out() == [("c", 8), ("d", 1)]
    assert summary.left_out(persistent=True) == [("c", 8)]  # d: 1 of the 6 steps from its first on
    assert summary.max_candidates_seen == 4
    assert "units left out by the budget (steps): c 8, d 1; max_active=4 would have held every unit" in (
        summary.format()
    )
    restored = TraceSummary(unit_names=["a", "b", "c", "d"])
    restored.load_state(json.loads(json.dumps(summary.state())))
    assert restored.left_out(persistent=True) == [("c", 8)] and restored.max_candidates_seen == 4


def test_a_trace_written_before_left_outs_were_recorded_reads_its_risky_units_outside_active_as_left_out():
    summary = TraceSummary(unit_names=["a", "b"])
    summary.add_record({"type": "step", "step": 1, "active": [0], "entered": [0], "exited": [], "risky": [0, 1]})
    assert summary.left_out() == [("b", 1)] and summary.over_budget_steps == 1


class _EveryUnitAsks(Policy):
    """Every unit asks for recovery at every step; the budget decides."""

    name = "every_unit_asks"

    def step(self, scores: Scores) -> Choice:
        candidates = torch.ones_like(scores.risky)
        self.active = torch.zeros_like(candidates)
        self.active[: self.config.max_active] = True
        return Choice(self.active, candidates)


def test_a_run_whose_budget_left_units_out_persistently_warns_at_train_end_naming_them(
    tiny_llama_dir, dataset, tmp_path, caplog
):
    if "every_unit_asks" not in known_policies():
        register_policy(_EveryUnitAsks)
    # 4 units (layer 0's q and k projections, both layers' o projections), a budget of 2: the o projections are left
    # out at every step.
    include = [r"layers\.0\.self_attn\.[qk]_proj$", r"o_proj$"]
    config = GNMRConfig(policy="every_unit_asks", max_active=2, include=include)
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, gnmr=config, max_steps=4, spike_step=0)
    with caplog.at_level(logging.WARNING, logger="gnmr_hf"):
        trainer.train()
    assert gnmr_of(trainer).units.names == [
        "model.layers.0.self_attn.q_proj",
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.o_proj",
        "model.layers.1.self_attn.o_proj",
    ]
    warnings = [r.getMessage() for r in caplog.records if "the budget was full" in r.getMessage()]
    assert len(warnings) == 1
    assert (
        "2 units asked for recovery and were left out at least half of the steps from the first time on: "
        "model.layers.0.self_attn.o_proj (4 steps), model.layers.1.self_attn.o_proj (4 steps). max_active=4 would "
        "have held every unit that asked (it is 2). `gnmr-hf advise " in warnings[0]
    )
    trace = [json.loads(line) for line in (tmp_path / "gnmr_trace.jsonl").read_text().splitlines()[1:]]
    assert [(r["active"], r["left_out"], r["n_candidates"]) for r in trace] == [([0, 1], [2, 3], 4)] * 4
    summary = json.loads((tmp_path / "gnmr_summary.json").read_text())
    assert summary["max_candidates_seen"] == 4 and summary["steps_with_units_left_out"] == 4


def test_the_policy_of_the_method_docs_runs_as_shown():
    docs = (ROOT / "docs" / "method.md").read_text()
    section = docs.split("## The policy seam", 1)[1].split("\n## ", 1)[0]
    (snippet,) = re.findall(r"```python\n(.*?)```", section, re.S)
    namespace: dict = {}
    exec(compile(snippet, "docs/method.md", "exec"), namespace)
    controller = GNMRController(GNMRConfig(policy="no_lock", max_active=1, min_history=2, window=2), 3)
    active = _recovery_sets(controller, steps=7, unit=2, spike_step=4)
    assert active == [[], [], [], [2], [], [], []] and type(controller.policy) is namespace["NoLockPolicy"]


def _runs(root: Path, actives: list[list[int]], extra: dict | None = None, loss: float = 1.5) -> Path:
    folder = root / "gnmr" / "seed0"
    folder.mkdir(parents=True)
    lines = [{"type": "header", "version": 2, "units": ["a", "b", "c"]}]
    for step, active in enumerate(actives, start=1):
        lines.append({"type": "step", "step": step, "active": active, "risky": []} | (extra or {}))
    (folder / "gnmr_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    (folder / "result.json").write_text(json.dumps({"final_eval_loss": loss}))
    return root


def test_compare_traces_finds_the_first_differing_decision_and_names_the_fields_only_one_side_has(tmp_path, capsys):
    compare = runpy.run_path(str(ROOT / "benchmarks" / "compare_traces.py"))["main"]
    before = _runs(tmp_path / "before", [[], [1], [1]])
    same = _runs(tmp_path / "same", [[], [1], [1]], extra={"left_out": []})
    other = _runs(tmp_path / "other", [[], [1], [2]])
    assert compare([str(before), str(same)]) == 0
    assert "same  gnmr/seed0: the same 3 steps, final validation loss 1.5; compared without left_out" in (
        capsys.readouterr().out
    )
    assert compare([str(before), str(other)]) == 1
    assert "DIFFERENT  gnmr/seed0: step 3: active differs ([1] against [2])" in capsys.readouterr().out
