"""find_units and register_backend: a backend declared once, filters, and clear errors."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
from torch import nn

from gnmr_hf import Backend, BackendOptions, GNMRConfig, RecoverableUnit, find_units, register_backend
from gnmr_hf.registry import _REGISTERED
from gnmr_hf.units import display_name


class HalfUnit(RecoverableUnit):
    """A toy backend: an nn.Linear whose recovery path is the same layer in float64 (nothing built here)."""

    def recovery_bytes(self):
        return self.module.weight.numel() * 8


def linear_unit(module, ctx):
    return HalfUnit if isinstance(module, nn.Linear) else None


@pytest.fixture
def toy_backend():
    register_backend(Backend("toy", linear_unit))
    yield "toy"
    _REGISTERED.pop("toy", None)


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


def test_an_include_that_matches_nothing_lists_the_unit_names_it_is_matched_against(toy_backend):
    with pytest.raises(ValueError, match=r"without filters this model has 3 'toy' units: '0', '2\.0', '3'\."):
        find_units(model(), toy_backend, include=["nothing"])


def test_an_include_pattern_that_selects_no_unit_is_a_warning_naming_it(toy_backend, caplog):
    with caplog.at_level("WARNING", logger="gnmr_hf"):
        units = find_units(model(), toy_backend, include=[r"^2\.0$", "typo_proj$"])
    assert [u.name for u in units] == ["2.0"]
    (record,) = caplog.records
    assert "include pattern 'typo_proj$' matches no unit" in record.getMessage()


def test_an_exclude_pattern_that_matches_no_module_is_a_warning_naming_it(toy_backend, caplog):
    with caplog.at_level("WARNING", logger="gnmr_hf"):
        units = find_units(model(), toy_backend, exclude=["^3$", "lm_headd"])
    assert [u.name for u in units] == ["0", "2.0"]
    (record,) = caplog.records
    assert "exclude pattern 'lm_headd' matches no module" in record.getMessage()


def test_patterns_that_all_take_part_warn_of_nothing(toy_backend, caplog):
    with caplog.at_level("WARNING", logger="gnmr_hf"):
        units = find_units(model(), toy_backend, include=["^2", "^3$"], exclude=[r"^2\.1$"])
    assert [u.name for u in units] == ["2.0", "3"] and not caplog.records


def test_unknown_backend_names_the_known_ones():
    known = r"known backends are \['act_quant', 'block_fp', 'bnb_int8'"
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; " + known):
        find_units(model(), "nope")


def test_invalid_regex_is_reported():
    with pytest.raises(ValueError, match="invalid regex in include"):
        find_units(model(), "bnb_int8", include=["("])


@pytest.mark.parametrize(
    ("backend", "error", "message"),
    [
        (Backend("", linear_unit), ValueError, "name must be a non-empty string"),
        (Backend("bnb_int8", linear_unit), ValueError, "'bnb_int8' is a built-in backend"),
        (Backend("x", 3), TypeError, "unit_for must be callable"),
        (Backend("x", linear_unit, options=dict), TypeError, "options must be a BackendOptions"),
        ("x", TypeError, "backend must be a gnmr_hf.Backend"),
    ],
)
def test_register_backend_rejects_bad_arguments(backend, error, message):
    with pytest.raises(error, match=message):
        register_backend(backend)


def test_close_leaves_recovery(toy_backend):
    unit = find_units(model(), toy_backend)[0]
    unit.enter_recovery()
    assert "recovery" in repr(unit)
    unit.close()
    assert not unit.in_recovery


def test_a_registered_backend_is_a_valid_config_backend(toy_backend):
    assert GNMRConfig(backend=toy_backend).backend == "toy"
    # The config is a leaf: a name is checked when the units are built.
    assert GNMRConfig(backend="nope").backend == "nope"
    with pytest.raises(ValueError, match=r"unknown backend 'nope'; known backends are \['act_quant', .*'toy'\]"):
        find_units(model(), "nope")


@dataclass
class ScaledOptions(BackendOptions):
    """Options of a backend defined outside the package."""

    scale: float = field(default=2.0, metadata={"help": "A factor (> 0)."})
    mode: str = field(default="fast", metadata={"help": "'fast' or 'exact'."})
    bits: int = 8
    exact_bias: bool = False

    def __post_init__(self):
        self.check_choice("mode", ("fast", "exact"))
        self.check_int("bits", 2, 16)
        if self.scale <= 0:
            raise ValueError(f"option 'scale' must be > 0, got {self.scale}")


@pytest.fixture
def scaled_backend():
    register_backend(Backend("scaled", linear_unit, options=ScaledOptions, hint="Use nn.Linear layers."))
    yield "scaled"
    _REGISTERED.pop("scaled", None)


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
        ("bits=four", ValueError, r"scaled option 'bits' must be int \(5 or 5\.0, not 5\.5 or true\), got 'four'"),
        ("scale=-1", ValueError, r"scaled option 'scale' must be > 0"),
        ("colour=red", ValueError, r"unknown options \['colour'\]; known options are \['bits', 'exact_bias', 'mode'"),
    ],
)
def test_an_outside_backend_validates_its_options_by_name(scaled_backend, options, error, message):
    with pytest.raises(error, match=message):
        find_units(model(), scaled_backend, backend_options=options)


FORMS = ("dict", "json", "text")


def _given(form: str, name: str, value: object) -> object:
    """Option `name` = `value` as a Python dict, a JSON object or key=value text (as the command line writes it)."""
    if form == "dict":
        return {name: value}
    if form == "json":
        return json.dumps({name: value})
    return f"{name}={json.dumps(value).strip(chr(34))}"


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("value", [5, 5.0])
def test_an_int_option_takes_an_integral_number_in_every_form(form, value):
    bits = ScaledOptions.parse(_given(form, "bits", value)).bits
    assert bits == 5 and type(bits) is int


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("value", [5.5, True, "five"])
def test_an_int_option_refuses_a_fraction_a_bool_and_a_word_in_every_form_with_one_message(
    scaled_backend, form, value
):
    message = r"^scaled option 'bits' must be int \(5 or 5\.0, not 5\.5 or true\), got "
    with pytest.raises(ValueError, match=message):
        find_units(model(), scaled_backend, backend_options=_given(form, "bits", value))


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("value", [True, False])
def test_a_bool_option_takes_true_or_false_in_every_form(form, value):
    assert ScaledOptions.parse(_given(form, "exact_bias", value)).exact_bias is value


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("value", [1, 0, "yes"])
def test_a_bool_option_refuses_anything_else_in_every_form_with_one_message(scaled_backend, form, value):
    with pytest.raises(ValueError, match=r"^scaled option 'exact_bias' must be bool \(true or false\), got "):
        find_units(model(), scaled_backend, backend_options=_given(form, "exact_bias", value))


@pytest.mark.parametrize("form", FORMS)
def test_a_float_option_takes_an_int_in_every_form(form):
    scale = ScaledOptions.parse(_given(form, "scale", 3)).scale
    assert scale == 3.0 and type(scale) is float


@pytest.mark.parametrize("form", ("dict", "json"))
def test_a_str_option_refuses_a_number(scaled_backend, form):
    with pytest.raises(ValueError, match=r"^scaled option 'mode' must be str, got 5$"):
        find_units(model(), scaled_backend, backend_options=_given(form, "mode", 5))


def test_optional_and_list_options_are_typed_alike_in_every_form():
    @dataclass
    class Lists(BackendOptions):
        layers: list[int] = field(default_factory=list)
        limit: float | None = None

    for given in ({"layers": [1, 2.0], "limit": None}, '{"layers": [1, 2], "limit": null}', "layers=1;2,limit=none"):
        options = Lists.parse(given)
        assert options == Lists(layers=[1, 2]) and all(type(i) is int for i in options.layers)
    with pytest.raises(ValueError, match=r"^option 'layers' must be list\[int\] \(in text, items separated by ';'\)"):
        Lists.parse({"layers": [1, 2.5]})
    with pytest.raises(ValueError, match=r"^option 'limit' must be float \(any number\) or none, got 'big'"):
        Lists.parse("limit=big")


def test_an_outside_backend_takes_its_options_from_the_command_line(scaled_backend):
    from transformers import HfArgumentParser

    args = ["--backend", "scaled", "--backend_options", '{"scale": 3, "mode": "exact"}']
    (config,) = HfArgumentParser(GNMRConfig).parse_args_into_dataclasses(args=args)
    assert config.backend == "scaled" and config.backend_options == {"scale": 3, "mode": "exact"}
    units = find_units(model(), config.backend, backend_options=config.backend_options)
    assert units[0].options.scale == 3 and units[0].options.mode == "exact"


def test_no_units_error_carries_the_backend_hint(scaled_backend):
    with pytest.raises(ValueError, match=r"Use nn\.Linear layers\. Known backends: \['act_quant', .*'scaled'\]"):
        find_units(nn.Sequential(nn.ReLU()), scaled_backend)


def test_a_failing_unit_leaves_the_model_as_found():
    made = []

    class Recorded(HalfUnit):
        def __init__(self, name, module, ctx):
            super().__init__(name, module, ctx)
            made.append(self)
            self.enter_recovery()

    def unit_for(module, ctx):
        if isinstance(module, nn.LayerNorm):
            raise ValueError("cannot handle LayerNorm")
        return Recorded if isinstance(module, nn.Linear) else None

    m = model()
    with pytest.raises(ValueError, match="LayerNorm"):
        find_units(m, Backend("fragile", unit_for))
    assert len(made) == 2 and all(u.closed and not u.in_recovery for u in made)
    assert [u.name for u in find_units(m, Backend("toy", linear_unit))] == ["0", "2.0", "3"]


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
