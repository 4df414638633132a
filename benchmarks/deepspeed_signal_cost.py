"""What GNMR's read costs under DeepSpeed ZeRO-2 and ZeRO-3: squared partial norms of the local gradient slices with
one all-reduce of [3, N] floats (what `GNMRCallback` does), against DeepSpeed's own `safe_get_full_grad` per tensor.

    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29531 benchmarks/deepspeed_signal_cost.py
    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port 29531 benchmarks/deepspeed_signal_cost.py \\
        --hidden 1024 --intermediate 2816 --layers 4

A LLaMA from a config (random weights, fp32, full fine-tune: every linear's weight gradient is a unit's signal, the
case where the gradients are large), trained a few steps by `deepspeed.initialize` with plain AdamW. Just before
each ZeRO optimizer step both reads run `--repeat` times, timed, and their norms are compared (float32 sums in
different orders: they differ in the last digits, more for larger tensors). Prints
one markdown row per stage: the median time per read and the bytes each moves per rank (the partial read
all-reduces 3 x N float32; `safe_get_full_grad` all-reduces (ZeRO-2) or all-gathers (ZeRO-3) a full-size fp32
buffer per tensor).
"""

from __future__ import annotations

import argparse
import statistics
import time
from types import SimpleNamespace

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports():
    import torch
    import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--intermediate", type=int, default=1408)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    opts = parser.parse_args()

    import deepspeed
    from deepspeed.utils import safe_get_full_grad
    from transformers import LlamaConfig, LlamaForCausalLM

    from gnmr_hf.integrations.deepspeed import DeepSpeedZero

    deepspeed.init_distributed(dist_backend="gloo")
    rank = dist.get_rank()
    rows = []
    for stage in (2, 3):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=256,
            hidden_size=opts.hidden,
            intermediate_size=opts.intermediate,
            num_hidden_layers=opts.layers,
            num_attention_heads=8,
            num_key_value_heads=8,
            max_position_embeddings=128,
        )
        model = LlamaForCausalLM(config)
        linears = [m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and "lm_head" not in name]
        units = [SimpleNamespace(signal_tensors=lambda m=m: [m.weight], output_grad=None, module=m) for m in linears]
        ds_config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage}}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config)
        zero = DeepSpeedZero(engine.optimizer, stage)
        zero._prepare(units)
        partial_s, full_s, rel = timing = [], [], []
        original = engine.optimizer.step

        def step(*args, zero=zero, units=units, original=original, timing=timing, **kwargs):
            partial_s, full_s, rel = timing
            for _ in range(opts.repeat):
                dist.barrier()
                start = time.perf_counter()
                norms, _ = zero.compute()
                partial_s.append(time.perf_counter() - start)
            for _ in range(opts.repeat):
                dist.barrier()
                start = time.perf_counter()
                full = torch.stack([safe_get_full_grad(u.module.weight).float().norm() for u in units])
                full_s.append(time.perf_counter() - start)
            rel.append(float(((norms.double() - full.double()).abs() / full.double()).max()))
            return original(*args, **kwargs)

        engine.optimizer.step = step
        g = torch.Generator().manual_seed(rank)
        for _ in range(opts.steps):
            x = torch.randint(0, 256, (2, 64), generator=g)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        numel = sum(u.module.weight.ds_numel if stage == 3 else u.module.weight.numel() for u in units)
        rows.append(
            f"| ZeRO-{stage} | {len(units)} | {numel / 1e6:.1f}M | {statistics.median(partial_s) * 1e3:.2f} ms, "
            f"{3 * len(units) * 4} B | {statistics.median(full_s) * 1e3:.2f} ms, {numel * 4 / 2**20:.1f} MiB "
            f"| {max(rel):.1e} |"
        )
        del engine, optimizer, model
    if rank == 0:
        print(
            "| stage | units | signal elements | partial norms + 1 all-reduce | safe_get_full_grad per tensor "
            "| largest relative difference |"
        )
        print("|---|---|---|---|---|---|")
        print("\n".join(rows))


if __name__ == "__main__":
    main()
