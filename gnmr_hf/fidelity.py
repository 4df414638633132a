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
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakTensorKeyDictionary

__all__ = [
    "BIAS_BOUND",
    "ERROR_BOUND",
    "PENDING_MAX_ELEMENTS",
    "ROW_SUM_BOUND",
    "SOFTMAX_SHIFT_BOUND",
    "OperandStats",
    "Pending",
    "RowTotals",
    "TensorCache",
    "defer",
    "finish_pending",
    "loss_of",
    "operand_loss",
    "operand_losses",
    "operand_stats",
    "part_device",
    "pending_operand",
    "relative_error",
    "resolve",
    "row_sum_loss",
    "row_totals",
    "softmax_shift_loss",
    "spread_rows",
    "sum_bias",
    "take_rows",
    "unit_losses",
]


class OperandStats(NamedTuple):
    """What one rounded operand reduces to, float32 on its device: the L2 norms of its error and of its exact values
    (0-d), and per row |sum of errors| and sum |exact| ([R]; empty when its bias is not measured)."""

    error: torch.Tensor
    norm: torch.Tensor
    row_bias: torch.Tensor
    row_mass: torch.Tensor


class RowTotals(NamedTuple):
    """The sums of a sample of probability rows ([R] float32), whose loss is `row_sum_loss`'s: a part whose
    arithmetic waits for the step's batched pass."""

    totals: torch.Tensor


class Pending:
    """A part whose arithmetic waits for the step's batched pass: `finish(key, *stacked)` turns the `tensors` of P
    pending parts that share its `finish` and `key` (hashable: what the rounding needs), each stacked along a new
    first dimension, into their [P] float32 losses (in units of the bound), so that every pending operand of a step
    with the same shapes and rounding is rounded and reduced by one set of ops. A part is finished once (units that
    share a tensor report one `Pending`).

    Why: on a CPU the ops of a measure cost their dispatch, not their arithmetic (~4 us each warm, ~20 us as the
    first op after a large kernel on this project's VM), and a step measures tens of operands between its large
    kernels. A backend takes only what it must while the data lives (the sampled rows, a scale) and leaves the
    rest to one batched pass per step. `tensors` are all it holds: a sample of rows, never a whole activation.
    """

    __slots__ = ("_done", "finish", "key", "tensors")

    def __init__(self, finish: Callable[..., torch.Tensor], key: Any, *tensors: torch.Tensor) -> None:
        self.finish, self.key, self.tensors = finish, key, tensors
        # Once finished: (the [P] losses of its group, its position there), read only when asked for.
        self._done: tuple[torch.Tensor, int] | None = None

    @property
    def pending(self) -> bool:
        """Whether the part still waits for its arithmetic (holds its tensors)."""
        return self._done is None

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device if self._done is None else self._done[0].device

    def group_key(self) -> tuple[Any, ...]:
        """Pending parts with equal group keys finish together: same rounding, same shapes."""
        return (self.finish, self.key, *((t.shape, t.dtype, t.device) for t in self.tensors))

    def resolve(self) -> torch.Tensor:
        """This part's 0-d loss, computed now (alone) if it was not."""
        if self._done is None:
            self._set_done(self.finish(self.key, *(t.unsqueeze(0) for t in self.tensors)), 0)
        losses, k = self._done  # type: ignore[misc]
        return losses[k]

    def _set_done(self, losses: torch.Tensor, k: int) -> None:
        # The tensors go: a part reported again later (a weight's, `BlockFPUnit.weight_part`) is its loss.
        self._done, self.tensors = (losses, k), ()


class TensorCache:
    """Entries per live tensor, for the units of one `find_units` call: what several units reading one tensor (q, k
    and v projections the same normalized hidden states; gate and up projections another) would each compute from it
    is computed once. Keyed weakly by the tensor (an entry goes when the tensor does) and by a key the caller gives,
    which should hold the tensor's version counter (an in-place change then makes a new entry)."""

    def __init__(self) -> None:
        self._entries: WeakTensorKeyDictionary = WeakTensorKeyDictionary()

    def get(self, x: torch.Tensor, key: tuple[Any, ...]) -> Any:
        return self._entries.get(x, {}).get(key)

    def put(self, x: torch.Tensor, key: tuple[Any, ...], entry: Any) -> None:
        per_tensor = self._entries.get(x)
        if per_tensor is None:
            per_tensor = self._entries[x] = {}
        per_tensor[key] = entry


