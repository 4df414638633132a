"""GNMRCallback and GNMRTrainer in a real transformers Trainer on a real bitsandbytes INT8 + peft LoRA model (CPU)."""

from __future__ import annotations

import json
import logging
import shutil
from typing import ClassVar

import pytest
import torch
from transformers import Trainer, TrainerCallback

from gnmr_hf import GNMRCallback, GNMRConfig, GNMRTrainer
from gnmr_hf.experiments.demo import GradientSpikeCallback
from gnmr_hf.trace import read_trace

from trainer_utils import CFG, SPIKE_STEP, SPIKED, Recorder, gnmr_of, make_trainer, steps_of


def test_injected_spike_is_selected_next_step_held_for_lock_steps_then_released(tiny_llama_dir, dataset, tmp_path):
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path)
    rec = Recorder()
    trainer.add_callback(rec)
    trainer.train()
    gnmr = gnmr_of(trainer)
    rec.gnmr = gnmr
    names = [u.name for u in gnmr.units]
    idx = names.index(SPIKED)
    steps = {r["step"]: r for r in steps_of(tmp_path)}
    assert len(steps) == 14
    # The decision made from step k's gradients selects the unit ...
    assert idx in steps[SPIKE_STEP]["risky"]
    assert idx in steps[SPIKE_STEP]["entered"]
    # ... it stays for lock_steps decisions after its last risky one, then leaves.
    lock = CFG["lock_steps"]
    last_risky = max(s for s, r in steps.items() if idx in r["risky"])
    for s in range(SPIKE_STEP, last_risky + lock):
        assert idx in steps[s]["active"], s
    assert idx in steps[last_risky + lock]["exited"]
    assert all(idx not in steps[s]["active"] for s in range(last_risky + lock, 15))
    # The hard budget holds at every step.
    assert max(len(r["active"]) for r in steps.values()) <= CFG["max_active"]
    assert all(idx not in steps[s]["active"] for s in range(1, SPIKE_STEP))


def test_a_decision_takes_effect_from_the_next_step(tiny_llama_dir, dataset, tmp_path):
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path)
    rec = Recorder(gnmr_of(trainer))
    trainer.add_callback(rec)
    trainer.train()
    steps = {r["step"]: r for r in steps_of(tmp_path)}
    names = [u.name for u in rec.gnmr.units]
    # Units running in recovery during step k are exactly those chosen by the decision of step k-1.
    for k in range(2, 15):
        assert rec.in_recovery_at_step[k] == [names[i] for i in steps[k - 1]["active"]], k
    assert rec.in_recovery_at_step[1] == []
    assert SPIKED not in rec.in_recovery_at_step[SPIKE_STEP]
    assert SPIKED in rec.in_recovery_at_step[SPIKE_STEP + 1]
    # Event timing: each optimizer step k runs pre_optimizer_step, optimizer_step (global_step k-1), step_end (k).
    start = rec.events.index(("step_begin", SPIKE_STEP - 1))
    assert rec.events[start : start + 4] == [
        ("step_begin", SPIKE_STEP - 1),
        ("pre_optimizer_step", SPIKE_STEP - 1),
        ("optimizer_step", SPIKE_STEP - 1),
        ("step_end", SPIKE_STEP),
    ]


class PreClipRecorder(Trainer):
    """Records every unit's gradient norm right before the Trainer clips."""

    def _clip_grad_norm(self, model):
        gnmr = gnmr_of(self)
        norms = []
        for unit in gnmr.units:
            sq = sum(t.grad.float().square().sum() for t in unit.signal_tensors() if t.grad is not None)
            norms.append(float(torch.as_tensor(sq).sqrt()))
        self.pre_clip.append(norms)
        total = super()._clip_grad_norm(model)
        self.totals.append(float(total))
        return total


