"""Anomalous documents in training (`--anomalies`, `--anomaly_every`): each kind, determinism, where they go, what
is recorded, and the flags' bad input."""

from __future__ import annotations

import base64
import json
import re
from typing import Any

import pytest
import torch

from gnmr_hf import GNMRCallback
from gnmr_hf.experiments.pretrain import (
    ANOMALY_KINDS,
    AnomalousBlocks,
    AnomalySchedule,
    ByteTokenizer,
    anomalous_text,
    block_dataset,
)
from gnmr_hf.trace import read_trace

from trainer_utils import load_recipe, load_script

SOURCE = "def f(x, y):\n    return x + y  # add\n\n\nclass A:\n    pass\n" * 40


def test_the_schedule_puts_one_kind_on_every_nth_step_in_turn():
    schedule = AnomalySchedule.parse("repeat, digits", 5)
    assert schedule.steps(22) == [(5, "repeat"), (10, "digits"), (15, "repeat"), (20, "digits")]
    assert schedule.record(12) == {"kinds": ["repeat", "digits"], "every": 5, "scope": "sequence",
                                   "steps": [[5, "repeat"], [10, "digits"]]}  # fmt: skip
    assert AnomalySchedule.parse("base64", 1).steps(3) == [(1, "base64"), (2, "base64"), (3, "base64")]


def test_each_kind_is_what_it_says():
    g = torch.Generator().manual_seed(0)
    repeat = anomalous_text("repeat", 300, g)
    assert len(repeat) == 300 and len(set(repeat)) == 1
    blob = anomalous_text("base64", 300, g)
    assert len(blob) == 300 and re.fullmatch(r"[A-Za-z0-9+/]+", blob)
    base64.b64decode(blob[:296])  # valid base64, cut at a 4-character boundary
    digits = anomalous_text("digits", 300, g)
    assert len(digits) == 300 and digits.isdigit() and len(set(digits)) == 10
    minified = anomalous_text("minified", 0, g, SOURCE)
    assert "\n" not in minified and "  " not in minified
    assert "def f(x,y):return x+y#add class A:pass" in minified  # no space beside punctuation, words kept apart
    with pytest.raises(ValueError, match="kind must be one of"):
        anomalous_text("emoji", 10, g)


def test_the_documents_depend_on_the_seed_and_step_alone():
    def text(seed: int) -> list[str]:
        g = torch.Generator().manual_seed(seed)
        return [anomalous_text(k, 64, g, SOURCE) for k in ANOMALY_KINDS]

    assert text(3) == text(3)
    assert text(3)[:3] != text(4)[:3]


def _blocks(scope: str = "sequence", seed: int = 0, batch: int = 4) -> tuple[AnomalousBlocks, Any]:
    tokens = ByteTokenizer().encode(SOURCE * 4)
    clean = block_dataset(tokens, 32, 12 * batch, seed=0)
    tokenizer = ByteTokenizer()
    schedule = AnomalySchedule.parse("repeat,base64,digits,minified", 3, scope)
    blocks = AnomalousBlocks(
        clean, schedule, batch=batch, seq_len=32, max_steps=12, seed=seed,
        encode=tokenizer.encode, decode=tokenizer.decode, tokens=tokens,
    )  # fmt: skip
    return blocks, clean


def test_one_sequence_of_each_anomalous_step_is_replaced_and_nothing_else():
    blocks, clean = _blocks()
    # Steps 3, 6, 9, 12 (1-based); the Trainer reads 4 sequences per step in order: the first of each is replaced.
    assert blocks.kinds == {8: "repeat", 20: "base64", 32: "digits", 44: "minified"}
    assert len(blocks) == len(clean) == 48
    for i in range(48):
        item = blocks[i]
        assert item["input_ids"].dtype == torch.long and item["input_ids"].shape == (32,)
        assert torch.equal(item["input_ids"], item["labels"])  # trained on like any sequence
        assert torch.equal(item["input_ids"], clean[i]["input_ids"]) == (i not in blocks.kinds)
    assert len(set(blocks[8]["input_ids"].tolist())) == 1
    assert bytes(blocks[32]["input_ids"].tolist()).isdigit()


def test_batch_scope_replaces_every_sequence_of_the_step():
    blocks, _ = _blocks("batch")
    assert sorted(blocks.kinds) == [8, 9, 10, 11, 20, 21, 22, 23, 32, 33, 34, 35, 44, 45, 46, 47]
    assert blocks[20]["input_ids"].tolist() != blocks[21]["input_ids"].tolist()  # each its own document


def test_every_arm_of_a_seed_gets_the_same_anomalies_and_another_seed_others():
    a, _ = _blocks(seed=0)
    b, _ = _blocks(seed=0)
    c, _ = _blocks(seed=1)
    assert all(torch.equal(a[i]["input_ids"], b[i]["input_ids"]) for i in a.kinds)
    assert not torch.equal(a[20]["input_ids"], c[20]["input_ids"])


