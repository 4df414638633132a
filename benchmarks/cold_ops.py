"""What one small op costs on this CPU warm, and as the first op after a GEMM: the floor under a fidelity measure.

    OMP_NUM_THREADS=1 python benchmarks/cold_ops.py --repeats 300

A measure that a unit takes where the data lives runs between the step's large kernels, so its first op pays for
bringing PyTorch's dispatch path back into the caches the GEMM evicted. Timed here, per op (median over `--repeats`),
on the probe model's shapes (2,048 token rows of 128 values, a 128 -> 384 projection): `torch.empty` of 256 rows, an
`index_select` of 256 spread rows (what a measure takes), and the same into a preallocated buffer (`out=`, no
allocation), each warm (right after the same op) and cold (right after the GEMM); and how much of a cold op the
model's next op would have paid anyway (a cold select followed by a multiply, less a cold multiply alone).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports():
    import torch


def timed(before: Callable[[], object], op: Callable[[], object], repeats: int) -> float:
    """Median seconds of `op()` run right after `before()`."""
    samples = []
    for _ in range(repeats):
        before()
        start = time.perf_counter()
        op()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=300)
    args = parser.parse_args()
    x, weight = torch.randn(2048, 128), torch.randn(384, 128)
    rows = (torch.arange(256) * 9 + 5) % 2048
    out = torch.empty(256, 128)
    ops = {
        "empty (256 x 128)": lambda: torch.empty(256, 128),
        "index_select of 256 rows": lambda: x.index_select(0, rows),
        "index_select into a buffer (out=)": lambda: torch.index_select(x, 0, rows, out=out),
    }
    gemm = lambda: x @ weight.t()  # noqa: E731 - the step's kind of large kernel
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, {args.repeats} repeats\n")
    print("| op | warm (us) | first after a GEMM (us) |\n|---|---:|---:|")
    for name, op in ops.items():
        warm, cold = timed(op, op, args.repeats), timed(gemm, op, args.repeats)
        print(f"| {name} | {warm * 1e6:.1f} | {cold * 1e6:.1f} |")
    multiply = lambda: x.mul(2.0)  # noqa: E731 - the model's next op
    both = timed(gemm, lambda: (x.index_select(0, rows), multiply()), args.repeats)
    alone = timed(gemm, multiply, args.repeats)
    print(
        f"\ncold select + multiply {both * 1e6:.1f} us, cold multiply alone {alone * 1e6:.1f} us: the select adds "
        f"{(both - alone) * 1e6:.1f} us"
    )


if __name__ == "__main__":
    main()
