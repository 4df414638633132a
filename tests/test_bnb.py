"""The bnb_int8 backend on a real 8-bit LLaMA (bitsandbytes on CPU) with real peft LoRA. No mocks.

Tolerances (also in the module docstring of gnmr_hf/backends/bnb.py):
- source="checkpoint": a unit in recovery equals a BF16 `nn.Linear` holding the checkpoint weight, exactly.
- source="dequantize": each weight is within half an INT8 step (absmax_row / 254) plus one BF16 rounding of the
  original; an output element within that times sum_k |x_k|.
- LoRA gradients through the recovery path: within 2% (relative L2, per tensor) of a reference whose base
  linears hold the BF16-rounded checkpoint weights.
"""

from __future__ import annotations

import copy
import gc
import logging
import shutil
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from gnmr_hf import OutputGradMeter, RecoveryLedger, find_units
from gnmr_hf.backends.bnb import BnbInt8Unit
from gnmr_hf.experiments.tiny import build_tiny_llama, load_int8_lora

from trainer_utils import close_all, lora_grads_against_bf16, randomize_lora_b, step_impacts, token_ids

bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

TARGETS = [
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
]
NAMES = [f"model.layers.{layer}.{target}" for layer in range(2) for target in TARGETS]


def scales(module: nn.Module) -> torch.Tensor:
    return module.state.SCB if module.state.SCB is not None else module.weight.SCB


def test_discovery_finds_each_int8_linear_of_a_peft_lora_llama_in_module_order(tiny_llama_dir: Path) -> None:
    model = load_int8_lora(tiny_llama_dir)
    units = find_units(model, "bnb_int8")
    assert [unit.name for unit in units] == NAMES
    for unit in units:
        assert isinstance(unit, BnbInt8Unit)
        assert isinstance(unit.module, bnb.nn.Linear8bitLt)
        assert unit.tuner.base_layer is unit.module
        assert unit.signal == "lora"
        expected = [unit.tuner.lora_A["default"].weight, unit.tuner.lora_B["default"].weight]
        assert [id(t) for t in unit.signal_tensors()] == [id(t) for t in expected]
    close_all(units)


def test_include_exclude_and_module_filter_fn_narrow_the_units(tiny_llama_dir: Path) -> None:
    model = load_int8_lora(tiny_llama_dir)
    cases = [
        ({"include": r"self_attn"}, [n for n in NAMES if "self_attn" in n]),
        ({"include": [r"q_proj", r"v_proj"], "exclude": r"layers\.1\."}, NAMES[0:1] + NAMES[2:3]),
        ({"module_filter_fn": lambda module, fqn: ".mlp." in fqn}, [n for n in NAMES if ".mlp." in n]),
    ]
    for filters, expected in cases:
        units = find_units(model, "bnb_int8", **filters)
        assert [unit.name for unit in units] == expected, filters
        close_all(units)


def test_model_without_int8_linear_raises_listing_module_types(tiny_llama_dir: Path) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"no module .* 'bnb_int8' unit.*torch\.nn\.modules\.linear\.Linear x15"):
        find_units(model, "bnb_int8")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"source": "bf16"}, r"option 'source' must be one of \['auto', 'checkpoint', 'dequantize'\], got 'bf16'"),
        (
            {"signal": "grad"},
            r"option 'signal' must be one of \['auto', 'lora', 'weight', 'output_grad'\], got 'grad'",
        ),
        ({"sorce": "auto"}, r"unknown options \['sorce'\]; known options are \['signal', 'source'\]"),
    ],
)
def test_bad_option_values_raise_naming_the_option_and_allowed_values(
    tiny_llama_dir: Path, options: dict, message: str
) -> None:
    model = load_int8_lora(tiny_llama_dir)
    with pytest.raises(ValueError, match=message):
        find_units(model, "bnb_int8", **options)


