"""Per-unit gradient norms in one fused pass, with no device-to-host sync, identical on every rank.

A unit's signal is the L2 norm of the gradients of its signal tensors (for LoRA: lora_A and lora_B of every
active adapter) taken together: sqrt(sum_j ||g_j||^2). Computing that with a Python loop of `.norm()` calls
would launch one kernel per tensor and, worse, tempt `.item()` calls. Instead the gradients go through
`torch._foreach_norm` (a multi-tensor kernel on GPU), the per-tensor squares are summed into their units in one
fixed-order reduction, and the result stays on the device for the controller.

A unit none of whose tensors has a gradient this step (a layer that was not used, a frozen branch) is reported
as *missing*: its norm is NaN and `missing[i]` is True, so the controller skips it instead of reading a zero
as "perfectly stable". Which `.grad` is None is known on the host, so the mask costs no sync.

Several processes. The decisions must be the same on every rank, so the norms must be:

- Replicated gradients (DDP after its averaging, or any plain tensor) are already identical on every rank.
- Sharded gradients (FSDP2's `fully_shard` gives DTensor parameters whose gradients are DTensors) hold a slice
  of each tensor per rank: the squares of their local shards are summed per unit, then across the mesh
  dimensions the tensor is sharded on, with one all-reduce per distinct group, before the square root. Only
  the sharded part is reduced: adding a replicated square once per rank would count it several times.
- Output-gradient meters measure the gradient of a module's output for the rank's own micro-batches, which
  differ per rank; with `dp_group` their squares and whether they fired are summed across the data-parallel
  group, so every rank scores the whole global batch and agrees on which units are missing.

DeepSpeed ZeRO keeps gradients inside its engine (`.grad` is None at every Trainer event):
`gnmr_hf/integrations/deepspeed.py` reads them there the same way, squares of the local slices reduced across ranks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch

from .units import OutputGradMeter, RecoverableUnit

__all__ = ["UnitSignals"]


def _shard_groups(tensor: torch.Tensor) -> tuple[Any, ...] | None:
    """The process groups to sum a DTensor's local squared norm over (the mesh dimensions it is sharded on), or
    None for a plain tensor."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return None
    from torch.distributed.tensor import DTensor

    if not isinstance(tensor, DTensor):
        return None
    mesh = tensor.device_mesh
    return tuple(mesh.get_group(dim) for dim, p in enumerate(tensor.placements) if p.is_shard())


class UnitSignals:
    """Computes the [N] vector of per-unit gradient norms for a fixed list of units.

    Args:
        units: the units, in controller order.
        device: where the norms live (default: the first signal tensor's device).
        dp_group: the data-parallel process group over which output-gradient meters are summed, when several
            processes train on different data (DDP, FSDP); None for one process.
    """

    def __init__(
        self, units: Sequence[RecoverableUnit], device: torch.device | str | None = None, dp_group: Any = None
    ) -> None:
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
        self.num_units = len(self.units)
        self.dp_group = dp_group
        self._owner_host = owner
        # Each tensor gets its own slot in an [N, M] grid (M = most tensors of one unit), so the per-unit sum
        # is a plain `sum(dim=1)`: deterministic on every device, unlike `index_add_`, whose CUDA kernel adds
        # in a nondeterministic order (and decisions must be a pure function of the gradients).
        width = max(Counter(owner).values(), default=1)
        slots, seen = [], [0] * self.num_units
        for i in owner:
            slots.append(i * width + seen[i])
            seen[i] += 1
        self._width = width
        # Tensors grouped by how their squares are reduced: None for plain tensors, else the process groups of
        # the mesh dimensions a DTensor gradient is sharded on. Each group's grid slots are kept on the device.
        self._members: dict[tuple[Any, ...] | None, list[int]] = {None: []}
        for j, tensor in enumerate(self.tensors):
            self._members.setdefault(_shard_groups(tensor), []).append(j)
        self._slots = slots
        self._member_slots = {
            key: torch.tensor([slots[j] for j in members], dtype=torch.long, device=self.device)
            for key, members in self._members.items()
        }
        self.sharded = len(self._members) > 1
        self._none_missing = torch.zeros(self.num_units, dtype=torch.bool, device=self.device)

    def _squares(self, key: tuple[Any, ...] | None, has_grad: list[bool]) -> torch.Tensor:
        """[N] sums of the squared gradient norms of one group's tensors (local shards for sharded ones), each
        added into its own grid slot, then per unit. Marks the units that have a gradient in `has_grad`."""
        members = self._members[key]
        present = [j for j in members if self.tensors[j].grad is not None]
        grid = torch.zeros(self.num_units * self._width, dtype=torch.float32, device=self.device)
        if present:
            grads = [self.tensors[j].grad for j in present]
            if key is not None:
                grads = [g.to_local() for g in grads]
            for j in present:
                has_grad[self._owner_host[j]] = True
            # Norms in float32 whatever the gradient dtype: bf16 squares lose the small terms of a sum.
            norms = torch._foreach_norm(grads, 2, dtype=torch.float32)
            per_tensor = torch.stack([n.to(self.device) for n in norms])
            slots = self._member_slots[key]
            if len(present) < len(members):
                slots = torch.tensor([self._slots[j] for j in present], dtype=torch.long, device=self.device)
            grid[slots] = per_tensor.square()
        return grid.view(self.num_units, self._width).sum(dim=1)

    @torch.no_grad()
    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norms float32 [N], missing bool [N]); norms are NaN where missing. No host sync."""
        has_grad = [False] * self.num_units
        sq = self._squares(None, has_grad)
        for key in self._members:
            if key is not None:
                part = self._squares(key, has_grad)
                for group in key:
                    torch.distributed.all_reduce(part, group=group)
                sq += part
        missing_mask: torch.Tensor | None = None
        if self.meters:
            meter_sq = torch.zeros(self.num_units, dtype=torch.float32, device=self.device)
            fired = torch.zeros(self.num_units, dtype=torch.float32, device=self.device)
            for i, meter in self.meters:
                value = meter.take()
                if value is not None:
                    meter_sq[i] = value.to(self.device)
                    fired[i] = 1.0
                    has_grad[i] = True
            if self.dp_group is not None:
                # Each rank metered its own micro-batches: sum the squares and the "fired" flags across ranks, so
                # every rank scores the global batch and marks the same units missing.
                both = torch.stack([meter_sq, fired])
                torch.distributed.all_reduce(both, group=self.dp_group)
                meter_sq, fired = both[0], both[1]
                metered = torch.zeros(self.num_units, dtype=torch.bool)
                metered[[i for i, _ in self.meters]] = True
                tensor_missing = torch.tensor([not h for h in has_grad]) & ~metered
                missing_mask = tensor_missing.to(self.device, non_blocking=True) | (
                    metered.to(self.device, non_blocking=True) & (fired == 0)
                )
            sq += meter_sq
        if missing_mask is None:
            if all(has_grad):
                return sq.sqrt_(), self._none_missing
            missing_mask = torch.tensor([not h for h in has_grad], dtype=torch.bool).to(self.device, non_blocking=True)
        return sq.sqrt_().masked_fill_(missing_mask, torch.nan), missing_mask
