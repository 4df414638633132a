"""What a cheap path loses, measured where a backend already holds the exact tensor and its low-precision copy.

Every measure is a 0-d float32 tensor on the tensor's device (no host sync) in units of a bound (1 = broken), so that
units of different kinds compare on one scale (the cause policy ranks causes by it). Two losses of a rounded operand:
its relative L2 error, and its *sum bias*, how far the rounded rows' sums are from the exact ones relative to the
rows' L1 mass. A GEMM averages unbiased rounding error away over its thousands of terms; it cannot average away a
bias, which is what breaks a tensor dominated by a few large entries (the output head's gradient: one -1 per row and
many small probabilities whose sum balances it; flushed to zero, the row no longer sums to 0) while its L2 error stays
small. Why these bounds: docs/method.md, "The cause policy".
"""

from __future__ import annotations

import torch

__all__ = [
    "BIAS_BOUND",
    "ERROR_BOUND",
    "ROW_SUM_BOUND",
    "operand_loss",
    "relative_error",
    "row_sum_loss",
    "sum_bias",
]

# Unbiased error twice the signal: the copy is mostly noise even after a GEMM's averaging.
ERROR_BOUND = 2.0
# Rows whose sums move by a tenth of their L1 mass: a bias the GEMM accumulates.
BIAS_BOUND = 0.1
# A tenth of a probability row's mass created or lost by the recomputed softmax (the same bound, on p's rows).
ROW_SUM_BOUND = 0.1


def relative_error(exact: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """||rounded - exact|| / ||exact|| in float32 (0 for an all-zero `exact`)."""
    e = exact.detach().float()
    num = torch.linalg.vector_norm(rounded.detach().float() - e)
    den = torch.linalg.vector_norm(e)
    return torch.where(den > 0, num / den.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def sum_bias(exact: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """Mean over the rows (last dimension) of |sum(rounded - exact)| / sum(|exact|); rows of zeros count 0."""
    e = exact.detach().float().reshape(-1, exact.shape[-1]) if exact.dim() else exact.detach().float().reshape(1, 1)
    r = rounded.detach().float().reshape(e.shape)
    mass = e.abs().sum(-1)
    bias = torch.where(mass > 0, (r - e).sum(-1).abs() / mass.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    return bias.mean()


def operand_loss(exact: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    """What rounding `exact` to `rounded` loses, in units of the bounds: max(relative error / ERROR_BOUND, sum bias /
    BIAS_BOUND). Non-finite values in either make it +inf (a broken copy)."""
    loss = torch.maximum(relative_error(exact, rounded) / ERROR_BOUND, sum_bias(exact, rounded) / BIAS_BOUND)
    return torch.nan_to_num(loss, nan=torch.inf)


def row_sum_loss(probabilities: torch.Tensor) -> torch.Tensor:
    """Mean |sum_j p_ij - 1| over the rows with some mass, in units of ROW_SUM_BOUND (a fully masked row, all
    zeros, is not a row of probabilities)."""
    total = probabilities.detach().float().sum(-1)
    live = total > 0
    deviation = torch.where(live, (total - 1.0).abs(), 0.0).sum() / live.sum().clamp_min(1)
    return torch.nan_to_num(deviation / ROW_SUM_BOUND, nan=torch.inf)
