"""gnmr_hf.quant: integer absmax quantization with packing, low-bit float rounding and block scaling.

Expected values never come from the code under test. Every value of a float format is enumerated with Python
floats from its definition (sign, exponent code, mantissa code); neighbours, midpoints and the nearest value of
a random input come from that table; block scales come from a per-block loop written out in the test.
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import pytest
import torch

from gnmr_hf import quant
from gnmr_hf.quant import (
    FORMATS,
    QuantizedTensor,
    absmax_error_bound,
    pack_codes,
    quantize_absmax,
    quantize_blocks,
    quantized_nbytes,
    round_to_format,
    unpack_codes,
)

NAN, INF = math.nan, math.inf

# The definitions: exponent bits, mantissa bits, and which top codes are special. "mx": none (OCP MX v1.0 element
# types); "fn": only S.1111.111 is NaN (OCP FP8 E4M3FN); "ieee": the top exponent code is inf/NaN (OCP FP8 E5M2).
SPEC = {"e2m1": (2, 1, "mx"), "e2m3": (2, 3, "mx"), "e3m2": (3, 2, "mx"), "e4m3": (4, 3, "fn"), "e5m2": (5, 2, "ieee")}
MX_FORMATS = ["e2m1", "e2m3", "e3m2"]
ALL_BITS = [2, 3, 4, 5, 6, 7, 8]


def finite_values(fmt: str) -> list[tuple[float, int]]:
    """(value, mantissa code) of every finite value >= 0 of `fmt`, ascending."""
    e_bits, m_bits, special = SPEC[fmt]
    bias = 2 ** (e_bits - 1) - 1
    top = 2**e_bits - 1
    out = []
    for e in range(2**e_bits):
        for m in range(2**m_bits):
            if (special == "ieee" and e == top) or (special == "fn" and e == top and m == 2**m_bits - 1):
                continue
            significand = m / 2**m_bits if e == 0 else 1 + m / 2**m_bits
            out.append((2.0 ** (max(e, 1) - bias) * significand, m))
    return sorted(out)


def signed_table(fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """All finite values of `fmt`, both signs, ascending (float64), and their mantissa codes."""
    pos = finite_values(fmt)
    values = [-v for v, _ in reversed(pos[1:])] + [v for v, _ in pos]
    codes = [m for _, m in reversed(pos[1:])] + [m for _, m in pos]
    return torch.tensor(values, dtype=torch.float64), torch.tensor(codes)


def nearest_in_table(fmt: str, x: torch.Tensor) -> torch.Tensor:
    """Reference rounding: the nearest table value to each (finite) x, ties to the even mantissa, saturating."""
    values, codes = signed_table(fmt)
    x = x.double().clamp(values[0], values[-1])
    hi = torch.searchsorted(values, x).clamp(1, len(values) - 1)
    lo = hi - 1
    d_lo, d_hi = x - values[lo], values[hi] - x
    pick_hi = (d_hi < d_lo) | ((d_hi == d_lo) & (codes[hi] % 2 == 0))
    return torch.where(pick_hi, values[hi], values[lo]).float()


def f32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------------------------
# round_to_format
# ----------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", list(SPEC))
def test_format_constants_match_the_definition(fmt):
    e_bits, m_bits, special = SPEC[fmt]
    table = finite_values(fmt)
    f = FORMATS[fmt]
    assert (f.exp_bits, f.man_bits, f.bias) == (e_bits, m_bits, 2 ** (e_bits - 1) - 1)
    assert f.max_finite == table[-1][0]
    assert f.min_subnormal == table[1][0]
    assert f.min_normal == 2.0 ** (1 - f.bias) == f.min_subnormal * 2**m_bits
    assert f.emax == math.floor(math.log2(f.max_finite))
    assert (f.has_inf, f.has_nan) == (special == "ieee", special != "mx")


def test_format_maxima_are_the_spec_values():
    assert {name: f.max_finite for name, f in FORMATS.items()} == {
        "e2m1": 6.0,
        "e2m3": 7.5,
        "e3m2": 28.0,
        "e4m3": 448.0,
        "e5m2": 57344.0,
    }


@pytest.mark.parametrize("fmt", list(SPEC))
def test_every_representable_value_round_trips(fmt):
    values, _ = signed_table(fmt)
    x = values.float()
    assert torch.equal(round_to_format(x, fmt), x)


@pytest.mark.parametrize("fmt", list(SPEC))
def test_midpoints_round_to_the_neighbour_with_even_mantissa(fmt):
    table = finite_values(fmt)
    mids, expected = [], []
    for (a, ma), (b, mb) in itertools.pairwise(table):
        assert (ma % 2 == 0) != (mb % 2 == 0)  # neighbours always differ in mantissa parity
        mids.append((a + b) / 2)
        expected.append(a if ma % 2 == 0 else b)
    mids_t, expected_t = f32(mids), f32(expected)
    assert torch.equal(round_to_format(mids_t, fmt), expected_t)
    assert torch.equal(round_to_format(-mids_t, fmt), -expected_t)


@pytest.mark.parametrize("fmt", list(SPEC))
def test_values_next_to_a_midpoint_go_to_the_nearer_neighbour(fmt):
    table = finite_values(fmt)
    lower, upper = f32([a for a, _ in table[:-1]]), f32([b for b, _ in table[1:]])
    mids = (lower + upper) / 2  # exact: both have few significant bits
    above = torch.nextafter(mids, torch.full_like(mids, INF))
    below = torch.nextafter(mids, torch.full_like(mids, -INF))
    assert torch.equal(round_to_format(above, fmt), upper)
    assert torch.equal(round_to_format(below, fmt), lower)
    assert torch.equal(round_to_format(-above, fmt), -upper)
    assert torch.equal(round_to_format(-below, fmt), -lower)


@pytest.mark.parametrize("fmt", list(SPEC))
def test_random_values_round_to_the_nearest_representable_value(fmt):
    f = FORMATS[fmt]
    g = torch.Generator().manual_seed(0)
    # log-uniform magnitudes from far below the smallest subnormal to far above the maximum, both signs
    lo, hi = math.log2(f.min_subnormal) - 4, math.log2(f.max_finite) + 4
    x = torch.exp2(torch.rand(20_000, generator=g) * (hi - lo) + lo)
    x = torch.where(torch.rand(20_000, generator=g) < 0.5, -x, x)
    assert torch.equal(round_to_format(x, fmt), nearest_in_table(fmt, x))


@pytest.mark.parametrize("fmt", list(SPEC))
def test_overflow_saturates_to_max(fmt):
    m = FORMATS[fmt].max_finite
    x = f32([m * 1.01, m * 1.5, m * 4, 1e30, 3.4e38, -m * 1.01, -1e30, -3.4e38])
    assert round_to_format(x, fmt).tolist() == [m, m, m, m, m, -m, -m, -m]


@pytest.mark.parametrize("fmt", list(SPEC))
def test_subnormal_range_is_rounded_exactly(fmt):
    f = FORMATS[fmt]
    # every multiple of min_subnormal / 8 up to min_normal: Python's round() is half-to-even, like the formats
    grid = [k * f.min_subnormal / 8 for k in range(8 * 2**f.man_bits + 1)]
    expected = [round(v / f.min_subnormal) * f.min_subnormal for v in grid]
    assert round_to_format(f32(grid), fmt).tolist() == expected
    assert round_to_format(-f32(grid), fmt).tolist() == [-v for v in expected]


@pytest.mark.parametrize("fmt", list(SPEC))
def test_nan_stays_nan_and_inf_stays_inf(fmt):
    y = round_to_format(f32([NAN, INF, -INF, 1.0]), fmt)
    assert math.isnan(y[0]) and y[1:].tolist() == [INF, -INF, 1.0]


@pytest.mark.parametrize("fmt", list(SPEC))
def test_zero_keeps_its_sign(fmt):
    tiny = FORMATS[fmt].min_subnormal / 4  # rounds to zero
    y = round_to_format(f32([0.0, -0.0, tiny, -tiny]), fmt)
    assert y.tolist() == [0.0, 0.0, 0.0, 0.0]
    assert y.signbit().tolist() == [False, True, False, True]


def test_bf16_and_fp16_inputs_are_rounded_from_their_exact_float32_values():
    x = torch.randn(1000, generator=torch.Generator().manual_seed(1)) * 10
    for dtype in (torch.bfloat16, torch.float16):
        y = round_to_format(x.to(dtype), "e3m2")
        assert y.dtype == torch.float32
        assert torch.equal(y, round_to_format(x.to(dtype).float(), "e3m2"))


def test_inputs_are_never_modified():
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(2))
    before = x.clone()
    for fmt in SPEC:
        round_to_format(x, fmt)
        quantize_blocks(x, fmt)
        quantize_blocks(x, fmt, scale="pow2")
    for bits in ALL_BITS:
        quantize_absmax(x, bits, group_size=32)
        quantize_absmax(x, bits, stochastic=True)
    assert torch.equal(x, before)


def test_hand_written_rounding_matches_torch_float8_casts():
    """The bit-level rounding used for FP4/FP6 gives the same results as torch's own float8 casts when it is
    pointed at e4m3 and e5m2, whose subnormals start at other exponents (a cross-check of the method)."""
    from gnmr_hf.quant import _round_

    g = torch.Generator().manual_seed(3)
    x = torch.exp2(torch.rand(50_000, generator=g) * 40 - 24) * torch.randn(50_000, generator=g).sign()
    x = torch.cat([x, f32([NAN, INF, -INF, 0.0, -0.0])])
    for fmt in ("e4m3", "e5m2"):
        by_hand = _round_(x.clone(), dataclasses.replace(FORMATS[fmt], torch_dtype=None))
        by_torch = _round_(x.clone(), FORMATS[fmt])
        torch.testing.assert_close(by_hand, by_torch, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_finite_results_match_torchao_reference(fmt):
    utils = pytest.importorskip("torchao.prototype.custom_fp_utils")
    e_bits, m_bits, _ = SPEC[fmt]
    values, _ = signed_table(fmt)
    g = torch.Generator().manual_seed(4)
    x = torch.cat([values.float(), (values[1:] + values[:-1]).float() / 2, torch.randn(20_000, generator=g) * 4])
    reference = utils._floatx_unpacked_to_f32(utils._f32_to_floatx_unpacked(x, e_bits, m_bits), e_bits, m_bits)
    assert torch.equal(round_to_format(x, fmt), reference)
    # ... and the reason not to use it: it turns NaN into a finite number.
    nan_code = utils._f32_to_floatx_unpacked(f32([NAN]), e_bits, m_bits)
    assert torch.isfinite(utils._floatx_unpacked_to_f32(nan_code, e_bits, m_bits)).all()


ML_DTYPES = {"e2m1": "float4_e2m1fn", "e2m3": "float6_e2m3fn", "e3m2": "float6_e3m2fn"}


@pytest.mark.parametrize("fmt", MX_FORMATS)
def test_finite_results_match_ml_dtypes_bit_for_bit(fmt):
    ml_dtypes = pytest.importorskip("ml_dtypes")
    np = pytest.importorskip("numpy")
    values, _ = signed_table(fmt)
    g = torch.Generator().manual_seed(6)
    spread = torch.randn(50_000, generator=g) * torch.exp2(torch.randint(-12, 8, (50_000,), generator=g).float())
    mids = (values[1:] + values[:-1]).float() / 2
    x = torch.cat([values.float(), mids, mids.nextafter(f32(INF)), mids.nextafter(f32(-INF)), spread, f32([1e30])])
    dtype = getattr(ml_dtypes, ML_DTYPES[fmt])
    reference = torch.from_numpy(x.numpy().astype(dtype).astype(np.float32))
    assert torch.equal(round_to_format(x, fmt), reference)
    # ... and why the library does not replace this module: NaN comes back as -0, inf as +-max.
    special = np.array([NAN, INF], dtype=np.float32).astype(dtype).astype(np.float32)
    assert special[0] == 0 and math.copysign(1, special[0]) == -1 and special[1] == FORMATS[fmt].max_finite


def test_round_to_format_refuses_unknown_formats_and_integer_tensors():
    with pytest.raises(ValueError, match=r"round_to_format: fmt must be one of \['e2m1'"):
        round_to_format(f32([1.0]), "e8m0")
    with pytest.raises(TypeError, match="round_to_format: x must be a floating-point tensor"):
        round_to_format(torch.tensor([1]), "e4m3")


# ----------------------------------------------------------------------------------------------------------------
# quantize_absmax and packing
# ----------------------------------------------------------------------------------------------------------------


def spread_tensor(seed: int = 0, shape=(8, 64)) -> torch.Tensor:
    """Gaussian values whose rows differ in scale by up to 10^4, so that per-group scales matter."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g) * torch.logspace(-2, 2, shape[0]).view(-1, *[1] * (len(shape) - 1))


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [None, 16])
def test_round_to_nearest_error_is_within_half_a_scale(bits, group_size):
    x = spread_tensor()
    err = (quantize_absmax(x, bits, group_size=group_size).dequantize().double() - x.double()).abs()
    bound = absmax_error_bound(x, bits, group_size).double()
    assert bound.shape == x.shape
    assert (err <= bound * (1 + 1e-6)).all()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("group_size", [None, 16])
