"""The setups users run, beyond the default one (DESIGN.md section 4): fp16 with a loss scaler, LoRA on some
modules, interrupted runs and retries, resume from another folder, torch.compile, adapters, evaluation logs.

Each test runs the real transformers Trainer on a real bitsandbytes INT8 + peft LoRA tiny LLaMA on the CPU.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from transformers import Trainer, TrainerCallback

from gnmr_hf import GNMRCallback, GNMRConfig, find_units
from gnmr_hf.experiments.demo import GradientSpikeCallback
from gnmr_hf.trace import read_trace

from trainer_utils import CFG, SPIKE_STEP, SPIKED, Recorder, gnmr_of, make_trainer, steps_of

# ------------------------------------------------------------------------------------------- fp16 loss scaling


class CPUGradScalerTrainer(Trainer):
    """The Trainer's own fp16 path (scaled backward, unscale before clipping, skipped steps) on a CPU.

    accelerate makes a `GradScaler` only for GPUs, so this puts a CPU one where accelerate keeps its scaler, before
    `accelerator.prepare` hands it to the optimizer wrapper, and marks the state fp16 so that
    `Accelerator.unscale_gradients` and autocast behave as on a GPU. A small `growth_interval` doubles the scale
    every few steps: read without unscaling, each doubling would look like a x2 spike on every unit at once.
    """

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        self.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
        self.accelerator.native_amp = True
        self.accelerator.state._mixed_precision = "fp16"

    def _clip_grad_norm(self, model):
        # Every unit's norm before the Trainer unscales and clips, divided by the scale in use.
        gnmr = gnmr_of(self)
        scale = self.accelerator.scaler.get_scale()
        norms = []
        for unit in gnmr.units:
            sq = sum(t.grad.float().square().sum() for t in unit.signal_tensors() if t.grad is not None)
            norms.append(float(torch.as_tensor(sq).sqrt()) / scale)
        self.unscaled.append(norms)
        self.scales.append(scale)
        return super()._clip_grad_norm(model)


@pytest.fixture
def fp16_state():
    from accelerate.state import AcceleratorState

    yield
    AcceleratorState()._mixed_precision = "no"  # the state is a process-wide singleton


def test_fp16_norms_are_unscaled_on_the_device(tiny_llama_dir, dataset, tmp_path, fp16_state):
    trainer = make_trainer(
        tiny_llama_dir, dataset, tmp_path, trainer_cls=CPUGradScalerTrainer, max_steps=10, max_grad_norm=1.0
    )
    trainer.unscaled, trainer.scales, observed = [], [], []

    class Grab(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            observed.append(gnmr_of(trainer).capture.pending[0].tolist())

    trainer.add_callback(Grab())
    trainer.train()
    assert len(set(trainer.scales)) >= 3  # the scale moved during the run ...
    # ... and GNMR saw the gradients as the optimizer applies them, whatever the scale.
    torch.testing.assert_close(torch.tensor(observed), torch.tensor(trainer.unscaled), rtol=1e-5, atol=0)
    assert gnmr_of(trainer).capture.scaler is trainer.accelerator.scaler


def test_fp16_a_step_the_scaler_skips_is_not_observed(tiny_llama_dir, dataset, tmp_path, fp16_state):
    # An inf gradient on one unit at step 5: the scaler skips that update and halves its scale.
    overflow = GradientSpikeCallback(SPIKED, 5, float("inf"))
    trainer = make_trainer(
        tiny_llama_dir,
        dataset,
        tmp_path,
        trainer_cls=CPUGradScalerTrainer,
        max_steps=8,
        spike_step=0,
        callbacks=[overflow],
    )
    trainer.unscaled, trainer.scales = [], []
    trainer.train()
    gnmr = gnmr_of(trainer)
    _, records = read_trace(tmp_path / "gnmr_trace.jsonl")
    assert [(r["type"], r["step"]) for r in records if r["type"] == "skip"] == [("skip", 5)]
    steps = [r for r in records if r["type"] == "step"]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 6, 7, 8] and [r["t"] for r in steps] == list(range(1, 8))
    # No history from the skipped step, and no decision change: nothing entered because of the inf.
    assert gnmr.controller.step == 7
    assert torch.equal(gnmr.controller.norm_count, torch.full((len(gnmr.units),), 7.0, dtype=torch.float64))
    assert all(not r["entered"] for r in steps)
    assert gnmr.summary.skipped_steps == 1
    assert trainer.scales[4] == trainer.scales[3] and trainer.scales[5] == trainer.scales[4] / 2


def test_fp16_from_accelerate_without_a_scaler_is_plain_precision(tiny_llama_dir, dataset, tmp_path, monkeypatch):
    # `accelerate launch --mixed_precision fp16` sets ACCELERATE_MIXED_PRECISION; on a CPU accelerate then runs
    # without a scaler (gradients are never scaled), so GNMR reads them as they are.
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp16")
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, max_steps=4, spike_step=0)
    assert trainer.args.mixed_precision == "fp16" and not trainer.args.fp16
    trainer.train()
    assert gnmr_of(trainer).capture.scaler is None and gnmr_of(trainer).controller.step == 4


# ------------------------------------------------------------------------------------- LoRA on some modules


def test_units_without_a_gradient_are_logged_by_signal_kind_and_warned_about_after_warmup(
    tiny_llama_dir, dataset, tmp_path, caplog
):
    # LoRA on q_proj/v_proj only: the other INT8 layers fall back to their output gradient, and layer 0's k_proj
    # never gets one (nothing before it requires grad).
    trainer = make_trainer(
        tiny_llama_dir, dataset, tmp_path, max_steps=8, spike_step=0, target_modules=["q_proj", "v_proj"]
    )
    with caplog.at_level(logging.INFO, logger="gnmr_hf"):
        trainer.train()
    gnmr = gnmr_of(trainer)
    assert "14 bnb_int8 units (signal: output_grad x10, lora x4" in caplog.text
    warnings = [r.getMessage() for r in caplog.records if "still have no score" in r.getMessage()]
    assert len(warnings) == 1  # once
    assert "model.layers.0.self_attn.k_proj" in warnings[0] and "enable_input_require_grads" in warnings[0]
    assert "model.layers.0.self_attn.q_proj" not in warnings[0]
    header, _ = read_trace(tmp_path / "gnmr_trace.jsonl")
    assert header["unit_kinds"]["signal"] == {"output_grad": 10, "lora": 4}
    assert gnmr.controller.step == 8


class OutputGradSpike(TrainerCallback):
    """Multiplies the gradient flowing into `module`'s output by `factor` during optimizer step `step`. Its hook is
    put on the module when it is made, before GNMR's meter, so the meter sees the multiplied gradient."""

    def __init__(self, module, step, factor=100.0):
        self.step, self.factor, self.armed = step, factor, False
        module.register_forward_hook(self._on_forward)

    def _on_forward(self, module, args, output):
        if output.requires_grad:
            output.register_hook(self._scale)

    def _scale(self, grad):
        return grad * self.factor if self.armed else grad

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = state.global_step + 1 == self.step


