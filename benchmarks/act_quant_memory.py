"""Bytes saved for backward per training step with `act_quant` at 16, 8 and 4 bits (and the plain model).

    python benchmarks/act_quant_memory.py                  # the probe-scale LLaMA, batch 16 x 128 bytes
    python benchmarks/act_quant_memory.py --d_model 256 --n_layers 8 --batch 8 --seq_len 512

One forward pass per setting under torch's saved-tensor hooks
(`gnmr_hf.experiments.pretrain.SavedTensorMeter`): every tensor
autograd keeps for the backward pass is counted once per storage, the parameters not at all. That is what a step
holds between its forward and its backward, measured, not estimated from shapes. Settings: the plain model
(sdpa attention), then for each unit kind (linear inputs of the q/k/v/o/gate/up/down projections; attention's
q/k/v; both) every unit at 16 (unquantized: our code path, same bytes as the plain model where it saves the same
tensors), 8 and 4 bits, per-tensor and per-row scales. Prints a markdown table; `--json` writes the numbers.
"""

from __future__ import annotations

import argparse
import json

import torch

from gnmr_hf import find_units
from gnmr_hf.experiments.pretrain import SavedTensorMeter, build_model, llama_config

INCLUDE = {
    "linear": [r"\.(q|k|v|o|gate|up|down)_proj$"],
    "attention": [r"\.self_attn$"],
    "linear;attention": [r"\.(q|k|v|o|gate|up|down)_proj$", r"\.self_attn$"],
}


def saved_bytes(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, int]:
    with SavedTensorMeter(exclude=model) as meter:
        model(input_ids=ids, labels=ids)
    return {"total": meter.nbytes, **meter.by_dtype}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d_model", type=int, default=128)
    parser.add_argument("--n_layers", type=int, default=4)
    parser.add_argument("--n_heads", type=int, default=4)
    parser.add_argument("--seq_len", type=int, default=128)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--json", default=None, help="Write the numbers to this file.")
    cli = parser.parse_args()

    config = llama_config(cli.d_model, cli.n_layers, cli.n_heads, cli.seq_len)
    ids = torch.randint(0, 256, (cli.batch, cli.seq_len), generator=torch.Generator().manual_seed(0))
    rows = [{"setting": "plain model (sdpa)", **saved_bytes(build_model(config, 0), ids)}]
    for kinds, include in INCLUDE.items():
        for scaling in ("tensor", "row"):
            for bits in (16, 8, 4):
                if bits == 16 and scaling == "row":
                    continue
                model = build_model(config, 0)
                units = find_units(
                    model,
                    "act_quant",
                    include=include,
                    low_bits=bits,
                    high_bits=16,
                    scaling=scaling,
                    kinds=kinds.split(";"),
                )
                label = f"{kinds}, {bits} bits" + (f", {scaling} scales" if bits < 16 else "")
                rows.append({"setting": label, "units": len(units), **saved_bytes(model, ids)})
                for unit in units:
                    unit.close()
    plain = rows[0]["total"]
    print(
        f"Bytes saved for backward in one step: batch {cli.batch} x {cli.seq_len}, d={cli.d_model}, "
        f"{cli.n_layers} layers"
    )
    print("| setting | units | MiB | vs plain | of which packed codes (uint8) MiB |")
    print("|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['setting']} | {row.get('units', '-')} | {row['total'] / 2**20:.2f} | "
            f"{row['total'] / plain:.2f} | {row.get('uint8', 0) / 2**20:.2f} |"
        )
    if cli.json:
        with open(cli.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
