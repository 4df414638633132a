"""Low-bit numerics shared by the backends, written once: absmax integers with bit packing (`quantize_absmax`, the
saved inputs of `act_quant`) and block-scaled low-bit floats (`round_to_format`, `quantize_blocks`: FP4/FP6 MX
element types and FP8 with DeepSeek-V3, MX or NVFP4 scales, and the 16x16 random Hadamard rotation of NVIDIA's NVFP4
recipe, for `block_fp`). Plain tensor functions; ties to even (or stochastic rounding, on request), saturation
instead of inf, NaN and inf kept visible in their own block. Libraries now round the same values on finite inputs
(ml_dtypes for FP4/FP6, torchao for NVFP4, MX and FP8 blocks; the tests compare bit for bit): this module stays for
what they do not give, one blown-up block that stays in its block, all-zero blocks that stay zero, any shape, on the
tensor's device. Every decision, its test and its cost: docs/quant.md.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F

__all__ = [
    "FORMATS",
    "FloatFormat",
    "QuantizedTensor",
    "absmax_error_bound",
    "absmax_round_rows",
    "absmax_rows",
    "pack_codes",
    "quantize_absmax",
    "quantize_blocks",
    "quantized_nbytes",
    "random_hadamard",
    "rotate_rows",
    "round_codes",
    "round_to_format",
    "tensor_absmax_scale",
    "unpack_codes",
]

# float32 layout: 1 sign bit, 8 exponent bits (bias 127), 23 mantissa bits.
_F32_EXP_MASK = 0x7F800000
_F32_MAN_BITS = 23
_F32_BIAS = 127


# --------------------------------------------------------------------------------------------------------------
# Integer absmax quantization and packing
# --------------------------------------------------------------------------------------------------------------


def _check_bits(where: str, bits: Any) -> int:
    if isinstance(bits, bool) or not isinstance(bits, int) or not 2 <= bits <= 8:
        raise ValueError(f"{where}: bits must be an int in 2..8, got {bits!r}")
    return bits


def _codes_per_byte(bits: int) -> int:
    # 3, 5, 6 and 7 bits would straddle byte boundaries; one code per byte keeps unpacking a shift and a mask.
    return 8 // bits if 8 % bits == 0 else 1


@functools.cache
def _torchao_uint4() -> tuple[Callable[[torch.Tensor], torch.Tensor], Callable[[torch.Tensor], torch.Tensor]] | None:
    """torchao's `(pack_uint4, unpack_uint4)` where torchao is installed and has them, else None."""
    if importlib.util.find_spec("torchao") is None:
        return None
    # Its import logs the CUDA kernels it cannot load on a CPU machine (the loggers `commandline.quiet_unused_imports`
    # hushes): no news to a caller packing codes. transformers has usually imported it already; then this is free.
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        # A prototype module (the packing its MX and NVFP4 tensors use): where a later torchao moves or breaks it,
        # the strided form below writes the same bytes.
        from torchao.prototype.mx_formats.kernels import pack_uint4, unpack_uint4
    except Exception:  # an installed torchao built for another torch fails at import in its own ways
        return None
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)
    return pack_uint4, unpack_uint4


def _pack_strided(flat: torch.Tensor, bits: int) -> torch.Tensor:
    """`flat` (uint8, a multiple of 8 // bits codes) packed by ORing its strided slices: code i of each byte is
    `flat[i::per_byte] << bits * i` (torchao's `pack_uint4` at 4 bits, written for any width that divides 8)."""
    per_byte = 8 // bits
    packed = flat[0::per_byte].clone()
    for i in range(1, per_byte):
        packed |= flat[i::per_byte] << bits * i
    return packed


