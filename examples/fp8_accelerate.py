r"""FP8 training switched on by accelerate, with GNMR keeping the riskiest FP8 linears in high precision:

    accelerate launch --mixed_precision fp8 --fp8_enable_fsdp_float8_all_gather false \
        examples/fp8_accelerate.py --backend torchao_float8 --max_active 4 --output_dir runs/fp8

`--mixed_precision fp8` (it sets ACCELERATE_MIXED_PRECISION=fp8) makes the Trainer's accelerator convert the model's
linears to torchao's `Float8Linear` when it prepares the model, with accelerate's torchao recipe (`AORecipeKwargs`:
every `nn.Linear` whose sizes are multiples of 16, but the first and the last, which stay in high precision), and run
the forward under bf16 autocast. GNMR (`--backend torchao_float8`) finds those `Float8Linear` units at train begin and
moves up to `max_active` of them to the plain matmul, as their gradients ask. `--fp8_enable_fsdp_float8_all_gather
false` only matters without FSDP2: accelerate's default wraps each FP8 weight for FSDP2's float8 all-gather, and
transformers cannot save a checkpoint of such a weight (docs/backends.md, `torchao_float8`).

The model here is the tests' tiny LLaMA, trained on random tokens, so that the file runs anywhere in seconds; put
yours in its place, as it is (`AutoModelForCausalLM.from_pretrained(name)`, not converted).
"""

from __future__ import annotations

import torch
from datasets import Dataset
from transformers import HfArgumentParser, TrainingArguments

from gnmr_hf import GNMRConfig, GNMRTrainer
from gnmr_hf.testing import tiny_llama


def main(argv: list[str] | None = None) -> GNMRTrainer:
    args, gnmr = HfArgumentParser((TrainingArguments, GNMRConfig)).parse_args_into_dataclasses(argv)
    model = tiny_llama()
    ids = torch.randint(0, model.config.vocab_size, (64, 32), generator=torch.Generator().manual_seed(0)).tolist()
    trainer = GNMRTrainer(
        model=model, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}), gnmr_config=gnmr
    )
    trainer.train()
    return trainer


if __name__ == "__main__":
    main()