CHECKPOINTING = {
    "off": {},
    "reentrant": {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
    "non_reentrant": {"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False}},
}


@pytest.mark.parametrize("accumulation", [1, 3])
@pytest.mark.parametrize("checkpointing", list(CHECKPOINTING))
def test_signal_is_the_pre_clip_norm_after_accumulation(
    tiny_llama_dir, dataset, tmp_path, accumulation, checkpointing
):
    # Reentrant checkpointing runs a nested backward per decoder layer; the norms must still be read once, after
    # the outermost backward of the last micro-batch, with every unit's complete gradient.
    trainer = make_trainer(
        tiny_llama_dir,
        dataset,
        tmp_path,
        max_steps=10,
        trainer_cls=PreClipRecorder,
        gradient_accumulation_steps=accumulation,
        max_grad_norm=1.0,
        **CHECKPOINTING[checkpointing],
    )
    trainer.pre_clip, trainer.totals = [], []
    observed = []

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            observed.append(gnmr_of(trainer).capture.pending[0].tolist())

    trainer.add_callback(Grab())
    trainer.train()
    # One observation per optimizer step, whatever the accumulation.
    assert gnmr_of(trainer).controller.step == 10
    assert len(observed) == len(trainer.pre_clip) == 10
    # Clipping really rescaled the gradients (the spike alone is far above max_grad_norm) ...
    assert max(trainer.totals) > 1.0
    # ... and the signal is the norm before it, for every unit (a missing unit would be NaN here).
    torch.testing.assert_close(torch.tensor(observed), torch.tensor(trainer.pre_clip), rtol=1e-5, atol=0)


def test_a_spike_in_the_first_layer_is_caught_under_reentrant_checkpointing(tiny_llama_dir, dataset, tmp_path):
    first = "model.layers.0.self_attn.q_proj"
    trainer = make_trainer(
        tiny_llama_dir,
        dataset,
        tmp_path,
        spike_step=0,
        callbacks=[GradientSpikeCallback(first, SPIKE_STEP, 100.0)],
        **CHECKPOINTING["reentrant"],
    )
    trainer.train()
    # transformers 5.25 renamed the property (the old name warns); the package accepts transformers >= 5.0.
    model = trainer.model
    assert getattr(model, "is_activation_checkpointing", None) or model.is_gradient_checkpointing
    steps = {r["step"]: r for r in steps_of(tmp_path)}
    idx = [u.name for u in gnmr_of(trainer).units].index(first)
    assert all(r["n_scored"] == len(gnmr_of(trainer).units) for s, r in steps.items() if s > CFG["min_history"])
    assert idx in steps[SPIKE_STEP]["entered"]


def test_one_device_to_host_sync_per_optimizer_step(tiny_llama_dir, dataset, tmp_path, monkeypatch):
    from torch.utils._python_dispatch import TorchDispatchMode

    counts = {"n": 0}

    class CountScalars(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten._local_scalar_dense.default:
                counts["n"] += 1
            return func(*args, **(kwargs or {}))

    # Host transfers: `.cpu()`, `.tolist()`, `.item()` (`.numpy()` is a free view of a host tensor).
    for name in ("tolist", "cpu", "item"):
        original = getattr(torch.Tensor, name)

        def counted(self, *a, _orig=original, **k):
            counts["n"] += 1
            return _orig(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    per_step: dict[str, list[int]] = {}

    class Meter(TrainerCallback):
        def __init__(self, key):
            self.key, self.start = key, 0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = counts["n"]

        def on_step_end(self, args, state, control, **kwargs):
            per_step.setdefault(self.key, []).append(counts["n"] - self.start)

    # source="dequantize": reading the checkpoint goes through safetensors, which reads its memory-mapped
    # *host* storage with scalar reads; on CPU those look like the syncs counted here, on a GPU they are not.
    runs = {"plain": False, "gnmr": GNMRConfig(**CFG, backend_options={"source": "dequantize"})}
    for key, gnmr in runs.items():
        trainer = make_trainer(
            tiny_llama_dir, dataset, tmp_path / key, gnmr=gnmr, max_steps=8, spike_step=5, logging_steps=100
        )
        trainer.add_callback(Meter(key))  # last: measures every callback, GNMR's included
        with CountScalars():
            trainer.train()
    extra = [g - p for g, p in zip(per_step["gnmr"], per_step["plain"], strict=False)]
    assert len(extra) == 8
    assert max(extra) <= 1, extra


def test_monitor_only_scores_and_logs_but_never_flips(tiny_llama_dir, dataset, tmp_path):
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, gnmr=GNMRConfig(**CFG, monitor_only=True))
    rec = Recorder(gnmr_of(trainer))
    trainer.add_callback(rec)
    trainer.train()
    steps = steps_of(tmp_path)
    idx = [u.name for u in rec.gnmr.units].index(SPIKED)
    assert idx in steps[SPIKE_STEP - 1]["active"]  # the decision is made and traced ...
    assert all(names == [] for names in rec.in_recovery_at_step.values())  # ... but never applied
    assert any("gnmr/max_risk" in logs for logs in rec.logs)


def test_gnmr_trainer_puts_the_metrics_ahead_of_every_other_callback(tiny_llama_dir, dataset, tmp_path):
    rec = Recorder()
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, trainer_cls=GNMRTrainer, callbacks=[rec])
    trainer.train()
    keys = {"gnmr/active", "gnmr/entered", "gnmr/exited", "gnmr/candidates", "gnmr/exceedance_rate"}
    step_logs = [logs for logs in rec.logs if "loss" in logs]
    assert step_logs and all(keys <= set(logs) for logs in step_logs)
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert all(keys <= set(h) for h in history)
    entered = sum(h["gnmr/entered"] for h in history)
    assert entered >= 1  # the spike entered, and the flips of every step are summed between logs


class FakeTensorBoard(TrainerCallback):
    """What transformers' TensorBoardCallback does with a log (its `on_log` writes every number in `logs` as a scalar
    of the step), into a dict: tensorboard is not a test dependency."""

    written: ClassVar[dict[str, list[int]]] = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        for key, value in (logs or {}).items():
            if isinstance(value, (int, float)):
                self.written.setdefault(key, []).append(state.global_step)


@pytest.mark.parametrize("how", ["add_callback", "callbacks", "GNMRTrainer"])
def test_only_gnmr_trainer_gets_the_metrics_to_tensorboard_and_the_others_warn_with_the_fix(
    how, tiny_llama_dir, dataset, tmp_path, caplog, monkeypatch
):
    from transformers import TrainingArguments

    from gnmr_hf.experiments.tiny import load_int8_lora

    # report_to=["tensorboard"] gets the TensorBoard callback where the Trainer puts every reporting integration.
    monkeypatch.setattr(
        "transformers.trainer.get_reporting_integration_callbacks", lambda report_to: [FakeTensorBoard]
    )
    FakeTensorBoard.written = {}
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=2, logging_steps=1,
        report_to=["tensorboard"], disable_tqdm=True,
    )  # fmt: skip
    common = dict(model=load_int8_lora(tiny_llama_dir), args=args, train_dataset=dataset)
    config = GNMRConfig(**CFG)
    if how == "add_callback":
        trainer = Trainer(**common)
        trainer.add_callback(GNMRCallback(config))
    elif how == "callbacks":
        trainer = Trainer(**common, callbacks=[GNMRCallback(config)])
    else:
        trainer = GNMRTrainer(**common, gnmr_config=config)
    with caplog.at_level(logging.WARNING, logger="gnmr_hf"):
        trainer.train()
    assert all("gnmr/active" in h for h in trainer.state.log_history if "loss" in h)
    if how == "GNMRTrainer":
        assert FakeTensorBoard.written["gnmr/active"] == FakeTensorBoard.written["loss"] == [1, 2]
        assert "reporting integrations" not in caplog.text
    else:
        assert "gnmr/active" not in FakeTensorBoard.written and FakeTensorBoard.written["loss"] == [1, 2]
        assert "the reporting integrations ['tensorboard'] log before this callback" in caplog.text
        assert "build the trainer as GNMRTrainer(model=..., args=..., train_dataset=..., gnmr_config=" in caplog.text


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"backend": "nonexistent"}, r"^GNMRConfig\.backend: unknown backend 'nonexistent'; known backends are \["),
        ({"backend_options": "foo=bar"}, r"^GNMRConfig\.backend_options: bnb_int8 has unknown options \['foo'\]"),
    ],
)
def test_a_bad_backend_or_option_is_refused_when_the_callback_or_trainer_is_built(fields, message, tmp_path):
    from transformers import TrainingArguments

    config = GNMRConfig(**fields)  # the config is a leaf: it imports no backend, so it takes the name
    with pytest.raises(ValueError, match=message):
        GNMRCallback(config)
    # GNMRTrainer checks before Trainer.__init__ touches the model: with no model at all, ours is the error.
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with pytest.raises(ValueError, match=message):
        GNMRTrainer(model=None, args=args, gnmr_config=config)


