"""Per-GPU memory of the model states of the LLaMA-2 13B LoRA fine-tune under DDP, ZeRO-2 and ZeRO-3, from shapes.

    python benchmarks/zero_memory.py              # 8 GPUs
    python benchmarks/zero_memory.py --gpus 4

Arithmetic, not a measurement: LLaMA-2 13B's shapes (hidden 5120, MLP 13824, 40 layers, vocabulary 32000) and
LoRA r=16 on the seven projections, as in recipes/finetune_13b.py. Weights, gradients and Adam state only;
activations (~3-4 GB with checkpointing at 4 x 512 tokens) come on top and are the same for every row. Under
DeepSpeed with bf16 the engine casts every floating-point parameter to bf16 (the INT8 weights stay INT8) and keeps
fp32 master weights and Adam moments of the trainable ones (12 bytes each) partitioned; under DDP the Trainer's
bf16 autocast leaves peft's fp32 LoRA weights and, for the 8-bit arm, the fp32 embeddings and head that
`prepare_model_for_kbit_training` makes. GB = 1e9 bytes.
"""

from __future__ import annotations

import argparse

HIDDEN, MLP, LAYERS, VOCAB, RANK, MAX_ACTIVE = 5120, 13824, 40, 32000, 16, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gpus", type=int, default=8)
    n = parser.parse_args().gpus
    linears = [(HIDDEN, HIDDEN)] * 4 + [(HIDDEN, MLP)] * 2 + [(MLP, HIDDEN)]  # q k v o, gate up, down
    linear = LAYERS * sum(i * o for i, o in linears)
    embeddings = 2 * VOCAB * HIDDEN  # embed_tokens and lm_head
    lora = LAYERS * sum(RANK * (i + o) for i, o in linears)
    layer = sum(i * o for i, o in linears)
    recovery = MAX_ACTIVE * max(i * o for i, o in linears) * 2  # GNMR's BF16 recovery weights, max_active of them
    gb = 1e9
    rows = [
        ("DDP", "gnmr", linear + 4 * embeddings, 16 * lora, recovery, ""),
        ("ZeRO-2", "gnmr", linear + 2 * embeddings, 2 * lora + 14 * lora / n, recovery, ""),
        ("ZeRO-3", "gnmr", None, None, None, "refused: bitsandbytes 8-bit under ZeRO-3 (issue #1451)"),
        ("DDP", "bf16", 2 * (linear + embeddings), 16 * lora, 0, ""),
        ("ZeRO-2", "bf16", 2 * (linear + embeddings), 2 * lora + 14 * lora / n, 0, ""),
        (
            "ZeRO-3",
            "bf16",
            2 * (linear + embeddings) / n + 2 * layer,
            16 * lora / n,
            0,
            f"base: 1/{n} of it + one gathered layer ({2 * layer / gb:.2f} GB; prefetch may hold more)",
        ),
    ]
    print(f"LLaMA-2 13B: {linear / 1e9:.2f}B in linear layers, {embeddings / 1e9:.2f}B in embeddings and head;")
    print(f"LoRA r={RANK}: {lora / 1e6:.1f}M trainable; {n} GPUs; per GPU, model states only:\n")
    print("| strategy | arm | base weights | LoRA weights, gradients, Adam | GNMR recovery | total | note |")
    print("|---|---|---|---|---|---|---|")
    for strategy, arm, base, states, extra, note in rows:
        if base is None:
            print(f"| {strategy} | {arm} | - | - | - | - | {note} |")
            continue
        total = base + states + extra
        cells = " | ".join(f"{v / gb:.2f} GB" for v in (base, states, extra, total))
        print(f"| {strategy} | {arm} | {cells} | {note} |")


if __name__ == "__main__":
    main()
