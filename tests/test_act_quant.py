"""The act_quant backend: saved activations at low/high bits, exact forward, packed storage, flips, attention."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gnmr_hf import GNMRConfig, find_units
from gnmr_hf.backends import act_quant
from gnmr_hf.backends.act_quant import (
    ATTN_IMPLEMENTATION,
    ActQuantOptions,
    ChunkedHeadLoss,
    QuantSavedAttention,
    QuantSavedLinear,
    QuantSavedRecompute,
    SaveSpec,
)
from gnmr_hf.backends.act_quant import attention as aq_attention
from gnmr_hf.backends.act_quant import head as aq_head
from gnmr_hf.experiments.faults import inject_fault
from gnmr_hf.experiments.pretrain import SavedTensorMeter, build_model, llama_config
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
        ({"max_row_total": 0.0}, "'max_row_total' must be a number > 0"),
        ({"max_row_total": float("nan")}, "'max_row_total' must be a number > 0"),
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


def test_the_attention_logsumexp_is_torchs_bit_for_bit_on_masked_peaked_and_non_finite_rows():
    g = torch.Generator().manual_seed(0)
    rows = torch.randn(8, 300, generator=g) * torch.tensor([1.0, 10.0, 100.0, 1000.0] * 2).unsqueeze(-1)
    rows[4:, 150:] = -torch.inf  # masked keys; the large scales leave most terms below e^-87.3 (1.2e-38)
    rows[5] = -torch.inf  # a fully masked row
    rows[6, 7] = math.nan
    rows[7, 9] = math.inf
    for length in (1, 37, 300):
        s = rows[:, :length]
        torch.testing.assert_close(
            aq_attention._logsumexp(s), torch.logsumexp(s, dim=-1), rtol=0, atol=0, equal_nan=True
        )


def test_recomputed_probabilities_below_1e_38_are_zero_and_the_rest_are_torchs_exp():
    x = torch.cat([torch.linspace(-120.0, 0.0, 10_001), torch.tensor([-torch.inf, math.nan])])
    exact = torch.exp(x)
    flushed = aq_attention._exp_flushed_(x.clone())
    kept, low = x >= aq_attention.EXP_FLOOR, x < aq_attention.EXP_FLOOR
    assert torch.equal(flushed[kept], exact[kept])
    assert (flushed[low] == 0).all()
    assert (exact[low] <= 1.22e-38).all()  # what is flushed is float32's denormals and smallest normals
    assert flushed[-1].isnan()


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


def test_a_recomputed_row_above_max_row_total_is_scaled_down_to_it_and_rows_below_are_left():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16) * 3 for _ in range(3))
    g = torch.randn(1, 2, 32, 16)
    seen = {}

    def run(cap):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        QuantSavedAttention.apply(*leaves, None, True, 0.25, SaveSpec(2), False, None, cap).backward(g)
        return [t.grad for t in leaves]

    original = aq_attention._recomputed_probabilities

    def spy(*args, **kwargs):
        seen["p"] = original(*args, **kwargs)
        return seen["p"]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(aq_attention, "_recomputed_probabilities", spy)
        uncapped = run(math.inf)
    totals = seen["p"].sum(-1)
    assert (totals > 1.05).any() and (totals < 0.95).any()  # 2-bit q, k: rows both above and below 1
    capped = run(1.0)
    # d_v = p^T d_out: with the cap, exactly the rows above 1 are divided by their sum.
    total = seen["p"].sum(-1, keepdim=True)
    p = seen["p"] / torch.where(total > 1.0 + act_quant.ROW_TOTAL_SLACK, total, 1.0)
    torch.testing.assert_close(capped[2], torch.matmul(p.transpose(-2, -1), g))
    torch.testing.assert_close(uncapped[2], torch.matmul(seen["p"].transpose(-2, -1), g))
    assert not torch.equal(capped[0], uncapped[0])
    # A faithful path (16 bits) has rows summing to 1 up to float rounding: the cap leaves it bit for bit.
    exact = []
    for cap in (math.inf, 1.0):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        QuantSavedAttention.apply(*leaves, None, True, 0.25, SaveSpec(16), False, None, cap).backward(g)
        exact.append([t.grad for t in leaves])
    for a, b in zip(*exact, strict=True):
        assert torch.equal(a, b)


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
    inject_fault(unit, 10.0, 4)  # rows 0 and 4 get a scale 10x too large
    faulty = weight_grad()
    rows = torch.ones(8, 1)
    rows[::4] = 10.0
    low = SaveSpec.restore(*SaveSpec(4, "row").save(x))
    torch.testing.assert_close(faulty, torch.ones(32, 8) @ (low * rows))
    assert not torch.allclose(faulty, clean)
    unit.enter_recovery()
    torch.testing.assert_close(weight_grad(), torch.ones(32, 8) @ SaveSpec.restore(*SaveSpec(8, "row").save(x)))


# ---------------------------------------------------------------------------------------- kinds=all, per kind

ALL_UNITS_PER_LAYER = 7 + 1 + 1 + 2  # projections, attention, mlp, two norms


def test_kinds_all_selects_every_kind_also_on_the_command_line():
    config = GNMRConfig(backend="act_quant", backend_options="kinds=all,low_bits=4")
    assert ActQuantOptions.parse(config.backend_options).kinds == ["linear", "attention", "mlp", "norm", "head"]
    units = find_units(small_llama(), "act_quant", kinds="all")
    assert len(units) == 2 * ALL_UNITS_PER_LAYER + 2  # and the final norm, the head
    assert {u.kind for u in units} == {"linear", "attention", "mlp", "norm", "head"}
    assert units.names[-2:] == ["model.norm", "lm_head"]


def test_kinds_all_keeps_the_forward_exact_and_the_gradient_error_shrinks_with_the_width():
    model = small_llama()
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")  # the attention unit's forward is eager attention's, bit for bit
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ref_logits, ref = grads(eager, ids)
    ref_loss = eager(input_ids=ids, labels=ids).loss
    errors = {}
    for bits in (16, 8, 4, 2):
        m = copy.deepcopy(model)
        units = find_units(m, "act_quant", kinds="all", low_bits=bits, high_bits=16)
        logits, g = grads(m, ids)
        assert torch.equal(logits, ref_logits), bits
        # The loss is summed chunk by chunk: the same value up to float32 summation order.
        torch.testing.assert_close(m(input_ids=ids, labels=ids).loss, ref_loss, rtol=1e-6, atol=0)
        errors[bits] = max(((g[n] - ref[n]).norm() / ref[n].norm()).item() for n in ref)
        units.close()
    assert errors[16] < 1e-5
    assert errors[16] < errors[8] < errors[4] < errors[2]


@pytest.mark.parametrize("bits", [4, 8])
def test_kinds_all_saves_at_most_a_quarter_of_the_plain_model_at_4_bits_and_a_third_at_8(bits):
    model = small_llama()
    ids = torch.randint(0, 64, (4, 32))
    with SavedTensorMeter(exclude=model) as plain:
        model(input_ids=ids, labels=ids)
    units = find_units(model, "act_quant", kinds="all", low_bits=bits, high_bits=16)
    with SavedTensorMeter(exclude=model) as meter:
        model(input_ids=ids, labels=ids)
    assert meter.nbytes <= {4: 0.25, 8: 0.35}[bits] * plain.nbytes
    units.close()


@pytest.mark.parametrize("kind", ["attention", "mlp", "norm", "head"])
def test_a_flip_of_each_kind_takes_effect_from_the_next_forward_only(kind):
    model = small_llama()
    units = find_units(model, "act_quant", kinds=[kind], low_bits=2, high_bits=8)
    unit = units[0]
    signal = unit.signal_tensors()[0]
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))

    def step(flip: bool = False) -> torch.Tensor:
        model.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        if flip:
            unit.enter_recovery()  # a decision between this forward and its backward
        loss.backward()
        return signal.grad.clone()

    low = step()
    assert torch.equal(step(flip=True), low)  # this step still used what was saved at 2 bits
    assert not torch.equal(step(), low)  # the next step saves at 8 bits
    units.close()


def test_each_new_kind_is_scored_on_its_nearest_trainable_weights():
    model = small_llama()
    units = {u.name: u for u in find_units(model, "act_quant", kinds=["mlp", "norm", "head"])}
    layer = model.model.layers[0]
    mlp, norm, head = units["model.layers.0.mlp"], units["model.layers.0.input_layernorm"], units["lm_head"]
    assert [id(t) for t in mlp.signal_tensors()] == [id(layer.mlp.gate_proj.weight), id(layer.mlp.up_proj.weight)]
    assert [id(t) for t in norm.signal_tensors()] == [id(layer.input_layernorm.weight)]
    assert [id(t) for t in head.signal_tensors()] == [id(model.lm_head.weight)]
    assert (mlp.signal, norm.signal, head.signal) == ("gate_up_weight", "weight", "weight")


def test_close_gives_the_loss_function_back():
    model = small_llama()
    units = find_units(model, "act_quant", kinds="all")
    assert "_loss_function" in model.__dict__
    units.close()
    assert "_loss_function" not in model.__dict__
    assert all("forward" not in m.__dict__ for m in model.modules())


# ---------------------------------------------------------------------------------------------------- mlp


def silu_product_grads(bits: int, gate: torch.Tensor, up: torch.Tensor, g_out: torch.Tensor):
    gate, up = (t.detach().clone().requires_grad_() for t in (gate, up))
    out = QuantSavedRecompute.apply(lambda a, b: F.silu(a) * b, SaveSpec(bits), None, gate, up)
    out.backward(g_out)
    return out.detach(), gate.grad, up.grad


def test_the_swiglu_product_is_exact_forward_and_its_gradients_stay_within_the_bound_per_width():
    torch.manual_seed(0)
    gate, up, g_out = torch.randn(4, 8, 64) * 2, torch.randn(4, 8, 64), torch.randn(4, 8, 64)
    exact_out, exact_gate, exact_up = silu_product_grads(16, gate, up, g_out)
    ref_gate, ref_up = (t.clone().requires_grad_() for t in (gate, up))
    (F.silu(ref_gate) * ref_up).backward(g_out)
    torch.testing.assert_close((exact_gate, exact_up), (ref_gate.grad, ref_up.grad), rtol=1e-6, atol=1e-6)
    errors = []
    for bits in (8, 4, 2):
        out, d_gate, d_up = silu_product_grads(bits, gate, up, g_out)
        assert torch.equal(out, exact_out)
        e_gate, e_up = absmax_error_bound(gate, bits), absmax_error_bound(up, bits)
        up_hat = SaveSpec.restore(*SaveSpec(bits).save(up))
        # d_up = g silu(g_hat): |err| <= |g| max|silu'| e_gate; d_gate = g u_hat silu'(gate_hat):
        # |err| <= |g| (max|silu'| e_up + |u_hat| max|silu''| e_gate), with max|silu'| < 1.1, max|silu''| = 0.5.
        assert ((d_up - ref_up.grad).abs() <= g_out.abs() * 1.1 * e_gate + 1e-6).all(), bits
        bound = g_out.abs() * (1.1 * e_up + up_hat.abs() * 0.5 * e_gate)
        assert ((d_gate - ref_gate.grad).abs() <= bound + 1e-6).all(), bits
        errors.append((d_gate - ref_gate.grad).norm() / ref_gate.grad.norm())
    assert errors[0] < errors[1] < errors[2]


def test_the_mlp_unit_saves_packed_gate_and_up_outputs_and_no_float_copy_of_them():
    model = small_llama()
    find_units(model, "act_quant", kinds=["mlp"], low_bits=4, high_bits=8, include=[r"layers\.0\.mlp$"])
    x = torch.randn(2, 16, 32, requires_grad=True)
    with SavedTensorMeter(exclude=model) as meter:
        model.model.layers[0].mlp(x)
    intermediate = 2 * 16 * 64
    # Packed gate and up outputs (4 bits), the plain down_proj's float input; the gate/up Linears' shared input.
    assert meter.by_dtype["uint8"] == 2 * intermediate // 2
    assert meter.by_dtype["float32"] == 4 * (intermediate + x.numel()) + 2 * 4  # and one scale per operand


# --------------------------------------------------------------------------------------------------- norm


def test_the_norm_unit_is_exact_forward_and_its_gradients_stay_within_the_bound_per_width():
    model = small_llama()
    norm = model.model.layers[0].input_layernorm
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(2, 16, 32) * 3
    g_out = torch.randn(2, 16, 32)

    def run():
        xr = x.clone().requires_grad_()
        norm.weight.grad = None
        out = norm(xr)
        out.backward(g_out)
        return out.detach(), xr.grad, norm.weight.grad.clone()

    ref_out, ref_dx, ref_dw = run()
    rstd = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    y, wg = x * rstd, norm.weight * g_out
    errors = {}
    for bits in (16, 8, 4, 2):
        (unit,) = find_units(model, "act_quant", kinds=["norm"], low_bits=bits, high_bits=16, include=[r"0\.input"])
        out, dx, dw = run()
        unit.close()
        assert torch.equal(out, ref_out), bits
        # With the exact rstd r saved, y_hat = x_hat r moves by at most r e: dW by sum |g| r e, and
        # dx = r (w g - y m) by at most r (r e |m_hat| + |y| mean(|w g| r e)), m = mean(w g y).
        e = absmax_error_bound(x, bits).expand_as(x) if bits < 16 else torch.zeros_like(x)
        y_hat = SaveSpec.restore(*SaveSpec(bits).save(x)) * rstd
        m_hat = (wg * y_hat).mean(-1, keepdim=True)
        assert ((dw - ref_dw).abs() <= (g_out.abs() * rstd * e).sum((0, 1)) * (1 + 1e-4) + 1e-6).all(), bits
        bound = rstd * (rstd * e * m_hat.abs() + y.abs() * (wg.abs() * rstd * e).mean(-1, keepdim=True))
        assert ((dx - ref_dx).abs() <= bound * (1 + 1e-4) + 1e-6).all(), bits
        errors[bits] = max(((a - b).norm() / b.norm()).item() for a, b in ((dx, ref_dx), (dw, ref_dw)))
    assert errors[16] < 1e-6
    assert errors[8] < errors[4] < errors[2]


def test_the_norm_unit_saves_only_its_packed_input():
    model = small_llama()
    find_units(model, "act_quant", kinds=["norm"], low_bits=4, high_bits=8, include=[r"0\.input"])
    x = torch.randn(2, 16, 32, requires_grad=True)
    with SavedTensorMeter(exclude=model) as meter:
        model.model.layers[0].input_layernorm(x)
    # The codes, one scale and the exact rstd of each row.
    assert meter.by_dtype == {"uint8": x.numel() // 2, "float32": 4 + 4 * 2 * 16}


# --------------------------------------------------------------------------------------------------- head


def head_loss_grads(bits: int, h, weight, targets, denom=None):
    h, weight = (t.detach().clone().requires_grad_() for t in (h, weight))
    logits = F.linear(h, weight)
    loss = ChunkedHeadLoss.apply(logits.detach(), h, weight, None, targets, -100, denom, SaveSpec(bits), None)
    loss.backward()
    return loss.detach(), h.grad, weight.grad


@pytest.mark.parametrize("chunk", [2**22, 64 * 5])  # one chunk; chunks of 5 rows, the last one short
def test_the_chunked_loss_is_the_plain_loss_and_its_gradients_stay_within_the_bound_per_width(chunk, monkeypatch):
    monkeypatch.setattr(aq_head, "LOSS_CHUNK_ELEMENTS", chunk)
    torch.manual_seed(0)
    h, weight = torch.randn(23, 32), torch.randn(64, 32) * 0.3
    targets = torch.randint(0, 64, (23,))
    targets[[3, 11]] = -100
    hr, wr = h.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(F.linear(hr, wr), targets, ignore_index=-100)
    ref.backward()
    loss, dh, dw = head_loss_grads(16, h, weight, targets)
    torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=0)
    torch.testing.assert_close((dh, dw), (hr.grad, wr.grad), rtol=1e-5, atol=1e-7)
    errors = []
    for bits in (8, 4, 2):
        loss, dh, dw = head_loss_grads(bits, h, weight, targets)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=0)
        # Logits recomputed from h_hat move by at most delta = |W| e_h per row, so each probability by at most
        # p (exp(2 delta) - 1), the bias of its row included (they are renormalized): d_logits' error is bounded.
        e_h = absmax_error_bound(h, bits).expand_as(h)
        h_hat = SaveSpec.restore(*SaveSpec(bits).save(h))
        delta = (e_h @ weight.abs().t()).max(-1, keepdim=True).values
        p = torch.softmax(F.linear(h, weight), -1)
        d_err = p * torch.expm1(2 * delta) * (targets != -100)[:, None] / (targets != -100).sum()
        d = (p - F.one_hot(targets.clamp_min(0), 64)) * (targets != -100)[:, None] / (targets != -100).sum()
        assert ((dh - hr.grad).abs() <= d_err @ weight.abs() * (1 + 1e-4) + 1e-7).all(), bits
        bound = d_err.t() @ h_hat.abs() + d.abs().t() @ e_h
        assert ((dw - wr.grad).abs() <= bound * (1 + 1e-4) + 1e-7).all(), bits
        errors.append((dw - wr.grad).norm() / wr.grad.norm())
    assert errors[0] < errors[1] < errors[2]


def test_the_chunked_loss_divides_by_num_items_in_batch_as_transformers_does():
    torch.manual_seed(0)
    h, weight, targets = torch.randn(8, 16), torch.randn(32, 16), torch.randint(0, 32, (8,))
    loss, _, _ = head_loss_grads(16, h, weight, targets, denom=torch.tensor(20))
    ref = F.cross_entropy(F.linear(h, weight), targets, reduction="sum") / 20
    torch.testing.assert_close(loss, ref, rtol=1e-6, atol=0)


def test_the_head_unit_keeps_neither_the_logits_nor_their_log_softmax():
    model = small_llama()
    ids = torch.randint(0, 64, (2, 16))
    find_units(model, "act_quant", kinds=["head"], low_bits=4, high_bits=8)
    h = model.model(input_ids=ids).last_hidden_state
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        logits = model.lm_head(h)
        model.loss_function(logits=logits, labels=ids, vocab_size=64).backward()
    assert logits.requires_grad  # still differentiable, for a loss of the caller's own
    # The head input, saved once, packed (the logits' own graph and the loss share the copy), its scale, the targets.
    codes = [t for t in seen if t.dtype == torch.uint8]
    assert len({t.untyped_storage().data_ptr() for t in codes}) == 1 and codes[0].numel() == 2 * 16 * 32 // 2
    floats = [t for t in seen if t.is_floating_point() and not isinstance(t, nn.Parameter)]
    assert sum(t.numel() for t in floats) <= 2  # scales: no logits, no log-softmax, no float head input


def test_the_head_unit_refuses_a_model_whose_loss_is_not_the_causal_lm_loss():
    model = small_llama()
    model.loss_function = lambda **kwargs: None
    with pytest.raises(ValueError, match="drop 'head' from kinds"):
        find_units(model, "act_quant", kinds=["head"])


@pytest.mark.parametrize("rows", [0, 8])  # every row, or a sample of 8 rows per measured tensor
def test_every_unit_of_kinds_all_reports_its_fidelity_on_both_paths(rows):
    model = small_llama()
    units = find_units(model, "act_quant", kinds="all", low_bits=2, high_bits=8)
    ids = torch.randint(0, 64, (2, 16))
    for unit in units:
        unit.meter.start(rows)
    for recovering in (False, True):
        for unit in units:
            unit.enter_recovery() if recovering else unit.exit_recovery()
        model(input_ids=ids, labels=ids).loss.backward()
        taken = {u.name: u.meter.take_loss() for u in units}
        assert all(t is not None and 0 < t.item() < float("inf") for t in taken.values()), taken
    units.close()


def test_the_benchmarks_count_from_shapes_matches_the_measurement_so_its_13b_table_can_be_trusted():
    import importlib.util
    import sys
    from pathlib import Path

    from gnmr_hf.experiments.pretrain import build_model, llama_config

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "act_quant_memory.py"
    spec = importlib.util.spec_from_file_location("act_quant_memory", path)
    bench = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = bench  # its dataclass looks its module up
    spec.loader.exec_module(bench)
    config = llama_config(32, 2, 2, 16)
    shapes = bench.Shapes(32, 2, 2, 2, config.intermediate_size, 256, batch=2, seq_len=16)
    ids = torch.randint(0, 256, (2, 16))
    assert bench.saved_bytes(build_model(config, 0), ids)["total"] == sum(bench.shape_bytes(shapes).values())
    for kinds, bits, scaling in [(("linear",), 16, "tensor"), (("linear",), 4, "row"), (bench.KINDS, 8, "row")]:
        model = build_model(config, 0)
        include = [bench.INCLUDE[k] for k in kinds]
        units = find_units(
            model, "act_quant", kinds=kinds, include=include, low_bits=bits, high_bits=16, scaling=scaling
        )
        measured = bench.saved_bytes(model, ids)["total"]
        assert measured == sum(bench.shape_bytes(shapes, kinds, bits, scaling).values()), (kinds, bits)
        units.close()


def test_a_norm_that_is_not_llamas_rms_norm_is_refused():
    class GemmaStyleRMSNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = nn.Parameter(torch.zeros(8))
            self.eps = 1e-6

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return (1 + self.weight) * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    with pytest.raises(ValueError, match="does not compute LLaMA's RMSNorm"):
        find_units(nn.Sequential(GemmaStyleRMSNorm()), "act_quant", kinds=["norm"])


def test_an_mlp_unit_is_scored_on_its_lora_adapters_and_a_frozen_one_on_its_output_gradient():
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(small_llama(), LoraConfig(r=2, target_modules=["gate_proj", "up_proj"]))
    units = {u.name: u for u in find_units(model, "act_quant", kinds=["mlp"])}
    mlp = model.base_model.model.model.layers[0].mlp
    expected = [*mlp.gate_proj.lora_A.default.parameters(), *mlp.gate_proj.lora_B.default.parameters()]
    expected += [*mlp.up_proj.lora_A.default.parameters(), *mlp.up_proj.lora_B.default.parameters()]
    unit = units["model.layers.0.mlp"]
    assert unit.signal == "gate_up_lora" and [id(t) for t in unit.signal_tensors()] == [id(t) for t in expected]
    frozen = small_llama().requires_grad_(False)
    unit = find_units(frozen, "act_quant", kinds=["mlp"])[0]
    assert unit.signal == "output_grad" and unit.output_grad is not None


def test_an_attention_unit_lives_while_its_module_does_even_when_its_unit_set_is_dropped():
    import gc

    from gnmr_hf.units import unit_of

    model = build_model(llama_config(d_model=32, n_layers=1, n_heads=2, seq_len=16, vocab_size=64), seed=0)
    attention = model.model.layers[0].self_attn
    find_units(model, "act_quant", include=[r"\.self_attn$"], kinds=["attention"], low_bits=4)  # result dropped
    gc.collect()
    unit = unit_of(attention)
    assert unit is not None and not unit.closed  # still quantizing what attention saves
    unit.close()
    assert "_gnmr_attention_unit" not in attention.__dict__ and unit_of(attention) is None


@pytest.mark.parametrize("backend", ["act_quant", "block_fp"])
def test_a_bitsandbytes_lora_model_is_refused_at_train_begin_naming_the_backend_and_what_fits(
    backend, tiny_llama_dir, dataset, tmp_path
):
    # Both backends compute F.linear on the module's own weight: on a Linear8bitLt that failed at the first forward
    # with "expected m1 and m2 to have the same dtype ... float != signed char". It is refused when the units are
    # built, before any forward, and leaves the model as found.
    pytest.importorskip("bitsandbytes")
    from gnmr_hf.units import unit_of

    from trainer_utils import make_trainer

    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, gnmr=GNMRConfig(backend=backend), spike_step=0)
    forwards = []
    trainer.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    with pytest.raises(ValueError) as err:
        trainer.train()
    message = str(err.value)
    assert message.startswith(f"backend '{backend}' cannot take a bitsandbytes.nn.modules.Linear8bitLt")
    assert "torch.int8" in message and "'bnb_int8'" in message and "'bnb_4bit'" in message
    assert not forwards
    assert all(unit_of(m) is None for m in trainer.model.modules())