def test_output_grad_signal_works_on_a_peft_lora_model(tiny_llama_dir, dataset, tmp_path):
    # max_active=3: the spike on down_proj's output gradient reaches gate_proj and up_proj of the same layer whole
    # (their outputs flow only into down_proj), so all three are equally risky.
    trainer = make_trainer(
        tiny_llama_dir,
        dataset,
        tmp_path,
        max_steps=10,
        spike_step=0,
        gnmr=GNMRConfig(**{**CFG, "max_active": 3}, backend_options="signal=output_grad"),
    )
    spiked = trainer.model.get_submodule(f"base_model.model.{SPIKED}.base_layer")
    trainer.add_callback(OutputGradSpike(spiked, SPIKE_STEP))
    trainer.model.enable_input_require_grads()  # so that every layer's output gets a gradient
    trainer.train()
    gnmr = gnmr_of(trainer)
    assert {u.signal for u in gnmr.units} == {"output_grad"}
    steps = {r["step"]: r for r in steps_of(tmp_path)}
    assert all(steps[t]["n_scored"] == len(gnmr.units) for t in range(CFG["min_history"] + 1, 11))
    assert [u.name for u in gnmr.units].index(SPIKED) in steps[SPIKE_STEP]["entered"]


# ------------------------------------------------------------------------------ interrupted runs and retries