def test_stochastic_error_is_below_one_scale(bits, group_size):
    x = spread_tensor()
    q = quantize_absmax(x, bits, group_size=group_size, stochastic=True, generator=torch.Generator().manual_seed(0))
    err = (q.dequantize().double() - x.double()).abs()
    bound = absmax_error_bound(x, bits, group_size, stochastic=True).double()
    assert (err < bound * (1 + 1e-6)).all()


def test_error_bound_follows_each_groups_own_absmax():
    """With groups, a small group next to a large one gets a bound (and an error) on its own scale."""
    x = torch.tensor([[100.0, -50.0, 3.0, 1.0], [0.01, -0.02, 0.03, 0.004]])
    per_group = absmax_error_bound(x, 4, group_size=4)
    assert per_group[0].tolist() == pytest.approx([100 / 7 / 2] * 4)
    assert per_group[1].tolist() == pytest.approx([0.03 / 7 / 2] * 4)
    assert absmax_error_bound(x, 4).flatten().tolist() == pytest.approx([100 / 7 / 2] * 8)


@pytest.mark.parametrize("bits", ALL_BITS)
def test_codes_are_the_integers_from_minus_qmax_to_qmax(bits):
    qmax = 2 ** (bits - 1) - 1
    x = torch.linspace(-1, 1, 1001)
    q = quantize_absmax(x, bits)
    assert q.scales.item() == pytest.approx(1 / qmax)
    levels = torch.unique(q.dequantize() / q.scales).round()
    assert levels.tolist() == list(range(-qmax, qmax + 1))
    codes = unpack_codes(q.packed, bits, x.numel())
    assert codes.min().item() == 0 and codes.max().item() == 2 * qmax


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("numel", [1, 3, 7, 13, 64])
def test_pack_unpack_is_an_exact_inverse(bits, numel):
    g = torch.Generator().manual_seed(bits * 100 + numel)
    codes = torch.randint(0, 2**bits, (numel,), generator=g, dtype=torch.uint8)
    codes[0] = 2**bits - 1  # all bits set, next to whatever follows in its byte
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == (math.ceil(numel * bits / 8) if 8 % bits == 0 else numel)
    assert torch.equal(unpack_codes(packed, bits, numel), codes)


