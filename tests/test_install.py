"""The CPU install does what README.md says: the pinned PyTorch release, and no index pip would have to query."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_cpu_constraints_pin_the_release_and_add_no_index():
    lines = [line for line in (ROOT / "constraints-cpu.txt").read_text().splitlines() if not line.startswith("#")]
    # A plain pin: a local `2.13.0+cpu` wheel matches it and outranks PyPI's CUDA `2.13.0`.
    assert [line for line in lines if line.strip()] == ["torch==2.13.0"]
    readme = (ROOT / "README.md").read_text()
    assert "CPU build" in readme and "CPU index" in readme
