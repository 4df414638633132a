"""Where a cheap path's loss lands in a real model: per unit, the loss the cause policy's meter measures on its cheap
path beside the error that path puts into the unit's own weight gradient, on one batch.

    OMP_NUM_THREADS=1 python benchmarks/real_model_grad_error.py --model smollm2-135m \\
        --backend_options kinds=all,low_bits=4,high_bits=16 --out runs/grad_error_all4.json

One batch of `--batch` x `--seq_len` tokens of the standard library's sources (the pretraining recipes' corpus, in
the model's own tokens), the model in fp32 and training mode. First the exact gradients, with no unit on the model;
then every unit of `--backend` on its cheap path, measuring as under `policy="cause"` (every row), one forward and
backward of the same batch. Per unit: the relative error of its weight gradient, ||g - g*|| / ||g*|| over its
signal tensors (for act_quant the weights whose gradients its saved activations feed), beside the loss its meter
measured (in units of its bound: the cause policy calls a unit past 1 broken). Printed per kind (median and maximum
of both) and for the units with the largest gradient error; `--out` writes every unit's pair. `--model` also takes a
.gguf file or a transformers folder (`gnmr_hf.experiments.models`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from gnmr_hf.commandline import fail, one_line_errors, quiet_unused_imports

with quiet_unused_imports("act_quant"):
    import torch

    from gnmr_hf import find_units
    from gnmr_hf.experiments.models import check_model, load_real_model
    from gnmr_hf.experiments.pretrain import load_corpus, retokenize
    from gnmr_hf.signals import UnitSignals


def batch_of(model: str, batch: int, seq_len: int) -> torch.Tensor:
    """The first batch x seq_len training tokens of the stdlib corpus in `model`'s tokens ([batch, seq_len])."""
    tokens = retokenize(load_corpus("stdlib", max_bytes=400_000), model).train
    if tokens.numel() < batch * seq_len:
        fail(f"--batch x --seq_len: the corpus has {tokens.numel()} tokens, fewer than {batch * seq_len}")
    return tokens[: batch * seq_len].view(batch, seq_len).long()


def measure(model_name: str, backend: str, options: str, batch: int, seq_len: int) -> list[dict]:
    model = load_real_model(model_name)[0].train()
    ids = batch_of(model_name, batch, seq_len)
    model(input_ids=ids, labels=ids).loss.backward()
    exact = {id(p): p.grad.detach().clone() for p in model.parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    units = find_units(model, backend, backend_options=options)
    for unit in units:
        unit.meter.start(0, clock=lambda: 1, recovery_every=1)
    signals = UnitSignals(units)
    model(input_ids=ids, labels=ids).loss.backward()
    losses = signals.gather_cheap_loss()
    rows = []
    for i, unit in enumerate(units):
        tensors = [t for t in unit.signal_tensors() if t.grad is not None and id(t) in exact]
        error = sum(float((t.grad - exact[id(t)]).double().square().sum()) for t in tensors)
        norm = sum(float(exact[id(t)].double().square().sum()) for t in tensors)
        rows.append(
            {
                "unit": unit.name,
                "kind": unit.kind,
                "grad_error": (error / norm) ** 0.5 if norm > 0 else float("nan"),
                "cheap_loss": float(losses[i]) if losses is not None else float("nan"),
            }
        )
    units.close()
    return rows


def report(rows: list[dict], top: int) -> str:
    lines = ["kind        units  grad error median / max   cheap-path loss median / max (1 = the bound)"]
    for kind in sorted({r["kind"] for r in rows}):
        of = [r for r in rows if r["kind"] == kind]
        g, c = [r["grad_error"] for r in of], [r["cheap_loss"] for r in of]
        lines.append(
            f"{kind:<11} {len(of):>5}  {statistics.median(g):>10.3g} / {max(g):<10.3g}"
            f"  {statistics.median(c):>10.3g} / {max(c):.3g}"
        )
    lines.append(f"\nthe {top} units with the largest weight-gradient error:")
    for r in sorted(rows, key=lambda r: -r["grad_error"])[:top]:
        lines.append(f"  {r['unit']:<40} grad error {r['grad_error']:>8.3g}  cheap-path loss {r['cheap_loss']:.3g}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = one_line_errors(argparse.ArgumentParser(description=__doc__.split("\n\n")[0]))
    parser.add_argument("--model", default="smollm2-135m", help="A real model: smollm2-135m, a .gguf file, a folder.")
    parser.add_argument("--backend", default="act_quant", help="The units' backend.")
    parser.add_argument("--backend_options", default="kinds=all,low_bits=4,high_bits=16")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--top", type=int, default=10, help="How many units to list by gradient error.")
    parser.add_argument("--out", type=Path, default=None, help="Write every unit's pair to this JSON file.")
    args = parser.parse_args(argv)
    for flag in ("batch", "seq_len", "top"):
        if getattr(args, flag) < 1:
            fail(f"--{flag} must be >= 1, got {getattr(args, flag)}")
    try:
        check_model(args.model)
    except (ValueError, FileNotFoundError) as err:
        fail(f"--model: {err}")
    rows = measure(args.model, args.backend, args.backend_options, args.batch, args.seq_len)
    print(report(rows, args.top))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"args": vars(args) | {"out": str(args.out)}, "units": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
