"""The impact estimate (`gnmr_hf.impact`), `gnmr_hf.plan` and the impact policy in a Trainer: the estimate is the
Fisher-weighted output change it says it is, it finds a planted lossy unit where the counterfactual oracle does, it
is the same under gradient accumulation and checkpointing, a measuring step trains exactly as any other, plan leaves
nothing on the model, and a Trainer run holds the planted unit while the others take turns measuring."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import TrainerCallback, TrainingArguments

from gnmr_hf import GNMRCallback, GNMRConfig, GNMRTrainer, find_units, plan
from gnmr_hf.advise import advise, format_advice
from gnmr_hf.experiments.faults import inject_fault
from gnmr_hf.experiments.pretrain import build_model, llama_config
from gnmr_hf.impact import ImpactMeter, QuietTurns, impacts
from gnmr_hf.quant import random_hadamard, rotate_rows
from gnmr_hf.trace import read_trace

from trainer_utils import step_impacts

FAULTY = "model.layers.1.mlp.up_proj"
OPTIONS = {"low_format": "e4m3", "high_format": "bf16"}


def tiny(seed: int = 0) -> nn.Module:
    return build_model(llama_config(d_model=32, n_layers=2, n_heads=2, seq_len=16), seed)


def batches(count: int = 2, size: int = 4, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.randint(0, 256, (size, 16), generator=g)
        out.append({"input_ids": ids, "labels": ids})
    return out


class _Unit:
    name, backend, closed = "u", "test", False


def test_the_impact_is_half_n_times_the_fisher_weighted_output_change_summed_over_every_row():
    unit = _Unit()
    meter = ImpactMeter(unit)
    meter.start(0, clock=lambda: 0)
    y = torch.randn(3, 5, 4, requires_grad=True)
    delta = torch.randn(15, 4)
    meter.offer(y, delta, None)
    weights = torch.randn(3, 5, 4)
    (y * weights).sum().div(15).backward()  # a mean over 15 tokens: dL/dY = weights / 15
    (value,) = impacts([meter.take()], torch.device("cpu"))
    expected = 0.5 * 15 * ((weights / 15).reshape(15, 4).square() * delta.square()).sum()
    assert value.item() == pytest.approx(expected.item(), rel=1e-5)
    assert meter.take() is None  # taken once


def test_a_sample_of_rows_stands_for_every_row_and_a_loss_scale_is_divided_out_squared():
    unit = _Unit()
    meter = ImpactMeter(unit)
    meter.start(0, clock=lambda: 0)
    y = torch.randn(8, 2, requires_grad=True)
    index = torch.tensor([1, 5])
    delta = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    meter.offer(y, delta, index)
    (y * 64.0).sum().backward()  # dL/dY = 64 everywhere: a loss scale of 64 on a gradient of 1
    (value,) = impacts([meter.take()], torch.device("cpu"), scale=64.0)
    # Rows 1 and 5 of 8, each gradient 1 after the scale: 0.5 * 8 rows * (8 / 2 sampled) * sum(delta^2).
    assert value.item() == pytest.approx(0.5 * 8 * 4 * 30.0)


def test_an_output_that_needs_no_gradient_measures_only_where_the_cheap_path_changes_the_forward():
    unit = _Unit()  # the meter holds its unit weakly
    meter = ImpactMeter(unit)
    meter.start(0, clock=lambda: 0)
    frozen = torch.randn(6, 4)  # a frozen weight's output on an input that needs no gradient
    delta = torch.randn(6, 4)
    # A backward-only cheap path (act_quant) behind such an output is never read: it hands back the output itself.
    assert meter.offer(frozen, delta, None) is frozen and not frozen.requires_grad
    # A forward error reaches the loss all the same (through an adapter's sum): the output comes back as a leaf
    # that takes dL/dY, and the measure is the one an output with a gradient of its own gets.
    leaf = meter.offer(frozen, delta, None, in_forward=True)
    assert leaf.requires_grad and leaf.is_leaf and torch.equal(leaf, frozen)
    adapter = torch.randn(6, 4, requires_grad=True)
    weights = torch.randn(6, 4)
    ((leaf + adapter) * weights).sum().div(6).backward()
    (value,) = impacts([meter.take()], torch.device("cpu"))
    assert value.item() == pytest.approx((0.5 * 6 * ((weights / 6).square() * delta.square()).sum()).item(), rel=1e-5)
    # An output that has a gradient is handed back as it is, in_forward or not.
    y = torch.randn(6, 4, requires_grad=True)
    assert meter.offer(y, delta, None, in_forward=True) is y


def test_a_unit_measures_on_its_turn_and_at_a_step_asked_for():
    step, unit = [0], _Unit()
    meter = ImpactMeter(unit)
    meter.start(0, clock=lambda: step[0], every=3, phase=1)
    with torch.enable_grad():
        due = []
        for step[0] in range(7):
            due.append(meter.due)
        meter.measure_at(7)
        step[0] = 7
        due.append(meter.due)
    assert due == [False, False, True, False, False, True, False, True]
    with torch.no_grad():
        assert not meter.due  # only training passes measure


def test_a_quiet_unit_takes_every_quiet_every_th_of_its_turns_and_a_symptom_still_measures_it():
    step, unit = [0], _Unit()
    mask = np.zeros(3, dtype=bool)
    meter = ImpactMeter(unit)
    meter.start(0, clock=lambda: step[0], every=2, phase=7, quiet=QuietTurns(mask, 1, 8))
    assert meter.phase == 7

    def due(steps):
        out = []
        for s in steps:
            step[0] = s
            if meter.due:
                out.append(s)
        return out

    with torch.enable_grad():
        assert due(range(16)) == [1, 3, 5, 7, 9, 11, 13, 15]
        mask[1] = True  # the policy's host mask, updated in place
        assert due(range(16, 40)) == [17, 25, 33]  # one of its usual turns in four
        meter.measure_at(20)
        assert due([20]) == [20]
        mask[1] = False
        assert due(range(40, 44)) == [41, 43]
    with pytest.raises(ValueError, match=r"quiet\.every must be a multiple of every=3, got 8"):
        meter.start(0, every=3, quiet=QuietTurns(mask, 1, 8))


def planted(model: nn.Module, **options):
    """block_fp units of `model` (FP8 cheap path, nearly exact) with FAULTY's cheap path faulty; a plan-like
    `find_units` hook so that `plan` builds the same units."""
    units = find_units(model, "block_fp", backend_options={**OPTIONS, **options})
    inject_fault(next(u for u in units if u.name == FAULTY), 30.0, stride=2)
    return units


def test_plan_finds_the_planted_lossy_unit_where_the_counterfactual_oracle_does(monkeypatch):
    model = tiny()
    # plan builds its own units: plant the fault in the ones it builds.
    import gnmr_hf.registry as registry

    real = registry.find_units

    def find_and_plant(*args, **kwargs):
        units = real(*args, **kwargs)
        inject_fault(next(u for u in units if u.name == FAULTY), 30.0, stride=2)
        return units

    monkeypatch.setattr(registry, "find_units", find_and_plant)
    ranking = plan(model, batches(), backend="block_fp", backend_options=OPTIONS)
    monkeypatch.setattr(registry, "find_units", real)
    ranked = ranking.ranked
    assert ranked[0][0] == FAULTY and ranked[0][1] > 100 * ranked[1][1]
    assert ranking.carve_out(1) == [FAULTY] and ranking.smallest(0.9) == [FAULTY]
    # The oracle: the judge batch's loss with only unit i on the recovery path, every other unit cheap.
    units = planted(model)
    model.train()
    judge = batches(1, seed=1)[0]
    with torch.no_grad():
        low = float(model(**judge).loss)
        gains = {}
        for unit in units:
            unit.enter_recovery()
            gains[unit.name] = low - float(model(**judge).loss)
            unit.exit_recovery()
    units.close()
    assert max(gains, key=gains.get) == FAULTY


def test_plan_leaves_the_model_its_forward_gradients_mode_and_random_stream():
    model = tiny()
    model.eval()
    weight = model.model.layers[0].mlp.up_proj.weight
    weight.grad = torch.full_like(weight, 7.0)
    forwards = {name: m.__dict__.get("forward") for name, m in model.named_modules()}
    torch.manual_seed(3)
    expected = torch.rand(1)
    torch.manual_seed(3)
    plan(model, batches(1), backend="block_fp", backend_options=OPTIONS)
    assert torch.rand(1).item() == expected.item()
    assert not model.training
    assert torch.equal(weight.grad, torch.full_like(weight, 7.0))
    assert all(p.grad is None for n, p in model.named_parameters() if p is not weight)
    assert {name: m.__dict__.get("forward") for name, m in model.named_modules()} == forwards


def test_plan_refuses_a_model_that_returns_no_loss_and_a_backend_that_measures_no_impact():
    model = tiny()
    with pytest.raises(ValueError, match="no loss; each batch must hold labels"):
        plan(model, [{"input_ids": batches(1)[0]["input_ids"]}], backend="block_fp", backend_options=OPTIONS)
    with pytest.raises(ValueError, match="act_quant units do not measure their impact"):
        plan(model, batches(1), backend="act_quant", backend_options={"kinds": "norm"})


def _impacts_of(model: nn.Module, micro_batches: list[dict], **checkpointing) -> torch.Tensor:
    return step_impacts(model, planted(model), micro_batches, **checkpointing)


def test_gradient_accumulation_measures_what_one_batch_of_the_same_tokens_measures():
    (batch,) = batches(1, size=4)
    whole = _impacts_of(tiny(), [batch])
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    accumulated = _impacts_of(tiny(), halves)
    torch.testing.assert_close(accumulated, whole, rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_measures_each_unit_once_as_without_it(reentrant):
    (batch,) = batches(1)
    plain = _impacts_of(tiny(), [batch])
    checkpointed = _impacts_of(tiny(), [batch], use_reentrant=reentrant)
    torch.testing.assert_close(checkpointed, plain, rtol=1e-4, atol=1e-9)


def _lora_block_fp_impacts(input_grads: bool = False) -> tuple[list[str], torch.Tensor]:
    """Every block_fp unit's impact over one step of LoRA (every linear) on the tiny model, FP4 cheap path: the base
    weights and the embeddings are frozen, so the first layer's q/k/v base outputs need no gradient, unless
    `input_grads` makes the embeddings' output need one (as transformers does for a reentrant checkpoint)."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(tiny(), LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
    if input_grads:
        model.enable_input_require_grads()
    units = find_units(model, "block_fp", backend_options={"low_format": "e2m1", "high_format": "bf16"})
    names = [u.name for u in units]
    return names, step_impacts(model, units, batches(1))


