#!/usr/bin/env bash
# The runs behind docs/results.md, "The policy seam": the two regimes where the policies act, shortened to 80 steps,
# every policy arm, with the code of the tree $1 (a git worktree of the commit to check; default: this one), into the
# folder $2 (default runs/seam_check); then
# `python benchmarks/compare_traces.py BEFORE/attn AFTER/attn` (and fp4) compares two such folders decision by decision.
#
#     bash benchmarks/seam_check.sh /tmp/before runs/ref/before
#
# ARMS (default: every policy arm) narrows both regimes to the arms named, e.g. ARMS=gnmr_cause.
set -euo pipefail
tree=$(cd "${1:-.}" && pwd)
out=$(mkdir -p "${2:-runs/seam_check}" && cd "${2:-runs/seam_check}" && pwd)
attn_arms=${ARMS:-gnmr gnmr_cause gnmr_relapse random carve_first_last carve_named global_z static_low}
fp4_arms=${ARMS:-gnmr gnmr_cause static_high}
cd "$tree"
export PYTHONPATH="$tree" OMP_NUM_THREADS=1
python recipes/pretrain_actquant.py --output_dir "$out/attn" --seeds 0 --learning_rate 1.4e-3 --max_steps 80 \
  --backend_options 'kinds=linear;attention,low_bits=4,high_bits=8,max_row_total=inf' --trace_top_k 64 \
  --arms $attn_arms --carve_named 'self_attn$' --budget 2 --plot false
python recipes/pretrain_dynamic_precision.py --output_dir "$out/fp4" --seeds 0 --learning_rate 1.4e-3 \
  --max_steps 80 --backend_options low_format=e2m1,high_format=e4m3,quantize_lm_head=true --arms $fp4_arms \
  --trace_top_k 64 --plot false
