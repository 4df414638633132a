"""The command line as a user meets it: a mistake is one line naming the flag, exit status 2, no traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gnmr_hf.cli import main

ROOT = Path(__file__).resolve().parents[1]


def _fails_with(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err, err
    return err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--max_active", "-1"], "max_active must be an int >= 1, got -1"),
        (
            ["--backend", "nonsense"],
            "argument --backend: invalid choice: 'nonsense' (choose from 'bnb_int8', 'bnb_4bit')",
        ),
        (["--backend_options", "foo"], "'foo' in 'foo' is not 'key=value'"),
        (["--backend_options", "source=nowhere"], "source"),
        (["--max_steps", "0"], "--max_steps must be >= 1, got 0"),
        (["--alpha", "abc"], "argument --alpha: invalid float value: 'abc'"),
        (["--no_such_flag"], "not used by the HfArgumentParser: ['--no_such_flag']"),
    ],
)
def test_demo_user_errors_are_one_line(argv, message, capsys, tmp_path):
    assert message in _fails_with(["demo", "--output_dir", str(tmp_path), *argv], capsys)
    assert not any(tmp_path.iterdir())  # refused before any work


def test_an_unknown_command_is_named(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown command 'frobnicate'; the commands are demo, report")


def test_report_on_a_binary_file_names_the_file(tmp_path, capsys):
    path = tmp_path / "model.safetensors"
    path.write_bytes(bytes(range(256)) * 4)
    assert main(["report", str(path), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert str(path) in err and "not a text file" in err


def test_report_on_the_summary_says_it_is_not_a_trace(tmp_path, capsys):
    path = tmp_path / "gnmr_summary.json"
    path.write_text(json.dumps({"units": 14, "steps": 40}, indent=2))
    assert main(["report", str(path), "--no-plots"]) == 2
    err = capsys.readouterr().err
    assert "is one JSON document" in err and "not a gnmr-hf trace" in err and "is not JSON" not in err


def test_demo_help_is_quiet_quick_and_documents_every_flag():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, "-m", "gnmr_hf.cli", "demo", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    assert done.stdout.startswith("usage: gnmr-hf demo")
    for flag in ("--max_steps", "--spike_factor", "--spike_module", "--seed", "--spike_step"):
        block = done.stdout.split(f"  {flag} ", 1)[1].split("\n  --", 1)[0]
        assert len(block.split()) > 3, f"{flag} has no help text: {block!r}"
