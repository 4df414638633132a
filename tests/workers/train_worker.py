"""Worker for tests/test_distributed.py: one GNMR training run in its own process, to be killed and resumed.

    python tests/workers/train_worker.py MODEL_DIR OUT_DIR [--resume CHECKPOINT] [--pause_after STEP]

An 8-bit LoRA tiny LLaMA, 12 optimizer steps, a checkpoint every 4, an injected x100 spike at step 6 (its lock
spans the checkpoint at step 8). `--pause_after STEP` makes the process sleep forever after that step, so that
the test can SIGKILL it at a known point; `--resume` resumes from a checkpoint as a user would.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--resume", default=None)
    parser.add_argument("--pause_after", type=int, default=0)
    opts = parser.parse_args()

    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gnmr_hf import GNMRCallback, GNMRConfig
    from gnmr_hf.experiments.demo import GradientSpikeCallback, byte_dataset
    from gnmr_hf.experiments.tiny import load_int8_lora, write_local_text

    class Pause(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == opts.pause_after:
                print(f"PAUSED {state.global_step}", flush=True)
                while True:
                    time.sleep(1)

    model = load_int8_lora(opts.model_dir)
    Path(opts.out_dir).mkdir(parents=True, exist_ok=True)
    data = byte_dataset(write_local_text(f"{opts.out_dir}/train.txt", lines=64))
    args = TrainingArguments(
        output_dir=opts.out_dir,
        use_cpu=True,
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=100,
        save_strategy="steps",
        save_steps=4,
        report_to=[],
        seed=0,
        disable_tqdm=True,
    )
    callbacks = [
        GNMRCallback(GNMRConfig(max_active=2, lock_steps=3, window=2, min_history=2, alpha=3.0, beta=3.0)),
        GradientSpikeCallback("model.layers.1.mlp.down_proj", 6, 100.0),
        Pause(),
    ]
    Trainer(model=model, args=args, train_dataset=data, callbacks=callbacks).train(resume_from_checkpoint=opts.resume)


if __name__ == "__main__":
    main()
