"""The recovery oracle: gaps and benefits on toy models whose answer is known, and the agreement statistics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from gnmr_hf import find_units
from gnmr_hf.experiments.faults import inject_fault
from gnmr_hf.experiments.oracle import oracle_agreement, recovery_benefits, recovery_gaps, spearman


class Toy(nn.Module):
    """Two parallel Linears: `exact` reads a tensor of -1/0/+1 (exact at any bit width, so its gap is 0), `lossy`
    reads Gaussian values (a 2-bit copy is far off, so its gap is large)."""

    def __init__(self) -> None:
        super().__init__()
        self.exact = nn.Linear(16, 1)
        self.lossy = nn.Linear(16, 1)

    def forward(self, ternary, gaussian, labels):
        pred = self.exact(ternary) + self.lossy(gaussian)
        return type("Out", (), {"loss": ((pred.squeeze(-1) - labels) ** 2).mean()})()


def toy_batch():
    torch.manual_seed(0)
    return {
        "ternary": torch.randint(-1, 2, (32, 16)).float(),
        "gaussian": torch.randn(32, 16),
        "labels": torch.randn(32),
    }


def toy_setup():
    """The toy model, its two units (2-bit cheap path, unquantized recovery) and its batch."""
    torch.manual_seed(0)
    model = Toy()
    return model, find_units(model, "act_quant", low_bits=2, high_bits=16), toy_batch()


def test_the_gap_is_zero_where_the_cheap_path_is_exact_and_large_where_it_is_not():
    model, units, batch = toy_setup()
    gaps = recovery_gaps(model, units, batch)
    assert [u.name for u in units] == ["exact", "lossy"]
    assert gaps[0] == 0 and gaps[1] > 1e-2


def test_the_gap_is_the_norm_of_the_weight_gradient_difference():
    model, units, batch = toy_setup()
    gaps = recovery_gaps(model, units, batch)
    low = torch.autograd.grad(model(**batch).loss, [model.lossy.weight])[0]
    units[1].enter_recovery()
    high = torch.autograd.grad(model(**batch).loss, [model.lossy.weight])[0]
    assert math.isclose(gaps[1].item(), (low - high).norm().item(), rel_tol=1e-5)


@pytest.mark.parametrize("probe", [recovery_gaps, recovery_benefits])
def test_probing_leaves_paths_gradients_measuring_and_the_ledger_peak_as_they_were(probe):
    model = Toy()
    units = find_units(model, "act_quant", low_bits=2, high_bits=8)
    units[1].enter_recovery()
    units[0].meter.start(0)
    model(**toy_batch()).loss.backward()
    units[0].meter.take()
    grads = [p.grad.clone() for p in model.parameters()]
    peak = units[0].ledger.peak_bytes
    probe(model, units, toy_batch())
    assert [u.in_recovery for u in units] == [False, True]
    assert [u.meter.on for u in units] == [True, False]
    assert units[0].meter.take() == []  # the probe's passes measured nothing
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert units[0].ledger.peak_bytes == peak


def whole_gradient(model, batch):
    params = list(model.parameters())
    return torch.cat([g.reshape(-1) for g in torch.autograd.grad(model(**batch).loss, params)]).double()


def test_the_benefit_is_how_much_recovering_the_unit_alone_brings_the_whole_gradient_to_the_recovery_paths():
    model, units, batch = toy_setup()
    benefits = recovery_benefits(model, units, batch)
    low = whole_gradient(model, batch)
    for unit in units:
        unit.enter_recovery()
    high = whole_gradient(model, batch)
    units[0].exit_recovery()
    only_lossy = whole_gradient(model, batch)
    base = (low - high).norm().item()
    assert base > 1e-2
    # `exact` loses nothing on its cheap path: recovering it alone changes nothing. `lossy` is the only loss:
    # recovering it alone gives the recovery path's gradient.
    assert benefits[0].item() == 0.0
    assert math.isclose(benefits[1].item(), base - (only_lossy - high).norm().item(), rel_tol=1e-9)
    assert math.isclose(benefits[1].item(), base, rel_tol=1e-6)
    assert [u.in_recovery for u in units] == [False, True]


def test_a_tensor_several_units_read_counts_once_in_the_whole_gradient():
    # An act_quant attention unit's signal is its q, k and v projections' weights, which are those units' own.
    from gnmr_hf.experiments.pretrain import build_model, llama_config

    model = build_model(llama_config(d_model=32, n_layers=1, n_heads=2, seq_len=16), seed=0)
    units = find_units(model, "act_quant", kinds=["linear", "attention"], low_bits=2, high_bits=8)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    attention = next(i for i, u in enumerate(units) if u.kind == "attention")
    benefits = recovery_benefits(model, units, batch)
    low = whole_gradient(model, batch)
    for unit in units:
        unit.enter_recovery()
    high = whole_gradient(model, batch)
    for i, unit in enumerate(units):
        if i != attention:
            unit.exit_recovery()
    only_attention = whole_gradient(model, batch)
    expected = (low - high).norm() - (only_attention - high).norm()
    assert math.isclose(benefits[attention].item(), expected.item(), rel_tol=1e-6)


class Chain(nn.Module):
    """x -> a -> tanh -> b: a corrupted output of `b` corrupts the gradient `a` receives (`a` shows a gap it does
    not cause)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(32, 32)
        self.b = nn.Linear(32, 1)

    def forward(self, x, labels):
        pred = self.b(torch.tanh(self.a(x))).squeeze(-1)
        return type("Out", (), {"loss": ((pred - labels) ** 2).mean()})()


