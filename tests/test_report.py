"""The trace format, `TraceSummary`, and the `gnmr-hf report` command, on hand-written traces."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gnmr_hf.cli import main
from gnmr_hf.controller import HostDecision
from gnmr_hf.trace import TraceSummary, TraceWriter, read_trace

UNITS = ["a", "b", "c"]


def decision(step, active, entered=(), exited=(), risky=(), top=((0, 0.5),)):
    return HostDecision(
        step=step,
        active=np.array(active, dtype=np.int64),
        entered=np.array(entered, dtype=np.int64),
        exited=np.array(exited, dtype=np.int64),
        risky=np.array(risky, dtype=np.int64),
        n_eligible=3,
        n_candidates=len(active),
        max_score=max(s for _, s in top),
        top_units=np.array([i for i, _ in top], dtype=np.int64),
        top_scores=np.array([s for _, s in top]),
        alpha=3.0,
        beta=3.0,
    )


def write_trace(path, decisions):
    writer = TraceWriter(path, {"units": UNITS, "config": {"max_active": 2}})
    for d in decisions:
        writer.write(d)
    writer.close()
    return path


STREAM = [
    decision(1, []),
    decision(2, [1], entered=[1], risky=[1], top=((1, 9.0), (0, 0.5))),
    decision(3, [1, 2], entered=[2], risky=[2], top=((2, float("inf")), (1, 0.9))),
    decision(4, [2], exited=[1]),
    decision(5, [], exited=[2]),
]


def test_summary_counts_recovery_fraction_flips_and_top_units(tmp_path):
    summary, _, steps = TraceSummary.from_trace(write_trace(tmp_path / "t.jsonl", STREAM))
    assert len(steps) == 5
    assert summary.recovery_fraction == pytest.approx(4 / 15)
    assert summary.flips_per_1k_steps == pytest.approx(1000 * 4 / 5)
    assert summary.top_units() == [("b", 2, 1), ("c", 2, 1)]
    assert summary.max_active_seen == 2


def test_infinite_scores_are_written_as_strict_json(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", STREAM)
    line = path.read_text().splitlines()[3]
    assert "Infinity" not in line
    assert json.loads(line)["top"][0] == [2, "inf"]


def test_resuming_a_trace_drops_the_steps_after_the_checkpoint(tmp_path):
    path = write_trace(tmp_path / "t.jsonl", STREAM)
    writer = TraceWriter(path, {"units": UNITS, "config": {}}, resume_step=3)
    writer.write(decision(4, [2], exited=[1]))
    writer.close()
    header, steps = read_trace(path)
    assert header["units"] == UNITS
    assert [r["step"] for r in steps] == [1, 2, 3, 4]


def test_report_command_prints_the_summary_and_writes_plots(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", STREAM)
    assert main(["report", str(path), "--out", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "unit-steps in recovery         26.6667%" in out
    for name in ("gnmr_recovery.png", "gnmr_scores.png"):
        png = tmp_path / "plots" / name
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_report_command_json_output(tmp_path, capsys):
    path = write_trace(tmp_path / "t.jsonl", STREAM)
    assert main(["report", str(path), "--no-plots", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["flips"] == 4


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "no trace file"),
        ('{"type":"step","step":1}\n', "no header"),
        ("not json\n", "is not JSON"),
        ('{"type":"header","units":[]}\n{"type":"nope"}\n', "unknown record type"),
    ],
)
def test_report_command_rejects_bad_traces_with_a_clear_error(tmp_path, capsys, content, message):
    path = tmp_path / "t.jsonl"
    if content is not None:
        path.write_text(content)
    assert main(["report", str(path), "--no-plots"]) == 2
    assert message in capsys.readouterr().err


def test_cli_without_a_command_prints_usage_and_fails(capsys):
    assert main([]) == 2
    assert "usage: gnmr-hf" in capsys.readouterr().out
