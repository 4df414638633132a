"""Which backends exist, and `find_units`: the one generic walk that turns a model into units.

The built-in backends are listed in `gnmr_hf.backends.builtin_backends` (each module there declares its own in
`BACKENDS`) and imported the first time a backend is looked up, never by `import gnmr_hf`. Their optional libraries
(bitsandbytes, torchao) are imported only when a unit is matched. Adding a built-in backend is one new module there
and one line in that list; an outside one is a `register_backend(Backend(...))` call. The registry is the generic one
of `gnmr_hf.registry_base`, as the policies' is.
"""

from __future__ import annotations

import importlib.util
import logging
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from functools import cache
from typing import Any

from torch import nn

from .options import BackendOptions
from .registry_base import Registry
from .signals import tuner_layers
from .units import Backend, DispatchContext, RecoverableUnit, RecoveryLedger, UnitSet, display_name, unwrap_model

__all__ = ["find_units", "get_backend", "known_backends", "register_backend"]

logger = logging.getLogger("gnmr_hf")

# How many unit names a message lists before it gives only their count.
_SHOWN = 5


def _builtin_backends() -> tuple[Backend, ...]:
    from .backends import builtin_backends

    return builtin_backends()


# Backend names: the built-ins first, in their modules' order, then the registered ones; an unknown name's error lists
# them without a guess (the command line and the docs quote that message as it is).
_BACKENDS: Registry[Backend] = Registry(
    "backend", "backends", _builtin_backends, lambda backend: backend.name, suggest=False, sort_names=False
)
# The registered backends by name (a test that registers one removes it here).
_REGISTERED = _BACKENDS.registered


@cache
def _available(requirement: str) -> bool:
    return importlib.util.find_spec(requirement) is not None


def register_backend(backend: Backend) -> Backend:
    """Make `find_units(model, backend.name)` and `GNMRConfig(backend=backend.name)` use `backend`."""
    if not isinstance(backend, Backend):
        raise TypeError(f"register_backend: backend must be a gnmr_hf.Backend, got {type(backend).__name__}")
    if not isinstance(backend.name, str) or not backend.name:
        raise ValueError(f"register_backend: Backend.name must be a non-empty string, got {backend.name!r}")
    if not callable(backend.unit_for):
        raise TypeError(f"register_backend: Backend.unit_for must be callable, got {backend.unit_for!r}")
    options = backend.options
    if not (isinstance(options, type) and issubclass(options, BackendOptions)):
        raise TypeError(f"register_backend: Backend.options must be a BackendOptions dataclass, got {options!r}")
    return _BACKENDS.register(backend)


def known_backends() -> tuple[str, ...]:
    """The backend names `find_units` accepts now: the built-in ones, then those registered."""
    return tuple(_BACKENDS.names())


