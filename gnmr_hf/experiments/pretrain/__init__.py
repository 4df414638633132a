"""Pretraining a small LLaMA from scratch with the transformers Trainer, arm against arm: the machinery the
pretraining stress recipes share (`recipes/pretrain_actquant.py`, `recipes/pretrain_dynamic_precision.py`) and the
benchmarks that train arms of their own.

A precision claim needs every arm to see the same model initialization, the same batches in the same order and the
same code path, and differ only in precision policy. This package provides exactly that, offline, one concern per
file, in the order a run uses them:

- `anomalies.py`: anomalous documents put into training on a schedule (`AnomalySchedule`, `AnomalousBlocks`:
  `--anomalies repeat,base64,digits,minified --anomaly_every N`), the same in every arm.
- `data.py`: the corpus (`load_corpus`: the Python standard library's sources by default, split by document), the
  byte tokenizer (`ByteTokenizer`) and the fixed batch order (`block_dataset`), the same in every arm.
- `model.py`: the model (`llama_config`, `build_model`: transformers' `LlamaForCausalLM`, seeded; or a real
  pretrained model, `recipe_model`).
- `arguments.py`: the recipe's own arguments (`PretrainArguments`), the presets (`PRESETS`) and the Trainer
  settings fixed for every arm (`training_arguments`).
- `arms.py`: the arms as a table, name -> how its callbacks are built (`ARMS`, `arm_callbacks`): the reference,
  static low and high, the GNMR policies, the same-budget baselines and the stabilizers.
- `meters.py`: what an arm costs (`StepMeter`, `SavedTensorMeter`: seconds per step, bytes saved for backward).
- `runner.py`: one arm and seed trained and evaluated into a `result.json` (`run_arm`), or a whole comparison
  (`run_comparison`).
- `table.py`, `plot.py`: the comparison table over seeds and the loss-curve plot.
- `recipe.py`: a recipe's command line to its run and report (`parse_recipe_arguments`, `run_recipe`,
  `write_report`), and a benchmark's (`benchmark_parser`, `benchmark_arguments`).

Everything is importable from `gnmr_hf.experiments.pretrain` itself, as recipes, benchmarks and tests do.
"""

from __future__ import annotations

from .anomalies import ANOMALY_KINDS, AnomalousBlocks, AnomalySchedule, anomalous_text
from .arguments import PRESETS, PretrainArguments, training_arguments
from .arms import ARMS, BUDGET_ARMS, arm_callbacks
from .data import ByteTokenizer, Corpus, block_dataset, load_corpus, retokenize, text_codec
from .meters import SavedTensorMeter, StepMeter
from .model import build_model, llama_config, recipe_model
from .plot import plot_loss_curves
from .recipe import benchmark_arguments, benchmark_parser, parse_recipe_arguments, run_recipe, write_report
from .runner import check_arm_plan, gnmr_budget, oracle_mean_gaps, run_arm, run_comparison, unit_names
from .table import load_results, results_table

__all__ = [
    "ANOMALY_KINDS",
    "ARMS",
    "BUDGET_ARMS",
    "PRESETS",
    "AnomalousBlocks",
    "AnomalySchedule",
    "ByteTokenizer",
    "Corpus",
    "PretrainArguments",
    "SavedTensorMeter",
    "StepMeter",
    "anomalous_text",
    "arm_callbacks",
    "benchmark_arguments",
    "benchmark_parser",
    "block_dataset",
    "build_model",
    "check_arm_plan",
    "gnmr_budget",
    "llama_config",
    "load_corpus",
    "load_results",
    "oracle_mean_gaps",
    "parse_recipe_arguments",
    "plot_loss_curves",
    "recipe_model",
    "results_table",
    "retokenize",
    "run_arm",
    "run_comparison",
    "run_recipe",
    "text_codec",
    "training_arguments",
    "unit_names",
    "write_report",
]
