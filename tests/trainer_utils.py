"""Helpers shared by the Trainer tests: a tiny INT8 + LoRA Trainer with GNMR, an event recorder, trace access, and
the recipes loaded as modules."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from transformers import Trainer, TrainerCallback, TrainingArguments

from gnmr_hf import GNMRCallback, GNMRConfig, GNMRTrainer
from gnmr_hf.demo import GradientSpikeCallback
from gnmr_hf.tiny import load_int8_lora
from gnmr_hf.trace import read_trace

RECIPES = Path(__file__).resolve().parents[1] / "recipes"
SPIKED = "model.layers.1.mlp.down_proj"
SPIKE_STEP = 8
CFG = dict(max_active=2, lock_steps=3, window=3, min_history=3, alpha=4.0, beta=4.0)


class Recorder(TrainerCallback):
    """Records the event sequence and, at each step begin, which units are in recovery."""

    def __init__(self, gnmr: GNMRCallback | None = None) -> None:
        self.gnmr = gnmr
        self.events: list[tuple[str, int]] = []
        self.in_recovery_at_step: dict[int, list[str]] = {}
        self.logs: list[dict] = []

    def _ev(self, name, state):
        self.events.append((name, state.global_step))

    def on_step_begin(self, args, state, control, **kwargs):
        self._ev("step_begin", state)
        if self.gnmr is not None and self.gnmr.units:
            step = state.global_step + 1  # the optimizer step about to run
            self.in_recovery_at_step[step] = [u.name for u in self.gnmr.units if u.in_recovery]

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._ev("pre_optimizer_step", state)

    def on_optimizer_step(self, args, state, control, **kwargs):
        self._ev("optimizer_step", state)

    def on_step_end(self, args, state, control, **kwargs):
        self._ev("step_end", state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append(dict(logs or {}))


def make_trainer(
    model_dir,
    dataset,
    out,
    *,
    gnmr: GNMRConfig | None = None,
    max_steps: int = 14,
    spike_step: int = SPIKE_STEP,
    trainer_cls=Trainer,
    callbacks=(),
    target_modules: list[str] | None = None,
    eval_dataset=None,
    **args,
):
    """A Trainer on a fresh INT8 + LoRA tiny LLaMA with GNMR (`gnmr=False`: none) and an injected x100 spike
    on `SPIKED` at `spike_step` (0: none); `args` go to `TrainingArguments`."""
    model = load_int8_lora(model_dir, target_modules=target_modules)
    training_args = TrainingArguments(
        output_dir=str(out),
        use_cpu=True,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=args.pop("logging_steps", 2),
        save_strategy=args.pop("save_strategy", "no"),
        report_to=[],
        seed=0,
        disable_tqdm=True,
        **args,
    )
    cbs = list(callbacks)
    if spike_step:
        cbs.append(GradientSpikeCallback(SPIKED, spike_step, 100.0))
    kwargs = {}
    if trainer_cls is GNMRTrainer:
        kwargs["gnmr_config"] = gnmr or GNMRConfig(**CFG)
    elif gnmr is not False:
        cbs.insert(0, GNMRCallback(gnmr or GNMRConfig(**CFG)))
    return trainer_cls(
        model=model,
        args=training_args,
        train_dataset=dataset,
        eval_dataset=eval_dataset,
        callbacks=cbs,
        **kwargs,
    )


def gnmr_of(trainer) -> GNMRCallback:
    return next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, GNMRCallback))


def steps_of(out) -> list[dict]:
    return read_trace(Path(out) / "gnmr_trace.jsonl")[1]


@functools.cache
def load_recipe(name: str) -> ModuleType:
    """`recipes/<name>.py` as a module (the recipes are scripts, not a package), loaded once per session."""
    spec = importlib.util.spec_from_file_location(f"gnmr_recipe_{name}", RECIPES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while building the argument classes
    spec.loader.exec_module(module)
    return module