def test_weight_signal_on_a_frozen_int8_weight_raises_naming_the_unit(tiny_llama_dir: Path) -> None:
    model = load_int8_lora(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj': signal='weight'.*does not require"):
        find_units(model, "bnb_int8", signal="weight")


def test_checkpoint_source_in_recovery_equals_a_bf16_linear_exactly(biased_llama_dir: Path) -> None:
    checkpoint = load_file(biased_llama_dir / "model.safetensors")
    model = load_int8_lora(biased_llama_dir)
    units = find_units(model, "bnb_int8", source="checkpoint")
    torch.manual_seed(0)
    for unit in units:
        weight, bias = checkpoint[unit.name + ".weight"], checkpoint[unit.name + ".bias"]
        reference = nn.Linear(weight.shape[1], weight.shape[0], dtype=torch.bfloat16)
        reference.load_state_dict({"weight": weight.bfloat16(), "bias": bias.bfloat16()})
        x = torch.randn(3, 5, weight.shape[1])
        unit.enter_recovery()
        with torch.no_grad():
            assert torch.equal(unit.module(x), reference(x.bfloat16()).float()), unit.name
        unit.exit_recovery()
    close_all(units)


def test_recovery_is_a_bf16_matmul_even_under_fp16_autocast(tiny_llama_dir: Path) -> None:
    checkpoint = load_file(tiny_llama_dir / "model.safetensors")
    model = load_int8_lora(tiny_llama_dir)
    unit = find_units(model, "bnb_int8", source="checkpoint", include=r"layers\.0\.mlp\.up_proj")[0]
    weight = checkpoint[unit.name + ".weight"]
    x = torch.randn(4, weight.shape[1])
    unit.enter_recovery()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.float16):
        out = unit.module(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, nn.functional.linear(x.bfloat16(), weight.bfloat16()).float())
    unit.close()


def test_importing_the_backend_imports_neither_bitsandbytes_nor_peft() -> None:
    import subprocess
    import sys

    code = (
        "import sys, gnmr_hf; gnmr_hf.get_backend('bnb_int8'); "
        "print(sorted(m for m in ('bitsandbytes', 'peft', 'transformers') if m in sys.modules))"
    )
    repo = Path(__file__).resolve().parents[1]
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo)
    assert result.stdout.strip() == "[]"


def test_dequantize_source_in_recovery_is_within_the_int8_rounding_error_of_a_bf16_linear(
    biased_llama_dir: Path,
) -> None:
    checkpoint = load_file(biased_llama_dir / "model.safetensors")
    model = load_int8_lora(biased_llama_dir)
    units = find_units(model, "bnb_int8", source="dequantize")
    torch.manual_seed(0)
    worst = 0.0
    for unit in units:
        weight, bias = checkpoint[unit.name + ".weight"], checkpoint[unit.name + ".bias"]
        absmax = weight.abs().amax(dim=1, keepdim=True)
        unit.enter_recovery()
        recovered = unit.recovery_weight
        # The formula bitsandbytes documents, CB * SCB / 127, up to the BF16 rounding of the result.
        formula = unit.module.weight.data.float() * scales(unit.module).float()[:, None] / 127
        torch.testing.assert_close(recovered.float(), formula, rtol=2**-8, atol=0)
        weight_bound = absmax / 254 + 2**-8 * weight.abs()
        assert ((recovered.float() - weight).abs() <= weight_bound).all(), unit.name

        x = torch.randn(3, 5, weight.shape[1])
        with torch.no_grad():
            out = unit.module(x)
            reference = nn.functional.linear(x.bfloat16(), weight.bfloat16(), bias.bfloat16()).float()
        # Weight error times |x|, plus the BF16 rounding of each of the two outputs (half an ulp, 2^-9 relative).
        output_bound = (absmax.T * (1 / 254 + 2**-8)) * x.abs().sum(dim=-1, keepdim=True)
        output_bound = output_bound + 2**-9 * (out.abs() + reference.abs())
        ratio = ((out - reference).abs() / output_bound).max().item()
        assert ratio <= 1.0, (unit.name, ratio)
        worst = max(worst, ratio)
        unit.exit_recovery()
    assert worst > 0  # the bound is exercised, not vacuous: dequantized weights do differ
    close_all(units)


def test_dequantize_gives_the_same_weight_before_and_after_bitsandbytes_first_forward(tiny_llama_dir: Path) -> None:
    model = load_int8_lora(tiny_llama_dir)
    units = find_units(model, "bnb_int8", source="dequantize")
    unit = units[0]
    assert unit.module.state.SCB is None  # scales still on the weight
    unit.enter_recovery()
    before = unit.recovery_weight.clone()
    unit.exit_recovery()
    with torch.no_grad():
        model(token_ids())
    assert unit.module.state.SCB is not None  # bnb moved them to module.state
    unit.enter_recovery()
    assert torch.equal(unit.recovery_weight, before)
    close_all(units)


