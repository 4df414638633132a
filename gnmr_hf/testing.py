"""`check_backend`: the unit contract as one call, for a backend of your own.

    from gnmr_hf.testing import check_backend

    check_backend("bf16_cast")  # a registered name, or the `Backend` itself

It builds the backend's units on a tiny LLaMA (or on the models `make_model()` returns), flips them, trains on both
paths, measures, closes, and raises an `AssertionError` whose message starts with the promise broken
("close() must put the module back as it was found: model.layers.0.mlp.up_proj.forward still wrapped"). The
promises are those of `gnmr_hf.units.RecoverableUnit`; the built-in backends are held to the same call
(tests/test_contract.py). It checks what can be observed from outside a unit: what a unit holds in recovery is
counted from the tensors on the unit and its module, not from the allocator, so memory held elsewhere is not seen.
`import gnmr_hf` does not import this module.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as module_hooks

from .options import BackendOptions
from .registry import find_units, get_backend
from .units import Backend, RecoverableUnit, UnitSet, close_units, unit_of

__all__ = ["TINY_LLAMA", "check_backend", "tiny_llama"]

# The promises, as each message starts.
FOUND = "find_units must return the units it made, each with its name, ledger and signal"
ADDS_NOTHING = "a flip must add no Parameter or buffer"
OPTIMIZER = "a flip must leave the optimizer untouched"
WEIGHTS = "a flip must change no weight"
PATHS = "a forward and backward must work on both paths"
IDEMPOTENT = "enter_recovery() and exit_recovery() must be idempotent"
COUNTED = "what recovery holds must be counted in the unit's ledger"
BOUNDED = "what the ledger counts for a unit must be bounded by its recovery_bytes()"
DROPPED = "exit_recovery() must drop what recovery holds"
MEASURED = "a unit with a fidelity_bound must report a finite loss on both paths while measuring, one without none"
CLOSED = "a closed unit must refuse to enter"
AS_FOUND = "close() must put the module back as it was found"
ONE_OWNER = "a module must belong to one open unit, and close_units must close them all"

# A module's hooks: the attribute torch keeps them in, and what a message calls one.
_HOOKS = {
    "_forward_hooks": "forward hook",
    "_forward_pre_hooks": "forward pre-hook",
    "_backward_hooks": "backward hook",
    "_backward_pre_hooks": "backward pre-hook",
    "_state_dict_hooks": "state_dict hook",
}
_GLOBAL_HOOKS = (
    "_global_forward_hooks",
    "_global_forward_pre_hooks",
    "_global_backward_hooks",
    "_global_backward_pre_hooks",
)


# The tiny LLaMA every test and the demo build (`LlamaConfig` fields); the harness's `build_tiny_llama` uses it too.
TINY_LLAMA = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=128,
)


def tiny_llama(**overrides: Any) -> nn.Module:
    """A randomly initialised `LlamaForCausalLM` (`TINY_LLAMA`: 2 layers, hidden 64, vocabulary 256; seed 0; fp32),
    built from a config: no network, no files. `overrides` are `LlamaConfig` fields."""
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(**{**TINY_LLAMA, **overrides}))


def causal_lm_loss(model: nn.Module) -> torch.Tensor:
    """The language-model loss of `model` on 2 x 16 fixed random tokens (the default `loss` of `check_backend`)."""
    ids = torch.randint(0, model.config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    ids = ids.to(next(model.parameters()).device)
    return model(input_ids=ids, labels=ids).loss


def check_backend(
    backend: str | Backend,
    make_model: Callable[[], nn.Module] | None = None,
    *,
    backend_options: Mapping[str, Any] | str | BackendOptions | None = None,
    loss: Callable[[nn.Module], torch.Tensor] | None = None,
) -> None:
    """Check that `backend`'s units keep the unit contract; raise an `AssertionError` naming the first promise broken.

    Args:
        backend: a registered backend's name, or a `Backend` (registered or not).
        make_model: returns a new model with units of this backend at each call (called twice); default `tiny_llama`.
        backend_options: the options to find the units with (as `find_units` takes them).
        loss: `fn(model) -> 0-d loss` for one forward; default `causal_lm_loss`. Run with the RNG seeded, so that it
            must give the same value for the same weights (dropout included).

    The promises, in the order checked: `find_units` returns units that know their name, ledger and signal, and
    `describe()` / `precision()` are JSON-safe; a flip (every unit into recovery, a forward and backward, and back)
    adds no Parameter or buffer, leaves the optimizer's parameters and state alone and changes no weight; the
    forward and backward work on both paths; enter and exit are idempotent; what a unit holds in recovery (tensors
    on it and its module) is counted in its ledger, the ledger's count is at most `recovery_bytes()`, and exit drops
    it; under measuring (`policy="cause"`), a unit with a `fidelity_bound` reports a finite loss on both paths
    and one without reports none; a module belongs to one open unit and `close_units` closes them all; `close()`
    (twice) puts every module back as it was found (forward, hooks, attributes, parameters, the config's attention
    implementation, the loss bit for bit), and a closed unit refuses to enter.
    """
    spec = get_backend(backend) if isinstance(backend, str) else backend
    if not isinstance(spec, Backend):
        raise TypeError(f"check_backend: backend must be a backend's name or a gnmr_hf.Backend, got {backend!r}")
    make = tiny_llama if make_model is None else make_model
    compute = causal_lm_loss if loss is None else loss
    model = make()
    model.train()  # what training runs (and an eval-mode forward repacks a 4-bit weight on some CPUs)
    units = find_units(model, spec, backend_options=backend_options)
    try:
        _check_units(spec, units)
        _run(model, compute, "cheap path")
        holdings = _Holdings(model, units)
        _check_flips(model, units, compute, holdings)
        _check_ledger(model, units, compute, holdings)
        _check_measuring(model, units, compute)
        _check_one_owner(model, spec, units)
    except BaseException:
        with contextlib.suppress(Exception):
            units.close()
        raise
    _check_close(make(), spec, backend_options, compute)


def _check(ok: bool, promise: str, detail: str) -> None:
    if not ok:
        raise AssertionError(f"{promise}: {detail}")


def _run(model: nn.Module, compute: Callable[[nn.Module], torch.Tensor], path: str, backward: bool = True) -> float:
    """One forward (and backward) with the RNG seeded; the loss. Fails `PATHS` on an error or a non-finite loss."""
    devices = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(0)
        try:
            value = compute(model)
            if backward and value.requires_grad:
                value.backward()
        except Exception as err:
            raise AssertionError(f"{PATHS}: on the {path}: {type(err).__name__}: {err}") from err
    value = float(value.detach())
    _check(math.isfinite(value), PATHS, f"the loss on the {path} is {value}")
    return value


def _check_units(spec: Backend, units: UnitSet) -> None:
    _check(isinstance(units, UnitSet) and len(units) > 0, FOUND, f"got {units!r}")
    _check(units.backend is spec, FOUND, f"the UnitSet's backend is {units.backend!r}, not {spec.name!r}")
    _check(units.names == [u.name for u in units], FOUND, "UnitSet.names differs from the units' names")
    keys = None
    for unit in units:
        name = getattr(unit, "name", "?")
        _check(isinstance(unit, RecoverableUnit), FOUND, f"{name!r} is a {type(unit).__name__}, not a RecoverableUnit")
        _check(unit.backend == spec.name, FOUND, f"unit {name!r} says its backend is {unit.backend!r}")
        _check(unit.ledger is units.ledger, FOUND, f"unit {name!r} does not share its find_units call's ledger")
        _check(unit_of(unit.module) is unit, FOUND, f"unit {name!r} is not its module's owner (unit_of)")
        _check(isinstance(unit.signal, str), FOUND, f"unit {name!r}: signal must be a str, got {unit.signal!r}")
        tensors, meter = bool(unit.signal_tensors()), unit.output_grad is not None
        _check(tensors != meter, FOUND, f"unit {name!r} has signal tensors: {tensors}, an output-grad meter: {meter}")
        facts = unit.describe()
        signal = facts.get("signal") if isinstance(facts, dict) else None
        _check(signal == unit.signal, FOUND, f"unit {name!r}: describe() = {facts!r} must carry the signal kind")
        try:
            json.dumps(facts)
        except (TypeError, ValueError) as err:
            raise AssertionError(f"{FOUND}: unit {name!r}: describe() must be JSON-safe: {err}") from None
        keys = facts.keys() if keys is None else keys
        _check(facts.keys() == keys, FOUND, f"unit {name!r}: describe() has keys {sorted(facts)}, not {sorted(keys)}")
        precision, nbytes = unit.precision(), unit.recovery_bytes()
        _check(isinstance(precision, str), FOUND, f"unit {name!r}: precision() must be a str, got {precision!r}")
        _check(isinstance(nbytes, int) and nbytes >= 0, FOUND, f"unit {name!r}: recovery_bytes() = {nbytes!r}")


def _named_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    return {**dict(model.named_parameters()), **{f"buffer {n}": b for n, b in model.named_buffers()}}


def _identity(model: nn.Module) -> tuple[list[int], list[int], list[str]]:
    return [id(p) for p in model.parameters()], [id(b) for b in model.buffers()], list(model.state_dict())


def _optimizer_state(optimizer: torch.optim.Optimizer | None) -> tuple[list[list[int]], list[tuple[int, str, Any]]]:
    """The optimizer's parameter groups (ids) and state (copied), to compare."""
    if optimizer is None:
        return [], []
    groups = [list(map(id, g["params"])) for g in optimizer.param_groups]
    state = [
        (id(p), k, v.clone() if torch.is_tensor(v) else v) for p, s in optimizer.state.items() for k, v in s.items()
    ]
    return groups, state


