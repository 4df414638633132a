"""What a cheap path loses, measured where a backend already holds the exact tensor and its low-precision copy.

Every measure is a 0-d float32 tensor on the tensor's device (no host sync) in units of a bound (1 = broken), so that
units of different kinds compare on one scale (the cause policy ranks causes by it). Two losses of a rounded operand:
its relative L2 error, and its *sum bias*, how far the rounded rows' sums are from the exact ones relative to the
rows' L1 mass. A GEMM averages unbiased rounding error away over its thousands of terms; it cannot average away a
bias, which is what breaks a tensor dominated by a few large entries (the output head's gradient: one -1 per row and
many small probabilities whose sum balances it; flushed to zero, the row no longer sums to 0) while its L2 error stays
small. Why these bounds: docs/method.md, "The cause policy".

A measure may read a sample of the rows (`spread_rows`): the rounding it measures is row-local or uses a scale taken
from the whole tensor, so the sampled rows' loss estimates the whole tensor's at a cost that does not grow with the
batch (docs/method.md, "What measuring costs").
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "BIAS_BOUND",
    "ERROR_BOUND",
    "ROW_SUM_BOUND",
    "operand_loss",
    "relative_error",
    "row_sum_loss",
    "spread_rows",
    "sum_bias",
    "take_rows",
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


def row_sum_loss(probabilities: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """Mean |sum_j p_ij - 1| over the rows with some mass (those of `index` when given), in units of
    ROW_SUM_BOUND (a fully masked row, all zeros, is not a row of probabilities)."""
    total = take_rows(probabilities.detach(), index).float().sum(-1)
    live = total > 0
    deviation = torch.where(live, (total - 1.0).abs(), 0.0).sum() / live.sum().clamp_min(1)
    return torch.nan_to_num(deviation / ROW_SUM_BOUND, nan=torch.inf)


def spread_rows(n: int, max_rows: int, draw: int, device: torch.device | str) -> torch.Tensor | None:
    """Indices of `max_rows` of `n` rows spread over all of them, or None (read every row) when `max_rows` is 0 or
    at least `n`.

    An arithmetic progression modulo `n` whose stride is the first integer >= n / max_rows coprime with `n` (so the
    rows are distinct and a period of the data, such as every sequence's first token, is not hit every time) and
    whose start moves with `draw` (the caller's count of measurements), so that over successive steps every row is
    read. Built on `device` from Python ints: no host sync.
    """
    if max_rows <= 0 or max_rows >= n:
        return None
    stride = n // max_rows
    while math.gcd(stride, n) != 1:
        stride += 1
    start = (draw * 7919) % n  # a prime step: successive draws start far apart
    return (torch.arange(max_rows, device=device) * stride + start) % n


def take_rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """`x` as rows of its last dimension ([-1, x.shape[-1]]), only those of `index` (all when None)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return rows if index is None else rows.index_select(0, index)
