"""find_units and register_backend: peft-style dispatch, filters, and clear errors."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import pytest
from torch import nn

from gnmr_hf import BackendOptions, GNMRConfig, RecoverableUnit, find_units, register_backend
from gnmr_hf.units import _CUSTOM_BACKENDS, display_name


class HalfUnit(RecoverableUnit):
    """A toy backend: an nn.Linear whose recovery path is the same layer in float64."""

    def __init__(self, name, module):
        super().__init__(name, module)
        self.on = False

    @property
    def in_recovery(self):
        return self.on

    def signal_tensors(self):
        return [self.module.weight]

    def enter_recovery(self):
        self.on = True

    def exit_recovery(self):
        self.on = False

    def recovery_bytes(self):
        return self.module.weight.numel() * 8


def dispatch_linear(module, fqn, ctx):
    return HalfUnit(display_name(fqn), module) if isinstance(module, nn.Linear) else None


@pytest.fixture
def toy_backend():
    register_backend("toy", dispatch_linear)
    yield "toy"
    _CUSTOM_BACKENDS.pop("toy", None)


def model():
    return nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)), nn.Linear(4, 2))


def test_units_come_in_named_modules_order_with_display_names(toy_backend):
    units = find_units(model(), toy_backend)
    assert [u.name for u in units] == ["0", "2.0", "3"]


def test_display_name_drops_peft_prefix_and_base_layer():
    assert display_name("base_model.model.model.layers.0.q_proj.base_layer") == "model.layers.0.q_proj"


def test_include_exclude_and_module_filter_fn_narrow_the_units(toy_backend):
    m = model()
    assert [u.name for u in find_units(m, toy_backend, include=[r"^2\."])] == ["2.0"]
    assert [u.name for u in find_units(m, toy_backend, exclude="^0$")] == ["2.0", "3"]
    only_wide = find_units(m, toy_backend, module_filter_fn=lambda mod, fqn: getattr(mod, "out_features", 0) == 4)
    assert [u.name for u in only_wide] == ["0", "2.0"]


def test_no_match_lists_the_module_types_seen(toy_backend):
    with pytest.raises(ValueError, match=r"no module .* 'toy' unit after filtering with include.*torch.nn.modules"):
        find_units(model(), toy_backend, include=["nothing"])


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known backends are \['bnb_int8'"):
        find_units(model(), "nope")


def test_invalid_regex_is_reported():
    with pytest.raises(ValueError, match="invalid regex in include"):
        find_units(model(), "bnb_int8", include=["("])


@pytest.mark.parametrize(
    ("name", "dispatcher", "error"),
    [("", dispatch_linear, ValueError), ("bnb_int8", dispatch_linear, ValueError), ("x", 3, TypeError)],
)
def test_register_backend_rejects_bad_arguments(name, dispatcher, error):
    with pytest.raises(error):
        register_backend(name, dispatcher)


def test_close_leaves_recovery(toy_backend):
    unit = find_units(model(), toy_backend)[0]
    unit.enter_recovery()
    assert "recovery" in repr(unit)
    unit.close()
    assert not unit.in_recovery


def test_a_registered_backend_is_a_valid_config_backend(toy_backend):
    from gnmr_hf import GNMRConfig

    assert GNMRConfig(backend=toy_backend).backend == "toy"
    with pytest.raises(ValueError, match=r"backend must be one of \['bnb_int8', .*'toy'\]"):
        GNMRConfig(backend="nope")


@dataclass
class ScaledOptions(BackendOptions):
    """Options of a backend defined outside the package."""

    backend: ClassVar[str] = "scaled"
    scale: float = field(default=2.0, metadata={"help": "A factor (> 0)."})
    mode: str = field(default="fast", metadata={"help": "'fast' or 'exact'."})
    bits: int = 8
    exact_bias: bool = False

    def __post_init__(self):
        self.check_choice("mode", ("fast", "exact"))
        self.check_int("bits", 2, 16)
        if self.scale <= 0:
            raise ValueError(f"scaled option 'scale' must be > 0, got {self.scale}")


class ScaledUnit(HalfUnit):
    def __init__(self, name, module, options):
        super().__init__(name, module)
        self.options = options


def dispatch_scaled(module, fqn, ctx):
    return ScaledUnit(display_name(fqn), module, ctx.options) if isinstance(module, nn.Linear) else None


@pytest.fixture
def scaled_backend():
    register_backend("scaled", dispatch_scaled, options=ScaledOptions, hint="Use nn.Linear layers.")
    yield "scaled"
    _CUSTOM_BACKENDS.pop("scaled", None)


def test_an_outside_backend_declares_its_own_options_and_gets_them_typed(scaled_backend):
    units = find_units(model(), scaled_backend, scale=0.5, mode="exact")
    assert units[0].options == ScaledOptions(scale=0.5, mode="exact")
    text = find_units(model(), scaled_backend, backend_options="scale=0.25,bits=4,exact_bias=true")[0].options
    assert (text.scale, text.bits, text.exact_bias, text.mode) == (0.25, 4, True, "fast")


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ("mode=slow", ValueError, r"scaled option 'mode' must be one of \['fast', 'exact'\], got 'slow'"),
        ("bits=1", ValueError, r"scaled option 'bits' must be an int in 2..16, got 1"),
        ("bits=four", ValueError, r"scaled option 'bits' must be int, got 'four'"),
        ("scale=-1", ValueError, r"scaled option 'scale' must be > 0"),
        ("colour=red", ValueError, r"unknown options \['colour'\]; known options are \['bits', 'exact_bias', 'mode'"),
    ],
)
def test_an_outside_backend_validates_its_options_by_name(scaled_backend, options, error, message):
    with pytest.raises(error, match=message):
        find_units(model(), scaled_backend, backend_options=options)
    with pytest.raises(error, match=r"GNMRConfig\.backend_options: .*" + message):
        GNMRConfig(backend=scaled_backend, backend_options=options)


def test_an_outside_backend_takes_its_options_from_the_command_line(scaled_backend):
    from transformers import HfArgumentParser

    args = ["--backend", "scaled", "--backend_options", '{"scale": 3, "mode": "exact"}']
    (config,) = HfArgumentParser(GNMRConfig).parse_args_into_dataclasses(args=args)
    assert config.backend == "scaled" and config.backend_options == {"scale": 3, "mode": "exact"}
    units = find_units(model(), config.backend, backend_options=config.backend_options)
    assert units[0].options.scale == 3 and units[0].options.mode == "exact"


def test_no_units_error_carries_the_backend_hint(scaled_backend):
    with pytest.raises(ValueError, match=r"Use nn\.Linear layers\. Known backends: \['bnb_int8', .*'scaled'\]"):
        find_units(nn.Sequential(nn.ReLU()), scaled_backend)


def test_a_failing_dispatcher_leaves_the_model_as_found():
    made = []

    def dispatch(module, fqn, ctx):
        if isinstance(module, nn.LayerNorm):
            raise ValueError("cannot handle LayerNorm")
        if isinstance(module, nn.Linear):
            made.append(HalfUnit(display_name(fqn), module))
            made[-1].enter_recovery()
            return made[-1]
        return None

    register_backend("fragile", dispatch)
    try:
        with pytest.raises(ValueError, match="LayerNorm"):
            find_units(model(), "fragile")
    finally:
        _CUSTOM_BACKENDS.pop("fragile", None)
    assert len(made) == 2 and all(u.closed and not u.in_recovery for u in made)


def test_the_ledger_counts_what_each_unit_holds_now_and_the_peak():
    from gnmr_hf import RecoveryLedger

    ledger = RecoveryLedger()
    a, b = object(), object()
    ledger.hold(a, 100)
    ledger.hold(b, 50)
    ledger.hold(a, 30)  # a unit whose held bytes change (saved activations grow with the batch)
    assert (ledger.live_bytes, ledger.peak_bytes, ledger.live_units) == (80, 150, 2)
    ledger.release(a)
    ledger.release(a)
    assert (ledger.live_bytes, ledger.live_units) == (50, 1)