def finish_pending(pending: Sequence[Pending]) -> tuple[list[torch.Tensor], list[Pending]]:
    """[P_g] losses of each group of equal `group_key` among `pending` (distinct parts, none finished), in the order
    of the groups' first parts, and the parts in that order (`pending` regrouped)."""
    groups: dict[tuple[Any, ...], list[Pending]] = {}
    for part in pending:
        groups.setdefault(part.group_key(), []).append(part)
    losses, order = [], []
    for group in groups.values():
        stacked = [torch.stack(ts) for ts in zip(*(p.tensors for p in group), strict=True)]
        losses.append(group[0].finish(group[0].key, *stacked))
        for k, part in enumerate(group):
            part._set_done(losses[-1], k)
        order += group
    return losses, order


# A pending part keeps at most this many elements per tensor (1 MiB in float32); a larger sample is finished at
# once: its arithmetic, not its dispatch, dominates, and it is not worth holding until the end of the step.
PENDING_MAX_ELEMENTS = 1 << 18


def defer(part: Pending) -> Pending | torch.Tensor:
    """`part` itself, to be finished with the step's batch, or its loss now when it holds a tensor larger than
    `PENDING_MAX_ELEMENTS` or one that is a view into a larger tensor (holding it would hold all of that)."""
    for t in part.tensors:
        if t.numel() > PENDING_MAX_ELEMENTS or t.untyped_storage().nbytes() > t.numel() * t.element_size():
            return part.resolve()
    return part


def pending_operand(exact: torch.Tensor, rounded: torch.Tensor, bias: bool = True) -> Pending | torch.Tensor:
    """`operand_stats(exact, rounded, bias)` as a part finished with every other pending operand of the same shape
    in the step's batched pass (`defer`: at once when large). Rows: the last dimension."""
    return defer(Pending(_finish_operands, bias, _float_rows(exact), _float_rows(rounded)))


def _finish_operands(bias: bool, exact: torch.Tensor, rounded: torch.Tensor) -> torch.Tensor:
    return operand_losses(exact, rounded, bias)


def resolve(part: Any) -> Any:
    """`part` itself, or what a `Pending` part resolves to."""
    return part.resolve() if isinstance(part, Pending) else part


# A part of one measurement: an operand's stats, probability rows' sums, a loss already in units of its bound, or a
# `Pending` one of these.
Part = OperandStats | RowTotals | torch.Tensor | Pending

# Unbiased error twice the signal: the copy is mostly noise even after a GEMM's averaging.
ERROR_BOUND = 2.0
# Rows whose sums move by a tenth of their L1 mass: a bias the GEMM accumulates.
BIAS_BOUND = 0.1
# A tenth of a probability row's mass created or lost by the recomputed softmax (the same bound, on p's rows).
ROW_SUM_BOUND = 0.1
# A tenth of a probability row's mass moved by a softmax recomputed from a rounded copy (the same bound again).
SOFTMAX_SHIFT_BOUND = 0.1


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
    # Every op here is paid per measured operand, and on a small model its dispatch costs more than its arithmetic:
    # no conversion, copy or view that the inputs do not need.
    e, r = _float_rows(exact), _float_rows(rounded)
    diff = r - e
    norms = torch.linalg.vector_norm(diff), torch.linalg.vector_norm(e)
    if not bias:
        none = e.new_empty(0)
        return OperandStats(*norms, none, none)
    # (vector_norm(e, 1, -1) is the same sum at 5-10x the time on a CPU.)
    return OperandStats(*norms, diff.sum(-1).abs_(), e.abs().sum(-1))


def _float_rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as float32 rows of its last dimension, without autograd history."""
    if t.requires_grad:
        t = t.detach()
    if t.dim() != 2:
        t = take_rows(t, None)
    return t if t.dtype == torch.float32 else t.float()


def _stats_losses(stats: Sequence[OperandStats]) -> torch.Tensor:
    """[P] `operand_loss` of each operand's stats, batched."""
    err, norm = torch.stack([s.error for s in stats]), torch.stack([s.norm for s in stats])
    counts = [s.row_bias.numel() for s in stats]
    if not any(counts):
        return _losses(err, norm)
    bias, mass = torch.cat([s.row_bias for s in stats]), torch.cat([s.row_mass for s in stats])
    return _losses(err, norm, _part_means(_ratio(bias, mass), counts))


