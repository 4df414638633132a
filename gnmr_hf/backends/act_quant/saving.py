"""How act_quant saves a tensor for the backward: `SaveSpec` (bits and absmax scaling) packs it into codes and float32
scales, `SaveCache` keeps one packed copy of a tensor several units save. A `SaveSpec` also measures what its save
loses, on sampled rows and without packing, batched over a step (`gnmr_hf.fidelity.Pending`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ...fidelity import (
    OperandStats,
    Pending,
    TensorCache,
    defer,
    operand_loss,
    operand_losses,
    operand_stats,
    take_rows,
)
from ...quant import (
    QuantizedTensor,
    absmax_round_rows,
    quantize_absmax,
    quantized_nbytes,
    round_codes,
    tensor_absmax_scale,
)

# The bits of a copy saved as it is.
UNQUANTIZED = 16

# `SaveSpec.scale_transform`: (scales, their positions among the copy's, None for all in order) -> scales stored.
ScaleTransform = Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]


@dataclass(frozen=True)
class SaveSpec:
    """How one forward saves a tensor: bit width (16: unquantized) and absmax scaling.

    `scale_transform` (None: none) is a hook for experiments that perturb a copy (`gnmr_hf/experiments/faults.py`): it
    gets the flat scales a copy stores, or an unquantized copy's rows (which stand for its scales), with their
    positions in the whole copy (None: all, in order), and returns what is stored in their place. Every copy this
    spec gives back, and every measure of what it loses, reads the transformed scales.
    """

    bits: int
    scaling: str = "tensor"
    group_size: int = 32
    stochastic: bool = False
    scale_transform: ScaleTransform | None = None

    def group_for(self, shape: torch.Size) -> int | None:
        """The `group_size` argument of `quantize_absmax` for a tensor of `shape`."""
        if self.scaling == "tensor":
            return None
        return shape[-1] if self.scaling == "row" else self.group_size

    def nbytes(self, shape: torch.Size, element_size: int) -> int:
        """Bytes saved for a tensor of `shape` whose elements take `element_size` bytes unquantized."""
        if self.bits == UNQUANTIZED:
            return shape.numel() * element_size
        return quantized_nbytes(shape, self.bits, self.group_for(shape))

    def save(
        self, x: torch.Tensor, cache: SaveCache | None = None
    ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any] | None]:
        """(tensors for `ctx.save_for_backward`, metadata for `restore`). With a `cache`, a tensor already quantized
        the same way (the one input q, k and v projections share) is not quantized and stored twice."""
        if self.bits == UNQUANTIZED:
            if self.scale_transform is None:
                return (x,), None
            return (self.scale_transform(x.reshape(-1, x.shape[-1]), None).reshape(x.shape),), None
        key = self._key(x)
        entry = None if cache is None else cache.get(x, key)
        if entry is None:
            q = quantize_absmax(x.detach(), self.bits, group_size=self.group_for(x.shape), stochastic=self.stochastic)
            entry = (q.tensors(), q.metadata())
            if cache is not None:
                cache.put(x, key, entry)
        (packed, scales), meta = entry
        return (packed, self._stored(scales.reshape(-1), None).reshape(scales.shape)), meta

    def _key(self, x: torch.Tensor) -> tuple[Any, ...]:
        return (self.bits, self.group_for(x.shape), self.stochastic, x._version)

    def loss(self, x: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
        """What saving `x` this way loses (`gnmr_hf.fidelity.operand_loss` of the restored copy), on the rows `rows`
        of `x` (all when None)."""
        return operand_loss(take_rows(x, rows), self.restore_rows(x, rows))

    def stats(
        self, x: torch.Tensor, cache: SaveCache | None = None, rows: torch.Tensor | None = None, bias: bool = True
    ) -> OperandStats | Pending:
        """The `operand_stats` of `loss` (`bias`: with the row-sum bias), kept in `cache` so that the units reading
        one tensor measure it once, and using the scale of the copy the cache holds (the one saved) where there is
        one. On sampled `rows`, a `Pending` part: the rows and the scale are taken now, the rounding and the sums
        run in the step's batched pass."""
        key = ("stats", self, bias, x._version)
        cached = None if cache is None else cache.get(x, key)
        if cached is None:
            exact = take_rows(x.detach(), rows)
            if rows is None:
                cached = operand_stats(exact, self._rounded(x, exact, None, cache), bias)
            else:
                scale, group = self._tensor_scale(x, cache), self.group_for(x.shape)
                # The key is a value (spec, dtype, group, bias) and the function a plain one, so that the operands of
                # every unit with the same rounding finish together (bound methods compare their instance by id).
                # With one scale per tensor the part keeps that scale; otherwise the row indices, which row-local
                # scales and a transform of unquantized rows (by their positions) need.
                kept = (rows,) if scale is None else (scale.reshape(1),)
                pending = Pending(SaveSpec._finish_losses, (self, x.dtype, group, bias), exact, *kept)
                cached = defer(pending)
            if cache is not None:
                cache.put(x, key, cached)
        return cached

    @staticmethod
    def _finish_losses(key: tuple[Any, ...], exact: torch.Tensor, kept: torch.Tensor) -> torch.Tensor:
        """[P] losses of P pending `stats`: their [P, R, W] rows and, as `stats` kept them, their [P] scales (one
        per tensor) or their [P, R] row indices; rounded as `_round_rows` rounds each tensor's rows, all at once."""
        self, dtype, group, bias = key
        exact = exact.float()
        if self.bits == UNQUANTIZED:
            rounded = self._stored(exact, kept)
        elif group is None:
            # Each tensor's rows at its own scale ([P, 1]), stored as its copy's one scale: position 0 of each, so
            # the P of them are one row of [1, P] for the scale transform.
            scale = kept.reshape(-1, 1)
            codes = round_codes(exact, scale, self.bits, stochastic=self.stochastic)
            rounded = codes.mul_(self._stored(kept.reshape(1, -1), None).reshape(-1, 1, 1))
        else:
            rounded = torch.stack(
                [self._round_rows(e, i, torch.float32, group, None) for e, i in zip(exact, kept, strict=True)]
            )
        if dtype != torch.float32:
            rounded = rounded.to(dtype).float()
        return operand_losses(exact, rounded, bias)

    def restore_rows(self, x: torch.Tensor, rows: torch.Tensor | None, cache: SaveCache | None = None) -> torch.Tensor:
        """Rows `rows` (all when None) of what saving `x` this way gives back, as [-1, x.shape[-1]], computing only
        those rows: with deterministic rounding the same values `restore(*save(x))` has there, scale transform
        included. One scale per tensor is the copy's in `cache` when it holds one, else computed from all of `x`."""
        return self._rounded(x, take_rows(x.detach(), rows), rows, cache).to(x.dtype)

    def _rounded(
        self, x: torch.Tensor, exact: torch.Tensor, rows: torch.Tensor | None, cache: SaveCache | None
    ) -> torch.Tensor:
        """`restore_rows` from `exact`, rows `rows` of `x` already taken, as float32 (of values in x's dtype)."""
        if rows is None:
            return take_rows(self.restore(*self.save(x, cache)), None).float()
        return self._round_rows(exact, rows, x.dtype, self.group_for(x.shape), self._tensor_scale(x, cache))

    def rounded_copy(self, x: torch.Tensor, cache: SaveCache | None = None) -> torch.Tensor:
        """What `restore(*save(x))` gives back (deterministic rounding, scale transform included), computed without
        packing the codes: for a measure that needs every row of the copy."""
        rows = take_rows(x.detach(), None)
        index = torch.arange(len(rows), device=x.device)
        scale = self._tensor_scale(x, cache)
        return self._round_rows(rows, index, x.dtype, self.group_for(x.shape), scale).to(x.dtype).reshape(x.shape)

    def _tensor_scale(self, x: torch.Tensor, cache: SaveCache | None) -> torch.Tensor | None:
        """The one scale of a quantized per-tensor copy of `x`: the saved copy's when `cache` holds it, else from
        all of `x`; None for a copy with row-local scales (or none)."""
        if self.bits == UNQUANTIZED or self.group_for(x.shape) is not None:
            return None
        entry = None if cache is None else cache.get(x, self._key(x))
        return tensor_absmax_scale(x.detach(), self.bits) if entry is None else entry[0][1]

    def _round_rows(
        self, exact: torch.Tensor, rows: torch.Tensor, dtype: torch.dtype, group: int | None, scale: Any
    ) -> torch.Tensor:
        """The rounded copy of `exact` (rows `rows` of a tensor of `dtype`), float32, scale transform included;
        `scale`: the tensor's one scale when it has one."""
        if self.bits == UNQUANTIZED:
            return self._stored(exact, rows).float()
        codes, scales = absmax_round_rows(
            None, exact, self.bits, group_size=group, stochastic=self.stochastic, scale=scale
        )  # fmt: skip
        if self.scale_transform is not None and group is None:
            scales = self.scale_transform(scales, None)  # the one scale ([1, 1]): position 0
        elif self.scale_transform is not None:
            # Scale j of sampled row i is scale rows[i] * per_row + j of the whole tensor's.
            per_row = scales.shape[-1]
            index = (rows.unsqueeze(-1) * per_row + torch.arange(per_row, device=rows.device)).reshape(-1)
            scales = self.scale_transform(scales.reshape(-1), index).reshape(scales.shape)
        rounded = codes.mul_(scales.unsqueeze(-1)).reshape(len(rows), -1)
        return rounded if dtype == torch.float32 else rounded.to(dtype).float()

    def _stored(self, scales: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """`scales` as stored: through `scale_transform`, or themselves."""
        return scales if self.scale_transform is None else self.scale_transform(scales, index)

    @staticmethod
    def restore(saved: tuple[torch.Tensor, ...], meta: dict[str, Any] | None) -> torch.Tensor:
        """The tensor `save` kept, dequantized to its original shape and dtype."""
        return saved[0] if meta is None else QuantizedTensor.from_tensors(*saved, **meta).dequantize()


class SaveCache(TensorCache):
    """The quantized copies of live tensors, per quantization, for the units of one `find_units` call.

    Several Linears often read one tensor (q, k and v projections the same normalized hidden states; gate and up
    projections another): quantized once, the packed copy is saved once, as a fused QKV projection would save it.
    Keyed weakly by the tensor (an entry goes when the tensor does) and by its version counter (an in-place change
    makes a new entry).
    """
