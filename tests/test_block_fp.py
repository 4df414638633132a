"""The `block_fp` backend: which GEMM inputs are rounded with which tiles, gradients within each format's bound of a
float64 reference, the recovery path, flips, options, carve-outs, and the recipe's tiny preset end to end.

The rounding itself (every representable value, midpoints, saturation, NaN/inf, block scales of `quantize_blocks`)
is tested in tests/test_quant.py; here it is the backend's use of it."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from gnmr_hf import GNMRConfig, find_units
from gnmr_hf.backends.block_fp import BlockFPOptions, GemmFormat, block_fp_linear
from gnmr_hf.experiments.faults import FaultyGemmFormat, clear_fault, inject_fault
from gnmr_hf.experiments.pretrain import build_model, llama_config
from gnmr_hf.quant import FORMATS, quantize_blocks, random_hadamard, rotate_rows

from trainer_utils import load_recipe

PROJECTIONS = [r"\.(q|k|v|o|gate|up|down)_proj$"]


def operands(seed: int = 0, m: int = 300, k: int = 256, n: int = 192):
    """x [2, m/2, k] with token magnitudes spread over decades, W [n, k], b [n], dy [2, m/2, n]: shapes that the 128
    tiles and blocks do not divide, so ragged blocks are exercised too."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp(2 * torch.randn(m, 1, generator=g))
    w = torch.randn(n, k, generator=g) / k**0.5
    dy = torch.randn(m, n, generator=g) * torch.exp(torch.randn(m, 1, generator=g))
    return x.view(2, m // 2, k), w, torch.randn(n, generator=g), dy.view(2, m // 2, n)


def run(x, w, b, dy, fmt: GemmFormat):
    """(y, dx, dW, db) of block_fp_linear."""
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = block_fp_linear(x, w, b, fmt)
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


def tiny_llama() -> nn.Module:
    return build_model(llama_config(d_model=32, n_layers=2, n_heads=2, seq_len=16), seed=0)


# ------------------------------------------------------------------------------------------------------ options


def test_options_come_as_keywords_config_fields_or_command_line_text():
    units = find_units(tiny_llama(), "block_fp", low_format="e2m1", high_format="bf16", scaling="mx")
    assert units[0].describe() == {"signal": "weight", "formats": "e2m1/bf16", "scaling": "mx"}
    config = GNMRConfig(backend="block_fp", backend_options="low_format=e2m3,quantize_lm_head=true")
    assert config.backend_options == {"low_format": "e2m3", "quantize_lm_head": "true"}
    options = BlockFPOptions.parse(config.backend_options)
    assert (options.low_format, options.high_format, options.quantize_lm_head) == ("e2m3", "e4m3", True)
    assert BlockFPOptions.parse(None) == BlockFPOptions(low_format="e3m2", high_format="e4m3", scaling="fp32")


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"low_format": "fp4"}, "'low_format' must be one of"),
        ({"high_format": "e3m2"}, "'high_format' must be one of ['e4m3', 'e5m2', 'bf16']"),
        ({"low_format": "e4m3", "high_format": "e4m3"}, "'high_format' must differ from low_format"),
        ({"scaling": "tile"}, "'scaling' must be one of ['fp32', 'mx', 'nvfp4']"),
        ({"scaling": "nvfp4"}, "'low_format' must be 'e2m1' with scaling='nvfp4'"),
        ({"low_format": "e2m1", "scaling": "nvfp4", "weight_blocks": "2d"}, "'weight_blocks' must be one of"),
        ({"weight_blocks": "1x16"}, "'weight_blocks' applies to scaling='nvfp4' only"),
        ("wgrad_rht=yes", "'wgrad_rht' must be bool"),
        ("stochastic_rounding=1", "'stochastic_rounding' must be bool"),
        ({"rounding_seed": -1}, "'rounding_seed' must be an int in 0..4294967295"),
        ("quantize_eval=sometimes", "'quantize_eval' must be bool"),
        ({"signal": "loss"}, "'signal' must be one of"),
        ({"bits": 6}, "unknown options ['bits']"),
    ],
)
def test_invalid_options_raise_an_error_naming_the_option(options, message):
    # Checked by the backend when the units are built (the config is a leaf).
    with pytest.raises((ValueError, TypeError), match=message.replace("[", r"\[").replace("]", r"\]")):
        find_units(tiny_llama(), "block_fp", backend_options=GNMRConfig(backend_options=options).backend_options)