def test_block_fp_units_under_lora_measure_the_first_layers_frozen_projections_too():
    names, measured = _lora_block_fp_impacts()
    first = [i for i, n in enumerate(names) if n.startswith("model.layers.0.self_attn.") and "lora_" not in n]
    assert len(first) == 4
    # Before the meter made such outputs leaves, the first layer's q/k/v measured nothing (NaN) and the paper's
    # rule stood in for them; their FP4 error reaches the loss through the adapters all the same.
    assert bool((measured[first] > 0).all()), measured[first]
    # The same measure as when the input carries a gradient of its own: the leaf reads the same dL/dY.
    _, reference = _lora_block_fp_impacts(input_grads=True)
    torch.testing.assert_close(measured, reference, rtol=1e-4, atol=1e-12, equal_nan=True)


class _Plant(TrainerCallback):
    """Once GNMR has built its units (train begin), corrupt FAULTY's cheap path: at the first step begin, since a
    callback rebuilt from a checkpoint (restore_callback_states_from_checkpoint) runs after this one."""

    def __init__(self, trainer_ref: list) -> None:
        self.trainer_ref = trainer_ref
        self.planted = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.planted = False

    def on_step_begin(self, args, state, control, **kwargs):
        if not self.planted:
            handler = self.trainer_ref[0].callback_handler
            gnmr = next(cb for cb in handler.callbacks if isinstance(cb, GNMRCallback))
            inject_fault(next(u for u in gnmr.units if u.name == FAULTY), 30.0, stride=2)
            self.planted = True


