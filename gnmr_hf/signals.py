"""What a unit is scored on (`Signal`: its peft adapters, its weight, or its output gradient), and `UnitSignals`: the
per-unit gradient norms of all units in one fused pass (`torch._foreach_norm`, a fixed-order per-unit sum), with no
host sync, NaN and a `missing` mark for a unit without a gradient, and identical on every rank (sharded DTensor
gradients and output-gradient meters reduce their squares across ranks). peft is asked which tuner layer wraps
which module (`get_base_layer()`) and imported only when installed. Details: docs/method.md, "The signal".
"""

from __future__ import annotations

import importlib.util
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from .deprecated import warn_renamed
from .fidelity import unit_losses
from .impact import impacts
from .options import BackendOptions

__all__ = [
    "SIGNALS",
    "NormGrid",
    "OutputGradMeter",
    "Signal",
    "SignalOptions",
    "UnitSignals",
    "active_adapters",
    "adapter_tensors",
    "resolve_signal",
    "signal_option",
    "tuner_layers",
]


# The gradient a linear-like unit can be scored on; "auto" picks the first that exists in this order.
SIGNALS = ("auto", "lora", "weight", "output_grad")


def signal_option(weight: str = "its own trainable weight", note: str = "") -> Any:
    """The `signal` field every backend's options declare (validated with `check_choice("signal", SIGNALS)`)."""
    return field(
        default="auto",
        metadata={
            "help": f"The gradient a unit is scored on: 'lora' (its LoRA parameters), 'weight' ({weight}), "
            f"'output_grad' (the gradient of its output), or 'auto' (lora, else weight, else output_grad).{note}"
        },
    )


@dataclass
class SignalOptions(BackendOptions):
    """Options with the `signal` choice every linear-like backend offers (see `gnmr_hf.signals.resolve_signal`)."""

    signal: str = signal_option()

    def __post_init__(self) -> None:
        self.check_choice("signal", SIGNALS)


def tuner_layers(model: nn.Module) -> dict[int, nn.Module]:
    """{id(base module): the peft tuner layer wrapping it} over `model` (empty without peft)."""
    layers: dict[int, nn.Module] = {}
    if importlib.util.find_spec("peft") is not None:
        from peft.tuners.tuners_utils import BaseTunerLayer

        for candidate in model.modules():
            if isinstance(candidate, BaseTunerLayer):
                layers[id(candidate.get_base_layer())] = candidate
    return layers


def adapter_tensors(tuner: nn.Module) -> list[torch.Tensor]:
    """Trainable parameters of the active adapters of a peft tuner layer, in peft's own layer-name order.

    Several active adapters (`set_adapter(["a", "b"])`) all count. Keyed by identity: peft lists a DoRA layer's
    name twice in `adapter_layer_names`, and a parameter may be shared; counted twice it would double its share
    of the unit's norm.
    """
    active = set(tuner.active_adapters)
    tensors: dict[int, torch.Tensor] = {}
    for layer_name in tuner.adapter_layer_names:
        for adapter, layer in getattr(tuner, layer_name).items():
            if adapter not in active:
                continue
            params = [layer] if isinstance(layer, nn.Parameter) else list(layer.parameters())
            tensors.update((id(p), p) for p in params if p.requires_grad)
    return list(tensors.values())


def active_adapters(model: nn.Module) -> tuple[str, ...] | None:
    """The active adapters of a peft model (or of a transformers model with adapters loaded), else None."""
    value: Any = getattr(model, "active_adapters", None)
    if callable(value):  # transformers' integration: a method that raises when no adapter is loaded
        try:
            value = value()
        except (ValueError, AttributeError):
            return None
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass
class Signal:
    """What a unit is scored on: `kind` ("lora", "weight" or "output_grad") and the tensors whose `.grad` is the
    signal (empty for "output_grad", which meters the gradient of the module's output instead)."""

    kind: str
    tensors: list[torch.Tensor]


def resolve_signal(choice: str, name: str, module: nn.Module, tuner: nn.Module | None, backend: str) -> Signal:
    """The signal of a linear-like unit for the option `signal=choice`.

    "lora": the trainable tensors of the active adapters of the peft layer around the module; "weight": the
    module's own weight, when it is trainable; "output_grad": an `OutputGradMeter` on the module's output (it
    fires only where the output requires grad: before the first trainable parameter, call
    `model.enable_input_require_grads()`); "auto": lora, else weight, else output_grad.
    """
    lora = adapter_tensors(tuner) if tuner is not None else []
    weight = getattr(module, "weight", None)
    trainable_weight = isinstance(weight, torch.Tensor) and weight.requires_grad
    kind = choice
    if kind == "auto":
        kind = "lora" if lora else "weight" if trainable_weight else "output_grad"
    if kind == "lora" and not lora:
        raise ValueError(
            f"{backend} unit {name!r}: signal='lora' but the module has no peft adapter with trainable parameters; "
            "use signal='weight' or 'output_grad', or exclude it"
        )
    if kind == "weight" and not trainable_weight:
        raise ValueError(
            f"{backend} unit {name!r}: signal='weight' but its weight does not require grad; use signal='lora' or "
            "'output_grad'"
        )
    return Signal(kind, {"lora": lora, "weight": [weight], "output_grad": []}[kind])


