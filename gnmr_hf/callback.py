"""`GNMRCallback`: GNMR in the transformers Trainer, as one callback. Glue only: the run is `gnmr_hf.run.GNMRRun`,
the logic the controller's.

    trainer.add_callback(GNMRCallback(GNMRConfig(max_active=4, lock_steps=8)))

Per optimizer step: the units' norms are read once, at the end of the outermost backward pass of the last
micro-batch (after accumulation and DDP/FSDP reductions, before the Trainer clips; fp16 norms unscaled on the
device, a skipped step never observed: `gnmr_hf.capture`); `on_optimizer_step` lets the controller decide, fetches
the decision in the step's one device-to-host transfer and flips units (exits first) for the next step; metrics go
into the Trainer's training logs, decisions into a JSONL trace, the controller state into every checkpoint. Why
each of these happens where it does: docs/method.md, "The signal" and "Resume".

The callback keeps what is the Trainer's: its events, finding the units on the model it hands over, and the state a
checkpoint keeps (`ExportableState`, and where to read it back from on resume). Everything a run owns (signals, step
capture, controller, trace) is its `GNMRRun`, started at train begin, as `EarlyStoppingCallback` keeps only its
events.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import nn
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .capture import StepCapture
from .config import GNMRConfig
from .controller import GNMRController, HostDecision
from .integrations.deepspeed import DeepSpeedZero
from .options import BackendOptions
from .policy import make_policy
from .registry import find_units, get_backend
from .run import RUN_ATTR, GNMRRun, own_lines
from .signals import UnitSignals
from .trace import TraceSummary
from .units import Backend, RecoverableUnit, close_units, unwrap_model

__all__ = ["GNMRCallback"]

logger = logging.getLogger("gnmr_hf")


class GNMRCallback(TrainerCallback, ExportableState):
    """Watches each recoverable unit's gradient norm and moves the riskiest to the recovery path.

    Args:
        config: a `GNMRConfig`, or a dict of its fields (as stored in a checkpoint).
        module_filter_fn: optional `fn(module, fqn) -> bool` narrowing the units (not saved in checkpoints;
            use `config.include` / `config.exclude` for runs that restore callback state).
        ahead_of_reporting: the caller put this callback ahead of the Trainer's reporting integrations (TensorBoard,
            W&B, ...), so they get the gnmr/* metrics it adds to each log; `GNMRTrainer` does. When False and
            `report_to` names any, train begin warns that they miss those metrics.
        **config_kwargs: shorthand for `GNMRConfig` fields, e.g. `GNMRCallback(max_active=2)`.
    """

    def __init__(
        self,
        config: GNMRConfig | dict[str, Any] | None = None,
        *,
        module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        ahead_of_reporting: bool = False,
        **config_kwargs: Any,
    ) -> None:
        if isinstance(config, dict):
            config = GNMRConfig.from_dict({**config, **config_kwargs})
        elif config is None:
            config = GNMRConfig(**config_kwargs)
        elif config_kwargs:
            raise TypeError("GNMRCallback: pass either a GNMRConfig or keyword fields, not both")
        if not isinstance(config, GNMRConfig):
            raise TypeError(f"GNMRCallback: config must be a GNMRConfig or a dict, got {type(config).__name__}")
        if not isinstance(ahead_of_reporting, bool):
            raise TypeError(f"GNMRCallback: ahead_of_reporting must be True or False, got {ahead_of_reporting!r}")
        # The config is a leaf that imports no backend or policy, so it takes any name; check both and their options
        # here, when the user builds the callback (or GNMRTrainer), not at train begin after the model is prepared.
        _backend_and_options(config)
        make_policy(config)
        self.config = config
        self.module_filter_fn = module_filter_fn
        self.ahead_of_reporting = ahead_of_reporting
        self.units: Sequence[RecoverableUnit] = []
        # The run of the latest train(); kept after it ends, so that what it did stays readable.
        self.run: GNMRRun | None = None
        self.last_decision: HostDecision | None = None
        # Set by the Trainer when it rebuilds this callback from a checkpoint (`ExportableState`).
        self.controller_state: dict[str, Any] | None = None
        self.summary_state: dict[str, Any] | None = None
        self.unit_names: list[str] | None = None
        self.unit_fidelity_state: dict[str, Any] | None = None
        self.step_marks: dict[int, dict[str, Any]] = {}

    def mark_step(self, step: int, **fields: Any) -> None:
        """Write `fields` on optimizer step `step`'s trace record, under "marks": what the caller knows about that
        step and GNMR does not, e.g. which data it trained on. `step` is 1-based, as `state.global_step` counts the
        step once taken; marks given for the same step merge; the values must be JSON values. Call it before the
        step is taken (before `train()` for a schedule known in advance)."""
        if isinstance(step, bool) or not isinstance(step, int) or step < 1:
            raise ValueError(f"GNMRCallback.mark_step: step must be an int >= 1 (an optimizer step), got {step!r}")
        if not fields:
            raise ValueError("GNMRCallback.mark_step: give at least one field, e.g. mark_step(20, data='repeat')")
        try:
            json.dumps(fields)
        except TypeError as err:
            raise ValueError(f"GNMRCallback.mark_step: the fields must be JSON values: {err}") from None
        self.step_marks.setdefault(step, {}).update(fields)

    # What the run owns, readable from the callback (None before the first train begin).
    @property
    def signals(self) -> UnitSignals | None:
        return self.run.signals if self.run is not None else None

    @property
    def capture(self) -> StepCapture | None:
        """Reads the norms once per optimizer step (`gnmr_hf.capture`)."""
        return self.run.capture if self.run is not None else None

    @property
    def controller(self) -> GNMRController | None:
        return self.run.controller if self.run is not None else None

    @property
    def summary(self) -> TraceSummary | None:
        return self.run.summary if self.run is not None else None

    # ------------------------------------------------------------------ ExportableState
    def state(self) -> dict[str, Any]:
        # The Trainer calls this while writing a checkpoint; the run flushes its trace first.
        empty = dict.fromkeys(("controller_state", "summary_state", "unit_names", "unit_fidelity_state"))
        return {
            "args": {"config": self.config.to_dict(), "ahead_of_reporting": self.ahead_of_reporting},
            "attributes": self.run.exported() if self.run is not None else empty,
        }

    def _restored(self, state: Any) -> dict[str, Any] | None:
        """The exported attributes to resume from: those the Trainer rebuilt this callback with, or else the
        checkpoint's `trainer_state.json` (`state.stateful_callbacks`), which the Trainer loads on every resume.
        Taken once: the next train() starts from its own checkpoint."""
        attributes: dict[str, Any] | None
        if self.controller_state is not None:
            attributes = {
                "controller_state": self.controller_state,
                "summary_state": self.summary_state,
                "unit_names": self.unit_names,
                "unit_fidelity_state": self.unit_fidelity_state,
            }
        else:
            attributes = _exported_attributes(getattr(state, "stateful_callbacks", None))
        self.controller_state = self.summary_state = self.unit_names = self.unit_fidelity_state = None
        return attributes

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            raise ValueError("GNMRCallback.on_train_begin: the Trainer passed no model")
        zero = DeepSpeedZero.from_trainer(args, optimizer, self.config.backend)
        model = unwrap_model(model)
        marked = model.__dict__.get(RUN_ATTR)
        other, other_state = (marked[0](), marked[1]) if marked is not None else (None, None)
        if other is not None and other is not self.run and other_state is state:
            raise ValueError(
                "GNMRCallback: the Trainer has more than one GNMRCallback; one callback manages all units "
                "(narrow them with include/exclude/module_filter_fn instead)"
            )
        # Start from a clean model: a run interrupted by an exception or Ctrl-C skipped on_train_end and left its
        # units live (forward wrappers, hooks, recovery weights), this callback's or a callback the Trainer has
        # since replaced (restore_callback_states_from_checkpoint).
        self.close()
        closed = close_units(model)
        if closed:
            logger.info("GNMR: closed %d units left live on the model by an earlier, interrupted train()", closed)
        self.run = None
        backend, options = _backend_and_options(self.config)
        self.units = find_units(
            model,
            backend,
            include=self.config.include,
            exclude=self.config.exclude,
            module_filter_fn=self.module_filter_fn,
            backend_options=options,
        )
        with own_lines():
            # A run that fails to start closes what it built: the model is left as it was found.
            self.run = GNMRRun(
                self.config,
                self.units,
                model,
                args,
                state,
                optimizer,
                zero=zero,
                restored=self._restored(state),
                marks=self.step_marks,
            )
            self._warn_reporting(args)

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        assert self.run is not None
        # The optimizer step being taken: global_step counts it only after on_step_end.
        decision = self.run.step(state.global_step + 1, optimizer)
        if decision is not None:  # None: fp16's loss scaler skipped the step
            self.last_decision = decision

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self.run is None:
            return
        self.run.flush()
        # Only the Trainer's training logs (they carry "loss") get GNMR metrics: an evaluation log in between
        # would otherwise take the metrics of the steps since the last training log.
        if logs is None or "loss" not in logs:
            return
        metrics = self.run.pop_metrics()
        if metrics is None:
            return
        logs.update(metrics)
        # Trainer.log() appended its copy to log_history before calling us; keep the two in step.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_save(self, args, state, control, **kwargs):
        if self.run is not None:
            self.run.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.run is not None and state.is_world_process_zero:
            self.run.report(args.output_dir)
        self.close()

    # ------------------------------------------------------------------ internals
    def close(self) -> None:
        """Remove hooks, return every unit to its low-cost path and close the trace."""
        if self.run is not None:
            self.run.close()

    def _warn_reporting(self, args: Any) -> None:
        if not getattr(args, "report_to", None) or self.ahead_of_reporting:
            return
        # Trainer.log() builds each log's dict itself and hands it to the callbacks in list order, and the Trainer
        # puts the reporting integrations ahead of every callback it is given (callbacks= as well as add_callback).
        # No event hands a callback the Trainer or its callback list, so it cannot move itself ahead; GNMRTrainer,
        # which owns the list, can. Hence the fix the warning names.
        logger.warning(
            "GNMR: the reporting integrations %s log before this callback adds the gnmr/* metrics (the Trainer "
            "puts them ahead of the callbacks it is given, by add_callback or callbacks=), so they never get "
            "those metrics; state.log_history does (the console too with callbacks=, not with add_callback, which "
            "appends after the console printer). To have them everywhere, build the trainer as "
            "GNMRTrainer(model=..., args=..., train_dataset=..., gnmr_config=GNMRConfig(...)) (from gnmr_hf "
            "import GNMRTrainer) in place of Trainer(...) and add_callback(GNMRCallback(...)).",
            list(args.report_to),
        )


def _backend_and_options(config: GNMRConfig) -> tuple[Backend, BackendOptions]:
    """`config.backend`'s `Backend` and its parsed `config.backend_options`; errors name the field and what is
    allowed (the known backends, the backend's options). Again at train begin: the config may have changed since."""
    try:
        backend = get_backend(config.backend)
    except ValueError as err:
        raise ValueError(f"GNMRConfig.backend: {err}") from None
    try:
        return backend, backend.parse_options(config.backend_options)
    except (TypeError, ValueError) as err:
        raise type(err)(f"GNMRConfig.backend_options: {err}") from None


def _exported_attributes(stateful: Any) -> dict[str, Any] | None:
    """This callback's exported attributes in a loaded `TrainerState.stateful_callbacks`, if any."""
    if not isinstance(stateful, Mapping):
        return None
    entry = stateful.get(GNMRCallback.__name__)
    if isinstance(entry, list):  # the Trainer stores a list when several callbacks share a class
        entry = entry[0] if entry else None
    return entry.get("attributes") if isinstance(entry, Mapping) else None