def _planted_run(tmp_path, max_steps: int, max_active: int, policy_options: dict) -> tuple[list[str], list[dict]]:
    """A Trainer run of the tiny model's block_fp units under policy="impact", FAULTY's cheap path made lossy at its
    start (`_Plant`): the unit names and the trace's step records."""
    data = [{k: v[i] for k, v in b.items()} for b in batches(max_steps) for i in range(4)]
    config = GNMRConfig(
        backend="block_fp", backend_options=OPTIONS, policy="impact", max_active=max_active, lock_steps=2,
        min_history=2, window=2, policy_options=policy_options,
    )  # fmt: skip
    args = TrainingArguments(
        tmp_path, max_steps=max_steps, per_device_train_batch_size=4, use_cpu=True, report_to=[], save_strategy="no",
        logging_steps=100, learning_rate=1e-3, disable_tqdm=True,
    )  # fmt: skip
    ref: list = []
    trainer = GNMRTrainer(model=tiny(), args=args, train_dataset=data, gnmr_config=config, callbacks=[_Plant(ref)])
    ref.append(trainer)
    trainer.train()
    header, records = read_trace(tmp_path / "gnmr_trace.jsonl")
    return header["units"], [r for r in records if r["type"] == "step"]


def test_a_trainer_run_holds_the_planted_unit_and_the_others_take_turns_measuring(tmp_path):
    names, steps = _planted_run(tmp_path, 6, 1, {"every": 3, "rows": 8})
    faulty = names.index(FAULTY)
    measured = [{i for i, _ in r["impact"]["estimate"]} for r in steps]
    # 14 units over every=3 steps: 4 or 5 a step, each unit once in three steps.
    assert sorted(len(m) for m in measured[:3]) == [4, 5, 5] and set().union(*measured[:3]) == set(range(len(names)))
    turn = next(t for t, m in enumerate(measured) if faulty in m)
    # From the step after its first measure to the end, the planted unit and only it is held.
    assert all(r["active"] == [faulty] for r in steps[turn:])
    assert all(r["active"] == [] for r in steps[:turn])
    estimates = {i: v for r in steps for i, v in r["impact"]["estimate"]}
    assert max(estimates, key=estimates.get) == faulty and not math.isnan(estimates[faulty])
    # `gnmr-hf advise` on the run's trace ranks the units by their traced estimates, and carves out the planted one.
    advice = advise(str(tmp_path / "gnmr_trace.jsonl"))
    assert advice.ranking is not None and advice.ranking.ranked[0][0] == FAULTY
    text, errors = format_advice(advice, budget=1)
    assert not errors and "carve-out at budget 1: 1 units" in text
    assert f"exclude = ['^{FAULTY.replace('.', chr(92) * 2 + '.')}$']" in text