def get_backend(name: str) -> Backend:
    """The `Backend` called `name`; an unknown name is a `ValueError` listing the known ones."""
    return _BACKENDS.get(name)


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
    backend: str | Backend = "bnb_int8",
    *,
    include: Iterable[str] | str | None = None,
    exclude: Iterable[str] | str | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
    backend_options: Mapping[str, Any] | str | BackendOptions | None = None,
    **options: Any,
) -> UnitSet:
    """Find the recoverable units of `model`, in `named_modules()` order (the controller's unit index).

    Args:
        backend: a backend's name ("bnb_int8", ... or one given to `register_backend`) or the `Backend` itself.
        include / exclude: regexes searched in the unit's name (`display_name`, e.g.
            ``model.layers.0.self_attn.q_proj``); a unit must match some include and no exclude. A pattern with no
            effect (an include that selects no unit, an exclude that matches no module include lets through) is
            logged as a warning that names it.
        module_filter_fn: `fn(module, fqn) -> bool` on the raw module and its full name, as in torchao.
        backend_options / **options: the backend's options, as one value (a dict, JSON or ``key=value,...``
            text, or a parsed instance) or as keywords; not both.

    Returns:
        A `UnitSet`: the units, their shared `ledger`, their `names`, and `close()`.

    Raises:
        ValueError: when no module matches (listing the module types the model has, the backend's hint, and with
            include the first unit names its patterns are searched in),
            when two units would share a name, or when an option is invalid. A failure leaves the model as found.
    """
    spec = get_backend(backend) if isinstance(backend, str) else backend
    if backend_options is not None and options:
        raise ValueError("find_units: pass the backend's options either as keywords or as backend_options, not both")
    parsed = spec.parse_options(backend_options if backend_options is not None else options)
    inc, exc = _compile(include, "include"), _compile(exclude, "exclude")
    model = unwrap_model(model)
    ledger = RecoveryLedger()
    units: list[RecoverableUnit] = []
    # The patterns that took part: an include that selected a unit, an exclude that kept a module out. One that did
    # neither is most likely a typo, and a filter that silently does nothing is how a carve-out gets lost.
    included: set[int] = set()
    excluded: set[int] = set()
    ctx: DispatchContext | None = None
    if spec.requires is None or _available(spec.requires):
        ctx = DispatchContext(model, spec.name, parsed, ledger, tuner_layers(model))
        try:
            for fqn, module in model.named_modules():
                name = display_name(fqn)
                matched = [i for i, p in enumerate(inc) if p.search(name)] if inc is not None else []
                if inc is not None and not matched:
                    continue
                if exc is not None:
                    hits = [i for i, p in enumerate(exc) if p.search(name)]
                    excluded.update(hits)
                    if hits:
                        continue
                if module_filter_fn is not None and not module_filter_fn(module, fqn):
                    continue
                unit_cls = spec.unit_for(module, ctx)
                if unit_cls is not None:
                    units.append(unit_cls(name, module, ctx))
                    included.update(matched)
            duplicates = sorted(n for n, c in Counter(u.name for u in units).items() if c > 1)
            if duplicates:
                raise ValueError(f"find_units: several units share the names {duplicates}; unit names must be unique")
        except BaseException:
            # Units already made may have wrapped their module's forward or put hooks on it: undo that, so that a
            # failed call leaves the model as it was and a corrected retry works.
            for unit in units:
                unit.close()
            raise
    if not units:
        candidates = _candidate_names(model, spec, ctx) if inc is not None and ctx is not None else []
        raise ValueError(_no_units_message(model, spec, include, exclude, module_filter_fn, candidates))
    for kind, patterns, used in (("include", inc, included), ("exclude", exc, excluded)):
        for i, pattern in enumerate(patterns or ()):
            if i not in used:
                logger.warning(
                    "find_units: %s pattern %r %s, so it has no effect (is it a typo?); unit names look like %r",
                    kind,
                    pattern.pattern,
                    "matches no unit" if kind == "include" else "matches no module that include lets through",
                    units[0].name,
                )
    return UnitSet(units, spec, ledger)


def _candidate_names(model: nn.Module, spec: Backend, ctx: DispatchContext) -> list[str]:
    """The names of the modules `spec` would make units of, with no filter: what include's patterns are matched
    against. For a message only: a module the backend refuses (a quantized layer for `act_quant`) is left out."""
    names = []
    for fqn, module in model.named_modules():
        try:
            if spec.unit_for(module, ctx) is not None:
                names.append(display_name(fqn))
        except Exception:  # the backend's refusal of one module is not this message's subject
            continue
    return names


def _no_units_message(
    model: nn.Module, spec: Backend, include: Any, exclude: Any, module_filter_fn: Any, candidates: list[str]
) -> str:
    seen = Counter(type(m).__module__ + "." + type(m).__name__ for _, m in model.named_modules())
    listing = ", ".join(f"{name} x{count}" for name, count in sorted(seen.items()))
    filters = [f"include={include!r}"] if include is not None else []
    filters += [f"exclude={exclude!r}"] if exclude is not None else []
    filters += ["module_filter_fn"] if module_filter_fn is not None else []
    missing = spec.requires is not None and not _available(spec.requires)
    shown = ", ".join(repr(n) for n in candidates[:_SHOWN]) + (", ..." if len(candidates) > _SHOWN else "")
    return (
        f"find_units: no module of the model is a {spec.name!r} unit"
        + (f" after filtering with {', '.join(filters)}" if filters else "")
        + (f" ({spec.requires} is not installed)" if missing else "")
        + (
            f". include's patterns are searched in the unit names, and without filters this model has "
            f"{len(candidates)} {spec.name!r} units: {shown}"
            if candidates
            else ""
        )
        + f". Module types seen: {listing}."
        + (f" {spec.hint}" if spec.hint else "")
        + f" Known backends: {list(known_backends())}."
    )