def test_only_block_linears_are_units_and_lm_head_joins_only_when_asked():
    model = tiny_llama()
    names = [u.name for u in find_units(model, "block_fp")]
    assert len(names) == 2 * 7 and all(n.split(".")[-1].endswith("_proj") for n in names)
    for unit in find_units(model, "block_fp", quantize_lm_head=True, include=[r"lm_head"]):
        assert unit.name == "lm_head"
        unit.close()


def test_the_recipe_adds_lm_head_to_its_default_units_when_quantize_lm_head_is_set():
    module = recipe()
    model = tiny_llama()

    def names(options, include):
        units = find_units(model, "block_fp", include=include, backend_options=options)
        try:
            return [u.name for u in units]
        finally:
            units.close()

    head = "low_format=e2m1,quantize_lm_head=true"
    # Without the head in the default include, the projection-only default would filter it out without a word.
    assert names(head, module.DEFAULT_UNITS) == [*names(head, module.PROJECTIONS), "lm_head"]
    assert len(names(head, module.PROJECTIONS)) == 2 * 7  # an explicit --include is kept as given
    assert names("low_format=e2m1", module.DEFAULT_UNITS) == names(head, module.PROJECTIONS)
    # Without the head option the default leaves the head's pattern out, so find_units has no unmatched pattern to
    # warn about.
    assert module.default_units("block_fp", {"low_format": "e2m1"}) == module.PROJECTIONS
    assert module.default_units("block_fp", {"quantize_lm_head": "true"}) == module.DEFAULT_UNITS


# ------------------------------------------------------------------------------------------ what is rounded how


@pytest.mark.parametrize("scaling", ["fp32", "mx"])
def test_each_gemm_rounds_its_inputs_in_blocks_along_its_contraction_dimension(scaling):
    x, w, b, dy = operands()
    y, dx, dw, db = run(x, w, b, dy, GemmFormat("e3m2", scaling))
    x2, g2 = x.reshape(-1, 256), dy.reshape(-1, 192)
    if scaling == "fp32":
        # DeepSeek-V3: 1x128 tiles of x and dy along the channels, 128x128 weight blocks (one copy for fprop and
        # dgrad), and 128 tokens x 1 channel for both inputs of the wgrad, which sums over tokens.
        q = {"x": (1, 128), "w_fprop": (128, 128), "dy": (1, 128), "w_dgrad": (128, 128), "wgrad": (128, 1)}
        kwargs = {}
    else:
        q = {"x": (1, 32), "w_fprop": (1, 32), "dy": (1, 32), "w_dgrad": (32, 1), "wgrad": (32, 1)}
        kwargs = {"scale": "pow2"}

    def qb(t, block):
        return quantize_blocks(t, "e3m2", q[block], **kwargs)

    assert torch.equal(y.reshape(-1, 192), qb(x2, "x") @ qb(w, "w_fprop").t() + b)
    assert torch.equal(dx.reshape(-1, 256), qb(g2, "dy") @ qb(w, "w_dgrad"))
    assert torch.equal(dw, qb(g2, "wgrad").t() @ qb(x2, "wgrad"))
    assert torch.equal(db, g2.sum(0))  # the bias gradient is a sum, not a GEMM: exact


def test_an_outlier_coarsens_only_its_own_tiles():
    x, w, b, dy = operands()
    spiked = x.clone()
    spiked[0, 0, 3] = 1e4  # token 0, channel 3
    y0, _, dw0, _ = run(x, w, b, dy, GemmFormat("e2m1", "fp32"))
    y1, _, dw1, _ = run(spiked, w, b, dy, GemmFormat("e2m1", "fp32"))
    # fprop tiles are per token: only token 0's outputs change.
    changed_tokens = (y0 != y1).any(-1).flatten().nonzero().flatten().tolist()
    assert changed_tokens == [0]
    # wgrad tiles are 128 tokens of one channel: only channel 3's column of dW changes.
    assert (dw0 != dw1).any(0).nonzero().flatten().tolist() == [3]


def element_bound(t: torch.Tensor, fmt: str, block: tuple[int, int], scale: str = "fp32") -> torch.Tensor:
    """|round(t) - t| <= this, per element, in float64: half a quantum of the format at t / scale, times scale; with
    MX's power-of-two scales the largest elements of a block can lie above the format's max and saturate, so the
    bound is at least |t| - max * scale there."""
    t = t.double()
    if fmt == "bf16":
        return t.abs() * 2.0**-8
    f = FORMATS[fmt]
    _, s = quantize_blocks(t.float(), fmt, block, scale=scale, return_scales=True)
    s = s.double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)[: t.shape[0], : t.shape[1]]
    rounding = torch.maximum(t.abs() * 2.0 ** -(f.man_bits + 1), s * 2.0 ** (f.emin - f.man_bits - 1))
    return torch.maximum(rounding, t.abs() - f.max_finite * s)