def test_in_a_trainer_run_the_units_far_under_the_held_one_measure_on_the_slower_rotation(tmp_path):
    # every=1: each unit measures every step until its estimate is far under the planted unit's (the bar to a budget
    # of 1); from then on one step in quiet_factor=4, at its turn (clock + i) % 4 == 0, while the held unit measures
    # every step. The clock is the Trainer's global_step, which is the traced step - 1 during that step's forward.
    names, steps = _planted_run(tmp_path, 10, 1, {"every": 1, "rows": 8, "quiet_factor": 4})
    n, faulty = len(names), names.index(FAULTY)
    measured = [{i for i, _ in r["impact"]["estimate"]} for r in steps]
    assert measured[0] == set(range(n))  # step 1: every unit, nothing is known yet
    quiet_from = next(k for k, r in enumerate(steps) if r["impact"]["quiet"] == n - 1)
    assert quiet_from < 4 and all(r["active"] == [faulty] for r in steps[quiet_from:])
    for k in range(quiet_from + 1, len(steps)):
        step = steps[k]["step"]
        assert measured[k] == {faulty} | {i for i in range(n) if (step - 1 + i) % 4 == 0}


def test_advise_refuses_a_budget_for_a_trace_without_impacts(tmp_path):
    names = ["a", "b"]
    header = {"type": "header", "version": 2, "units": names, "backend": "block_fp", "config": {"max_active": 1}}
    step = {"type": "step", "step": 1, "t": 1, "active": [0], "entered": [0], "exited": [], "risky": [],
            "n_scored": 2, "n_candidates": 1, "max_risk": 0.0, "top": [], "alpha": 3.0, "beta": 3.0}  # fmt: skip
    path = tmp_path / "gnmr_trace.jsonl"
    path.write_text(json.dumps(header) + "\n" + json.dumps(step) + "\n")
    advice = advise(str(path))
    assert advice.ranking is None
    _, errors = format_advice(advice, budget=1)
    assert errors == [
        "--budget: this trace has no impact estimates to rank the units by (a run with policy='impact' writes "
        "them; monitor_only=True to change nothing), or rank them before training with `gnmr-hf plan`"
    ]


