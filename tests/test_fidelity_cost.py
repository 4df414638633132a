"""benchmarks/fidelity_cost.py times what the impact measure costs on bitsandbytes' INT8 LoRA units."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def test_the_int8_lora_regime_times_its_units_measuring_and_nothing_when_not(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    command = [sys.executable, "benchmarks/fidelity_cost.py", "--rounds", "1", "--steps", "1", "--batch", "2"]
    command += ["--seq_len", "32", "--measure", "impact", "--rows", "8", "--every", "1", "--regimes", "bnb_int8"]
    done = subprocess.run([*command, "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (regime,) = json.loads(out.read_text()).values()
    own = regime["own_ms_per_step"]
    for recovering in ("all cheap", "4 in recovery"):
        assert own[f"{recovering}, measuring 8 rows"] > 0.0  # each unit's offer and its backward half were timed
        assert own[f"{recovering}, not measuring"] < 0.1 * own[f"{recovering}, measuring 8 rows"]


def test_the_int8_lora_regime_needs_the_impact_measure(monkeypatch, capsys) -> None:
    # In this process: the refusal comes from the argument parsing, before the benchmark wraps any function.
    monkeypatch.setattr(sys, "argv", ["fidelity_cost.py", "--regimes", "bnb_int8"])
    with pytest.raises(SystemExit) as stopped:
        runpy.run_path(str(ROOT / "benchmarks" / "fidelity_cost.py"), run_name="__main__")
    assert stopped.value.code == 2 and "--regimes bnb_int8 needs --measure impact" in capsys.readouterr().err


def test_quiet_units_from_a_trace_measure_one_turn_in_quiet_factor(tmp_path: Path) -> None:
    # A policy='impact' trace of the block_fp regime's 29 units (the probe model's 28 projections and its head) in
    # which the head's estimate is far above the others, at a budget of 2: the bar is min_impact (0.002), so the 28
    # others are quiet. With --every 1 --quiet_factor 4 a step measures the head and a quarter of the rest (7),
    # where the usual rotation measures all 29. With 4 units in recovery (the head, far over the bar, so quiet; and
    # 3 ordinary ones, near it, so not): those 3 and a quarter of the other 26 (the head and 25 out of recovery).
    from gnmr_hf import find_units
    from gnmr_hf.experiments.pretrain import build_model, llama_config

    model = build_model(llama_config(d_model=128, n_layers=4, n_heads=4, seq_len=128), seed=0)
    include = [r"\.(q|k|v|o|gate|up|down)_proj$", "^lm_head$"]
    options = {"low_format": "e2m1", "high_format": "e4m3", "quantize_lm_head": True}
    units = find_units(model, "block_fp", include=include, backend_options=options)
    names = [u.name for u in units]
    units.close()
    header = {"type": "header", "version": 2, "units": names, "backend": "block_fp",
              "config": {"policy": "impact", "max_active": 2, "policy_options": {}}}  # fmt: skip
    estimates = [[i, 0.5 if n == "lm_head" else 1e-4] for i, n in enumerate(names)]
    step = {"type": "step", "step": 1, "t": 1, "active": [], "entered": [], "exited": [], "risky": [], "n_scored": 0,
            "n_candidates": 0, "max_risk": None, "top": [], "alpha": 3.0, "beta": 3.0,
            "impact": {"estimate": estimates, "measure": []}}  # fmt: skip
    trace = tmp_path / "gnmr_trace.jsonl"
    trace.write_text(json.dumps(header) + "\n" + json.dumps(step) + "\n")
    command = [sys.executable, "benchmarks/fidelity_cost.py", "--rounds", "1", "--steps", "4", "--batch", "2"]
    command += ["--seq_len", "32", "--measure", "impact", "--rows", "8", "--every", "1", "--regimes", "block_fp"]
    out = tmp_path / "quiet.json"
    command += ["--quiet_from", f"block_fp={trace}", "--quiet_factor", "4", "--out", str(out)]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    (regime,) = json.loads(out.read_text()).values()
    assert regime["quiet_units"] == 28 and regime["quiet_units_in_recovery"] == 26 and regime["units"] == 29
    # The quiet rotation and the usual one, in the same rounds.
    assert regime["measures_per_step"] == {
        "all cheap, not measuring": 0.0,
        "all cheap, measuring 8 rows": 29.0,
        "all cheap, measuring 8 rows, quiet units 1 turn in 4": 8.0,
        "4 in recovery, not measuring": 0.0,
        "4 in recovery, measuring 8 rows": 29.0,
        "4 in recovery, measuring 8 rows, quiet units 1 turn in 4": 3 + 26 / 4,
    }