def test_pack_codes_puts_the_first_code_in_the_low_bits():
    assert pack_codes(torch.tensor([1, 2, 3], dtype=torch.uint8), 4).tolist() == [0x21, 0x03]
    assert pack_codes(torch.tensor([1, 2, 3, 0, 3], dtype=torch.uint8), 2).tolist() == [0b00111001, 0b11]


def bytes_of_the_sum_form(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """How pack_codes packed until torchao's and the strided form replaced it: each byte's codes shifted to their
    offsets and summed (disjoint bit fields, so the sum is their OR)."""
    per_byte = 8 // bits if 8 % bits == 0 else 1
    flat = torch.nn.functional.pad(codes, (0, -codes.numel() % per_byte))
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8)[:per_byte]
    return (flat.view(-1, per_byte) << shifts).sum(dim=1, dtype=torch.uint8)


@pytest.fixture(params=["torchao", "strided"])
def packing_path(request, monkeypatch):
    """Run a test on torchao's pack_uint4/unpack_uint4 (used wherever torchao is installed) and on the plain-torch
    strided form that stands in for it otherwise."""
    if request.param == "torchao":
        pytest.importorskip("torchao")
        assert quant._torchao_uint4() is not None, "torchao is installed, so 4-bit packing must be its pack_uint4"
    else:
        monkeypatch.setattr(quant, "_torchao_uint4", lambda: None)
    return request.param


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("numel", [1, 1000, 1001, 1002, 1003])
def test_packing_writes_the_same_bytes_as_the_sum_form_and_unpacks_them_back(packing_path, bits, numel):
    g = torch.Generator().manual_seed(bits * 10_000 + numel)
    codes = torch.randint(0, 2**bits, (numel,), generator=g, dtype=torch.uint8)
    packed = pack_codes(codes, bits)
    assert torch.equal(packed, bytes_of_the_sum_form(codes, bits))
    assert torch.equal(unpack_codes(packed, bits, numel), codes)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize("group_size", [None, 7])