def _unpack_strided(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of `_pack_strided`: every code of `packed`, flat (torchao's `unpack_uint4` at 4 bits)."""
    per_byte, mask = 8 // bits, (1 << bits) - 1
    # The top code needs no mask: the shift drops the bits below it and brings in zeros above.
    fields = [(packed >> bits * i) & mask for i in range(per_byte - 1)] + [packed >> bits * (per_byte - 1)]
    return torch.stack(fields, dim=-1).reshape(-1)


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes, each < 2**bits, into a flat uint8 tensor, 8 // bits codes per byte when bits divides 8.

    Code i of a byte sits at bit offset bits * i (the first code in the low bits). The tail of the last byte is
    zero-padded; `unpack_codes` needs the original `numel` to drop it. Codes >= 2**bits are not checked (that would
    cost a device sync) and would corrupt their neighbours. With one code per byte the result is a flat view of
    `codes`. At 4 bits the packing is torchao's `pack_uint4` where torchao is installed (the same layout), else the
    same strided OR in plain torch; both write the same bytes (docs/act_quant.md, "Step time").
    """
    _check_bits("pack_codes", bits)
    if codes.dtype != torch.uint8:
        raise TypeError(f"pack_codes: codes must be a torch.uint8 tensor, got {codes.dtype}")
    flat = codes.reshape(-1)
    per_byte = _codes_per_byte(bits)
    if per_byte == 1:
        return flat
    if flat.numel() % per_byte:
        flat = F.pad(flat, (0, -flat.numel() % per_byte))
    torchao = _torchao_uint4() if bits == 4 else None
    return _pack_strided(flat, bits) if torchao is None else torchao[0](flat)


def unpack_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Inverse of `pack_codes`: the first `numel` codes of `packed`, as a flat uint8 tensor."""
    _check_bits("unpack_codes", bits)
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_codes: packed must be a torch.uint8 tensor, got {packed.dtype}")
    per_byte = _codes_per_byte(bits)
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
        raise ValueError(f"unpack_codes: numel must be an int >= 0, got {numel!r}")
    if packed.numel() != -(-numel // per_byte):
        raise ValueError(
            f"unpack_codes: packed has {packed.numel()} bytes, but {numel} codes of {bits} bits take "
            f"{-(-numel // per_byte)} ({per_byte} per byte)"
        )
    if per_byte == 1:
        return packed.reshape(-1)
    flat = packed.reshape(-1).contiguous()
    torchao = _torchao_uint4() if bits == 4 else None
    codes = _unpack_strided(flat, bits) if torchao is None else torchao[1](flat)
    return codes[:numel]


def _centred_codes(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """The first `numel` codes of `packed` minus qmax, as float32 (the integers -qmax..qmax), for `dequantize`.

    Each code field is centred in uint8 (adding 256 - qmax modulo 256, read as int8: exact for the codes up to
    2 * qmax that `quantize_absmax` writes) and written straight into the float output, the cast folded into the
    interleaving copy. Unpacking first (torchao's `unpack_uint4` or the strided form) interleaves uint8 codes that two
    more passes then cast and centre: at 4 bits a dequantize takes 35-40% less time this way (docs/act_quant.md)."""
    per_byte, qmax = _codes_per_byte(bits), 2 ** (bits - 1) - 1
    flat = packed.reshape(-1)
    if per_byte == 1:
        return flat.add(256 - qmax).view(torch.int8).to(torch.float32)
    mask = (1 << bits) - 1
    out = torch.empty(flat.numel(), per_byte, dtype=torch.float32, device=flat.device)
    for i in range(per_byte):
        field = flat & mask if i == 0 else flat >> bits * i
        if 0 < i < per_byte - 1:
            field &= mask
        out[:, i].copy_(field.add_(256 - qmax).view(torch.int8))
    return out.reshape(-1)[:numel]


def _check_group_size(where: str, shape: torch.Size, group_size: Any) -> int | None:
    if group_size is None:
        return None
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"{where}: group_size must be None (one scale per tensor) or an int >= 1, got {group_size!r}")
    if len(shape) == 0 or shape[-1] % group_size != 0:
        last = shape[-1] if len(shape) else "none (0-dim tensor)"
        raise ValueError(
            f"{where}: group_size={group_size} must divide the last dimension, got shape {tuple(shape)} "
            f"(last dimension {last}); use group_size=None for one scale per tensor"
        )
    return group_size


def _scale_shape(shape: torch.Size, group_size: int | None) -> tuple[int, ...]:
    return () if group_size is None else (*shape[:-1], shape[-1] // group_size)


def _absmax_scales(where: str, x: torch.Tensor, bits: Any, group_size: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """Validate, then return (x as float32 groups, scales); groups have shape scale_shape + (group,)."""
    bits = _check_bits(where, bits)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{where}: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}")
    group_size = _check_group_size(where, x.shape, group_size)
    scale_shape = _scale_shape(x.shape, group_size)
    groups = x.to(torch.float32).reshape(*scale_shape, x.numel() if group_size is None else group_size)
    if groups.numel() == 0:
        absmax = groups.new_zeros(scale_shape)
    else:
        # amax/amin propagate NaN, and avoid the full-size temporary that abs() would allocate.
        absmax = torch.maximum(groups.amax(dim=-1), groups.amin(dim=-1).neg())
    scales = absmax / (2 ** (bits - 1) - 1)
    # One rule for every non-finite group (NaN or inf inside): scale NaN, so all of it dequantizes to NaN.
    return groups, torch.where(torch.isfinite(scales), scales, math.nan)


@dataclass(frozen=True, eq=False)
class QuantizedTensor:
    """A tensor stored as packed absmax integer codes plus float32 scales; `dequantize()` gives it back.

    `packed` is flat uint8 (codes offset by +qmax); `scales` has shape () for one scale per tensor, or
    shape[:-1] + (shape[-1] // group_size,). To keep one in a custom autograd Function::

        ctx.save_for_backward(*q.tensors())
        ctx.q_meta = q.metadata()
        ...
        q = QuantizedTensor.from_tensors(*ctx.saved_tensors, **ctx.q_meta)
    """

    packed: torch.Tensor
    scales: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    bits: int
    group_size: int | None

    @property
    def nbytes(self) -> int:
        """Bytes held: packed codes plus scales (the small Python metadata is not counted)."""
        return self.packed.numel() * self.packed.element_size() + self.scales.numel() * self.scales.element_size()

    def dequantize(self) -> torch.Tensor:
        """The stored values, with the original shape and dtype."""
        codes = _centred_codes(self.packed, self.bits, math.prod(self.shape))
        group = math.prod(self.shape) if self.group_size is None else self.group_size
        values = codes.reshape(*self.scales.shape, group)
        return values.mul_(self.scales.unsqueeze(-1)).reshape(self.shape).to(self.dtype)

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(packed, scales): the tensors to hand to `ctx.save_for_backward`."""
        return self.packed, self.scales

    def metadata(self) -> dict[str, Any]:
        """The non-tensor fields, as keyword arguments for `from_tensors`."""
        return {"shape": self.shape, "dtype": self.dtype, "bits": self.bits, "group_size": self.group_size}

    @classmethod
    def from_tensors(
        cls,
        packed: torch.Tensor,
        scales: torch.Tensor,
        *,
        shape: torch.Size | tuple[int, ...],
        dtype: torch.dtype,
        bits: int,
        group_size: int | None,
    ) -> QuantizedTensor:
        """Rebuild from `tensors()` and `metadata()`, checking that they fit together."""
        shape = torch.Size(shape)
        _check_bits("QuantizedTensor.from_tensors", bits)
        group_size = _check_group_size("QuantizedTensor.from_tensors", shape, group_size)
        if tuple(scales.shape) != _scale_shape(shape, group_size):
            raise ValueError(
                f"QuantizedTensor.from_tensors: scales must have shape {_scale_shape(shape, group_size)} for "
                f"shape {tuple(shape)} and group_size={group_size}, got {tuple(scales.shape)}"
            )
        per_byte = _codes_per_byte(bits)
        if packed.dtype != torch.uint8 or packed.numel() != -(-math.prod(shape) // per_byte):
            raise ValueError(
                f"QuantizedTensor.from_tensors: packed must be uint8 with {-(-math.prod(shape) // per_byte)} "
                f"elements for shape {tuple(shape)} at {bits} bits, got {packed.dtype} with {packed.numel()}"
            )
        return cls(packed, scales, shape, dtype, bits, group_size)


def quantize_absmax(
    x: torch.Tensor,
    bits: int,
    *,
    group_size: int | None = None,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> QuantizedTensor:
    """Symmetric absmax quantization of `x` to `bits` in 2..8, codes -qmax..qmax, packed (see the module docstring).

    group_size: None for one scale per tensor, or the length of the contiguous groups along the last dimension
    (which it must divide) that get one scale each. A group of zeros gets scale 0 and dequantizes to exact
    zeros; a group holding a NaN or inf gets scale NaN and dequantizes to NaN. stochastic: round with
    floor(v + U[0, 1)) instead of to nearest (ties to even); `generator` makes the draws reproducible.
    """
    groups, scales = _absmax_scales("quantize_absmax", x, bits, group_size)
    qmax = 2 ** (bits - 1) - 1
    # Through int8, which holds -qmax..qmax at every width: torch's float -> int8 cast is vectorized and 2.5x faster
    # than float -> uint8 on a CPU; the uint8 view then adds qmax modulo 256, which lands every code in 0..2 * qmax.
    codes = _round_codes(groups, scales, qmax, stochastic, generator).to(torch.int8).view(torch.uint8).add_(qmax)
    return QuantizedTensor(pack_codes(codes, bits), scales, x.shape, x.dtype, bits, group_size)


def _round_codes(
    groups: torch.Tensor, scales: torch.Tensor, qmax: int, stochastic: bool, generator: torch.Generator | None
) -> torch.Tensor:
    """float32 codes in -qmax..qmax of `groups` ([..., group]) at `scales` ([...]), as quantize_absmax rounds."""
    # Zero and NaN groups divide by 1: their codes are then defined (0 after nan_to_num) and the scale decides.
    v = groups / torch.where(scales > 0, scales, 1.0).unsqueeze(-1)
    if stochastic:
        v.add_(torch.rand(v.shape, generator=generator, device=v.device)).floor_()
    else:
        v.round_()
    # clamp catches x / scale landing a rounding error above qmax; NaN codes would be undefined as uint8.
    return v.clamp_(-qmax, qmax).nan_to_num_(0.0)


def absmax_rows(
    x: torch.Tensor,
    rows: torch.Tensor,
    bits: int,
    *,
    group_size: int | None = None,
    stochastic: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows `rows` of `x` (as [-1, x.shape[-1]]) quantized as `quantize_absmax(x, ...)` quantizes them, computed
    only there: (codes as float32 [R, G, group], scales [R, G]; one scale per tensor: G = 1 and scales [1, 1]), so
    `(codes * scales.unsqueeze(-1)).reshape(R, -1)` is those rows of `dequantize()` (for round to nearest exactly;
    stochastic rounding draws anew). One scale per tensor is the whole tensor's: `scale` when the caller has it,
    else the absmax of all of `x`. What a fidelity measure reads (`gnmr_hf.fidelity.spread_rows`)."""
    sub = x.reshape(-1, x.shape[-1]).index_select(0, rows)
    return absmax_round_rows(x, sub, bits, group_size=group_size, stochastic=stochastic, scale=scale)


def absmax_round_rows(
    x: torch.Tensor | None,
    sub: torch.Tensor,
    bits: int,
    *,
    group_size: int | None = None,
    stochastic: bool = False,
    scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`absmax_rows` of rows of `x` the caller has already taken (`sub`, [R, x.shape[-1]]): `x` itself is read only
    for one scale per tensor when `scale` is not given (and may be None when it is, or with `group_size`)."""
    qmax = 2 ** (_check_bits("absmax_rows", bits) - 1) - 1
    if group_size is None:
        if scale is None:
            if x is None:
                raise ValueError("absmax_round_rows: one scale per tensor needs x or scale")
            scale = tensor_absmax_scale(x, bits)
        groups, scales = sub.to(torch.float32).unsqueeze(1), scale.reshape(1, 1)
    else:
        groups, scales = _absmax_scales("absmax_rows", sub, bits, group_size)
    return _round_codes(groups, scales, qmax, stochastic, None), scales


def round_codes(values: torch.Tensor, scales: torch.Tensor, bits: int, *, stochastic: bool = False) -> torch.Tensor:
    """float32 codes in -qmax..qmax of `values` ([..., n]) at `scales` ([...], one per run of the last dimension),
    rounded as `quantize_absmax` rounds (a zero or NaN scale divides by 1; NaN codes are 0)."""
    return _round_codes(values, scales, 2 ** (_check_bits("round_codes", bits) - 1) - 1, stochastic, None)


def tensor_absmax_scale(x: torch.Tensor, bits: int) -> torch.Tensor:
    """The one scale `quantize_absmax(x, bits)` uses (0-d float32; NaN when x holds a non-finite value)."""
    return _absmax_scales("absmax_rows", x, bits, None)[1]


def quantized_nbytes(shape: torch.Size | tuple[int, ...], bits: int, group_size: int | None = None) -> int:
    """Bytes `quantize_absmax` holds for a tensor of `shape` (packed codes plus float32 scales), without quantizing.

    Equal to `QuantizedTensor.nbytes` of the result; a backend uses it to state what a tensor would cost at another
    bit width (its recovery path's extra bytes) from the shape alone.
    """
    _check_bits("quantized_nbytes", bits)
    shape = torch.Size(shape)
    group_size = _check_group_size("quantized_nbytes", shape, group_size)
    codes = -(-math.prod(shape) // _codes_per_byte(bits))
    return codes + 4 * math.prod(_scale_shape(shape, group_size))


def absmax_error_bound(
    x: torch.Tensor, bits: int, group_size: int | None = None, *, stochastic: bool = False
) -> torch.Tensor:
    """Per-element bound on |x - quantize_absmax(x, ...).dequantize()|, float32, shape of x.

    scale / 2 for round to nearest, scale (a strict bound) for stochastic rounding, in exact arithmetic (float32
    evaluation adds a few ulps of |x|). NaN for the elements of a non-finite group, which have no bound.
    """
    groups, scales = _absmax_scales("absmax_error_bound", x, bits, group_size)
    bound = scales if stochastic else scales / 2
    return bound.unsqueeze(-1).expand(groups.shape).reshape(x.shape)


# --------------------------------------------------------------------------------------------------------------
# Low-bit float formats
# --------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FloatFormat:
    """A low-bit float element format: 1 sign bit, `exp_bits`, `man_bits`, exponent bias `bias`.

    `emax` is the exponent of the largest finite value (floor(log2(max_finite))), the emax_elem of the MX spec;
    `emin` = 1 - bias, the exponent of the smallest normal value. `torch_dtype` is the torch dtype whose cast
    does the rounding, or None where this module rounds by hand.
    """

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    max_finite: float
    min_normal: float
    min_subnormal: float
    has_inf: bool
    has_nan: bool
    torch_dtype: torch.dtype | None

    @property
    def emin(self) -> int:
        return 1 - self.bias

    @property
    def emax(self) -> int:
        return math.frexp(self.max_finite)[1] - 1


# Read-only: the backends and the tests share these constants.
FORMATS: Mapping[str, FloatFormat] = MappingProxyType(
    {
        # OCP MX v1.0 element types: no inf/NaN codes, so the top exponent code is an ordinary normal binade.
        "e2m1": FloatFormat("e2m1", 2, 1, 1, 6.0, 1.0, 0.5, False, False, None),
        "e2m3": FloatFormat("e2m3", 2, 3, 1, 7.5, 1.0, 0.125, False, False, None),
        "e3m2": FloatFormat("e3m2", 3, 2, 3, 28.0, 0.25, 0.0625, False, False, None),
        # OCP FP8: E4M3FN spends only S.1111.111 on NaN (max 1.75 * 2**8); E5M2 reserves its top exponent, as IEEE.
        "e4m3": FloatFormat("e4m3", 4, 3, 7, 448.0, 2.0**-6, 2.0**-9, False, True, torch.float8_e4m3fn),
        "e5m2": FloatFormat("e5m2", 5, 2, 15, 57344.0, 2.0**-14, 2.0**-16, True, True, torch.float8_e5m2),
    }
)


def _get_format(where: str, fmt: Any) -> FloatFormat:
    if fmt not in FORMATS:
        raise ValueError(f"{where}: fmt must be one of {sorted(FORMATS)}, got {fmt!r}")
    return FORMATS[fmt]


def _quanta(v: torch.Tensor, f: FloatFormat) -> torch.Tensor:
    """The spacing of `f`'s values around each value of float32 `v`: 2**(max(e, emin) - man_bits), e = v's exponent.

    Built as float32 bits: keep v's exponent field, clamp it at emin's and subtract man_bits. For inf/NaN (field
    255) it is a finite power of two, so a NaN stays NaN through v / q."""
    q_bits = (v.view(torch.int32) & _F32_EXP_MASK).clamp_(min=(f.emin + _F32_BIAS) << _F32_MAN_BITS)
    return q_bits.sub_(f.man_bits << _F32_MAN_BITS).view(torch.float32)


def _round_(
    v: torch.Tensor, f: FloatFormat, stochastic: bool = False, generator: torch.Generator | None = None
) -> torch.Tensor:
    """Round float32 `v` to format `f` in place and return it: saturating (so +-inf becomes +-max), NaN stays NaN.

    stochastic: to one of the two neighbours, the upper one with probability (v - lower) / (upper - lower), so that
    the expected result is v for every v within +-max: v is clamped first (a saturated value is biased, as in
    hardware), then floor(v / q + U[0, 1)) * q, with q `_quanta` (max is a multiple of its binade's q, so nothing
    lands above it). float32 noise in [0, 1) has 24 bits, which leaves a bias below 2**-20 quanta.

    In place because on a CPU every fresh tensor above glibc's mmap threshold (32 MiB) is page-faulted in anew,
    which costs more than the arithmetic: on 4096 x 4096 float32, `x * 2` takes ~50 ms, `x.mul_(2)` ~4 ms.
    """
    if stochastic:
        # By hand for the FP8 formats too (the float8 casts only round to nearest): the same bit-level method
        # reproduces those casts exactly (tests/test_quant.py).
        q = _quanta(v.clamp_(-f.max_finite, f.max_finite), f)
        noise = torch.rand(v.shape, generator=generator, device=v.device)
        return v.div_(q).add_(noise).floor_().mul_(q)
    if f.torch_dtype is not None:
        # copy_ converts the float8 tensor back into v's own memory instead of a new float32 tensor.
        return v.copy_(v.clamp_(-f.max_finite, f.max_finite).to(f.torch_dtype))
    q = _quanta(v, f)
    return v.div_(q).round_().mul_(q).clamp_(-f.max_finite, f.max_finite)


def round_to_format(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Each value of `x` rounded to the nearest value of `fmt` (a key of `FORMATS`), as a new float32 tensor.

    Ties to the even mantissa; finite values beyond the format's max saturate to +-max; subnormals exact; NaN
    stays NaN, +-inf stays +-inf, -0.0 stays -0.0. `x` is first converted to float32, exactly for bf16/fp16;
    a float64 value within 2**-24 (relative) of a midpoint may round the other way.
    """
    f = _get_format("round_to_format", fmt)
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"round_to_format: x must be a floating-point tensor, got {getattr(x, 'dtype', type(x))}")
    y = _round_(x.to(torch.float32, copy=True), f)
    # Saturation turned +-inf into +-max; put it back so that the failure stays visible.
    return torch.where(torch.isinf(x), x, y, out=y)


def _check_block(block: Any) -> tuple[int, int]:
    ok = isinstance(block, (tuple, list)) and len(block) == 2
    if not ok or any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in block):
        raise ValueError(f"quantize_blocks: block must be a pair of ints >= 1 (rows, columns), got {block!r}")
    return int(block[0]), int(block[1])


SCALES = ("fp32", "pow2", "nvfp4")
# NVFP4's second level: the block scales are E4M3 numbers, in units of an FP32 scale per tensor.
_E4M3 = FORMATS["e4m3"]


def quantize_blocks(
    x: torch.Tensor,
    fmt: str,
    block: tuple[int, int] | None = None,
    *,
    scale: str = "fp32",
    return_scales: bool = False,
    stochastic: bool = False,
    generator: torch.Generator | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Fake-quantize `x` to `fmt` with one scale per block: round_to_format(x / s, fmt) * s, in float32.

    x is viewed as 2-D, leading dimensions flattened into rows (a 1-D x is one row). block: (rows, columns) of a
    block; None means (1, 128) for scale="fp32" (DeepSeek-V3's activation/gradient tiles; pass (128, 128) for
    weights), (1, 32) for scale="pow2" (MX) and (1, 16) for scale="nvfp4". A shape that the block does not divide
    is zero-padded internally: the ragged last blocks get their own scales from their real elements.

    scale: "fp32" for s = amax / max_finite in float32; "pow2" for the MX v1.0 E8M0 scale
    s = 2**(floor(log2(amax)) - emax), clamped below at 2**-127 as E8M0 is; "nvfp4" for NVIDIA's two levels,
    s = t * e4m3(amax / max_finite / t) with the per-tensor FP32 scale t = tensor amax / (448 * max_finite), in
    torchao's `NVFP4Tensor` arithmetic (bit for bit on finite inputs; its exceptions: `_nvfp4_scales`). With "fp32"
    and "pow2" a block of zeros (or one whose fp32 scale underflows to 0) gets s = 1; with "nvfp4" the smallest
    normal E4M3 scale, t * 2**-6. A block with a NaN or inf gets s = NaN and comes back all NaN (with "nvfp4", t is
    taken from the finite blocks only, so the other blocks stay as they were).

    stochastic: round each element stochastically (unbiased below the format's max, see `_round_`) with draws from
    `generator` (None: torch's global generator), instead of to nearest.

    Returns float32 with x's shape: the values the emulated GEMM multiplies, with no second rounding to x.dtype
    (element * fp32 scale is in general not a bf16 number). With return_scales=True, also the float32 scales,
    shape (ceil(rows / block rows), ceil(columns / block columns)).
    """
    f = _get_format("quantize_blocks", fmt)
    if scale not in SCALES:
        raise ValueError(f"quantize_blocks: scale must be one of {list(SCALES)}, got {scale!r}")
    if not isinstance(x, torch.Tensor) or not x.is_floating_point() or x.dim() == 0:
        raise TypeError(
            f"quantize_blocks: x must be a floating-point tensor with at least 1 dimension, got "
            f"{getattr(x, 'dtype', type(x))} with shape {tuple(getattr(x, 'shape', ()))}"
        )
    if block is None:
        block = {"fp32": (1, 128), "pow2": (1, 32), "nvfp4": (1, 16)}[scale]
    br, bc = _check_block(block)

    rows, cols = math.prod(x.shape[:-1]), x.shape[-1]
    x2 = x.to(torch.float32).reshape(rows, cols)
    n_r, n_c = -(-rows // br), -(-cols // bc)
    if (n_r * br, n_c * bc) != (rows, cols):
        # Zeros do not change a block's amax, so the ragged blocks are scaled by their real elements only.
        x2 = F.pad(x2, (0, n_c * bc - cols, 0, n_r * br - rows))
    blocks = x2.view(n_r, br, n_c, bc)

    if blocks.numel() == 0:
        amax = blocks.new_zeros(n_r, n_c)
    else:
        # amax/amin propagate NaN, and avoid the full-size temporary that abs() would allocate.
        amax = torch.maximum(blocks.amax(dim=(1, 3)), blocks.amin(dim=(1, 3)).neg())
    if scale == "nvfp4":
        s, rcp = _nvfp4_scales(amax, f)
        v = blocks * rcp.view(n_r, 1, n_c, 1)
    else:
        if scale == "fp32":
            s = amax / f.max_finite
        else:
            # frexp: amax = m * 2**k with m in [0.5, 1), so floor(log2(amax)) = k - 1 exactly (torch.log2 can round
            # a value just below a power of two up to it). The power of two is built from float64 bits: exact, and
            # 2**-127 is a float32 subnormal that exp2 implementations need not hit exactly.
            exp = (torch.frexp(amax).exponent.to(torch.int64) - 1 - f.emax).clamp_(min=-127)
            s = ((exp + 1023) << 52).view(torch.float64).to(torch.float32)
        s = torch.where((amax == 0) | (s == 0), 1.0, s)
        s = torch.where(torch.isfinite(amax), s, math.nan)
        v = blocks / s.view(n_r, 1, n_c, 1)

    # An inf only reaches the rounding divided by its block's NaN scale, so no inf needs putting back here.
    y = _round_(v, f, stochastic, generator).mul_(s.view(n_r, 1, n_c, 1)).view(n_r * br, n_c * bc)
    y = y[:rows, :cols].reshape(x.shape)
    return (y, s) if return_scales else y


def _nvfp4_scales(amax: torch.Tensor, f: FloatFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """(decode scale s, encode reciprocal) per block from the blocks' amax, as torchao 0.18's `nvfp4_quantize`
    computes them, operation for operation (the element is x * reciprocal, not x / s: the two can differ in the last
    bit, and then at a rounding midpoint): t = tensor amax / (448 * max), block scale
    e = e4m3(clamp(amax / max / t, 2**-6, 448)), reciprocal (1 / t) / e, s = t * e.

    Where torchao's arithmetic makes a finite input NaN, it is changed (docs/quant.md): t comes from the finite
    blocks only (torchao: one NaN or inf anywhere makes every block NaN); an all-zero tensor gets t = 1 (torchao:
    0 / 0); a reciprocal that overflows, possible only in a tensor whose amax is below 2688 * 2**-122 (about
    2**-110.6), becomes 0 (torchao: inf, so NaN from each 0 and +-max from the rest), which rounds those blocks'
    elements (all below that amax) to 0.
    """
    finite = torch.isfinite(amax)
    tensor_amax = torch.where(finite, amax, 0.0).amax() if amax.numel() else amax.new_zeros(())
    t = tensor_amax / (_E4M3.max_finite * f.max_finite)
    t = torch.where(t > 0, t, 1.0)
    e = (amax / f.max_finite / t).clamp_(_E4M3.min_normal, _E4M3.max_finite).to(_E4M3.torch_dtype).float()
    rcp = (1.0 / t) / e
    rcp = torch.where(torch.isfinite(rcp), rcp, 0.0)
    s = torch.where(finite, t * e, math.nan)
    return s, rcp


# --------------------------------------------------------------------------------------------------------------
# Random Hadamard rotation (NVFP4's weight-gradient GEMM)
# --------------------------------------------------------------------------------------------------------------


def random_hadamard(size: int = 16, seed: int = 0, *, device: torch.device | str | None = None) -> torch.Tensor:
    """The `size` x `size` random Hadamard matrix H = S D / sqrt(size), float32: S the Sylvester Hadamard matrix
    (entries +-1), D a diagonal of random signs from a CPU generator seeded with `seed` (so the same H on every
    device, rank and run). H is orthogonal (H^T H = I), so rotating both inputs of a GEMM along its contraction
    dimension leaves the product unchanged in exact arithmetic, while it spreads an outlier over `size` elements
    before they are rounded (NVIDIA's NVFP4 recipe: 16, on the weight-gradient GEMM). For size a power of 4 every
    entry is +-2**-k, so H^T H = I holds exactly in float32 too."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1 or size & (size - 1):
        raise ValueError(f"random_hadamard: size must be a power of two >= 1, got {size!r}")
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (size,), generator=torch.Generator().manual_seed(seed)).mul_(2).sub_(1)
    return (h * signs / math.sqrt(size)).to(device)


def rotate_rows(t: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """2-D `t` ([rows, columns]) with each run of n consecutive rows multiplied by `rotation` ([n, n]) from the
    left, in float32 (float64 stays float64), rows zero-padded to a multiple of n (zero rows add nothing to a product
    over rows). Rotating both inputs of a GEMM that contracts over rows, `rotate_rows(a, H).T @ rotate_rows(b, H)`,
    gives `a.T @ b` for an orthogonal H."""
    n = rotation.shape[0]
    rows, cols = t.shape
    t = t.to(torch.promote_types(t.dtype, torch.float32))
    if rows % n:
        t = F.pad(t, (0, 0, 0, -rows % n))
    return torch.matmul(rotation.to(t.device, t.dtype), t.reshape(-1, n, cols)).view(-1, cols)
