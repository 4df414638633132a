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
