"""Recoverable units: the contract every backend fills in, and how a backend is declared.

A unit is one module with a cheap path and a high-fidelity (recovery) path; it is what the controller's index i
refers to. `RecoverableUnit` owns the rules (enter/exit/close idempotent, a closed unit refuses to enter, what
the recovery path holds counted in the shared `RecoveryLedger`, the signal); a backend subclass fills in what
differs. `SwitchedUnit` is the template for units that switch their module's forward. `Backend` declares a kind
of unit once: its name, its options, which modules it takes. `gnmr_hf.registry.find_units` builds the units. Under
`policy="cause"` a unit also reports what its cheap path loses, through its `meter` (a `gnmr_hf.meter.FidelityMeter`:
when to measure, which rows, what was measured), or through `input_fidelity` for a backend whose rounding happens in
a closed kernel.
"""

from __future__ import annotations

import logging
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

import torch
from torch import nn

from .deprecated import RenamedUnitNames
from .impact import ImpactMeter
from .meter import FidelityMeter
from .options import BackendOptions
from .signals import OutputGradMeter, Signal, resolve_signal

__all__ = [
    "Backend",
    "DispatchContext",
    "RecoverableUnit",
    "RecoveryLedger",
    "SwitchedUnit",
    "UnitSet",
    "apply_decision",
    "close_units",
    "display_name",
    "not_plain_linear",
    "unit_of",
    "unwrap_model",
]

logger = logging.getLogger("gnmr_hf")

T = TypeVar("T")
OptionsT = TypeVar("OptionsT", bound=BackendOptions)

# Path components that wrappers insert into `named_modules()` names: DDP/DataParallel (`module`), torch.compile
# (`_orig_mod`), FSDP1 and activation-checkpoint wrappers, and peft (`base_model.model`, `base_layer`).
_WRAPPER_COMPONENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})
# Where a module records the open unit that manages it (a weak reference): the model itself knows its units, so a
# run interrupted before it closed them can be cleaned up by the next one, with no module-level registry.
_OWNER_ATTR = "_gnmr_unit"


class RecoveryLedger:
    """Bytes held by the recovery paths of one group of units (those of one `find_units` call).

    A unit holds `nbytes` when it enters recovery or when what it holds changes (a saved-activation unit's bytes
    follow the batch), and releases them when it leaves. It counts what the units hold, not what the allocator
    reports, so it is exact and free to read on any device.
    """

    def __init__(self) -> None:
        self._held: dict[int, int] = {}
        self.live_bytes = 0
        self.peak_bytes = 0

    @property
    def live_units(self) -> int:
        return len(self._held)

    def hold(self, unit: object, nbytes: int) -> None:
        self.live_bytes += nbytes - self._held.get(id(unit), 0)
        self._held[id(unit)] = nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def release(self, unit: object) -> None:
        self.live_bytes -= self._held.pop(id(unit), 0)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __repr__(self) -> str:
        return (
            f"RecoveryLedger(live_bytes={self.live_bytes}, peak_bytes={self.peak_bytes}, live_units={self.live_units})"
        )


@dataclass
class DispatchContext(Generic[OptionsT]):
    """What one `find_units` call shares with the units it builds.

    Attributes:
        model: the (unwrapped) model being searched.
        backend: the backend's name, for messages.
        options: the backend's parsed options (an instance of its `Backend.options` class).
        ledger: the `RecoveryLedger` every unit of this call shares.
        tuners: {id(base module): peft tuner layer} for the model (empty without peft).
    """

    model: nn.Module
    backend: str = ""
    options: OptionsT = field(default_factory=BackendOptions)  # type: ignore[assignment]
    ledger: RecoveryLedger = field(default_factory=RecoveryLedger)
    tuners: dict[int, nn.Module] = field(default_factory=dict)
    _once: dict[Callable[..., Any], Any] = field(default_factory=dict, repr=False)

    def tuner(self, module: nn.Module) -> nn.Module | None:
        """The peft tuner layer whose base layer is `module`, or None."""
        return self.tuners.get(id(module))

    def once(self, make: Callable[[DispatchContext], T]) -> T:
        """`make(self)`, computed on first use and shared by every unit of this call (a checkpoint handle, a
        cache...): keyed by the function itself, so each backend's state keeps its own type."""
        if make not in self._once:
            self._once[make] = make(self)
        return self._once[make]