def test_the_paper_policy_measures_nothing():
    model = tiny()
    units = find_units(model, "block_fp", backend_options=OPTIONS)
    model.train()
    model(**batches(1)[0]).loss.backward()
    assert all(u.impact.take() is None and not u.impact.on for u in units)
    units.close()


def test_a_linear_units_output_change_is_its_cheap_gemm_minus_the_exact_one():
    model = nn.Sequential(nn.Linear(8, 6))
    (unit,) = find_units(model, "block_fp", backend_options={"low_format": "e2m1", "high_format": "bf16"})
    unit.impact.start(0, clock=lambda: 0)
    x = torch.randn(5, 8)
    model.train()
    out = model(x)
    out.sum().backward()
    (value,) = impacts([unit.impact.take()], torch.device("cpu"))
    lin = model[0]
    exact = F.linear(x, lin.weight, lin.bias)
    expected = 0.5 * 5 * (out.detach() - exact).square().sum()  # dL/dY = 1 on every entry
    assert value.item() == pytest.approx(expected.item(), rel=1e-4)
    unit.close()


@pytest.mark.parametrize("rht", [False, True])
def test_with_impact_wgrad_a_linear_units_impact_adds_its_weight_gradients_rounded_inputs_output_change(rht):
    # The weight gradient's input, rounded along the tokens (rotated and rotated back with wgrad_rht), changes the
    # output by (x' - x) W^T; its square adds to the forward's. A frozen weight has no weight gradient: no term.
    options = {"low_format": "e2m1", "high_format": "bf16", "scaling": "nvfp4", "wgrad_rht": rht}
    values = {}
    for wgrad, frozen in ((False, False), (True, False), (True, True)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 6))
        model[0].weight.requires_grad_(not frozen)
        (unit,) = find_units(model, "block_fp", backend_options={**options, "impact_wgrad": wgrad})
        unit.impact.start(0, clock=lambda: 0)
        x = torch.randn(20, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
        model.train()
        out = model(x)
        out.sum().backward()
        (values[wgrad, frozen],) = impacts([unit.impact.take()], torch.device("cpu"))
        low = unit.low
        unit.close()
    lin = model[0]
    x = x.detach()
    rounded = low.input_operand(x, 0)
    if rht:
        rounded = rotate_rows(rounded, random_hadamard(16, low.seed).t())
    wgrad_term = 0.5 * 20 * F.linear(rounded[:20] - x, lin.weight).square().sum()  # dL/dY = 1 everywhere
    assert not torch.allclose(rounded[:20], x)
    assert (values[True, False] - values[False, False]).item() == pytest.approx(wgrad_term.item(), rel=1e-4)
    assert values[True, True].item() == pytest.approx(values[False, False].item(), rel=1e-6)


def test_an_act_quant_heads_impact_weighs_the_logits_its_backward_recomputes_by_dl_dlogits():
    # The head saves its input at 3 bits; its backward recomputes the logits from that copy. The impact is
    # 0.5 * N * sum((dL/dz)^2 (z_rounded - z)^2) over every row, with dL/dz the exact loss's own.
    model = tiny()
    (unit,) = find_units(model, "act_quant", backend_options={"kinds": "head", "low_bits": 3})
    unit.impact.start(0, clock=lambda: 0)
    (batch,) = batches(1)
    model.train()
    model(**batch).loss.backward()
    (value,) = impacts([unit.impact.take()], torch.device("cpu"))
    unit.close()
    out = model(**batch, output_hidden_states=True)
    h = out.hidden_states[-1].detach()
    z = out.logits.detach().requires_grad_(True)
    labels = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    loss = F.cross_entropy(z.reshape(-1, z.shape[-1]), labels.reshape(-1), ignore_index=-100)
    (dz,) = torch.autograd.grad(loss, z)
    rounded = unit.cheap_spec().restore_rows(h, None).reshape(h.shape)
    zq = F.linear(rounded, model.lm_head.weight.detach())
    expected = 0.5 * h.shape[0] * h.shape[1] * (dz.square() * (zq - z.detach()).square()).sum()
    assert value.item() == pytest.approx(expected.item(), rel=1e-3)


def test_an_act_quant_linears_impact_is_its_rounded_inputs_output_change():
    model = nn.Sequential(nn.Linear(8, 6))
    (unit,) = find_units(model, "act_quant", backend_options={"kinds": "linear", "low_bits": 2})
    unit.impact.start(0, clock=lambda: 0)
    x = torch.randn(5, 8)
    model.train()
    model(x).sum().backward()
    (value,) = impacts([unit.impact.take()], torch.device("cpu"))
    rounded = unit.cheap_spec().restore_rows(x, None)
    expected = 0.5 * 5 * ((rounded - x) @ model[0].weight.detach().t()).square().sum()
    assert value.item() == pytest.approx(expected.item(), rel=1e-4)
    unit.close()


def _impact_trace(tmp_path) -> str:
    names = ["model.layers.0.mlp.up_proj", "model.layers.0.mlp.down_proj", "lm_head"]
    header = {"type": "header", "version": 2, "units": names, "backend": "block_fp", "config": {"max_active": 1}}
    records = [header]
    for step, estimate in enumerate(([[0, 0.01], [2, 0.5]], [[1, 0.03]], [[0, 0.03], [2, 0.3]]), start=1):
        records.append(
            {"type": "step", "step": step, "t": step, "active": [2], "entered": [2] if step == 1 else [], "exited": [],
             "risky": [], "n_scored": 3, "n_candidates": 1, "max_risk": 0.0, "top": [], "alpha": 3.0, "beta": 3.0,
             "impact": {"estimate": estimate, "measure": []}}
        )  # fmt: skip
    path = tmp_path / "gnmr_trace.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_advise_budget_prints_the_carve_out_of_the_costliest_units_by_their_mean_estimate(tmp_path, capsys):
    from gnmr_hf.cli import main

    assert main(["advise", _impact_trace(tmp_path), "--budget", "2"]) == 0
    out = capsys.readouterr().out
    # Means: lm_head 0.4, down_proj 0.03, up_proj 0.02.
    assert "carve-out at budget 2: 2 units" in out
    assert "llm_int8_skip_modules = ['lm_head', 'model.layers.0.mlp.down_proj']" in out


@pytest.mark.parametrize(
    "budget, message",
    [
        ("0", "error: --budget must be a count of units (an int >= 1)"),
        ("many", "error: --budget must be a count of units"),
        ("4", "error: --budget 4 is more than the 3 units of the trace"),
    ],
)
def test_advise_budget_mistakes_are_one_line(tmp_path, capsys, budget, message):
    from gnmr_hf.cli import main

    with pytest.raises(SystemExit) as done:
        main(["advise", _impact_trace(tmp_path), "--budget", budget])
    err = capsys.readouterr().err.strip()
    assert done.value.code == 2 and len(err.splitlines()) == 1 and err.startswith(message)


@pytest.mark.parametrize("restore_callback_states", [False, True])
def test_a_resumed_impact_run_measures_and_decides_as_the_uninterrupted_one(tmp_path, restore_callback_states):
    # The units take turns by the optimizer step and the rows move with it, and the estimates are in the checkpoint:
    # from a checkpoint at step 4, the resumed run's trace is the uninterrupted run's, step for step.
    import shutil

    data = [{k: v[i] for k, v in b.items()} for b in batches(8) for i in range(4)]
    config = GNMRConfig(
        backend="block_fp", backend_options=OPTIONS, policy="impact", policy_options={"every": 3, "rows": 8},
        max_active=1, lock_steps=2, min_history=2, window=2,
    )  # fmt: skip

    def trainer(out, **kwargs):
        ref: list = []
        args = TrainingArguments(
            out, max_steps=8, per_device_train_batch_size=4, use_cpu=True, report_to=[], logging_steps=100,
            learning_rate=1e-3, disable_tqdm=True, seed=0, **kwargs,
        )  # fmt: skip
        made = GNMRTrainer(model=tiny(), args=args, train_dataset=data, gnmr_config=config, callbacks=[_Plant(ref)])
        ref.append(made)
        return made

    trainer(tmp_path / "full", save_strategy="no").train()
    _, full = read_trace(tmp_path / "full" / "gnmr_trace.jsonl")
    reference = [r for r in full if r["type"] == "step"]
    run = tmp_path / "run"
    trainer(run, save_strategy="steps", save_steps=4).train()
    shutil.rmtree(run / "checkpoint-8")
    resumed = trainer(
        run, save_strategy="steps", save_steps=4, restore_callback_states_from_checkpoint=restore_callback_states
    )
    resumed.train(resume_from_checkpoint=str(run / "checkpoint-4"))
    _, records = read_trace(run / "gnmr_trace.jsonl")
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps][-4:] == [5, 6, 7, 8]
    assert steps[-4:] == reference[4:]
    assert any(r["impact"]["estimate"] for r in reference[4:]) and any(r["active"] for r in reference[4:])


