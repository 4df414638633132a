"""What a user reads on the console: GNMR's summary and warnings on lines of their own, under the Trainer's progress
bar; no other library's words in the `gnmr-hf demo` and recipe output (deepspeed's guess of a CPU accelerator,
transformers' FutureWarning on the `is_gradient_checkpointing` that peft reads); and the demo with no trace."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# The two foreign messages, as they printed.
FOREIGN = ("Setting accelerator to CPU", "is_gradient_checkpointing")


def _screen(text: str) -> list[str]:
    """The lines a terminal shows for `text`: on each line, what was written after its last carriage return (which a
    progress bar uses to redraw itself)."""
    return [line.rsplit("\r", 1)[-1] for line in text.split("\n")]


def test_the_end_summary_and_the_budget_warning_start_on_lines_of_their_own_below_the_progress_bar(
    tiny_llama_dir, dataset, tmp_path, monkeypatch
):
    from transformers import TrainingArguments

    from gnmr_hf import GNMRConfig, GNMRTrainer
    from gnmr_hf.experiments.tiny import load_int8_lora

    # A terminal: stdout and stderr on one screen, the bar (tqdm, stderr) and GNMR's output (stdout, and a log handler
    # as a user's logging setup has one) in the order they were written.
    terminal = io.StringIO()
    monkeypatch.setattr(sys, "stdout", terminal)
    monkeypatch.setattr(sys, "stderr", terminal)
    handler = logging.StreamHandler(terminal)
    logging.getLogger("gnmr_hf").addHandler(handler)
    # max_active=1 and thresholds just above 1: units are left out step after step, so train end warns of the budget.
    config = GNMRConfig(max_active=1, lock_steps=2, window=2, min_history=2, alpha=1.01, beta=1.01, trace_file="")
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=8, per_device_train_batch_size=4, logging_steps=100,
        save_strategy="no", report_to=[], disable_tqdm=False,
    )  # fmt: skip
    try:
        GNMRTrainer(model=load_int8_lora(tiny_llama_dir), args=args, train_dataset=dataset, gnmr_config=config).train()
    finally:
        logging.getLogger("gnmr_hf").removeHandler(handler)
    screen = _screen(terminal.getvalue())
    assert "GNMR summary" in screen, terminal.getvalue()[-2000:]
    warnings = [line for line in screen if "GNMR: the budget was full" in line]
    assert warnings and all(line.startswith("GNMR: the budget was full") for line in warnings), warnings


@pytest.fixture(scope="module")
def demo_without_trace(tmp_path_factory):
    """`gnmr-hf demo --trace_file ''`, run as a user runs it (two steps)."""
    out = tmp_path_factory.mktemp("demo_without_trace")
    command = [
        sys.executable,
        "-m",
        "gnmr_hf.cli",
        "demo",
        "--trace_file",
        "",
        "--max_steps",
        "2",
        "--spike_step",
        "0",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run([*command, "--output_dir", str(out)], capture_output=True, text=True, timeout=300, env=env)
    return done, out


def test_a_demo_without_a_trace_trains_and_prints_its_summary_without_plots(demo_without_trace):
    # trace_file='' is the config's documented "no trace": the demo honours it (a run of the library would) and still
    # shows what GNMR did, from the summary the callback kept while training; plots need a trace, so there are none.
    done, out = demo_without_trace
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("gnmr-hf demo: bnb_int8 LoRA fine-tune of tiny, 2 steps, spike off; output in ")
    assert "no trace (--trace_file ''), so no plots" in done.stdout.splitlines()[0]
    assert (
        "GNMR summary" in done.stdout + done.stderr and "optimizer steps                2" in done.stdout + done.stderr
    )
    assert not list(out.glob("*.jsonl")) and not list(out.glob("*.png")) and (out / "gnmr_summary.json").is_file()


def test_the_demo_prints_no_foreign_message(demo_without_trace):
    done, _ = demo_without_trace
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [m for m in FOREIGN if m in done.stdout + done.stderr], done.stderr[-3000:]


def test_the_finetune_recipe_prints_no_foreign_message(tmp_path):
    command = [sys.executable, str(ROOT / "recipes" / "finetune_13b.py"), "--preset", "tiny", "--arm", "gnmr"]
    command += ["--max_steps", "1", "--max_train_samples", "4", "--per_device_train_batch_size", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [*command, "--output_dir", str(tmp_path)], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert not [m for m in FOREIGN if m in done.stdout + done.stderr], done.stderr[-3000:]


def test_the_readme_names_the_metrics_as_tensorboard_and_w_and_b_file_them():
    from transformers.integrations.integration_utils import rewrite_logs

    readme = (ROOT / "README.md").read_text()
    for metric in ("gnmr/active", "gnmr/entered", "gnmr/max_risk"):
        (shown,) = rewrite_logs({metric: 0.0})  # what TensorBoardCallback and WandbCallback log a training metric as
        assert f"`{shown}`" in readme, shown
