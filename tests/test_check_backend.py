"""`gnmr_hf.testing.check_backend`: it passes a backend that keeps the unit contract (every built-in one and the docs'
outside backend, in tests/test_contract.py) and fails one that breaks a promise, with a message naming it. The broken
backends here are outside backends as a user would write them: one small `SwitchedUnit` each, one mistake each.
"""

from __future__ import annotations

import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gnmr_hf import Backend, SwitchedUnit
from gnmr_hf.fidelity import OperandStats, operand_stats, take_rows
from gnmr_hf.testing import check_backend, tiny_llama

ROOT = Path(__file__).resolve().parents[1]


class Float64Unit(SwitchedUnit):
    """A correct toy: the cheap path is the layer's own forward, recovery the same layer in float64."""

    def recovery_forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.module.bias
        return F.linear(x.double(), self.module.weight.double(), None if bias is None else bias.double()).to(x.dtype)


class KeepsItsForward(Float64Unit):
    def _close(self) -> None:
        pass  # the mistake: SwitchedUnit's _close would have removed the forward it put on the module


class KeepsItsHook(Float64Unit):
    def __init__(self, name, module, ctx):
        super().__init__(name, module, ctx)
        self._hook = module.register_forward_pre_hook(lambda module, args: None)  # the mistake: never removed


class RoundsItsWeight(Float64Unit):
    def _enter(self) -> int:
        with torch.no_grad():  # the mistake: "recovery" rounds the weight in place, and nothing can undo that
            self.module.weight.copy_(self.module.weight.to(torch.bfloat16))
        return 0


class HoldsACopy(Float64Unit):
    """Recovery from a float64 copy of the weight, built on entering and counted as its bytes."""

    def _enter(self) -> int:
        self._copy = self.module.weight.detach().double()
        return self._copy.nbytes

    def _exit(self) -> None:
        self._copy = None

    def recovery_bytes(self) -> int:
        return self.module.weight.numel() * 8


class HoldsUncounted(HoldsACopy):
    def _enter(self) -> int:
        super()._enter()
        return 0  # the mistake: the copy is not counted in the ledger


class CountsPastItsBound(HoldsACopy):
    def recovery_bytes(self) -> int:
        return self.module.weight.nbytes  # the mistake: the float32 size, half of what the float64 copy holds


class KeepsItsCopy(HoldsACopy):
    def _exit(self) -> None:
        pass  # the mistake: the copy stays after the unit leaves recovery


def _backend(unit_cls: type[SwitchedUnit]) -> Backend:
    def unit_for(module, ctx):
        return unit_cls if isinstance(module, nn.Linear) and module is not ctx.model.get_output_embeddings() else None

    return Backend(name=unit_cls.__name__.lower(), unit_for=unit_for)


FIRST = "model.layers.0.self_attn.q_proj"


def test_a_backend_that_keeps_the_contract_passes():
    check_backend(_backend(HoldsACopy))


@pytest.mark.parametrize(
    ("unit_cls", "message"),
    [
        (KeepsItsForward, f"close() must put the module back as it was found: {FIRST}.forward still wrapped"),
        (KeepsItsHook, f"close() must put the module back as it was found: {FIRST} keeps a forward pre-hook it did"),
        (RoundsItsWeight, f"a flip must change no weight: {FIRST}.weight is not bit-identical after enter_recovery"),
        (
            HoldsUncounted,
            f"what recovery holds must be counted in the unit's ledger: unit '{FIRST}' holds 32768 bytes more in "
            "recovery than on the cheap path (tensors on it and its module), the ledger counts 0",
        ),
        (CountsPastItsBound, "what the ledger counts for a unit must be bounded by its recovery_bytes(): "),
        (KeepsItsCopy, f"exit_recovery() must drop what recovery holds: unit '{FIRST}' still holds 32768 bytes"),
    ],
    ids=lambda v: v.__name__ if isinstance(v, type) else "",
)
def test_a_backend_that_breaks_a_promise_fails_with_a_message_naming_it(unit_cls, message):
    with pytest.raises(AssertionError, match="^" + re.escape(message)):
        check_backend(_backend(unit_cls))


