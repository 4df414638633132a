"""What every act_quant unit shares: the `SaveSpec` of its next forward (low bits on the cheap path, high bits in
recovery), the recovery path's extra bytes for the ledger and, for the kinds that replace their module's forward,
one `SaveCache` per `find_units` call."""

from __future__ import annotations

import dataclasses
from abc import abstractmethod
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...fidelity import OperandStats
from ...units import DispatchContext, RecoverableUnit, SwitchedUnit
from .options import ActQuantOptions
from .saving import SaveCache, SaveSpec, ScaleTransform


class _SavesActivations(RecoverableUnit):
    """What every unit kind shares: the bits of the next forward's saved tensors, and the ledger's bytes.

    `scale_transform` (None: none) is the cheap path's `SaveSpec.scale_transform`, the seam through which an
    experiment perturbs what the cheap path stores. The recovery path holds, per forward, the extra bytes of the
    saved tensors at `high_bits` over `low_bits`; they follow batch x sequence, so each recovery forward re-states
    them.
    """

    options: ActQuantOptions

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext[ActQuantOptions]) -> None:
        options = ctx.options
        self.low_bits, self.high_bits = options.low_bits, options.high_bits
        self.scale_transform: ScaleTransform | None = None
        self._max_extra = 0
        super().__init__(name, module, ctx)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "kind": self.kind, "bits": f"{self.low_bits}/{self.high_bits}"}

    def current_spec(self) -> SaveSpec:
        """How the next forward saves: `high_bits` in recovery, else `cheap_spec()`."""
        return self.options.spec(self.high_bits) if self._recovering else self.cheap_spec()

    def cheap_spec(self) -> SaveSpec:
        """How the cheap path saves (`low_bits`, with the unit's `scale_transform`), also while the unit is in
        recovery: what it loses is measured on it either way."""
        spec = self.options.spec(self.low_bits)
        if self.scale_transform is None:
            return spec
        return dataclasses.replace(spec, scale_transform=self.scale_transform)

    def count_recovery_bytes(self, *tensors: torch.Tensor) -> None:
        """Record the extra bytes the recovery path saves for these tensors; state them to the ledger in recovery."""
        extra = self.options.extra_bytes(*tensors)
        self._max_extra = max(self._max_extra, extra)
        if self._recovering:
            self.ledger.hold(self, extra)

    def recovery_bytes(self) -> int:
        return self._max_extra

    def _enter(self) -> int:
        return self._max_extra


def _save_cache(ctx: DispatchContext) -> SaveCache:
    return SaveCache()


def _operand_parts(
    unit: RecoverableUnit, spec: SaveSpec, cache: SaveCache, tensors: Sequence[torch.Tensor], bias: bool = True
) -> list[OperandStats]:
    """`SaveSpec.stats` of each operand one unit saves, on the rows `unit.meter.rows` picks, for one report (its
    loss is the worst one's, as attention's q, k, v: the worst one is the one whose backward breaks first). `bias`:
    with the row-sum bias (False for a copy that feeds only a weight gradient, docs/method.md)."""
    return [spec.stats(x, cache, unit.meter.rows(x), bias) for x in tensors]


class _SwitchedSaves(_SavesActivations, SwitchedUnit):
    """A kind whose module's forward is replaced (every kind but attention): one forward for both paths, since what
    differs is only how it saves (`current_spec`); the kinds share one save cache per `find_units` call."""

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext) -> None:
        self._cache = ctx.once(_save_cache)
        super().__init__(name, module, ctx)

    @abstractmethod
    def saving_forward(self, *args: Any) -> Any:
        """The module's computation, saving for the backward as `current_spec()` says."""

    def cheap_forward(self, *args: Any) -> Any:
        return self.saving_forward(*args)

    def recovery_forward(self, *args: Any) -> Any:
        return self.saving_forward(*args)
