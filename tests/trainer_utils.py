"""Helpers shared by the Trainer tests: a tiny INT8 + LoRA Trainer with GNMR, an event recorder, trace access, and
the recipes loaded as modules."""

from __future__ import annotations

import functools
import importlib.util
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

from gnmr_hf import GNMRCallback, GNMRConfig, GNMRTrainer
from gnmr_hf.experiments.demo import GradientSpikeCallback
from gnmr_hf.experiments.tiny import load_int8_lora
from gnmr_hf.impact import impacts
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
    """A Trainer with GNMR (`gnmr=False`: none) and an injected x100 spike on `SPIKED` at `spike_step` (0: none),
    on a fresh INT8 + LoRA tiny LLaMA loaded from `model_dir`, or on `model_dir` itself when it is a model (another
    backend's); `args` go to `TrainingArguments`."""
    model = model_dir if isinstance(model_dir, nn.Module) else load_int8_lora(model_dir, target_modules=target_modules)
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


@functools.cache
def load_script(path: str) -> ModuleType:
    """A script of the repository (e.g. "benchmarks/anomaly_analysis.py") as a module, loaded once per session."""
    name = "gnmr_script_" + Path(path).stem
    spec = importlib.util.spec_from_file_location(name, RECIPES.parent / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# ------------------------------------------------------------------------------------ backend test helpers


def token_ids(seed: int = 0, batch: int = 2, length: int = 12) -> torch.Tensor:
    return torch.randint(0, 256, (batch, length), generator=torch.Generator().manual_seed(seed))


def close_all(units: list) -> None:
    for unit in units:
        unit.close()


def randomize_lora_b(model: nn.Module, seed: int = 0) -> None:
    """peft starts lora_B at zero, which makes every lora_A gradient zero; give both a gradient."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def lora_grads_against_bf16(model: nn.Module, path: Path, backend: str) -> tuple[dict, dict, dict]:
    """The LoRA gradients of `model` (a quantized LoRA LLaMA loaded from `path`) with every unit of `backend` in
    recovery and on the cheap path, and those of the reference: the fp32 model with BF16-rounded base weights and
    the same LoRA parameters. Returns (reference, recovery, cheap), each name -> gradient."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from gnmr_hf import find_units

    reference = AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        for module in reference.modules():
            if isinstance(module, nn.Linear) and module is not reference.lm_head:
                module.weight.copy_(module.weight.bfloat16().float())
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    reference = get_peft_model(reference, LoraConfig(r=4, lora_alpha=8, target_modules=targets, task_type="CAUSAL_LM"))
    missing = reference.load_state_dict({k: v for k, v in model.state_dict().items() if "lora_" in k}, strict=False)
    assert not missing.unexpected_keys
    ids = token_ids()
    reference(ids, labels=ids).loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters() if p.requires_grad}

    def lora_grads(recovery: bool) -> dict[str, torch.Tensor]:
        units = find_units(model, backend)
        for unit in units if recovery else []:
            unit.enter_recovery()
        model.zero_grad(set_to_none=True)
        model(ids, labels=ids).loss.backward()
        close_all(units)
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    return ref_grads, lora_grads(recovery=True), lora_grads(recovery=False)


def step_impacts(model: nn.Module, units, micro_batches: list[dict], **checkpointing) -> torch.Tensor:
    """Every unit's impact over one optimizer step of `micro_batches` (each a mean loss, divided by their count),
    the units measuring every row, under gradient checkpointing with `checkpointing`'s kwargs if any; closes the
    units."""
    for unit in units:
        unit.impact.start(0, clock=lambda: 0)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        if not any(p.requires_grad for p in model.get_input_embeddings().parameters()):
            # Frozen embeddings (LoRA): a reentrant checkpoint passes gradients only to inputs that need them.
            model.enable_input_require_grads()
    model.train()
    for batch in micro_batches:
        (model(**batch).loss / len(micro_batches)).backward()
    value = impacts([u.impact.take() for u in units], torch.device("cpu"))
    units.close()
    return value


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# A rank aborted by std::terminate inside the gloo process group's threads (at start or teardown, not in our code: the
# rank dies by SIGABRT, where a Python error exits with 1), seen about once in 30 launches on the 2-core VM and once in
# CI, after a finished recipe run. The recipe and the DDP and FSDP2 workers destroy their process group before exit;
# the launch is still retried once on exactly that signature, never on a failure of the test's assertions.
_GLOO_ABORT = "terminate called without an active exception"


def launch(
    cmd: list[str], timeout: float = 300, cwd: Path | None = None, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run a multi-process launch (`accelerate launch`, `torchrun`) on loopback; fail the test with its output."""
    env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **(env or {})}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if result.returncode != 0 and _GLOO_ABORT in result.stderr and "(exitcode: -6)" in result.stderr:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd)
    if result.returncode != 0:
        pytest.fail(
            f"{' '.join(cmd)} exited with {result.returncode}:\n{result.stdout[-4000:]}\n{result.stderr[-8000:]}"
        )
    return result
