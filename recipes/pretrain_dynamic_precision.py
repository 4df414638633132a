"""Pretrain a small byte-level LLaMA from scratch with every block Linear's GEMMs (forward and backward) on
block-scaled low-bit floats, DeepSeek-V3 style, arm against arm: the paper's second scenario at CPU scale.

    python recipes/pretrain_dynamic_precision.py --preset tiny --output_dir runs/dp_tiny      # smoke test, ~1 min

    python recipes/pretrain_dynamic_precision.py --output_dir runs/dynprec_fp4 --seeds 0 1 --learning_rate 5e-3 \\
        --backend_options low_format=e2m1,high_format=e4m3 \\
        --arms reference static_high static_low gnmr random carve_first_last global_z

Every arm trains the same model (same initialization per seed) on the same batches in the same order, with the
transformers `Trainer` and `GNMRCallback` (or a baseline policy over the same units,
`gnmr_hf.experiments.baselines`), and writes
`<output_dir>/<arm>/seed<k>/result.json` and its GNMR trace; then `<output_dir>/results.md` (the table over every
result found in `output_dir`: validation loss and perplexity per byte, the share of the static low -> high gap
closed, the fraction of unit-steps recovered, seconds per step) and `loss_curves.png`.

Arms (`--arms`): reference (the plain FP32 model, no units: the 16-bit-or-better reference), static_high (every unit
on `high_format`, FP8 e4m3 by default), static_low (every unit on `low_format`, FP6 e3m2 by default), gnmr,
gnmr_relapse, random and carve_first_last (GNMR's mean budget of the same seed, so run gnmr first, or give
`--budget`), carve_best (the units with the largest oracle gaps of the gnmr run; needs `--oracle_every`), global_z,
and the stabilizers users reach for first, every unit on `low_format` (zclip, spam, stable_spam, adagc, skip_step; and
gnmr_cause_zclip: `gnmr_hf.experiments.stabilizers`, `pip install -e '.[stabilizers]'`).
Without `--arms`, every arm runs that the other flags allow (carve_best only with `--oracle_every`, carve_named only
with `--carve_named`, the stabilizers only when named); the whole arm list is checked before the first arm trains.

Rare documents, the data that breaks a low-bit path briefly (`gnmr_hf.experiments.pretrain.anomalies`): with
`--anomalies KIND[,KIND...] --anomaly_every N` every N-th optimizer step trains on one anomalous document (`repeat`,
`base64`, `digits`, `minified`, taking turns) in place of its batch's first sequence (`--anomaly_scope batch`: all of
them), the same in every arm of a seed. The steps and kinds are in each `result.json` and on the trace's step records
(`marks`); `--logging_steps 1` keeps every step's loss:

    python recipes/pretrain_dynamic_precision.py --preset tiny --output_dir runs/dp_anomalies \
        --arms static_low gnmr_impact --anomalies repeat,base64,digits,minified --anomaly_every 5 --logging_steps 1

Flags: `TrainingArguments` (the preset fills every one not given: steps, batch, learning rate, warm-up, evaluation;
AdamW 0.9/0.95 without weight decay, cosine decay, clipping at 1.0, fp32 on the CPU),
`PretrainArguments`
(`gnmr_hf.experiments.pretrain`: preset, arms, seeds, corpus, model size, oracle) and `GNMRConfig` (the
controller and the
backend: here `block_fp`, whose `--backend_options` are `low_format`, `high_format`, `scaling`, `quantize_lm_head`,
`quantize_eval`, `signal`; see `gnmr_hf.backends.block_fp`). Without `--include`, the units are the
q/k/v/o/gate/up/down projections of every layer; the embedding, the norms, attention and lm_head stay in FP32.
With `quantize_lm_head=true` and no `--include`, lm_head joins the projections (the option would otherwise be
filtered out by that default without a word).
"""

from __future__ import annotations

import sys

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("block_fp"):
    from gnmr_hf.backends.block_fp import BLOCK_FP
    from gnmr_hf.experiments.pretrain import parse_recipe_arguments, run_recipe

PROJECTIONS = [r"\.(q|k|v|o|gate|up|down)_proj$"]
# The default units: every projection, and the output head, which block_fp makes a unit only with
# quantize_lm_head=true.
DEFAULT_UNITS = [*PROJECTIONS, r"^lm_head$"]


def default_units(backend: str, backend_options: dict) -> list[str]:
    """The default `include`: without block_fp's quantize_lm_head the head's pattern would match no unit, which
    find_units rightly warns about, so it is left out then."""
    if backend == "block_fp" and not BLOCK_FP.parse_options(backend_options).quantize_lm_head:
        return list(PROJECTIONS)
    return list(DEFAULT_UNITS)


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args, pretrain, config = parse_recipe_arguments(argv, backend="block_fp", include=DEFAULT_UNITS)
    if config.include == DEFAULT_UNITS:  # the recipe's default, not a --include given
        config.include = default_units(config.backend, config.backend_options)
    return run_recipe(args, pretrain, config)


if __name__ == "__main__":
    main()
