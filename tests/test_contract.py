"""The unit contract, once for every backend: every built-in one and the docs' outside backend
(`examples/bf16_cast_backend.py`, registered from outside the package as a user's would be).

Each backend gets a tiny LLaMA in the form it manages (8-bit, 4-bit, float8-converted, plain) and goes through
`gnmr_hf.testing.check_backend`, the call an outside backend's author runs: a flip adds nothing, leaves the optimizer
and the weights alone and works on both paths, enter/exit/close are idempotent, close gives the module back as found,
the ledger holds what the units in recovery hold, a closed unit refuses to enter, a module belongs to one open unit.
Beside it: bad options name the backend and the option, and the generic code names no backend.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from gnmr_hf import GNMRCallback, GNMRConfig, find_units, get_backend
from gnmr_hf.registry import known_backends
from gnmr_hf.testing import check_backend, tiny_llama
from gnmr_hf.units import unit_of

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


def _maker(backend: str, path: Path) -> tuple[Callable[[], torch.nn.Module] | None, dict]:
    """How to make a model the backend has units in (None: check_backend's tiny LLaMA), and the options to find them
    with."""
    from gnmr_hf.experiments.tiny import load_4bit_lora, load_int8_lora

    if backend == "bnb_int8":
        return (lambda: load_int8_lora(path)), {}
    if backend == "bnb_4bit":
        return (lambda: load_4bit_lora(path)), {}
    if backend == "torchao_float8":
        return (lambda: _float8(path)), {}
    if backend == "act_quant":
        return None, {"kinds": "all"}
    return None, {}


def _model(backend: str, path: Path) -> torch.nn.Module:
    make, _ = _maker(backend, path)
    return tiny_llama() if make is None else make()


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_keeps_the_unit_contract(backend, tiny_llama_dir):
    make_model, options = _maker(backend, tiny_llama_dir)
    check_backend(backend, make_model, backend_options=options)


def test_every_builtin_backend_is_found_without_being_named_by_the_generic_code():
    assert set(BUILTIN) <= set(known_backends()) and "bf16_cast" in known_backends()
    generic = Path(__file__).resolve().parents[1] / "gnmr_hf"
    for module in ("units.py", "registry.py", "config.py", "callback.py", "signals.py", "options.py", "testing.py"):
        text = (generic / module).read_text()
        assert not any(f'"{name}"' in text and name != "bnb_int8" for name in BUILTIN), module


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
    model = _model(backend, tiny_llama_dir)
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