def gemm_bound(a, block_a, b, block_b, fmt, scale="fp32"):
    """Bound on |round(a) @ round(b) - a @ b|: |ea| |b| + |a| |eb| + |ea| |eb|, plus float32 accumulation."""
    ea, eb = element_bound(a, fmt, block_a, scale), element_bound(b, fmt, block_b, scale)
    a, b = a.double().abs(), b.double().abs()
    return ea @ b + a @ eb + ea @ eb + a.shape[1] * 2.0**-23 * ((a + ea) @ (b + eb))


@pytest.mark.parametrize(
    ("fmt", "scaling"),
    [(f, "fp32") for f in ("e2m1", "e2m3", "e3m2", "e4m3", "e5m2", "bf16")]
    + [(f, "mx") for f in ("e2m1", "e2m3", "e3m2", "e4m3", "e5m2")],
)
def test_gradients_are_within_the_formats_bound_of_a_float64_reference(fmt, scaling):
    x, w, b, dy = operands(seed=1)
    y, dx, dw, _ = run(x, w, b, dy, GemmFormat(fmt, scaling))
    x2, g2 = x.reshape(-1, 256).double(), dy.reshape(-1, 192).double()
    w64 = w.double()
    # Blocks of each GEMM input as the bound sees it (the second input of the fprop is W^T): DeepSeek-V3's tiles and
    # symmetric weight blocks, or MX's 32 elements along the contraction dimension.
    if scaling == "fp32":
        blocks, scale = {"x": (1, 128), "wT": (128, 128), "w": (128, 128), "wgrad": (128, 1)}, "fp32"
    else:
        blocks, scale = {"x": (1, 32), "wT": (32, 1), "w": (32, 1), "wgrad": (32, 1)}, "pow2"
    checks = {
        "y": (
            y.reshape(-1, 192),
            x2 @ w64.t() + b.double(),
            gemm_bound(x2, blocks["x"], w64.t(), blocks["wT"], fmt, scale),
        ),
        "dx": (dx.reshape(-1, 256), g2 @ w64, gemm_bound(g2, blocks["x"], w64, blocks["w"], fmt, scale)),
        "dW": (dw, g2.t() @ x2, gemm_bound(g2.t(), blocks["x"], x2, blocks["wgrad"], fmt, scale)),
    }
    for name, (got, exact, bound) in checks.items():
        error = (got.double() - exact).abs()
        assert (error <= bound * (1 + 1e-6)).all(), (name, (error / bound).max().item())
        # Not vacuous: the rounding is really there, and the bound is not orders of magnitude loose.
        assert 1e-3 < (error / bound).max() <= 1, name


def test_a_non_finite_value_stays_visible_in_its_own_blocks():
    x, w, b, dy = operands()
    x[0, 5, 0] = torch.inf
    dy[1, 0, 0] = torch.nan
    y, dx, dw, _ = run(x, w, b, dy, GemmFormat("e3m2", "fp32"))
    assert y.reshape(-1, 192).isnan().any(-1).nonzero().flatten().tolist() == [5]
    assert dw.isnan().any() and dx.isnan().any() and not dx.isnan().all()


def test_under_autocast_the_output_is_autocasts_dtype_but_the_emulation_stays_float32():
    x, w, b, _ = operands()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = block_fp_linear(x, w, b, GemmFormat("e3m2", "fp32"))
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, block_fp_linear(x, w, b, GemmFormat("e3m2", "fp32")).bfloat16())


# ----------------------------------------------------------------------------------------------- the unit


def linear_unit(**options):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 192))
    (unit,) = find_units(model, "block_fp", **options)
    return model, unit


