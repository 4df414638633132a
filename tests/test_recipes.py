"""recipes/finetune_13b.py: flags, prompt masking, each arm's tiny preset end to end, its output_dir evaluated, and
two processes under `accelerate launch` taking identical GNMR decisions at every step.

The arms run a smaller slice of the tiny preset (a few steps on a few dozen examples) in this process; the
two-process test launches the recipe as users do, with the shipped CPU config (gloo, loopback, a free port).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gnmr_hf import GNMRConfig
from gnmr_hf.experiments.evaluation import PERPLEXITY_TASK, evaluate_model, write_local_tasks
from gnmr_hf.experiments.tiny import char_tokenizer
from gnmr_hf.trace import read_trace

from trainer_utils import free_port, launch, load_recipe

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "finetune_13b.py"
# A smaller slice of the tiny preset; thresholds low enough that GNMR flips units within it.
STEPS = 4  # GNMR needs 2 steps of history and a third to decide; its flips apply from the fourth
SLICE = ["--preset", "tiny", "--max_train_samples", "32", "--per_device_train_batch_size", "2", "--logging_steps", "2"]
ACTIVE_GNMR = ["--alpha", "1.05", "--beta", "1.05", "--min_history", "2", "--window", "2", "--lock_steps", "2"]


def recipe():
    return load_recipe("finetune_13b")


def test_training_arguments_recipe_arguments_and_gnmr_config_share_no_flag():
    from transformers import TrainingArguments

    names = [{f.name for f in dataclasses.fields(c)} for c in (TrainingArguments, recipe().FinetuneArguments)]
    gnmr = {f.name for f in dataclasses.fields(GNMRConfig)}
    assert not names[0] & names[1] and not names[0] & gnmr and not names[1] & gnmr
    recipe().build_parser()  # argparse itself refuses two flags of one name


def test_flags_of_all_three_parse_together_over_the_preset_defaults(tmp_path):
    training, args, gnmr = recipe().parse_args(
        [
            *("--preset", "tiny", "--arm", "gnmr", "--output_dir", str(tmp_path), "--learning_rate", "1e-4"),
            *("--lora_r", "2", "--max_active", "3", "--backend_options", "source=dequantize"),
        ]
    )
    assert (training.learning_rate, args.lora_r, gnmr.max_active) == (1e-4, 2, 3)
    assert gnmr.backend_options == {"source": "dequantize"}
    # Preset defaults under the flags given: CPU, activation checkpointing without reentrancy, GNMR thresholds.
    assert training.use_cpu and training.activation_checkpointing
    assert training.activation_checkpointing_kwargs == {"use_reentrant": False}
    assert (training.max_steps, gnmr.lock_steps, gnmr.alpha, args.lora_alpha) == (20, 4, 1.5, 8)

    # The 13b preset trains in bf16, which TrainingArguments refuses without a GPU unless told to use the CPU.
    training, args, gnmr = recipe().parse_args(["--arm", "int8", "--use_cpu", "--activation_checkpointing", "False"])
    assert args.model_name_or_path == "meta-llama/Llama-2-13b-hf" and args.dataset_name == "tatsu-lab/alpaca"
    assert training.bf16 and not training.activation_checkpointing
    assert training.output_dir == "runs/finetune_13b/int8"
    assert gnmr == GNMRConfig()  # the 13b preset keeps GNMR's own defaults


def test_a_bad_arm_name_in_python_is_an_error_that_names_the_flag_and_the_arms():
    with pytest.raises(ValueError, match=r"--arm must be one of int8, gnmr, gnmr_cause, bf16; got 'fp8'"):
        recipe().FinetuneArguments(arm="fp8")
    with pytest.raises(ValueError, match=r"--llm_int8_threshold must be >= 0 .*; got -1.0"):
        recipe().FinetuneArguments(arm="int8", llm_int8_threshold=-1.0)
    with pytest.raises(ValueError, match=r"--int8_training_kernel must be one of library, llm_int8; got 'fp'"):
        recipe().FinetuneArguments(arm="int8", int8_training_kernel="fp")


def test_a_bad_arm_name_on_the_command_line_lists_the_arms(capsys):
    with pytest.raises(SystemExit):
        recipe().parse_args(["--arm", "fp8"])
    err = capsys.readouterr().err
    assert "--arm" in err and "'fp8'" in err and all(arm in err for arm in ("int8", "gnmr", "bf16"))


def test_flags_that_do_not_fit_are_errors_that_name_them(capsys):
    for argv, flag in (
        (["--arm", "int8", "--check_rank_agreement"], "--check_rank_agreement"),
        (["--arm", "gnmr", "--gradient_checkpointing", "False"], "--activation_checkpointing"),
        (["--arm", "gnmr", "--preset", "huge"], "--preset"),
        (["--arm", "gnmr", "--train_file", "data.csv"], "--train_file"),
        (["--arm", "gnmr", "--train_file", "data.json", "--dataset_name", "tatsu-lab/alpaca"], "--dataset_name"),
    ):
        with pytest.raises(SystemExit):
            recipe().parse_args(argv)
        assert flag in capsys.readouterr().err, argv


def test_a_bad_backend_or_a_mistyped_flag_is_one_line_that_names_it(capsys):
    for argv, message in (
        (
            ["--backend", "nonexistent"],
            "error: --backend: unknown backend 'nonexistent'; known backends are ['act_quant',",
        ),
        (
            ["--max_activ", "2"],
            "error: unrecognized arguments: --max_activ 2 (--max_activ: did you mean --max_active?)",
        ),
        (["--lora-rr", "2"], "(--lora-rr: did you mean --lora_r?)"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            recipe().parse_args(["--preset", "tiny", "--arm", "gnmr", *argv])
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and err.count("\n") == 1 and message in err, err


def test_resuming_from_a_folder_that_is_not_a_checkpoint_is_one_line_before_any_model(tmp_path):
    # As a user runs it: one line on stderr, exit 2, no library's words first, nothing built (no output_dir).
    (tmp_path / "not_a_ckpt").mkdir()
    command = [sys.executable, str(RECIPE), "--preset", "tiny", "--arm", "gnmr", "--output_dir", str(tmp_path / "out")]
    command += ["--resume_from_checkpoint", str(tmp_path / "not_a_ckpt")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        f"error: --resume_from_checkpoint: {str(tmp_path / 'not_a_ckpt')!r} is not a checkpoint the Trainer saved "
        "(a checkpoint-N folder of an output_dir, holding trainer_state.json)"
    )
    assert not (tmp_path / "out").exists()


def test_a_gnmr_arm_with_a_backend_other_than_bnb_int8_is_one_line_before_any_model(tmp_path):
    # The arm loads its base in 8-bit, which only bnb_int8 manages; act_quant would refuse it after the model and the
    # data are loaded.
    command = [sys.executable, str(RECIPE), "--preset", "tiny", "--arm", "gnmr", "--backend", "act_quant"]
    command += ["--output_dir", str(tmp_path / "out")]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert done.stderr.startswith(
        "error: --backend act_quant: the gnmr arm trains LoRA on a base loaded in 8-bit (bitsandbytes Linear8bitLt), "
        "whose units only backend bnb_int8 manages"
    )
    assert not (tmp_path / "out").exists()


def _tokenized(rows: list[dict], **flags):
    from datasets import Dataset

    tokenizer = char_tokenizer()
    args = recipe().FinetuneArguments(arm="bf16", preset="tiny", **flags)
    return recipe().tokenize_instructions(Dataset.from_list(rows), args, tokenizer), tokenizer


def _text(ids: list[int], tokenizer) -> str:
    return "".join(tokenizer.convert_ids_to_tokens(ids))  # decode() would put spaces between characters


def _response(row: dict, tokenizer) -> str:
    return _text([t for t, label in zip(row["input_ids"], row["labels"], strict=True) if label != -100], tokenizer)


def test_alpaca_prompt_tokens_are_masked_out_of_the_labels():
    rows = [
        {"instruction": "Add 2 and 3.", "input": "", "output": "5"},
        {"instruction": "Reverse the word.", "input": "norm", "output": "mron"},
    ]
    data, tokenizer = _tokenized(rows)
    first, second = data[0], data[1]
    assert _text(first["input_ids"], tokenizer).startswith("Below is an instruction")
    assert "### Input:" in _text(second["input_ids"], tokenizer)
    # Only the response and the EOS that teaches the model to stop are trained on.
    assert [_response(first, tokenizer), _response(second, tokenizer)] == ["5<eos>", "mron<eos>"]
    assert first["labels"][-2:] == first["input_ids"][-2:]


def test_a_chat_template_is_used_when_the_tokenizer_has_one_and_only_the_reply_is_trained_on():
    from datasets import Dataset

    tokenizer = char_tokenizer()
    tokenizer.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    args = recipe().FinetuneArguments(arm="bf16", preset="tiny")
    rows = [{"instruction": "Add 2 and 3.", "input": "", "output": "5"}]
    row = recipe().tokenize_instructions(Dataset.from_list(rows), args, tokenizer)[0]
    assert _text(row["input_ids"], tokenizer) == "<user>Add 2 and 3.</s><assistant>5</s>"
    assert _response(row, tokenizer) == "5</s>"


def test_plain_prompt_is_the_instruction_as_written_and_only_the_answer_is_trained_on():
    # Even with a chat template on the tokenizer: plain is for data already in the form the model is asked in.
    tokenizer = char_tokenizer()
    tokenizer.chat_template = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}"
    rows = [
        {"instruction": "2+3= Answer:", "input": "", "output": " 5"},
        {"instruction": "Reverse:", "input": "norm", "output": " mron"},
    ]
    from datasets import Dataset

    args = recipe().FinetuneArguments(arm="bf16", preset="tiny", prompt_template="plain")
    first, second = recipe().tokenize_instructions(Dataset.from_list(rows), args, tokenizer)
    assert _text(first["input_ids"], tokenizer) == "2+3= Answer: 5<eos>"
    # The input follows after a blank line (the character tokenizer has no newline: <unk>).
    assert _text(second["input_ids"], tokenizer) == "Reverse:<unk><unk>norm mron<eos>"
    assert [_response(first, tokenizer), _response(second, tokenizer)] == [" 5<eos>", " mron<eos>"]
    with pytest.raises(ValueError, match="--prompt_template must be one of auto, chat, alpaca, plain; got 'raw'"):
        recipe().FinetuneArguments(arm="bf16", preset="tiny", prompt_template="raw")


def test_examples_cut_before_their_response_are_dropped():
    rows = [
        {"instruction": "x" * 400, "input": "", "output": "long"},
        {"instruction": "Hi.", "input": "", "output": "ok"},
    ]
    data, tokenizer = _tokenized(rows, max_seq_length=240)
    assert len(data) == 1 and _response(data[0], tokenizer) == "ok<eos>"


def bnb_matmul():
    import bitsandbytes

    return bitsandbytes.matmul


@pytest.fixture(scope="module")
def arms(tmp_path_factory) -> dict[str, Path]:
    """A smaller slice of the tiny preset for each arm, in this process: 2 steps for int8 and bf16, STEPS for gnmr,
    which checks rank agreement with itself (one rank) and has thresholds low enough to flip units."""
    root = tmp_path_factory.mktemp("arms")
    for arm in ("int8", "gnmr", "bf16"):
        # The int8 arm runs pure INT8 (no LLM.int8() outlier decomposition), as users set it for speed, and with
        # LLM.int8() in training, as on CUDA; the recipe puts bitsandbytes' own dispatcher back when it ends.
        pure = ["--llm_int8_threshold", "0", "--int8_training_kernel", "llm_int8"]
        extra = ["--max_steps", "2", *(pure if arm == "int8" else [])]
        if arm == "gnmr":
            extra = ["--max_steps", str(STEPS), *ACTIVE_GNMR, "--check_rank_agreement"]
        library = bnb_matmul()
        assert recipe().main(["--arm", arm, *SLICE, *extra, "--output_dir", str(root / arm)]) == 0
        assert bnb_matmul() is library
    return {arm: root / arm for arm in ("int8", "gnmr", "bf16")}


def test_each_arm_writes_its_adapter_tokenizer_and_run_file(arms):
    for arm, out in arms.items():
        assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
        assert (out / "tokenizer_config.json").is_file()
        run = json.loads((out / "gnmr_run.json").read_text())
        assert run["base_model"] == str((out / "base_model").resolve())
        assert (run["arm"], run["load_in_8bit"], run["adapter"]) == (arm, arm != "bf16", ".")
        assert run["llm_int8_threshold"] == (0.0 if arm == "int8" else 6.0)
        assert run["int8_training_kernel"] == ("llm_int8" if arm == "int8" else "library")
        assert json.loads((out / "train_results.json").read_text())["train_loss"] > 0
        assert (out / "gnmr_trace.jsonl").exists() == (arm == "gnmr")


def test_the_gnmr_arm_writes_its_trace_summary_and_plots_and_flips_units(arms):
    out = arms["gnmr"]
    for name in ("gnmr_summary.json", "gnmr_recovery.png", "gnmr_scores.png"):
        assert (out / name).is_file(), name
    header, steps = read_trace(out / "gnmr_trace.jsonl")
    assert len(steps) == STEPS and any(s["entered"] for s in steps)
    assert all(len(s["active"]) <= header["config"]["max_active"] for s in steps)
    digests = [json.loads(line) for line in (out / "gnmr_rank_agreement.jsonl").read_text().splitlines()]
    assert [d["step"] for d in digests] == [s["step"] for s in steps]
    assert [d["entered"] for d in digests] == [s["entered"] for s in steps]


def test_each_output_dir_evaluates_with_its_adapter_on_its_base(arms, tmp_path):
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=[str(write_local_tasks(tmp_path))], include_defaults=False)
    key = "bits_per_byte,none"

    def bits_per_byte(model: str, **kwargs) -> float:
        results = evaluate_model(model, tasks=PERPLEXITY_TASK, limit=2, device="cpu", task_manager=tasks, **kwargs)
        return results["results"][PERPLEXITY_TASK][key]

    base = bits_per_byte(str(arms["bf16"] / "base_model"))
    for arm, out in arms.items():
        eight_bit = json.loads((out / "gnmr_run.json").read_text())["load_in_8bit"]
        tuned = bits_per_byte(str(out), load_in_8bit=eight_bit)
        assert tuned != base and torch.isfinite(torch.tensor(tuned)), arm


def test_rank_agreement_stops_at_the_first_step_where_ranks_differ(tmp_path, monkeypatch):
    import numpy as np
    from transformers import TrainerControl, TrainerState

    from gnmr_hf import GNMRCallback

    gnmr = GNMRCallback(GNMRConfig())
    none = np.array([], dtype=np.int64)
    gnmr.last_decision = SimpleNamespace(
        step=3, active=np.array([1]), entered=none, exited=none, risky=none, max_risk=0.5
    )
    check = recipe().RankAgreementCallback(SimpleNamespace(callbacks=[gnmr]))
    args = SimpleNamespace(output_dir=str(tmp_path), device=torch.device("cpu"))
    state, control = TrainerState(global_step=2), TrainerControl()
    check.on_train_begin(args, state, control)
    # Another rank whose digest differs: every rank raises (they all see both digests); rank 0 wrote what it saw.
    monkeypatch.setattr("accelerate.utils.gather", lambda t: torch.cat([t, t + 1]))
    with pytest.raises(RuntimeError, match="differ across ranks at optimizer step 3"):
        check.on_optimizer_step(args, state, control)
    check.on_train_end(args, state, control)
    line = json.loads((tmp_path / "gnmr_rank_agreement.jsonl").read_text())
    assert line["step"] == 3 and line["active"] == [1] and len(set(line["digests"])) == 2


def test_two_processes_under_accelerate_launch_take_identical_gnmr_decisions_at_every_step(tmp_path):
    out = tmp_path / "ddp"
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--config_file",
        str(ROOT / "recipes" / "configs" / "cpu_2proc_gloo.yaml"),
        "--main_process_port",
        str(free_port()),
        str(RECIPE),
        "--arm",
        "gnmr",
        *SLICE,
        *("--max_steps", str(STEPS)),
        *ACTIVE_GNMR,
        "--check_rank_agreement",
        "--output_dir",
        str(out),
    ]
    launch(cmd, cwd=ROOT, env={"GLOO_SOCKET_IFNAME": "lo"})
    records = [json.loads(line) for line in (out / "gnmr_rank_agreement.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))
    for record in records:
        assert len(record["digests"]) == 2 and record["digests"][0] == record["digests"][1], record
    # The decisions compared are not trivially empty: units entered and left recovery during the run.
    assert any(r["entered"] for r in records) and any(r["active"] for r in records)
    _, steps = read_trace(out / "gnmr_trace.jsonl")
    assert [s["active"] for s in steps] == [r["active"] for r in records]


def test_help_shows_the_recipe_flags_first_and_no_none_output_dir(capsys):
    with pytest.raises(SystemExit):
        recipe().parse_args(["--help"])
    text = capsys.readouterr().out
    assert "runs/finetune_13b/None" not in text
    assert text.index("--arm") < text.index("--max_active") < text.index("--learning_rate")


def test_the_13b_preset_on_a_cpu_points_at_the_tiny_preset(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    argv = ["--arm", "gnmr", "--model_name_or_path", "m", "--dataset_name", "d"]
    with pytest.raises(SystemExit) as exit_info:
        recipe().parse_args(argv)
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and err.count("\n") == 1
    assert "bf16" in err and "`--preset tiny` runs this recipe on a CPU" in err


def test_the_gnmr_arm_runs_a_baseline_policy_over_the_same_units_and_gnmr_cause_refuses_one(tmp_path, capsys):
    # The random baseline at GNMR's budget, as docs/results.md runs it on SmolLM2: one unit of 14 every step.
    out = tmp_path / "random"
    argv = ["--arm", "gnmr", *SLICE, "--max_steps", "3", "--policy", "random"]
    assert recipe().main([*argv, "--policy_options", "mean_active=1,seed=0", "--output_dir", str(out)]) == 0
    header = json.loads((out / "gnmr_trace.jsonl").read_text().splitlines()[0])
    assert header["config"]["policy"] == "random"
    summary = json.loads((out / "gnmr_summary.json").read_text())
    assert summary["recovery_fraction"] == pytest.approx(1 / summary["units"])
    capsys.readouterr()  # the run's own log
    with pytest.raises(SystemExit) as stop:
        recipe().parse_args(["--arm", "gnmr_cause", "--preset", "tiny", "--policy", "random"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith("error: --policy random: the gnmr_cause arm runs policy=cause")
