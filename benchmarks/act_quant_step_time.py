"""Seconds per training step (forward and backward) of the probe-scale LLaMA, plain against `act_quant` with every
kind, and the split between quantization and the rest; on a GPU also the peak memory of the step.

    python benchmarks/act_quant_step_time.py               # d=128, 4 layers, batch 16 x 128, one thread
    python benchmarks/act_quant_step_time.py --device cuda --bf16 --d_model 2048 --n_layers 22 --n_heads 32 \
        --vocab 32000 --batch 8 --seq_len 512               # a 1B-class LLaMA (TinyLlama's shape), from gpu_check.sh
    python benchmarks/act_quant_step_time.py --model smollm2-135m --batch 2 --steps 2   # the real SmolLM2-135M

Settings: the plain model (sdpa attention); `kinds=all` at 16 bits (our code path with nothing quantized: eager
attention with the recomputing backward, the SwiGLU and RMSNorm functions, the chunked loss); at 8 and 4 bits. The
quantization's share is the 8 or 4 bits step minus the 16 bits one (quantizing, packing, dequantizing); the rest is
the 16 bits step minus the plain one. On a CPU the quantizer is emulated in eager PyTorch, so this is reported, not
a goal. Median of `--steps` steps after one warm-up step. On CUDA, "peak GiB" is the most memory allocated during a
step above what the model, its gradients and the batch hold before it: the activations, and the backward's
transients.
"""

from __future__ import annotations

import argparse
import statistics
import time

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("act_quant"):
    import torch

    from gnmr_hf import find_units
    from gnmr_hf.experiments.pretrain import build_model, llama_config


def step_seconds(model: torch.nn.Module, ids: torch.Tensor, steps: int, bf16: bool) -> tuple[float, float]:
    """(median seconds per step, peak bytes above the step's start on CUDA, else 0)."""
    cuda = ids.device.type == "cuda"
    times, peak = [], 0
    for _ in range(steps + 1):
        model.zero_grad(set_to_none=False)
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
        start = time.perf_counter()
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=bf16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
            peak = max(peak, torch.cuda.max_memory_allocated() - base)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:]), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=4)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--bf16", action="store_true", help="Run the step under bf16 autocast.")
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument(
        "--model",
        default=None,
        help="a real model of gnmr_hf.experiments.models (smollm2-135m) instead of a LLaMA of the shape flags; "
        "its pretrained weights in fp32, random token ids of its vocabulary",
    )
    cli = parser.parse_args()
    if cli.device == "cpu":
        torch.set_num_threads(1)
    if cli.model is None:
        config = llama_config(cli.d_model, cli.n_layers, cli.n_heads, cli.seq_len, cli.vocab)

        def make_model() -> torch.nn.Module:
            return build_model(config, 0)

    else:
        from transformers import AutoConfig

        from gnmr_hf.experiments.models import load_real_model, resolve_model

        def make_model() -> torch.nn.Module:
            return load_real_model(cli.model)[0]

        config = AutoConfig.from_pretrained(str(resolve_model(cli.model)))  # its shape, without loading the weights
        cli.d_model, cli.n_layers, cli.vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    ids = torch.randint(0, cli.vocab, (cli.batch, cli.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(cli.device)
    rows = []
    for bits in (None, 16, 8, 4):
        model = make_model().to(cli.device)
        units = None if bits is None else find_units(model, "act_quant", kinds="all", low_bits=bits, high_bits=16)
        name = "plain model (sdpa)" if bits is None else f"all, {bits} bits"
        rows.append((name, *step_seconds(model, ids, cli.steps, cli.bf16)))
        if units is not None:
            units.close()
        del model
    plain, unquantized = rows[0][1], rows[1][1]
    where = "1 thread" if cli.device == "cpu" else cli.device
    print(
        f"Seconds per step: {cli.model or 'LLaMA'}, batch {cli.batch} x {cli.seq_len}, d={cli.d_model}, "
        f"{cli.n_layers} layers, "
        f"vocabulary {cli.vocab}, {where}{', bf16 autocast' if cli.bf16 else ''}"
    )
    print("| setting | s/step | vs plain | quantization s | rest over plain s | peak GiB |")
    print("|---|---|---|---|---|---|")
    for name, seconds, peak in rows:
        quant = f"{seconds - unquantized:.3f}" if name.startswith("all") else "-"
        rest = f"{unquantized - plain:.3f}" if name.startswith("all") else "-"
        memory = f"{peak / 2**30:.2f}" if peak else "-"
        print(f"| {name} | {seconds:.3f} | {seconds / plain:.2f} | {quant} | {rest} | {memory} |")


if __name__ == "__main__":
    main()
