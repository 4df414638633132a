"""`GNMRCallback`: GNMR in the transformers Trainer, as one callback. Glue only; the logic is the controller's.

    trainer.add_callback(GNMRCallback(GNMRConfig(max_active=4, lock_steps=8)))

Per optimizer step: the units' norms are read once, at the end of the outermost backward pass of the last
micro-batch (after accumulation and DDP/FSDP reductions, before the Trainer clips; fp16 norms unscaled on the
device, a skipped step never observed: `gnmr_hf.capture`); `on_optimizer_step` lets the controller decide, fetches
the decision in the step's one device-to-host transfer and flips units (exits first) for the next step; metrics go
into the Trainer's training logs, decisions into a JSONL trace, the controller state into every checkpoint. Why
each of these happens where it does: docs/method.md, "The signal" and "Resume".
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch import nn
from tqdm import tqdm
from transformers import TrainerCallback
from transformers.trainer_callback import ExportableState

from .capture import StepCapture, data_parallel_group
from .config import GNMRConfig
from .controller import GNMRController, HostDecision
from .integrations.deepspeed import DeepSpeedZero
from .options import BackendOptions
from .policy import make_policy
from .registry import find_units, get_backend
from .signals import UnitSignals
from .trace import TraceSummary, TraceWriter, set_aside
from .units import Backend, RecoverableUnit, apply_decision, close_units, unwrap_model

__all__ = ["GNMRCallback"]

logger = logging.getLogger("gnmr_hf")

SUMMARY_FILE = "gnmr_summary.json"
_METRICS = ("active", "entered", "exited", "candidates", "exceedance_rate", "max_risk", "skipped")
# On the model: (this callback, weakly; the Trainer's state of the run) while a run manages its units. A second
# GNMRCallback of the same run (the same state object) is refused; one left by an interrupted run is cleaned up.
_RUN_ATTR = "_gnmr_run"


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
        self.signals: UnitSignals | None = None
        self.controller: GNMRController | None = None
        self.summary: TraceSummary | None = None
        self.last_decision: HostDecision | None = None
        # Set by the Trainer when it rebuilds this callback from a checkpoint (`ExportableState`).
        self.controller_state: dict[str, Any] | None = None
        self.summary_state: dict[str, Any] | None = None
        self.unit_names: list[str] | None = None
        self.unit_fidelity_state: dict[str, Any] | None = None
        self.capture: StepCapture | None = None  # reads the norms once per optimizer step (`gnmr_hf.capture`)
        self._trace: TraceWriter | None = None
        self._model: nn.Module | None = None
        self._zero: DeepSpeedZero | None = None
        self._warmup_check_step = 0
        self._window: dict[str, float] = {}
        self._window_steps = 0

    # ------------------------------------------------------------------ ExportableState
    def state(self) -> dict[str, Any]:
        # The Trainer calls this while writing a checkpoint: flush the trace first, so that every step the
        # checkpoint covers is on disk before the checkpoint exists.
        if self._trace is not None:
            self._trace.flush()
        return {
            "args": {"config": self.config.to_dict(), "ahead_of_reporting": self.ahead_of_reporting},
            "attributes": {
                "controller_state": self.controller.json_state() if self.controller is not None else None,
                "summary_state": self.summary.state() if self.summary is not None else None,
                "unit_names": [u.name for u in self.units] or None,
                "unit_fidelity_state": self._meter_states(),
            },
        }

    def _meter_states(self) -> dict[str, Any] | None:
        """Per unit name, what its measuring carries across steps (`RecoverableUnit.meter_state`); None: none (a unit
        that does not measure, as under the paper's policy, carries nothing). Stored as `unit_fidelity_state`: the
        state of the fidelity measuring, under the key checkpoints have always had."""
        states = {u.name: s for u in self.units if (s := u.meter_state()) is not None}
        return states or None

    # ------------------------------------------------------------------ events
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if model is None:
            raise ValueError("GNMRCallback.on_train_begin: the Trainer passed no model")
        self._zero = DeepSpeedZero.from_trainer(args, optimizer, self.config.backend)
        model = unwrap_model(model)
        run = model.__dict__.get(_RUN_ATTR)
        owner, owner_state = (run[0](), run[1]) if run is not None else (None, None)
        if owner is not None and owner is not self and owner_state is state:
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
        model.__dict__[_RUN_ATTR] = (weakref.ref(self), state)
        cfg = self.config
        self._model = model
        backend, options = _backend_and_options(cfg)
        self.units = find_units(
            model,
            backend,
            include=cfg.include,
            exclude=cfg.exclude,
            module_filter_fn=self.module_filter_fn,
            backend_options=options,
        )
        try:
            with _own_lines():
                self._start(args, state, optimizer)
        except BaseException:
            # Leave the model as it was found (no forward wrappers, hooks or recovery weights), so that a
            # corrected retry on the same model works.
            self.close()
            raise

    def _start(self, args: Any, state: Any, optimizer: Any) -> None:
        """Everything after unit discovery: signals, controller, restored state, hooks, recovery set, trace."""
        cfg = self.config
        names = [u.name for u in self.units]
        self.signals = UnitSignals(self.units, dp_group=data_parallel_group(), model=self._model)
        policy = make_policy(cfg)
        if not policy.resumes and state.global_step > 0:
            raise ValueError(f"GNMRCallback: policy {policy.name!r} does not resume; start the run anew")
        if policy.measures:
            # The policy reads what each unit's cheap path loses: the units measure it from now on.
            rows, every = policy.fidelity_schedule()
            for unit in self.units:
                unit.meter.start(rows, clock=lambda: state.global_step, recovery_every=every)
        schedule = policy.impact_schedule()
        if schedule is not None:
            self._start_impact(schedule, state)
        self.controller = GNMRController(
            cfg,
            len(self.units),
            self.signals.device,
            policy=policy,
            names=names,
            kinds=[u.kind for u in self.units],
        )
        self.summary = TraceSummary(unit_names=names)
        self._restore(state, names)
        if getattr(args, "report_to", None) and not self.ahead_of_reporting:
            # Trainer.log() builds each log's dict itself and hands it to the callbacks in list order, and the
            # Trainer puts the reporting integrations ahead of every callback it is given (callbacks= as well as
            # add_callback). No event hands a callback the Trainer or its callback list, so it cannot move itself
            # ahead; GNMRTrainer, which owns the list, can. Hence the fix the warning names.
            logger.warning(
                "GNMR: the reporting integrations %s log before this callback adds the gnmr/* metrics (the Trainer "
                "puts them ahead of the callbacks it is given, by add_callback or callbacks=), so they never get "
                "those metrics; state.log_history does (the console too with callbacks=, not with add_callback, which "
                "appends after the console printer). To have them everywhere, build the trainer as "
                "GNMRTrainer(model=..., args=..., train_dataset=..., gnmr_config=GNMRConfig(...)) (from gnmr_hf "
                "import GNMRTrainer) in place of Trainer(...) and add_callback(GNMRCallback(...)).",
                list(args.report_to),
            )
        self._warmup_check_step = self.controller.step if self.controller.step >= cfg.min_history + cfg.window else 0
        assert self._model is not None
        self.capture = StepCapture(self.signals, self._model, optimizer, self._zero, self.units)
        if not cfg.monitor_only:
            for i in self.controller.active.nonzero().flatten().tolist():
                self.units[i].enter_recovery()
        kinds = _unit_kinds(self.units)
        logger.info(
            "GNMR: %d %s units (%s), max_active=%d, lock_steps=%d, %s%s",
            len(self.units),
            cfg.backend,
            "; ".join(f"{key}: " + ", ".join(f"{v} x{n}" for v, n in counts.items()) for key, counts in kinds.items()),
            cfg.max_active,
            cfg.lock_steps,
            "monitor only" if cfg.monitor_only else "active",
            ", fp16 loss scaling: norms unscaled on the device, skipped steps not observed"
            if self.capture.scaler
            else "",
        )
        if cfg.trace_file and state.is_world_process_zero:
            path = os.path.join(args.output_dir, cfg.trace_file)
            if state.global_step == 0:
                for name in (cfg.trace_file, SUMMARY_FILE):
                    moved = set_aside(os.path.join(args.output_dir, name))
                    if moved is not None:
                        logger.warning("GNMR: a new run starts at step 0; the earlier %s was kept as %s", name, moved)
            header = {
                "units": names,
                "recovery_bytes": [u.recovery_bytes() for u in self.units],
                "backend": cfg.backend,
                "unit_kinds": kinds,
                "config": cfg.to_dict(),
                "paths": [u.precision() for u in self.units],
            }
            header |= policy.describe()
            if policy.measures:
                header["fidelity_bounds"] = {u.kind: u.fidelity_bound for u in self.units}
            self._trace = TraceWriter(path, header, resume_step=state.global_step)

    def _start_impact(self, schedule: tuple[int, int], state: Any) -> None:
        """Start every unit's impact meter: `rows` rows per measure, the units taking turns over `every` steps in
        controller order (so that each step measures N / every of them)."""
        rows, every = schedule
        for i, unit in enumerate(self.units):
            unit.impact.start(rows, clock=lambda: state.global_step, every=every, phase=i % every)
        silent = sorted({u.kind for u in self.units if not u.measures_impact})
        if silent:
            logger.warning(
                "GNMR: policy %r ranks units by what their cheap path costs the loss, but the %s units of kind %s "
                "do not measure it; the paper's rule stands in for them (a risky GNMR score)",
                self.config.policy,
                self.config.backend,
                ", ".join(silent),
            )

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        assert self.controller is not None and self.summary is not None
        assert self.capture is not None and self.signals is not None
        step = state.global_step + 1  # the optimizer step being taken (global_step counts it after on_step_end)
        norms, missing, cheap_loss = self.capture.take(self.controller.num_units, self.controller.device)
        try:
            self.signals.check()
        except ValueError:
            self.close()
            raise
        cfg = self.config
        check_history = self._warmup_check_step == 0 and self.controller.step + 1 >= cfg.min_history + cfg.window
        skipped = self.capture.skipped(optimizer)
        decision = self.controller.observe(norms, missing, cheap_loss, self.capture.take_impact()).to_host(
            top_k=cfg.trace_top_k, history=check_history, flag=skipped
        )
        if decision.flag:
            # The fp16 loss scaler found inf/NaN gradients and skipped the update: the step changed nothing, so
            # the controller must not have seen it (a loss-scale overflow is not a unit's failure).
            self.controller.revert()
            self.summary.skipped_steps += 1
            self._window["skipped"] = self._window.get("skipped", 0.0) + 1
            if self._trace is not None:
                self._trace.write_skip(step, "fp16 loss scaler skipped the step (inf/NaN gradients)")
            return
        if not cfg.monitor_only:
            apply_decision(self.units, decision.exited, decision.entered)
        for i in decision.extras.get("impact", {}).get("measure", ()):
            # A symptom: its family measures its impact at the next step, whatever its turn.
            self.units[i].impact.measure_at(step)
        self.last_decision = decision
        self.summary.add(decision.active, decision.entered, decision.exited, decision.risky, decision.left_out)
        self._accumulate(decision)
        if self._trace is not None:
            self._trace.write(decision, step=step)
        if check_history:
            self._warmup_check_step = decision.step
            with _own_lines():
                self._warn_unscored(decision)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._trace is not None:
            self._trace.flush()
        # Only the Trainer's training logs (they carry "loss") get GNMR metrics: an evaluation log in between
        # would otherwise take the metrics of the steps since the last training log.
        if logs is None or "loss" not in logs or not self._window_steps:
            return
        metrics = self._pop_metrics()
        logs.update(metrics)
        # Trainer.log() appended its copy to log_history before calling us; keep the two in step.
        if state.log_history and state.log_history[-1].get("step") == state.global_step:
            state.log_history[-1].update(metrics)

    def on_save(self, args, state, control, **kwargs):
        if self._trace is not None:
            self._trace.flush()

    def on_train_end(self, args, state, control, **kwargs):
        if self.summary is not None and state.is_world_process_zero:
            with _own_lines():
                _show(self.summary.format())
                self._warn_budget(args)
            os.makedirs(args.output_dir, exist_ok=True)
            with open(os.path.join(args.output_dir, SUMMARY_FILE), "w") as f:
                json.dump(self.summary.as_dict(), f, indent=2)
        self.close()

    # ------------------------------------------------------------------ internals
    def close(self) -> None:
        """Remove hooks, return every unit to its low-cost path and close the trace."""
        if self.capture is not None:
            self.capture.remove()  # kept, unhooked: what it read (`scaler`, `pending`) stays readable after the run
        for unit in self.units:
            unit.close()
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        if self._model is not None:
            run = self._model.__dict__.get(_RUN_ATTR)
            if run is not None and run[0]() is self:
                del self._model.__dict__[_RUN_ATTR]

    def _restore(self, state: Any, names: list[str]) -> None:
        """Restore the controller from the state the Trainer rebuilt this callback with, or else from the
        checkpoint's `trainer_state.json` (`state.stateful_callbacks`), which the Trainer loads on every resume."""
        assert self.controller is not None and self.summary is not None
        attributes: dict[str, Any] | None = None
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
        saved = (attributes or {}).get("controller_state")
        if saved is None or (saved.get("step", 0) == 0 and state.global_step == 0):
            if state.global_step > 0:
                logger.warning(
                    "GNMR: resuming at step %d but no GNMR state was found in the checkpoint; the controller "
                    "starts fresh and re-warms its history",
                    state.global_step,
                )
            return
        saved_names = attributes.get("unit_names")
        if saved_names is not None and list(saved_names) != names:
            raise ValueError(
                "GNMRCallback: the checkpoint's GNMR state was made for different units "
                f"({len(saved_names)} saved, {len(names)} found now); resume with the same model, backend and "
                "include/exclude/module_filter_fn"
            )
        self.controller.load_state_dict(saved)
        if attributes.get("summary_state") is not None:
            self.summary.load_state(attributes["summary_state"])
        units = {u.name: u for u in self.units}
        for name, unit_state in (attributes.get("unit_fidelity_state") or {}).items():
            if name not in units:
                raise ValueError(
                    f"GNMRCallback: the checkpoint's unit_fidelity_state names a unit {name!r} that is not among "
                    f"the {len(units)} units found now; resume with the same model, backend and "
                    "include/exclude/module_filter_fn"
                )
            units[name].load_meter_state(unit_state)
        logger.info("GNMR: restored the controller state of optimizer step %d", state.global_step)

    def _warn_budget(self, args: Any) -> None:
        """Say so when the budget kept units off the recovery path that asked for it persistently (broken units
        under the cause policy, units risky step after step under the paper's): the run was not protected there."""
        assert self.summary is not None
        left = self.summary.left_out(persistent=True)
        if not left:
            return
        trace = os.path.join(args.output_dir, self.config.trace_file) if self.config.trace_file else "<trace>"
        logger.warning(
            "GNMR: the budget was full: %d units asked for recovery and were left out at least half of the steps "
            "from the first time on: %s. max_active=%d would have held every unit that asked (it is %d). `gnmr-hf "
            "advise %s` turns the run into a static carve-out of the units it needed.",
            len(left),
            ", ".join(f"{n} ({c} steps)" for n, c in left[:10])
            + (f" and {len(left) - 10} more" if len(left) > 10 else ""),
            self.summary.max_candidates_seen,
            self.config.max_active,
            trace,
        )

    def _warn_unscored(self, decision: HostDecision) -> None:
        missing = decision.no_history
        if missing is None or not len(missing):
            return
        names = [self.units[i].name for i in missing]
        shown = ", ".join(names[:10]) + (f" and {len(names) - 10} more" if len(names) > 10 else "")
        kinds = Counter(self.units[i].signal for i in missing)
        logger.warning(
            "GNMR: after %d steps, %d of %d units still have no score (fewer than min_history=%d gradients, or only "
            "zero gradients), so GNMR cannot protect them: %s (signal kinds: %s). A unit scored on its output "
            "gradient gets none where nothing before it requires grad: call model.enable_input_require_grads() "
            "(peft's prepare_model_for_kbit_training does), or put LoRA on these modules, or exclude them "
            "(GNMRConfig.exclude).",
            decision.step,
            len(names),
            len(self.units),
            self.config.min_history,
            shown,
            dict(kinds),
        )

    def _accumulate(self, decision: HostDecision) -> None:
        w = self._window
        self._window_steps += 1
        w["active"] = float(len(decision.active))
        w["entered"] = w.get("entered", 0.0) + len(decision.entered)
        w["exited"] = w.get("exited", 0.0) + len(decision.exited)
        w["candidates"] = float(decision.n_candidates)
        w["exceedance_rate"] = w.get("exceedance_rate", 0.0) + decision.exceedance_rate
        if not np.isnan(decision.max_risk):
            w["max_risk"] = max(w.get("max_risk", 0.0), decision.max_risk)

    def _pop_metrics(self) -> dict[str, float]:
        """Metrics since the last log: current active/candidates, summed flips, mean exceedance, max risk."""
        w, steps = self._window, self._window_steps
        metrics = {f"gnmr/{k}": w[k] for k in _METRICS if k in w}
        metrics["gnmr/exceedance_rate"] = w.get("exceedance_rate", 0.0) / steps
        self._window, self._window_steps = {}, 0
        return metrics


@contextlib.contextmanager
def _own_lines() -> Iterator[None]:
    """Around what the callback prints or logs while the Trainer's progress bar is drawn: the bar (tqdm, on stderr)
    keeps the cursor at the end of its line, and a terminal shows stdout and stderr together, so a summary or a
    warning written then would go on that line (`8/8 [01:00<00:00, 7.45s/it]GNMR summary`). tqdm's own remedy: clear
    the bars, write, draw them again below. Without a bar on the screen, nothing changes."""
    with tqdm.external_write_mode(file=sys.stdout):
        yield


def _show(text: str) -> None:
    """End-of-run output the user must see: logged at INFO where the user's logging shows that (a handler and a level
    that let it through: no second copy), else printed to stdout, as the Trainer's own train summary is (its
    printer and progress callbacks `print` the final metrics on the main process whatever logging is set up). A
    script with default logging would otherwise show nothing of GNMR."""
    if logger.isEnabledFor(logging.INFO) and logger.hasHandlers():
        logger.info("\n%s", text)
    else:
        print(text, flush=True)


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


def _unit_kinds(units: list[RecoverableUnit]) -> dict[str, dict[str, int]]:
    """{key: {value: count}} over what each unit's `describe()` reports (its signal kind, its source, ...)."""
    kinds: dict[str, Counter[str]] = {}
    for unit in units:
        for key, value in unit.describe().items():
            kinds.setdefault(key, Counter())[str(value)] += 1
    return {key: dict(counts.most_common()) for key, counts in kinds.items()}
