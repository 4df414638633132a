"""Which of the output head's GEMM inputs must be high for FP4 training to work: the issue's "per-GEMM granularity".

    python benchmarks/head_gemm_split.py --output_dir runs/head_gemm_split --seeds 0 1 --learning_rate 1.4e-3

The FP4 head regime of docs/results.md (block_fp e2m1 / e4m3, DeepSeek-V3 tiles, the 28 projections and the output
head as units) with every unit static on its cheap path, except the head, whose three GEMM inputs are set apart:
`head_high` all three in e4m3 (the head carve-out), `head_grad_high` only its output gradient (the dgrad and wgrad
GEMMs' G) in e4m3 with its input and weight in e2m1, `head_fwd_high` its input and weight in e4m3 with its output
gradient in e2m1, and `all_low` nothing (static e2m1). If one operand carries the whole effect, a unit finer than a
module (per GEMM operand, as torchao's `ROWWISE_WITH_GW_HP` keeps only the weight-gradient GEMM high and as
Transformer Engine's AutoswitchGemm switches one GEMM) would recover it for a third of the work. Writes
`<output_dir>/head_gemm_split.md` and `.json`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("block_fp"):
    from transformers import TrainerCallback

    from gnmr_hf import GNMRConfig
    from gnmr_hf.backends.block_fp import GemmFormat
    from gnmr_hf.experiments.operands import OperandFormats, check_operand_routing
    from gnmr_hf.experiments.pretrain import benchmark_arguments, benchmark_parser, load_corpus, run_arm

ARMS = ("all_low", "head_high", "head_grad_high", "head_fwd_high")


def formats_for(arm: str, low: GemmFormat, high: GemmFormat) -> OperandFormats | None:
    """The head's formats in `arm` (None: the head keeps its cheap path)."""
    return {
        "all_low": None,
        "head_high": OperandFormats(high, high, high),
        "head_grad_high": OperandFormats(low, low, high),
        "head_fwd_high": OperandFormats(high, high, low),
    }[arm]


class HeadFormats(TrainerCallback):
    """Sets the output head unit's cheap path to `formats` at train begin (every unit is static on its cheap path)."""

    def __init__(self, owner: Any, formats: OperandFormats | None) -> None:
        self.owner, self.formats = owner, formats

    def on_train_begin(self, args, state, control, **kwargs):
        (head,) = [u for u in self.owner.units if u.name == "lm_head"]
        if self.formats is not None:
            head.low = self.formats


def main() -> None:
    parser = benchmark_parser(__doc__.split("\n\n")[0], ARMS)
    cli = parser.parse_args()

    low, high = GemmFormat("e2m1", "fp32"), GemmFormat("e4m3", "fp32")
    check_operand_routing(low, high)
    root = Path(cli.output_dir)
    args, pretrain = benchmark_arguments(cli)
    config = GNMRConfig(
        backend="block_fp",
        backend_options={"low_format": low.fmt, "high_format": high.fmt, "quantize_lm_head": True},
        include=[r"\.(q|k|v|o|gate|up|down)_proj$", "^lm_head$"],
    )
    corpus = load_corpus(pretrain.corpus, pretrain.corpus_bytes)
    rows = []
    for seed in cli.seeds:
        for arm in cli.arms:
            out = root / arm / f"seed{seed}"
            formats = formats_for(arm, low, high)
            result = run_arm(
                "static_low",
                seed,
                args=dataclasses.replace(args, output_dir=str(out)),
                pretrain=pretrain,
                config=config,
                corpus=corpus,
                extra_callbacks=lambda owner, formats=formats: [HeadFormats(owner, formats)],
            )
            rows.append({"arm": arm, "seed": seed, "final_eval_loss": result["final_eval_loss"]})
            (root / "head_gemm_split.json").write_text(json.dumps(rows, indent=1))
    lines = ["| arm | head's x / W / G | seed | val loss |", "|---|---|---|---|"]
    for row in rows:
        f = formats_for(row["arm"], low, high)
        lines.append(f"| {row['arm']} | {f.fmt if f else 'all e2m1'} | {row['seed']} | {row['final_eval_loss']:.4f} |")
    (root / "head_gemm_split.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