def _same_state(
    a: tuple[list[list[int]], list[tuple[int, str, Any]]], b: tuple[list[list[int]], list[tuple[int, str, Any]]]
) -> bool:
    (groups, state), (groups_now, state_now) = a, b
    return (
        groups == groups_now
        and len(state) == len(state_now)
        and all(
            (p, k) == (q, j) and (torch.equal(v, w) if torch.is_tensor(v) and torch.is_tensor(w) else v == w)
            for (p, k, v), (q, j, w) in zip(state, state_now, strict=True)
        )
    )


def _check_flips(
    model: nn.Module, units: UnitSet, compute: Callable[[nn.Module], torch.Tensor], holdings: _Holdings
) -> None:
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3) if trainable else None
    _run(model, compute, "cheap path")
    if optimizer is not None:
        optimizer.step()  # so that the optimizer has state a flip could disturb
        optimizer.zero_grad()
    identity, optimizer_state = _identity(model), _optimizer_state(optimizer)
    weights = {n: t.detach().clone() for n, t in _named_tensors(model).items()}
    for unit in units:
        unit.enter_recovery()
    changed = "the model's parameters, buffers or state_dict keys changed"
    _check(_identity(model) == identity, ADDS_NOTHING, f"{changed} on entering recovery")
    _run(model, compute, "recovery path")
    for unit in units:
        unit.exit_recovery()
        holdings.check_dropped(unit)
    _check(_identity(model) == identity, ADDS_NOTHING, f"{changed} by a flip")
    same = _same_state(_optimizer_state(optimizer), optimizer_state)
    _check(same, OPTIMIZER, "its parameter groups or its state changed")
    for name, tensor in _named_tensors(model).items():
        before = weights[name]
        same = tensor.dtype == before.dtype and tensor.shape == before.shape and torch.equal(tensor.detach(), before)
        _check(same, WEIGHTS, f"{name} is not bit-identical after enter_recovery() and exit_recovery()")
    model.zero_grad(set_to_none=True)


