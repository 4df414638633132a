"""Renamed public names still work for a release: each old name does what its new one does and warns
(`DeprecationWarning`, "removed in a later minor version", naming the new one), and docs/backends.md lists them."""

from __future__ import annotations

import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

from gnmr_hf import Backend, GNMRConfig, GNMRController, SwitchedUnit, find_units
from gnmr_hf.deprecated import RenamedUnitNames
from gnmr_hf.signals import UnitSignals

ROOT = Path(__file__).resolve().parents[1]
WARNS = r"is deprecated and will be removed in a later minor version; use "


def measuring_unit():
    """An act_quant unit measuring 2 rows of its input, in recovery one step in 2 by the clock of step 3."""
    units = find_units(nn.Sequential(nn.Linear(4, 4)), "act_quant", low_bits=2)
    units[0].meter.start(2, clock=lambda: 3, recovery_every=2)
    return units[0]


@pytest.mark.parametrize(
    ("old", "new"),
    [
        (lambda u: u.sample_rows(torch.ones(5, 4)), lambda u: u.meter.rows(torch.ones(5, 4))),
        (lambda u: u.measuring, lambda u: u.meter.due),
        (lambda u: u.measure_fidelity, lambda u: u.meter.on),
        (lambda u: u.fidelity_rows, lambda u: u.meter.max_rows),
        (lambda u: u.on_phase(4), lambda u: u.meter.in_phase(4)),
        (lambda u: u.fidelity_step(), lambda u: u.meter.step),
        (lambda u: u.take_measurements(), lambda u: u.meter.take()),
        (lambda u: u.take_fidelity(), lambda u: u.meter.take_loss()),
        (lambda u: u.fidelity_state(), lambda u: u.meter_state()),
    ],
    ids=[
        "sample_rows",
        "measuring",
        "measure_fidelity",
        "fidelity_rows",
        "on_phase",
        "fidelity_step",
        "take_measurements",
        "take_fidelity",
        "fidelity_state",
    ],
)
def test_a_renamed_unit_name_warns_and_gives_what_its_new_name_gives(old, new):
    with pytest.warns(DeprecationWarning, match=r"^RecoverableUnit\.\w+.* " + WARNS):
        value = old(measuring_unit())
    expected = new(measuring_unit())  # a unit of its own: drawing rows moves the unit's draw
    assert torch.equal(value, expected) if isinstance(value, torch.Tensor) else value == expected


def test_report_fidelity_and_start_measuring_warn_and_reach_the_meter():
    unit = find_units(nn.Sequential(nn.Linear(4, 4)), "act_quant", low_bits=2)[0]
    with pytest.warns(DeprecationWarning, match=r"start_measuring\(\) " + WARNS + r"self\.meter\.start\(\)"):
        unit.start_measuring(8, recovery_every=3)
    assert (unit.meter.on, unit.meter.max_rows, unit.meter.recovery_every) == (True, 8, 3)
    with pytest.warns(DeprecationWarning, match=r"report_fidelity\(\*parts\) " + WARNS + r"self\.meter\.report"):
        unit.report_fidelity(torch.tensor(0.5))
    assert unit.meter.take_loss().item() == 0.5


class Plain(SwitchedUnit):
    def recovery_forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.module.weight, self.module.bias)


def test_a_backend_overriding_the_old_state_methods_warns_at_its_definition_and_the_callbacks_calls_reach_them():
    with pytest.warns(DeprecationWarning, match=r"^Held\.fidelity_state " + WARNS + r"meter_state") as caught:

        class Held(Plain):  # keeps a measure across steps, under the previous names of the state methods
            def fidelity_state(self):
                return {"loss": self.loss, "base": super().fidelity_state()}

            def load_fidelity_state(self, state):
                self.loss = state["loss"]

    assert any(str(w.message).startswith("Held.load_fidelity_state ") for w in caught)
    backend = Backend(name="held", unit_for=lambda module, ctx: Held if isinstance(module, nn.Linear) else None)
    unit = find_units(nn.Sequential(nn.Linear(4, 4)), backend)[0]
    unit.load_meter_state({"loss": 0.25})  # what the callback calls on a resume
    with pytest.warns(DeprecationWarning):  # the base's fidelity_state, called by the override: None, no loop
        assert unit.meter_state() == {"loss": 0.25, "base": None}


def test_the_renamed_names_of_scores_signals_and_observe_warn_and_give_the_cheap_loss():
    units = find_units(nn.Sequential(nn.Linear(4, 4)), "act_quant", low_bits=2)
    units[0].meter.start()
    units[0].meter.report(torch.tensor(0.5))
    signals = UnitSignals(units)
    with pytest.warns(DeprecationWarning, match=r"UnitSignals\.gather_fidelity\(\) " + WARNS + "gather_cheap_loss"):
        assert signals.gather_fidelity().tolist() == [0.5]
    with pytest.warns(DeprecationWarning, match=r"UnitSignals\.fidelity " + WARNS + r"UnitSignals\.cheap_loss"):
        assert signals.fidelity is None  # no step computed yet
    controller = GNMRController(GNMRConfig(policy="cause"), 1)
    with pytest.warns(DeprecationWarning, match=r"observe\(fidelity=\.\.\.\) " + WARNS + r"observe\(cheap_loss"):
        decision = controller.observe(torch.ones(1, dtype=torch.float64), fidelity=torch.tensor([0.5]))
    with pytest.warns(DeprecationWarning, match=r"Scores\.fidelity " + WARNS + r"Scores\.cheap_loss"):
        assert decision.scores.fidelity.tolist() == [0.5]


def test_docs_list_every_renamed_unit_name():
    text = (ROOT / "docs" / "backends.md").read_text()
    section = text.split("\n### Renamed names\n", 1)[1].split("\n## ", 1)[0]
    names = [n for n in vars(RenamedUnitNames) if not n.startswith("_") and n != "meter"]
    assert names and [n for n in names if not re.search(rf"`(unit|self)\.{n}\b", section)] == []
    for old in ("Scores.fidelity", "UnitSignals.gather_fidelity", "fidelity=...", "GNMRConfig.recovery_every"):
        assert old in section, old


def test_a_current_backend_warns_nothing():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        unit = measuring_unit()
        unit.meter.rows(torch.ones(5, 4))
        unit.meter_state()
