"""Pretrain a small byte-level LLaMA from scratch with saved activations at 4 bits (cheap) / 8 bits (recovery),
arm against arm: the paper's first scenario at CPU scale.

    python recipes/pretrain_actquant.py --preset tiny --output_dir runs/pt_tiny        # smoke test, about a minute

    python recipes/pretrain_actquant.py --output_dir runs/pretrain_attn --seeds 0 1 --learning_rate 3e-3 \\
        --backend act_quant --backend_options 'kinds=linear;attention,low_bits=4,high_bits=8' \\
        --arms static_high static_low gnmr --oracle_every 10 --trace_top_k 64

Every arm trains the same model (same initialization per seed) on the same batches in the same order, with the
transformers `Trainer` and `GNMRCallback` (or a baseline policy over the same units,
`gnmr_hf.experiments.baselines`), and
writes `<output_dir>/<arm>/seed<k>/result.json` and its GNMR trace. After its runs the recipe writes
`<output_dir>/results.md` (the table over every result found in `output_dir`, so arms run by separate commands end
up in one table) and `loss_curves.png`.

Arms (`--arms`): reference (plain fp32 model, no units), static_high, static_low, gnmr, gnmr_relapse, random,
carve_first_last, carve_best, carve_named, global_z. random and carve_first_last take GNMR's average number of
recovered units of the same seed (`--budget` overrides it), so run gnmr first; carve_best keeps on the recovery path
the units with the largest mean oracle gap of the gnmr run (needs `--oracle_every`); carve_named the units matching
`--carve_named` regexes, e.g. every attention unit (they exist with `kinds=linear;attention`):

    python recipes/pretrain_actquant.py --preset tiny --output_dir runs/pt_carve --arms carve_named \
        --backend_options 'kinds=linear;attention' --carve_named 'self_attn$'

The stabilizers users reach for first (`zclip`, `spam`, `stable_spam`, `adagc`, `skip_step`: every unit at 4 bits,
the update changed instead; and `gnmr_cause_zclip`; `gnmr_hf.experiments.stabilizers` says how each is hooked into the
Trainer; `pip install -e '.[stabilizers]'`) run only when named, their own knobs at their authors' defaults unless
`--stabilizer_options` gives others:

    python recipes/pretrain_actquant.py --preset tiny --output_dir runs/pt_stab \\
        --arms zclip spam stable_spam adagc skip_step gnmr_cause_zclip

Rare documents go into training on every N-th step with `--anomalies KIND[,KIND...] --anomaly_every N` (the kinds
and what is replaced: `gnmr_hf.experiments.pretrain.anomalies`; recorded in each `result.json` and the trace):

    python recipes/pretrain_actquant.py --preset tiny --output_dir runs/pt_anomalies --arms static_low gnmr \
        --anomalies digits,repeat --anomaly_every 4 --logging_steps 1

Without `--arms`, every arm runs that the other flags allow: carve_best only with `--oracle_every`, carve_named only
with `--carve_named`, the stabilizers only when named. The whole arm list is checked before the first arm trains.

Flags: `TrainingArguments` (a preset fills every one not given: steps, batch, learning rate, warm-up, evaluation;
AdamW 0.9/0.95 without weight decay, cosine decay, clipping at 1.0, fp32 on the CPU),
`PretrainArguments`
(`gnmr_hf.experiments.pretrain`: preset, arms, seeds, corpus, model size, oracle) and `GNMRConfig` (the
controller and the
backend; here `--backend act_quant` and its `--backend_options`, see `gnmr_hf.backends.act_quant`). Without
`--include`, the units are the modules of the kinds `--backend_options` selects: the q/k/v/o/gate/up/down projections
of every layer by default (`kinds=linear`), its attention modules with `attention`, and every MLP, RMSNorm and the
head with the other kinds (`kinds=all`: docs/act_quant.md):

    python recipes/pretrain_actquant.py --preset tiny --output_dir runs/pt_all --arms static_low \
        --backend_options 'kinds=all,low_bits=4'
"""

from __future__ import annotations

import sys

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("act_quant"):
    from gnmr_hf import get_backend
    from gnmr_hf.experiments.pretrain import parse_recipe_arguments, run_recipe

PROJECTIONS = [r"\.(q|k|v|o|gate|up|down)_proj$", r"\.self_attn$"]
# The modules of each act_quant kind in a LLaMA: the default include is those of the kinds `kinds` selects (a
# pattern of a kind not selected would match no unit, which find_units warns about).
KIND_MODULES = {
    "linear": r"\.(q|k|v|o|gate|up|down)_proj$",
    "attention": r"\.self_attn$",
    "mlp": r"\.mlp$",
    "norm": r"norm$",
    "head": r"^lm_head$",
}


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else argv
    args, pretrain, config = parse_recipe_arguments(argv, backend="act_quant", include=PROJECTIONS)
    if config.backend == "act_quant" and not any(a.split("=", 1)[0] == "--include" for a in argv):
        kinds = get_backend("act_quant").parse_options(config.backend_options).kinds
        config.include = [KIND_MODULES[k] for k in KIND_MODULES if k in kinds]
    return run_recipe(args, pretrain, config)


if __name__ == "__main__":
    main()