def test_quantize_absmax_stores_the_bytes_of_its_definition_and_dequantize_gives_back_their_values(
    packing_path, bits, group_size
):
    x = spread_tensor(shape=(9, 7 * 15))  # an odd number of elements: the last byte is padded at 2 and 4 bits
    x[3] = 0.0  # a group of zeros: scale 0, codes qmax
    qmax = 2 ** (bits - 1) - 1
    groups = x.reshape(-1, x.numel() if group_size is None else group_size)
    scales = groups.abs().amax(dim=1, keepdim=True) / qmax
    codes = torch.round(groups / torch.where(scales > 0, scales, 1.0)).clamp(-qmax, qmax) + qmax
    q = quantize_absmax(x, bits, group_size=group_size)
    assert torch.equal(q.packed, bytes_of_the_sum_form(codes.reshape(-1).to(torch.uint8), bits))
    assert torch.equal(q.dequantize(), ((codes - qmax) * scales).reshape(x.shape))


def test_4bit_storage_is_half_of_8bit():
    x = spread_tensor(shape=(64, 128))
    q4, q8 = quantize_absmax(x, 4, group_size=32), quantize_absmax(x, 8, group_size=32)
    assert q8.packed.numel() == x.numel() and q4.packed.numel() * 2 == q8.packed.numel()
    assert quantize_absmax(x, 2).packed.numel() * 4 == x.numel()
    assert q4.nbytes == x.numel() // 2 + 4 * (x.numel() // 32)
    assert q8.nbytes == x.numel() + 4 * (x.numel() // 32)


@pytest.mark.parametrize("bits", ALL_BITS)
@pytest.mark.parametrize(("shape", "group_size"), [((7,), None), ((3, 5, 32), 8), ((0, 16), 4), ((), None)])
def test_quantized_nbytes_predicts_nbytes_from_the_shape(bits, shape, group_size):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(bits))
    assert quantized_nbytes(shape, bits, group_size) == quantize_absmax(x, bits, group_size=group_size).nbytes