# The README's add_callback example as a user's own script, logging left as Python sets it up.
USER_SCRIPT = """
import sys
from transformers import Trainer, TrainingArguments
from gnmr_hf import GNMRCallback, GNMRConfig
from gnmr_hf.experiments.demo import byte_dataset
from gnmr_hf.experiments.tiny import load_int8_lora

model_dir, text, out, configure = sys.argv[1:]
if configure == "info":
    import logging
    logging.basicConfig(level=logging.INFO)
args = TrainingArguments(
    output_dir=out, use_cpu=True, max_steps=3, per_device_train_batch_size=2, logging_steps=1, report_to=[]
)
trainer = Trainer(model=load_int8_lora(model_dir), args=args, train_dataset=byte_dataset(text))
trainer.add_callback(GNMRCallback(GNMRConfig(max_active=4, lock_steps=8)))
trainer.train()
"""


def test_a_users_script_shows_the_summary_once_as_the_trainer_shows_its_own(tiny_llama_dir, tmp_path):
    import os
    import subprocess
    import sys

    from gnmr_hf.experiments.tiny import write_local_text

    text = write_local_text(tmp_path / "train.txt", lines=16)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    runs = {}
    for configure in ("default", "info"):
        runs[configure] = subprocess.run(
            [sys.executable, "-c", USER_SCRIPT, str(tiny_llama_dir), str(text), str(tmp_path / configure), configure],
            capture_output=True,
            text=True,
            env=env,
            timeout=300,
        )
        assert runs[configure].returncode == 0, runs[configure].stderr[-3000:]
    default, info = runs["default"], runs["info"]
    # Default logging: printed on stdout, after the Trainer's own train summary.
    assert default.stdout.count("GNMR summary") == 1 and "GNMR summary" not in default.stderr
    assert default.stdout.index("train_runtime") < default.stdout.index("GNMR summary")
    # Logging configured to show INFO: logged there, and not printed a second time.
    assert info.stderr.count("GNMR summary") == 1 and "GNMR summary" not in info.stdout


