"""UnitSignals: per-unit gradient norms in one fused pass, missing units marked, no host sync."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gnmr_hf import DispatchContext, RecoverableUnit, Signal, UnitSignals


class LinearUnit(RecoverableUnit):
    """A bare unit over an nn.Linear, scored on its own parameters or on its output gradient."""

    def __init__(self, name, module, use_meter=False):
        self.use_meter = use_meter
        super().__init__(name, module, DispatchContext(module, "test"))

    def find_signal(self, ctx):
        return Signal("output_grad", []) if self.use_meter else Signal("weight", list(self.module.parameters()))


def make(n=4, dtype=torch.float32, meter_at=None):
    torch.manual_seed(0)
    layers = nn.ModuleList(nn.Linear(8, 8, dtype=dtype) for _ in range(n))
    units = [LinearUnit(f"l{i}", m, use_meter=i == meter_at) for i, m in enumerate(layers)]
    return layers, units


def test_norm_is_the_l2_norm_of_all_signal_gradients_together():
    layers, units = make()
    x = torch.randn(5, 8)
    for layer in layers:
        x = torch.tanh(layer(x))
    x.sum().backward()
    norms, missing = UnitSignals(units).compute()
    expected = [torch.cat([p.grad.flatten() for p in layer.parameters()]).norm() for layer in layers]
    torch.testing.assert_close(norms, torch.stack(expected))
    assert not missing.any()


def test_units_without_gradient_are_marked_missing_not_zero():
    layers, units = make()
    layers[0](torch.randn(2, 8)).sum().backward()
    norms, missing = UnitSignals(units).compute()
    assert missing.tolist() == [False, True, True, True]
    assert norms[0] > 0 and torch.isnan(norms[1:]).all()


def test_bf16_gradients_are_reduced_in_float32():
    layers, units = make(dtype=torch.bfloat16)
    for layer in layers:
        for p in layer.parameters():
            p.grad = torch.full_like(p, 1e-3)
    norms, _ = UnitSignals(units).compute()
    assert norms.dtype == torch.float32
    torch.testing.assert_close(norms, torch.full((4,), (72 * 1e-6) ** 0.5), rtol=1e-2, atol=0)


def test_output_gradient_meter_sums_squares_over_micro_batches():
    layers, units = make(meter_at=2)
    signals = UnitSignals(units)
    total = 0.0
    for _ in range(2):  # two micro-batches of one optimizer step
        out = layers[2](torch.randn(3, 8, requires_grad=True))
        grad = torch.randn_like(out)
        out.backward(grad)
        total += grad.square().sum().item()
    norms, missing = signals.compute()
    assert norms[2].item() == pytest.approx(total**0.5, rel=1e-5)
    assert missing.tolist() == [True, True, False, True]
    assert units[2].output_grad.take() is None  # compute() consumed the step's value


def test_compute_makes_no_host_sync():
    from torch.utils._python_dispatch import TorchDispatchMode

    layers, units = make()
    layers[1](torch.randn(2, 8)).sum().backward()
    signals = UnitSignals(units)
    calls = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append(func)
            return func(*args, **(kwargs or {}))

    with Spy():
        signals.compute()
    assert torch.ops.aten._local_scalar_dense.default not in calls
    assert torch.ops.aten.nonzero.default not in calls


def test_a_unit_without_any_signal_is_rejected():
    _, units = make()
    units[1]._signal_tensors = []
    with pytest.raises(ValueError, match="'l1' has no signal tensors"):
        UnitSignals(units)
