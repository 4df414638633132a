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
batch. Where a unit measures, it reduces a rounded operand to a few sums (`operand_stats`) and reports them; the
losses of every unit are computed from those sums together, in one batched pass per step (`unit_losses`), so that
the ops a step adds do not grow with the number of operands measured (docs/method.md, "The cause policy").
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

import torch

__all__ = [
    "BIAS_BOUND",
    "ERROR_BOUND",
    "ROW_SUM_BOUND",
    "OperandStats",
    "loss_of",
    "operand_loss",
    "operand_stats",
    "part_device",
    "relative_error",
    "row_sum_loss",
    "spread_rows",
    "sum_bias",
    "take_rows",
    "unit_losses",
]

# What one rounded operand reduces to: (sum of squared errors, sum of squared exact values) as 0-d tensors, and per
# row |sum of errors| and sum |exact| as [R] tensors, float32.
OperandStats = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# A part of one measurement: an operand's stats, or a loss already in units of its bound (0-d).
Part = OperandStats | torch.Tensor

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
    return loss_of(operand_stats(exact, rounded))


def loss_of(stats: OperandStats) -> torch.Tensor:
    """`operand_loss` from an operand's sums (0-d)."""
    return _stats_losses([stats])[0]


def operand_stats(exact: torch.Tensor, rounded: torch.Tensor, bias: bool = True) -> OperandStats:
    """The sums `operand_loss` needs of `exact` and its `rounded` copy (rows: the last dimension): a few ops on
    the device, no sync; `unit_losses` turns many of them into losses at once. `bias=False`: the relative error
    only (no row has a bias), for an operand no GEMM sums along its rows (docs/method.md)."""
    e = take_rows(exact.detach(), None).float()
    diff = take_rows(rounded.detach(), None).float() - e
    flat_diff, flat_e = diff.reshape(-1), e.reshape(-1)
    squares = torch.dot(flat_diff, flat_diff), torch.dot(flat_e, flat_e)
    if not bias:
        none = e.new_zeros(0)
        return (*squares, none, none)
    return (*squares, diff.sum(-1).abs(), e.abs().sum(-1))


def _stats_losses(stats: Sequence[OperandStats]) -> torch.Tensor:
    """[P] `operand_loss` of each operand's stats, batched."""
    tiny = torch.finfo(torch.float32).tiny
    err, norm = torch.stack([s[0] for s in stats]), torch.stack([s[1] for s in stats])
    relative = torch.where(norm > 0, (err / norm.clamp_min(tiny)).sqrt(), 0.0)
    bias, mass = torch.cat([s[2] for s in stats]), torch.cat([s[3] for s in stats])
    ratio = torch.where(mass > 0, bias / mass.clamp_min(tiny), 0.0)
    counts = torch.tensor([s[2].numel() for s in stats], device=ratio.device)
    owner = torch.repeat_interleave(torch.arange(len(stats), device=ratio.device), counts)
    mean_ratio = ratio.new_zeros(len(stats)).index_add_(0, owner, ratio) / counts.clamp_min(1)
    loss = torch.maximum(relative / ERROR_BOUND, mean_ratio / BIAS_BOUND)
    return torch.nan_to_num(loss, nan=torch.inf)


def part_device(part: Part) -> torch.device:
    """The device a measurement's part lives on."""
    return part.device if isinstance(part, torch.Tensor) else part[0].device


def unit_losses(measurements: Sequence[Sequence[Sequence[Part]]], device: torch.device | str) -> torch.Tensor:
    """Per unit, the mean over its measurements of the worst of each measurement's parts, in one batched pass.

    `measurements[i]`: unit i's measurements since the last call, each a list of parts (operand stats or 0-d
    losses). Returns [N] float32 losses, NaN where a unit has no measurement."""
    device = torch.device(device)
    n = len(measurements)
    stats, stat_owner, losses, loss_owner, unit_of = [], [], [], [], []
    for i, unit in enumerate(measurements):
        for parts in unit:
            m = len(unit_of)
            unit_of.append(i)
            for part in parts:
                if isinstance(part, torch.Tensor):
                    losses.append(part.to(device))
                    loss_owner.append(m)
                else:
                    stats.append(tuple(t.to(device) for t in part))
                    stat_owner.append(m)
    if not unit_of:
        return torch.full((n,), torch.nan, device=device)
    values = ([_stats_losses(stats)] if stats else []) + ([torch.stack(losses).float().reshape(-1)] if losses else [])
    # One host-to-device copy of the bookkeeping: which measurement each value is of, which unit each measurement.
    index = torch.tensor(stat_owner + loss_owner + unit_of, device=device)
    owners, units = index[: len(stat_owner) + len(loss_owner)], index[len(stat_owner) + len(loss_owner) :]
    worst = torch.full((len(unit_of),), -torch.inf, device=device).scatter_reduce(
        0, owners, torch.cat(values), reduce="amax"
    )
    count = torch.bincount(units, minlength=n).float()
    total = torch.zeros(n, device=device).index_add_(0, units, worst)
    return torch.where(count > 0, total / count.clamp_min(1), torch.nan)


def spread_rows(n: int, max_rows: int, draw: int, device: torch.device | str) -> torch.Tensor | None:
    """Indices of `max_rows` of `n` rows spread over all of them, or None (read every row) when `max_rows` is 0 or
    at least `n`.

    An arithmetic progression modulo `n` whose stride is the first integer >= n / max_rows coprime with `n` (so the
    rows are distinct and a period of the data, such as every sequence's first token, is not hit every time) and
    whose start moves with `draw` (the caller's count of measurements), so that over successive steps every row is
    read. Built on `device` from Python ints: no host sync; kept for the units that draw the same rows of a tensor of
    the same length (a step's units all draw the same), as a read-only tensor.
    """
    if max_rows <= 0 or max_rows >= n:
        return None
    return _spread(n, max_rows, (draw * 7919) % n, str(torch.device(device)))  # a prime step: starts far apart


@functools.lru_cache(maxsize=1024)
def _spread(n: int, max_rows: int, start: int, device: str) -> torch.Tensor:
    stride = n // max_rows
    while math.gcd(stride, n) != 1:
        stride += 1
    return (torch.arange(max_rows, device=device) * stride + start) % n


def take_rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """`x` as rows of its last dimension ([-1, x.shape[-1]]), only those of `index` (all when None)."""
    rows = x.reshape(-1, x.shape[-1]) if x.dim() else x.reshape(1, 1)
    return rows if index is None else rows.index_select(0, index)


def row_sum_loss(probabilities: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """Mean |sum_j p_ij - 1| over the rows with some mass (those of `index` when given), in units of
    ROW_SUM_BOUND (a fully masked row, all zeros, is not a row of probabilities)."""
    total = take_rows(probabilities.detach(), index).float().sum(-1)
    live = total > 0
    deviation = torch.where(live, (total - 1.0).abs(), 0.0).sum() / live.sum().clamp_min(1)
    return torch.nan_to_num(deviation / ROW_SUM_BOUND, nan=torch.inf)
