"""The recovery oracle: gaps on a toy model whose answer is known, and the agreement statistics."""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from gnmr_hf import find_units
from gnmr_hf.experiments.oracle import oracle_agreement, recovery_gaps, spearman


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


def test_the_gap_is_zero_where_the_cheap_path_is_exact_and_large_where_it_is_not():
    torch.manual_seed(0)
    model = Toy()
    units = find_units(model, "act_quant", low_bits=2, high_bits=16)
    gaps = recovery_gaps(model, units, toy_batch())
    assert [u.name for u in units] == ["exact", "lossy"]
    assert gaps[0] == 0 and gaps[1] > 1e-2


def test_the_gap_is_the_norm_of_the_weight_gradient_difference():
    torch.manual_seed(0)
    model = Toy()
    units = find_units(model, "act_quant", low_bits=2, high_bits=16)
    batch = toy_batch()
    gaps = recovery_gaps(model, units, batch)
    low = torch.autograd.grad(model(**batch).loss, [model.lossy.weight])[0]
    units[1].enter_recovery()
    high = torch.autograd.grad(model(**batch).loss, [model.lossy.weight])[0]
    assert math.isclose(gaps[1].item(), (low - high).norm().item(), rel_tol=1e-5)


def test_probing_leaves_paths_gradients_and_the_ledger_peak_as_they_were():
    model = Toy()
    units = find_units(model, "act_quant", low_bits=2, high_bits=8)
    units[1].enter_recovery()
    model(**toy_batch()).loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    peak = units[0].ledger.peak_bytes
    recovery_gaps(model, units, toy_batch())
    assert [u.in_recovery for u in units] == [False, True]
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads, strict=True))
    assert units[0].ledger.peak_bytes == peak


def record(gaps, risk, active=(), scored=True):
    return {"gaps": list(gaps), "risk": list(risk), "active": list(active), "scored": scored}


def test_agreement_is_perfect_for_the_oracle_itself_and_none_for_its_reverse():
    gaps = np.arange(10.0)
    same = oracle_agreement([record(gaps, gaps, active=[9, 8])], k=2)
    reverse = oracle_agreement([record(gaps, -gaps, active=[0])], k=2)
    assert same["precision_at_k"] == 1.0 and same["recovered_set_precision"] == 1.0
    assert math.isclose(same["spearman"], 1.0) and math.isclose(reverse["spearman"], -1.0)
    assert reverse["precision_at_k"] == 0.0 and reverse["recovered_set_precision"] == 0.0
    # Random selection's precision@k is k / N in expectation.
    assert abs(same["random_precision_at_k"] - 0.2) < 0.05 and abs(same["random_spearman"]) < 0.2


def test_probes_without_scores_are_left_out():
    gaps = np.arange(5.0)
    result = oracle_agreement([record(gaps, gaps, scored=False), record(gaps, gaps)], k=1)
    assert result["probes"] == 1


def test_spearman_averages_ties():
    assert math.isclose(spearman(np.array([0.0, 0.0, 1.0]), np.array([1.0, 2.0, 3.0])), math.sqrt(3) / 2)