class RecoverableUnit(RenamedUnitNames):
    """One module with a low-cost path and a recovery path. A backend subclasses it (or `SwitchedUnit`).

    The contract, owned here: `enter_recovery()` / `exit_recovery()` are idempotent, cheap and reversible, create
    no `nn.Parameter` and never touch the optimizer; what the recovery path holds is counted in `ledger`; a closed
    unit refuses to enter; `close()` puts the module back as it was found. A subclass fills in `_enter()` (build
    the recovery path, return the bytes it holds), `_exit()`, `_close()` and `recovery_bytes()` where they differ
    from "nothing to build". Validate in `__init__` *before* calling `super().__init__`, which installs hooks.

    Attributes: `name`, `module`, `backend` (its name), `kind`, `options`, `ledger`, `tuner` (the peft layer around
    the module, or None), `signal` (the signal kind: "lora", "weight", "output_grad" or a backend's own),
    `output_grad` (the `OutputGradMeter` of an output-gradient signal, else None), `meter` (its `FidelityMeter`),
    `impact` (its `gnmr_hf.impact.ImpactMeter`: what its cheap path costs the loss, for `policy="impact"`; a backend
    offers it where it holds the cheap and the exact output, `measures_impact` says whether it does), `closed`.
    The names it had before its meter (`sample_rows`, `report_fidelity`, ...) still work, with a DeprecationWarning
    (`gnmr_hf.deprecated.RenamedUnitNames`).
    """

    closed = False
    _recovering = False
    # What this kind's loss measures and against what bound, in words (docs/method.md, "The cause policy"); the loss
    # itself is reported where the backend touches the data, through `self.meter`. None: this kind reports nothing.
    fidelity_bound: str | None = None
    # Whether this kind offers its impact (what its cheap path costs the loss) to `self.impact` when it is due.
    measures_impact: bool = False

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext) -> None:
        owner = unit_of(module)
        if owner is not None:
            raise ValueError(
                f"{ctx.backend} unit {name!r}: the module already belongs to another unit ({owner!r}); close() the "
                "old units first"
            )
        self.name = name
        self.module = module
        self.backend = ctx.backend
        self.options = ctx.options
        self.ledger = ctx.ledger
        self.tuner = ctx.tuner(module)
        self.meter = FidelityMeter(self, reads_input=type(self).input_fidelity is not RecoverableUnit.input_fidelity)
        self.impact = ImpactMeter(self)
        signal = self.find_signal(ctx)
        self.signal = signal.kind
        self._signal_tensors = list(signal.tensors)
        self.output_grad = OutputGradMeter(module) if signal.kind == "output_grad" else None
        module.__dict__[_OWNER_ATTR] = weakref.ref(self)

    def find_signal(self, ctx: DispatchContext) -> Signal:
        """What this unit is scored on: by default the `signal` option over its peft adapters, its weight or its
        output gradient (`gnmr_hf.signals.resolve_signal`). A backend with another signal overrides this."""
        choice = getattr(ctx.options, "signal", "auto")
        return resolve_signal(choice, self.name, self.module, self.tuner, ctx.backend)

    # ------------------------------------------------------------------ what a backend fills in
    def _enter(self) -> int:
        """Build what the recovery path needs; return the bytes it holds (nothing to build: 0)."""
        return 0

    def _exit(self) -> None:
        """Drop what `_enter` built."""

    def _close(self) -> None:
        """Undo what `__init__` installed on the module besides the owner mark and the meters."""

    def recovery_bytes(self) -> int:
        """Extra bytes the recovery path holds while this unit is in recovery (an upper bound where it varies)."""
        return 0

    @property
    def kind(self) -> str:
        """What kind of unit this is, for a policy that relates units (the cause policy compares a unit with the
        same kind in other layers) and for messages: by default its class name; a backend with several kinds of
        unit names each (act_quant: "linear", "attention", ...)."""
        return type(self).__name__

    def precision(self) -> str:
        """What the two paths run in, "cheap/recovery" (e.g. "4/8" bits, "e2m1/e4m3"): for the trace header and
        `gnmr-hf advise`. By default the `bits` or `formats` the backend describes, else "low/high"."""
        facts = self.describe()
        return str(facts.get("bits", facts.get("formats", "low/high")))

    def describe(self) -> dict[str, Any]:
        """JSON-safe facts worth recording (signal kind, weight source, bit widths...), the same keys for every unit
        of a backend: the callback logs their counts at train begin and writes them to the trace header."""
        return {"signal": self.signal}

    # ------------------------------------------------------------------ what a backend measures
    def input_fidelity(self, x: torch.Tensor) -> Any:
        """What the cheap path loses on the input `x` of a forward (a part for `FidelityMeter.report`: operand stats
        or a 0-d loss), for a backend whose cheap path quantizes the input in a kernel we cannot open (bitsandbytes,
        torchao): measured by emulating that rounding, on both paths, from the meter's forward pre-hook. None (the
        default): the backend reports from its own code, or nothing."""
        return None

    def meter_state(self) -> dict[str, Any] | None:
        """What this unit's measuring carries from one step to the next and a resume must restore (JSON-safe: the
        callback writes it into the checkpoint with the controller's state), or None: nothing (the default). May
        sync with the device: it is read when a checkpoint is written."""
        return None

    def load_meter_state(self, state: dict[str, Any]) -> None:
        """Restore what `meter_state` returned."""
        raise ValueError(f"{self.backend} unit {self.name!r} keeps no meter state, got {state!r}")

    # ------------------------------------------------------------------ the contract
    @property
    def in_recovery(self) -> bool:
        return self._recovering

    def signal_tensors(self) -> list[torch.Tensor]:
        """Tensors whose `.grad` is this unit's signal; empty when it uses an `OutputGradMeter`."""
        return list(self._signal_tensors)

    def enter_recovery(self) -> None:
        if self.closed:
            raise RuntimeError(f"{self.backend} unit {self.name!r} is closed; find the units again to use it")
        if self._recovering:
            return
        nbytes = self._enter()
        self._recovering = True
        self.ledger.hold(self, nbytes)

    def exit_recovery(self) -> None:
        if not self._recovering:
            return
        self._recovering = False
        self._exit()
        self.ledger.release(self)

    def close(self) -> None:
        """Leave recovery and remove everything the unit installed; the module is as it was found. Idempotent."""
        if self.closed:
            return
        self.exit_recovery()
        self.meter.stop()
        self.impact.stop()
        if self.output_grad is not None:
            self.output_grad.remove()
            self.output_grad = None
        self._close()
        if unit_of(self.module) is self:
            del self.module.__dict__[_OWNER_ATTR]
        self.closed = True

    def __repr__(self) -> str:
        state = "closed" if self.closed else "recovery" if self._recovering else "low-cost"
        return f"{type(self).__name__}(name={getattr(self, 'name', '?')!r}, {state})"


