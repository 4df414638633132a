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

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("block_fp"):
    from gnmr_hf import GNMRConfig
    from gnmr_hf.backends.block_fp import GemmFormat
    from gnmr_hf.experiments.operands import HIGH, LOW, OperandFormats, run_split
    from gnmr_hf.experiments.pretrain import benchmark_parser

ARMS = ("all_low", "head_high", "head_grad_high", "head_fwd_high")


def formats_for(arm: str, low: GemmFormat, high: GemmFormat) -> OperandFormats | None:
    """The head's formats in `arm` (None: the head keeps its cheap path)."""
    return {
        "all_low": None,
        "head_high": OperandFormats(high, high, high),
        "head_grad_high": OperandFormats(low, low, high),
        "head_fwd_high": OperandFormats(high, high, low),
    }[arm]


HEAD = [r"^lm_head$"]  # the units the arms set apart


def main() -> None:
    parser = benchmark_parser(__doc__.split("\n\n")[0], ARMS)
    cli = parser.parse_args()

    config = GNMRConfig(
        backend="block_fp",
        backend_options={"low_format": LOW.fmt, "high_format": HIGH.fmt, "quantize_lm_head": True},
        include=[r"\.(q|k|v|o|gate|up|down)_proj$", "^lm_head$"],
    )
    run_split(cli, config, formats_for, name="head_gemm_split", what="head's x / W / G", units=HEAD)


if __name__ == "__main__":
    main()
