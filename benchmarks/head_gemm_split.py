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
    import torch
    from transformers import TrainerCallback

    from gnmr_hf import GNMRConfig
    from gnmr_hf.backends.block_fp import GemmFormat
    from gnmr_hf.experiments.pretrain import benchmark_arguments, benchmark_parser, load_corpus, run_arm

ARMS = ("all_low", "head_high", "head_grad_high", "head_fwd_high")


@dataclasses.dataclass(frozen=True)
class OperandFormats:
    """A `GemmFormat` per GEMM input of one Linear: its input `x` (fprop and wgrad), its weight `w` (fprop and dgrad)
    and its output gradient `g` (dgrad and wgrad), for `BlockFPLinear`, which rounds the input through
    `input_operand`, the weight through `operand(..., weight=True)` and the output gradient through `grad_operand`
    (checked by `check_operand_routing`)."""

    x: GemmFormat
    w: GemmFormat
    g: GemmFormat

    @property
    def fmt(self) -> str:
        return f"x={self.x.fmt};w={self.w.fmt};g={self.g.fmt}"

    @property
    def scaling(self) -> str:
        return self.x.scaling

    def operand(self, t: torch.Tensor, contract: int, *, weight: bool = False) -> torch.Tensor:
        return (self.w if weight else self.g).operand(t, contract, weight=weight)

    def input_operand(self, x2: torch.Tensor, contract: int) -> torch.Tensor:
        return self.x.input_operand(x2, contract)

    def grad_operand(self, g2: torch.Tensor, contract: int) -> torch.Tensor:
        return self.g.grad_operand(g2, contract)


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


def check_operand_routing(low: GemmFormat, high: GemmFormat) -> None:
    """Fail unless `BlockFPLinear` rounds each GEMM input through the method `OperandFormats` routes it by: the
    gradients with only G high are those computed by hand from G high and x, W low."""
    from gnmr_hf.backends.block_fp import block_fp_linear

    g = torch.Generator().manual_seed(0)
    x, w, dy = torch.randn(160, 128, generator=g), torch.randn(96, 128, generator=g), torch.randn(160, 96, generator=g)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = block_fp_linear(xr, wr, None, OperandFormats(low, low, high))
    y.backward(dy)
    xq, wq = low.operand(x, 1), low.operand(w, 1, weight=True)
    expected = (
        xq @ wq.t(),
        high.operand(dy, 1) @ low.operand(w, 0, weight=True),
        high.operand(dy, 0).t() @ low.operand(x, 0),
    )
    for name, got, want in zip(("output", "input grad", "weight grad"), (y, xr.grad, wr.grad), expected, strict=True):
        if not torch.equal(got.detach(), want):
            raise RuntimeError(f"BlockFPLinear no longer rounds its GEMM inputs as OperandFormats assumes ({name})")


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
