"""Recoverable units: one module with a cheap path and a high-fidelity (recovery) path, and how to find them.

A unit is what the controller's index i refers to. It knows its name, the tensors whose gradient is its signal,
how to switch its module to the recovery path and back, and what the recovery path holds in bytes, so that the
controller's `max_active` is also a memory budget that can be stated and measured.

Units are found the way peft finds layers to wrap: a backend offers `dispatch_<backend>(module, fqn, ctx)`
functions that return a unit or None; `find_units` walks the model once and asks the backend's dispatchers in
order. What every backend needs is here, written once:

- `Backend`: a name, its dispatchers, its options (a dataclass the backend declares and validates, so the
  config and the callback pass options through without knowing them), and a hint for when nothing matches.
  `register_backend` adds one from outside the package.
- `DispatchContext`: the model, the backend's parsed options, the `RecoveryLedger` every unit of one
  `find_units` call shares, and a `shared` dict for anything else a backend computes once per call.
- `RecoveryLedger`: the bytes held by units in recovery now, and their peak. Not every backend has a fixed
  cost per unit (saved activations grow with batch x sequence), so a unit reports what it holds when it holds it.
- `find_units` itself: filters, unwrapping (DDP, torch.compile, FSDP wrappers), names that do not depend on
  wrappers, and the undo of half-made units when a dispatcher fails.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import logging
import re
import types
import typing
import weakref
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

__all__ = [
    "Backend",
    "BackendOptions",
    "DispatchContext",
    "OutputGradMeter",
    "RecoverableUnit",
    "RecoveryLedger",
    "apply_decision",
    "display_name",
    "find_units",
    "get_backend",
    "register_backend",
]

logger = logging.getLogger("gnmr_hf")

# Built-in backends are imported only when asked for, so that `import gnmr_hf` never imports bitsandbytes.
_BUILTIN_BACKENDS: dict[str, str] = {
    "bnb_int8": "gnmr_hf.backends.bnb:BNB_INT8",
    "bnb_4bit": "gnmr_hf.backends.bnb:BNB_4BIT",
    "torchao_float8": "gnmr_hf.backends.torchao:TORCHAO_FLOAT8",
    "act_quant": "gnmr_hf.backends.act_quant:ACT_QUANT",
    "block_fp": "gnmr_hf.backends.block_fp:BLOCK_FP",
}
_CUSTOM_BACKENDS: dict[str, Backend] = {}
# Every unit `find_units` made and nobody closed yet, so that a run interrupted before it could close its units
# (an exception, Ctrl-C) can be cleaned up by the next one: see `close_live_units`.
_LIVE_UNITS: weakref.WeakSet[RecoverableUnit] = weakref.WeakSet()

# Path components that wrappers insert into `named_modules()` names: DDP/DataParallel (`module`), torch.compile
# (`_orig_mod`), FSDP1 (`_fsdp_wrapped_module`), activation-checkpoint wrappers and peft (`base_model.model`,
# `base_layer`). A unit's name is its module's path without them, so it is the same however the model is
# wrapped, and it is the name users know (`model.layers.0.self_attn.q_proj`).
_WRAPPER_COMPONENTS = frozenset({"module", "_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"})


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


class RecoveryLedger:
    """Bytes held by the recovery paths of a group of units (those of one `find_units` call).

    A unit calls `hold(unit, nbytes)` when it enters recovery or when what it holds changes (a saved-activation
    unit's bytes depend on the batch), and `release(unit)` when it leaves. `live_bytes` is what the units hold
    now, `peak_bytes` its maximum since creation or `reset_peak()`, `live_units` how many hold anything. It
    counts what the units hold, not what the allocator reports, so it is exact and free to read on any device.
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


class RecoverableUnit(ABC):
    """One module with a low-cost path and a recovery path. Subclasses implement one backend.

    Contract: `enter_recovery()` / `exit_recovery()` are idempotent, cheap, reversible, create no
    `nn.Parameter` and never touch the optimizer; the module's low-cost weights are never modified.
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        self.output_grad: OutputGradMeter | None = None
        self.closed = False

    @property
    @abstractmethod
    def in_recovery(self) -> bool: ...

    @abstractmethod
    def signal_tensors(self) -> list[torch.Tensor]:
        """Tensors whose `.grad` is this unit's signal. Empty when the unit uses an `OutputGradMeter`."""

    @abstractmethod
    def enter_recovery(self) -> None: ...

    @abstractmethod
    def exit_recovery(self) -> None: ...

    @abstractmethod
    def recovery_bytes(self) -> int:
        """Extra bytes the recovery path holds while this unit is in recovery (an upper bound where it varies)."""

    def describe(self) -> dict[str, Any]:
        """JSON-safe facts about this unit worth recording (its signal kind, where its recovery weight comes from,
        its bit widths...). The callback logs their counts per value at train begin and writes them to the trace
        header. Keys should be the same for every unit of a backend."""
        return {"signal": "output_grad" if self.output_grad is not None else "tensors"}

    def close(self) -> None:
        """Leave recovery and remove any hook the unit installed; the module is as it was found. Idempotent;
        subclasses that override it call `super().close()`."""
        self.exit_recovery()
        if self.output_grad is not None:
            self.output_grad.remove()
            self.output_grad = None
        self.closed = True
        _LIVE_UNITS.discard(self)

    def __repr__(self) -> str:
        state = "recovery" if self.in_recovery else "low-cost"
        return f"{type(self).__name__}(name={self.name!r}, {state})"


# ---------------------------------------------------------------------------------------------------- options


@dataclass
class BackendOptions:
    """Base class of a backend's options: a dataclass whose fields are the options, validated in
    `__post_init__` with errors that name the option (`self.check_choice(...)` helps).

    Options arrive as keyword arguments of `find_units`, as the dict `GNMRConfig.backend_options`, or from the
    command line as a JSON object or ``key=value,key=value`` text; `parse` turns any of these into an instance,
    converting text to the field types (int, float, bool, str, their Optional forms, and lists of them).
    """

    backend: ClassVar[str] = ""

    def check_choice(self, name: str, allowed: Sequence[Any]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(f"{self.backend} option {name!r} must be one of {list(allowed)}, got {value!r}")

    def check_int(self, name: str, minimum: int, maximum: int | None = None) -> None:
        value = getattr(self, name)
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{self.backend} option {name!r} must be an int {bounds}, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"{self.backend} option {name!r} must be an int {bounds}, got {value}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, options: Mapping[str, Any] | str | None) -> BackendOptions:
        """An instance from a mapping, a JSON object string, ``key=value,...`` text, or None (the defaults)."""
        data = parse_options_text(options, what=f"{cls.backend or cls.__name__} options")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(
                f"{cls.backend or cls.__name__} backend: unknown options {unknown}; known options are {sorted(known)}"
            )
        hints = typing.get_type_hints(cls)
        values = {name: _coerce(value, hints[name], cls.backend, name) for name, value in data.items()}
        return cls(**values)


def parse_options_text(options: Mapping[str, Any] | str | None, what: str) -> dict[str, Any]:
    """A dict from a mapping, a JSON object string, ``key=value,key=value`` text, or None."""
    if options is None:
        return {}
    if isinstance(options, Mapping):
        return dict(options)
    if not isinstance(options, str):
        raise TypeError(f"{what} must be a dict, a JSON object or 'key=value,...' text, got {type(options).__name__}")
    text = options.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{what}: {text!r} is not a valid JSON object: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{what}: {text!r} is not a JSON object")
        return data
    data = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: {item!r} in {text!r} is not 'key=value' (separate several with commas)")
        data[key.strip()] = value.strip()
    return data


def _coerce(value: Any, hint: Any, backend: str, name: str) -> Any:
    """Text from the command line to the option's type; other values pass through (validation is the class's)."""
    if not isinstance(value, str):
        return value
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], backend, name) if len(inner) == 1 else value
    if origin in (list, tuple) and args:
        return [_coerce(v, args[0], backend, name) for v in value.split(";") if v]
    try:
        if hint is bool:
            lowered = value.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return lowered in ("true", "1", "yes")
        if hint in (int, float):
            return hint(value)
    except ValueError:
        raise ValueError(f"{backend} option {name!r} must be {hint.__name__}, got {value!r}") from None
    return value


