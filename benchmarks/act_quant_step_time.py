"""Seconds per training step (forward and backward) of the probe-scale LLaMA, plain against `act_quant` with every
kind, and the split between quantization and the rest; on a GPU also the peak memory of the step.

    python benchmarks/act_quant_step_time.py               # d=128, 4 layers, batch 16 x 128, one thread
    python benchmarks/act_quant_step_time.py --device cuda --bf16 --d_model 2048 --n_layers 22 --n_heads 32 \
        --vocab 32000 --batch 8 --seq_len 512               # a 1B-class LLaMA (TinyLlama's shape), from gpu_check.sh
    python benchmarks/act_quant_step_time.py --model smollm2-135m --batch 2 --steps 2   # the real SmolLM2-135M

Settings: the plain model (sdpa attention); `kinds=all` at 16 bits (our code path with nothing quantized: eager
attention with the recomputing backward, the SwiGLU and RMSNorm functions, the chunked loss); at 8 and 4 bits. The
quantization's share is the 8 or 4 bits step minus the 16 bits one (quantizing, packing, dequantizing); the rest is
the 16 bits step minus the plain one; both are stated as fractions of the plain step, which load on a shared machine
moves less than the seconds. The four models are built first and their steps interleaved, one of each per round, so
that a change of load falls on every setting alike; after one warm-up round, each setting's median and minimum seconds
over `--steps` rounds, and each ratio as the median over rounds of that round's ratio (steps moments apart). On CUDA,
"peak GiB" is the most memory allocated during a step above what is held before it (the four models, their gradients
and the batch): the activations, and the backward's transients.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("act_quant"):
    import torch

    from gnmr_hf import find_units
    from gnmr_hf.experiments.pretrain import build_model, llama_config


def step_seconds(model: torch.nn.Module, ids: torch.Tensor, bf16: bool) -> tuple[float, int]:
    """(seconds of one training step, peak bytes above the step's start on CUDA, else 0)."""
    cuda = ids.device.type == "cuda"
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
    seconds = time.perf_counter() - start
    return seconds, torch.cuda.max_memory_allocated() - base if cuda else 0


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
    parser.add_argument("--steps", type=int, default=5, help="interleaved rounds timed, after one warm-up round")
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
            # A config of its own: the models live side by side, and find_units switches its model's config to the
            # act_quant attention (a shared one would switch the plain model too).
            return build_model(copy.deepcopy(config), 0)

    else:
        from transformers import AutoConfig

        from gnmr_hf.experiments.models import load_real_model, resolve_model

        def make_model() -> torch.nn.Module:
            return load_real_model(cli.model)[0]

        config = AutoConfig.from_pretrained(str(resolve_model(cli.model)))  # its shape, without loading the weights
        cli.d_model, cli.n_layers, cli.vocab = config.hidden_size, config.num_hidden_layers, config.vocab_size
    ids = torch.randint(0, cli.vocab, (cli.batch, cli.seq_len), generator=torch.Generator().manual_seed(0))
    ids = ids.to(cli.device)
    settings = (None, 16, 8, 4)
    models, unit_sets = [], []
    for bits in settings:
        models.append(make_model().to(cli.device))
        kwargs = {"kinds": "all", "low_bits": bits, "high_bits": 16}
        unit_sets.append(None if bits is None else find_units(models[-1], "act_quant", **kwargs))
    times: list[list[float]] = [[] for _ in settings]
    peaks = [0 for _ in settings]
    for round_ in range(cli.steps + 1):
        for i, model in enumerate(models):
            seconds, peak = step_seconds(model, ids, cli.bf16)
            if round_:  # round 0 warms every model up
                times[i].append(seconds)
                peaks[i] = max(peaks[i], peak)
    for units in unit_sets:
        if units is not None:
            units.close()
    plain, unquantized = times[0], times[1]

    def per_round(f: Callable[[int], float]) -> float:
        """The median over rounds of `f(round)`: a ratio of steps taken moments apart, under the same load."""
        return statistics.median(f(r) for r in range(cli.steps))

    where = "1 thread" if cli.device == "cpu" else cli.device
    print(
        f"Seconds per step: {cli.model or 'LLaMA'}, batch {cli.batch} x {cli.seq_len}, d={cli.d_model}, "
        f"{cli.n_layers} layers, vocabulary {cli.vocab}, {where}{', bf16 autocast' if cli.bf16 else ''}; "
        f"{cli.steps} interleaved rounds"
    )
    print("| setting | median s | min s | vs plain | quantization / plain | rest / plain | peak GiB |")
    print("|---|---|---|---|---|---|---|")
    for bits, t, peak in zip(settings, times, peaks, strict=True):
        name = "plain model (sdpa)" if bits is None else f"all, {bits} bits"
        ratio = per_round(lambda r, t=t: t[r] / plain[r])
        quant = "-" if bits is None else f"{per_round(lambda r, t=t: (t[r] - unquantized[r]) / plain[r]):.2f}"
        rest = "-" if bits is None else f"{per_round(lambda r: (unquantized[r] - plain[r]) / plain[r]):.2f}"
        memory = f"{peak / 2**30:.2f}" if peak else "-"
        print(f"| {name} | {statistics.median(t):.3f} | {min(t):.3f} | {ratio:.2f} | {quant} | {rest} | {memory} |")


if __name__ == "__main__":
    main()