def _storages(obj: Any, excluded: set[int], found: dict[int, int], depth: int) -> None:
    """The tensor storages reachable from `obj` through containers (`depth` levels), not through modules or other
    objects, and not in `excluded`: {data pointer: bytes}."""
    if isinstance(obj, torch.Tensor):
        with contextlib.suppress(Exception):  # a tensor subclass without storage of its own
            storage = obj.untyped_storage()
            if storage.data_ptr() and storage.data_ptr() not in excluded:
                found[storage.data_ptr()] = storage.nbytes()
        return
    if depth == 0 or isinstance(obj, (nn.Module, str, bytes)):
        return
    items = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple, set)) else ()
    for item in items:
        _storages(item, excluded, found, depth - 1)


def _held_bytes(unit: RecoverableUnit, excluded: set[int]) -> int:
    """Bytes of the tensors the unit holds (its attributes, through containers) and of the plain tensor attributes
    it may have put on its module, other than the model's parameters and buffers."""
    found: dict[int, int] = {}
    for value in vars(unit).values():
        _storages(value, excluded, found, 3)
    for value in vars(unit.module).values():
        _storages(value, excluded, found, 0)
    return sum(found.values())


class _Holdings:
    """What each unit holds on the cheap path (before any flip), to compare what it holds later with."""

    def __init__(self, model: nn.Module, units: UnitSet) -> None:
        self.excluded = {t.untyped_storage().data_ptr() for t in _named_tensors(model).values()}
        self.cheap = {id(u): _held_bytes(u, self.excluded) for u in units}

    def extra(self, unit: RecoverableUnit) -> int:
        return _held_bytes(unit, self.excluded) - self.cheap[id(unit)]

    def check_dropped(self, unit: RecoverableUnit) -> None:
        kept = self.extra(unit)
        _check(kept <= 0, DROPPED, f"unit {unit.name!r} still holds {kept} bytes more than on the cheap path")


