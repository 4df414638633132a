"""The README's main job, `gnmr-hf demo`, end to end on a few steps (the full demo runs 40)."""

from __future__ import annotations

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