def test_an_act_quant_attentions_impact_is_its_recomputed_attentions_output_change():
    # The backward differentiates p_low v_low, p_low recomputed from the saved low-bit q, k with the exact
    # logsumexp and the row cap: the impact is 0.5 * N * sum((dL/dO)^2 (p_low v_low - O)^2), N tokens (not rows of
    # heads), on either path. Checked against the saved copies themselves (SaveSpec.save, then restore).
    from gnmr_hf.backends.act_quant import attention as attn

    model = tiny()
    units = find_units(model, "act_quant", backend_options={"kinds": "attention", "low_bits": 3})
    unit = units[0]
    unit.impact.start(0, clock=lambda: 0)
    seen = {}
    apply = attn.QuantSavedAttention.apply

    def recording(q, k, v, mask, is_causal, scaling, spec, *rest):
        out = apply(q, k, v, mask, is_causal, scaling, spec, *rest)
        if "q" not in seen:  # layer 0: the unit measured
            seen.update(q=q.detach(), k=k.detach(), v=v.detach(), mask=mask, causal=is_causal, scaling=scaling)
            out.register_hook(lambda g: seen.__setitem__("grad", g.detach()))
            seen["out"] = out.detach()
        return out

    (batch,) = batches(1)
    model.train()
    values = []
    for recover in (False, True):
        seen.clear()
        if recover:
            unit.enter_recovery()
        attn.QuantSavedAttention.apply = recording
        try:
            model(**batch).loss.backward()
        finally:
            attn.QuantSavedAttention.apply = apply
        (value,) = impacts([unit.impact.take()], torch.device("cpu"))
        values.append(value.item())
    units.close()
    spec = unit.cheap_spec()
    q, k, v = (spec.restore(*spec.save(seen[x])).float() for x in ("q", "k", "v"))
    s = attn._scores(seen["q"], seen["k"], seen["mask"], seen["causal"], seen["scaling"])
    lse = torch.logsumexp(s, dim=-1)
    logits = attn._scores(q, k, seen["mask"], seen["causal"], seen["scaling"])
    p = torch.exp((logits - lse.unsqueeze(-1)).clamp(max=0.0))
    p = attn._used_rows(p, unit.options.renormalize, unit.options.max_row_total)
    delta = p @ v - seen["out"].float()
    tokens = batch["input_ids"].numel()
    expected = 0.5 * tokens * (seen["grad"].float().square() * delta.square()).sum().item()
    assert values[0] == pytest.approx(expected, rel=1e-3) and expected > 0
    assert values[1] == pytest.approx(values[0], rel=1e-3)  # the forward is exact on both paths