def test_stochastic_rounding_is_unbiased():
    n = 4000
    x = torch.linspace(-1, 1, 41)  # 2 bits: scale 1, so every x between -1 and 1 lies between two levels
    rows = x.expand(n, -1)
    g = torch.Generator().manual_seed(0)
    mean = quantize_absmax(rows, 2, group_size=41, stochastic=True, generator=g).dequantize().mean(dim=0)
    # each draw lies within one scale (= 1) of x: std <= 1/2, so the mean's std <= 1 / (2 sqrt(n)); allow 5 sigma
    tolerance = 5 / (2 * math.sqrt(n))
    assert (mean - x).abs().max().item() < tolerance
    nearest = quantize_absmax(rows, 2, group_size=41).dequantize().mean(dim=0)
    assert (nearest - x).abs().max().item() > 10 * tolerance  # round to nearest is biased: the test can tell


def test_stochastic_rounding_is_reproducible_with_a_generator():
    x = spread_tensor()

    def draw(seed):
        return quantize_absmax(x, 4, group_size=16, stochastic=True, generator=torch.Generator().manual_seed(seed))

    assert torch.equal(draw(7).packed, draw(7).packed)
    assert not torch.equal(draw(7).packed, draw(8).packed)


def test_zero_tensor_dequantizes_to_exact_zeros():
    for group_size in (None, 4):
        q = quantize_absmax(torch.zeros(3, 8), 4, group_size=group_size)
        assert (q.scales == 0).all()
        assert torch.equal(q.dequantize(), torch.zeros(3, 8))


def test_zero_group_beside_nonzero_groups_stays_exact_zeros():
    x = spread_tensor()
    x[2, 16:32] = 0
    y = quantize_absmax(x, 3, group_size=16).dequantize()
    assert (y[2, 16:32] == 0).all()
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
def test_non_finite_value_poisons_its_group_only(bad):
    x = spread_tensor()
    x[5, 40] = bad
    q = quantize_absmax(x, 4, group_size=16)
    y = q.dequantize()
    assert torch.isnan(y[5, 32:48]).all()
    y[5, 32:48] = 0
    assert torch.isfinite(y).all()
    assert math.isnan(q.scales[5, 2])
    per_tensor = quantize_absmax(x, 4).dequantize()
    assert torch.isnan(per_tensor).all()


def test_dequantize_restores_shape_and_dtype():
    x = spread_tensor(shape=(4, 6, 32)).to(torch.bfloat16)
    q = quantize_absmax(x, 4, group_size=8)
    assert q.scales.dtype == torch.float32 and q.scales.shape == (4, 6, 4)
    y = q.dequantize()
    assert (y.shape, y.dtype) == (x.shape, torch.bfloat16)


def test_empty_tensors_quantize_to_empty_tensors():
    assert quantize_absmax(torch.zeros(0), 4).dequantize().shape == (0,)
    assert quantize_absmax(torch.zeros(0, 8), 4, group_size=4).dequantize().shape == (0, 8)


def test_quantized_tensor_survives_save_for_backward():
    """The intended use: a Linear-like Function keeps its input at 4 bits for the backward pass."""

    class MatmulSaving4Bit(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, w):
            q = quantize_absmax(x, 4, group_size=16)
            ctx.save_for_backward(*q.tensors(), w)
            ctx.q_meta = q.metadata()
            return x @ w.t()

        @staticmethod
        def backward(ctx, grad):
            packed, scales, w = ctx.saved_tensors
            x = QuantizedTensor.from_tensors(packed, scales, **ctx.q_meta).dequantize()
            return grad @ w, grad.t() @ x

    x = spread_tensor(shape=(8, 32))
    w = torch.randn(4, 32, requires_grad=True)
    MatmulSaving4Bit.apply(x, w).sum().backward()
    expected = torch.ones(8, 4).t() @ quantize_absmax(x, 4, group_size=16).dequantize()
    assert torch.equal(w.grad, expected)


