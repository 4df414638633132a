"""Per-unit gradient norms in one fused pass, with no device-to-host sync.

A unit's signal is the L2 norm of the gradients of its signal tensors (for LoRA: lora_A and lora_B of every
active adapter) taken together: sqrt(sum_j ||g_j||^2). Computing that with a Python loop of `.norm()` calls
would launch one kernel per tensor and, worse, tempt `.item()` calls. Instead all gradients go through one
`torch._foreach_norm` (a multi-tensor kernel on GPU), the per-tensor squares are summed into their units in one
fixed-order reduction, and the result stays on the device for the controller.

A unit none of whose tensors has a gradient this step (a layer that was not used, a frozen branch) is reported
as *missing*: its norm is NaN and `missing[i]` is True, so the controller skips it instead of reading a zero
as "perfectly stable". Which `.grad` is None is known on the host, so the mask costs no sync.

Sharded gradients (FSDP, ZeRO) hold only a slice of each tensor on a rank: pass `process_group` and the squared
partial norms are summed across ranks with one all-reduce before the square root.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

import torch

from .units import OutputGradMeter, RecoverableUnit

__all__ = ["UnitSignals"]


class UnitSignals:
    """Computes the [N] vector of per-unit gradient norms for a fixed list of units."""

    def __init__(self, units: Sequence[RecoverableUnit], device: torch.device | str | None = None) -> None:
        if not units:
            raise ValueError("UnitSignals: units must be a non-empty sequence of RecoverableUnit")
        self.units = list(units)
        self.tensors: list[torch.Tensor] = []
        owner: list[int] = []
        self.meters: list[tuple[int, OutputGradMeter]] = []
        for i, unit in enumerate(self.units):
            tensors = unit.signal_tensors()
            if tensors:
                self.tensors.extend(tensors)
                owner.extend([i] * len(tensors))
            elif unit.output_grad is not None:
                self.meters.append((i, unit.output_grad))
            else:
                raise ValueError(f"UnitSignals: unit {unit.name!r} has no signal tensors and no output-gradient meter")
        if device is None:
            first = self.tensors[0] if self.tensors else next(self.units[0].module.parameters())
            device = first.device
        self.device = torch.device(device)
        self._owner_host = owner
        # Each tensor gets its own slot in an [N, M] grid (M = most tensors of one unit), so the per-unit sum
        # is a plain `sum(dim=1)`: deterministic on every device, unlike `index_add_`, whose CUDA kernel adds
        # in a nondeterministic order (and decisions must be a pure function of the gradients).
        width = max(Counter(owner).values(), default=1)
        slots, seen = [], [0] * len(self.units)
        for i in owner:
            slots.append(i * width + seen[i])
            seen[i] += 1
        self._width = width
        self._slots = torch.tensor(slots, dtype=torch.long, device=self.device)
        self._same_device = all(t.device == self.device for t in self.tensors)
        self._none_missing = torch.zeros(len(self.units), dtype=torch.bool, device=self.device)
        self.num_units = len(self.units)

    @torch.no_grad()
    def compute(self, process_group: object | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norms float32 [N], missing bool [N]); norms are NaN where missing. No host sync."""
        grid = torch.zeros(self.num_units * self._width, dtype=torch.float32, device=self.device)
        has_grad = [False] * self.num_units
        grads, present = [], []
        for j, tensor in enumerate(self.tensors):
            if tensor.grad is not None:
                grads.append(tensor.grad)
                present.append(j)
                has_grad[self._owner_host[j]] = True
        if grads:
            # Norms in float32 whatever the gradient dtype: bf16 squares lose the small terms of a sum.
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            per_tensor = torch.stack(norms if self._same_device else [n.to(self.device) for n in norms])
            slots = self._slots if len(present) == len(self.tensors) else self._slots[present]
            grid[slots] = per_tensor.square()
        sq = grid.view(self.num_units, self._width).sum(dim=1)
        for i, meter in self.meters:
            value = meter.take()
            if value is not None:
                sq[i] += value.to(self.device)
                has_grad[i] = True
        if process_group is not None:
            torch.distributed.all_reduce(sq, group=process_group)
        if all(has_grad):
            return sq.sqrt_(), self._none_missing
        missing = torch.tensor([not h for h in has_grad], dtype=torch.bool).to(self.device, non_blocking=True)
        return sq.sqrt_().masked_fill_(missing, torch.nan), missing
