"""benchmarks/head_gemm_split.py: each of the head's GEMM inputs is rounded in the format its arm gives it."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gnmr_hf import find_units
from gnmr_hf.backends.block_fp import GemmFormat, block_fp_linear
from gnmr_hf.experiments import operands
from gnmr_hf.experiments.pretrain import build_model, llama_config

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import head_gemm_split as hgs

LOW, HIGH = GemmFormat("e2m1", "fp32"), GemmFormat("e4m3", "fp32")


def test_block_fp_linear_rounds_each_input_through_the_method_operand_formats_routes_it_by(monkeypatch):
    operands.check_operand_routing(LOW, HIGH)

    class Misrouted(operands.OperandFormats):  # the output gradient rounded as the weight is
        def operand(self, t, contract, *, weight=False):
            return (self.w if not weight else self.g).operand(t, contract, weight=weight)

    monkeypatch.setattr(operands, "OperandFormats", Misrouted)
    with pytest.raises(RuntimeError, match="no longer rounds its GEMM inputs"):
        operands.check_operand_routing(LOW, HIGH)


@pytest.mark.parametrize("arm", hgs.ARMS)
def test_each_arm_gives_the_head_its_formats_and_leaves_the_other_units_alone(arm):
    model = build_model(llama_config(d_model=32, n_layers=1, n_heads=2, seq_len=8), seed=0)
    units = find_units(model, "block_fp", low_format="e2m1", high_format="e4m3", quantize_lm_head=True)
    formats = hgs.formats_for(arm, LOW, HIGH)
    operands.UnitFormats(SimpleNamespace(units=units), formats, hgs.HEAD).on_train_begin(None, None, None)
    head = next(u for u in units if u.name == "lm_head")
    assert all(u.low == LOW for u in units if u is not head)
    x = torch.randn(2, 8, 32)
    expected = block_fp_linear(x, model.lm_head.weight, None, formats or LOW)
    assert torch.equal(model.lm_head(x), expected)
    if arm == "head_grad_high":
        assert (formats.x, formats.w, formats.g) == (LOW, LOW, HIGH)