def test_from_tensors_rejects_pieces_that_do_not_fit():
    q = quantize_absmax(spread_tensor(), 4, group_size=16)
    meta = q.metadata()
    with pytest.raises(ValueError, match="scales must have shape"):
        QuantizedTensor.from_tensors(q.packed, q.scales[:, :2], **meta)
    with pytest.raises(ValueError, match="packed must be uint8 with 256 elements"):
        QuantizedTensor.from_tensors(q.packed[:-1], q.scales, **meta)
    with pytest.raises(ValueError, match=r"bits must be an int in 2\.\.8"):
        QuantizedTensor.from_tensors(q.packed, q.scales, **{**meta, "bits": 16})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"bits": 9}, r"quantize_absmax: bits must be an int in 2\.\.8, got 9"),
        ({"bits": 1}, r"bits must be an int in 2\.\.8, got 1"),
        ({"bits": 16}, r"bits must be an int in 2\.\.8, got 16"),
        ({"bits": 4.0}, r"bits must be an int in 2\.\.8, got 4\.0"),
        ({"bits": True}, r"bits must be an int in 2\.\.8, got True"),
        ({"bits": 4, "group_size": 0}, r"group_size must be None \(one scale per tensor\) or an int >= 1, got 0"),
        ({"bits": 4, "group_size": 24}, r"group_size=24 must divide the last dimension, got shape \(8, 64\)"),
    ],
)
def test_bad_absmax_arguments_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_absmax(spread_tensor(), **kwargs)


def test_bad_packing_arguments_name_the_parameter():
    with pytest.raises(TypeError, match=r"pack_codes: codes must be a torch\.uint8 tensor"):
        pack_codes(torch.tensor([1, 2]), 4)
    with pytest.raises(ValueError, match="unpack_codes: packed has 2 bytes, but 7 codes of 4 bits take 4"):
        unpack_codes(torch.zeros(2, dtype=torch.uint8), 4, 7)
    with pytest.raises(TypeError, match="quantize_absmax: x must be a floating-point tensor"):
        quantize_absmax(torch.tensor([1, 2]), 4)


# ----------------------------------------------------------------------------------------------------------------
# quantize_blocks
# ----------------------------------------------------------------------------------------------------------------