# --------------------------------------------------------------------------------------------------- backends


@dataclass
class DispatchContext:
    """What a dispatcher may need besides the module, for one `find_units` call.

    Attributes:
        model: the (unwrapped) model being searched.
        options: the backend's parsed options (an instance of its `BackendOptions` subclass).
        ledger: the `RecoveryLedger` every unit of this call shares.
        shared: anything else a backend computes once per call (a checkpoint handle, a map of peft layers...).
    """

    model: nn.Module
    options: BackendOptions = field(default_factory=BackendOptions)
    ledger: RecoveryLedger = field(default_factory=RecoveryLedger)
    shared: dict[str, Any] = field(default_factory=dict)


Dispatcher = Callable[[nn.Module, str, DispatchContext], "RecoverableUnit | None"]


@dataclass(frozen=True)
class Backend:
    """A kind of recoverable unit: how to find its modules and which options it takes.

    Attributes:
        name: what `find_units(model, name)` and `GNMRConfig(backend=name)` call it.
        dispatchers: `fn(module, fqn, ctx) -> RecoverableUnit | None`, asked in order for every module.
        options: the backend's `BackendOptions` subclass (its fields are the options it accepts).
        hint: what to tell a user whose model has no module of this kind (how to load one, or which backend fits).
    """

    name: str
    dispatchers: tuple[Dispatcher, ...]
    options: type[BackendOptions] = BackendOptions
    hint: str = ""

    def parse_options(self, options: Mapping[str, Any] | str | None) -> BackendOptions:
        return self.options.parse(options)


