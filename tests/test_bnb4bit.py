"""The bnb_4bit backend on a real 4-bit (QLoRA) LLaMA, bitsandbytes on CPU, with real peft LoRA. No mocks.

Tolerances (also in the module docstring of gnmr_hf/backends/bnb.py):
- source="checkpoint": a unit in recovery equals a BF16 `nn.Linear` holding the checkpoint weight, exactly, for
  NF4 and FP4, with and without double quantization.
- source="dequantize": the recovery weight is `dequantize_4bit` of the module's own state, cast to BF16, exactly;
  each weight is within half the widest gap of the 4-bit code times its block's absmax, plus (double
  quantization) half the widest gap of the 8-bit code times the largest |absmax - mean| of its group of 256
  blocks, plus BF16 rounding; an output element within that times |x|, plus the BF16 rounding of the outputs.
- LoRA gradients through the recovery path (checkpoint source): within 2% (relative L2, per tensor) of a reference
  whose base linears hold the BF16-rounded checkpoint weights.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from gnmr_hf import GNMRConfig, find_units
from gnmr_hf.backends.bnb import Bnb4bitUnit
from gnmr_hf.experiments.tiny import build_tiny_llama, load_4bit_lora
from gnmr_hf.registry import get_backend

from trainer_utils import (
    CFG,
    SPIKE_STEP,
    SPIKED,
    Recorder,
    close_all,
    gnmr_of,
    lora_grads_against_bf16,
    make_trainer,
    randomize_lora_b,
    step_impacts,
    token_ids,
)

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

TARGETS = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"]
TARGETS += ["mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"]
NAMES = [f"model.layers.{layer}.{target}" for layer in range(2) for target in TARGETS]
VARIANTS = [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]
VARIANT_IDS = [f"{quant_type}{'-double_quant' if double else ''}" for quant_type, double in VARIANTS]


def load(path: Path, quant_type: str = "nf4", double_quant: bool = False) -> nn.Module:
    # Train mode, as under a Trainer: on CPUs with AVX512-BF16, bitsandbytes repacks a 4-bit weight in place on an
    # eval-mode forward without gradients, and these tests compare the 4-bit state before and after forwards.
    return load_4bit_lora(path, quant_type=quant_type, double_quant=double_quant).train()


def quant_state_snapshot(module: nn.Module) -> dict[str, object]:
    """Every tensor and field of a Linear4bit's weight and quant state, cloned."""
    state = module.weight.quant_state
    snapshot = {
        "weight": module.weight,
        "data": module.weight.data.clone(),
        "quant_state": state,
        "absmax": state.absmax.clone(),
        "code": state.code.clone(),
        "fields": (tuple(state.shape), state.dtype, state.blocksize, state.quant_type, state.nested),
        "bias": module.bias.data.clone(),
    }
    if state.nested:
        snapshot.update(offset=state.offset.clone(), absmax2=state.state2.absmax.clone(), code2=state.state2.code)
    return snapshot


def assert_unchanged(module: nn.Module, before: dict[str, object]) -> None:
    after = quant_state_snapshot(module)
    assert after["weight"] is before["weight"] and after["quant_state"] is before["quant_state"]
    for key, value in before.items():
        if isinstance(value, torch.Tensor):
            assert after[key].dtype == value.dtype and torch.equal(after[key], value), key
    assert after["fields"] == before["fields"]


def test_discovery_finds_each_4bit_linear_of_a_qlora_llama_in_module_order(tiny_llama_dir: Path) -> None:
    units = find_units(load(tiny_llama_dir, "nf4", double_quant=True), "bnb_4bit")
    assert [unit.name for unit in units] == NAMES
    for unit in units:
        assert isinstance(unit, Bnb4bitUnit) and isinstance(unit.module, bnb.nn.Linear4bit)
        assert unit.tuner.base_layer is unit.module
        assert [id(t) for t in unit.signal_tensors()] == [
            id(unit.tuner.lora_A["default"].weight),
            id(unit.tuner.lora_B["default"].weight),
        ]
        assert unit.describe() == {"signal": "lora", "source": "checkpoint", "quant_type": "nf4", "double_quant": True}
    close_all(units)