def test_the_recipe_trains_on_them_and_records_them_in_the_result_and_the_trace(tmp_path):
    out = tmp_path / "run"
    load_recipe("pretrain_actquant").main(
        ["--preset", "tiny", "--output_dir", str(out), "--arms", "static_low", "gnmr", "--anomalies", "digits,repeat",
         "--anomaly_every", "7", "--logging_steps", "1", "--plot", "false"]
    )  # fmt: skip
    for arm in ("static_low", "gnmr"):
        result = json.loads((out / arm / "seed0" / "result.json").read_text())
        assert result["anomalies"] == {
            "kinds": ["digits", "repeat"], "every": 7, "scope": "sequence", "steps": [[7, "digits"], [14, "repeat"]]
        }  # fmt: skip
        assert [s for s, _ in result["train_loss"]] == list(range(1, 21))
    _, records = read_trace(out / "gnmr" / "seed0")
    marks = {r["step"]: r["marks"] for r in records if "marks" in r}
    assert marks == {7: {"anomaly": "digits"}, 14: {"anomaly": "repeat"}}


def test_without_anomalies_nothing_changes(tmp_path):
    out = tmp_path / "run"
    load_recipe("pretrain_actquant").main(
        ["--preset", "tiny", "--output_dir", str(out), "--arms", "gnmr", "--max_steps", "4", "--plot", "false"]
    )
    result = json.loads((out / "gnmr" / "seed0" / "result.json").read_text())
    assert "anomalies" not in result
    _, records = read_trace(out / "gnmr" / "seed0")
    assert not any("marks" in r for r in records)


