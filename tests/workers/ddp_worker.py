"""Worker for tests/test_distributed.py: the Trainer with GNMRCallback under DDP, 2 CPU processes with gloo.

    accelerate launch --multi_gpu --num_processes 2 --main_process_ip 127.0.0.1 --main_process_port PORT \\
        tests/workers/ddp_worker.py MODEL_DIR OUT_DIR

An 8-bit LoRA tiny LLaMA, gradient accumulation 2, and a x100 spike in rank 0's *local* gradient only (a hook
that fires on rank 0 alone), trained twice. `lora`: LoRA on every projection, units scored on their LoRA
gradients (averaged by DDP). `meters`: LoRA on q_proj/v_proj only, so most units are scored on their output
gradient, which each rank meters on its own data and GNMR sums across ranks. `cause`: as `lora` with
policy="cause", whose fidelity each rank measures on its own micro-batches and GNMR averages across ranks; it trains
with LLM.int8(), a GPU's kernel (`llm_int8_in_training`), since bitsandbytes' CPU training kernel rounds no input and
leaves nothing to measure. `impact`: the fp32 model (no LoRA) with block_fp FP4 units under policy="impact", every
unit measured every step (`every=1`, no quiet units) and every one material, so that the budget goes by impact
alone: each rank measures on its own micro-batches and GNMR averages across ranks. `impact_quiet`: as `impact` with
quiet units on (`quiet_factor=2`, `quiet_below=1`): the units far under the budget's bar measure on every other step,
which each rank reads from its own copy of the quiet mask (the policy's, from the all-reduced estimates), so the
ranks must measure the same units on the same steps or the all-reduce would average a measure with none. Each rank
writes the norms it read
and its decisions, step by step, to OUT_DIR/{mode}_rank{R}.json; the test compares the ranks.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch


def run(model_dir: str, out_dir: str, mode: str) -> None:
    from local_spike import LocalSpike  # beside this script
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gnmr_hf import GNMRCallback, GNMRConfig
    from gnmr_hf.experiments.demo import byte_dataset
    from gnmr_hf.experiments.tiny import load_int8_lora, write_local_text

    rank = int(os.environ["RANK"])
    targets = ["q_proj", "v_proj"] if mode == "meters" else None
    if mode.startswith("impact"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    else:
        model = load_int8_lora(model_dir, target_modules=targets)
    if mode == "meters":
        model.enable_input_require_grads()
    data = byte_dataset(write_local_text(os.path.join(out_dir, f"train{rank}.txt"), lines=64))
    spiked = "model.layers.1.self_attn.v_proj" if mode == "meters" else "model.layers.1.mlp.down_proj"
    # policy="cause" with every measured loss suspect: the spike is blamed on its family's lossiest unit, which only
    # a loss averaged over the ranks makes the same unit on both.
    cause = {"policy": "cause", "policy_options": {"suspect": 1e-6}} if mode == "cause" else {}
    if mode.startswith("impact"):
        quiet = {"quiet_factor": 2, "quiet_below": 1.0} if mode == "impact_quiet" else {"quiet_factor": 1}
        cause = {
            "policy": "impact",
            "policy_options": {"min_impact": 1e-12, "every": 1, "rows": 8, **quiet},
            "backend": "block_fp",
            "backend_options": {"low_format": "e2m1", "high_format": "e4m3"},
        }
    gnmr = GNMRCallback(GNMRConfig(max_active=2, lock_steps=2, window=2, min_history=2, alpha=3.0, beta=3.0, **cause))

    records = []

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            norms, missing = gnmr.capture.pending
            records.append({"step": state.global_step + 1, "norms": norms.tolist(), "missing": missing.tolist()})
            if gnmr.capture.pending_cheap_loss is not None:
                records[-1]["cheap_loss"] = gnmr.capture.pending_cheap_loss.tolist()
            if gnmr.capture.pending_impact is not None:
                records[-1]["impact"] = gnmr.capture.pending_impact.tolist()

        def on_optimizer_step(self, args, state, control, **kwargs):
            d = gnmr.last_decision
            records[-1].update(active=d.active.tolist(), entered=d.entered.tolist(), risky=d.risky.tolist())
            quiet = getattr(gnmr.controller.policy, "quiet_mask", None)
            if quiet is not None:
                records[-1]["quiet"] = quiet.nonzero()[0].tolist()  # the units on the slower rotation from next step

    args = TrainingArguments(
        output_dir=os.path.join(out_dir, mode),
        use_cpu=True,
        max_steps=10,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        logging_steps=100,
        save_strategy="no",
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=args, train_dataset=data, callbacks=[gnmr, LocalSpike(spiked, 6, rank), Record()]
    )
    from gnmr_hf.experiments.models import llm_int8_in_training

    with llm_int8_in_training() if mode == "cause" else contextlib.nullcontext():
        trainer.train()
    assert torch.distributed.get_world_size() == 2
    with open(os.path.join(out_dir, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(
            {"names": [u.name for u in gnmr.units], "signals": [u.signal for u in gnmr.units], "records": records}, f
        )


def main() -> None:
    model_dir, out_dir = sys.argv[1:3]
    for mode in ("lora", "meters", "cause", "impact", "impact_quiet"):
        run(model_dir, out_dir, mode)
    # Tear the process group down before the interpreter does: left to exit, gloo's threads can be destroyed while
    # joinable ("terminate called without an active exception", SIGABRT), seen here about one run in five.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