def test_summary_and_trace_are_written(tiny_llama_dir, dataset, tmp_path):
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path)
    trainer.train()
    summary = json.loads((tmp_path / "gnmr_summary.json").read_text())
    header, steps = read_trace(tmp_path / "gnmr_trace.jsonl")
    assert summary["steps"] == len(steps) == 14
    assert summary["top_units"][0]["name"] == SPIKED
    active_unit_steps = sum(len(r["active"]) for r in steps)
    assert summary["recovery_fraction"] == pytest.approx(active_unit_steps / (14 * len(header["units"])))
    flips = sum(len(r["entered"]) + len(r["exited"]) for r in steps)
    assert summary["flips_per_1k_steps"] == pytest.approx(1000 * flips / 14)
    # Every unit is back on its low-cost path after training.
    assert not any(u.in_recovery for u in gnmr_of(trainer).units)


@pytest.mark.parametrize("restore_callback_states", [False, True])
def test_resume_from_checkpoint_gives_identical_decisions(tiny_llama_dir, dataset, tmp_path, restore_callback_states):
    full = tmp_path / "full"
    make_trainer(tiny_llama_dir, dataset, full, max_steps=10, spike_step=4, save_strategy="no").train()
    reference = steps_of(full)

    run = tmp_path / "run"
    make_trainer(tiny_llama_dir, dataset, run, max_steps=10, spike_step=4, save_strategy="steps", save_steps=5).train()
    exported = json.loads((run / "checkpoint-5" / "trainer_state.json").read_text())["stateful_callbacks"]
    assert exported["GNMRCallback"]["attributes"]["controller_state"]["step"] == 5
    assert steps_of(run) == reference
    # Drop everything after the checkpoint, as after a crash at step 7, then resume in a fresh Trainer.
    shutil.rmtree(run / "checkpoint-10")
    trainer = make_trainer(
        tiny_llama_dir,
        dataset,
        run,
        max_steps=10,
        spike_step=4,
        save_strategy="steps",
        save_steps=5,
        restore_callback_states_from_checkpoint=restore_callback_states,
    )
    trainer.train(resume_from_checkpoint=str(run / "checkpoint-5"))
    resumed = steps_of(run)
    assert [r["step"] for r in resumed] == list(range(1, 11))
    # The lock taken at step 4 spans the checkpoint; steps 6-10 must match the uninterrupted run.
    assert any(r["active"] for r in reference[4:])
    assert resumed[5:] == reference[5:]
    assert gnmr_of(trainer).summary.steps == 10