def test_the_cheap_path_is_low_format_and_recovery_the_high_format_closer_to_exact():
    x = operands()[0]
    model, unit = linear_unit(low_format="e2m1", high_format="e4m3")
    w, b = model[0].weight.detach(), model[0].bias.detach()
    exact = F.linear(x.double(), w.double(), b.double())
    cheap = model(x)
    unit.enter_recovery()
    recovered = model(x)
    assert torch.equal(cheap, block_fp_linear(x, w, b, GemmFormat("e2m1", "fp32")))
    assert torch.equal(recovered, block_fp_linear(x, w, b, GemmFormat("e4m3", "fp32")))
    assert (recovered - exact).norm() < (cheap - exact).norm() / 4
    unit.exit_recovery()
    assert torch.equal(model(x), cheap)


def test_a_flip_takes_effect_at_the_next_step_adds_nothing_and_leaves_the_optimizer_alone():
    x, _, _, dy = operands()
    model, unit = linear_unit(low_format="e2m1", high_format="e4m3")
    lin = model[0]
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x).backward(dy)
    optimizer.step()
    optimizer.zero_grad()
    params, buffers = [id(p) for p in model.parameters()], [id(t) for t in model.buffers()]
    keys, groups = list(model.state_dict()), [list(map(id, g["params"])) for g in optimizer.param_groups]
    state = {id(p): {k: id(v) for k, v in s.items()} for p, s in optimizer.state.items()}
    w, b = lin.weight.detach().clone(), lin.bias.detach().clone()

    y = model(x)
    unit.enter_recovery()  # between a step's forward and its backward
    y.backward(dy)
    # The step in flight finishes on the format its forward started with...
    assert torch.equal(lin.weight.grad, run(x, w, b, dy, GemmFormat("e2m1", "fp32"))[2])
    lin.weight.grad = None
    model(x).backward(dy)
    # ...and the next step runs on the recovery format.
    assert torch.equal(lin.weight.grad, run(x, w, b, dy, GemmFormat("e4m3", "fp32"))[2])

    assert [id(p) for p in model.parameters()] == params and [id(t) for t in model.buffers()] == buffers
    assert list(model.state_dict()) == keys
    assert [list(map(id, g["params"])) for g in optimizer.param_groups] == groups
    assert {id(p): {k: id(v) for k, v in s.items()} for p, s in optimizer.state.items()} == state
    assert torch.equal(lin.weight, w) and torch.equal(lin.bias, b)
    assert unit.ledger.peak_bytes == 0 and unit.recovery_bytes() == 0 and unit.ledger.live_units == 1
    unit.close()
    assert "forward" not in lin.__dict__


def test_an_injected_fault_corrupts_only_the_cheap_paths_input_and_shows_in_its_fidelity_on_both_paths():
    x, _, _, dy = operands()
    model, unit = linear_unit(low_format="e3m2", high_format="e4m3")
    w, b = model[0].weight.detach(), model[0].bias.detach()
    cheap = GemmFormat("e3m2", "fp32")
    inject_fault(unit, 30.0, 16)  # every 16th token's input reads 30x its value
    assert (unit.low.fault_scale, unit.low.fault_stride) == (30.0, 16)
    faulty = FaultyGemmFormat("e3m2", "fp32", 30.0, 16)

    def grads():
        model.zero_grad()
        y = model(x)
        y.backward(dy)
        return y.detach(), model[0].weight.grad.clone()

    # By hand: the input's rounded copy, every 16th token times 30, in the fprop and in the wgrad.
    x2 = x.reshape(-1, x.shape[-1])
    rows = torch.ones(len(x2), 1)
    rows[::16] = 30.0
    g2 = dy.reshape(-1, dy.shape[-1])
    y, dw = grads()
    wq = cheap.operand(w, 1, weight=True)
    torch.testing.assert_close(y.reshape(-1, y.shape[-1]), (cheap.operand(x2, 1) * rows) @ wq.t() + b)
    torch.testing.assert_close(dw, cheap.operand(g2, 0).t() @ (cheap.operand(x2, 0) * rows))
    assert torch.equal(y, run(x, w, b, dy, faulty)[0])
    index = torch.tensor([0, 5, 16, 17, 32, 299])  # rows rounded apart read the fault where the whole copy does
    assert torch.equal(faulty.fault_rows(cheap.operand(x2[index], 1), index), faulty.input_operand(x2, 1)[index])
    assert not torch.allclose(y, run(x, w, b, dy, cheap)[0])
    # Recovery reads a correct copy.
    unit.enter_recovery()
    assert torch.equal(grads()[1], run(x, w, b, dy, GemmFormat("e4m3", "fp32"))[2])
    unit.exit_recovery()

    # The loss of the faulty copy: past its bound, the same measured on the cheap path and in recovery (the rows
    # rounded apart read the fault where the whole copy does); without the fault, far under it.
    unit.meter.start()  # every row: the two measures read the same rows
    grads()
    on_cheap = unit.meter.take_loss().item()
    unit.enter_recovery()
    grads()
    in_recovery = unit.meter.take_loss().item()
    unit.exit_recovery()
    clear_fault(unit)
    grads()
    clean = unit.meter.take_loss().item()
    assert on_cheap > 1.0 and in_recovery == pytest.approx(on_cheap, rel=1e-5) and clean < 0.2


