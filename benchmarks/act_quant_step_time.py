"""Seconds per training step (forward and backward) of the probe-scale LLaMA, plain against `act_quant` with every
kind, and the split between quantization and the rest.

    python benchmarks/act_quant_step_time.py               # d=128, 4 layers, batch 16 x 128, one thread

Settings: the plain model (sdpa attention); `kinds=all` at 16 bits (our code path with nothing quantized: eager
attention with the recomputing backward, the SwiGLU and RMSNorm functions, the chunked loss); at 8 and 4 bits. The
quantization's share is the 8 or 4 bits step minus the 16 bits one (quantizing, packing, dequantizing); the rest is
the 16 bits step minus the plain one. On a CPU the quantizer is emulated in eager PyTorch, so this is reported, not
a goal. Median of `--steps` steps after one warm-up step.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from gnmr_hf import find_units
from gnmr_hf.experiments.pretrain import build_model, llama_config


def step_seconds(model: torch.nn.Module, ids: torch.Tensor, steps: int) -> float:
    times = []
    for _ in range(steps + 1):
        model.zero_grad()
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    config = llama_config(cli.d_model, cli.n_layers, 4, cli.seq_len)
    ids = torch.randint(0, 256, (cli.batch, cli.seq_len), generator=torch.Generator().manual_seed(0))
    plain = step_seconds(build_model(config, 0), ids, cli.steps)
    rows = [("plain model (sdpa)", plain)]
    for bits in (16, 8, 4):
        model = build_model(config, 0)
        units = find_units(model, "act_quant", kinds="all", low_bits=bits, high_bits=16)
        rows.append((f"all, {bits} bits", step_seconds(model, ids, cli.steps)))
        units.close()
    unquantized = rows[1][1]
    print(f"Seconds per step: batch {cli.batch} x {cli.seq_len}, d={cli.d_model}, {cli.n_layers} layers, 1 thread")
    print("| setting | s/step | vs plain | quantization s | rest over plain s |")
    print("|---|---|---|---|---|")
    for name, seconds in rows:
        quant = f"{seconds - unquantized:.3f}" if name.startswith("all") else "-"
        rest = f"{unquantized - plain:.3f}" if name.startswith("all") else "-"
        print(f"| {name} | {seconds:.3f} | {seconds / plain:.2f} | {quant} | {rest} |")


if __name__ == "__main__":
    main()