def _attention_impacts(micro_batches: list[dict], **checkpointing) -> torch.Tensor:
    model = tiny()
    units = find_units(model, "act_quant", backend_options={"kinds": "attention", "low_bits": 3})
    return step_impacts(model, units, micro_batches, **checkpointing)


@pytest.mark.parametrize("reentrant", [False, True])
def test_attention_units_measure_each_forward_once_under_gradient_checkpointing(reentrant):
    (batch,) = batches(1, size=4)
    plain = _attention_impacts([batch])
    assert bool((plain > 0).all())
    torch.testing.assert_close(_attention_impacts([batch], use_reentrant=reentrant), plain, rtol=1e-4, atol=1e-9)


def test_attention_units_under_accumulation_measure_the_mean_of_their_micro_batches():
    # Per-tensor scales make each micro-batch round on its own, so the whole batch is not the reference here; each
    # half measured alone is: accumulation halves each gradient (a quarter of each sum) and counts both halves'
    # tokens, 0.5 * 2n * (S1 + S2) / 4 = the mean of the halves' own 0.5 * n * S_i.
    (batch,) = batches(1, size=4)
    halves = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    alone = torch.stack([_attention_impacts([half]) for half in halves])
    torch.testing.assert_close(_attention_impacts(halves), alone.mean(0), rtol=1e-4, atol=1e-9)


