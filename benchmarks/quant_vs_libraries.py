"""gnmr_hf.quant against the libraries that now round the same values: speed, and equality on the tensor timed.

    python benchmarks/quant_vs_libraries.py --size 2048 --repeats 7

One size x size float32 standard-normal tensor; each row rounds it one way and back to float32 (what the emulated
GEMMs multiply): FP4/FP6 elements (`round_to_format` / ml_dtypes' `astype`, through numpy on the host), MX blocks
(`quantize_blocks(scale="pow2")` / torchao's `MXTensor.to_mx(...).dequantize()`), FP8 blocks of DeepSeek-V3 (1x128
and 128x128 / torchao's `Float8Tensor` with `PerBlock`) and NVFP4 (`quantize_blocks(scale="nvfp4")` / torchao's
`NVFP4Tensor`). Reported: CPU seconds of this process per call (the least over --repeats calls, after one warm-up),
with one torch thread, which other jobs on a shared machine disturb far less than wall time; the library's time over
ours; and whether the two results are equal bit for bit (they should be: the tensor is finite and has no all-zero
block).
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("torchao_float8"):
    import torch

    from gnmr_hf.quant import quantize_blocks, round_to_format


def cpu_ms(fn: Callable[[], torch.Tensor], repeats: int) -> tuple[float, torch.Tensor]:
    """Least CPU milliseconds of `repeats` calls (after one warm-up), and the result."""
    result = fn()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        fn()
        times.append(time.process_time() - start)
    return 1e3 * min(times), result


def rows(x: torch.Tensor) -> list[tuple[str, Callable[[], torch.Tensor], Callable[[], torch.Tensor]]]:
    """(what, ours, the library's) for every pair that rounds the same values."""
    import ml_dtypes
    import numpy as np
    from torchao.prototype.mx_formats.mx_tensor import MXTensor
    from torchao.prototype.mx_formats.nvfp4_tensor import NVFP4Tensor, per_tensor_amax_to_scale
    from torchao.quantization.granularity import PerBlock
    from torchao.quantization.quantize_.workflows.float8.float8_tensor import Float8Tensor

    def ml(dtype):
        return lambda: torch.from_numpy(x.numpy().astype(dtype).astype(np.float32))

    def mx(dtype):
        return lambda: MXTensor.to_mx(x, dtype, 32).dequantize(torch.float32)

    def per_block(block):
        return lambda: Float8Tensor.from_hp(x, granularity=PerBlock(list(block))).dequantize()

    def nvfp4():
        scale = per_tensor_amax_to_scale(x.abs().max())
        return NVFP4Tensor.to_nvfp4(x, per_tensor_scale=scale).dequantize(torch.float32)

    found = []
    for fmt, dtype in (("e2m1", "float4_e2m1fn"), ("e2m3", "float6_e2m3fn"), ("e3m2", "float6_e3m2fn")):
        ours = functools.partial(round_to_format, x, fmt)
        found.append((f"{fmt} elements | ml_dtypes", ours, ml(getattr(ml_dtypes, dtype))))
    for fmt, dtype in (("e2m1", torch.float4_e2m1fn_x2), ("e3m2", "fp6_e3m2"), ("e4m3", torch.float8_e4m3fn)):
        ours = functools.partial(quantize_blocks, x, fmt, scale="pow2")
        found.append((f"{fmt} MX 1x32 | torchao MXTensor", ours, mx(dtype)))
    for block in ((1, 128), (128, 128)):
        label = f"e4m3 {block[0]}x{block[1]} | torchao Float8Tensor PerBlock"
        found.append((label, functools.partial(quantize_blocks, x, "e4m3", block), per_block(block)))
    found.append(("e2m1 NVFP4 1x16 | torchao NVFP4Tensor", lambda: quantize_blocks(x, "e2m1", scale="nvfp4"), nvfp4))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=2048, help="the tensor is size x size (a multiple of 128)")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.size, args.size, generator=torch.Generator().manual_seed(0))
    print(f"{args.size} x {args.size} float32, torch {torch.__version__}, 1 thread, CPU ms per call (least)\n")
    print("| rounding | library | ours ms | library ms | library / ours | equal |\n|---|---|---:|---:|---:|---|")
    for what, ours, library in rows(x):
        ours_ms, ours_y = cpu_ms(ours, args.repeats)
        library_ms, library_y = cpu_ms(library, args.repeats)
        equal = torch.equal(ours_y, library_y)
        print(f"| {what} | {ours_ms:.0f} | {library_ms:.0f} | {library_ms / ours_ms:.2f} | {equal} |")


if __name__ == "__main__":
    main()