class Crash(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise KeyboardInterrupt  # what Ctrl-C raises; on_train_end never runs


def test_a_retry_after_an_interrupted_run_starts_from_a_clean_model(tiny_llama_dir, dataset, tmp_path, caplog):
    crash = Crash(SPIKE_STEP + 1)  # the spiked unit is in recovery then
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, max_steps=14, callbacks=[crash])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    gnmr = gnmr_of(trainer)
    first_units = list(gnmr.units)
    assert any(u.in_recovery for u in first_units)  # the interrupted run left the model modified
    crash.step = -1
    with caplog.at_level(logging.INFO, logger="gnmr_hf"):
        trainer.train()  # the same Trainer again: no "already belongs to another unit"
    assert all(u.closed and not u.in_recovery for u in first_units)
    assert len(steps_of(tmp_path)) == 14
    # The interrupted run's trace is kept, not overwritten, and the log says where.
    assert [r["step"] for r in read_trace(tmp_path / "gnmr_trace.1.jsonl")[1]] == list(range(1, SPIKE_STEP + 2))
    assert "the earlier gnmr_trace.jsonl was kept as" in caplog.text
    # After the retry ends, the model is exactly as it was found.
    assert all("forward" not in u.module.__dict__ for u in gnmr.units)


def test_a_second_train_call_keeps_the_first_trace_and_summary(tiny_llama_dir, dataset, tmp_path):
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, max_steps=4, spike_step=0)
    trainer.train()
    trainer.train()
    for name in ("gnmr_trace.jsonl", "gnmr_trace.1.jsonl"):
        assert len(read_trace(tmp_path / name)[1]) == 4
    assert json.loads((tmp_path / "gnmr_summary.1.json").read_text())["steps"] == 4


def test_a_new_callback_after_an_interrupted_run_closes_the_old_units(tiny_llama_dir, dataset, tmp_path):
    crash = Crash(3)
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path / "a", max_steps=6, spike_step=0, callbacks=[crash])
    with pytest.raises(KeyboardInterrupt):
        trainer.train()
    model, old = trainer.model, gnmr_of(trainer)
    # A new Trainer and callback on the same model (as after restore_callback_states_from_checkpoint).
    retry = Trainer(model=model, args=trainer.args, train_dataset=dataset, callbacks=[GNMRCallback(GNMRConfig(**CFG))])
    crash.step = -1
    retry.train()
    assert all(u.closed for u in old.units)


# ------------------------------------------------------------------------------------------------- resume


@pytest.mark.parametrize("restore_callback_states", [False, True])
def test_resume_from_a_checkpoint_in_another_folder_gives_identical_decisions(
    tiny_llama_dir, dataset, tmp_path, restore_callback_states
):
    full = tmp_path / "full"
    make_trainer(tiny_llama_dir, dataset, full, max_steps=10, spike_step=4).train()
    reference = steps_of(full)
    first = tmp_path / "A"
    make_trainer(
        tiny_llama_dir, dataset, first, max_steps=10, spike_step=4, save_strategy="steps", save_steps=5
    ).train()
    elsewhere = tmp_path / "B"
    trainer = make_trainer(
        tiny_llama_dir,
        dataset,
        elsewhere,
        max_steps=10,
        spike_step=4,
        restore_callback_states_from_checkpoint=restore_callback_states,
    )
    trainer.train(resume_from_checkpoint=str(first / "checkpoint-5"))
    assert trainer.args.resume_from_checkpoint is None  # train(resume_from_checkpoint=...) does not set it
    resumed = steps_of(elsewhere)
    assert [r["step"] for r in resumed] == list(range(6, 11))
    assert any(r["active"] for r in reference[5:])  # the lock taken at step 4 spans the checkpoint
    assert resumed == reference[5:]
    assert gnmr_of(trainer).summary.steps == 10