def test_a_fault_on_the_output_gradient_corrupts_only_the_cheap_paths_dgrad_and_wgrad_and_shows_in_its_fidelity():
    x, w, b, dy = operands()
    cheap = GemmFormat("e3m2", "fp32")
    faulty = FaultyGemmFormat("e3m2", "fp32", 30.0, 16, "grad")
    # By hand: the output gradient's rounded copy, every 16th token times 30, in the dgrad and in the wgrad; the
    # fprop and the input's copy untouched.
    x2, g2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    rows = torch.ones(len(g2), 1)
    rows[::16] = 30.0
    y, dx, dw, _ = run(x, w, b, dy, faulty)
    assert torch.equal(y, run(x, w, b, dy, cheap)[0])
    torch.testing.assert_close(
        dx.reshape(len(g2), -1), (cheap.operand(g2, 1) * rows) @ cheap.operand(w, 0, weight=True)
    )
    torch.testing.assert_close(dw, (cheap.operand(g2, 0) * rows).t() @ cheap.operand(x2, 0))
    index = torch.tensor([0, 5, 16, 17, 32, 299])
    assert torch.equal(
        faulty.fault_rows(cheap.operand(g2[index], 1), index, "grad"), faulty.grad_operand(g2, 1)[index]
    )
    assert torch.equal(faulty.fault_rows(cheap.operand(x2[index], 1), index), cheap.operand(x2[index], 1))

    model, unit = linear_unit(low_format="e3m2", high_format="e4m3")
    inject_fault(unit, 30.0, 16, "grad")
    assert unit.low == FaultyGemmFormat("e3m2", "fp32", 30.0, 16, "grad") and unit.high == GemmFormat("e4m3", "fp32")

    def loss():
        model.zero_grad()
        model(x).backward(dy)
        return unit.meter.take_loss().item()

    # Past its bound on the cheap path and the same measured in recovery (its cheap rounding of the sampled rows
    # reads the fault where the whole copy does); without the fault, far under it.
    unit.meter.start()
    on_cheap = loss()
    unit.enter_recovery()
    in_recovery = loss()
    unit.exit_recovery()
    clear_fault(unit)
    assert on_cheap > 1.0 and in_recovery == pytest.approx(on_cheap, rel=1e-5) and loss() < 0.2


def test_a_fault_operand_must_be_the_input_or_the_output_gradient():
    _, unit = linear_unit()
    with pytest.raises(ValueError, match=r"fault_operand must be one of \('input', 'grad'\), got 'weight'"):
        inject_fault(unit, 30.0, operand="weight")


def test_a_fault_stride_must_be_a_positive_int():
    _, unit = linear_unit()
    for bad in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="fault_stride must be an int >= 1"):
            inject_fault(unit, 30.0, stride=bad)


def test_eval_mode_runs_the_plain_matmul_unless_quantize_eval():
    x = operands()[0]
    for quantize_eval in (False, True):
        model, unit = linear_unit(low_format="e2m1", quantize_eval=quantize_eval)
        with torch.no_grad():
            train = model(x)
            model.eval()
            evaluated = model(x)
        plain = F.linear(x, model[0].weight, model[0].bias)
        assert torch.equal(evaluated, train if quantize_eval else plain)
        assert not torch.equal(train, plain)
        unit.close()
        # Closed (as the callback closes every unit at train end), the module is the plain one either way: an
        # evaluation after training reads the exact model (docs/block_fp.md).
        with torch.no_grad():
            assert torch.equal(model(x), plain)


# ------------------------------------------------------------------------------------ NVFP4 (scaling="nvfp4")

NVFP4 = "low_format=e2m1,high_format=bf16,scaling=nvfp4"


def nvfp4(t: torch.Tensor, block: tuple[int, int], **kwargs) -> torch.Tensor:
    return quantize_blocks(t, "e2m1", block, scale="nvfp4", **kwargs)


