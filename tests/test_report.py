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
        n_scored=3,
        n_candidates=len(active),
        max_risk=max(s for _, s in top),
        top_units=np.array([i for i, _ in top], dtype=np.int64),
        top_risks=np.array([s for _, s in top]),
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
    path = write_trace(tmp_path / "gnmr_trace.jsonl", STREAM)
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
        ('not json\n{"type":"header","units":[]}\n', "is not JSON"),
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
    assert "usage: gnmr-hf" in capsys.readouterr().err


def test_a_last_line_cut_off_mid_write_is_dropped_with_a_warning(tmp_path, capsys, caplog):
    path = write_trace(tmp_path / "t.jsonl", STREAM)
    whole = path.read_text()
    path.write_text(whole + '{"type":"step","step":6,"active":[0,')  # a kill in the middle of a write
    with caplog.at_level("WARNING", logger="gnmr_hf"):
        assert main(["report", str(path), "--no-plots", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 5
    assert "dropped its last line" in caplog.text
    # A resumed writer drops it too, and continues after the last complete step.
    writer = TraceWriter(path, {"units": UNITS, "config": {}}, resume_step=5)
    writer.write(decision(6, []))
    writer.close()
    assert [r["step"] for r in read_trace(path)[1]] == [1, 2, 3, 4, 5, 6]


def test_a_trace_of_version_1_is_read_with_todays_field_names(tmp_path):
    path = tmp_path / "v1.jsonl"
    lines = [
        {"type": "header", "version": 1, "units": UNITS, "config": {"max_active": 2}},
        {
            "type": "step",
            "step": 1,
            "active": [1],
            "entered": [1],
            "exited": [],
            "risky": [1],
            "n_eligible": 3,
            "n_candidates": 1,
            "max_score": 2.5,
            "top": [[1, 2.5]],
            "alpha": 3.0,
            "beta": 3.0,
        },
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    _, steps = read_trace(path)
    assert steps[0]["n_scored"] == 3 and steps[0]["max_risk"] == 2.5 and "max_score" not in steps[0]


def test_skipped_steps_are_counted_apart_from_observed_ones(tmp_path):
    path = tmp_path / "t.jsonl"
    writer = TraceWriter(path, {"units": UNITS, "config": {"max_active": 2}})
    writer.write(decision(1, []), step=1)
    writer.write_skip(2, "fp16 loss scaler skipped the step")
    writer.write(decision(2, [0], entered=[0], risky=[0]), step=3)
    writer.close()
    summary, _, steps = TraceSummary.from_trace(path)
    assert (summary.steps, summary.skipped_steps) == (2, 1)
    assert [(r["step"], r["t"]) for r in steps] == [(1, 1), (3, 2)]
    assert "skipped by the fp16 loss scaler" in summary.format()


def _plotted_figures(monkeypatch, trace, out) -> list:
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    assert main(["report", str(trace), "--out", str(out)]) == 0
    return figures


def test_the_scores_plot_is_not_empty_when_nothing_entered_recovery(tmp_path, monkeypatch):
    quiet = [decision(1, [], top=((0, 0.2), (1, 0.1))), decision(2, [], top=((0, 0.6), (1, 0.3)))]
    _, scores = _plotted_figures(monkeypatch, write_trace(tmp_path / "t.jsonl", quiet), tmp_path)
    (ax,) = scores.axes
    assert len(ax.get_lines()) > 1  # the units' risks beside the threshold line
    assert ax.get_title().startswith("No unit was risky")
    assert len(ax.get_yticks()) >= 5


def test_the_recovery_heatmap_has_a_legend_for_recovery_and_a_y_label(tmp_path, monkeypatch):
    heatmap, _ = _plotted_figures(monkeypatch, write_trace(tmp_path / "t.jsonl", STREAM), tmp_path)
    (ax,) = heatmap.axes
    labels = [text.get_text() for text in ax.get_legend().get_texts()]
    assert labels[0] == "in recovery (high-fidelity path)" and ax.get_ylabel() == "unit"


def test_report_on_a_run_folder_reads_the_folder_s_trace(tmp_path, capsys):
    write_trace(tmp_path / "gnmr_trace.jsonl", STREAM)
    assert main(["report", str(tmp_path), "--no-plots", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["steps"] == 5


def test_report_on_a_folder_without_a_trace_names_the_traces_it_has(tmp_path, capsys):
    write_trace(tmp_path / "gnmr_trace.1.jsonl", STREAM)
    assert main(["report", str(tmp_path), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert f"the folder {tmp_path} has no gnmr_trace.jsonl; pass one of its traces: gnmr_trace.1.jsonl" in err


def test_the_plots_are_named_after_the_trace_so_an_earlier_run_s_never_overwrite_the_current_run_s(tmp_path):
    from gnmr_hf.report import plot_names

    assert plot_names("gnmr_trace.jsonl") == ("gnmr_recovery.png", "gnmr_scores.png")
    assert plot_names("gnmr_trace.1.jsonl") == ("gnmr_recovery.1.png", "gnmr_scores.1.png")
    assert plot_names("run.jsonl") == ("run_recovery.png", "run_scores.png")
    current = tmp_path / "gnmr_recovery.png"
    current.write_bytes(b"the current run's plot")
    assert main(["report", str(write_trace(tmp_path / "gnmr_trace.1.jsonl", STREAM))]) == 0
    assert current.read_bytes() == b"the current run's plot"
    assert (tmp_path / "gnmr_recovery.1.png").read_bytes()[:4] == b"\x89PNG"


def test_a_trace_that_starts_at_a_resume_says_so_and_why_its_counts_are_fewer(tmp_path, capsys):
    # A run resumed from a checkpoint of step 2 into a new folder: its trace starts at step 3.
    writer = TraceWriter(tmp_path / "gnmr_trace.jsonl", {"units": UNITS, "config": {"max_active": 2}}, resume_step=2)
    for d in STREAM[2:]:
        writer.write(d)
    writer.close()
    assert main(["report", str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "optimizer steps                3\n" in out
    assert (
        "this trace starts at step 3, where the run resumed from a checkpoint: it counts steps 3 on; steps 1-2 are"
        in (out)
    )
    assert main(["report", str(write_trace(tmp_path / "whole.jsonl", STREAM)), "--no-plots"]) == 0
    assert "resumed" not in capsys.readouterr().out