def test_gnmr_trainer_matches_callback_and_lists_it_first(tiny_llama_dir, dataset, tmp_path):
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path / "t", trainer_cls=GNMRTrainer)
    assert trainer.callback_handler.callbacks[0] is trainer.gnmr
    trainer.train()
    make_trainer(tiny_llama_dir, dataset, tmp_path / "c").train()
    assert steps_of(tmp_path / "t") == steps_of(tmp_path / "c")


def test_units_in_recovery_never_exceed_the_memory_budget(tiny_llama_dir, dataset, tmp_path):
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, gnmr=GNMRConfig(**{**CFG, "max_active": 1}))
    trainer.train()
    units = gnmr_of(trainer).units
    ledger = units[0].ledger
    biggest = max(u.recovery_bytes() for u in units)
    assert ledger.peak_bytes > 0
    assert ledger.peak_bytes <= 1 * biggest
    assert ledger.live_bytes == 0


def test_resuming_a_checkpoint_without_gnmr_state_warns_and_starts_fresh(tiny_llama_dir, dataset, tmp_path, caplog):
    make_trainer(
        tiny_llama_dir, dataset, tmp_path, gnmr=False, max_steps=4, save_strategy="steps", save_steps=4
    ).train()
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, max_steps=6, spike_step=0)
    with caplog.at_level("WARNING", logger="gnmr_hf"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert "no GNMR state was found" in caplog.text
    assert gnmr_of(trainer).controller.step == 2  # only the two steps it saw


def test_resuming_with_different_units_is_refused(tiny_llama_dir, dataset, tmp_path):
    make_trainer(
        tiny_llama_dir, dataset, tmp_path, max_steps=4, spike_step=0, save_strategy="steps", save_steps=4
    ).train()
    narrowed = GNMRConfig(**CFG, include=["q_proj"])
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, gnmr=narrowed, max_steps=6, spike_step=0)
    with pytest.raises(ValueError, match="made for different units"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    # The failed start left the model as it was: no forward wrapper is left on any unit's module.
    assert all("forward" not in u.module.__dict__ for u in gnmr_of(trainer).units)
