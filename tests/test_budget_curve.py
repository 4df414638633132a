"""benchmarks/budget_curve.py: gap closed per seed against the same seed's statics, unit-steps, the figure."""

from __future__ import annotations

import json

import pytest

from trainer_utils import load_script


def _arm(root, name, losses, fraction=0.0):
    for seed, loss in enumerate(losses):
        folder = root / name / f"seed{seed}"
        folder.mkdir(parents=True)
        result = {"seed": seed, "final_eval_loss": loss, "recovery_fraction": fraction}
        (folder / "result.json").write_text(json.dumps(result))
    return root / name


def test_each_seed_is_judged_against_its_own_statics(tmp_path, capsys):
    curve = load_script("benchmarks/budget_curve.py")
    low = _arm(tmp_path, "static_low", [2.0, 3.0])
    high = _arm(tmp_path, "static_high", [1.0, 1.0])
    a = _arm(tmp_path / "k1", "gnmr_impact", [1.5, 2.0], 0.01)
    b = _arm(tmp_path / "k2", "gnmr_impact", [1.2], 0.05)
    out = tmp_path / "curve.png"
    points = curve.main(["--low", str(low), "--high", str(high), "--series", f"impact={a},{b}", "--out", str(out)])
    assert points[0]["gap_closed"] == {0: 0.5, 1: 0.5} and points[0]["mean_unit_steps"] == 0.01
    assert points[1]["seeds"] == [0] and points[1]["mean_gap_closed"] == pytest.approx(0.8)
    assert out.stat().st_size > 1000
    assert "| impact |" in capsys.readouterr().out


def test_a_folder_without_results_is_named(tmp_path):
    curve = load_script("benchmarks/budget_curve.py")
    low = _arm(tmp_path, "static_low", [2.0])
    with pytest.raises(SystemExit) as exit_info:
        curve.main(["--low", str(low), "--high", str(tmp_path / "nothing"), "--series", f"x={low}"])
    assert exit_info.value.code == 2
    with pytest.raises(SystemExit) as exit_info:
        curve.main(["--low", str(low), "--high", str(low), "--series", "no_equals_sign"])
    assert exit_info.value.code == 2


def _runs(root, name, evals, train):
    """One seed's result.json with evaluations (step, loss) ending with the final one, and logged training losses."""
    folder = root / name / "seed0"
    folder.mkdir(parents=True)
    result = {"seed": 0, "max_steps": 40, "final_eval_loss": evals[-1][1], "eval_loss": evals, "train_loss": train}
    (folder / "result.json").write_text(json.dumps(result))
    return root / name


def test_the_gap_is_read_on_the_loss_named(tmp_path):
    curve = load_script("benchmarks/budget_curve.py")
    root = tmp_path
    # in training (the model on its cheap paths) 4.0 / 2.0 / 3.0; after (exact) 2.4 / 2.2 / 2.3; training loss over
    # steps 21-40 (the step-20 value is the first half's) 5.0 / 3.0 / 3.5.
    low = _runs(root, "low", [[40, 4.0], [40, 2.4]], [[20, 9.0], [30, 5.0], [40, 5.0]])
    high = _runs(root, "high", [[40, 2.0], [40, 2.2]], [[20, 9.0], [30, 3.0], [40, 3.0]])
    arm = _runs(root, "arm", [[40, 3.0], [40, 2.3]], [[20, 1.0], [30, 3.0], [40, 4.0]])
    for loss, closed in (("final", 0.5), ("in_training", 0.5), ("train_tail", 0.75)):
        points = curve.main(["--low", str(low), "--high", str(high), "--series", f"a={arm}", "--loss", loss])
        assert points[0]["gap_closed"][0] == pytest.approx(closed), loss
    after_only = _runs(root, "after_only", [[40, 2.3]], [[40, 4.0]])
    with pytest.raises(SystemExit, match="no evaluation during training"):
        curve.main(["--low", str(low), "--high", str(high), "--series", f"a={after_only}", "--loss", "in_training"])