def test_bad_options_name_the_4bit_backend_the_option_and_the_allowed_values() -> None:
    with pytest.raises(ValueError, match=r"bnb_4bit option 'source' must be one of \['auto', 'checkpoint', 'dequan"):
        get_backend("bnb_4bit").parse_options("source=bf16")


@pytest.mark.parametrize(("quant_type", "double_quant"), VARIANTS, ids=VARIANT_IDS)
def test_checkpoint_source_in_recovery_equals_a_bf16_linear_exactly(
    biased_llama_dir: Path, quant_type: str, double_quant: bool
) -> None:
    checkpoint = load_file(biased_llama_dir / "model.safetensors")
    units = find_units(load(biased_llama_dir, quant_type, double_quant), "bnb_4bit")  # auto: the row check accepts
    assert {unit.source for unit in units} == {"checkpoint"}
    for unit in units:
        weight, bias = checkpoint[unit.name + ".weight"], checkpoint[unit.name + ".bias"]
        reference = nn.Linear(weight.shape[1], weight.shape[0], dtype=torch.bfloat16)
        reference.load_state_dict({"weight": weight.bfloat16(), "bias": bias.bfloat16()})
        x = torch.randn(3, 5, weight.shape[1], generator=torch.Generator().manual_seed(0))
        unit.enter_recovery()
        with torch.no_grad():
            assert torch.equal(unit.module(x), reference(x.bfloat16()).float()), unit.name
        unit.exit_recovery()
    close_all(units)


def dequantize_bound(weight: torch.Tensor, state) -> torch.Tensor:
    """The per-weight bound stated in the module docstring, computed from the checkpoint weight alone."""
    blocks = weight.reshape(-1, state.blocksize)
    absmax = blocks.abs().amax(dim=1)
    code = state.code.sort().values
    bound = absmax * (code[1:] - code[:-1]).max() / 2
    if state.nested:
        code8 = state.state2.code.sort().values
        centred = (absmax - absmax.mean()).abs()
        group = torch.cat([chunk.amax().expand(len(chunk)) for chunk in centred.split(state.state2.blocksize)])
        bound = bound + group * (code8[1:] - code8[:-1]).max() / 2
    return bound[:, None].expand_as(blocks).reshape(weight.shape)


@pytest.mark.parametrize(("quant_type", "double_quant"), VARIANTS, ids=VARIANT_IDS)
def test_dequantize_source_is_dequantize_4bit_and_within_the_stated_bound(
    biased_llama_dir: Path, quant_type: str, double_quant: bool
) -> None:
    import bitsandbytes.functional as bnb_functional

    checkpoint = load_file(biased_llama_dir / "model.safetensors")
    units = find_units(load(biased_llama_dir, quant_type, double_quant), "bnb_4bit", source="dequantize")
    worst = 0.0
    for unit in units:
        weight, bias = checkpoint[unit.name + ".weight"], checkpoint[unit.name + ".bias"]
        state = unit.module.weight.quant_state
        assert state.blocksize == 64 and state.nested == double_quant  # the tiny model has 1 or 2 blocks a row
        unit.enter_recovery()
        recovered = unit.recovery_weight
        assert torch.equal(recovered, bnb_functional.dequantize_4bit(unit.module.weight.data, state).bfloat16())
        weight_bound = dequantize_bound(weight, state) + 2**-8 * recovered.float().abs()
        assert ((recovered.float() - weight).abs() <= weight_bound).all(), unit.name

        x = torch.randn(3, 5, weight.shape[1], generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            out = unit.module(x)
            reference = nn.functional.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()).float()
        # Weight error (the BF16 rounding of the reference's weight included) times |x|, plus the BF16 rounding
        # of each of the two outputs (half an ulp, 2^-9 relative).
        output_bound = x.abs() @ (weight_bound + 2**-8 * weight.abs()).T + 2**-9 * (out.abs() + reference.abs())
        ratio = ((out - reference).abs() / output_bound).max().item()
        assert ratio <= 1.0, (unit.name, ratio)
        worst = max(worst, ratio)
        unit.exit_recovery()
    assert worst > 0.1  # the bound is exercised, not vacuous: 4-bit weights differ a lot
    close_all(units)


