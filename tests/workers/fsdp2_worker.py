"""Worker for tests/test_distributed.py: GNMR on an FSDP2-sharded model, 2 CPU processes with gloo.

    torchrun --nproc_per_node 2 --master_port PORT tests/workers/fsdp2_worker.py OUT_DIR BACKEND [POLICY]

accelerate selects FSDP only for accelerator devices (on a CPU it stays MULTI_CPU and runs DDP, silently ignoring
an FSDP config; see docs/reliability.md), so the Trainer cannot run FSDP here. This worker therefore drives the
callback's own machinery in a plain training loop over a model sharded with `fully_shard`: `GNMRCallback` finds
the units (BACKEND: `act_quant` or `block_fp`, the pretraining backends users shard, or `bf16_cast`, a precision
backend on full-precision weights registered from outside the package: `examples/bf16_cast_backend.py`), reads the
norms at the end of each backward pass (after FSDP2's reduce-scatter) and decides. Each rank writes, per step, the
norms GNMR read, the reference norms from DTensor's own `full_tensor()`, and the decision. POLICY `cause`: also the
fidelity GNMR read each step, and at the first step (weights still the initial ones on every rank) the reference
fidelity of an unsharded copy of the model on the rank's same batch, averaged over the ranks as GNMR averages.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.distributed as dist


def main() -> None:
    out_dir, backend = sys.argv[1], sys.argv[2]
    policy = sys.argv[3] if len(sys.argv) > 3 else "paper"
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    from gnmr_hf import GNMRCallback, GNMRConfig
    from gnmr_hf.experiments.tiny import TINY_LLAMA

    # The docs' custom backend, registered from outside the package as a user's would be.
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import bf16_cast_backend  # noqa: F401

    torch.manual_seed(0)
    config = LlamaConfig(**TINY_LLAMA)
    model = LlamaForCausalLM(config)
    replica = LlamaForCausalLM(config)
    replica.load_state_dict(model.state_dict())
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    callback = GNMRCallback(
        GNMRConfig(
            max_active=2,
            lock_steps=2,
            window=2,
            min_history=2,
            alpha=3.0,
            beta=3.0,
            backend=backend,
            exclude=[r"lm_head$"],
            trace_file="",
            policy=policy,
        )
    )
    args = SimpleNamespace(output_dir=out_dir)
    state = SimpleNamespace(global_step=0, is_world_process_zero=rank == 0, stateful_callbacks={})
    callback.on_train_begin(args, state, None, model=model, optimizer=optimizer)
    sharded = callback.signals.sharded
    # A spike in rank 0's local gradient only: its down_proj output gradient x50 at step 6. Under data parallelism
    # the reduced gradient carries it to both ranks, which must then decide the same.
    spike = {"on": False}

    def scale_output_grad(module, args, output):
        if spike["on"] and rank == 0:
            output.register_hook(lambda grad: grad * 50.0)

    model.model.layers[1].mlp.down_proj.register_forward_hook(scale_output_grad)
    records = []
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data, as under data parallelism
    for step in range(1, 9):
        x = torch.randint(0, 256, (4, 16), generator=g)
        spike["on"] = step == 6
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        norms, missing = callback.capture.pending
        cheap_loss = callback.capture.pending_cheap_loss
        if step == 1 and policy == "cause":
            reference_cheap_loss = unsharded_cheap_loss(replica, backend, callback.config, x)
        reference = []
        for unit in callback.units:
            full = [t.grad.full_tensor() if hasattr(t.grad, "full_tensor") else t.grad for t in unit.signal_tensors()]
            reference.append(float(torch.sqrt(sum(f.float().square().sum() for f in full))))
        callback.on_optimizer_step(args, state, None, optimizer=optimizer)
        d = callback.last_decision
        optimizer.step()
        optimizer.zero_grad()
        state.global_step += 1
        records.append(
            {
                "step": step,
                "norms": norms.tolist(),
                "reference": reference,
                "missing": missing.tolist(),
                "active": d.active.tolist(),
                "entered": d.entered.tolist(),
                "risky": d.risky.tolist(),
                **({} if cheap_loss is None else {"cheap_loss": cheap_loss.tolist()}),
            }
        )
    callback.close()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        result = {"sharded": sharded, "names": [u.name for u in callback.units], "records": records}
        if policy == "cause":
            result["reference_cheap_loss"] = reference_cheap_loss
        json.dump(result, f)
    dist.destroy_process_group()


def unsharded_cheap_loss(model, backend, config, x) -> list[float]:
    """What the units of `model` (not sharded) measure on batch `x` at the first step, averaged over the ranks by
    `UnitSignals.gather_cheap_loss`."""
    from gnmr_hf import find_units
    from gnmr_hf.policy import make_policy
    from gnmr_hf.signals import UnitSignals

    units = find_units(model, backend, exclude=config.exclude)
    rows, every = make_policy(config).fidelity_schedule()
    for unit in units:
        unit.meter.start(rows, clock=lambda: 0, recovery_every=every)
    model(input_ids=x, labels=x).loss.backward()
    cheap_loss = UnitSignals(units, dp_group=dist.group.WORLD).gather_cheap_loss()
    units.close()
    return cheap_loss.tolist()


if __name__ == "__main__":
    main()
