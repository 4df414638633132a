"""benchmarks/operand_split.py: the units it sets apart round each GEMM input as their arm says; the rest stay FP4."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gnmr_hf import find_units
from gnmr_hf.backends.block_fp import GemmFormat, block_fp_linear
from gnmr_hf.experiments.operands import UnitFormats
from gnmr_hf.experiments.pretrain import build_model, llama_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import operand_split as ops

LOW, HIGH = GemmFormat("e2m1", "fp32"), GemmFormat("e4m3", "fp32")


def _units():
    model = build_model(llama_config(d_model=32, n_layers=2, n_heads=2, seq_len=8), seed=0)
    return model, find_units(model, "block_fp", low_format="e2m1", high_format="e4m3")


@pytest.mark.parametrize("arm", ops.ARMS)
@pytest.mark.parametrize("chosen", [None, [r"layers\.1\.mlp\."]])
def test_each_arm_sets_the_chosen_units_formats_and_leaves_the_others_on_fp4(arm, chosen):
    _, units = _units()
    formats = ops.formats_for(arm, LOW, HIGH)
    UnitFormats(SimpleNamespace(units=units), formats, chosen).on_train_begin(None, None, None)
    apart = {u.name for u in units if chosen is None or "layers.1.mlp." in u.name}
    assert apart and (chosen is None or len(apart) == 3)
    for unit in units:
        assert unit.low == (formats or LOW if unit.name in apart else LOW), unit.name
    down = next(u for u in units if u.name.endswith("layers.1.mlp.down_proj"))
    x = torch.randn(2, 8, down.module.in_features)
    assert torch.equal(down.module(x), block_fp_linear(x, down.module.weight, None, formats or LOW))
    if arm == "grad_high":
        assert (formats.x, formats.w, formats.g) == (LOW, LOW, HIGH)
    if arm == "fwd_high":
        assert (formats.x, formats.w, formats.g) == (HIGH, HIGH, LOW)


def test_units_that_match_nothing_fail_before_training():
    _, units = _units()
    with pytest.raises(ValueError, match="match no unit"):
        UnitFormats(SimpleNamespace(units=units), None, ["nothing"]).on_train_begin(None, None, None)