def _check_ledger(
    model: nn.Module, units: UnitSet, compute: Callable[[nn.Module], torch.Tensor], holdings: _Holdings
) -> None:
    ledger = units.ledger
    _run(model, compute, "cheap path")  # a saved-activation unit learns its bytes from a forward
    first, last = units[0], units[len(units) - 1]
    first.enter_recovery()
    first.enter_recovery()
    last.enter_recovery()
    _run(model, compute, "recovery path")
    entered = 1 if last is first else 2
    _check(ledger.live_units == entered, IDEMPOTENT, f"entered twice, the ledger holds {ledger.live_units} units")
    _check(first.in_recovery and last.in_recovery, IDEMPOTENT, "a unit entered twice is not in recovery")
    held = ledger.live_bytes
    limit = first.recovery_bytes() + (last.recovery_bytes() if last is not first else 0)
    _check(0 <= held <= limit, BOUNDED, f"{held} bytes held for units whose recovery_bytes() add up to {limit}")
    first.exit_recovery()
    first.exit_recovery()
    left = ledger.live_units
    _check(left == entered - 1 and not first.in_recovery, IDEMPOTENT, f"exited twice, the ledger holds {left} units")
    holdings.check_dropped(first)
    last.exit_recovery()
    holdings.check_dropped(last)
    _check(ledger.live_bytes == 0, IDEMPOTENT, f"after every exit the ledger holds {ledger.live_bytes} bytes")
    _check(ledger.peak_bytes >= held, COUNTED, f"the ledger's peak is {ledger.peak_bytes} bytes, it held {held}")
    model.zero_grad(set_to_none=True)

    # Every unit in recovery, then out one at a time: what leaves the ledger with a unit is what it counted.
    for unit in units:
        unit.enter_recovery()
    _run(model, compute, "recovery path")
    live = ledger.live_units
    _check(live == len(units), COUNTED, f"with every unit in recovery the ledger holds {live} of {len(units)}")
    extra = {id(u): holdings.extra(u) for u in units}
    for unit in units:
        before = ledger.live_bytes
        unit.exit_recovery()
        counted, bound, holds = before - ledger.live_bytes, unit.recovery_bytes(), extra[id(unit)]
        detail = f"unit {unit.name!r} holds {holds} bytes more in recovery than on the cheap path (tensors on it and "
        _check(0 <= counted and holds <= counted, COUNTED, detail + f"its module), the ledger counts {counted}")
        _check(counted <= bound, BOUNDED, f"unit {unit.name!r}: the ledger counts {counted} bytes, the bound {bound}")
        holdings.check_dropped(unit)
    model.zero_grad(set_to_none=True)


def _check_measuring(model: nn.Module, units: UnitSet, compute: Callable[[nn.Module], torch.Tensor]) -> None:
    for unit in units:
        unit.meter.start()
        unit.meter.take_loss()
    for path in ("cheap path", "recovery path"):
        if path == "recovery path":
            for unit in units:
                unit.enter_recovery()
        _run(model, compute, path)
        for unit in units:
            loss = unit.meter.take_loss()
            if unit.fidelity_bound is None:
                _check(loss is None, MEASURED, f"unit {unit.name!r} reports a loss but has no fidelity_bound")
                continue
            value = "nothing" if loss is None else float(loss)
            ok = isinstance(value, float) and math.isfinite(value) and value >= 0
            _check(ok, MEASURED, f"unit {unit.name!r} reports {value} on the {path}")
    for unit in units:
        unit.exit_recovery()
    model.zero_grad(set_to_none=True)


