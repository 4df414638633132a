"""Each GEMM input of a block_fp Linear in a format of its own, for the benchmarks that set them apart.

    formats = OperandFormats(x=low, w=low, g=high)  # the output gradient high, the input and weight low
    unit.low = formats  # a BlockFPUnit's cheap path, as an experiment may replace it

`benchmarks/head_gemm_split.py` sets the output head's inputs apart, `benchmarks/operand_split.py` every unit's (or
some units'): both train their arms with `run_split`. `check_operand_routing` fails if `BlockFPLinear` no longer
rounds each input through the method this routes it by.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback

from ..backends.block_fp import GemmFormat, block_fp_linear

__all__ = ["HIGH", "LOW", "OperandFormats", "UnitFormats", "check_operand_routing", "run_split"]


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


def check_operand_routing(low: GemmFormat, high: GemmFormat) -> None:
    """Fail unless `BlockFPLinear` rounds each GEMM input through the method `OperandFormats` routes it by: the
    gradients with only G high are those computed by hand from G high and x, W low."""
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


# The split benchmarks' formats: FP4 and its FP8 recovery path, DeepSeek-V3's tiles.
LOW, HIGH = GemmFormat("e2m1", "fp32"), GemmFormat("e4m3", "fp32")


class UnitFormats(TrainerCallback):
    """Sets the cheap path of every unit whose name matches one of `units` (regexes; None: every unit) to `formats`
    at train begin (every unit is static on its cheap path). Fails if no unit matches."""

    def __init__(self, owner: Any, formats: OperandFormats | None, units: Sequence[str] | None = None) -> None:
        self.owner, self.formats, self.units = owner, formats, units

    def on_train_begin(self, args, state, control, **kwargs):
        chosen = [u for u in self.owner.units if self.units is None or any(re.search(p, u.name) for p in self.units)]
        if not chosen:
            raise ValueError(f"--units {self.units} match no unit")
        if self.formats is not None:
            for unit in chosen:
                unit.low = self.formats


def run_split(
    cli: argparse.Namespace,
    config: Any,
    formats_for: Callable[[str, GemmFormat, GemmFormat], OperandFormats | None],
    *,
    name: str,
    what: str,
    units: Sequence[str] | None = None,
    model: str = "scratch",
) -> list[dict[str, Any]]:
    """Train each of `cli.seeds` x `cli.arms` (`benchmark_parser`'s flags) as the static FP4 arm with the units
    `units` matches on `formats_for(arm, LOW, HIGH)`, writing `<output_dir>/<name>.json` after every run and the
    table `<name>.md` (its format column headed `what`) at the end; returns the rows."""
    from .pretrain import benchmark_arguments, load_corpus, retokenize, run_arm

    check_operand_routing(LOW, HIGH)
    root = Path(cli.output_dir)
    args, pretrain = benchmark_arguments(cli)
    pretrain = dataclasses.replace(pretrain, model=model)
    corpus = retokenize(load_corpus(pretrain.corpus, pretrain.corpus_bytes), pretrain.model)
    rows = []
    for seed in cli.seeds:
        for arm in cli.arms:
            formats = formats_for(arm, LOW, HIGH)
            result = run_arm(
                "static_low",
                seed,
                args=dataclasses.replace(args, output_dir=str(root / arm / f"seed{seed}")),
                pretrain=pretrain,
                config=config,
                corpus=corpus,
                extra_callbacks=lambda owner, formats=formats: [UnitFormats(owner, formats, units)],
            )
            units_set = None if units is None else list(units)
            rows.append({"arm": arm, "seed": seed, "units": units_set, "final_eval_loss": result["final_eval_loss"]})
            (root / f"{name}.json").write_text(json.dumps(rows, indent=1))
    lines = [f"| arm | {what} | seed | val loss |", "|---|---|---|---|"]
    for row in rows:
        f = formats_for(row["arm"], LOW, HIGH)
        lines.append(f"| {row['arm']} | {f.fmt if f else 'all e2m1'} | {row['seed']} | {row['final_eval_loss']:.4f} |")
    (root / f"{name}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return rows