def test_a_unit_with_a_fidelity_bound_must_report_and_may_report_a_0d_loss():
    class Silent(Float64Unit):
        fidelity_bound = "nothing, in fact"

    with pytest.raises(
        AssertionError,
        match=r"^a unit with a fidelity_bound must report .*: unit '.*' reports nothing on the cheap path",
    ):
        check_backend(_backend(Silent))

    class ReportsALoss(Float64Unit):
        fidelity_bound = "a constant quarter of the bound"

        def input_fidelity(self, x: torch.Tensor) -> torch.Tensor:
            return torch.tensor(0.25)

    check_backend(_backend(ReportsALoss), lambda: tiny_llama(num_hidden_layers=1))
    model = tiny_llama(num_hidden_layers=1)
    from gnmr_hf import find_units

    units = find_units(model, _backend(ReportsALoss))
    units[0].meter.start()
    ids = torch.zeros(1, 4, dtype=torch.long)
    model(input_ids=ids).logits.sum().backward()
    assert units[0].meter.take_loss().item() == 0.25
    units.close()


class PreviousDocsCastUnit(SwitchedUnit):
    """The unit of docs/backends.md's outside backend as the previous release showed it, before measuring moved to
    `self.meter`: its rows came from `self.sample_rows(x)`."""

    fidelity_bound = "input cast to bfloat16: max(relative L2 error / 2, row-sum bias / 0.1)"

    def input_fidelity(self, x: torch.Tensor) -> OperandStats:
        rows = take_rows(x, self.sample_rows(x))
        return operand_stats(rows, rows.to(torch.bfloat16))

    def cheap_forward(self, x: torch.Tensor) -> torch.Tensor:
        w, b = self.module.weight, self.module.bias
        return F.linear(x.bfloat16(), w.bfloat16(), None if b is None else b.bfloat16()).to(x.dtype)

    def recovery_forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.module.weight, self.module.bias)


class ReportsFromItsForward(Float64Unit):
    """A unit that reports from its own code, as the previous docs said: `self.report_fidelity(*parts)` while
    `self.measuring`."""

    fidelity_bound = "a constant quarter of the bound"

    def forward_and_report(self, forward, x: torch.Tensor) -> torch.Tensor:
        if self.measuring:
            self.report_fidelity(torch.tensor(0.25))
        return forward(x)

    def cheap_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_and_report(super().cheap_forward, x)

    def recovery_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_and_report(super().recovery_forward, x)


RENAMED = r"RecoverableUnit\.{} is deprecated and will be removed in a later minor version; use {}"


def test_a_backend_written_against_the_previous_docs_passes_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning, match=RENAMED.format(r"sample_rows\(x\)", r"self\.meter\.rows\(x\)")):
        check_backend(_backend(PreviousDocsCastUnit), lambda: tiny_llama(num_hidden_layers=1))


def test_a_backend_that_reports_from_its_own_code_under_the_previous_names_passes_with_a_deprecation_warning():
    with pytest.warns(DeprecationWarning) as caught:
        check_backend(_backend(ReportsFromItsForward), lambda: tiny_llama(num_hidden_layers=1))
    messages = {str(w.message) for w in caught}
    assert any(re.match(RENAMED.format("measuring", r"self\.meter\.due"), m) for m in messages)
    assert any(re.match(RENAMED.format(r"report_fidelity\(\*parts\)", r"self\.meter\.report"), m) for m in messages)


def test_a_forward_that_fails_on_one_path_is_named():
    class BrokenRecovery(Float64Unit):
        def recovery_forward(self, x):
            raise RuntimeError("no kernel for this shape")

    message = r"^a forward and backward must work on both paths: on the recovery path: RuntimeError: no kernel"
    with pytest.raises(AssertionError, match=message):
        check_backend(_backend(BrokenRecovery))


def test_import_gnmr_hf_does_not_import_the_testing_module():
    code = "import gnmr_hf, sys; assert 'gnmr_hf.testing' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _own_backend_snippets() -> list[str]:
    """The python blocks of docs/backends.md's "A backend of your own", but the example file it shows whole."""
    text = (ROOT / "docs" / "backends.md").read_text()
    section = text.split("\n## A backend of your own\n", 1)[1].split("\n## ", 1)[0]
    example = (ROOT / "examples" / "bf16_cast_backend.py").read_text().rstrip()
    return [b for b in re.findall(r"```python\n(.*?)```", section, re.S) if b.rstrip() != example]


def test_the_snippets_of_a_backend_of_your_own_run_as_written(monkeypatch):
    snippets = _own_backend_snippets()
    assert any("check_backend(" in s for s in snippets)
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    for i, snippet in enumerate(snippets):
        # Each as a module of its own, as a user's file would run it (a dataclass looks its module up).
        module = types.ModuleType(f"backends_md_snippet{i}")
        monkeypatch.setitem(sys.modules, module.__name__, module)
        exec(compile(snippet, "docs/backends.md", "exec"), module.__dict__)
