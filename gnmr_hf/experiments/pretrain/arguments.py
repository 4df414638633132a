"""The recipe's own arguments (`PretrainArguments`, beside `TrainingArguments` and `GNMRConfig`) and its presets.

A preset (`PRESETS`) sets the model, the data and the Trainer's schedule; `training_arguments` fills every
`TrainingArguments` field the command line did not give from the preset and from the settings fixed for every arm
(AdamW with betas 0.9/0.95 and no weight decay, linear warm-up then cosine decay, global clipping at 1.0, fp32, CPU,
the batches read in order). `PretrainArguments` checks everything the arms need when it is built, so a mistake is
found before the first arm trains.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from transformers import TrainingArguments

from ..stabilizers import STABILIZER_ARMS, missing_package, parse_options
from .anomalies import AnomalySchedule
from .arms import ARMS

__all__ = ["PRESETS", "PretrainArguments", "training_arguments"]

# A preset sets the model, the data and the Trainer's schedule; anything given on the command line wins.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    # A smoke test: a minute on a CPU, end to end, every arm.
    "tiny": {
        "model": {"d_model": 32, "n_layers": 2, "n_heads": 2, "seq_len": 32},
        "data": {"corpus_bytes": 400_000, "eval_blocks": 16},
        "training": {
            "max_steps": 20,
            "per_device_train_batch_size": 4,
            "per_device_eval_batch_size": 16,
            "learning_rate": 3e-3,
            "warmup_steps": 2,
            "eval_steps": 10,
            "logging_steps": 5,
        },
    },
    # The independent probe's scale: d=128, 4 layers, batch 16 x 128 bytes, 400 steps.
    "probe": {
        "model": {"d_model": 128, "n_layers": 4, "n_heads": 4, "seq_len": 128},
        "data": {"corpus_bytes": 0, "eval_blocks": 128},
        "training": {
            "max_steps": 400,
            "per_device_train_batch_size": 16,
            "per_device_eval_batch_size": 64,
            "learning_rate": 3e-3,
            "warmup_steps": 40,
            "eval_steps": 50,
            "logging_steps": 10,
        },
    },
}

# Continued training of a real pretrained model (`--model smollm2-135m`): its own tokenizer, the stdlib corpus, a
# fine-tuning learning rate; sized so that one arm takes ~10 minutes on one CPU thread.
PRESETS["real"] = {
    "model": {"d_model": 576, "n_layers": 30, "n_heads": 9, "seq_len": 128},
    "data": {"corpus_bytes": 3_000_000, "eval_blocks": 32},
    "training": {
        "max_steps": 100,
        "per_device_train_batch_size": 4,
        "per_device_eval_batch_size": 8,
        "learning_rate": 1e-4,
        "warmup_steps": 5,
        "eval_steps": 50,
        "logging_steps": 5,
    },
}

# Fixed for every arm and preset (the reference's recipe); the command line can still override them.
_TRAINING_FIXED: dict[str, Any] = {
    "lr_scheduler_type": "cosine",
    "weight_decay": 0.0,
    "adam_beta1": 0.9,
    "adam_beta2": 0.95,
    "max_grad_norm": 1.0,
    "eval_strategy": "steps",
    "save_strategy": "no",
    "report_to": [],
    "use_cpu": True,
    "disable_tqdm": True,
    "train_sampling_strategy": "sequential",
    "dataloader_num_workers": 0,
}


@dataclass
class PretrainArguments:
    """The recipe's own arguments (beside `TrainingArguments` and `GNMRConfig`)."""

    preset: str = field(default="probe", metadata={"help": f"Model/data/schedule preset: {sorted(PRESETS)}."})
    arms: list[str] | None = field(
        default=None,
        metadata={
            "help": f"Arms to run, in order, from {list(ARMS)}. Default: every arm the other flags allow (carve_best "
            "with --oracle_every, carve_named with --carve_named; the stabilizer arms only when named)."
        },
    )
    seeds: list[int] = field(default_factory=lambda: [0], metadata={"help": "Model-initialization seeds."})
    model: str = field(
        default="scratch",
        metadata={
            "help": "scratch: a LLaMA built here from --d_model etc. (byte tokens); or a real pretrained model "
            "(gnmr_hf.experiments.models: smollm2-135m, a .gguf file or a folder), trained on with its own tokenizer "
            "from its weights (--d_model, --n_layers, --n_heads then only label the results: --preset real gives "
            "SmolLM2's)."
        },
    )
    corpus: str = field(
        default="stdlib",
        metadata={"help": "'stdlib' (the Python standard library sources), a text file or folder, or 'hf:name'."},
    )
    corpus_bytes: int | None = field(default=None, metadata={"help": "Cap on training bytes read (0: no cap)."})
    eval_blocks: int | None = field(default=None, metadata={"help": "Validation blocks of seq_len bytes."})
    d_model: int | None = field(default=None, metadata={"help": "Hidden size."})
    n_layers: int | None = field(default=None, metadata={"help": "Decoder layers."})
    n_heads: int | None = field(default=None, metadata={"help": "Attention heads."})
    seq_len: int | None = field(default=None, metadata={"help": "Bytes per training sequence."})
    budget: float | None = field(
        default=None,
        metadata={
            "help": "Average number of recovered units for the random and carve-out arms; default: the gnmr "
            "run's of the same seed in output_dir."
        },
    )
    carve_named: list[str] | None = field(
        default=None,
        metadata={"help": "Regexes of the units the carve_named arm keeps on the recovery path (a chosen carve-out)."},
    )
    oracle_every: int = field(
        default=0,
        metadata={"help": "Oracle probe every k steps in the gnmr arms (0: none); see gnmr_hf.experiments.oracle."},
    )
    oracle_benefits: bool = field(
        default=False,
        metadata={
            "help": "With --oracle_every: also probe each unit's recovery benefit, the counterfactual oracle "
            "(N + 2 passes per probe instead of 2; gnmr_hf.experiments.oracle.recovery_benefits)."
        },
    )
    impact_options: str = field(
        default="",
        metadata={"help": "The gnmr_impact arm's policy options, 'k=v,k=v' (e.g. 'min_impact=0.001,every=4')."},
    )
    stabilizer_options: str = field(
        default="",
        metadata={
            "help": "Keyword arguments of the stabilizer arms' method beyond its authors' defaults, 'k=v,k=v' (e.g. "
            "'update_proj_gap=100' for spam): a tuned setting (gnmr_hf.experiments.stabilizers)."
        },
    )
    anomalies: str = field(
        default="",
        metadata={
            "help": "Anomalous documents in training, comma-separated kinds from "
            "gnmr_hf.experiments.pretrain.anomalies (repeat, base64, digits, minified): one on every "
            "--anomaly_every-th optimizer step, the kinds taking turns; recorded in result.json and the trace."
        },
    )
    anomaly_every: int | None = field(
        default=None,
        metadata={"help": "With --anomalies: every N-th optimizer step trains on an anomalous document (default 20)."},
    )
    anomaly_scope: str = field(
        default="sequence",
        metadata={"help": "With --anomalies: 'sequence' (the step's first sequence) or 'batch' (all of them)."},
    )
    plot: bool = field(default=True, metadata={"help": "Write loss_curves.png beside results.md."})

    def anomaly_schedule(self) -> AnomalySchedule | None:
        """The anomalies' schedule, or None without --anomalies."""
        if not self.anomalies:
            return None
        every = 20 if self.anomaly_every is None else self.anomaly_every
        return AnomalySchedule.parse(self.anomalies, every, self.anomaly_scope)

    def __post_init__(self) -> None:
        if self.preset not in PRESETS:
            raise ValueError(f"PretrainArguments.preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        if self.arms is None:
            self.arms = [
                arm
                for arm in ARMS
                if (arm != "carve_best" or self.oracle_every > 0)
                and (arm != "carve_named" or self.carve_named)
                and arm not in STABILIZER_ARMS
            ]
        unknown = [a for a in self.arms if a not in ARMS]
        if unknown:
            raise ValueError(f"PretrainArguments.arms: {unknown} are not arms; choose from {list(ARMS)}")
        for key, value in {**PRESETS[self.preset]["model"], **PRESETS[self.preset]["data"]}.items():
            if getattr(self, key) is None:
                setattr(self, key, value)
        for key in ("d_model", "n_layers", "n_heads", "seq_len", "eval_blocks"):
            value = getattr(self, key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"PretrainArguments.{key} must be an int >= 1, got {value!r}")
        if self.d_model % self.n_heads:
            raise ValueError(f"PretrainArguments.d_model={self.d_model} must be a multiple of n_heads={self.n_heads}")
        if self.oracle_every < 0:
            raise ValueError(f"PretrainArguments.oracle_every must be >= 0, got {self.oracle_every}")
        if self.oracle_benefits and not self.oracle_every:
            raise ValueError("PretrainArguments.oracle_benefits needs --oracle_every K > 0 (the probes it adds to)")
        if "carve_named" in self.arms and not self.carve_named:
            raise ValueError("arm carve_named needs --carve_named REGEX ... (the units it keeps on the recovery path)")
        if self.anomalies:
            self.anomaly_schedule()
        elif self.anomaly_every is not None or self.anomaly_scope != "sequence":
            flag = "--anomaly_every" if self.anomaly_every is not None else "--anomaly_scope"
            raise ValueError(f"{flag} needs --anomalies KIND[,KIND...] (the documents it schedules)")
        parse_options(self.stabilizer_options)
        if self.impact_options:
            from ...policies.impact import ImpactOptions

            try:
                ImpactOptions.parse(self.impact_options)
            except (TypeError, ValueError) as err:
                raise ValueError(f"PretrainArguments.impact_options: {err}") from None
        for arm in self.arms:
            package = missing_package(arm)
            if package:
                raise ValueError(f"arm {arm} needs the {package} package: pip install -e '.[stabilizers]'")


def training_arguments(base: TrainingArguments, preset: str, given: Iterable[str] = ()) -> TrainingArguments:
    """`base` with the preset's schedule and the fixed recipe settings, except for the fields in `given` (those the
    user set on the command line)."""
    given = set(given)
    values = {**_TRAINING_FIXED, **PRESETS[preset]["training"]}
    return dataclasses.replace(base, **{k: v for k, v in values.items() if k not in given})