class OutputGradMeter:
    """Accumulates ||dL/d output||^2 of one module over the backward passes of an optimizer step.

    The fallback signal for a unit with no trainable parameter of its own: a forward hook puts a tensor hook on
    the module's output, so the meter sees the gradient flowing into the module. Over gradient accumulation the
    squared norms of the micro-batches add up (their outputs are different tensors, so there is no single
    accumulated gradient to take the norm of); `take()` returns the sum and resets it.
    """

    def __init__(self, module: nn.Module) -> None:
        self.sq: torch.Tensor | None = None
        self._handle = module.register_forward_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad and torch.is_grad_enabled():
            out.register_hook(self._on_grad)

    def _on_grad(self, grad: torch.Tensor) -> None:
        sq = torch.linalg.vector_norm(grad, dtype=torch.float32).square()
        self.sq = sq if self.sq is None else self.sq + sq

    def take(self) -> torch.Tensor | None:
        sq, self.sq = self.sq, None
        return sq

    def remove(self) -> None:
        self._handle.remove()


class ScoredUnit(Protocol):
    """What `UnitSignals` reads of a unit (a `gnmr_hf.units.RecoverableUnit`)."""

    name: str
    module: nn.Module
    output_grad: OutputGradMeter | None

    def signal_tensors(self) -> list[torch.Tensor]: ...


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


class NormGrid:
    """Per-unit sums of squared gradient norms, the same on every device: each tensor j of the units' signals
    (`owner[j]`: its unit) has its own slot in an [N, M] grid (M = most tensors of one unit), so a unit's sum is a
    plain `sum(dim=1)` over its row, unlike `index_add_`, whose CUDA kernel adds in a nondeterministic order (and
    decisions must be a pure function of the gradients). `UnitSignals` and the DeepSpeed ZeRO path fill it."""

    def __init__(self, owner: Sequence[int], num_units: int, device: torch.device) -> None:
        self.num_units, self.device = num_units, device
        self.width = max(Counter(owner).values(), default=1)
        seen = [0] * num_units
        self.slots: list[int] = []
        for i in owner:
            self.slots.append(i * self.width + seen[i])
            seen[i] += 1

    def slot_tensor(self, tensors: Sequence[int]) -> torch.Tensor:
        """The grid slots of signal tensors `tensors` (indices into `owner`), on the device."""
        return torch.tensor([self.slots[j] for j in tensors], dtype=torch.long, device=self.device)

    def squares(self, grads: Sequence[torch.Tensor], slots: torch.Tensor) -> torch.Tensor:
        """[N] float32: the squared norms of `grads`, each put in its slot of `slots` (`slot_tensor`), summed per
        unit; 0 for a unit none of them belongs to."""
        grid = torch.zeros(self.num_units * self.width, dtype=torch.float32, device=self.device)
        if grads:
            # Norms in float32 whatever the gradient dtype: bf16 squares lose the small terms of a sum.
            norms = torch._foreach_norm(list(grads), 2, dtype=torch.float32)
            grid[slots] = torch.stack([n.to(self.device) for n in norms]).square()
        return grid.view(self.num_units, self.width).sum(dim=1)