def test_after_exit_outputs_equal_the_int8_path_bit_for_bit(biased_llama_dir: Path) -> None:
    model = load_int8_lora(biased_llama_dir)
    untouched = copy.deepcopy(model)
    ids = token_ids()
    with torch.no_grad():
        before = model(ids).logits
    units = find_units(model, "bnb_int8")
    for unit in units:
        unit.enter_recovery()
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, before)  # recovery really changed the path
    for unit in units:
        unit.exit_recovery()
    with torch.no_grad():
        after = model(ids).logits
        assert torch.equal(after, before)
        assert torch.equal(after, untouched(ids).logits)
    close_all(units)


def test_flips_leave_int8_weights_scales_bias_and_state_dict_bitwise_unchanged(biased_llama_dir: Path) -> None:
    model = load_int8_lora(biased_llama_dir)
    with torch.no_grad():
        model(token_ids())  # let bnb move CB/SCB into module.state, as in training
    units = find_units(model, "bnb_int8")
    snapshot = {
        unit.name: (
            unit.module.weight,
            unit.module.weight.data.clone(),
            scales(unit.module).clone(),
            unit.module.bias.data.clone(),
        )
        for unit in units
    }
    lora = {name: param.detach().clone() for name, param in model.named_parameters() if param.requires_grad}
    keys = list(model.state_dict())
    parameters = [(name, id(param)) for name, param in model.named_parameters()]
    buffers = [name for name, _ in model.named_buffers()]

    for group in (units[::2], units[1::3], units):
        for unit in group:
            unit.enter_recovery()
            unit.enter_recovery()  # idempotent
        model(token_ids(seed=1), labels=token_ids(seed=1)).loss.backward()
        with torch.no_grad():
            group[0].module(torch.randn(2, group[0].module.in_features, dtype=torch.bfloat16))
        for unit in group:
            unit.exit_recovery()
            unit.exit_recovery()

    for unit in units:
        weight_object, weight, scb, bias = snapshot[unit.name]
        assert unit.module.weight is weight_object
        assert torch.equal(unit.module.weight.data, weight) and unit.module.weight.dtype == torch.int8
        assert torch.equal(scales(unit.module), scb)
        assert unit.module.bias.dtype == torch.float32 and torch.equal(unit.module.bias.data, bias)
    for name, param in model.named_parameters():
        if param.requires_grad:
            assert torch.equal(param, lora[name]), name
    assert list(model.state_dict()) == keys
    assert [(name, id(param)) for name, param in model.named_parameters()] == parameters
    assert [name for name, _ in model.named_buffers()] == buffers
    close_all(units)


