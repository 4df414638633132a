r"""Which GEMM inputs of every unit make FP4 training cost what it costs: the forward's or the output gradient's.

    python benchmarks/operand_split.py --output_dir runs/operand_split --preset real --model smollm2-135m \
        --max_steps 40 --seeds 0 1
    # only some units set apart (the rest stay all e2m1), e.g. the last 32 (layers 26-29, layer 25's attention):
    python benchmarks/operand_split.py --output_dir runs/operand_split_last32 --preset real --model smollm2-135m \
        --max_steps 40 --seeds 0 1 --arms grad_high fwd_high --units 'layers\.(2[6-9])\.' 'layers\.25\.self_attn\.'

The FP4 regime of docs/lab/impact.md (block_fp e2m1 / e4m3, DeepSeek-V3 tiles, every projection a unit, the output
head not) with every unit static, and each unit's three GEMM inputs set apart as `head_gemm_split.py` sets the
head's: `all_low` every input in e2m1 (static FP4; the recipe's `static_low` to the digit), `grad_high` only the
output gradient G (the dgrad and wgrad GEMMs' one) in e4m3, `fwd_high` only the input x and the weight W (the
fprop's; x in the wgrad, W in the dgrad) in e4m3, `all_high` all three (the recipe's `static_high`, or with `--units`
its `carve_named` arm). `--units REGEX ...`: only the units whose names match one of them are set apart, the others
stay all e2m1. The validation loss is the exact model's (block_fp's eval runs the
plain `F.linear`), as in the recipe: what FP4 did to the weights, not what it does to a forward.

Why: `policy="impact"` weighs each unit's forward error (docs/method.md), so the share of FP4's training cost that
comes from the output gradient's rounding is the share its ranking cannot see. Writes `<output_dir>/operand_split.md`
and `.json`.
"""

from __future__ import annotations

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("block_fp"):
    from gnmr_hf import GNMRConfig
    from gnmr_hf.backends.block_fp import GemmFormat
    from gnmr_hf.experiments.operands import HIGH, LOW, OperandFormats, run_split
    from gnmr_hf.experiments.pretrain import benchmark_parser

ARMS = ("all_low", "grad_high", "fwd_high", "all_high")
PROJECTIONS = [r"\.(q|k|v|o|gate|up|down)_proj$"]


def formats_for(arm: str, low: GemmFormat, high: GemmFormat) -> OperandFormats | None:
    """Every unit's cheap-path formats in `arm` (None: block_fp's own, every input in `low`)."""
    return {
        "all_low": None,
        "grad_high": OperandFormats(low, low, high),
        "fwd_high": OperandFormats(high, high, low),
        "all_high": OperandFormats(high, high, high),
    }[arm]


def main() -> None:
    parser = benchmark_parser(__doc__.split("\n\n")[0], ARMS)
    parser.add_argument("--model", default="scratch", help="PretrainArguments.model (smollm2-135m with --preset real)")
    parser.add_argument("--units", nargs="+", default=None, help="Regexes of the units set apart (default: all)")
    cli = parser.parse_args()

    config = GNMRConfig(
        backend="block_fp", backend_options={"low_format": LOW.fmt, "high_format": HIGH.fmt}, include=PROJECTIONS
    )
    what = "x / W / G of the units set apart"
    run_split(cli, config, formats_for, name="operand_split", what=what, units=cli.units, model=cli.model)


if __name__ == "__main__":
    main()