class Unrounded(GemmFormat):
    """A GemmFormat whose rounding is off (each operand as it is): what is left is the wiring around it."""

    def operand(self, t, contract, *, weight=False, generator=None):
        return t.to(torch.promote_types(t.dtype, torch.float32))


@pytest.mark.parametrize(
    ("weight_blocks", "w_fprop", "w_dgrad"), [("16x16", (16, 16), (16, 16)), ("1x16", (1, 16), (16, 1))]
)
def test_nvfp4_rounds_each_gemm_in_16_element_blocks_along_its_contraction_dimension(weight_blocks, w_fprop, w_dgrad):
    x, w, b, dy = operands()
    y, dx, dw, _ = run(x, w, b, dy, GemmFormat("e2m1", "nvfp4", weight_blocks=weight_blocks))
    x2, g2 = x.reshape(-1, 256), dy.reshape(-1, 192)
    assert torch.equal(y.reshape(-1, 192), nvfp4(x2, (1, 16)) @ nvfp4(w, w_fprop).t() + b)
    assert torch.equal(dx.reshape(-1, 256), nvfp4(g2, (1, 16)) @ nvfp4(w, w_dgrad))
    assert torch.equal(dw, nvfp4(g2, (16, 1)).t() @ nvfp4(x2, (16, 1)))


def test_16x16_weight_blocks_give_the_forward_and_the_backward_the_same_quantized_weight():
    w = operands()[1]
    square, rows = GemmFormat("e2m1", "nvfp4"), GemmFormat("e2m1", "nvfp4", weight_blocks="1x16")
    assert torch.equal(square.operand(w, 1, weight=True), square.operand(w, 0, weight=True))
    assert not torch.equal(rows.operand(w, 1, weight=True), rows.operand(w, 0, weight=True))


def test_nvfp4_gradients_are_within_the_formats_bound_of_a_float64_reference():
    x, w, b, dy = operands(seed=1)
    y, dx, dw, _ = run(x, w, b, dy, GemmFormat("e2m1", "nvfp4"))
    x2, g2, w64 = x.reshape(-1, 256).double(), dy.reshape(-1, 192).double(), w.double()
    checks = {
        "y": (
            y.reshape(-1, 192),
            x2 @ w64.t() + b.double(),
            gemm_bound(x2, (1, 16), w64.t(), (16, 16), "e2m1", "nvfp4"),
        ),
        "dx": (dx.reshape(-1, 256), g2 @ w64, gemm_bound(g2, (1, 16), w64, (16, 16), "e2m1", "nvfp4")),
        "dW": (dw, g2.t() @ x2, gemm_bound(g2.t(), (1, 16), x2, (16, 1), "e2m1", "nvfp4")),
    }
    for name, (got, exact, bound) in checks.items():
        error = (got.double() - exact).abs()
        assert (error <= bound * (1 + 1e-6)).all(), (name, (error / bound).max().item())
        assert 1e-3 < (error / bound).max() <= 1, name


def test_the_nvfp4_options_reach_the_cheap_path_and_an_fp8_recovery_keeps_fp32_scaling():
    units = find_units(
        tiny_llama(), "block_fp", backend_options=NVFP4.replace("bf16", "e4m3") + ",wgrad_rht=true,weight_blocks=1x16"
    )
    low, high = units[0].low, units[0].high
    assert (low.fmt, low.scaling, low.weight_blocks, low.wgrad_rht, low.stochastic_rounding) == (
        "e2m1", "nvfp4", "1x16", True, False,
    )  # fmt: skip
    assert (high.fmt, high.scaling, high.wgrad_rht) == ("e4m3", "fp32", False)
    assert units[0].describe()["scaling"] == "nvfp4"
    units.close()


def test_wgrad_rht_leaves_every_gemm_unchanged_when_rounding_is_off():
    x, w, b, dy = operands()
    x, w, b, dy = x.double(), w.double(), b.double(), dy.double()
    plain = run(x, w, b, dy, Unrounded("e2m1", "nvfp4"))
    rotated = run(x, w, b, dy, Unrounded("e2m1", "nvfp4", wgrad_rht=True))
    assert torch.equal(rotated[0], plain[0]) and torch.equal(rotated[1], plain[1])  # y and dx: not rotated
    torch.testing.assert_close(rotated[2], plain[2], rtol=1e-12, atol=1e-12)  # 300 tokens: padded to 304
    torch.testing.assert_close(plain[2], dy.reshape(-1, 192).t() @ x.reshape(-1, 256), rtol=1e-12, atol=1e-12)


