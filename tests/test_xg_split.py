"""benchmarks/xg_split.py: the recorded norms are the true ones, and each symptom gets the class its norms say."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from gnmr_hf import find_units

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import xg_split


def test_the_recorder_writes_each_linear_units_input_and_output_gradient_norms_per_step(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4), nn.ReLU(), nn.Linear(4, 3))
    units = find_units(model, "act_quant", low_bits=8, high_bits=16)
    recorder = xg_split.NormRecorder(SimpleNamespace(units=units), tmp_path / "norms.jsonl")
    recorder.on_train_begin(None, None, None)
    xs, dys = [torch.randn(5, 8), torch.randn(2, 8)], [torch.randn(5, 3), torch.randn(2, 3)]
    hidden_grads = []
    for x, dy in zip(xs, dys, strict=True):  # two micro-batches of one step
        h = model[0](x)
        h.register_hook(hidden_grads.append)
        model[2](model[1](h)).backward(dy)
    with torch.no_grad():
        model(torch.randn(3, 8))  # not a training pass: not counted
    recorder.on_step_end(None, SimpleNamespace(global_step=7), None)
    recorder.on_train_end(None, None, None)

    (row,) = map(json.loads, (tmp_path / "norms.jsonl").read_text().splitlines())
    assert row["step"] == 7
    first_input = torch.cat(xs).norm().item()
    second_input = torch.cat([torch.relu(model[0](x)) for x in xs]).norm().item()
    assert row["x"] == pytest.approx([first_input, second_input], rel=1e-5)
    assert row["g"] == pytest.approx([torch.cat(hidden_grads).norm().item(), torch.cat(dys).norm().item()], rel=1e-5)
    assert not model[0]._forward_pre_hooks and not model[0]._forward_hooks  # removed at train end


def write_run(tmp_path: Path, norms: dict[int, tuple[list, list]], steps: list[dict]) -> tuple[Path, Path]:
    trace, path = tmp_path / "trace.jsonl", tmp_path / "norms.jsonl"
    header = {"type": "header", "version": 2, "units": ["l.0.attn", "l.0.attn.q_proj", "l.0.attn.k_proj"]}
    lines = [header] + [{"type": "step", "entered": [], "risky": [], **s} for s in steps]
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    path.write_text("".join(json.dumps({"step": k, "x": x, "g": g}) + "\n" for k, (x, g) in norms.items()))
    return trace, path


def test_each_symptom_is_classed_by_which_norm_moved_against_its_recent_median(tmp_path):
    # Unit 0 is not a linear (no norms); units 1 and 2 have steady norms for 8 steps, then at step 9 unit 1's output
    # gradient and unit 2's input triple; at step 10 unit 1's norms stay and unit 2's both move 3x.
    norms = {k: ([None, 1.0, 2.0], [None, 4.0, 1.0]) for k in range(1, 9)}
    norms[9] = ([None, 1.1, 6.0], [None, 12.0, 1.0])
    norms[10] = ([None, 1.0, 6.0], [None, 4.0, 3.0])
    steps = [{"step": 9, "risky": [0, 1, 2], "entered": [0], "cause": {"why": [[0, "cause", 1]]}},
             {"step": 10, "risky": [1, 2]}]  # fmt: skip
    trace, path = write_run(tmp_path, norms, steps)
    found = xg_split.classify(trace, path, window=8, factor=2.0)["symptoms"]
    assert [(s["step"], s["unit"], s["class"], s["blamed_on"]) for s in found] == [
        (9, "l.0.attn.q_proj", "G", "l.0.attn"),
        (9, "l.0.attn.k_proj", "X", None),
        (10, "l.0.attn.q_proj", "neither", None),
        (10, "l.0.attn.k_proj", "both", None),
    ]
    assert found[0]["rg"] == pytest.approx(3.0) and found[1]["rx"] == pytest.approx(3.0)
    summary = xg_split.summarize(found)
    assert summary["total"] == {"G": 1, "X": 1, "both": 1, "neither": 1}
    assert summary["blamed"] == {"G": 1, "X": 0, "both": 0, "neither": 0}
    assert summary["by_kind"]["q_proj"] == {"G": 1, "X": 0, "both": 0, "neither": 1}


def test_update_rms_is_elevated_before_an_onset_only_where_it_rose_in_the_steps_before(tmp_path):
    # Unit 1's update RMS is 1 at every step but 3 at step 12; its only symptom onset is step 14 (risky again at 15:
    # not an onset). So the onset had an elevated RMS in the 3 steps before, not at its own step; over every unit-step
    # with 8 steps of history known (steps 8-20: 13), one is elevated and 3 follow it.
    norms = {k: ([None, 1.0], [None, 1.0]) for k in range(1, 21)}
    u = {k: [None, 3.0 if k == 12 else 1.0] for k in range(1, 21)}
    trace, path = write_run(tmp_path, norms, [{"step": 14, "risky": [1]}, {"step": 15, "risky": [1]}])
    path.write_text("".join(json.dumps({"step": k, "x": x, "g": g, "u": u[k]}) + "\n" for k, (x, g) in norms.items()))
    found = xg_split.update_rms_lead(trace, path, window=8, factor=2.0, lead=3)
    assert found["onsets"] == {"n": 1, "at_step": 0.0, "before": 1.0}
    assert found["every_unit_step"] == {"n": 13, "at_step": pytest.approx(1 / 13), "before": pytest.approx(3 / 13)}


def test_the_recorder_takes_the_update_rms_from_adamws_second_moment_before_the_step(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 4))
    (unit,) = find_units(model, "act_quant", low_bits=8, high_bits=16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.95))
    recorder = xg_split.NormRecorder(SimpleNamespace(units=[unit]), tmp_path / "norms.jsonl")
    recorder.on_train_begin(None, None, None)
    rms = []
    for step in (1, 2):
        model.zero_grad()
        model(torch.randn(5, 8) * step).sum().backward()
        recorder.on_pre_optimizer_step(None, None, None, optimizer=optimizer)
        rms.append(recorder.rms[0])
        if step == 2:  # by hand, from the second moment the first step left
            p = model[0].weight
            state = optimizer.state[p]
            v = state["exp_avg_sq"] / (1 - 0.95 ** state["step"].item())
            expected = (p.grad.square() / v).mean().sqrt().item()
        optimizer.step()
    assert rms[0] is None  # no second moment yet
    assert rms[1] == pytest.approx(expected, rel=1e-5)