class SwitchedUnit(RecoverableUnit, ABC):
    """A unit whose module's forward switches between the cheap path and `recovery_forward` on a flag.

    A flip is a flag checked in `forward`, as peft's `disable_adapters` is, not module surgery: the unit puts one
    instance-level `forward` on its module and `close()` deletes it. Under torch.compile the switch is excluded from
    tracing (`torch.compiler.disable(recursive=False)`), so no flip recompiles: each unit is a graph break, the cheap
    path compiles as a frame of its own and the recovery path runs eagerly (docs/backends.md has the cost).
    """

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext) -> None:
        super().__init__(name, module, ctx)
        self._previous_forward = module.__dict__.get("forward")
        self._install_forward(module.forward)

    def cheap_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The low-cost path; by default the module's own forward, as it was when the unit was made."""
        return self._module_forward(*args, **kwargs)

    @abstractmethod
    def recovery_forward(self, *args: Any, **kwargs: Any) -> Any:
        """The high-fidelity path, with the module forward's signature."""

    def _install_forward(self, module_forward: Callable[..., Any]) -> None:
        self._module_forward = module_forward
        recovery = torch.compiler.disable(self.recovery_forward)
        # Call the module's own forward directly unless the backend has its own cheap path: under compile each
        # callable is a frame with its own guards, and the module's forward is guarded per module class.
        overridden = type(self).cheap_forward is not SwitchedUnit.cheap_forward
        cheap = self.cheap_forward if overridden else module_forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            if self._recovering:
                return recovery(*args, **kwargs)
            return cheap(*args, **kwargs)

        self._forward = torch.compiler.disable(forward, recursive=False)
        self.module.forward = self._forward

    def _close(self) -> None:
        if self.module.__dict__.get("forward") is self._forward:
            if self._previous_forward is None:
                del self.module.forward
            else:
                self.module.forward = self._previous_forward
        else:
            # Someone wrapped forward after us; removing ours would drop theirs. Ours stays, inert (cheap path).
            logger.warning(
                "%s unit %r: forward was re-wrapped by someone else; left in place", self.backend, self.name
            )


