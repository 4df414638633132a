"""`gnmr-hf plan`, run as a user runs it: on a tiny GGUF and on a local transformers folder it prints the ranking and
the carve-outs and writes PLAN.json; every mistake in its flags is one line naming the flag, exit 2, before any
model loads."""

from __future__ import annotations

import json

import pytest

from gnmr_hf.cli import main
from gnmr_hf.experiments.tiny import build_tiny_llama, char_tokenizer, write_local_text, write_tiny_gguf


@pytest.fixture(scope="module")
def text(tmp_path_factory):
    return write_local_text(tmp_path_factory.mktemp("text") / "notes.txt", lines=64)


def test_plan_on_a_tiny_gguf_prints_the_ranking_and_writes_the_plan(tmp_path, text, capsys, monkeypatch):
    pytest.importorskip("gguf")
    monkeypatch.setenv("GNMR_HF_CACHE", str(tmp_path / "cache"))
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", str(gguf), "--data", str(text), "--batches", "2", "--batch_size", "2", "--seq_len",
            "16", "--backend_options", "low_format=e2m1", "--budget", "3", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    plan = json.loads(out.read_text())
    names = [r["unit"] for r in plan["ranked"]]
    impacts = [r["impact"] for r in plan["ranked"]]
    assert len(names) == 14 and impacts == sorted(impacts, reverse=True) and impacts[0] > 0
    assert plan["carve_out"] == names[:3] and plan["budget"] == 3
    assert set(plan["smallest"]) == {"0.9", "0.99"}
    assert "carve-out at budget 3: 3 units" in printed and "llm_int8_skip_modules = " in printed
    assert "module_filter_func=module_filter_fn" in printed and f"^{names[0]}$".replace(".", "\\\\.") in printed


def test_plan_takes_a_local_transformers_folder_and_a_fraction_as_budget(tmp_path, text, capsys):
    folder = build_tiny_llama(tmp_path / "model")
    char_tokenizer().save_pretrained(folder)
    out = tmp_path / "plan.json"
    argv = ["plan", "--model", str(folder), "--data", str(text), "--batches", "1", "--batch_size", "2", "--seq_len",
            "16", "--budget", "0.5", "--output", str(out)]  # fmt: skip
    assert main(argv) == 0
    plan = json.loads(out.read_text())
    assert len(plan["carve_out"]) == round(0.5 * len(plan["ranked"]))


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--data", "MISSING"], "error: --data must be a text file; MISSING is not there"),
        (["--backend", "block_fq"], "error: --backend: unknown backend 'block_fq'; known backends are ['act_quant'"),
        (["--backend_options", "low_format=e9m9"], "error: --backend_options: block_fp option 'low_format' must be"),
        (["--budget", "0"], "error: --budget must be a count of units (an int >= 1)"),
        (["--budget", "1.5"], "error: --budget must be a count of units"),
        (["--budget", "many"], "error: --budget must be a count of units"),
        (["--batches", "0"], "error: --batches must be an int >= 1, got 0"),
        (["--model", "no-such-model"], "error: --model: must be one of ['smollm2-135m']"),
    ],
)
def test_a_mistake_is_one_line_naming_the_flag_before_any_model_loads(flags, message, tmp_path, text, capsys):
    folder = tmp_path / "model"  # no model there: a mistake must be found before one would be loaded
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    base = {"--model": str(folder), "--data": str(text)}
    for flag, value in zip(flags[::2], flags[1::2], strict=True):
        base[flag] = value.replace("MISSING", str(tmp_path / "missing.txt"))
    argv = ["plan"] + [x for pair in base.items() for x in pair]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(message.replace("MISSING", str(tmp_path / "missing.txt")))


def test_a_budget_larger_than_the_units_found_is_one_line(tmp_path, text, capsys):
    folder = build_tiny_llama(tmp_path / "model")
    char_tokenizer().save_pretrained(folder)
    argv = ["plan", "--model", str(folder), "--data", str(text), "--batches", "1", "--batch_size", "1", "--seq_len",
            "8", "--budget", "500"]  # fmt: skip
    capsys.readouterr()
    with pytest.raises(SystemExit):
        main(argv)
    # Known only once the units are found, so after the model's loading bar: the error is the last line.
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: --budget 500 is more than the 14 units found"