def _check_one_owner(model: nn.Module, spec: Backend, units: UnitSet) -> None:
    options = units[0].options
    try:
        again = find_units(model, spec, backend_options=options)
    except ValueError:
        pass
    else:
        again.close()
        raise AssertionError(f"{ONE_OWNER}: find_units on a model whose units are open made {len(again)} more")
    units[0].enter_recovery()
    closed = close_units(model)
    _check(closed == len(units), ONE_OWNER, f"close_units(model) closed {closed} of {len(units)} open units")
    _check(
        all(u.closed for u in units) and units.ledger.live_bytes == 0,
        ONE_OWNER,
        "close_units left a unit open or bytes in the ledger",
    )
    again = find_units(model, spec, backend_options=options)
    names = again.names
    again.close()
    _check(names == units.names, ONE_OWNER, "find_units after close_units found other units")


def _modules_state(model: nn.Module) -> dict[str, tuple[dict[str, int], dict[str, dict[int, Any]]]]:
    """Per module: its attributes (name -> id of the value) and its hooks."""
    return {
        name: ({k: id(v) for k, v in vars(m).items() if k not in _HOOKS}, {h: dict(getattr(m, h)) for h in _HOOKS})
        for name, m in model.named_modules()
    }


def _global_hooks() -> dict[str, dict[int, Any]]:
    return {h: dict(getattr(module_hooks, h)) for h in _GLOBAL_HOOKS if hasattr(module_hooks, h)}


def _attention(model: nn.Module) -> Any:
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def _differences(before: dict, after: dict) -> Iterator[str]:
    """What differs between two `_modules_state`s, module by module in the model's order, the forward first."""
    for name in [*before, *(n for n in after if n not in before)]:
        where = name or "(the model)"
        if name not in after or name not in before:
            yield f"module {where} was {'removed' if name not in after else 'added'}"
            continue
        (attrs, hooks), (attrs_now, hooks_now) = before[name], after[name]
        if attrs_now.get("forward") != attrs.get("forward"):
            yield f"{where}.forward still wrapped" if "forward" in attrs_now else f"{where}.forward was removed"
        for kind in _HOOKS:
            if hooks_now[kind].keys() - hooks[kind].keys():
                yield f"{where} keeps a {_HOOKS[kind]} it did not have"
            if hooks[kind].keys() - hooks_now[kind].keys():
                yield f"{where} lost a {_HOOKS[kind]} it had"
        for attr in [*attrs, *(a for a in attrs_now if a not in attrs)]:
            if attr == "forward":
                continue
            if attr not in attrs_now:
                yield f"{where}.{attr} was removed"
            elif attr not in attrs:
                yield f"{where}.{attr} was added and left"
            elif attrs[attr] != attrs_now[attr]:
                yield f"{where}.{attr} was replaced"


def _check_close(
    model: nn.Module, spec: Backend, backend_options: Any, compute: Callable[[nn.Module], torch.Tensor]
) -> None:
    model.train()
    loss = _run(model, compute, "model without units")
    model.zero_grad(set_to_none=True)
    modules, hooks, identity, attention = _modules_state(model), _global_hooks(), _identity(model), _attention(model)
    units = find_units(model, spec, backend_options=backend_options)
    for unit in units:
        unit.enter_recovery()
    _run(model, compute, "recovery path")
    model.zero_grad(set_to_none=True)
    units.close()
    units.close()
    difference = next(_differences(modules, _modules_state(model)), None)
    _check(difference is None, AS_FOUND, str(difference))
    _check(_global_hooks() == hooks, AS_FOUND, "a global module hook was left")
    _check(_identity(model) == identity, AS_FOUND, "the model's parameters, buffers or state_dict keys changed")
    now = _attention(model)
    _check(now == attention, AS_FOUND, f"config._attn_implementation is {now!r}, was {attention!r}")
    recovering = [u.name for u in units if u.in_recovery]
    _check(not recovering and units.ledger.live_bytes == 0, AS_FOUND, f"closed units in recovery: {recovering}")
    after = _run(model, compute, "model after close()")
    _check(after == loss, AS_FOUND, f"the model's loss is {after!r} after close(), was {loss!r}")
    try:
        units[0].enter_recovery()
    except RuntimeError:
        return
    raise AssertionError(f"{CLOSED}: enter_recovery() on closed unit {units[0].name!r} raised no RuntimeError")
