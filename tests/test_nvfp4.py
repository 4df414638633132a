"""NVFP4 numerics in gnmr_hf.quant: two-level block scales (`quantize_blocks(..., scale="nvfp4")`) against torchao's
`NVFP4Tensor`, stochastic rounding, and the random Hadamard rotation of NVIDIA's recipe (arXiv 2509.25149).

torchao is the oracle for the element and scale rounding: equal bit for bit on finite inputs, and where the two
differ (an all-zero tensor, a tensor below 2**-110, a NaN or inf) each difference is its own test, with its bound.
"""

from __future__ import annotations

import math

import pytest
import torch

from gnmr_hf.quant import FORMATS, quantize_blocks, random_hadamard, rotate_rows

E2M1_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def torchao_nvfp4(x: torch.Tensor) -> torch.Tensor:
    """torchao's NVFP4 round trip with the per-tensor scale from x's amax (the oracle)."""
    nvfp4 = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    scale = nvfp4.per_tensor_amax_to_scale(x.abs().max())
    return nvfp4.NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(torch.float32)


def ours(x: torch.Tensor, **kwargs) -> torch.Tensor:
    return quantize_blocks(x, "e2m1", (1, 16), scale="nvfp4", **kwargs)


def hard_tensor(seed: int, rows: int = 64, cols: int = 256) -> torch.Tensor:
    """Gaussian blocks whose magnitudes span 2**-40..2**40 (so block scales hit E4M3's clamp at 2**-6 and its
    subnormal-free low end), 1% outliers x1000, all-zero blocks, and float32 subnormals inside normal blocks."""
    g = torch.Generator().manual_seed(seed)
    magnitude = torch.exp2(torch.randint(-40, 41, (rows, cols // 16), generator=g).float()).repeat_interleave(16, 1)
    x = torch.randn(rows, cols, generator=g) * magnitude
    x[torch.rand(rows, cols, generator=g) < 0.01] *= 1000
    x.view(rows, -1, 16)[torch.rand(rows, cols // 16, generator=g) < 0.1] = 0
    x[torch.rand(rows, cols, generator=g) < 0.01] = 1e-40
    return x


@pytest.mark.parametrize("seed", range(8))
def test_nvfp4_equals_torchao_bit_for_bit_on_finite_inputs(seed):
    x = hard_tensor(seed)
    assert torch.equal(ours(x), torchao_nvfp4(x))


def test_nvfp4_ties_go_to_the_even_element_as_torchao_rounds_them():
    # Tensor amax 5.25 makes the per-tensor scale 5.25 / 2688 = 2**-9; a block with amax 3 then has the E4M3 scale
    # (3 / 6) / 2**-9 = 256, so its elements are exactly x * 2 and its decode scale 0.5.
    ties = [0.125, 0.375, 0.625, 0.875, 1.25, 1.75, 2.5]  # x * 2 halfway between two E2M1 values
    block = torch.tensor([3.0, *ties, *[-t for t in ties], 0.0])
    x = torch.stack([torch.full((16,), 5.25), block])
    # x * 2 = 0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4
    even = [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    expected = torch.tensor([3.0, *[e / 2 for e in even], *[-e / 2 for e in even], 0.0])
    assert torch.equal(ours(x)[1], expected)
    assert torch.equal(ours(x), torchao_nvfp4(x))


def test_nvfp4_scales_are_e4m3_values_times_the_fp32_per_tensor_scale():
    x = hard_tensor(0)
    _, s = ours(x, return_scales=True)
    t = x.abs().max() / (448.0 * 6.0)
    e = (s / t).to(torch.float8_e4m3fn).float()
    assert s.shape == (64, 16)
    assert torch.equal(t * e, s)
    assert e.min() >= 2.0**-6 and e.max() <= 448.0


def test_the_block_holding_the_tensor_amax_gets_the_largest_e4m3_scale():
    x = hard_tensor(1)
    _, s = ours(x, return_scales=True)
    t = x.abs().max() / (448.0 * 6.0)
    top = x.abs().view(64, 16, 16).amax(-1).argmax()
    assert (s.flatten()[top] / t).item() == 448.0


def test_16x16_weight_blocks_quantize_a_matrix_and_its_transpose_alike():
    """What NVIDIA's 2D weight blocks are for: the fprop (W) and the dgrad (W^T) read the same quantized weight."""
    w = hard_tensor(2, 64, 48)
    q = quantize_blocks(w, "e2m1", (16, 16), scale="nvfp4")
    assert torch.equal(quantize_blocks(w.t(), "e2m1", (16, 16), scale="nvfp4"), q.t())
    assert not torch.equal(ours(w.t()), ours(w).t())  # 1x16 blocks along rows would not


def test_16x16_blocks_take_one_scale_from_all_256_elements():
    w = torch.ones(32, 32)
    w[3, 5] = 12.0  # the amax of block (0, 0) only
    _, s = quantize_blocks(w, "e2m1", (16, 16), scale="nvfp4", return_scales=True)
    t = 12.0 / 2688
    assert s.shape == (2, 2)
    assert s[0, 0].item() == pytest.approx(t * 448, rel=1e-6)
    assert torch.equal(s[0, 1], s[1, 0]) and torch.equal(s[1, 1], s[0, 1])
    assert s[1, 1].item() == pytest.approx(t * float(torch.tensor(1 / 6 / t).to(torch.float8_e4m3fn)), rel=1e-6)


def test_an_all_zero_tensor_stays_zero_where_torchao_gives_nan():
    x = torch.zeros(4, 32)
    assert torch.equal(ours(x), x)
    assert torch.isnan(torchao_nvfp4(x)).all()  # its per-tensor scale is 0, so its block scales are 0 / 0


@pytest.mark.parametrize("exponent", [-100, -110, -111, -113, -117, -125, -135, -149])
def test_a_tensor_below_two_to_the_minus_110_differs_only_by_rounding_to_zero(exponent):
    """torchao's reciprocal (1 / t) / e, with t = amax / 2688 and e >= 2**-6, overflows to inf only when amax is below
    2688 * 2**-122 (about 2**-110.6): each element of such a block then becomes +-6 times its scale (a zero NaN), and
    from amax 2**-117 on 1 / t itself overflows. Here such a block rounds to zero, an error of at most |x|. At amax
    2**-110 and above the two agree bit for bit."""
    g = torch.Generator().manual_seed(-exponent)
    x = torch.randn(8, 64, generator=g) * torch.exp2(-torch.arange(4.0).repeat_interleave(16) * 3)
    x = x / x.abs().max() * 2.0**exponent  # amax exactly 2**exponent
    y, reference = ours(x), torchao_nvfp4(x)
    differ = (y != reference) & ~(torch.isnan(y) & torch.isnan(reference))
    assert torch.isfinite(y).all()
    assert (y[differ] == 0).all()
    assert (x[differ].abs() < 2.0**-110).all()
    if exponent >= -110:
        assert not differ.any()
    if exponent <= -117:
        assert differ.any()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_a_non_finite_value_poisons_its_own_block_where_torchao_poisons_the_whole_tensor(bad):
    x = hard_tensor(3)
    x[5, 40] = bad  # block (5, 2)
    y = ours(x)
    assert torch.isnan(y[5, 32:48]).all()
    # Every other block: exactly torchao's NVFP4 of x with the poisoned block zeroed (the per-tensor scale comes from
    # the finite blocks).
    clean = x.clone()
    clean[5, 32:48] = 0
    expected = torchao_nvfp4(clean)
    expected[5, 32:48] = math.nan
    assert torch.equal(y.nan_to_num(7.0), expected.nan_to_num(7.0))
    assert torch.isnan(torchao_nvfp4(x)).all()


def test_nvfp4_of_other_element_formats_uses_their_max():
    x = hard_tensor(4)
    _, s = quantize_blocks(x, "e4m3", (1, 16), scale="nvfp4", return_scales=True)
    t = x.abs().max() / (448.0 * FORMATS["e4m3"].max_finite)
    assert (s.flatten()[x.abs().view(64, 16, 16).amax(-1).argmax()] / t).item() == 448.0


# ----------------------------------------------------------------------------------------------------------------
# stochastic rounding
# ----------------------------------------------------------------------------------------------------------------


def blocks_of(value: float, draws: int) -> torch.Tensor:
    """Rows of 16: 6.0 (each block's amax, so the scale is 1 with fp32 scaling) then 15 copies of `value`."""
    rows = -(-draws // 15)
    return torch.cat([torch.full((rows, 1), 6.0), torch.full((rows, 15), value)], 1)


@pytest.mark.parametrize("scale", ["fp32", "nvfp4"])
@pytest.mark.parametrize("value", [2.6, -1.2, 0.3, 4.7, 0.1, 5.9])
def test_stochastic_rounding_is_unbiased(value, scale):
    x = blocks_of(value, 100_000)
    y = quantize_blocks(x, "e2m1", (1, 16), scale=scale, stochastic=True, generator=torch.Generator().manual_seed(0))
    error = (y[:, 1:] - x[:, 1:]).double().flatten()
    assert error.numel() >= 100_000
    assert abs(error.mean()) <= 3 * error.std() / math.sqrt(error.numel())


@pytest.mark.parametrize("value", [2.6, -1.2, 0.3, 4.7])
def test_round_to_nearest_fails_the_unbiasedness_test(value):
    """The test above can fail: to nearest, every copy of a value errs the same way."""
    x = blocks_of(value, 100_000)
    error = (quantize_blocks(x, "e2m1", (1, 16))[:, 1:] - x[:, 1:]).double().flatten()
    assert error.std() == 0 and error.mean() != 0


def test_stochastic_rounding_lands_on_one_of_the_two_neighbours():
    g = torch.Generator().manual_seed(1)
    x = torch.cat([torch.full((2000, 1), 6.0), (torch.rand(2000, 15, generator=g) * 12 - 6)], 1)
    y = quantize_blocks(x, "e2m1", (1, 16), stochastic=True, generator=g)
    grid = torch.tensor([-v for v in reversed(E2M1_VALUES[1:])] + E2M1_VALUES)
    hi = torch.searchsorted(grid, x.contiguous()).clamp(max=len(grid) - 1)
    lo = (hi - 1).clamp(min=0)
    assert ((y == grid[lo]) | (y == grid[hi])).all()


def test_stochastic_rounding_keeps_representable_values():
    x = torch.tensor([[6.0, 4.0, -3.0, 0.5, 0.0, -6.0, 1.5, -2.0] * 2])
    y = quantize_blocks(x, "e2m1", (1, 16), stochastic=True, generator=torch.Generator().manual_seed(2))
    assert torch.equal(y, x)


def test_stochastic_rounding_saturates_above_the_formats_max():
    # MX scales: amax 7.9 gets the scale 1, so 7.9 lies above e2m1's largest value 6 (test_quant.py)
    x = torch.tensor([7.9, -7.9, 6.5, 1.0] * 8)
    y = quantize_blocks(x, "e2m1", scale="pow2", stochastic=True, generator=torch.Generator().manual_seed(2))
    assert torch.equal(y, torch.tensor([6.0, -6.0, 6.0, 1.0] * 8))


def test_stochastic_rounding_is_reproducible_with_a_generator_and_ignores_the_global_rng():
    x = hard_tensor(5)
    torch.manual_seed(0)
    a = ours(x, stochastic=True, generator=torch.Generator().manual_seed(7))
    torch.manual_seed(1)
    b = ours(x, stochastic=True, generator=torch.Generator().manual_seed(7))
    c = ours(x, stochastic=True, generator=torch.Generator().manual_seed(8))
    assert torch.equal(a, b) and not torch.equal(a, c)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2", "e3m2"])
def test_stochastic_rounding_of_other_formats_is_unbiased(fmt):
    f = FORMATS[fmt]
    value = f.max_finite * 0.37  # between two values of the format
    rows = -(-100_000 // 15)
    x = torch.cat([torch.full((rows, 1), f.max_finite), torch.full((rows, 15), value)], 1)
    y = quantize_blocks(x, fmt, (1, 16), stochastic=True, generator=torch.Generator().manual_seed(3))
    error = (y[:, 1:] - x[:, 1:]).double().flatten()
    assert error.std() > 0
    assert abs(error.mean()) <= 3 * error.std() / math.sqrt(error.numel())


# ----------------------------------------------------------------------------------------------------------------
# random Hadamard rotation
# ----------------------------------------------------------------------------------------------------------------


def test_random_hadamard_is_orthogonal_exactly_in_float32():
    h = random_hadamard(16, seed=0)
    assert h.dtype == torch.float32 and h.shape == (16, 16)
    assert torch.equal(h.t() @ h, torch.eye(16))
    assert set(h.abs().unique().tolist()) == {0.25}


def test_random_hadamard_signs_come_from_the_seed_alone():
    torch.manual_seed(0)
    a = random_hadamard(16, seed=3)
    torch.manual_seed(1)
    assert torch.equal(random_hadamard(16, seed=3), a)
    assert not torch.equal(random_hadamard(16, seed=4), a)


def test_rotating_both_inputs_of_a_product_over_rows_leaves_it_unchanged():
    g = torch.Generator().manual_seed(0)
    grad = torch.randn(70, 24, generator=g, dtype=torch.float64)
    x = torch.randn(70, 40, generator=g, dtype=torch.float64)
    h = random_hadamard(16, seed=5)
    rotated = rotate_rows(grad, h).t() @ rotate_rows(x, h)
    assert rotate_rows(x, h).shape == (80, 40)  # rows padded to a multiple of 16
    torch.testing.assert_close(rotated, grad.t() @ x, rtol=1e-12, atol=1e-12)


def test_the_rotation_spreads_an_outlier_over_its_16_rows():
    x = torch.zeros(16, 1)
    x[3] = 8.0
    assert torch.equal(rotate_rows(x, random_hadamard(16, seed=0)).abs(), torch.full((16, 1), 2.0))


@pytest.mark.parametrize("size", [0, 12, 16.0, True])
def test_random_hadamard_refuses_a_size_that_is_not_a_power_of_two(size):
    with pytest.raises(ValueError, match=r"random_hadamard: size must be a power of two >= 1, got"):
        random_hadamard(size)
