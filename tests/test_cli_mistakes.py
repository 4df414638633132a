"""A user's mistake with `gnmr-hf report`, `advise` and `demo`, run as the user ran it: one line on stderr naming the
flag or the trace's field and what is allowed, exit status 2, before any work and before anything is written. And a
reader that goes away (`gnmr-hf report TRACE | head -4`) ends the command quietly, as it ends a Unix tool."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gnmr_hf.cli import main

UNITS = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj", "lm_head"]


def _step(step: int, active: list[int]) -> dict:
    return {
        "type": "step", "step": step, "t": step, "active": active, "entered": active if step == 2 else [],
        "exited": [], "risky": active, "n_scored": 3, "n_candidates": len(active), "max_risk": 0.5,
        "top": [[0, 0.5]], "alpha": 3.0, "beta": 3.0, "left_out": [],
    }  # fmt: skip


def write_trace(path: Path, header: dict | None = None, steps: list[dict] | None = None) -> Path:
    """A hand-written trace: a header over `UNITS`, unit 1 in recovery from step 2 on (or `header`, `steps`)."""
    header = (
        {"type": "header", "version": 2, "units": UNITS, "config": {"max_active": 1}} if header is None else header
    )
    steps = [_step(s, [1] if s > 1 else []) for s in range(1, 6)] if steps is None else steps
    path.write_text("".join(json.dumps(record) + "\n" for record in [header, *steps]))
    return path


def _refused(argv: list[str], capsys) -> str:
    """Run `gnmr-hf ARGV`; it must end with status 2 and one line on stderr; return that line."""
    try:
        code = main(argv)
    except SystemExit as stop:
        code = stop.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


def test_an_expect_pattern_that_is_no_regex_is_refused_naming_the_flag(tmp_path, capsys):
    err = _refused(["advise", str(write_trace(tmp_path / "gnmr_trace.jsonl")), "--expect", "["], capsys)
    assert err.startswith("error: --expect takes regexes of unit names (as include/exclude do); '[' is not one:")


@pytest.mark.parametrize("command", ["report", "advise"])
def test_a_trace_header_without_units_is_refused_naming_the_field(tmp_path, capsys, command):
    trace = write_trace(tmp_path / "gnmr_trace.jsonl", header={"type": "header", "version": 2, "config": {}})
    err = _refused([command, str(trace)], capsys)
    assert "the header's 'units' must be the list of unit names the records' indices refer to, got none" in err
    assert [p.name for p in tmp_path.iterdir()] == ["gnmr_trace.jsonl"]  # no plot written


@pytest.mark.parametrize("command", ["report", "advise"])
def test_a_unit_index_beyond_the_header_s_units_is_refused_naming_the_step_and_the_field(tmp_path, capsys, command):
    trace = write_trace(tmp_path / "gnmr_trace.jsonl", steps=[_step(1, []), _step(2, [999])])
    err = _refused([command, str(trace)], capsys)
    assert "step 2 has unit index 999 in 'active'; the header names 3 units, so one is in 0..2" in err
    assert [p.name for p in tmp_path.iterdir()] == ["gnmr_trace.jsonl"]


@pytest.mark.parametrize("command", ["report", "advise"])
def test_a_trace_of_a_newer_version_is_refused_naming_the_versions_read(tmp_path, capsys, command):
    header = {"type": "header", "version": 99, "units": UNITS, "config": {"max_active": 1}}
    err = _refused([command, str(write_trace(tmp_path / "gnmr_trace.jsonl", header=header))], capsys)
    assert "the header's 'version' is 99; this gnmr-hf reads traces of version 1 to 2" in err


def test_report_out_on_an_existing_file_is_refused_naming_the_flag(tmp_path, capsys):
    trace = write_trace(tmp_path / "gnmr_trace.jsonl")
    existing = tmp_path / "notes.txt"
    existing.write_text("mine")
    err = _refused(["report", str(trace), "--out", str(existing)], capsys)
    assert err == f"error: --out must be a folder for the plots (made if missing); {existing} is a file\n"
    assert existing.read_text() == "mine" and sorted(p.name for p in tmp_path.iterdir()) == [
        "gnmr_trace.jsonl",
        "notes.txt",
    ]


def test_report_without_matplotlib_is_one_line_that_offers_no_plots(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an install without the plot extra finds
    err = _refused(["report", str(write_trace(tmp_path / "gnmr_trace.jsonl"))], capsys)
    assert "matplotlib, which is not installed: pip install 'gnmr-hf[plot]', or pass --no-plots" in err
    assert main(["report", str(tmp_path / "gnmr_trace.jsonl"), "--no-plots"]) == 0


def test_the_demo_without_the_bnb_extra_is_one_line_before_anything_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # what an install without the bnb extra finds
    err = _refused(["demo", "--output_dir", str(tmp_path / "demo")], capsys)
    assert err == (
        "error: --backend bnb_int8: the demo trains a bitsandbytes model under peft LoRA, which come with the bnb "
        "extra: pip install 'gnmr-hf[bnb]' (not installed: peft)\n"
    )
    assert not (tmp_path / "demo").exists()


def _gnmr_hf() -> list[str]:
    """The installed `gnmr-hf` script, as a user runs it (next to this Python), else the module."""
    script = Path(sys.executable).with_name("gnmr-hf")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gnmr_hf.cli"]


def test_report_into_a_pipe_its_reader_closed_ends_quietly_as_a_unix_tool_does(tmp_path):
    # `gnmr-hf report TRACE | head -4`: head has gone when the summary is written. The reader here closes its end at
    # once, before the command has imported what it needs, so that every write meets a closed pipe.
    trace = write_trace(tmp_path / "gnmr_trace.jsonl")
    run = subprocess.Popen(
        [*_gnmr_hf(), "report", str(trace), "--no-plots"], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    run.stdout.close()
    err = run.stderr.read().decode()
    assert run.wait(timeout=120) == 141, err  # 128 + SIGPIPE: what a shell reports for `cat` in the same place
    assert err == ""
