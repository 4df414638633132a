"""find_units and register_backend: peft-style dispatch, filters, and clear errors."""

from __future__ import annotations

import pytest
from torch import nn

from gnmr_hf import RecoverableUnit, find_units, register_backend
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
    with pytest.raises(ValueError, match=r"backend must be one of \['bnb_int8', 'toy'\]"):
        GNMRConfig(backend="nope")
