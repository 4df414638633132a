"""benchmarks/gpu_check.py on a CPU: the logic of the one-GPU check (modes, flip latency, its JSON) runs end to end.

The numbers themselves need a GPU (`bash benchmarks/gpu_check.sh`); here the script must run, write every field,
and say that syncs and host-to-device copies do not exist on a CPU rather than report zeros.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_runs_on_a_cpu_with_the_tiny_size(tmp_path):
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--size", "tiny", "--steps", "2"]
    cmd += ["--warmup", "1", "--sync_steps", "1", "--repeats", "2", "--seq", "32", "--batch", "2"]
    done = subprocess.run([*cmd, "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["device"] == "cpu" and result["units"] == 14
    modes = {m["mode"]: m for m in result["modes"]}
    assert list(modes) == ["plain", "monitor_only", "active"]
    assert all(m["step_s"] > 0 and m["syncs_per_step"] is None for m in modes.values())  # no syncs on a CPU
    # Active GNMR held BF16 weights (at most max_active x the largest unit); monitor-only never did.
    assert modes["monitor_only"]["recovery_peak_mib"] == 0.0 < modes["active"]["recovery_peak_mib"]
    assert result["flip"]["checkpoint"] and result["flip"]["dequantize"]
    assert "checks the logic only" in done.stdout


def test_gpu_check_takes_a_real_model_by_name_or_file(tmp_path):
    """`--model` (gpu_check.sh runs smollm2-135m): the model's converted folder loaded in 8-bit with LoRA, as the
    random LLaMA is. Here a GGUF the test writes, with the cache in tmp_path."""
    pytest.importorskip("gguf")
    from gnmr_hf.experiments.tiny import write_tiny_gguf

    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    cmd = [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), "--model", str(gguf), "--steps", "1"]
    cmd += ["--warmup", "1", "--sync_steps", "1", "--repeats", "1", "--seq", "16", "--batch", "2"]
    env = {**os.environ, "GNMR_HF_CACHE": str(tmp_path / "cache")}
    done = subprocess.run(
        [*cmd, "--out", str(tmp_path / "out")], capture_output=True, text=True, timeout=600, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads((tmp_path / "out" / "gpu_check.json").read_text())
    assert result["size"] == str(gguf) and result["units"] == 14
    assert {m["mode"] for m in result["modes"]} == {"plain", "monitor_only", "active"}
