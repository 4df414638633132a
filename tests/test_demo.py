"""The README's main job, `gnmr-hf demo`, end to end on a few steps (the full demo runs 40)."""

from __future__ import annotations

import pytest

from gnmr_hf.cli import main
from gnmr_hf.trace import read_trace


def test_demo_command_trains_catches_the_injected_spike_and_writes_its_report(tmp_path, capsys):
    out = tmp_path / "demo"
    code = main(
        [
            "demo",
            "--output_dir",
            str(out),
            "--max_steps",
            "10",
            "--spike_step",
            "7",
            "--min_history",
            "3",
            "--window",
            "3",
            "--lock_steps",
            "2",
        ]
    )
    assert code == 0
    header, steps = read_trace(out / "gnmr_trace.jsonl")
    spiked = header["units"].index("model.layers.1.mlp.down_proj")
    assert spiked in steps[6]["entered"]
    assert header["config"]["lock_steps"] == 2  # the HfArgumentParser flags reached the callback
    for name in ("gnmr_summary.json", "gnmr_recovery.png", "gnmr_scores.png", "base_model/model.safetensors"):
        assert (out / name).is_file(), name
    printed = capsys.readouterr().out
    assert f"plot:  {out / 'gnmr_recovery.png'}" in printed


def test_demo_backend_flag_runs_the_demo_in_4bit(tmp_path):
    out = tmp_path / "demo4"
    argv = ["demo", "--output_dir", str(out), "--backend", "bnb_4bit", "--max_steps", "8", "--spike_step", "6"]
    assert main([*argv, "--min_history", "3", "--window", "3", "--lock_steps", "2"]) == 0
    header, steps = read_trace(out / "gnmr_trace.jsonl")
    assert header["config"]["backend"] == "bnb_4bit"
    assert header["units"].index("model.layers.1.mlp.down_proj") in steps[5]["entered"]


def test_demo_refuses_a_backend_it_has_no_model_for(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--output_dir", str(tmp_path), "--backend", "torchao_float8"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err == (
        "error: argument --backend: invalid choice: 'torchao_float8' (choose from 'bnb_int8', 'bnb_4bit')\n"
    )
