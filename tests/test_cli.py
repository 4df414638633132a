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
        (["--no_such_flag"], "error: unrecognized arguments: --no_such_flag\n"),
        (["--max_activ", "2"], "unrecognized arguments: --max_activ 2 (--max_activ: did you mean --max_active?)"),
        (["--lock-step=3"], "unrecognized arguments: --lock-step=3 (--lock-step: did you mean --lock_steps?)"),
        (["--policy", "caus"], "--policy: unknown policy 'caus' (did you mean 'cause'?); known policies are "),
        (
            ["--spike_module", "model.layers.9.nope"],
            "--spike_module must be a LoRA layer of tiny, model.layers.N.self_attn.{q,k,v,o}_proj or "
            "model.layers.N.mlp.{gate,up,down}_proj with N in 0..1",
        ),
    ],
)
def test_demo_user_errors_are_one_line(argv, message, capsys, tmp_path):
    assert message in _fails_with(["demo", "--output_dir", str(tmp_path), *argv], capsys)
    assert not any(tmp_path.iterdir())  # refused before any work


def test_an_unknown_command_is_named(capsys):
    assert main(["frobnicate"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown command 'frobnicate'; the commands are demo, report")
    assert main(["dmeo"]) == 2
    assert capsys.readouterr().err.startswith("error: unknown command 'dmeo' (did you mean demo?); the commands are")


def test_a_mistyped_report_flag_gets_the_right_name(capsys):
    assert "unrecognized arguments: --tpo 3 (--tpo: did you mean --top?)" in _fails_with(
        ["report", "trace.jsonl", "--tpo", "3"], capsys
    )


def test_a_mistyped_advise_flag_gets_the_right_name_and_no_prefix_is_taken_for_it(capsys):
    message = "unrecognized arguments: --min_shrae 0.3 (--min_shrae: did you mean --min_share?)"
    assert message in _fails_with(["advise", "trace.jsonl", "--min_shrae", "0.3"], capsys)
    # No abbreviations: a prefix is a typo to name, not a flag to guess.
    assert "--min_shar: did you mean --min_share?" in _fails_with(["advise", "trace.jsonl", "--min_shar", "1"], capsys)


def test_a_spike_module_that_holds_lora_layers_is_accepted_before_the_model_is_built():
    from gnmr_hf.experiments.demo import check_spike_module

    for name in ("model.layers.1.mlp.down_proj", "model.layers.0.self_attn", "model.layers.1"):
        check_spike_module(name)
    for name in ("model.layers.1.mlp.down", "model.layers.2.mlp.down_proj"):
        with pytest.raises(ValueError, match="--spike_module must be a LoRA layer"):
            check_spike_module(name)


def _gnmr_hf() -> list[str]:
    """The installed `gnmr-hf` script, as a user runs it (next to this Python), else the module."""
    script = Path(sys.executable).with_name("gnmr-hf")
    return [str(script)] if script.exists() else [sys.executable, "-m", "gnmr_hf.cli"]


def test_help_and_a_bad_command_are_quick_because_they_import_no_torch():
    # The real figure, on an idle 2-core machine: 0.1 s (it was 1.2 s idle, 2.7-4.5 s busy, when it imported torch).
    # The bound leaves room for a loaded CI machine; the import check below is the exact one.
    import time

    start = time.perf_counter()
    done = subprocess.run([*_gnmr_hf(), "--help"], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0 and done.stdout.startswith("usage: gnmr-hf {demo,report,advise,plan}"), done.stderr
    assert elapsed < 2.0, f"gnmr-hf --help took {elapsed:.2f} s"
    start = time.perf_counter()
    done = subprocess.run([*_gnmr_hf(), "advise", "--help"], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert done.returncode == 0 and done.stdout.startswith("usage: gnmr-hf advise"), done.stderr
    assert elapsed < 2.0, f"gnmr-hf advise --help took {elapsed:.2f} s"
    code = (
        "import sys; from gnmr_hf.cli import main; main(['--help']); main(['dmeo'])\n"
        "try:\n    main(['advise', '--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules), file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.stderr.splitlines()[-1] == "[]", done.stderr


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
    # A flag with a fixed set of values lists them; --policy's set is open (gnmr_hf.register_policy): its help names
    # the built-in ones.
    policy = " ".join(done.stdout.split("  --policy ", 1)[1].split("\n  --", 1)[0].split())
    assert policy.startswith("POLICY Which policy chooses the recovery set: 'paper' (default)") and "'cause'" in policy
    assert "  --threshold_schedule {constant,linear,cosine}," in done.stdout


def _scripts() -> list[Path]:
    return sorted([*(ROOT / "recipes").glob("*.py"), *(ROOT / "benchmarks").glob("*.py")])


@pytest.mark.parametrize("script", _scripts(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_script_imports_its_libraries_inside_quiet_unused_imports(script):
    # What keeps torchao's, torch's and bitsandbytes' import-time messages off a script's screen (its --help and
    # its one-line errors included): every import beyond the standard library inside the one quieting block.
    import ast

    loud = []
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Import | ast.ImportFrom):
            module = node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
            stdlib = module.split(".")[0] in (*sys.stdlib_module_names, "__future__")
            if not stdlib and module != "gnmr_hf.commandline":
                loud.append(f"line {node.lineno}: {module}")
        elif isinstance(node, ast.With):
            call = node.items[0].context_expr
            quiet = isinstance(call, ast.Call) and getattr(call.func, "id", "") == "quiet_unused_imports"
            assert quiet, f"{script.name} line {node.lineno}: a `with` at the top that is not quiet_unused_imports"
    assert not loud, f"{script.name} imports these outside `with quiet_unused_imports(...)`: {loud}"


def test_a_script_s_help_and_its_errors_come_before_any_library_s_words():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    script = ROOT / "recipes" / "pretrain_dynamic_precision.py"
    # Both at once: each spends its few seconds importing torch and transformers.
    runs = [
        subprocess.Popen([sys.executable, str(script), *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        for argv in (["--help"], ["--backend", "nonexistent"])
    ]
    (help_out, help_err), (out, err) = [[s.decode() for s in run.communicate(timeout=120)] for run in runs]
    assert runs[0].returncode == 0 and help_err == "", help_err
    assert help_out.startswith("usage: pretrain_dynamic_precision.py")
    assert runs[1].returncode == 2 and out == ""
    assert err.startswith("error: --backend: unknown backend 'nonexistent'; known backends are [")
    assert err.count("\n") == 1 and "'block_fp'" in err, err