@pytest.mark.parametrize("source", ["checkpoint", "dequantize"])
def test_flips_leave_the_4bit_weight_quant_state_and_outputs_bitwise_unchanged(
    biased_llama_dir: Path, source: str
) -> None:
    model = load(biased_llama_dir, "nf4", double_quant=True)
    ids = token_ids()
    with torch.no_grad():
        before = model(ids).logits
    units = find_units(model, "bnb_4bit", source=source)
    snapshot = {unit.name: quant_state_snapshot(unit.module) for unit in units}
    lora = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    keys = list(model.state_dict())
    parameters = [(name, id(param)) for name, param in model.named_parameters()]

    for group in (units[::2], units[1::3], units):
        for unit in group:
            unit.enter_recovery()
            unit.enter_recovery()  # idempotent
        model(token_ids(seed=1), labels=token_ids(seed=1)).loss.backward()
        for unit in group:
            unit.exit_recovery()
            unit.exit_recovery()

    for unit in units:
        assert_unchanged(unit.module, snapshot[unit.name])
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, lora[name]), name
    assert list(model.state_dict()) == keys
    assert [(name, id(param)) for name, param in model.named_parameters()] == parameters
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)  # after exit: the 4-bit path, bit for bit
    close_all(units)


def test_backward_through_recovery_gives_lora_grads_close_to_a_bf16_reference(tiny_llama_dir: Path) -> None:
    model = load(tiny_llama_dir)
    randomize_lora_b(model)
    ref_grads, recovery, four_bit = lora_grads_against_bf16(model, tiny_llama_dir, "bnb_4bit")
    for name, ref in ref_grads.items():
        error = ((recovery[name] - ref).norm() / ref.norm()).item()
        assert error < 0.02, (name, error)
    total = sum((recovery[n] - r).norm() ** 2 for n, r in ref_grads.items())
    total_4bit = sum((four_bit[n] - r).norm() ** 2 for n, r in ref_grads.items())
    assert total < total_4bit / 10  # 4-bit is far from BF16; recovery is not


def test_ledger_counts_one_bf16_weight_per_unit_in_recovery_and_frees_it_on_exit(tiny_llama_dir: Path) -> None:
    units = find_units(load(tiny_llama_dir), "bnb_4bit")
    ledger = units[0].ledger
    for unit in units:
        assert unit.recovery_bytes() == 2 * unit.module.out_features * unit.module.in_features
    chosen = [units[0], units[6], units[13]]
    for unit in chosen:
        unit.enter_recovery()
    assert ledger.live_bytes == ledger.peak_bytes == sum(unit.recovery_bytes() for unit in chosen)
    assert all(unit.recovery_weight is None for unit in units if unit not in chosen)
    ref = weakref.ref(chosen[0].recovery_weight)
    for unit in chosen:
        unit.exit_recovery()
    gc.collect()
    assert ref() is None and ledger.live_bytes == 0 and ledger.live_units == 0
    close_all(units)


def test_a_checkpoint_the_model_was_not_quantized_from_is_not_used(tiny_llama_dir: Path, tmp_path: Path) -> None:
    import shutil

    model = load(Path(shutil.copytree(tiny_llama_dir, tmp_path / "model")))
    build_tiny_llama(tmp_path / "model", seed=1)  # same names and shapes, other weights
    units = find_units(model, "bnb_4bit")
    assert {unit.source for unit in units} == {"dequantize"}
    close_all(units)
    with pytest.raises(
        ValueError, match=r"does not quantize to the module's row 0.*rebuild the BF16 weight from the 4"
    ):
        find_units(model, "bnb_4bit", source="checkpoint")


