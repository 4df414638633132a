"""The logits at a real vocabulary: what the head and its loss save for backward, their gradient error and their time,
plain against `act_quant`'s chunked loss (the `head` kind) and against quantized log-probabilities.

    python benchmarks/act_quant_head.py                    # vocabulary 32000, d=128, 2048 tokens (16 x 128)

Rows: the plain head and `F.cross_entropy` (they keep the head input and the float32 log-softmax, N x V); the head
unit's path, `QuantSavedLinear` for the logits and `ChunkedHeadLoss` for the loss, at 16, 8 and 4 bits (they keep the
packed head input and the targets; the backward recomputes the logits chunk by chunk); and the alternative, the
log-softmax kept at 8 or 4 bits with one scale per row (its bytes from the shapes, its gradient from the dequantized
copy). Inputs: random hidden states and a head weight scaled so that logits have a standard deviation of about 3, as
a trained model's do. Error: relative L2 error of the head weight's and the hidden states' gradients. Time: forward
plus backward, median of `--repeats`, on this machine's CPU with one thread.
"""

from __future__ import annotations

import argparse
import statistics
import time

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("act_quant"):
    import torch
    import torch.nn.functional as F

    from gnmr_hf.backends.act_quant import ChunkedHeadLoss, QuantSavedLinear, SaveCache, SaveSpec
    from gnmr_hf.experiments.pretrain import SavedTensorMeter
    from gnmr_hf.quant import quantize_absmax, quantized_nbytes


def plain(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w), targets)


def chunked(bits: int):
    def loss(h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        spec, cache = SaveSpec(bits, "row"), SaveCache()
        logits = QuantSavedLinear.apply(h, w, None, spec, cache)
        return ChunkedHeadLoss.apply(logits.detach(), h, w, None, targets, -100, None, spec, cache)

    return loss


def run(loss_fn, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> tuple[int, float, torch.Tensor, ...]:
    h, w = h.clone().requires_grad_(), w.clone().requires_grad_()
    start = time.perf_counter()
    with SavedTensorMeter(exclude=torch.nn.ParameterList([w])) as meter:
        loss = loss_fn(h, w, targets)
    loss.backward()
    return meter.nbytes, time.perf_counter() - start, h.grad, w.grad


def quantized_log_softmax_grads(h, w, targets, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradients a backward would get from the log-softmax saved at `bits` (row scales)."""
    log_p = torch.log_softmax(F.linear(h, w), -1)
    log_p_hat = quantize_absmax(log_p, bits, group_size=log_p.shape[-1]).dequantize()
    d = (log_p_hat.exp() - F.one_hot(targets, w.shape[0])) / targets.numel()
    return d @ w, d.t() @ h


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=3)
    cli = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    h = torch.randn(cli.tokens, cli.d_model, generator=gen)
    w = torch.randn(cli.vocab, cli.d_model, generator=gen) * 3 / cli.d_model**0.5
    targets = torch.randint(0, cli.vocab, (cli.tokens,), generator=gen)

    def error(a: torch.Tensor, b: torch.Tensor) -> float:
        return ((a - b).norm() / b.norm()).item()

    settings = [("plain head + F.cross_entropy", plain)] + [
        (f"chunked loss, {b} bits", chunked(b)) for b in (16, 8, 4)
    ]
    ref = None
    print(f"Head and loss: vocabulary {cli.vocab}, d={cli.d_model}, {cli.tokens} tokens")
    print("| setting | saved MiB | grad W error | grad h error | fwd+bwd s |")
    print("|---|---|---|---|---|")
    for name, fn in settings:
        runs = [run(fn, h, w, targets) for _ in range(cli.repeats)]
        nbytes, _, gh, gw = runs[0]
        ref = ref or (gh, gw)
        seconds = statistics.median(r[1] for r in runs)
        print(f"| {name} | {nbytes / 2**20:.2f} | {error(gw, ref[1]):.2e} | {error(gh, ref[0]):.2e} | {seconds:.2f} |")
    for bits in (8, 4):
        gh, gw = quantized_log_softmax_grads(h, w, targets, bits)
        nbytes = h.numel() * 4 + quantized_nbytes((cli.tokens, cli.vocab), bits, cli.vocab) + 8 * cli.tokens
        print(f"| log-softmax at {bits} bits, row scales | {nbytes / 2**20:.2f} | {error(gw, ref[1]):.2e} | ", end="")
        print(f"{error(gh, ref[0]):.2e} | - |")


if __name__ == "__main__":
    main()