def test_wgrad_rht_rotates_both_inputs_of_the_weight_gradient_gemm_before_rounding_them():
    x, w, b, dy = operands()
    _, dx, dw, _ = run(x, w, b, dy, GemmFormat("e2m1", "nvfp4", wgrad_rht=True, seed=3))
    h = random_hadamard(16, seed=3)
    x2, g2 = x.reshape(-1, 256), dy.reshape(-1, 192)
    assert torch.equal(dw, nvfp4(rotate_rows(g2, h), (16, 1)).t() @ nvfp4(rotate_rows(x2, h), (16, 1)))
    assert torch.equal(dx, run(x, w, b, dy, GemmFormat("e2m1", "nvfp4"))[1])


def test_stochastic_rounding_rounds_only_the_output_gradient_and_never_reads_torchs_rng():
    x, w, b, dy = operands()
    fmt = GemmFormat("e2m1", "nvfp4", stochastic_rounding=True, draw=5)
    nearest = run(x, w, b, dy, GemmFormat("e2m1", "nvfp4"))
    torch.manual_seed(0)
    first = run(x, w, b, dy, fmt)
    torch.manual_seed(1)
    second = run(x, w, b, dy, fmt)
    assert all(torch.equal(one, other) for one, other in zip(first, second, strict=True))
    assert torch.equal(first[0], nearest[0])  # the forward rounds to nearest
    assert not torch.equal(first[1], nearest[1]) and not torch.equal(first[2], nearest[2])
    g2 = dy.reshape(-1, 192)
    assert torch.equal(
        first[1].reshape(-1, 256),
        nvfp4(g2, (1, 16), stochastic=True, generator=fmt.grad_generator(g2.device, 1)) @ nvfp4(w, (16, 16)),
    )


def test_stochastic_rounding_draws_anew_in_each_training_pass_and_the_same_in_every_process():
    x, _, _, dy = operands()

    def two_passes(global_seed):
        torch.manual_seed(global_seed)
        model = nn.Sequential(nn.Linear(256, 192))
        with torch.no_grad():
            model[0].weight.copy_(operands()[1])
        find_units(model, "block_fp", backend_options=NVFP4 + ",stochastic_rounding=true")
        grads = []
        for _ in range(2):
            model(x).backward(dy)
            grads.append(model[0].weight.grad.clone())
            model[0].weight.grad = None
        return grads

    a, b = two_passes(0), two_passes(1)  # two "ranks" whose torch RNGs differ
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], a[1])


def test_a_unit_restored_from_its_state_draws_what_the_uninterrupted_unit_drew():
    x, _, _, dy = operands()
    model, unit = linear_unit(low_format="e2m1", high_format="bf16", scaling="nvfp4", stochastic_rounding=True)
    model(x).backward(dy)
    state = json.loads(json.dumps(unit.meter_state()))  # as a checkpoint keeps it
    assert state == {"rounding_passes": 1}
    model[0].weight.grad = None
    model(x).backward(dy)
    uninterrupted = model[0].weight.grad.clone()
    unit.close()
    resumed_model, resumed = linear_unit(
        low_format="e2m1", high_format="bf16", scaling="nvfp4", stochastic_rounding=True
    )
    resumed.load_meter_state(state)
    resumed_model(x).backward(dy)
    assert torch.equal(resumed_model[0].weight.grad, uninterrupted)
    with pytest.raises(ValueError, match="'rounding_passes' must be an int >= 0"):
        resumed.load_meter_state({"rounding_passes": -1})