@dataclass(frozen=True)
class Backend(Generic[OptionsT]):
    """A kind of recoverable unit, declared once; a module of `gnmr_hf/backends/` lists its own in `BACKENDS`, an
    outside one is passed to `gnmr_hf.register_backend`.

    Attributes:
        name: what `find_units(model, name)` and `GNMRConfig(backend=name)` call it.
        unit_for: `fn(module, ctx) -> unit class or None`: which `RecoverableUnit` subclass manages `module`.
            The generic code builds it as `cls(display_name, module, ctx)`.
        options: the `BackendOptions` dataclass of the options it accepts.
        requires: the optional library it needs (an import name); without it no module matches.
        hint: what to tell a user whose model has no such module (how to get one, or which backend fits).
    """

    name: str
    unit_for: Callable[[nn.Module, DispatchContext[OptionsT]], type[RecoverableUnit] | None]
    options: type[OptionsT] = BackendOptions  # type: ignore[assignment]
    requires: str | None = None
    hint: str = ""

    def parse_options(self, options: Mapping[str, Any] | str | BackendOptions | None) -> OptionsT:
        """The options as an instance of `self.options`; errors name this backend and the option."""
        if isinstance(options, self.options):
            return options
        if isinstance(options, BackendOptions):
            raise TypeError(f"{self.name} options must be {self.options.__name__}, got {type(options).__name__}")
        try:
            return self.options.parse(options)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{self.name} {err}") from None


class UnitSet(Sequence[RecoverableUnit]):
    """The units one `find_units` call made, in controller order, and their owner: `ledger`, `names`, `close()`."""

    def __init__(self, units: Iterable[RecoverableUnit], backend: Backend, ledger: RecoveryLedger) -> None:
        self._units = list(units)
        self.backend = backend
        self.ledger = ledger

    @property
    def names(self) -> list[str]:
        return [u.name for u in self._units]

    def close(self) -> None:
        """Close every unit (idempotent): each module is as it was found."""
        for unit in self._units:
            unit.close()

    @overload
    def __getitem__(self, i: int) -> RecoverableUnit: ...
    @overload
    def __getitem__(self, i: slice) -> list[RecoverableUnit]: ...
    def __getitem__(self, i: int | slice) -> RecoverableUnit | list[RecoverableUnit]:
        return self._units[i]

    def __len__(self) -> int:
        return len(self._units)

    def __iter__(self) -> Iterator[RecoverableUnit]:
        return iter(self._units)

    def __repr__(self) -> str:
        return f"UnitSet({self.backend.name!r}, {len(self)} units, {self.ledger!r})"


def unit_of(module: nn.Module) -> RecoverableUnit | None:
    """The open unit that manages `module`, or None."""
    ref = module.__dict__.get(_OWNER_ATTR)
    unit = ref() if ref is not None else None
    return unit if unit is not None and not unit.closed else None


def close_units(model: nn.Module) -> int:
    """Close every open unit on `model`'s modules and return how many: a run interrupted by an exception or
    Ctrl-C leaves its units on the model (forward wrappers, hooks, recovery weights); a retry starts clean."""
    stale = [u for u in (unit_of(m) for m in unwrap_model(model).modules()) if u is not None]
    for unit in stale:
        unit.close()
    return len(stale)


def not_plain_linear(module: nn.Linear) -> str | None:
    """What `module` is, when it is an `nn.Linear` that a unit computing `F.linear(x, module.weight, module.bias)`
    in its place must not take: a subclass with a forward of its own (bitsandbytes' `Linear8bitLt`/`Linear4bit`,
    torchao's `Float8Linear`) or a weight that is not floating point (int8 or packed 4-bit storage). None for a
    plain one. Such a layer fails at the first forward with a dtype or shape error far from its cause, or silently
    loses its own path, so the backends that replace a linear's forward refuse it while the units are built."""
    cls = type(module)
    if cls.forward is nn.Linear.forward and module.weight.is_floating_point():
        return None
    return f"{cls.__module__}.{cls.__qualname__} (weight {module.weight.dtype})"


def display_name(fqn: str) -> str:
    """The name users know a module by, whatever wraps it: without peft's `base_model.model.` prefix and
    `.base_layer`, and without the components DDP (`module.`), torch.compile (`_orig_mod.`) and FSDP insert."""
    parts = [p for p in fqn.split(".") if p not in _WRAPPER_COMPONENTS and p != "base_layer"]
    if parts[:2] == ["base_model", "model"]:
        parts = parts[2:]
    return ".".join(parts)


def unwrap_model(model: nn.Module) -> nn.Module:
    """The model inside DDP / DataParallel / torch.compile / DeepSpeed containers (accelerate's own unwrapping)."""
    from accelerate.utils import extract_model_from_parallel

    return extract_model_from_parallel(model, keep_fp32_wrapper=True, keep_torch_compile=False)


def apply_decision(units: Sequence[RecoverableUnit], exited: Iterable[int], entered: Iterable[int]) -> None:
    """Apply a decision: the `exited` units leave recovery first, then the `entered` ones enter, so the number of
    units holding a recovery path never exceeds the budget, not even halfway through a step that swaps units."""
    for i in exited:
        units[i].exit_recovery()
    for i in entered:
        units[i].enter_recovery()