def test_flips_between_training_steps_leave_lora_and_adamw_state_as_in_a_run_without_flips(
    tiny_llama_dir: Path,
) -> None:
    def train(flip: bool) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
        model = load_int8_lora(tiny_llama_dir)
        units = find_units(model, "bnb_int8")
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=1e-2)
        for step in range(3):
            ids = token_ids(seed=step)
            model(ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            if flip:
                for unit in units[step::3]:
                    unit.enter_recovery()
                model(ids, labels=ids).loss.backward()  # gradients the optimizer never sees
                optimizer.zero_grad()
                for unit in units:
                    unit.exit_recovery()
        lora = {name: p.detach().clone() for name, p in model.named_parameters() if p.requires_grad}
        state = [{k: v.clone() for k, v in optimizer.state[p].items()} for p in params]
        close_all(units)
        return lora, state

    lora_plain, state_plain = train(flip=False)
    lora_flipped, state_flipped = train(flip=True)
    assert lora_plain.keys() == lora_flipped.keys()
    for name in lora_plain:
        assert torch.equal(lora_plain[name], lora_flipped[name]), name
    for plain, flipped in zip(state_plain, state_flipped, strict=True):
        assert plain.keys() == flipped.keys() == {"step", "exp_avg", "exp_avg_sq"}
        for key in plain:
            assert torch.equal(plain[key], flipped[key]), key


def test_backward_through_recovery_gives_lora_grads_close_to_a_bf16_reference(tiny_llama_dir: Path) -> None:
    model = load_int8_lora(tiny_llama_dir)
    randomize_lora_b(model)
    ref_grads, recovery, int8 = lora_grads_against_bf16(model, tiny_llama_dir, "bnb_int8")
    assert recovery.keys() == ref_grads.keys()
    for name, ref in ref_grads.items():
        error = ((recovery[name] - ref).norm() / ref.norm()).item()
        assert error < 0.02, (name, error)
    total = sum((recovery[n] - r).norm() ** 2 for n, r in ref_grads.items())
    total_int8 = sum((int8[n] - r).norm() ** 2 for n, r in ref_grads.items())
    assert total < total_int8  # and recovery is closer to BF16 than the INT8 path is


def test_ledger_counts_the_bytes_of_live_recovery_weights_and_their_peak(biased_llama_dir: Path) -> None:
    model = load_int8_lora(biased_llama_dir)
    units = find_units(model, "bnb_int8")
    ledger = units[0].ledger
    assert isinstance(ledger, RecoveryLedger) and all(unit.ledger is ledger for unit in units)
    for unit in units:
        out_features, in_features = unit.module.weight.shape
        assert unit.recovery_bytes() == 2 * (out_features * in_features + out_features)

    chosen = [units[0], units[5], units[13]]
    for unit in chosen:
        unit.enter_recovery()
    assert ledger.live_bytes == sum(unit.recovery_bytes() for unit in chosen) == ledger.peak_bytes
    assert ledger.live_units == 3
    assert all(unit.recovery_weight is None for unit in units if unit not in chosen)
    peak = ledger.peak_bytes
    chosen[0].exit_recovery()
    assert ledger.live_bytes == peak - chosen[0].recovery_bytes() and ledger.peak_bytes == peak
    for unit in chosen:
        unit.exit_recovery()
    assert ledger.live_bytes == 0 and ledger.live_units == 0 and ledger.peak_bytes == peak
    ledger.reset_peak()
    assert ledger.peak_bytes == 0
    close_all(units)
    assert find_units(model, "bnb_int8")[0].ledger is not ledger  # one ledger per find_units call


def test_recovery_weight_is_freed_on_exit(tiny_llama_dir: Path) -> None:
    model = load_int8_lora(tiny_llama_dir)
    units = find_units(model, "bnb_int8")
    unit = units[3]
    unit.enter_recovery()
    ref = weakref.ref(unit.recovery_weight)
    ids = token_ids()
    model(ids, labels=ids).loss.backward()
    unit.exit_recovery()
    gc.collect()
    assert ref() is None
    close_all(units)


def test_auto_source_reads_the_local_checkpoint(tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = load_int8_lora(tiny_llama_dir)
    with caplog.at_level(logging.INFO, logger="gnmr_hf"):
        units = find_units(model, "bnb_int8")
    assert {unit.source for unit in units} == {"checkpoint"}
    assert [r.getMessage() for r in caplog.records if "source=" in r.getMessage()] == [
        f"bnb_int8: recovery weights from source=checkpoint ({tiny_llama_dir}), first unit '{NAMES[0]}'"
    ]
    close_all(units)


@pytest.fixture
def int8_lora_without_checkpoint(tiny_llama_dir: Path, tmp_path: Path) -> nn.Module:
    """An 8-bit LoRA model whose checkpoint directory was deleted after loading."""
    moved = Path(shutil.copytree(tiny_llama_dir, tmp_path / "moved"))
    model = load_int8_lora(moved)
    shutil.rmtree(moved)
    return model


def test_auto_source_dequantizes_when_the_checkpoint_dir_is_gone(
    int8_lora_without_checkpoint: nn.Module, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="gnmr_hf"):
        units = find_units(int8_lora_without_checkpoint, "bnb_int8")
    assert {unit.source for unit in units} == {"dequantize"}
    assert sum("source=dequantize" in r.getMessage() for r in caplog.records) == 1
    units[0].enter_recovery()
    assert units[0].recovery_weight.dtype == torch.bfloat16
    close_all(units)


def test_checkpoint_source_without_a_checkpoint_raises_a_clear_error(int8_lora_without_checkpoint: nn.Module) -> None:
    with pytest.raises(ValueError, match=r"source='checkpoint' but .*neither a local directory.*source='dequantize'"):
        find_units(int8_lora_without_checkpoint, "bnb_int8", source="checkpoint")


def test_auto_source_ignores_a_checkpoint_that_is_itself_int8(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    int8_config = BitsAndBytesConfig(load_in_8bit=True)
    AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=int8_config, device_map="cpu"
    ).save_pretrained(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path, device_map="cpu")
    units = find_units(model, "bnb_int8")
    assert {unit.source for unit in units} == {"dequantize"}
    close_all(units)
    with pytest.raises(ValueError, match=r"is I8, not a floating-point weight"):
        find_units(model, "bnb_int8", source="checkpoint")


def test_a_checkpoint_the_model_was_not_quantized_from_is_not_used(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = load_int8_lora(Path(shutil.copytree(tiny_llama_dir, tmp_path / "model")))
    build_tiny_llama(tmp_path / "model", seed=1)  # same names and shapes, other weights
    units = find_units(model, "bnb_int8")
    assert {unit.source for unit in units} == {"dequantize"}
    close_all(units)
    with pytest.raises(ValueError, match=r"does not quantize to the module's row 0"):
        find_units(model, "bnb_int8", source="checkpoint")


def test_a_hub_model_is_read_from_its_local_cache_snapshot(
    tiny_llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--gnmr--tiny-llama"
    snapshot = Path(shutil.copytree(tiny_llama_dir, repo / "snapshots" / "0123abc"))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(
        "gnmr/tiny-llama",
        cache_dir=tmp_path / "hub",
        quantization_config=BitsAndBytesConfig(load_in_8bit=True),
        device_map="cpu",
    )
    assert model.name_or_path == "gnmr/tiny-llama"
    units = find_units(model, "bnb_int8", source="checkpoint")
    assert {unit.source for unit in units} == {"checkpoint"}
    assert units[0].checkpoint_dir == snapshot
    close_all(units)


def test_sharded_checkpoint_is_read_through_its_index(tiny_llama_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    original.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    weights = original.state_dict()
    model = load_int8_lora(tmp_path)
    units = find_units(model, "bnb_int8", source="checkpoint")
    for unit in units:
        unit.enter_recovery()
        assert torch.equal(unit.recovery_weight, weights[unit.name + ".weight"].bfloat16()), unit.name
        unit.exit_recovery()
    close_all(units)


def test_output_grad_signal_meter_receives_a_finite_positive_value_after_backward(tiny_llama_dir: Path) -> None:
    model = load_int8_lora(tiny_llama_dir)
    # Layer 0's INT8 outputs need grad only if the embeddings' output does (the usual k-bit training setup).
    model.enable_input_require_grads()
    units = find_units(model, "bnb_int8", signal="output_grad")
    assert all(unit.signal_tensors() == [] and isinstance(unit.output_grad, OutputGradMeter) for unit in units)
    units[2].enter_recovery()  # the meter sees the recovery path too
    ids = token_ids()
    model(ids, labels=ids).loss.backward()
    for unit in units:
        value = unit.output_grad.take()
        assert value is not None and torch.isfinite(value) and value > 0, unit.name
    close_all(units)


def test_lora_signal_includes_trainable_dora_magnitudes(tiny_llama_dir: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    base = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=BitsAndBytesConfig(load_in_8bit=True), device_map="cpu"
    )
    model = get_peft_model(base, LoraConfig(r=4, use_dora=True, target_modules=["q_proj"]))
    units = find_units(model, "bnb_int8", include=r"q_proj")
    parent = units[0].tuner
    expected = [
        parent.lora_A["default"].weight,
        parent.lora_B["default"].weight,
        parent.lora_magnitude_vector["default"].weight,
    ]
    assert [id(t) for t in units[0].signal_tensors()] == [id(t) for t in expected]
    close_all(units)


def test_close_restores_the_module_as_found(tiny_llama_dir: Path) -> None:
    model = load_int8_lora(tiny_llama_dir)
    ids = token_ids()
    with torch.no_grad():
        before = model(ids).logits
    modules = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    hooks = [dict(m._forward_hooks) for m in modules]
    units = find_units(model, "bnb_int8", signal="output_grad")
    assert all("forward" in m.__dict__ for m in modules)
    for unit in units[:4]:
        unit.enter_recovery()
    close_all(units)
    close_all(units)  # idempotent
    assert all("forward" not in m.__dict__ for m in modules)
    assert [dict(m._forward_hooks) for m in modules] == hooks
    assert units[0].ledger.live_bytes == 0 and not any(unit.in_recovery for unit in units)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)
    with pytest.raises(RuntimeError, match="closed"):
        units[0].enter_recovery()


def test_a_failing_find_units_leaves_no_wrapper_or_hook_behind(tiny_llama_dir: Path) -> None:
    model = load_int8_lora(tiny_llama_dir, target_modules=["q_proj"])
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.k_proj': signal='lora' but .* no peft"):
        find_units(model, "bnb_int8", signal="lora")  # q_proj units were made before k_proj failed
    modules = [m for m in model.modules() if isinstance(m, bnb.nn.Linear8bitLt)]
    assert all("forward" not in m.__dict__ and not m._forward_hooks for m in modules)
    assert len(find_units(model, "bnb_int8", signal="output_grad")) == len(NAMES)


def test_a_module_belongs_to_at_most_one_live_unit(tiny_llama_dir: Path) -> None:
    model = load_int8_lora(tiny_llama_dir)
    units = find_units(model, "bnb_int8")
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj'.*already belongs to another unit"):
        find_units(model, "bnb_int8")
    close_all(units)
    assert len(find_units(model, "bnb_int8")) == len(NAMES)


def test_int8_rounds_input_says_which_kernel_bitsandbytes_runs_and_the_meter_follows(
    tiny_llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # bitsandbytes trains on a CPU with MatMul8bitFp (de-quantized weight, float matmul: the input is not rounded)
    # and evaluates with LLM.int8() (the input rounded per row); the harness's dispatcher runs LLM.int8() in both.
    from bitsandbytes.autograd import _functions

    from gnmr_hf.backends.bnb import int8_rounds_input
    from gnmr_hf.experiments.models import llm_int8_in_training
    from gnmr_hf.fidelity import loss_of

    model = load_int8_lora(tiny_llama_dir)
    units = find_units(model, "bnb_int8")
    unit = units[0]
    module = unit.module
    x = torch.randn(8, module.in_features, generator=torch.Generator().manual_seed(0))
    x[:, 3] = 20.0  # an outlier column: above bitsandbytes' default threshold 6.0

    def run(training: bool) -> tuple[torch.Tensor, bool, float]:
        module.train(training)
        with torch.no_grad():
            out = module(x)
        return out, int8_rounds_input(module, x), float(loss_of(unit.input_fidelity(x)))

    with torch.no_grad():
        run(False)  # the first forward moves the row scales to module.state
        dequantized = module.state.CB.float() * (module.state.SCB.float().unsqueeze(1) / 127)
        float_matmul = F.linear(x, dequantized, module.bias)
    trained, rounds_in_training, loss_in_training = run(True)
    evaluated, rounds_in_eval, loss_in_eval = run(False)
    assert hasattr(_functions, "MatMul8bitFp")
    torch.testing.assert_close(trained, float_matmul, rtol=1e-5, atol=1e-5)
    assert (evaluated - float_matmul).norm() > 1e-3 * float_matmul.norm()  # the input really was rounded
    assert (rounds_in_training, rounds_in_eval) == (False, True)
    assert loss_in_training == 0.0 and loss_in_eval > 0.0

    library = bnb.matmul
    caplog.clear()
    with caplog.at_level(logging.WARNING), llm_int8_in_training():
        trained_lt, rounds_lt, loss_lt = run(True)
        run(True)
    assert bnb.matmul is library
    # bitsandbytes' "inputs will be cast" warning, said on every fp32 call, gets through once per process at most.
    assert sum("inputs will be cast" in r.getMessage() for r in caplog.records) <= 1
    assert torch.equal(trained_lt, evaluated)
    assert rounds_lt and loss_lt == loss_in_eval
    close_all(units)


def test_an_int8_units_impact_is_its_int8_output_minus_the_exact_one_on_either_path(tiny_llama_dir: Path) -> None:
    # Under LLM.int8() (a GPU's numerics) the impact is 0.5 * N * sum((dL/dY)^2 (Y_int8 - Y)^2), Y the checkpoint
    # weight's exact product; in recovery the INT8 output is recomputed on the rows, the same value. On bitsandbytes'
    # CPU training kernel with a de-quantized recovery weight, cheap and exact are one product: nothing to recover.
    from gnmr_hf.experiments.models import llm_int8_in_training
    from gnmr_hf.impact import impacts

    model = load_int8_lora(tiny_llama_dir)
    units = find_units(model, "bnb_int8", backend_options="source=checkpoint")
    unit = units[0]
    module = unit.module
    unit.impact.start(0, clock=lambda: 0)
    x = torch.randn(5, module.in_features, generator=torch.Generator().manual_seed(0))
    x[:, 3] = 20.0  # an outlier column: LLM.int8() runs it in 16 bits
    module.train()

    def measured() -> tuple[float, torch.Tensor]:
        inp = x.clone().requires_grad_(True)
        out = module(inp)
        out.sum().backward()  # dL/dY = 1 everywhere
        (value,) = impacts([unit.impact.take()], torch.device("cpu"))
        return value.item(), out.detach()

    with llm_int8_in_training():
        cheap, out = measured()
        unit.enter_recovery()
        in_recovery, _ = measured()
        unit.exit_recovery()
    weight = load_file(tiny_llama_dir / "model.safetensors")[unit.name + ".weight"]
    exact = F.linear(x, weight.float())
    expected = 0.5 * 5 * (out - exact).square().sum().item()
    assert cheap == pytest.approx(expected, rel=1e-4) and cheap > 0
    assert in_recovery == pytest.approx(cheap, rel=1e-4)
    close_all(units)

    units = find_units(model, "bnb_int8", backend_options="source=dequantize")
    unit = next(u for u in units if u.name == NAMES[0])
    unit.impact.start(0, clock=lambda: 0)
    module = unit.module
    float_kernel, _ = measured()
    assert float_kernel < 1e-9 * cheap
    close_all(units)


def _int8_impacts(path: Path, micro_batches: list[torch.Tensor], llm_int8: bool, **checkpointing) -> torch.Tensor:
    """Every INT8 unit's impact over one optimizer step of `micro_batches` (`trainer_utils.step_impacts`), on
    bitsandbytes' CPU kernel or under LLM.int8()."""
    import contextlib

    from gnmr_hf.experiments.models import llm_int8_in_training

    model = load_int8_lora(path)
    randomize_lora_b(model)
    units = find_units(model, "bnb_int8", backend_options="source=checkpoint")
    batches = [{"input_ids": ids, "labels": ids} for ids in micro_batches]
    with llm_int8_in_training() if llm_int8 else contextlib.nullcontext():
        return step_impacts(model, units, batches, **checkpointing)


@pytest.mark.parametrize("llm_int8", [False, True], ids=["cpu_kernel", "llm_int8"])
def test_int8_units_measure_each_forward_once_under_gradient_checkpointing(tiny_llama_dir: Path, llm_int8: bool):
    # The checkpointed forward runs twice (once more in the backward); a unit measures the forward whose output the
    # gradient flows through, once: the same impacts as without checkpointing, in both modes, on both kernels.
    ids = token_ids(3, batch=2, length=16)
    plain = _int8_impacts(tiny_llama_dir, [ids], llm_int8)
    assert bool((plain > 0).all()) and plain.numel() == len(NAMES)  # the first layer's q/k/v too
    for reentrant in (False, True):
        checkpointed = _int8_impacts(tiny_llama_dir, [ids], llm_int8, use_reentrant=reentrant)
        torch.testing.assert_close(checkpointed, plain, rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("llm_int8", [False, True], ids=["cpu_kernel", "llm_int8"])
def test_int8_units_under_accumulation_measure_the_mean_of_their_micro_batches(tiny_llama_dir: Path, llm_int8: bool):
    # LLM.int8() picks its outlier columns per forward, so each micro-batch rounds on its own: the reference is each
    # half measured alone. Accumulation halves each gradient (a quarter of each sum) and counts both halves' tokens,
    # 0.5 * 2n * (S1 + S2) / 4 = the mean of the halves' own 0.5 * n * S_i.
    ids = token_ids(4, batch=4, length=16)
    halves = [ids[:2], ids[2:]]
    alone = torch.stack([_int8_impacts(tiny_llama_dir, [half], llm_int8) for half in halves])
    torch.testing.assert_close(_int8_impacts(tiny_llama_dir, halves, llm_int8), alone.mean(0), rtol=1e-4, atol=1e-12)
