"""Recoverable units: one module with a cheap path and a high-fidelity (recovery) path, and how to find them.

A unit is what the controller's index i refers to. It knows its name, the tensors whose gradient is its signal,
how to switch its module to the recovery path and back, and what the recovery path costs in bytes, so that the
controller's `max_active` is also a memory budget that can be stated and measured.

Units are found the way peft finds layers to wrap: each backend offers a `dispatch_<backend>(module, fqn, ctx)`
that returns a unit or None; `find_units` walks the model once and asks the backend's dispatchers in order.
A backend of your own is one `register_backend(name, dispatcher)` call.
"""

from __future__ import annotations

import importlib
import re
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "DispatchContext",
    "OutputGradMeter",
    "RecoverableUnit",
    "find_units",
    "register_backend",
]

# Built-in backends are imported only when asked for, so that `import gnmr_hf` never imports bitsandbytes.
_BUILTIN_BACKENDS: dict[str, str] = {"bnb_int8": "gnmr_hf.backends.bnb_int8:dispatch_bnb_int8"}
_CUSTOM_BACKENDS: dict[str, list[Dispatcher]] = {}


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


class RecoverableUnit(ABC):
    """One module with a low-cost path and a recovery path. Subclasses implement one backend.

    Contract: `enter_recovery()` / `exit_recovery()` are idempotent, cheap, reversible, create no
    `nn.Parameter` and never touch the optimizer; the module's low-cost weights are never modified.
    """

    def __init__(self, name: str, module: nn.Module) -> None:
        self.name = name
        self.module = module
        self.output_grad: OutputGradMeter | None = None

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
        """Extra bytes the recovery path holds while this unit is in recovery."""

    def close(self) -> None:
        """Leave recovery and remove any hook the unit installed; the module is as it was found."""
        self.exit_recovery()
        if self.output_grad is not None:
            self.output_grad.remove()
            self.output_grad = None

    def __repr__(self) -> str:
        state = "recovery" if self.in_recovery else "low-cost"
        return f"{type(self).__name__}(name={self.name!r}, {state})"


@dataclass
class DispatchContext:
    """What a dispatcher may need besides the module: the whole model and the backend's options."""

    model: nn.Module
    options: dict[str, Any] = field(default_factory=dict)


Dispatcher = Callable[[nn.Module, str, DispatchContext], "RecoverableUnit | None"]


def register_backend(name: str, dispatcher: Dispatcher | Sequence[Dispatcher]) -> None:
    """Make `find_units(model, name)` use `dispatcher(module, fqn, ctx) -> RecoverableUnit | None`."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"register_backend: name must be a non-empty string, got {name!r}")
    if name in _BUILTIN_BACKENDS:
        raise ValueError(f"register_backend: {name!r} is a built-in backend and cannot be replaced")
    dispatchers = [dispatcher] if callable(dispatcher) else list(dispatcher)
    if not dispatchers or not all(callable(d) for d in dispatchers):
        raise TypeError("register_backend: dispatcher must be a callable or a non-empty sequence of callables")
    _CUSTOM_BACKENDS[name] = dispatchers


def known_backends() -> tuple[str, ...]:
    """The backend names `find_units` accepts now: the built-in ones, then those registered."""
    return (*_BUILTIN_BACKENDS, *sorted(set(_CUSTOM_BACKENDS) - set(_BUILTIN_BACKENDS)))


def _dispatchers(backend: str) -> list[Dispatcher]:
    if backend in _CUSTOM_BACKENDS:
        return _CUSTOM_BACKENDS[backend]
    if backend in _BUILTIN_BACKENDS:
        module_name, attr = _BUILTIN_BACKENDS[backend].split(":")
        return [getattr(importlib.import_module(module_name), attr)]
    raise ValueError(f"find_units: unknown backend {backend!r}; known backends are {list(known_backends())}")


def display_name(fqn: str) -> str:
    """The name users know a module by: without peft's `base_model.model.` prefix and `.base_layer` suffix."""
    name = fqn.removeprefix("base_model.model.")
    return name.removesuffix(".base_layer")


def _compile(patterns: Iterable[str] | None, what: str) -> list[re.Pattern[str]] | None:
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
        backend: which dispatchers to ask ("bnb_int8", or a name given to `register_backend`).
        include / exclude: regexes searched in the unit's display name (peft prefixes and `.base_layer`
            removed, e.g. ``model.layers.0.self_attn.q_proj``); a unit must match some include and no exclude.
        module_filter_fn: `fn(module, fqn) -> bool` on the raw module and its full name, as in torchao.
        options: passed to the dispatchers (e.g. `source=` and `signal=` for bnb_int8).

    Raises:
        ValueError: when no module matches, listing the module types the model has.
    """
    dispatchers = _dispatchers(backend)
    inc, exc = _compile(include, "include"), _compile(exclude, "exclude")
    ctx = DispatchContext(model=model, options=dict(options))
    units: list[RecoverableUnit] = []
    for fqn, module in model.named_modules():
        name = display_name(fqn)
        if inc is not None and not any(p.search(name) for p in inc):
            continue
        if exc is not None and any(p.search(name) for p in exc):
            continue
        if module_filter_fn is not None and not module_filter_fn(module, fqn):
            continue
        for dispatch in dispatchers:
            unit = dispatch(module, fqn, ctx)
            if unit is not None:
                units.append(unit)
                break
    if not units:
        seen = Counter(type(m).__module__ + "." + type(m).__name__ for _, m in model.named_modules())
        listing = ", ".join(f"{name} x{count}" for name, count in sorted(seen.items()))
        filters = []
        if include is not None:
            filters.append(f"include={include!r}")
        if exclude is not None:
            filters.append(f"exclude={exclude!r}")
        if module_filter_fn is not None:
            filters.append("module_filter_fn")
        raise ValueError(
            f"find_units: no module of the model is a {backend!r} unit"
            + (f" after filtering with {', '.join(filters)}" if filters else "")
            + f". Module types seen: {listing}"
        )
    names = [u.name for u in units]
    duplicates = sorted(n for n, c in Counter(names).items() if c > 1)
    if duplicates:
        raise ValueError(f"find_units: several units share the names {duplicates}; unit names must be unique")
    return units
