"""Bytes saved for backward per training step with `act_quant`, per unit kind, at 16, 8 and 4 bits (and the plain
model), measured; and the same computed from the shapes alone, at the probe's and at LLaMA-2 13B's shapes.

    python benchmarks/act_quant_memory.py                  # the probe-scale LLaMA, batch 16 x 128 bytes
    python benchmarks/act_quant_memory.py --d_model 256 --n_layers 8 --batch 8 --seq_len 512

One forward pass per setting under torch's saved-tensor hooks
(`gnmr_hf.experiments.pretrain.SavedTensorMeter`): every tensor
autograd keeps for the backward pass is counted once per storage, the parameters not at all. That is what a step
holds between its forward and its backward, measured. Settings: the plain model (sdpa attention, as users run it),
then each unit kind alone (docs/act_quant.md: linear inputs of the q/k/v/o/gate/up/down projections; attention's
q/k/v; the SwiGLU product's operands; the RMSNorm inputs; the head's input with the loss in chunks), linear with
attention, and every kind (`kinds=all`), each unit at 16 (unquantized: our code path), 8 and 4 bits, per-tensor and
per-row scales. The "from shapes" column is `shape_bytes`, the same count from the model's shapes: it matches the
measurement here, and gives the second table (LLaMA-2 13B in bf16 at the 13B recipe's batch, 4 x 512, every weight
trainable, no activation checkpointing) without running it. Prints markdown; `--json` writes numbers.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("act_quant"):
    import torch

    from gnmr_hf import find_units
    from gnmr_hf.backends.act_quant import KINDS
    from gnmr_hf.experiments.pretrain import SavedTensorMeter, build_model, llama_config
    from gnmr_hf.quant import quantized_nbytes

# The modules of each kind in a LLaMA, by name.
INCLUDE = {
    "linear": r"\.(q|k|v|o|gate|up|down)_proj$",
    "attention": r"\.self_attn$",
    "mlp": r"\.mlp$",
    "norm": r"norm$",
    "head": r"^lm_head$",
}
SETTINGS = [("linear",), ("attention",), ("mlp",), ("norm",), ("head",), ("linear", "attention"), KINDS]


@dataclass(frozen=True)
class Shapes:
    """A LLaMA's shapes and one step's batch; `act_bytes`: the activations' element size (4: fp32, 2: bf16)."""

    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    intermediate: int
    vocab: int
    batch: int
    seq_len: int
    act_bytes: int = 4


def shape_bytes(s: Shapes, kinds: tuple[str, ...] = (), bits: int = 16, scaling: str = "tensor") -> dict[str, int]:
    """Bytes a step saves for backward, by what saves them, from the shapes: what `SavedTensorMeter` measures on a
    transformers LLaMA (sdpa attention; RMSNorm computing in float32; the loss's float32 log-softmax) with the
    act_quant units of `kinds` at `bits`. Scales and small int tensors included."""
    n, a, d, inter = s.batch * s.seq_len, s.act_bytes, s.d_model, s.intermediate
    head_dim = d // s.n_heads
    kv = s.n_kv_heads * head_dim

    def saved(kind: str, *shape: int) -> int:
        """One tensor of `shape` saved by a unit of `kind` (quantized) or by plain autograd."""
        if kind not in kinds or bits == 16:
            return math.prod(shape) * a
        return quantized_nbytes(shape, bits, shape[-1] if scaling == "row" else None)

    # RMSNorm: plain keeps its float32 input, the normalized copy (activation dtype) and rsqrt per row; the unit keeps
    # the input at `bits` and the exact rsqrt per row.
    norm = (saved("norm", n, d) if "norm" in kinds else n * d * (4 + a)) + 4 * n
    # sdpa keeps q, k, v, its output (which o_proj's input shares) and the logsumexp; the attention unit keeps packed
    # q, k, v and the logsumexp, and o_proj keeps its input itself.
    attention = saved("attention", s.batch, s.n_heads, s.seq_len, head_dim)
    attention += 2 * saved("attention", s.batch, s.n_kv_heads, s.seq_len, kv // s.n_kv_heads) + 4 * n * s.n_heads
    # (o_proj's unit at 16 bits saves that same tensor.)
    sdpa_out = 0 if "attention" in kinds or "linear" not in kinds or bits == 16 else n * d * a
    # SwiGLU: plain keeps SiLU's input, its output and the up output; the mlp unit the gate and up outputs.
    mlp = 2 * saved("mlp", n, inter) + (n * inter * a if "mlp" not in kinds else 0)
    linear = 3 * saved("linear", n, d) + saved("linear", n, inter)  # q/k/v, o, gate/up and down inputs
    parts = {
        "norms": (2 * s.n_layers + 1) * norm,
        "attention": s.n_layers * (attention + sdpa_out),
        "mlp": s.n_layers * mlp,
        "projections": s.n_layers * linear,
        # ids (embedding); RoPE's cos and sin, shared by every layer
        "other": 8 * n + 2 * s.seq_len * head_dim * a,
    }
    if "head" in kinds:
        # the head input at `bits`, the targets and their mask; no logits, no log-softmax
        parts["head"] = saved("head", n, d) + 9 * n
    else:
        # the head input; the float32 log-softmax of the logits; the shifted targets and nll_loss's total weight
        parts["head"] = n * d * a + 4 * n * s.vocab + 8 * n + 4
    return parts


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, int]:
    with SavedTensorMeter(exclude=model) as meter:
        model(input_ids=ids, labels=ids)
    return {"total": meter.nbytes, **meter.by_dtype}