def _step_grads(backend: str, options: dict, measure: bool, recover: bool) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny()
    units = find_units(model, backend, backend_options=options)
    if recover:
        units[0].enter_recovery()
    if measure:
        for unit in units:
            unit.impact.start(0, clock=lambda: 0)
    (batch,) = batches(1)
    model.train()
    loss = model(**batch).loss
    loss.backward()
    if measure:
        assert bool((impacts([u.impact.take() for u in units], torch.device("cpu")) > 0).any())
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    units.close()
    return loss.item(), grads


@pytest.mark.parametrize(
    "backend, options",
    [
        ("act_quant", {"kinds": "linear;attention", "low_bits": 4, "high_bits": 8}),
        ("block_fp", {"low_format": "e2m1", "high_format": "e4m3"}),
    ],
)
@pytest.mark.parametrize("recover", [False, True])
def test_measuring_leaves_the_steps_loss_and_every_gradient_as_they_were(backend, options, recover):
    # A measure only reads (sampled rows, a hook's gradient): a measuring step trains exactly as any other, so a
    # monitor-only run is its static run, and turns of measuring move nothing.
    loss, grads = _step_grads(backend, options, measure=False, recover=recover)
    measured_loss, measured_grads = _step_grads(backend, options, measure=True, recover=recover)
    assert measured_loss == loss and measured_grads.keys() == grads.keys()
    for name, grad in grads.items():
        assert torch.equal(measured_grads[name], grad), name


def test_in_a_trainer_run_a_held_unit_far_over_the_bar_measures_on_the_slower_rotation_and_stays_held(tmp_path):
    # Budget 2: the planted unit is held, far over the bar (the larger of min_impact and the 2nd largest estimate,
    # an ordinary unit's), so it measures on its quiet turns only, (clock + i) % 4 == 0, and stays held between them
    # on its running estimate.
    names, steps = _planted_run(tmp_path, 12, 2, {"every": 1, "rows": 8, "quiet_factor": 4})
    faulty = names.index(FAULTY)
    turns = [(r["step"] - 1 + faulty) % 4 == 0 for r in steps]
    measured = [faulty in {i for i, _ in r["impact"]["estimate"]} for r in steps]
    # Every unit quiet from the step after the decision that says so: the planted one far over the bar, the rest
    # far under it.
    quiet_from = next(k for k, r in enumerate(steps) if r["impact"]["quiet"] == len(names)) + 1
    assert quiet_from < 4 and measured[:quiet_from] == [True] * quiet_from  # every step until then
    assert measured[quiet_from:] == turns[quiet_from:] and not all(turns[quiet_from:])  # then its quiet turns alone
    assert all(faulty in r["active"] for r in steps)