@pytest.mark.parametrize("name", ["pretrain_actquant", "pretrain_dynamic_precision"])
@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--anomalies", "repeat,emoji"), "--anomalies: 'emoji' is not an anomaly kind; choose from repeat, base64"),
        (("--anomalies", "repeat", "--anomaly_every", "0"), "--anomaly_every must be an int >= 1"),
        (("--anomalies", "repeat", "--anomaly_every", "-3"), "--anomaly_every must be an int >= 1"),
        (("--anomalies", ","), "--anomalies: give at least one kind"),
        (("--anomaly_every", "5"), "--anomaly_every needs --anomalies"),
        (("--anomalies", "digits", "--anomaly_scope", "document"), "--anomaly_scope must be one of sequence, batch"),
    ],
)
def test_bad_anomaly_flags_exit_with_one_line(name, argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        load_recipe(name).main(["--preset", "tiny", "--output_dir", str(tmp_path / "run"), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "run").exists()


def test_mark_step_refuses_what_it_cannot_write():
    callback = GNMRCallback(backend="act_quant")
    callback.mark_step(3, data="repeat")
    callback.mark_step(3, source="web")
    assert callback.step_marks == {3: {"data": "repeat", "source": "web"}}
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        callback.mark_step(0, data="x")
    with pytest.raises(ValueError, match="at least one field"):
        callback.mark_step(2)
    with pytest.raises(ValueError, match="JSON values"):
        callback.mark_step(2, data=object())


def test_the_analysis_finds_the_anomalous_steps_and_what_broke_on_them(tmp_path, capsys):
    common = ["--preset", "tiny", "--max_steps", "36", "--eval_steps", "36", "--plot", "false", "--logging_steps", "1",
              "--backend_options", "low_format=e2m1,high_format=e4m3", "--anomalies", "repeat,digits",
              "--anomaly_every", "9"]  # fmt: skip
    recipe = load_recipe("pretrain_dynamic_precision")
    recipe.main([*common, "--output_dir", str(tmp_path / "diag"), "--arms", "gnmr_impact", "--monitor_only", "true",
                 "--trace_top_k", "64", "--impact_options", "every=1", "--oracle_every", "3"])  # fmt: skip
    recipe.main([*common, "--output_dir", str(tmp_path / "high"), "--arms", "static_high"])
    analysis = load_script("benchmarks/anomaly_analysis.py")
    out = tmp_path / "report.json"
    report = analysis.main(
        [str(tmp_path / "diag" / "gnmr_impact" / "seed0"), "--high", str(tmp_path / "high" / "static_high" / "seed0"),
         "--skip", "4", "--ratio", "2", "--out", str(out), "--plot", str(tmp_path / "steps.png")]
    )  # fmt: skip
    assert (tmp_path / "steps.png").stat().st_size > 10_000
    assert report["series"]["step"] == list(range(1, 37)) and len(report["series"]["active"]) == 36
    assert report["anomalies"] == [[9, "repeat"], [18, "digits"], [27, "repeat"], [36, "digits"]]
    assert json.loads(out.read_text()) == json.loads(json.dumps(report))
    assert [(r["step"], r["kind"]) for r in report["steps"]] == [(9, "repeat"), (18, "digits"), (27, "repeat"),
                                                                 (36, "digits")]  # fmt: skip
    # Clean: past step 4, not anomalous, not within 4 steps after one.
    assert report["clean_steps"] == len([s for s in range(5, 37) if s % 9 and (s % 9) > 4])
    for row in report["steps"]:
        assert len(row["top_impact"]) == 5 and row["impact_total"] > 0 and "cheap_path_loss" in row
        assert set(row["broken"]) <= {name for name, _, _ in row["top_impact"]}
        assert all(1 <= n <= 5 for n in row["broken_for"].values())
        assert row["max_risk"] is not None and row["high_max_risk"] is not None  # both runs' GNMR, the same step
    for spike in report["spikes"]:
        assert spike["step"] > 4 and spike["risky"] and (spike["anomaly"] is None) == (spike["step"] % 9 != 0)
    assert set(report["kinds"]) == {"repeat", "digits"} and report["kinds"]["repeat"]["occurrences"] == 2
    assert set(report["oracle"]["gap_total_ratio_by_kind"]) == {"repeat", "digits"}
    assert "| repeat | 2 |" in capsys.readouterr().out


def test_the_analysis_refuses_a_run_it_cannot_read(tmp_path):

    analysis = load_script("benchmarks/anomaly_analysis.py")
    with pytest.raises(SystemExit) as exit_info:
        analysis.main([str(tmp_path)])
    assert exit_info.value.code == 2
    (tmp_path / "result.json").write_text(json.dumps({"arm": "static_low", "max_steps": 4, "train_loss": []}))
    with pytest.raises(SystemExit, match="has no anomalies"):
        analysis.main([str(tmp_path)])


def test_the_analysis_reads_each_measure_back_from_the_running_estimate():
    from trainer_utils import load_script

    analysis = load_script("benchmarks/anomaly_analysis.py")
    measures = [0.05, 0.04, 9.7, 0.06, 0.05]  # one unit, a one-step rise at the third step
    estimate, records = None, []
    for step, m in enumerate(measures, start=1):
        estimate = m if estimate is None else 0.5 * estimate + 0.5 * m  # the policy's rule, smoothing 0.5
        records.append({"type": "step", "step": step, "impact": {"estimate": [[0, estimate]]}})
    got = analysis._per_unit(records, 1, "impact", smoothing=0.5)
    assert [round(float(got[s][0]), 9) for s in range(1, 6)] == measures
    records.append({"type": "step", "step": 6, "impact": {"estimate": [[0, "inf"]]}})  # an overflowed cheap path
    records.append({"type": "step", "step": 7, "impact": {"estimate": [[0, 0.07]]}})  # replaces it, unmixed
    got = analysis._per_unit(records, 1, "impact", smoothing=0.5)
    assert got[6][0] == float("inf") and got[7][0] == 0.07


def _arm_result(folder, val: float, losses: dict[int, float], **extra: Any) -> Any:
    folder.mkdir(parents=True)
    anomalies = {"kinds": ["repeat", "digits"], "every": 10, "scope": "sequence"}
    anomalies["steps"] = [[10, "repeat"], [20, "digits"], [30, "repeat"], [40, "digits"]]
    result = {"final_eval_loss": val, "train_loss": sorted(losses.items()), "anomalies": anomalies, **extra}
    (folder / "result.json").write_text(json.dumps(result))
    return folder


def test_anomaly_arms_puts_each_arm_against_the_statics_of_its_seed(tmp_path, capsys):
    main = load_script("benchmarks/anomaly_arms.py").main

    high = {s: 2.0 for s in range(1, 41)}
    low = {s: 2.1 + (0.5 if s in (10, 30) else 0.0) for s in range(1, 41)}
    arm = {s: 2.05 + (0.2 if s == 30 else 0.0) for s in range(1, 41)}
    dirs = {
        "--low": _arm_result(tmp_path / "low", 3.0, low),
        "--high": _arm_result(tmp_path / "high", 2.0, high),
    }
    gnmr = _arm_result(tmp_path / "gnmr", 2.75, arm, recovery_fraction=0.02)
    skip = _arm_result(tmp_path / "skip", 2.9, low, stabilizer={"skipped_steps": 2, "acted_steps": [10, 30]})
    rows = main([*(str(x) for kv in dirs.items() for x in kv), f"gnmr={gnmr}", f"skip_step={skip}"])
    by = {r["arm"]: r for r in rows}
    assert [r["arm"] for r in rows] == ["static_high", "static_low", "gnmr", "skip_step"]
    assert by["gnmr"]["gap_closed"] == pytest.approx(0.25) and by["gnmr"]["unit_steps"] == 0.02
    assert by["static_high"]["unit_steps"] == 1.0 and by["static_low"]["unit_steps"] == 0.0
    # Only the repeat steps past the warm-up get a column (10 is in it); clean steps leave out 4 after each anomaly.
    assert list(by["static_low"]["cheap_at"]) == [30]
    assert by["static_low"]["cheap_at"][30] == pytest.approx(0.6) and by["gnmr"]["cheap_at"][30] == pytest.approx(0.25)
    assert by["gnmr"]["cheap_clean_median"] == pytest.approx(0.05)
    assert by["skip_step"]["skipped_steps"] == [10, 30]
    assert "| skip_step (skipped 10, 30) | 2.9000 | 10.0% | 0.00% | 0.600 | 0.1000 |" in capsys.readouterr().out


def test_anomaly_arms_refuses_an_arm_of_other_anomalies_and_a_malformed_arm(tmp_path, capsys):
    main = load_script("benchmarks/anomaly_arms.py").main

    losses = {s: 2.0 for s in range(1, 41)}
    low, high = _arm_result(tmp_path / "low", 3.0, losses), _arm_result(tmp_path / "high", 2.0, losses)
    other = tmp_path / "other"
    _arm_result(other, 2.5, losses)
    record = json.loads((other / "result.json").read_text())
    record["anomalies"]["every"] = 5
    (other / "result.json").write_text(json.dumps(record))
    with pytest.raises(SystemExit, match="ran other anomalies"):
        main(["--low", str(low), "--high", str(high), f"x={other}"])
    with pytest.raises(SystemExit) as stopped:
        main(["--low", str(low), "--high", str(high), "no_folder"])
    assert stopped.value.code == 2 and "expected NAME=RUN_FOLDER" in capsys.readouterr().err


def test_anomaly_arms_draws_the_arms_and_the_units_one_arm_held(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    script = load_script("benchmarks/anomaly_arms.py")
    losses = {s: 2.0 for s in range(1, 41)}
    low, high = _arm_result(tmp_path / "low", 3.0, losses), _arm_result(tmp_path / "high", 2.0, losses)
    gnmr = _arm_result(tmp_path / "gnmr", 2.5, losses, recovery_fraction=0.05)
    names = ["model.layers.0.self_attn", "model.layers.0.mlp.up_proj", "model.layers.1.self_attn"]
    steps = [{"type": "step", "step": s, "active": [2] + ([1] if s in (10, 11) else [])} for s in range(1, 41)]
    lines = [{"type": "header", "version": 2, "units": names}, *steps]
    (gnmr / "gnmr_trace.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    # The units come back from the trace as the arm held them: one all the time, one at the anomalous step and after.
    got_names, active = script.held_units(gnmr)
    assert got_names == names and active[10] == [2, 1] and active[12] == [2]
    out = tmp_path / "fig" / "arms.png"
    base = ["--low", str(low), "--high", str(high), f"gnmr={gnmr}"]
    script.main([*base, "--plot", str(out)])
    assert out.stat().st_size > 10_000
    # --held is checked before anything is read, and it needs --plot.
    for extra, message in ((["--held", "x", "--plot", str(out)], "'x' is not one of the arms (gnmr)"),
                           (["--held", "gnmr"], "give --plot PATH too")):  # fmt: skip
        with pytest.raises(SystemExit) as stopped:
            script.main([*base, *extra])
        assert stopped.value.code == 2 and message in capsys.readouterr().err


def test_mark_anomalies_draws_a_line_per_step_on_every_axis_and_labels_each_kind_once():
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from gnmr_hf.experiments.pretrain.anomalies import mark_anomalies

    fig, axes = plt.subplots(2, 1)
    mark_anomalies(list(axes), [[10, "repeat"], [20, "digits"], [30, "repeat"]])
    assert [len(ax.lines) for ax in axes] == [3, 3]
    assert axes[0].get_legend_handles_labels()[1] == ["repeat", "digits"]
    assert axes[1].get_legend_handles_labels()[1] == []
    plt.close(fig)


def test_clean_steps_leave_out_each_anomalous_step_and_its_aftermath():
    from gnmr_hf.experiments.pretrain.anomalies import AFTERMATH_STEPS, clean_steps

    assert AFTERMATH_STEPS == 4
    expected = [*range(3, 10), *range(15, 20), *range(25, 31)]  # 10-14 and 20-24 out, and everything up to 2
    assert clean_steps(list(range(31)), {10: "repeat", 20: "digits"}, skip=2) == expected
    assert clean_steps([1, 2, 3, 4], [1], skip=0, after=1) == [3, 4]