def test_resume_survives_a_trace_cut_off_mid_line(tiny_llama_dir, dataset, tmp_path, caplog):
    run = tmp_path / "run"
    make_trainer(tiny_llama_dir, dataset, run, max_steps=10, spike_step=4, save_strategy="steps", save_steps=5).train()
    reference = steps_of(run)
    shutil.rmtree(run / "checkpoint-10")
    trace = run / "gnmr_trace.jsonl"
    lines = trace.read_text().splitlines(keepends=True)
    trace.write_text("".join(lines[:8]) + lines[8][: len(lines[8]) // 2])  # killed while writing step 8
    trainer = make_trainer(tiny_llama_dir, dataset, run, max_steps=10, spike_step=4)
    with caplog.at_level(logging.WARNING, logger="gnmr_hf"):
        trainer.train(resume_from_checkpoint=str(run / "checkpoint-5"))
    assert "dropped its last line" in caplog.text
    assert steps_of(run) == reference


# -------------------------------------------------------------------------------------------- torch.compile


def test_flips_under_torch_compile_never_recompile_and_match_eager(tiny_llama_dir):
    from torch._dynamo.utils import counters

    from gnmr_hf.experiments.tiny import load_int8_lora

    torch._dynamo.reset()
    model = load_int8_lora(tiny_llama_dir)
    units = find_units(model, "bnb_int8", backend_options="source=dequantize")
    compiled = torch.compile(model)
    x = torch.randint(0, 256, (2, 16))

    def step():
        out = compiled(input_ids=x, labels=x)
        out.loss.backward()
        return out.logits.detach()

    step()
    step()  # the second step compiles what the first one's gradients change (an optimizer-free loop here)
    units[0].enter_recovery()  # the first flip, of one unit
    step()
    units[0].exit_recovery()
    step()
    graphs = counters["stats"]["unique_graphs"]
    g = torch.Generator().manual_seed(0)
    flips = torch.zeros(len(units), dtype=torch.int64)
    while flips.min() < 20:  # every step flips a random half of the units: 20+ flips of each, in many combinations
        chosen = torch.randperm(len(units), generator=g)[: len(units) // 2]
        for i in chosen.tolist():
            units[i].exit_recovery() if units[i].in_recovery else units[i].enter_recovery()
        flips[chosen] += 1
        step()
    assert counters["stats"]["unique_graphs"] == graphs  # no recompilation
    in_recovery = [u.name for u in units if u.in_recovery]
    assert in_recovery  # the comparison below runs with a mix of paths
    torch.testing.assert_close(step(), model(input_ids=x, labels=x).logits.detach(), rtol=1e-5, atol=1e-5)
    for unit in units:
        unit.close()


def test_unit_names_do_not_depend_on_wrappers(tiny_llama_dir):
    from gnmr_hf.experiments.tiny import load_int8_lora

    model = load_int8_lora(tiny_llama_dir)
    units = find_units(model, "bnb_int8", backend_options="source=dequantize")
    names = [u.name for u in units]
    for unit in units:
        unit.close()

    class Wrapper(torch.nn.Module):  # what DDP and DataParallel look like to named_modules(): a `module` child
        def __init__(self, module):
            super().__init__()
            self.module = module

    for wrapped in (torch.compile(model), Wrapper(model)):
        units = find_units(wrapped, "bnb_int8", backend_options="source=dequantize")
        assert [u.name for u in units] == names
        for unit in units:
            unit.close()
    from gnmr_hf.units import display_name

    assert display_name("module._orig_mod.base_model.model.model.layers.0.mlp.up_proj.base_layer") == (
        "model.layers.0.mlp.up_proj"
    )
    assert display_name("_fsdp_wrapped_module.model.layers.1._checkpoint_wrapped_module.mlp.up_proj") == (
        "model.layers.1.mlp.up_proj"
    )


# --------------------------------------------------------------------------------------------------- adapters


def test_changing_the_active_adapter_during_training_is_refused(tiny_llama_dir, dataset, tmp_path):
    from peft import LoraConfig

    class SwitchAdapter(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.global_step == 3:
                model.set_adapter("other")

    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, max_steps=6, spike_step=0, callbacks=[SwitchAdapter()])
    trainer.model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))
    with pytest.raises(ValueError, match=r"active adapters changed from \['default'\] to \['other'\]"):
        trainer.train()
    assert all(u.closed for u in gnmr_of(trainer).units)


def test_several_active_adapters_are_all_in_the_signal(tiny_llama_dir):
    from peft import LoraConfig

    from gnmr_hf.experiments.tiny import load_int8_lora

    model = load_int8_lora(tiny_llama_dir)
    model.add_adapter("other", LoraConfig(r=2, target_modules=["q_proj"]))
    model.base_model.set_adapter(["default", "other"])
    unit = find_units(model, "bnb_int8", include="layers.0.self_attn.q_proj", backend_options="source=dequantize")[0]
    tuner = unit.tuner
    expected = [tuner.lora_A[a].weight for a in ("default", "other")] + [
        tuner.lora_B[a].weight for a in ("default", "other")
    ]
    assert {id(t) for t in unit.signal_tensors()} == {id(t) for t in expected}
    unit.close()


# ------------------------------------------------------------------------------------------- small behaviours


def test_evaluation_logs_get_no_gnmr_metrics(tiny_llama_dir, dataset, tmp_path):
    rec = Recorder()
    trainer = make_trainer(
        tiny_llama_dir,
        dataset,
        tmp_path,
        max_steps=6,
        spike_step=0,
        callbacks=[rec],
        logging_steps=3,
        eval_strategy="steps",
        eval_steps=2,
        per_device_eval_batch_size=4,
        eval_dataset=dataset.select(range(8)),
    )
    trainer.train()
    evals = [logs for logs in rec.logs if "eval_loss" in logs]
    trains = [logs for logs in rec.logs if "loss" in logs]
    assert len(evals) == 3 and len(trains) == 2
    assert not any(k.startswith("gnmr/") for logs in evals for k in logs)
    assert all("gnmr/active" in logs for logs in trains)


def test_a_model_without_int8_layers_gets_an_error_that_says_how_to_load_one(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir)
    known = r"Known backends: \['act_quant', 'block_fp', 'bnb_int8'"
    with pytest.raises(ValueError, match=r"BitsAndBytesConfig\(load_in_8bit=True\).*" + known):
        find_units(model, "bnb_int8")


def test_two_gnmr_callbacks_in_one_trainer_are_refused(tiny_llama_dir, dataset, tmp_path):
    trainer = make_trainer(tiny_llama_dir, dataset, tmp_path, max_steps=2, spike_step=0)
    trainer.add_callback(GNMRCallback(GNMRConfig(**CFG)))
    with pytest.raises(ValueError, match="more than one GNMRCallback"):
        trainer.train()


def test_bnb_impact_measures_under_torch_compile_as_in_eager_without_recompiling(tiny_llama_dir):
    # Whether a measure is due reads the optimizer step outside compiled code, so the units' turns never recompile,
    # and compiled and eager runs measure the same units the same amounts.
    from torch._dynamo.utils import counters

    from gnmr_hf.experiments.tiny import load_int8_lora
    from gnmr_hf.impact import impacts

    torch._dynamo.reset()
    x = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    runs, step = [], [0]
    for compile_it in (False, True):
        model = load_int8_lora(tiny_llama_dir)
        units = find_units(model, "bnb_int8", backend_options="source=checkpoint")  # INT8 weights vs exact
        for i, unit in enumerate(units):
            unit.impact.start(0, clock=lambda: step[0], every=2, phase=i)
        run = torch.compile(model) if compile_it else model
        measured = []
        for step[0] in range(6):
            run(input_ids=x, labels=x).loss.backward()
            if compile_it and step[0] == 2:
                graphs = counters["stats"]["unique_graphs"]
            measured.append(impacts([u.impact.take() for u in units], torch.device("cpu")))
        runs.append(torch.stack(measured))
        for unit in units:
            unit.close()
    assert counters["stats"]["unique_graphs"] == graphs  # the turns and the measures recompile nothing
    eager, compiled = runs
    assert bool((~eager.isnan()).any(dim=1).all())  # every step measures some units, in turns
    assert bool((eager.nan_to_num() > 0).any())  # the INT8 weights' error, not zeros
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-9, equal_nan=True)