def operand_losses(exact: torch.Tensor, rounded: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """[P] `operand_loss` of P operands of the same shape at once: `exact` and `rounded` [P, R, W] float32."""
    diff = rounded - exact
    err, norm = torch.linalg.vector_norm(diff, dim=(1, 2)), torch.linalg.vector_norm(exact, dim=(1, 2))
    if not bias:
        return _losses(err, norm)
    return _losses(err, norm, _ratio(diff.sum(-1).abs_(), exact.abs().sum(-1)).mean(-1))


def _ratio(bias: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Each row's |sum of errors| over its L1 mass; 0 for a row of zeros."""
    return torch.where(mass > 0, bias / mass.clamp_min(torch.finfo(torch.float32).tiny), 0.0)


def _losses(err: torch.Tensor, norm: torch.Tensor, mean_ratio: torch.Tensor | None = None) -> torch.Tensor:
    """The loss of operands from the L2 norms of their errors and exact values and their mean row-sum bias:
    max(relative error / ERROR_BOUND, mean bias / BIAS_BOUND), +inf where anything was not finite."""
    relative = torch.where(norm > 0, err / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)
    loss = relative / ERROR_BOUND
    if mean_ratio is not None:
        loss = torch.maximum(loss, mean_ratio / BIAS_BOUND)
    return torch.nan_to_num(loss, nan=torch.inf)


def _totals_losses(parts: Sequence[RowTotals]) -> torch.Tensor:
    """[P] `row_sum_loss` of each part's row sums, batched: the mean |sum - 1| of its live rows (those with mass; a
    fully masked row is no row of probabilities) over ROW_SUM_BOUND."""
    totals = torch.cat([p.totals for p in parts])
    live = totals > 0
    counts = [p.totals.numel() for p in parts]
    deviation = _part_means(torch.where(live, (totals - 1.0).abs(), 0.0), counts, live.float())
    return torch.nan_to_num(deviation / ROW_SUM_BOUND, nan=torch.inf)


def _part_means(values: torch.Tensor, counts: list[int], weights: torch.Tensor | None = None) -> torch.Tensor:
    """[P] mean of each part's run of `values` (`counts[i]` values each, concatenated), over its `weights` (1 or 0)
    when given; 0 for a part with nothing to average."""
    index = torch.repeat_interleave(
        torch.arange(len(counts), device=values.device), torch.tensor(counts, device=values.device)
    )
    total = values.new_zeros(len(counts)).index_add_(0, index, values)
    if weights is None:
        return total / torch.tensor(counts, device=values.device).clamp_min(1)
    return total / values.new_zeros(len(counts)).index_add_(0, index, weights).clamp_min(1)


def part_device(part: Part) -> torch.device:
    """The device a measurement's part lives on."""
    return part.device if isinstance(part, torch.Tensor | Pending) else part[0].device


def unit_losses(measurements: Sequence[Sequence[Sequence[Part]]], device: torch.device | str) -> torch.Tensor:
    """Per unit, the mean over its measurements of the worst of each measurement's parts, in one batched pass.

    `measurements[i]`: unit i's measurements since the last call, each a list of parts (operand stats, probability
    rows' sums, 0-d losses, or `Pending` ones, finished here by groups). Returns [N] float32 losses, NaN where a
    unit has no measurement."""
    device = torch.device(device)
    n = len(measurements)
    kinds: tuple[list[Any], list[Any], list[Any]] = ([], [], [])  # operand stats, row sums, losses
    owners: tuple[list[int], list[int], list[int]] = ([], [], [])
    pending: dict[int, Pending] = {}  # distinct pending parts, by id
    pending_owners: list[tuple[int, int]] = []  # (id of the part, measurement)
    unit_of: list[int] = []
    for i, unit in enumerate(measurements):
        for parts in unit:
            m = len(unit_of)
            unit_of.append(i)
            for part in parts:
                if isinstance(part, Pending) and part.pending:
                    pending.setdefault(id(part), part)
                    pending_owners.append((id(part), m))
                    continue
                part = resolve(part)
                kind = 2 if isinstance(part, torch.Tensor) else 1 if isinstance(part, RowTotals) else 0
                # A part measured on another device (a model split over several) comes over once, here.
                kinds[kind].append(part if part_device(part) == device else _to(part, device))
                owners[kind].append(m)
    if not unit_of:
        return torch.full((n,), torch.nan, device=device)
    values = []
    if kinds[0]:
        values.append(_stats_losses(kinds[0]))
    if kinds[1]:
        values.append(_totals_losses(kinds[1]))
    if kinds[2]:
        values.append(torch.stack(kinds[2]).float().reshape(-1))
    owner = owners[0] + owners[1] + owners[2]
    uses: list[int] = []
    if pending:
        # A part several units reported (a tensor they share) is finished once and counted for each of them.
        losses, order = finish_pending(list(pending.values()))
        values += [loss.to(device) for loss in losses]
        position = {id(part): len(owner) + k for k, part in enumerate(order)}
        uses = list(range(len(owner))) + [position[pid] for pid, _ in pending_owners]
        owner += [m for _, m in pending_owners]
    # One host-to-device copy of the bookkeeping: which measurement each value is of, which unit each measurement,
    # and which value each use of a shared pending part reads.
    index = torch.tensor(owner + unit_of + uses, device=device)
    by_value, by_measurement = index[: len(owner)], index[len(owner) : len(owner) + len(unit_of)]
    flat = torch.cat(values) if len(values) > 1 else values[0]
    if uses:
        flat = flat.index_select(0, index[len(owner) + len(unit_of) :])
    worst = torch.full((len(unit_of),), -torch.inf, device=device).scatter_reduce(0, by_value, flat, reduce="amax")
    count = torch.bincount(by_measurement, minlength=n).float()
    total = torch.zeros(n, device=device).index_add_(0, by_measurement, worst)
    return torch.where(count > 0, total / count.clamp_min(1), torch.nan)


def _to(part: Part, device: torch.device) -> Part:
    if isinstance(part, torch.Tensor):
        return part.to(device)
    return type(part)(*(t.to(device) for t in part))


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
    device = device if isinstance(device, torch.device) else torch.device(device)
    return _spread(n, max_rows, (draw * 7919) % n, device)  # a prime step: starts far apart


@functools.lru_cache(maxsize=1024)
def _spread(n: int, max_rows: int, start: int, device: torch.device) -> torch.Tensor:
    stride = n // max_rows
    while math.gcd(stride, n) != 1:
        stride += 1
    return (torch.arange(max_rows, device=device) * stride + start) % n


def take_rows(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """`x` as rows of its last dimension ([-1, x.shape[-1]]), only those of `index` (all when None). Rows of a
    permuted tensor (attention's q, k, v are transposed views) are read where they lie, not after a copy of all."""
    if not x.dim():
        return x.reshape(1, 1)
    width = x.shape[-1]
    if index is None or x.dim() == 2 or x.is_contiguous():
        rows = x.reshape(-1, width)
        return rows if index is None else rows.index_select(0, index)
    offsets = _row_offsets(x)
    if offsets is None:
        return x.reshape(-1, width).index_select(0, index)
    per_shape = _STORAGE_ROWS.get(index)
    if per_shape is None:
        per_shape = _STORAGE_ROWS[index] = {}
    key = (x.shape, x.stride())
    if key not in per_shape:
        # Row i of x (logical order) is memory row sum_d unravel(i)_d * stride_d / width: a few integer ops, once
        # per index and layout (the indices are themselves kept, `spread_rows`).
        unraveled = torch.unravel_index(index, x.shape[:-1])
        per_shape[key] = sum(u * o for u, o in zip(unraveled, offsets, strict=True))
    return x.as_strided((x.numel() // width, width), (width, 1)).index_select(0, per_shape[key])


# Per row index (weakly: it goes with the index), per layout of a permuted tensor: the memory rows it reads.
_STORAGE_ROWS: WeakTensorKeyDictionary = WeakTensorKeyDictionary()


def _row_offsets(x: torch.Tensor) -> list[int] | None:
    """Per leading dimension of `x`, its stride in rows, when x's rows fill one dense block of memory (a permutation
    of a contiguous tensor with the last dimension innermost); else None."""
    width = x.shape[-1]
    if x.stride(-1) != 1 and width > 1:
        return None
    expected = width
    for stride, size in sorted((x.stride(d), x.shape[d]) for d in range(x.dim() - 1) if x.shape[d] > 1):
        if stride != expected:
            return None
        expected *= size
    return [x.stride(d) // width if x.shape[d] > 1 else 0 for d in range(x.dim() - 1)]


def softmax_shift_loss(exact_logits: torch.Tensor, rounded_logits: torch.Tensor) -> torch.Tensor:
    """The mean over the rows of the total-variation distance between softmax(rounded_logits) and
    softmax(exact_logits), 0.5 * sum_j |q_ij - p_ij| (the share of each probability row the rounding moves), in
    units of SOFTMAX_SHIFT_BOUND; +inf where either is not finite. For a backward that recomputes a softmax from a
    rounded copy (the output head's loss), which a GEMM's averaging cannot undo: its rows are what the gradient of
    every layer below starts from."""
    p = torch.softmax(exact_logits.detach().float(), dim=-1)
    q = torch.softmax(rounded_logits.detach().float(), dim=-1)
    shift = 0.5 * (q - p).abs().sum(-1).mean() / SOFTMAX_SHIFT_BOUND
    return torch.where(shift.isfinite(), shift, torch.inf)


def row_totals(probabilities: torch.Tensor, index: torch.Tensor | None = None) -> RowTotals:
    """The sums of the rows of `probabilities` (those of `index` when given): a part whose loss is `row_sum_loss`,
    computed with the step's other measurements."""
    rows = take_rows(probabilities.detach(), index)
    return RowTotals(rows.sum(-1, dtype=torch.float32))


def row_sum_loss(probabilities: torch.Tensor, index: torch.Tensor | None = None) -> torch.Tensor:
    """Mean |sum_j p_ij - 1| over the rows with some mass (those of `index` when given), in units of
    ROW_SUM_BOUND (a fully masked row, all zeros, is not a row of probabilities)."""
    return _totals_losses([row_totals(probabilities, index)])[0]