def reference_blocks(x2: torch.Tensor, fmt: str, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32-scaled block quantization of a 2-D tensor, one block at a time."""
    br, bc = block
    rows, cols = x2.shape
    y = torch.empty_like(x2)
    scales = torch.empty(math.ceil(rows / br), math.ceil(cols / bc))
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            tile = x2[i * br : (i + 1) * br, j * bc : (j + 1) * bc]
            s = tile.abs().max() / FORMATS[fmt].max_finite
            s = torch.where(s == 0, 1.0, s)
            scales[i, j] = s
            y[i * br : (i + 1) * br, j * bc : (j + 1) * bc] = round_to_format(tile / s, fmt) * s
    return y, scales


def tiles_of_different_magnitudes(rows: int, cols: int, block: tuple[int, int], seed: int = 0) -> torch.Tensor:
    """Gaussian values times 10^k, k from -4 to 3 varying from block to block."""
    g = torch.Generator().manual_seed(seed)
    br, bc = block
    k = torch.arange(math.ceil(rows / br) * math.ceil(cols / bc)).remainder(8).sub(4).reshape(-1, math.ceil(cols / bc))
    magnitude = torch.pow(10.0, k.float()).repeat_interleave(br, 0)[:rows].repeat_interleave(bc, 1)[:, :cols]
    return torch.randn(rows, cols, generator=g) * magnitude


@pytest.mark.parametrize("fmt", list(SPEC))
def test_each_1x128_tile_gets_its_own_scale_and_error(fmt):
    f = FORMATS[fmt]
    x = tiles_of_different_magnitudes(2, 512, (1, 128))
    y, s = quantize_blocks(x, fmt, return_scales=True)
    assert s.shape == (2, 4)
    tiles = x.view(2, 4, 128)
    assert torch.equal(s, tiles.abs().amax(dim=-1) / f.max_finite)
    # per element: half a quantum of the format at x / s (relative 2^-(m+1) when normal, min_subnormal / 2 below)
    scaled = tiles.abs() / s.unsqueeze(-1)
    half_quantum = torch.maximum(scaled * 2.0 ** -(f.man_bits + 1), torch.tensor(f.min_subnormal / 2))
    bound = half_quantum * s.unsqueeze(-1) * (1 + 1e-5)
    assert ((y.view(2, 4, 128) - tiles).abs() <= bound).all()


@pytest.mark.parametrize("fmt", ["e2m1", "e4m3"])
def test_weights_get_one_scale_per_128x128_block(fmt):
    x = tiles_of_different_magnitudes(256, 384, (128, 128))
    y, s = quantize_blocks(x, fmt, (128, 128), return_scales=True)
    ref_y, ref_s = reference_blocks(x, fmt, (128, 128))
    assert s.shape == (2, 3)
    assert torch.equal(s, ref_s) and torch.equal(y, ref_y)


@pytest.mark.parametrize(("shape", "block"), [((3, 200), (1, 128)), ((130, 130), (128, 128)), ((5, 7), (2, 4))])
def test_ragged_shapes_are_padded_not_refused(shape, block):
    x = tiles_of_different_magnitudes(*shape, block)
    y, s = quantize_blocks(x, "e3m2", block, return_scales=True)
    ref_y, ref_s = reference_blocks(x, "e3m2", block)
    assert y.shape == x.shape
    assert torch.equal(s, ref_s) and torch.equal(y, ref_y)


def test_leading_dimensions_are_flattened_into_rows():
    x = tiles_of_different_magnitudes(6, 256, (1, 128)).reshape(2, 3, 256)
    y = quantize_blocks(x, "e4m3")
    assert y.shape == (2, 3, 256)
    assert torch.equal(y, quantize_blocks(x.reshape(6, 256), "e4m3").reshape(2, 3, 256))


@pytest.mark.parametrize("fmt", list(SPEC))
def test_pow2_scales_follow_the_mx_formula(fmt):
    x = tiles_of_different_magnitudes(4, 96, (1, 32), seed=1)
    x[0, :32] = 0.5  # amax an exact power of two
    x[1, :32] = 0.5 * (1 - 2**-24)  # amax just below one
    _, s = quantize_blocks(x, fmt, scale="pow2", return_scales=True)
    assert s.shape == (4, 3)
    for i in range(4):
        for j in range(3):
            amax = x[i, 32 * j : 32 * (j + 1)].abs().max().item()
            assert s[i, j].item() == 2.0 ** (math.floor(math.log2(amax)) - FORMATS[fmt].emax)
            assert math.frexp(s[i, j].item())[0] == 0.5  # a power of two


def test_pow2_scale_saturates_the_largest_element_as_the_mx_spec_does():
    # e2m1: emax = 2, amax 7.9 -> X = 2^(2 - 2) = 1, and 7.9 lies above the largest element value 6
    y, s = quantize_blocks(f32([7.9, 1.0, 0.5, -3.0]), "e2m1", scale="pow2", return_scales=True)
    assert s.tolist() == [[1.0]]
    assert y.tolist() == [6.0, 1.0, 0.5, -3.0]


def test_pow2_scale_is_clamped_at_two_to_the_minus_127():
    _, s = quantize_blocks(f32([1e-40, 0.0]), "e4m3", scale="pow2", return_scales=True)
    assert s.item() == 2.0**-127


@pytest.mark.parametrize("fmt", list(SPEC))
@pytest.mark.parametrize("scale", ["fp32", "pow2"])
def test_representable_values_times_a_power_of_two_round_trip_exactly(fmt, scale):
    values, _ = signed_table(fmt)
    g = torch.Generator().manual_seed(5)
    rows, blocks, bc = 3, 5, 32
    picks = values[torch.randint(len(values), (rows, blocks, bc), generator=g)].float()
    picks[..., 0] = FORMATS[fmt].max_finite  # sets each block's scale to exactly its power of two
    k = torch.randint(-20, 21, (rows, blocks, 1), generator=g).float()
    x = (picks * torch.exp2(k)).reshape(rows, blocks * bc)
    y, s = quantize_blocks(x, fmt, (1, bc), scale=scale, return_scales=True)
    assert torch.equal(y, x)
    assert torch.equal(s, torch.exp2(k.squeeze(-1)))


@pytest.mark.parametrize("bad", [NAN, INF, -INF])
@pytest.mark.parametrize("scale", ["fp32", "pow2"])
def test_non_finite_value_makes_its_block_nan_and_leaves_others_alone(bad, scale):
    x = tiles_of_different_magnitudes(2, 96, (1, 32))
    x[1, 40] = bad
    y, s = quantize_blocks(x, "e2m3", (1, 32), scale=scale, return_scales=True)
    assert torch.isnan(y[1, 32:64]).all() and math.isnan(s[1, 1])
    y[1, 32:64] = 0
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("scale", ["fp32", "pow2"])
def test_zero_block_gets_scale_one_and_stays_zero(scale):
    x = tiles_of_different_magnitudes(2, 64, (1, 32))
    x[0, 32:] = 0
    y, s = quantize_blocks(x, "e5m2", (1, 32), scale=scale, return_scales=True)
    assert s[0, 1].item() == 1.0
    assert (y[0, 32:] == 0).all() and torch.isfinite(y).all()


TORCHAO_MX = {
    "e2m1": "float4_e2m1fn_x2",
    "e2m3": "fp6_e2m3",
    "e3m2": "fp6_e3m2",
    "e4m3": "float8_e4m3fn",
    "e5m2": "float8_e5m2",
}


def torchao_mx_dtype(fmt: str) -> torch.dtype | str:
    name = TORCHAO_MX[fmt]
    return getattr(torch, name) if name.startswith("float") else name


@pytest.mark.parametrize("fmt", list(SPEC))
def test_pow2_blocks_match_torchao_mx_bit_for_bit_on_finite_inputs(fmt):
    """torchao's `MXTensor.to_mx` (FLOOR scales, the OCP spec's) as the oracle, on blocks whose amax lies between
    2**-80 and 2**80 (torchao clamps the scale at 2**-126, this module, as E8M0, at 2**-127: a block with amax below
    2**(emax - 126) rounds apart), all-zero blocks included."""
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    x = tiles_of_different_magnitudes(64, 256, (1, 32), seed=2)
    x = x * torch.exp2(
        torch.randint(-70, 71, (64, 8), generator=torch.Generator().manual_seed(3)).float()
    ).repeat_interleave(32, 1)
    x[3:9, 64:96] = 0
    reference = mx.MXTensor.to_mx(x, torchao_mx_dtype(fmt), 32).dequantize(torch.float32)
    assert torch.equal(quantize_blocks(x, fmt, scale="pow2"), reference)


@pytest.mark.parametrize("fmt", list(SPEC))
def test_pow2_blocks_differ_from_torchao_mx_only_below_two_to_the_emax_minus_126(fmt):
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    emax = FORMATS[fmt].emax
    x = torch.linspace(0.25, 1.0, 32).repeat(2, 1) * torch.tensor([[2.0 ** (emax - 125)], [2.0 ** (emax - 128)]])
    reference = mx.MXTensor.to_mx(x, torchao_mx_dtype(fmt), 32).dequantize(torch.float32)
    ours = quantize_blocks(x, fmt, scale="pow2")
    assert torch.equal(ours[0], reference[0]) and not torch.equal(ours[1], reference[1])


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_fp32_blocks_match_torchao_float8_per_block_bit_for_bit(fmt, block):
    """torchao's `Float8Tensor` with `PerBlock` granularity as the oracle, where it applies: shapes that 128
    divides, no all-zero block."""
    granularity = pytest.importorskip("torchao.quantization.granularity")
    float8 = pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")
    x = tiles_of_different_magnitudes(256, 384, block, seed=4)
    dtype = FORMATS[fmt].torch_dtype
    reference = float8.Float8Tensor.from_hp(x, float8_dtype=dtype, granularity=granularity.PerBlock(list(block)))
    assert torch.equal(quantize_blocks(x, fmt, block), reference.dequantize())


def test_torchao_float8_per_block_turns_a_zero_block_into_nan_and_refuses_ragged_shapes():
    """Why `quantize_blocks` keeps its own FP8 block scaling: a block of zeros stays zeros, any shape."""
    granularity = pytest.importorskip("torchao.quantization.granularity")
    float8 = pytest.importorskip("torchao.quantization.quantize_.workflows.float8.float8_tensor")
    x = tiles_of_different_magnitudes(256, 256, (128, 128))
    x[:128, :128] = 0
    per_block = granularity.PerBlock([128, 128])
    assert torch.isnan(float8.Float8Tensor.from_hp(x, granularity=per_block).dequantize()[:128, :128]).all()
    assert (quantize_blocks(x, "e4m3", (128, 128))[:128, :128] == 0).all()
    with pytest.raises(AssertionError, match="divisible by block size"):
        float8.Float8Tensor.from_hp(torch.ones(100, 200), granularity=granularity.PerBlock([1, 128]))
    assert quantize_blocks(torch.ones(100, 200), "e4m3").shape == (100, 200)


def test_block_output_is_float32_whatever_the_input_dtype():
    x = tiles_of_different_magnitudes(2, 128, (1, 128)).to(torch.bfloat16)
    y = quantize_blocks(x, "e4m3")
    assert y.dtype == torch.float32
    assert torch.equal(y, quantize_blocks(x.float(), "e4m3"))


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"fmt": "fp8"}, r"quantize_blocks: fmt must be one of \['e2m1', 'e2m3', 'e3m2', 'e4m3', 'e5m2'\], got 'fp8'"),
        (
            {"fmt": "e4m3", "scale": "e8m0"},
            r"quantize_blocks: scale must be one of \['fp32', 'pow2', 'nvfp4'\], got 'e8m0'",
        ),
        ({"fmt": "e4m3", "block": (0, 128)}, r"block must be a pair of ints >= 1 \(rows, columns\), got \(0, 128\)"),
        ({"fmt": "e4m3", "block": 128}, r"block must be a pair of ints >= 1 \(rows, columns\), got 128"),
    ],
)
def test_bad_block_arguments_name_the_parameter(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_blocks(torch.ones(2, 128), **kwargs)