def register_backend(
    name: str,
    dispatcher: Dispatcher | Sequence[Dispatcher],
    *,
    options: type[BackendOptions] = BackendOptions,
    hint: str = "",
) -> Backend:
    """Make `find_units(model, name, **options)` and `GNMRConfig(backend=name)` use these dispatchers.

    `options` is a `BackendOptions` dataclass subclass declaring the options the backend takes (none by default);
    they are validated when a `GNMRConfig` is made and when `find_units` runs, and can come from the command line
    (`--backend_options key=value,...`).
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_backend: name must be a non-empty string, got {name!r}")
    if name in _BUILTIN_BACKENDS:
        raise ValueError(f"register_backend: {name!r} is a built-in backend and cannot be replaced")
    dispatchers = (dispatcher,) if callable(dispatcher) else tuple(dispatcher)
    if not dispatchers or not all(callable(d) for d in dispatchers):
        raise TypeError("register_backend: dispatcher must be a callable or a non-empty sequence of callables")
    if not (isinstance(options, type) and issubclass(options, BackendOptions) and dataclasses.is_dataclass(options)):
        raise TypeError(f"register_backend: options must be a BackendOptions dataclass subclass, got {options!r}")
    backend = Backend(name, dispatchers, options, hint)
    _CUSTOM_BACKENDS[name] = backend
    return backend


def known_backends() -> tuple[str, ...]:
    """The backend names `find_units` accepts now: the built-in ones, then those registered."""
    return (*_BUILTIN_BACKENDS, *sorted(set(_CUSTOM_BACKENDS) - set(_BUILTIN_BACKENDS)))


def get_backend(name: str) -> Backend:
    """The `Backend` called `name` (built-in backends are imported on first use)."""
    if name in _CUSTOM_BACKENDS:
        return _CUSTOM_BACKENDS[name]
    if name in _BUILTIN_BACKENDS:
        module_name, attr = _BUILTIN_BACKENDS[name].split(":")
        return getattr(importlib.import_module(module_name), attr)
    raise ValueError(f"unknown backend {name!r}; known backends are {list(known_backends())}")


# ------------------------------------------------------------------------------------------------ find_units


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


def _compile(patterns: Iterable[str] | str | None, what: str) -> list[re.Pattern[str]] | None:
    if patterns is None:
        return None
    if isinstance(patterns, str):
        patterns = [patterns]
    try:
        return [re.compile(p) for p in patterns]
    except re.error as err:
        raise ValueError(f"find_units: invalid regex in {what}: {err}") from None


def find_units(
    model: nn.Module,
    backend: str = "bnb_int8",
    *,
    include: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    **options: Any,
) -> list[RecoverableUnit]:
    """Find the recoverable units of `model`, in `named_modules()` order (the controller's unit index).

    Args:
        backend: which backend ("bnb_int8", or a name given to `register_backend`).
        include / exclude: regexes searched in the unit's name (`display_name`: wrapper and peft components
            removed, e.g. ``model.layers.0.self_attn.q_proj``); a unit must match some include and no exclude.
        module_filter_fn: `fn(module, fqn) -> bool` on the raw module and its full name, as in torchao.
        options: the backend's options (e.g. `source=` and `signal=` for bnb_int8), or `backend_options=` with
            a dict or text as in `GNMRConfig.backend_options`.

    Raises:
        ValueError: when no module matches (listing the module types the model has, and the backend's hint),
            when two units would share a name, or when an option is invalid. A failure leaves the model as found.
    """
    spec = get_backend(backend) if isinstance(backend, str) else backend
    raw_options: Any = options
    if "backend_options" in options:
        if len(options) > 1:
            raise ValueError(
                "find_units: pass the backend's options either as keywords or as backend_options, not both"
            )
        raw_options = options["backend_options"]
    parsed = spec.parse_options(raw_options)
    inc, exc = _compile(include, "include"), _compile(exclude, "exclude")
    model = unwrap_model(model)
    ctx = DispatchContext(model=model, options=parsed)
    units: list[RecoverableUnit] = []
    try:
        for fqn, module in model.named_modules():
            name = display_name(fqn)
            if inc is not None and not any(p.search(name) for p in inc):
                continue
            if exc is not None and any(p.search(name) for p in exc):
                continue
            if module_filter_fn is not None and not module_filter_fn(module, fqn):
                continue
            for dispatch in spec.dispatchers:
                unit = dispatch(module, fqn, ctx)
                if unit is not None:
                    units.append(unit)
                    break
        if not units:
            raise ValueError(_no_units_message(model, spec, include, exclude, module_filter_fn))
        duplicates = sorted(n for n, c in Counter(u.name for u in units).items() if c > 1)
        if duplicates:
            raise ValueError(f"find_units: several units share the names {duplicates}; unit names must be unique")
    except BaseException:
        # Units already made may have wrapped their module's forward or put hooks on it: undo that, so that a
        # failed call leaves the model as it was and a corrected retry works.
        for unit in units:
            unit.close()
        raise
    _LIVE_UNITS.update(units)
    return units


def apply_decision(units: Sequence[RecoverableUnit], exited: Iterable[int], entered: Iterable[int]) -> None:
    """Apply a decision to the units: the `exited` ones leave recovery first, then the `entered` ones enter.

    In that order the number of units holding a recovery path never exceeds the budget, not even halfway through
    a step that swaps one unit for another, so `max_active` x the largest unit bounds the extra memory at every
    moment (entries first would briefly hold one unit more per swap).
    """
    for i in exited:
        units[i].exit_recovery()
    for i in entered:
        units[i].enter_recovery()


def close_live_units(model: nn.Module) -> int:
    """Close every unit that `find_units` made on `model`'s modules and that is still open; return how many.

    A training run closes its units when it ends; one interrupted by an exception or Ctrl-C leaves them on the
    model (forward wrappers, hooks, recovery weights). The Trainer callback calls this before it finds units, so
    that a retry starts from a clean model.
    """
    modules = {id(m) for m in unwrap_model(model).modules()}
    stale = [u for u in list(_LIVE_UNITS) if not u.closed and id(u.module) in modules]
    for unit in stale:
        unit.close()
    return len(stale)


def _no_units_message(
    model: nn.Module,
    spec: Backend,
    include: Any,
    exclude: Any,
    module_filter_fn: Any,
) -> str:
    seen = Counter(type(m).__module__ + "." + type(m).__name__ for _, m in model.named_modules())
    listing = ", ".join(f"{name} x{count}" for name, count in sorted(seen.items()))
    filters = []
    if include is not None:
        filters.append(f"include={include!r}")
    if exclude is not None:
        filters.append(f"exclude={exclude!r}")
    if module_filter_fn is not None:
        filters.append("module_filter_fn")
    return (
        f"find_units: no module of the model is a {spec.name!r} unit"
        + (f" after filtering with {', '.join(filters)}" if filters else "")
        + f". Module types seen: {listing}."
        + (f" {spec.hint}" if spec.hint else "")
        + f" Known backends: {list(known_backends())}."
    )
