"""The act_quant backend: saved activations at low/high bits, exact forward, packed storage, flips, attention."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gnmr_hf import GNMRConfig, find_units
from gnmr_hf.backends.act_quant import (
    ATTN_IMPLEMENTATION,
    ActQuantOptions,
    QuantSavedAttention,
    QuantSavedLinear,
    SaveSpec,
)
from gnmr_hf.experiments.pretrain import SavedTensorMeter
from gnmr_hf.quant import absmax_error_bound, quantized_nbytes

PROJECTIONS = [r"\.(q|k|v|o|gate|up|down)_proj$", r"\.self_attn$"]


def small_llama(n_kv_heads: int = 2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=n_kv_heads,
        max_position_embeddings=32,
    )
    return LlamaForCausalLM(config)


def grads(model, ids):
    model.zero_grad()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# ---------------------------------------------------------------------------------------------------- options


def test_options_come_as_keywords_config_fields_or_command_line_text():
    units = find_units(nn.Sequential(nn.Linear(4, 4)), "act_quant", low_bits=3, high_bits=16, scaling="row")
    assert (units[0].low_bits, units[0].high_bits, units[0].options.scaling) == (3, 16, "row")
    config = GNMRConfig(backend="act_quant", backend_options="low_bits=2,kinds=linear;attention,stochastic=true")
    options = ActQuantOptions.parse(config.backend_options)
    assert (options.low_bits, options.kinds, options.stochastic) == (2, ["linear", "attention"], True)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"low_bits": 9}, "'low_bits' must be one of"),
        ({"low_bits": 8, "high_bits": 4}, "'high_bits' must be >= low_bits"),
        ({"scaling": "channel"}, "'scaling' must be one of"),
        ({"kinds": ["conv"]}, "'kinds' must be a non-empty list"),
        ({"group_size": 0}, "'group_size' must be an int >= 1"),
    ],
)
def test_invalid_options_raise_an_error_naming_the_option(options, message):
    with pytest.raises(ValueError, match=message):
        ActQuantOptions.parse(options)


# ------------------------------------------------------------------------------------------------ quantizer


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 7, 8])
@pytest.mark.parametrize("scaling", ["tensor", "row", "group"])
def test_a_saved_tensor_round_trips_within_the_absmax_bound(bits, scaling):
    x = torch.randn(3, 5, 64)
    spec = SaveSpec(bits, scaling, group_size=16)
    saved, meta = spec.save(x)
    restored = SaveSpec.restore(saved, meta)
    bound = absmax_error_bound(x, bits, spec.group_for(x.shape))
    assert restored.shape == x.shape and restored.dtype == x.dtype
    assert ((restored - x).abs() <= bound * (1 + 1e-5) + 1e-7).all()
    assert sum(t.numel() * t.element_size() for t in saved) == quantized_nbytes(x.shape, bits, spec.group_for(x.shape))


def test_sixteen_bits_saves_the_tensor_itself():
    x = torch.randn(4, 8)
    saved, meta = SaveSpec(16).save(x)
    assert saved[0] is x and SaveSpec.restore(saved, meta) is x


def test_four_bit_codes_take_half_the_bytes_of_eight_bit_codes():
    x = torch.randn(16, 128)
    four, _ = SaveSpec(4).save(x)
    eight, _ = SaveSpec(8).save(x)
    assert four[0].dtype == torch.uint8 and four[0].numel() * 2 == eight[0].numel() == x.numel()


# ----------------------------------------------------------------------------------------- linear gradients


def linear_grads(bits: int, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor, g: torch.Tensor):
    x, w, b = (t.detach().clone().requires_grad_() for t in (x, w, b))
    out = QuantSavedLinear.apply(x, w, b, SaveSpec(bits))
    out.backward(g)
    return out.detach(), x.grad, w.grad, b.grad


def test_linear_gradients_are_exact_at_16_bits_and_within_the_bound_below():
    torch.manual_seed(0)
    x, w, b, g = torch.randn(4, 6, 32), torch.randn(16, 32), torch.randn(16), torch.randn(4, 6, 16)
    xr, wr, br = (t.clone().requires_grad_() for t in (x, w, b))
    ref = F.linear(xr, wr, br)
    ref.backward(g)
    out, gx, gw, gb = linear_grads(16, x, w, b, g)
    torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
    torch.testing.assert_close((gx, gw, gb), (xr.grad, wr.grad, br.grad), rtol=1e-6, atol=1e-6)
    for bits in (8, 4, 2):
        out, gx, gw, gb = linear_grads(bits, x, w, b, g)
        # The forward and the input/bias gradients never read the saved copy: exact at any width.
        torch.testing.assert_close(out, ref.detach(), rtol=0, atol=0)
        torch.testing.assert_close((gx, gb), (xr.grad, br.grad), rtol=1e-6, atol=1e-6)
        # dW = g^T x_hat, so |dW - g^T x| <= |g|^T |x_hat - x| <= |g|^T bound.
        bound = g.reshape(-1, 16).abs().t() @ absmax_error_bound(x, bits).reshape(-1, 32)
        assert ((gw - wr.grad).abs() <= bound * (1 + 1e-4) + 1e-5).all(), bits
        assert not torch.equal(gw, wr.grad)


def test_a_frozen_weight_saves_no_input():
    layer = nn.Linear(8, 8).requires_grad_(False)
    x = torch.randn(2, 8, requires_grad=True)
    with SavedTensorMeter() as meter:
        QuantSavedLinear.apply(x, layer.weight, layer.bias, SaveSpec(4))
    assert meter.by_dtype.get("uint8", 0) == 0


# ------------------------------------------------------------------------------------------- what is saved


def test_the_saved_tensors_autograd_sees_are_the_packed_codes_and_scales():
    torch.manual_seed(0)
    layer = nn.Linear(64, 32)
    x = torch.randn(8, 64, requires_grad=True)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        QuantSavedLinear.apply(x, layer.weight, layer.bias, SaveSpec(4, "row"))
    shapes = {(t.dtype, tuple(t.shape)) for t in seen}
    assert (torch.uint8, (8 * 64 // 2,)) in shapes  # the packed input: two 4-bit codes per byte
    assert (torch.float32, (8, 1)) in shapes  # one scale per row
    assert not any(t is x for t in seen)


def test_saved_bytes_per_step_shrink_with_the_bits_and_shared_inputs_are_stored_once():
    model = small_llama()
    ids = torch.randint(0, 64, (2, 16))
    saved = {}
    for bits in (16, 8, 4):
        m = copy.deepcopy(model)
        units = find_units(m, "act_quant", low_bits=bits, high_bits=16, include=[r"\.(q|k|v)_proj$"])
        with SavedTensorMeter(exclude=m) as meter:
            m(input_ids=ids, labels=ids)
        saved[bits] = meter.by_dtype.get("uint8", 0)
        for u in units:
            u.close()
    # q, k and v read the same normalized hidden states: one packed copy per layer, not three.
    per_layer = 2 * 16 * 32
    assert saved[8] == 2 * per_layer and saved[4] == 2 * per_layer // 2 and saved[16] == 0


# ---------------------------------------------------------------------------------------------- the switch


def test_a_flip_takes_effect_from_the_next_forward_only():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32))
    (unit,) = find_units(model, "act_quant", low_bits=2, high_bits=8)
    x = torch.randn(4, 32)
    model(x).sum().backward()
    low_grad = model[0].weight.grad.clone()
    model.zero_grad()
    out = model(x)
    unit.enter_recovery()  # a decision between this forward and its backward
    out.sum().backward()
    assert torch.equal(model[0].weight.grad, low_grad)  # this step still used what was saved at 2 bits
    model.zero_grad()
    model(x).sum().backward()  # the next step saves at 8 bits
    assert not torch.equal(model[0].weight.grad, low_grad)


def test_the_ledger_holds_the_extra_bytes_measured_in_recovery():
    model = nn.Sequential(nn.Linear(32, 32))
    (unit,) = find_units(model, "act_quant", low_bits=4, high_bits=8)
    x = torch.randn(6, 32)
    model(x)
    extra = quantized_nbytes(x.shape, 8) - quantized_nbytes(x.shape, 4)
    assert unit.recovery_bytes() == extra and unit.ledger.live_bytes == 0
    unit.enter_recovery()
    assert unit.ledger.live_bytes == extra
    model(torch.randn(12, 32))  # a bigger batch holds more
    assert unit.ledger.live_bytes == 2 * extra == unit.recovery_bytes()
    unit.exit_recovery()
    assert unit.ledger.live_bytes == 0 and unit.ledger.peak_bytes == 2 * extra


def test_close_gives_the_model_back_as_found():
    model = small_llama()
    units = find_units(model, "act_quant", kinds=["linear", "attention"], include=PROJECTIONS)
    assert model.config._attn_implementation == ATTN_IMPLEMENTATION
    assert len(units) == 2 * (1 + 7)
    for u in units:
        u.close()
    assert model.config._attn_implementation == "sdpa"
    assert all("forward" not in m.__dict__ for m in model.modules())


# -------------------------------------------------------------------------------------------------- attention


def test_attention_units_match_eager_attention_forward_exactly_and_backward_closely():
    model = small_llama(n_kv_heads=2)  # grouped-query attention
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    find_units(model, "act_quant", kinds=["attention"], low_bits=16, high_bits=16)
    ids = torch.randint(0, 64, (2, 16))
    logits, g = grads(model, ids)
    ref_logits, ref = grads(eager, ids)
    torch.testing.assert_close(logits, ref_logits, rtol=0, atol=0)
    for name in ref:
        torch.testing.assert_close(g[name], ref[name], rtol=1e-4, atol=1e-6)


def test_attention_with_a_padding_mask_matches_eager():
    model = small_llama()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    find_units(model, "act_quant", kinds=["attention"], low_bits=16, high_bits=16)
    ids = torch.randint(0, 64, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, :4] = 0  # left padding
    out = model(input_ids=ids, attention_mask=mask).logits
    ref = eager(input_ids=ids, attention_mask=mask).logits
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1, 4:], ref[1, 4:], rtol=1e-5, atol=1e-5)


def test_low_bit_q_and_k_change_only_the_backward_and_renormalizing_helps():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) * 3 for _ in range(3))
    g = torch.randn(1, 2, 32, 16)

    def run(bits, renormalize=False):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = QuantSavedAttention.apply(*leaves, None, True, 0.25, SaveSpec(bits), renormalize)
        out.backward(g)
        return out.detach(), [t.grad for t in leaves]

    exact_out, exact = run(16)
    low_out, low = run(3)
    _, renormalized = run(3, renormalize=True)
    assert torch.equal(low_out, exact_out)

    def error(grads):
        return sum(((a - b).norm() / b.norm()).item() for a, b in zip(grads, exact, strict=True))

    assert error(low) > 0.05
    assert error(renormalized) < error(low)


def test_attention_saves_packed_q_k_v_and_a_float32_logsumexp():
    q, k, v = (torch.randn(2, 4, 8, 16, requires_grad=True) for _ in range(3))
    with SavedTensorMeter() as meter:
        QuantSavedAttention.apply(q, k, v, None, True, 0.25, SaveSpec(4), False)
    assert meter.by_dtype["uint8"] == 3 * q.numel() // 2
    assert meter.by_dtype["float32"] == 4 * (2 * 4 * 8) + 3 * 4  # lse per query row, one scale per tensor


def test_attention_units_are_scored_on_their_q_k_v_projection_weights():
    model = small_llama()
    units = find_units(model, "act_quant", kinds=["attention"])
    attn = model.model.layers[0].self_attn
    assert units[0].name == "model.layers.0.self_attn"
    assert [id(t) for t in units[0].signal_tensors()] == [
        id(attn.q_proj.weight),
        id(attn.k_proj.weight),
        id(attn.v_proj.weight),
    ]


def test_an_injected_fault_corrupts_only_the_cheap_path():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32))
    (unit,) = find_units(model, "act_quant", low_bits=4, high_bits=8, scaling="row")
    x = torch.randn(8, 32)

    def weight_grad():
        model.zero_grad()
        model(x).sum().backward()
        return model[0].weight.grad.clone()

    clean = weight_grad()
    unit.fault_scale, unit.fault_stride = 10.0, 4  # rows 0 and 4 get a scale 10x too large
    faulty = weight_grad()
    rows = torch.ones(8, 1)
    rows[::4] = 10.0
    low = SaveSpec.restore(*SaveSpec(4, "row").save(x))
    torch.testing.assert_close(faulty, torch.ones(32, 8) @ (low * rows))
    assert not torch.allclose(faulty, clean)
    unit.enter_recovery()
    torch.testing.assert_close(weight_grad(), torch.ones(32, 8) @ SaveSpec.restore(*SaveSpec(8, "row").save(x)))
