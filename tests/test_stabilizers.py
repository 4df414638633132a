"""The stabilizer arms: each from its package, hooked into the Trainer as its authors place it, every unit on the cheap
path, and what it did recorded."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import torch
from pytorch_optimizer import SPAM, AdaGC, StableSPAM
from torch import nn
from transformers import TrainerCallback, TrainingArguments
from zclip import ZClip

from gnmr_hf import GNMRConfig
from gnmr_hf.experiments.pretrain import PretrainArguments, load_corpus, results_table, run_arm, training_arguments
from gnmr_hf.experiments.stabilizers import (
    STABILIZER_ARMS,
    SkipStepAdamW,
    ZClipCallback,
    adagc_count,
    parse_options,
    spam_count,
    stabilizer_for,
    stable_spam_count,
)


class _Seen(TrainerCallback):
    """What the Trainer handed its callbacks: the optimizer and its own clipping."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.optimizer = getattr(optimizer, "optimizer", optimizer)
        self.max_grad_norm = args.max_grad_norm


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, text_dir):
    pretrain = PretrainArguments(preset="tiny", corpus=str(text_dir), arms=["static_low"])
    base = TrainingArguments(output_dir=str(tmp_path_factory.mktemp("unused")), max_steps=3, eval_steps=3)
    args = training_arguments(base, "tiny", {"output_dir", "max_steps", "eval_steps"})
    config = GNMRConfig(backend="act_quant", include=[r"\.(q|k|v|o|gate|up|down)_proj$"])
    return args, pretrain, config, load_corpus(pretrain.corpus)


EXPECTED = {  # arm: (the Trainer's optimizer, the Trainer's own max_grad_norm)
    "zclip": (torch.optim.AdamW, 0.0),
    "gnmr_cause_zclip": (torch.optim.AdamW, 0.0),
    "spam": (SPAM, 1.0),
    "stable_spam": (StableSPAM, 1.0),
    "adagc": (AdaGC, 0.0),
    "skip_step": (SkipStepAdamW, 0.0),
}


@pytest.mark.parametrize("arm", STABILIZER_ARMS)
def test_each_stabilizer_arm_trains_on_the_tiny_preset_with_its_packages_class(arm, tiny, tmp_path, one_thread):
    args, pretrain, config, corpus = tiny
    seen = _Seen()
    result = run_arm(
        arm,
        0,
        args=dataclasses.replace(args, output_dir=str(tmp_path)),
        pretrain=pretrain,
        config=config,
        corpus=corpus,
        extra_callbacks=lambda owner: [seen],
    )
    optimizer, clip = EXPECTED[arm]
    assert type(seen.optimizer) is optimizer and seen.max_grad_norm == clip
    assert seen.optimizer.defaults["lr"] == args.learning_rate and seen.optimizer.defaults["betas"] == (0.9, 0.95)
    record = json.loads((tmp_path / "result.json").read_text())["stabilizer"]
    assert record == result["stabilizer"] and isinstance(record["acted_steps"], list)
    if arm != "gnmr_cause_zclip":
        assert result["recovery_fraction"] == 0.0  # every unit on the cheap path
    if "zclip" in arm:
        assert record["method"] == "zclip.ZClip" and record["clipped_steps"] == 3  # its warm-up clips at 1.0
    if arm == "skip_step":
        assert seen.optimizer.defaults["fused"]  # the Trainer's own AdamW, as static_low's: only the rule differs


def test_zclip_is_the_packages_class_with_its_defaults_and_its_ceiling_replaces_the_trainers():
    args = TrainingArguments(output_dir="unused", max_grad_norm=1.0)
    made = stabilizer_for("zclip", args)
    (callback,) = made.callbacks
    assert isinstance(callback.zclip, ZClip) and (callback.zclip.alpha, callback.zclip.z_thresh) == (0.97, 2.5)
    assert callback.zclip.max_grad_norm == 1.0 and made.max_grad_norm == 0.0 and made.optimizer_cls_and_kwargs is None


def _step(model: nn.Module, grad: torch.Tensor) -> None:
    model.weight.grad = grad.clone().reshape(model.weight.shape)


class _State:
    def __init__(self, step: int) -> None:
        self.global_step = step


def test_zclip_counts_a_z_score_clip_apart_from_its_ceiling():
    model = nn.Linear(4, 4, bias=False)
    callback = ZClipCallback(warmup_steps=5)
    for step in range(20):  # gradient norms 0.4 +- 5%, under ZClip's ceiling of 1.0, and one of 20 at step 13
        _step(model, torch.full((16,), 0.1 * (1 + 0.05 * (-1) ** step) if step != 12 else 5.0))
        callback.on_pre_optimizer_step(None, _State(step), None, model=model)
    assert callback.zscore_steps == [13] and callback.clipped_steps == [13]
    assert callback.record()["acted_steps"] == [13]


def _optimizer_steps(optimizer, param, grads, count):
    counts = []
    for grad in grads:
        param.grad = grad.clone()
        counts.append(count(optimizer))
        optimizer.step()
    return counts


def test_spam_counts_the_entries_it_clips_and_its_momentum_resets():
    param = nn.Parameter(torch.zeros(8))
    spam = SPAM([param], lr=1e-3, grad_accu_steps=2, update_proj_gap=10)  # its threshold: 5000
    grads = [torch.ones(8)] * 5 + [torch.tensor([100.0, *[1.0] * 7])] + [torch.ones(8)] * 4
    counts = _optimizer_steps(spam, param, grads, spam_count)
    assert counts[5] == (1, False) and sum(c for c, _ in counts) == 1
    assert counts[-1] == (0, True)  # step 10 resets the moments: the second moment is that step's alone
    assert torch.allclose(spam.state[param]["exp_avg_sq"], torch.full((8,), 1e-3))


