"""What a pretraining recipe or benchmark does with its command line: flags to arguments, the run, the report.

A recipe (`recipes/pretrain_actquant.py`, `recipes/pretrain_dynamic_precision.py`) is `parse_recipe_arguments`
then `run_recipe`; a benchmark that trains arms of its own takes the smaller flag set of `benchmark_parser`.
`write_report` turns every `result.json` under a folder into `results.md` and `loss_curves.png`, so arms run by
separate commands end up in one table.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformers import TrainingArguments

from ...config import GNMRConfig
from .arguments import PRESETS, PretrainArguments, training_arguments
from .data import load_corpus, retokenize
from .plot import _describe, plot_loss_curves
from .runner import check_arm_plan, run_comparison
from .table import load_results, results_table

__all__ = ["benchmark_arguments", "benchmark_parser", "parse_recipe_arguments", "run_recipe", "write_report"]

logger = logging.getLogger("gnmr_hf")


def benchmark_parser(description: str, arms: Sequence[str]) -> argparse.ArgumentParser:
    """The flags of a benchmark that trains arms of its own (`benchmarks/fault_injection.py`, `xg_split.py`,
    `head_gemm_split.py`): where, which seeds and arms, the preset, and the preset's steps and learning rate."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--arms", nargs="+", default=list(arms), choices=arms)
    parser.add_argument("--preset", default="probe", choices=sorted(PRESETS))
    parser.add_argument("--max_steps", type=int, default=None)
    parser.add_argument("--learning_rate", type=float, default=None)
    parser.add_argument("--impact_options", default="", help="The gnmr_impact arm's policy options, 'k=v,k=v'.")
    return parser


def benchmark_arguments(cli: argparse.Namespace) -> tuple[TrainingArguments, PretrainArguments]:
    """The `TrainingArguments` (the preset's, with `--max_steps` and `--learning_rate` where given) and the
    `PretrainArguments` (the preset's model and corpus) of `benchmark_parser`'s flags."""
    given = {k: getattr(cli, k) for k in ("max_steps", "learning_rate") if getattr(cli, k) is not None}
    base = TrainingArguments(output_dir=cli.output_dir, **given)
    args = training_arguments(base, cli.preset, {"output_dir", *given})
    return args, PretrainArguments(preset=cli.preset, arms=["static_low"], impact_options=cli.impact_options)


def parse_recipe_arguments(
    argv: Sequence[str], **defaults: Any
) -> tuple[TrainingArguments, PretrainArguments, GNMRConfig]:
    """`TrainingArguments`, `PretrainArguments` and `GNMRConfig` from a recipe's command line, with the recipe's
    own `defaults` for any of their fields (e.g. ``backend="block_fp"``) and the preset's schedule filling every
    `TrainingArguments` field the command line does not give. A user error exits with one line (`gnmr_hf.cli`)."""
    from transformers import HfArgumentParser

    from ...commandline import check_config, parse_or_fail

    # No abbreviations: with three dataclasses' flags in one parser, a prefix would pick whichever flag it matches.
    parser = HfArgumentParser((TrainingArguments, PretrainArguments, GNMRConfig), allow_abbrev=False)
    parser.set_defaults(**defaults)
    base, pretrain, config = parse_or_fail(parser, argv)
    check_config(config)
    given = {a[2:].split("=", 1)[0] for a in argv if a.startswith("--")}
    return training_arguments(base, pretrain.preset, given), pretrain, config


def run_recipe(args: TrainingArguments, pretrain: PretrainArguments, config: GNMRConfig) -> list[dict[str, Any]]:
    """What a pretraining recipe does once its flags are parsed: load the corpus (logged with its fingerprint),
    run every arm and seed under `args.output_dir`, print the table (and write the plot), return the results."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    from ...commandline import fail

    try:
        check_arm_plan(args.output_dir, pretrain, config)
    except ValueError as err:
        fail(str(err))
    logger.info("arms %s, seeds %s -> %s", " ".join(pretrain.arms), pretrain.seeds, args.output_dir)
    corpus = retokenize(load_corpus(pretrain.corpus, pretrain.corpus_bytes), pretrain.model)
    logger.info(
        "corpus %s: %d documents, %d training bytes, %d validation bytes (fingerprint %s); %s options %s",
        corpus.source,
        corpus.documents,
        len(corpus.train),
        len(corpus.validation),
        corpus.fingerprint(),
        config.backend,
        config.backend_options,
    )
    root = Path(args.output_dir)
    results = run_comparison(root, args=args, pretrain=pretrain, config=config, corpus=corpus)
    print(write_report(root, plot=pretrain.plot))
    return results


def write_report(root: str | Path, *, plot: bool = True, title: str = "") -> str:
    """The table over every `result.json` under `root` (arms run by separate commands end up in one table), written
    to `root/results.md`, and with `plot` the loss curves to `root/loss_curves.png`; returns the table."""
    root = Path(root)
    everything = load_results(root)
    table = results_table(everything)
    (root / "results.md").write_text(table + "\n")
    if plot and everything:
        plot_loss_curves(everything, root / "loss_curves.png", title=title or _describe(everything))
    return table