def test_a_resumed_training_run_with_stochastic_rounding_repeats_the_uninterrupted_run(tmp_path):
    from transformers import Trainer, TrainingArguments

    from gnmr_hf import GNMRCallback
    from gnmr_hf.experiments.pretrain import block_dataset

    tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(0))
    options = NVFP4 + ",wgrad_rht=true,stochastic_rounding=true"

    def train(out, resume=None, **save):
        model = build_model(llama_config(d_model=32, n_layers=2, n_heads=2, seq_len=32), seed=0)
        args = TrainingArguments(
            output_dir=str(out), max_steps=4, per_device_train_batch_size=4, use_cpu=True, report_to=[],
            disable_tqdm=True, train_sampling_strategy="sequential", learning_rate=1e-2, seed=0, logging_steps=1,
            **save,
        )  # fmt: skip
        callback = GNMRCallback(GNMRConfig(backend="block_fp", backend_options=options, include=[r"_proj$"]))
        trainer = Trainer(model=model, args=args, train_dataset=block_dataset(tokens, 32, 32, 0), callbacks=[callback])
        trainer.train(resume_from_checkpoint=resume)
        return [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]

    reference = train(tmp_path / "run", save_strategy="steps", save_steps=2)  # uninterrupted, checkpoint at step 2
    state_file = tmp_path / "run" / "checkpoint-2" / "trainer_state.json"
    saved = json.loads(state_file.read_text())["stateful_callbacks"]["GNMRCallback"]["attributes"]
    passes = [state["rounding_passes"] for state in saved["unit_fidelity_state"].values()]
    assert passes == [2] * 14  # one training pass per step, carried by the checkpoint
    resume = str(tmp_path / "run" / "checkpoint-2")
    assert train(tmp_path / "run", resume=resume) == reference  # steps 1-2 restored from the checkpoint, 3-4 rerun
    # Not vacuous: without the count the resumed units draw the first steps' numbers again.
    edited = json.loads(state_file.read_text())
    edited["stateful_callbacks"]["GNMRCallback"]["attributes"]["unit_fidelity_state"] = None
    state_file.write_text(json.dumps(edited))
    assert train(tmp_path / "run", resume=resume)[2:] != reference[2:]


def test_an_injected_fault_keeps_the_units_nvfp4_recipe():
    _, unit = linear_unit(low_format="e2m1", high_format="bf16", scaling="nvfp4", wgrad_rht=True, rounding_seed=4)
    recipe = unit.low
    inject_fault(unit, 30.0, 16)
    assert (unit.low.scaling, unit.low.wgrad_rht, unit.low.seed) == ("nvfp4", True, 4)
    clear_fault(unit)
    assert unit.low == recipe


# ---------------------------------------------------------------------------------------------- end to end


def recipe():
    return load_recipe("pretrain_dynamic_precision")


def test_the_tiny_preset_runs_end_to_end(tmp_path, text_dir, one_thread):
    out = tmp_path / "run"
    results = recipe().main(
        [
            *("--preset", "tiny", "--output_dir", str(out), "--corpus", str(text_dir)),
            *("--arms", "reference", "static_low", "gnmr", "random", "--max_steps", "6", "--eval_steps", "3"),
            *("--backend_options", "low_format=e2m1", "--alpha", "1.01", "--min_history", "1", "--window", "1"),
        ]
    )
    assert [r["arm"] for r in results] == ["reference", "static_low", "gnmr", "random"]
    assert all(r["final_eval_loss"] < 5.6 for r in results)  # below ln(256): it learned something
    gnmr = json.loads((out / "gnmr" / "seed0" / "result.json").read_text())
    assert gnmr["units"] == 2 * 7 and gnmr["backend_options"] == {"low_format": "e2m1"}
    assert 0 < gnmr["recovery_fraction"] <= 4 / 14 and gnmr["ledger_peak_bytes"] == 0
    table = (out / "results.md").read_text()
    assert len([line for line in table.splitlines() if line.startswith("|")]) == 2 + 4
    assert "saved MB/step" not in table and "Saved for backward: " in table  # block_fp's formats cannot change it
    assert (out / "loss_curves.png").is_file()


def test_quantize_eval_reads_the_cheap_paths_during_training_and_the_exact_model_after(tmp_path, text_dir, one_thread):
    # docs/block_fp.md: one run gives both readings; the option changes no step of the training itself.
    runs = {}
    for quantize_eval in ("false", "true"):
        (result,) = recipe().main(
            [
                *("--preset", "tiny", "--output_dir", str(tmp_path / quantize_eval), "--corpus", str(text_dir)),
                *("--arms", "static_low", "--max_steps", "2", "--eval_steps", "2", "--logging_steps", "1"),
                *("--backend_options", f"low_format=e2m1,quantize_eval={quantize_eval}", "--plot", "False"),
            ]
        )
        runs[quantize_eval] = result
    plain, cheap = runs["false"], runs["true"]
    assert plain["train_loss"] == cheap["train_loss"]
    assert plain["final_eval_loss"] == cheap["final_eval_loss"]  # after train end the units are closed: exact
    (during_plain, after_plain), (during_cheap, _) = plain["eval_loss"], cheap["eval_loss"]
    assert during_plain == after_plain  # the same exact model, evaluated twice
    assert during_cheap[1] != after_plain[1]  # during training, on its FP4 paths