def test_stable_spam_counts_the_entries_above_its_running_maximum():
    param = nn.Parameter(torch.zeros(8))
    stable = StableSPAM([param], lr=1e-3, update_proj_gap=6)
    grads = [torch.ones(8)] * 4 + [torch.tensor([50.0, *[1.0] * 7]), torch.ones(8)]
    counts = _optimizer_steps(stable, param, grads, stable_spam_count)
    assert [c for c, _ in counts] == [0, 0, 0, 0, 1, 0] and counts[-1][1] and not counts[0][1]


def test_adagc_counts_its_warm_up_clips_then_each_tensor_over_its_own_average():
    big, small = nn.Parameter(torch.zeros(4)), nn.Parameter(torch.zeros(4))
    adagc = AdaGC([big, small], lr=1e-3, warmup_steps=3, weight_decay=0.0)
    counts = []
    for step in range(6):  # step 1: global norm 4.1 > lambda_abs = 1, both clipped; step 5: a spike in `big` alone
        big.grad = torch.full((4,), 2.0 if step == 0 else 20.0 if step == 4 else 0.2)
        small.grad = torch.full((4,), 0.5 if step == 0 else 0.05)
        counts.append(adagc_count(adagc)[0])
        adagc.step()
    assert counts == [2, 0, 0, 0, 1, 0]


def _skip_run(losses, grad_norm=1.0):
    param = nn.Parameter(torch.zeros(4))
    optimizer = SkipStepAdamW([param], lr=1e-2, max_grad_norm=None)
    torch.manual_seed(0)
    for loss in losses:
        param.grad = torch.full((4,), grad_norm / 2) * (1 + 0.01 * torch.randn(4))
        optimizer.latest_loss = loss
        before = param.detach().clone()
        optimizer.step()
    return optimizer, param, before


def test_skip_step_skips_a_loss_more_than_6_sigma_above_its_last_128_steps_and_changes_nothing():
    noise = torch.randn(100, generator=torch.Generator().manual_seed(1)) * 0.01
    optimizer, param, before = _skip_run([3.0 + float(n) for n in noise] + [4.0])
    assert optimizer.skipped == [(101, "loss")]
    assert torch.equal(param.detach(), before) and optimizer.state[param]["step"] == 100


def test_skip_step_waits_for_half_its_window_and_steps_through_ordinary_noise():
    noise = torch.randn(200, generator=torch.Generator().manual_seed(2)) * 0.01
    early, _, _ = _skip_run([3.0] * 10 + [30.0])
    assert early.skipped == []
    calm, _, _ = _skip_run([3.0 + float(n) for n in noise])
    assert calm.skipped == []


def test_options_parse_to_the_methods_keywords():
    assert parse_options("update_proj_gap=100, threshold=1e3,foreach=false,mode=zscore") == {
        "update_proj_gap": 100,
        "threshold": 1000.0,
        "foreach": False,
        "mode": "zscore",
    }
    with pytest.raises(ValueError, match="not key=value"):
        parse_options("update_proj_gap")


def test_the_stabilizer_arms_run_only_when_named_and_their_packages_are_checked_first(monkeypatch):
    assert not set(STABILIZER_ARMS) & set(PretrainArguments(preset="tiny").arms)
    import importlib.util

    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "zclip" else find_spec(name))
    with pytest.raises(ValueError, match=r"arm zclip needs the zclip package: pip install -e '\.\[stabilizers\]'"):
        PretrainArguments(preset="tiny", arms=["zclip"])


def test_the_table_shows_what_each_stabilizer_did():
    base = {"seed": 0, "final_eval_ppl": 6.0, "sec_per_step": 1.0, "saved_bytes_per_step": 2**20}
    record = {"method": "zclip.ZClip", "options": {}, "clipped_steps": 30, "zscore_clipped_steps": 4}
    table = results_table(
        [
            {**base, "arm": "static_low", "final_eval_loss": 3.0},
            {**base, "arm": "zclip", "final_eval_loss": 2.5, "stabilizer": record},
        ]
    )
    assert "| stabilizer did |" in table and "30 clipped steps (4 by its z-score)" in table
    assert table.splitlines()[2].endswith("| - |")


def test_import_gnmr_hf_and_its_callback_import_no_stabilizer_package():
    code = "import sys, gnmr_hf; gnmr_hf.GNMRCallback; "
    code += "print([m for m in ('zclip', 'pytorch_optimizer') if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


def test_the_fault_table_says_when_a_stabilizer_acted_against_the_faults():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "fault_injection.py"
    spec = importlib.util.spec_from_file_location("gnmr_benchmark_fault_injection", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    acted = module.stabilizer_acted([(10, 3), (30, 1)], [10, 12, 31, 50], duration=4)
    assert acted == {"acted_first_step": 1, "acted_during": 2, "acted_elsewhere": 1}
    row = {"arm": "zclip", "seed": 0, "final_eval_loss": 2.0, "faults": 2, "caught_next_step": 0, "delays": []}
    row.update(entries=0, entries_on_healthy_units=0, unit_steps_in_recovery=0, stabilizer={}, **acted)
    table = module.fault_table([{"arm": "clean", "seed": 0, "final_eval_loss": 1.9}, row])
    assert table.splitlines()[0].endswith("other steps |") and table.splitlines()[2].endswith("| - |")
    assert table.splitlines()[3].endswith("| 1 / 2 of 2 / 1 |")
