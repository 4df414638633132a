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
