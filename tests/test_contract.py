"""The unit contract, once for every backend: every built-in one and the docs' outside backend
(`examples/bf16_cast_backend.py`, registered from outside the package as a user's would be).

Each backend gets a tiny LLaMA in the form it manages (8-bit, 4-bit, float8-converted, plain) and the same
specification: a flip adds nothing and leaves the optimizer alone, enter/exit/close are idempotent, close gives the
module back as found, the ledger holds what the units in recovery hold, a closed unit refuses to enter, a module
belongs to one open unit, bad options name the backend and the option, and every unit carries its signal and ledger.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from gnmr_hf import GNMRCallback, GNMRConfig, RecoverableUnit, UnitSet, find_units, get_backend
from gnmr_hf.registry import known_backends
from gnmr_hf.units import close_units, unit_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import bf16_cast_backend

BUILTIN = ("act_quant", "block_fp", "bnb_4bit", "bnb_int8", "torchao_float8")
BACKENDS = (*BUILTIN, "bf16_cast")


def _plain(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path)


def _float8(path: Path) -> torch.nn.Module:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    model = _plain(path)
    head = model.get_output_embeddings()
    config = Float8LinearConfig(emulate=True)
    return convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: m is not head)


def _model(backend: str, path: Path) -> tuple[torch.nn.Module, dict]:
    """A model the backend has units in, and the options to find them with."""
    from gnmr_hf.experiments.tiny import load_4bit_lora, load_int8_lora

    if backend == "bnb_int8":
        return load_int8_lora(path), {}
    if backend == "bnb_4bit":
        return load_4bit_lora(path), {}
    if backend == "torchao_float8":
        return _float8(path), {}
    if backend == "act_quant":
        return _plain(path), {"kinds": "all"}
    return _plain(path), {}


@pytest.fixture(params=BACKENDS)
def case(request, tiny_llama_dir):
    model, options = _model(request.param, tiny_llama_dir)
    units = find_units(model, request.param, **options)
    yield request.param, model, units
    units.close()


def _forward_loss(model: torch.nn.Module) -> torch.Tensor:
    torch.manual_seed(0)
    ids = torch.randint(0, 256, (2, 16))
    return model(input_ids=ids, labels=ids).loss


def test_every_builtin_backend_is_found_without_being_named_by_the_generic_code():
    assert set(BUILTIN) <= set(known_backends()) and "bf16_cast" in known_backends()
    generic = Path(__file__).resolve().parents[1] / "gnmr_hf"
    for module in ("units.py", "registry.py", "config.py", "callback.py", "signals.py", "options.py"):
        text = (generic / module).read_text()
        assert not any(f'"{name}"' in text and name != "bnb_int8" for name in BUILTIN), module


def test_find_units_returns_the_owner_of_the_units_it_made(case):
    backend, _, units = case
    assert isinstance(units, UnitSet) and units.backend.name == backend and len(units) > 0
    assert units.names == [u.name for u in units]
    assert all(u.ledger is units.ledger and unit_of(u.module) is u for u in units)
    assert all(isinstance(u, RecoverableUnit) and u.backend == backend for u in units)
    # Every unit says what it is scored on: signal tensors, or an output-gradient meter.
    assert all(isinstance(u.signal, str) and u.describe()["signal"] == u.signal for u in units)
    assert all(bool(u.signal_tensors()) != (u.output_grad is not None) for u in units)


def test_a_flip_adds_nothing_and_leaves_the_optimizer_alone(case):
    _, model, units = case
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-3)
    _forward_loss(model).backward()
    optimizer.step()
    optimizer.zero_grad()
    ids = [id(p) for p in model.parameters()], [id(b) for b in model.buffers()]
    keys = list(model.state_dict())
    groups = [list(map(id, g["params"])) for g in optimizer.param_groups]
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    for unit in units:
        unit.enter_recovery()
    _forward_loss(model).backward()
    for unit in units:
        unit.exit_recovery()
    assert ([id(p) for p in model.parameters()], [id(b) for b in model.buffers()]) == ids
    assert list(model.state_dict()) == keys
    assert [list(map(id, g["params"])) for g in optimizer.param_groups] == groups
    assert all(torch.equal(p, weights[n]) for n, p in model.named_parameters())


def test_enter_exit_are_idempotent_and_the_ledger_holds_what_recovery_holds(case):
    _, model, units = case
    _forward_loss(model)  # saved-activation units learn their bytes from a forward
    first, second = units[0], units[len(units) - 1]
    first.enter_recovery()
    first.enter_recovery()
    second.enter_recovery()
    _forward_loss(model)
    held = units.ledger.live_bytes
    assert units.ledger.live_units == 2 and first.in_recovery and second.in_recovery
    assert 0 <= held <= first.recovery_bytes() + second.recovery_bytes()
    first.exit_recovery()
    first.exit_recovery()
    assert units.ledger.live_units == 1 and not first.in_recovery
    second.exit_recovery()
    assert units.ledger.live_bytes == 0 and units.ledger.peak_bytes >= held


def test_close_gives_the_model_back_as_found_and_a_closed_unit_refuses_to_enter(case, tiny_llama_dir):
    backend = case[0]
    plain, options = _model(backend, tiny_llama_dir)
    # In train mode: an eval-mode forward repacks a 4-bit weight for bitsandbytes' CPU kernel.
    plain.train()
    before = _forward_loss(plain).detach()
    hooks = {n: dict(m._forward_hooks) for n, m in plain.named_modules()}
    config = getattr(plain, "config", None)
    attn = getattr(config, "_attn_implementation", None)
    fresh = find_units(plain, backend, **options)
    for unit in fresh:
        unit.enter_recovery()
    fresh.close()
    fresh.close()  # idempotent
    assert all("forward" not in m.__dict__ and unit_of(m) is None for m in plain.modules())
    assert {n: dict(m._forward_hooks) for n, m in plain.named_modules()} == hooks
    assert getattr(config, "_attn_implementation", None) == attn
    assert fresh.ledger.live_bytes == 0 and not any(u.in_recovery for u in fresh)
    assert torch.equal(_forward_loss(plain).detach(), before)
    with pytest.raises(RuntimeError, match="closed"):
        fresh[0].enter_recovery()


def test_a_module_belongs_to_one_open_unit_and_close_units_cleans_an_interrupted_run(case):
    backend, model, units = case
    with pytest.raises(ValueError, match="already belongs to another unit"):
        find_units(model, backend, backend_options=units[0].options)
    units[0].enter_recovery()
    assert close_units(model) == len(units)
    assert all(u.closed for u in units) and units.ledger.live_bytes == 0
    again = find_units(model, backend, backend_options=units[0].options)
    assert again.names == units.names
    again.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_options_name_the_backend_and_the_option(backend):
    spec = get_backend(backend)
    with pytest.raises(ValueError, match=rf"^{backend} has unknown options \['colour'\]; known options are \["):
        spec.parse_options("colour=red")
    with pytest.raises(ValueError, match=rf"^{backend} option 'signal' must be one of \['auto', 'lora', "):
        spec.parse_options({"signal": "activation"})
    with pytest.raises(ValueError, match=rf"^{backend} options: 'signal' in 'signal' is not 'key=value'"):
        spec.parse_options("signal")


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_callback_names_the_config_field_of_a_bad_backend_option(backend, tiny_llama_dir):
    # Refused when the callback is built, before any model is touched...
    with pytest.raises(ValueError, match=rf"^GNMRConfig\.backend_options: {backend} has unknown options"):
        GNMRCallback(GNMRConfig(backend=backend, backend_options="colour=red"))
    # ...and again at train begin if the config was changed since, leaving the model as found.
    model, _ = _model(backend, tiny_llama_dir)
    callback = GNMRCallback(GNMRConfig(backend=backend))
    callback.config.backend_options = {"colour": "red"}
    args = type("Args", (), {"deepspeed": None, "report_to": []})()
    with pytest.raises(ValueError, match=rf"^GNMRConfig\.backend_options: {backend} has unknown options"):
        callback.on_train_begin(args, type("State", (), {})(), None, model=model)
    assert all("forward" not in m.__dict__ and unit_of(m) is None for m in model.modules())


def test_an_unknown_backend_is_named_with_the_known_ones_when_the_callback_is_built():
    with pytest.raises(ValueError, match=r"^GNMRConfig\.backend: unknown backend 'fp4'; known backends are \["):
        GNMRCallback(GNMRConfig(backend="fp4"))
    with pytest.raises(ValueError, match=r"^GNMRConfig\.backend: unknown backend 'fp4'"):
        GNMRCallback({"backend": "fp4"})  # as a checkpoint rebuilds it


def test_the_outside_backend_is_one_file_and_its_options_work(tiny_llama_dir):
    units = find_units(_plain(tiny_llama_dir), "bf16_cast", low_dtype="float16")
    assert units.backend is bf16_cast_backend.BF16_CAST and units[0].options.low_dtype == "float16"
    assert "lm_head" not in units.names and len(units) == 2 * 7
    units.close()


def test_the_docs_show_the_outside_backend_as_it_is():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "backends.md").read_text()
    example = Path(bf16_cast_backend.__file__).read_text().rstrip()
    assert f"```python\n{example}\n```" in docs


def test_a_bad_option_of_the_outside_backend_reads_as_the_docs_say():
    with pytest.raises(ValueError, match=r"^bf16_cast option 'low_dtype' must be one of \['bfloat16', 'float16'\]"):
        get_backend("bf16_cast").parse_options("low_dtype=int8")