def label(kinds: tuple[str, ...]) -> str:
    return "all" if kinds == KINDS else " + ".join(kinds)


def measured_rows(cli: argparse.Namespace, shapes: Shapes) -> list[dict]:
    config = llama_config(cli.d_model, cli.n_layers, cli.n_heads, cli.seq_len)
    ids = torch.randint(0, 256, (cli.batch, cli.seq_len), generator=torch.Generator().manual_seed(0))
    plain = sum(shape_bytes(shapes).values())
    rows = [{"setting": "plain model (sdpa)", "shapes": plain, **saved_bytes(build_model(config, 0), ids)}]
    for kinds in SETTINGS:
        for scaling in ("tensor", "row"):
            for bits in (16, 8, 4):
                if bits == 16 and scaling == "row":
                    continue
                model = build_model(config, 0)
                include = [INCLUDE[k] for k in kinds]
                units = find_units(
                    model, "act_quant", include=include, low_bits=bits, high_bits=16, scaling=scaling, kinds=kinds
                )
                name = f"{label(kinds)}, {bits} bits" + (f", {scaling} scales" if bits < 16 else "")
                computed = sum(shape_bytes(shapes, kinds, bits, scaling).values())
                rows.append({"setting": name, "units": len(units), "shapes": computed, **saved_bytes(model, ids)})
                units.close()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=4)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", default=None, help="Write the numbers to this file.")
    cli = parser.parse_args()

    intermediate = llama_config(cli.d_model, 1, cli.n_heads, cli.seq_len).intermediate_size
    probe = Shapes(cli.d_model, cli.n_layers, cli.n_heads, cli.n_heads, intermediate, 256, cli.batch, cli.seq_len)
    rows = measured_rows(cli, probe)
    plain = rows[0]["total"]
    print(
        f"Bytes saved for backward in one step: batch {cli.batch} x {cli.seq_len}, d={cli.d_model}, "
        f"{cli.n_layers} layers (measured; from shapes alongside)"
    )
    print("| setting | units | MiB | vs plain | of which packed codes (uint8) MiB | from shapes MiB |")
    print("|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['setting']} | {row.get('units', '-')} | {row['total'] / 2**20:.2f} | "
            f"{row['total'] / plain:.3f} | {row.get('uint8', 0) / 2**20:.2f} | {row['shapes'] / 2**20:.2f} |"
        )

    big = Shapes(5120, 40, 40, 40, 13824, 32000, batch=4, seq_len=512, act_bytes=2)
    base = shape_bytes(big)
    print("\nLLaMA-2 13B shapes, bf16, batch 4 x 512, every weight trainable (computed from shapes, not run)")
    print("| setting | GiB | vs plain | norms | attention | mlp | projections | head + loss |")
    print("|---|---|---|---|---|---|---|---|")
    big_rows = [("plain model (sdpa)", base)]
    big_rows += [(f"{label(k)}, {b} bits", shape_bytes(big, k, b)) for k in SETTINGS for b in (8, 4)]
    for name, parts in big_rows:
        total = sum(parts.values())
        split = " | ".join(f"{parts[p] / 2**30:.2f}" for p in ("norms", "attention", "mlp", "projections", "head"))
        print(f"| {name} | {total / 2**30:.2f} | {total / sum(base.values()):.3f} | {split} |")
        rows.append({"setting": f"13B: {name}", "shapes": total, **{f"shapes_{p}": v for p, v in parts.items()}})
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
