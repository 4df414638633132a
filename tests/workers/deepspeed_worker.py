"""Worker for tests/test_deepspeed.py: the Trainer with GNMRCallback under DeepSpeed ZeRO, 2 CPU processes with gloo.

    torchrun --nproc_per_node 2 --master_addr 127.0.0.1 --master_port PORT tests/workers/deepspeed_worker.py \\
        MODEL_DIR OUT_DIR

Four runs in one launch (DeepSpeed's start-up is the slow part), each with `TrainingArguments(use_cpu=True,
deepspeed=config)`:

- `zero2`: ZeRO-2, the 8-bit LoRA tiny LLaMA (LoRA on q_proj and v_proj, so the other units are scored on their
  output gradients), gradient accumulation 2, 8 steps, a DeepSpeed checkpoint at step 4, and a x100 spike in rank
  0's *local* LoRA gradient of layer 1's v_proj at step 5 (a hook that fires on rank 0 alone).
- `resume`: the same, resumed from `zero2`'s checkpoint-4 in a fresh Trainer and model.
- `zero3`: ZeRO-3, a full fine-tune of the fp32 tiny LLaMA with the `block_fp` backend (weights partitioned), the
  same spike on layer 1's down_proj weight gradient at step 5, 8 steps.
- `refused`: ZeRO-3 with the 8-bit LoRA model: `GNMRCallback` must refuse it at train begin.

For every step each rank records the norms GNMR read, the reference norms from DeepSpeed's own
`safe_get_full_grad` read at the same moment (just before the ZeRO optimizer's step), and the decision, to
OUT_DIR/rank{R}.json; the test compares ranks, reference and runs.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch


def ds_config(stage: int) -> dict:
    auto = "auto"
    return {
        "zero_optimization": {"stage": stage},
        "train_micro_batch_size_per_gpu": auto,
        "train_batch_size": auto,
        "gradient_accumulation_steps": auto,
        "gradient_clipping": auto,
    }


def run(model_dir: str, out_dir: str, mode: str) -> dict:
    from deepspeed.utils import safe_get_full_grad
    from local_spike import LocalSpike  # beside this script
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from gnmr_hf import GNMRCallback, GNMRConfig
    from gnmr_hf.experiments.demo import byte_dataset
    from gnmr_hf.experiments.tiny import load_int8_lora, write_local_text

    rank = int(os.environ["RANK"])
    stage = 2 if mode in ("zero2", "resume") else 3
    args = TrainingArguments(
        output_dir=os.path.join(out_dir, "zero2" if mode == "resume" else mode),
        use_cpu=True,
        deepspeed=ds_config(stage),
        max_steps=8,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2 if stage == 2 else 1,
        learning_rate=1e-3,
        max_grad_norm=1.0,
        logging_steps=100,
        save_strategy="steps" if mode == "zero2" else "no",
        save_steps=4,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    if mode == "zero3":
        # Made after TrainingArguments so that transformers builds it under ZeRO-3's partitioning, as users do.
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        backend, spiked, exclude = "block_fp", "model.layers.1.mlp.down_proj", [r"lm_head$"]
    elif mode == "refused":
        # ZeRO-3 refuses a device_map, so the 8-bit model loads without one (bitsandbytes puts it on the CPU here).
        from peft import LoraConfig, get_peft_model
        from transformers import BitsAndBytesConfig

        int8 = BitsAndBytesConfig(load_in_8bit=True)
        base = AutoModelForCausalLM.from_pretrained(model_dir, quantization_config=int8)
        model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
        backend, spiked, exclude = "bnb_int8", "model.layers.1.self_attn.v_proj", None
    else:
        model = load_int8_lora(model_dir, target_modules=["q_proj", "v_proj"])
        model.enable_input_require_grads()
        backend, spiked, exclude = "bnb_int8", "model.layers.1.self_attn.v_proj", None
    data = byte_dataset(write_local_text(os.path.join(out_dir, f"train{rank}.txt"), lines=64))
    gnmr = GNMRCallback(
        GNMRConfig(
            max_active=2, lock_steps=2, window=2, min_history=2, alpha=3.0, beta=3.0, backend=backend, exclude=exclude
        )
    )

    records: list[dict] = []

    class Record(TrainerCallback):
        """Reads DeepSpeed's own full gradients just before the ZeRO step, outside GNMR's own read (after it in
        the callback list, so its wrapper runs first), in the same unit order on every rank."""

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            zero = optimizer.optimizer
            inner = zero.step

            def step(*a, **k):
                start = time.perf_counter()
                reference = []
                for unit in gnmr.units:  # the output-gradient units have no tensor gradient to compare with
                    full = [safe_get_full_grad(t).float().square().sum() for t in unit.signal_tensors()]
                    reference.append(float(sum(full) ** 0.5) if full else None)
                records.append({"reference": reference, "reference_s": time.perf_counter() - start})
                return inner(*a, **k)

            zero.step = step

        def on_optimizer_step(self, args, state, control, **kwargs):
            d = gnmr.last_decision
            records[-1].update(
                step=state.global_step + 1,
                active=d.active.tolist(),
                entered=d.entered.tolist(),
                risky=d.risky.tolist(),
                max_risk=d.max_risk,
            )

    class Norms(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            norms, missing = gnmr.capture.pending
            records[-1].update(norms=norms.tolist(), missing=missing.tolist())

    trainer = Trainer(
        model=model, args=args, train_dataset=data, callbacks=[gnmr, LocalSpike(spiked, 5, rank), Norms(), Record()]
    )
    if mode == "refused":
        try:
            trainer.train()
        except ValueError as err:
            return {"error": str(err)}
        return {"error": None}
    trainer.train(resume_from_checkpoint=os.path.join(out_dir, "zero2", "checkpoint-4") if mode == "resume" else None)
    return {"names": [u.name for u in gnmr.units], "signals": [u.signal for u in gnmr.units], "records": records}


def main() -> None:
    model_dir, out_dir = sys.argv[1:3]
    results = {}
    for mode in ("zero2", "resume", "zero3", "refused"):
        start = time.perf_counter()
        results[mode] = run(model_dir, out_dir, mode)
        results[mode]["wall_s"] = time.perf_counter() - start
    assert torch.distributed.get_world_size() == 2
    with open(os.path.join(out_dir, f"rank{os.environ['RANK']}.json"), "w") as f:
        json.dump(results, f)


if __name__ == "__main__":
    main()