class UnitSignals:
    """Computes the [N] vector of per-unit gradient norms for a fixed list of units.

    Args:
        units: the units, in controller order.
        device: where the norms live (default: the first signal tensor's device).
        dp_group: the data-parallel process group over which output-gradient meters are summed, when several
            processes train on different data (DDP, FSDP); None for one process.
        model: the model the units belong to; its active peft adapters are recorded, and `check()` refuses a
            change of them (the `lora` signals were resolved for these adapters).
    """

    def __init__(
        self,
        units: Sequence[ScoredUnit],
        device: torch.device | str | None = None,
        dp_group: Any = None,
        model: nn.Module | None = None,
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
        self._grid = NormGrid(owner, self.num_units, self.device)
        # Tensors grouped by how their squares are reduced: None for plain tensors, else the process groups of
        # the mesh dimensions a DTensor gradient is sharded on. Each group's grid slots are kept on the device.
        self._members: dict[tuple[Any, ...] | None, list[int]] = {None: []}
        for j, tensor in enumerate(self.tensors):
            self._members.setdefault(_shard_groups(tensor), []).append(j)
        self._member_slots = {key: self._grid.slot_tensor(members) for key, members in self._members.items()}
        self.sharded = len(self._members) > 1
        self._none_missing = torch.zeros(self.num_units, dtype=torch.bool, device=self.device)
        self._model = model
        self._adapters = active_adapters(model) if model is not None else None
        self.cheap_loss: torch.Tensor | None = None
        self.impact: torch.Tensor | None = None

    def check(self) -> None:
        """Raise if the model's active adapters changed since the signals were built: a unit's `lora` signal
        would then read the gradients of adapters that no longer train. Host only (no sync)."""
        if self._adapters is None or self._model is None:
            return
        now = active_adapters(self._model)
        if now != self._adapters:
            raise ValueError(
                f"GNMR: the model's active adapters changed from {list(self._adapters)} to {list(now or ())} after "
                "training began; GNMR scores each unit on the adapters active at train begin and would read the "
                "wrong ones. Change adapters between train() calls: each call finds the units again"
            )

    def _squares(self, key: tuple[Any, ...] | None, has_grad: list[bool]) -> torch.Tensor:
        """[N] sums of the squared gradient norms of one group's tensors (local shards for sharded ones), each
        added into its own grid slot, then per unit. Marks the units that have a gradient in `has_grad`."""
        members = self._members[key]
        present = [j for j in members if self.tensors[j].grad is not None]
        grads = [self.tensors[j].grad for j in present]
        if key is not None:
            grads = [g.to_local() for g in grads]
        for j in present:
            has_grad[self._owner_host[j]] = True
        slots = self._member_slots[key] if len(present) == len(members) else self._grid.slot_tensor(present)
        return self._grid.squares(grads, slots)

    def gather_cheap_loss(self) -> torch.Tensor | None:
        """[N] float32 of what each unit's cheap path lost this step, in units of its bound (each unit's
        `FidelityMeter.take`, turned into losses in one batched pass: `gnmr_hf.fidelity.unit_losses`), NaN where a
        unit measured nothing; None when no unit did (the paper's policy: nothing is measured). No host sync."""
        taken = [u.meter.take() if getattr(u, "meter", None) is not None else [] for u in self.units]
        if not any(taken):
            return None
        return self._mean_over_ranks(unit_losses(taken, self.device))

    def _mean_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Per unit, the mean of `values` ([N], NaN where a rank measured nothing) over the ranks that measured it:
        each rank measured its own micro-batches, and every rank must decide the same. As it is for one process."""
        if self.dp_group is None:
            return values
        seen = ~values.isnan()
        both = torch.stack([values.nan_to_num(0.0), seen.float()])
        torch.distributed.all_reduce(both, group=self.dp_group)
        return torch.where(both[1] > 0, both[0] / both[1].clamp_min(1.0), torch.nan)

    def gather_fidelity(self) -> torch.Tensor | None:
        warn_renamed("UnitSignals.gather_fidelity()", "gather_cheap_loss()")
        return self.gather_cheap_loss()

    @property
    def fidelity(self) -> torch.Tensor | None:
        warn_renamed("UnitSignals.fidelity", "UnitSignals.cheap_loss")
        return self.cheap_loss

    def gather_impact(self, scale: Any = None) -> torch.Tensor | None:
        """[N] float32 of what each unit's cheap path cost the loss this step (nats per token, `gnmr_hf.impact`),
        NaN where a unit measured nothing; None when no unit measures (only `policy="impact"` turns the meters on,
        on every rank alike). `scale`: the fp16 loss scale the gradients carried. Averaged over the ranks that
        measured, so that every rank decides the same. No host sync."""
        meters = [getattr(u, "impact", None) for u in self.units]
        if not any(m is not None and m.on for m in meters):
            return None
        return self._mean_over_ranks(
            impacts([m.take() if m is not None else None for m in meters], self.device, scale)
        )

    @torch.no_grad()
    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (norms float32 [N], missing bool [N]); norms are NaN where missing. No host sync.

        In the same pass what the units' cheap paths lost this step is gathered into `self.cheap_loss` ([N], NaN
        where a unit measured nothing, None when none did: `gather_cheap_loss`)."""
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
        self.cheap_loss = self.gather_cheap_loss()
        if missing_mask is None:
            if all(has_grad):
                return sq.sqrt_(), self._none_missing
            missing_mask = torch.tensor([not h for h in has_grad], dtype=torch.bool).to(self.device, non_blocking=True)
        return sq.sqrt_().masked_fill_(missing_mask, torch.nan), missing_mask
