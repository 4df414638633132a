"""`GNMRCallback`: GNMR in the transformers Trainer, as one callback. Glue only; the logic is the controller's.

    trainer.add_callback(GNMRCallback(GNMRConfig(max_active=4, lock_steps=8)))

What it does, per optimizer step k (transformers 5 event order):

1. During the backward pass of the *last* micro-batch of the accumulation window it reads every unit's gradient
   norm. That is the only moment the gradients are final but not yet clipped: `on_pre_optimizer_step` runs after
   `Trainer._clip_grad_norm`, which rescales every unit at once and would hide a spike. A post-accumulate-grad
   hook on the units' signal tensors queues one end-of-backward callback (the autograd engine runs it after all
   gradients of that backward are accumulated); it computes the N norms in one fused pass, on the device, with
   no sync. The Trainer marks the last micro-batch through accelerate's `GradientState.sync_gradients`.
2. In `on_optimizer_step` (after `optimizer.step()`, before `zero_grad`) the controller scores those norms and
   decides; the decision is fetched with the single device-to-host transfer of the step, and units enter or
   leave recovery (exits first, so at most `max_active` recovery weights exist at any moment). The next
   forward, step k+1, runs with the new precision.
3. Metrics go into the Trainer's own logs (so TensorBoard, W&B and the console get them), every decision goes
   to a JSONL trace in `output_dir`, and the controller state goes into every checkpoint.

Logging detail: `Trainer.log()` hands the same `logs` dict to the callbacks in list order, and the reporting
integrations are callbacks added before ours. So at train begin this callback moves itself to the front of the
Trainer's callback list (it finds the list as the caller of `on_train_begin`); `GNMRTrainer` puts it there
directly.

Resume: the controller state is written to `checkpoint-*/gnmr_state.json` on every save, and also exported
through `ExportableState` (used only with `restore_callback_states_from_checkpoint=True`). At train begin with
`global_step > 0` the callback restores from the exported state if present, else from the checkpoint file, so
both ways give the same decisions as an uninterrupted run.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import CallbackHandler, ExportableState

from .config import GNMRConfig
from .controller import GNMRController, HostDecision
from .signals import UnitSignals
from .trace import TraceSummary, TraceWriter
from .units import RecoverableUnit, find_units

__all__ = ["GNMRCallback"]

logger = logging.getLogger("gnmr_hf")

STATE_FILE = "gnmr_state.json"
SUMMARY_FILE = "gnmr_summary.json"
_METRICS = ("active", "entered", "exited", "candidates", "exceedance_rate", "max_score")


class GNMRCallback(TrainerCallback, ExportableState):
    """Watches each recoverable unit's gradient norm and moves the riskiest to the recovery path.

    Args:
        config: a `GNMRConfig`, or a dict of its fields (as stored in a checkpoint).
        module_filter_fn: optional `fn(module, fqn) -> bool` narrowing the units (not saved in checkpoints;
            use `config.include` / `config.exclude` for runs that restore callback state).
        **config_kwargs: shorthand for `GNMRConfig` fields, e.g. `GNMRCallback(max_active=2)`.
    """

    def __init__(
        self,
        config: GNMRConfig | dict[str, Any] | None = None,
        *,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        **config_kwargs: Any,
    ) -> None:
        if isinstance(config, dict):
            config = GNMRConfig.from_dict({**config, **config_kwargs})
        elif config is None:
            config = GNMRConfig.from_dict(config_kwargs)
        elif not isinstance(config, GNMRConfig):
            raise TypeError(f"GNMRCallback: config must be a GNMRConfig or a dict, got {type(config).__name__}")
        elif config_kwargs:
            raise TypeError(
                f"GNMRCallback: pass either a GNMRConfig or keyword fields, not both (got {sorted(config_kwargs)})"
            )
        self.config = config
        self.module_filter_fn = module_filter_fn
        self.units: list[RecoverableUnit] = []
        self.controller: GNMRController | None = None
        self.signals: UnitSignals | None = None
        self.summary: TraceSummary | None = None
        self.last_decision: HostDecision | None = None
        # Set by ExportableState restore (Trainer._load_callback_state) before on_train_begin.
        self.controller_state: dict[str, Any] | None = None
        self.summary_state: dict[str, Any] | None = None
        self.unit_names: list[str] | None = None
        self._pending: tuple[torch.Tensor, torch.Tensor] | None = None
        self._queued = False
        self._hooks: list[Any] = []
        self._trace: TraceWriter | None = None
        self._gradient_state: Any = None
        self._window: dict[str, float] = {}
        self._window_steps = 0

    # ------------------------------------------------------------------ ExportableState
    def state(self) -> dict[str, Any]:
        return {
            "args": {"config": self.config.to_dict()},
            "attributes": {
                "controller_state": self.controller.json_state() if self.controller is not None else None,
                "summary_state": self.summary.state() if self.summary is not None else None,
                "unit_names": [u.name for u in self.units] or None,
            },
        }

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            raise ValueError("GNMRCallback.on_train_begin: the Trainer passed no model")
        if getattr(args, "fp16", False):
            raise ValueError(
                "GNMRCallback: fp16 mixed precision is not supported (TrainingArguments.fp16=True). Its loss "
                "scaler rescales every gradient by a factor that changes over time, which GNMR would read as "
                "spikes; use bf16=True or full precision."
            )
        self._move_to_front(inspect.currentframe())
        cfg = self.config
        self.units = find_units(
            model,
            cfg.backend,
            include=cfg.include,
            exclude=cfg.exclude,
            module_filter_fn=self.module_filter_fn,
            source=cfg.recovery_source,
            signal=cfg.signal,
        )
        try:
            self._start(args, state)
        except BaseException:
            # Leave the model as it was found (no forward wrappers, hooks or recovery weights), so that a
            # corrected retry on the same model works.
            self.close()
            raise
        logger.info(
            "GNMR: %d %s units, max_active=%d, lock_steps=%d, %s",
            len(self.units),
            cfg.backend,
            cfg.max_active,
            cfg.lock_steps,
            "monitor only" if cfg.monitor_only else "active",
        )

    def _start(self, args: Any, state: Any) -> None:
        """Everything after unit discovery: signals, controller, restored state, hooks, recovery set, trace."""
        cfg = self.config
        names = [u.name for u in self.units]
        self.signals = UnitSignals(self.units)
        self.controller = GNMRController(cfg, len(self.units), device=self.signals.device)
        self.summary = TraceSummary(unit_names=names)
        self._restore(args, state, names)
        self._gradient_state = _gradient_state()
        self._install_capture_hooks()
        if not cfg.monitor_only:
            for i in self.controller.active.nonzero().flatten().tolist():
                self.units[i].enter_recovery()
        if cfg.trace_file and state.is_world_process_zero:
            header = {
                "units": names,
                "recovery_bytes": [u.recovery_bytes() for u in self.units],
                "sources": sorted({str(getattr(u, "source", "")) for u in self.units} - {""}),
                "config": cfg.to_dict(),
            }
            self._trace = TraceWriter(
                os.path.join(args.output_dir, cfg.trace_file), header, resume_step=state.global_step
            )

    def on_optimizer_step(self, args, state, control, **kwargs):
        assert self.controller is not None and self.signals is not None and self.summary is not None
        pending, self._pending = self._pending, None
        self._queued = False
        if pending is None:
            # No backward reached a signal tensor this step (e.g. every unit unused): all units are missing.
            device = self.controller.device
            n = self.controller.num_units
            pending = (
                torch.full((n,), torch.nan, device=device),
                torch.ones(n, dtype=torch.bool, device=device),
            )
        decision = self.controller.observe(*pending).to_host(top_k=self.config.trace_top_k)
        if not self.config.monitor_only:
            # Exits before entries: the number of live recovery weights never exceeds max_active.
            for i in decision.exited:
                self.units[i].exit_recovery()
            for i in decision.entered:
                self.units[i].enter_recovery()
        self.last_decision = decision
        self.summary.add(decision.active, decision.entered, decision.exited, decision.risky)
        self._accumulate(decision)
        if self._trace is not None:
            self._trace.write(decision)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._trace is not None:
            self._trace.flush()
        if logs is None or not self._window_steps:
            return
        metrics = self._pop_metrics()
        logs.update(metrics)
        # Trainer.log() appended its copy to log_history before calling us; keep the two in step.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_save(self, args, state, control, **kwargs):
        if self.controller is None or not state.is_world_process_zero:
            return
        if self._trace is not None:
            self._trace.flush()
        checkpoint = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        if not os.path.isdir(checkpoint):
            logger.warning("GNMR: checkpoint folder %s not found; controller state not saved there", checkpoint)
            return
        payload = {
            "controller": self.controller.json_state(),
            "summary": self.summary.state() if self.summary is not None else None,
            "unit_names": [u.name for u in self.units],
            "config": self.config.to_dict(),
        }
        tmp = os.path.join(checkpoint, STATE_FILE + ".tmp")
        with open(tmp, "w") as f:
            json.dump(payload, f)
        os.replace(tmp, os.path.join(checkpoint, STATE_FILE))  # atomic: a crash never leaves half a state

    def on_train_end(self, args, state, control, **kwargs):
        if self.summary is not None and state.is_world_process_zero:
            text = self.summary.format()
            logger.info("\n%s", text)
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, SUMMARY_FILE), "w") as f:
                json.dump(self.summary.as_dict(), f, indent=2)
        self.close()

    # ------------------------------------------------------------------ internals
    def close(self) -> None:
        """Remove hooks, return every unit to its low-cost path and close the trace."""
        for handle in self._hooks:
            handle.remove()
        self._hooks = []
        for unit in self.units:
            unit.close()
        if self._trace is not None:
            self._trace.close()
            self._trace = None

    def _move_to_front(self, frame: Any) -> None:
        # Trainer.log() passes one `logs` dict to the callbacks in list order; the reporting integrations
        # (TensorBoard, W&B, ...) are usually ahead of a callback added with `add_callback`, so our metrics
        # must be added first. The handler calling us owns that list.
        handler = frame.f_back.f_locals.get("self") if frame is not None and frame.f_back else None
        if isinstance(handler, CallbackHandler) and self in handler.callbacks:
            handler.callbacks.remove(self)
            handler.callbacks.insert(0, self)
        else:
            logger.warning(
                "GNMR: could not find the Trainer's callback list; GNMR metrics will reach state.log_history "
                "but maybe not reporting integrations listed before this callback"
            )

    def _restore(self, args: Any, state: Any, names: list[str]) -> None:
        assert self.controller is not None and self.summary is not None
        payload: dict[str, Any] | None = None
        if self.controller_state is not None and self.controller_state.get("step") == state.global_step:
            payload = {
                "controller": self.controller_state,
                "summary": self.summary_state,
                "unit_names": self.unit_names,
            }
        elif state.global_step > 0:
            for folder in (
                os.path.join(args.output_dir, f"checkpoint-{state.global_step}"),
                getattr(args, "resume_from_checkpoint", None),
            ):
                path = os.path.join(folder, STATE_FILE) if isinstance(folder, str) else None
                if path is not None and os.path.isfile(path):
                    with open(path) as f:
                        payload = json.load(f)
                    break
        self.controller_state = self.summary_state = self.unit_names = None
        if payload is None:
            if state.global_step > 0:
                logger.warning(
                    "GNMR: resuming at step %d but no GNMR state was found (neither restored callback state nor "
                    "%s in the checkpoint); the controller starts fresh and re-warms its history",
                    state.global_step,
                    STATE_FILE,
                )
            return
        saved_names = payload.get("unit_names")
        if saved_names is not None and list(saved_names) != names:
            raise ValueError(
                "GNMRCallback: the checkpoint's GNMR state was made for different units "
                f"({len(saved_names)} saved, {len(names)} found now); resume with the same model, backend and "
                "include/exclude/module_filter_fn"
            )
        self.controller.load_state_dict(payload["controller"])
        if payload.get("summary") is not None:
            self.summary.load_state(payload["summary"])
        logger.info("GNMR: restored controller state at step %d", self.controller.step)

    def _install_capture_hooks(self) -> None:
        assert self.signals is not None
        triggers = list(self.signals.tensors)
        if not triggers:
            # Units scored by output-gradient meters only: any trainable parameter marks the backward.
            triggers = [p for u in self.units for p in u.module.parameters() if p.requires_grad]
            if not triggers:
                raise ValueError(
                    "GNMRCallback: the units have no trainable parameters and no LoRA parameters, so there is "
                    "no backward pass to read gradients from"
                )
        self._hooks = [t.register_post_accumulate_grad_hook(self._on_grad_accumulated) for t in triggers]

    def _on_grad_accumulated(self, tensor: torch.Tensor) -> None:
        if self._queued or not self._gradient_state.sync_gradients:
            return
        self._queued = True
        # The engine runs queued callbacks after every gradient of this backward pass is accumulated, in
        # queue order, including callbacks queued while they run. Queueing from inside one puts our read
        # after any end-of-backward callback queued during the pass (DDP's reducer queues its gradient
        # averaging there once the last bucket is ready) and still before any clipping.
        engine = torch.autograd.Variable._execution_engine
        engine.queue_callback(lambda: engine.queue_callback(self._capture))

    def _capture(self) -> None:
        assert self.signals is not None
        self._pending = self.signals.compute()

    def _accumulate(self, decision: HostDecision) -> None:
        w = self._window
        self._window_steps += 1
        w["active"] = float(len(decision.active))
        w["entered"] = w.get("entered", 0.0) + len(decision.entered)
        w["exited"] = w.get("exited", 0.0) + len(decision.exited)
        w["candidates"] = float(decision.n_candidates)
        w["exceedance_rate"] = w.get("exceedance_rate", 0.0) + decision.exceedance_rate
        if not np.isnan(decision.max_score):
            w["max_score"] = max(w.get("max_score", 0.0), decision.max_score)

    def _pop_metrics(self) -> dict[str, float]:
        """Metrics since the last log: current active/candidates, summed flips, mean exceedance, max score."""
        w, steps = self._window, self._window_steps
        metrics = {f"gnmr/{k}": w[k] for k in _METRICS if k in w}
        metrics["gnmr/exceedance_rate"] = w.get("exceedance_rate", 0.0) / steps
        self._window, self._window_steps = {}, 0
        return metrics


def _gradient_state() -> Any:
    # accelerate's GradientState is a process-wide singleton; the Trainer sets `sync_gradients` before each
    # micro-batch (True on the last one of the accumulation window). Without accelerate state, every backward
    # counts as final.
    from accelerate.state import GradientState

    return GradientState()