def test_a_layer_narrower_than_one_block_cannot_be_checked_and_dequantizes(tmp_path: Path) -> None:
    path = build_tiny_llama(tmp_path, hidden_size=32, intermediate_size=64, num_attention_heads=2)
    units = find_units(load(path), "bnb_4bit", include=r"layers\.0\.mlp")
    # gate/up_proj read 32 inputs (less than the 64 of a block); down_proj reads 64: one whole block.
    assert [(unit.name.split(".")[-1], unit.source) for unit in units] == [
        ("gate_proj", "dequantize"),
        ("up_proj", "dequantize"),
        ("down_proj", "checkpoint"),
    ]
    close_all(units)


def test_a_weight_repacked_for_the_cpu_inference_kernel_is_refused_with_the_reason(tiny_llama_dir: Path) -> None:
    from bitsandbytes.functional import _convert_weight_packed_for_cpu

    model = load(tiny_llama_dir)
    units = find_units(model, "bnb_4bit", source="dequantize", include="q_proj")
    module = units[0].module
    # What bitsandbytes' own eval-mode forward does on a CPU with AVX512-BF16 (this one may not have it).
    module.weight.data, module.weight.quant_state = _convert_weight_packed_for_cpu(
        module.weight.data, module.weight.quant_state
    )
    with pytest.raises(RuntimeError, match=r"cannot dequantize: bitsandbytes repacked .* model\.train\(\)"):
        units[0].enter_recovery()
    close_all(units)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj': bitsandbytes repacked its weight"):
        find_units(model, "bnb_4bit", include="q_proj")


def test_the_int8_backend_on_a_4bit_model_points_at_bnb_4bit(tiny_llama_dir: Path) -> None:
    with pytest.raises(ValueError, match=r"Linear4bit x14.*include bitsandbytes\.nn\.modules\.Linear4bit, use backen"):
        find_units(load(tiny_llama_dir), "bnb_int8")


def test_trainer_moves_the_spiked_4bit_unit_at_the_next_step_within_the_memory_budget(
    tiny_llama_dir: Path, dataset, tmp_path: Path
) -> None:
    model = load(tiny_llama_dir, double_quant=True)
    trainer = make_trainer(
        model, dataset, tmp_path, gnmr=GNMRConfig(backend="bnb_4bit", **CFG), max_steps=SPIKE_STEP + 4
    )
    gnmr = gnmr_of(trainer)
    recorder = Recorder(gnmr)
    trainer.add_callback(recorder)
    trainer.train()
    assert SPIKED not in recorder.in_recovery_at_step[SPIKE_STEP]
    assert SPIKED in recorder.in_recovery_at_step[SPIKE_STEP + 1]
    ledger = gnmr.units[0].ledger
    assert 0 < ledger.peak_bytes <= CFG["max_active"] * max(unit.recovery_bytes() for unit in gnmr.units)
    assert ledger.live_bytes == 0


def test_every_4bit_unit_measures_its_impact_the_first_layers_too_and_once_under_checkpointing(
    tiny_llama_dir: Path,
) -> None:
    # The first layer's q/k/v base outputs need no gradient under QLoRA (frozen weights, frozen embeddings), yet the
    # loss moves with them through the adapter's sum: every unit measures, each forward once, as without checkpoints.
    def measured(**checkpointing) -> torch.Tensor:
        model = load(tiny_llama_dir)
        randomize_lora_b(model)
        units = find_units(model, "bnb_4bit", backend_options="source=checkpoint")
        ids = token_ids(5, batch=2, length=16)
        return step_impacts(model, units, [{"input_ids": ids, "labels": ids}], **checkpointing)

    plain = measured()
    assert plain.numel() == len(NAMES) and bool((plain > 0).all()), plain
    for reentrant in (False, True):
        torch.testing.assert_close(measured(use_reentrant=reentrant), plain, rtol=1e-4, atol=1e-12)
