"""The CPU install does what README.md says: PyTorch from its CPU wheel index, at the pinned release."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_cpu_constraints_point_pip_at_the_cpu_wheels():
    lines = [line for line in (ROOT / "constraints-cpu.txt").read_text().splitlines() if not line.startswith("#")]
    assert "--extra-index-url https://download.pytorch.org/whl/cpu" in lines
    # A plain pin: `2.13.0+cpu` on Linux matches it and outranks PyPI's CUDA `2.13.0`; macOS keeps PyPI's wheel.
    assert any(line.startswith("torch==") and "+" not in line for line in lines)