def test_the_benefit_goes_to_the_cause_of_a_corrupted_gradient_not_to_where_it_shows():
    torch.manual_seed(0)
    model = Chain()
    batch = {"x": 4 * torch.randn(64, 32), "labels": torch.randn(64)}
    units = find_units(model, "block_fp", low_format="e4m3", high_format="bf16")
    inject_fault(units[1], 30.0)  # b's input copy is 30 times its value: b's output, and every gradient, corrupted
    gaps = recovery_gaps(model, units, batch)
    benefits = recovery_benefits(model, units, batch)
    # a's own cheap path (e4m3) is close to exact, but its gradient is far from the recovery path's: the gap shows
    # the damage b does. Recovering a alone leaves almost all of it; recovering b alone removes almost all of it.
    assert gaps[0] > 10 and gaps[0] > 0.02 * gaps[1]
    assert benefits[0] < 0.01 * benefits[1]
    assert benefits[1] > 0.99 * recovery_base_distance(model, units, batch)


def recovery_base_distance(model, units, batch):
    for unit in units:
        unit.exit_recovery()
    low = whole_gradient(model, batch)
    for unit in units:
        unit.enter_recovery()
    high = whole_gradient(model, batch)
    for unit in units:
        unit.exit_recovery()
    return (low - high).norm().item()


def record(gaps, risk, active=(), scored=True):
    return {"gaps": list(gaps), "risk": list(risk), "active": list(active), "scored": scored}


def test_agreement_is_perfect_for_the_oracle_itself_and_none_for_its_reverse():
    gaps = np.arange(10.0)
    same = oracle_agreement([record(gaps, gaps, active=[9, 8])], k=2)
    reverse = oracle_agreement([record(gaps, -gaps, active=[0])], k=2)
    assert same["precision_at_k"] == 1.0 and same["recovered_set_precision"] == 1.0
    assert same["recovered_share"] == 1.0 and reverse["recovered_share"] == 0.0
    # One of the two largest (9 of 9 + 8) recovered: its share of their sum.
    assert math.isclose(oracle_agreement([record(gaps, gaps, active=[8])], k=2)["recovered_share"], 8 / 17)
    assert math.isclose(same["spearman"], 1.0) and math.isclose(reverse["spearman"], -1.0)
    assert reverse["precision_at_k"] == 0.0 and reverse["recovered_set_precision"] == 0.0
    # Random selection's precision@k is k / N in expectation.
    assert abs(same["random_precision_at_k"] - 0.2) < 0.05 and abs(same["random_spearman"]) < 0.2


def test_agreement_ranks_by_the_oracle_asked_for_and_refuses_records_without_it():
    gaps, benefits = np.arange(6.0), -np.arange(6.0)
    records = [{**record(gaps, benefits), "benefits": list(benefits)}]
    assert oracle_agreement(records, k=2)["precision_at_k"] == 0.0
    assert oracle_agreement(records, k=2, oracle="benefits")["precision_at_k"] == 1.0
    with pytest.raises(ValueError, match="1 of 1 records have no 'benefits'"):
        oracle_agreement([record(gaps, gaps)], k=2, oracle="benefits")
    with pytest.raises(ValueError, match="oracle must be one of"):
        oracle_agreement(records, k=2, oracle="gap")


def test_probes_without_scores_are_left_out():
    gaps = np.arange(5.0)
    result = oracle_agreement([record(gaps, gaps, scored=False), record(gaps, gaps)], k=1)
    assert result["probes"] == 1


def test_spearman_averages_ties():
    assert math.isclose(spearman(np.array([0.0, 0.0, 1.0]), np.array([1.0, 2.0, 3.0])), math.sqrt(3) / 2)
