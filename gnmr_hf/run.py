"""`GNMRRun`: one `train()` of GNMR over a set of units, what `GNMRCallback` starts at train begin and delegates to.

    run = GNMRRun(config, units, model, args, state, optimizer)   # at train begin, after find_units
    decision = run.step(state.global_step + 1, optimizer)          # at every optimizer step
    run.report(args.output_dir); run.close()                       # at train end

The run owns what lives for one training run: the units' signals (`gnmr_hf.signals`), the step capture that reads
the norms once per optimizer step (`gnmr_hf.capture`), the controller and its policy, the JSONL trace and its
summary, and the metrics since the last log. Starting it does, in order: signals, policy (a policy that does not
resume refuses a resumed run), the units' fidelity and impact meters when the policy reads them, controller,
restored state, capture, the restored recovery set, the start line in the log, and the trace. A failure on the way
closes what was built, so the model is left as it was found and a corrected retry works.

The callback keeps the Trainer's events, which unit discovery and the checkpoint state (`ExportableState`) belong
to, as transformers' `EarlyStoppingCallback` keeps only its events; the run imports nothing of transformers, so
the same run could be driven by another training loop's events.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
import weakref
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
from torch import nn
from tqdm import tqdm

from .capture import StepCapture, data_parallel_group
from .config import GNMRConfig
from .controller import GNMRController, HostDecision
from .impact import QuietTurns
from .integrations.deepspeed import DeepSpeedZero
from .policy import make_policy
from .signals import UnitSignals
from .trace import TraceSummary, TraceWriter, set_aside
from .units import RecoverableUnit, apply_decision

__all__ = ["RUN_ATTR", "GNMRRun", "own_lines"]

logger = logging.getLogger("gnmr_hf")

SUMMARY_FILE = "gnmr_summary.json"
_METRICS = ("active", "entered", "exited", "candidates", "exceedance_rate", "max_risk", "skipped")
# On the model while a run manages its units: (the run, weakly; the Trainer's state it runs in). A second
# GNMRCallback in the same Trainer run (the same state object) is refused; a run left by an interrupted train() is
# cleaned up.
RUN_ATTR = "_gnmr_run"


class GNMRRun:
    """GNMR over `units` of `model` for one training run: signals, step capture, controller, trace.

    Args:
        config: the run's `GNMRConfig`.
        units: the units found on `model` (`find_units`), in controller order.
        model: the unwrapped model.
        args / state: the Trainer's `TrainingArguments` and `TrainerState` (read: `output_dir`, `global_step`,
            `is_world_process_zero`; the meters' clock reads `state.global_step` at every step).
        optimizer: the Trainer's optimizer (fp16's loss scaler and skipped steps are found through it).
        zero: the DeepSpeed ZeRO reader when the Trainer runs under DeepSpeed, else None.
        restored: the exported attributes of a checkpoint to resume from (`GNMRCallback.state()["attributes"]`),
            or None.
        marks: fields to write on given steps' trace records, under "marks" (`GNMRCallback.mark_step`).
    """

    def __init__(
        self,
        config: GNMRConfig,
        units: Sequence[RecoverableUnit],
        model: nn.Module,
        args: Any,
        state: Any,
        optimizer: Any,
        *,
        zero: DeepSpeedZero | None = None,
        restored: Mapping[str, Any] | None = None,
        marks: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> None:
        self.config = config
        self.marks = marks if marks is not None else {}
        self.units = units
        self.model = model
        self.signals: UnitSignals | None = None
        self.capture: StepCapture | None = None
        self.controller: GNMRController | None = None
        self.summary: TraceSummary | None = None
        self._trace: TraceWriter | None = None
        self._warmup_check_step = 0
        self._window: dict[str, float] = {}
        self._window_steps = 0
        model.__dict__[RUN_ATTR] = (weakref.ref(self), state)
        try:
            self._start(args, state, optimizer, zero, restored)
        except BaseException:
            # Leave the model as it was found (no forward wrappers, hooks or recovery weights), so that a corrected
            # retry on the same model works.
            self.close()
            raise

    def _start(
        self, args: Any, state: Any, optimizer: Any, zero: DeepSpeedZero | None, restored: Mapping[str, Any] | None
    ) -> None:
        cfg = self.config
        names = [u.name for u in self.units]
        self.signals = UnitSignals(self.units, dp_group=data_parallel_group(), model=self.model)
        policy = make_policy(cfg)
        if not policy.resumes and state.global_step > 0:
            raise ValueError(f"GNMRCallback: policy {policy.name!r} does not resume; start the run anew")
        if policy.measures:
            # The policy reads what each unit's cheap path loses: the units measure it from now on.
            rows, every = policy.fidelity_schedule()
            for unit in self.units:
                unit.meter.start(rows, clock=lambda: state.global_step, recovery_every=every)
        self.controller = GNMRController(
            cfg,
            len(self.units),
            self.signals.device,
            policy=policy,
            names=names,
            kinds=[u.kind for u in self.units],
        )
        schedule = policy.impact_schedule()
        if schedule is not None:
            # After the controller binds the policy, which then holds the quiet units' mask (`impact_quiet`).
            self._start_impact(schedule, policy.impact_quiet(), state)
        self.summary = TraceSummary(unit_names=names)
        self._restore(state, names, restored)
        self._warmup_check_step = self.controller.step if self.controller.step >= cfg.min_history + cfg.window else 0
        self.capture = StepCapture(self.signals, self.model, optimizer, zero, self.units)
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

    def _start_impact(self, schedule: tuple[int, int], quiet: tuple[int, np.ndarray] | None, state: Any) -> None:
        """Start every unit's impact meter: `rows` rows per measure, the units taking turns over `every` steps in
        controller order (so that each step measures N / every of them); with `quiet` (quiet_every, the policy's
        mask), a unit the mask marks takes its turns over `quiet_every` steps instead, at phase i % quiet_every
        (the same units share a step as in the usual rotation, and quiet ones spread over the slower one)."""
        rows, every = schedule
        slow, mask = quiet if quiet is not None else (every, None)
        for i, unit in enumerate(self.units):
            turns = None if mask is None else QuietTurns(mask, i, slow)
            unit.impact.start(rows, clock=lambda: state.global_step, every=every, phase=i % slow, quiet=turns)
        silent = sorted({u.kind for u in self.units if not u.measures_impact})
        if silent:
            logger.warning(
                "GNMR: policy %r ranks units by what their cheap path costs the loss, but the %s units of kind %s "
                "do not measure it; the paper's rule stands in for them (a risky GNMR score)",
                self.config.policy,
                self.config.backend,
                ", ".join(silent),
            )

    def _restore(self, state: Any, names: list[str], attributes: Mapping[str, Any] | None) -> None:
        """Restore the controller, the summary and the units' meters from a checkpoint's exported `attributes`;
        without them (or at step 0), start fresh, warning when the Trainer resumes a later step."""
        assert self.controller is not None and self.summary is not None
        saved = (attributes or {}).get("controller_state")
        if saved is None or (saved.get("step", 0) == 0 and state.global_step == 0):
            if state.global_step > 0:
                logger.warning(
                    "GNMR: resuming at step %d but no GNMR state was found in the checkpoint; the controller "
                    "starts fresh and re-warms its history",
                    state.global_step,
                )
            return
        assert attributes is not None
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

    # ------------------------------------------------------------------ per step
    def step(self, step: int, optimizer: Any) -> HostDecision | None:
        """Optimizer step `step` (1-based) is being taken: decide from its norms, flip units (exits first) for the
        next step, trace and count the decision; returns it, or None when fp16's loss scaler skipped the step."""
        assert self.controller is not None and self.summary is not None
        assert self.capture is not None and self.signals is not None
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
            return None
        if not cfg.monitor_only:
            apply_decision(self.units, decision.exited, decision.entered)
        for i in decision.extras.get("impact", {}).get("measure", ()):
            # A symptom: its family measures its impact at the next step, whatever its turn.
            self.units[i].impact.measure_at(step)
        self.summary.add(decision.active, decision.entered, decision.exited, decision.risky, decision.left_out)
        self._accumulate(decision)
        if self._trace is not None:
            self._trace.write(decision, step=step, marks=self.marks.get(step))
        if check_history:
            self._warmup_check_step = decision.step
            with own_lines():
                self._warn_unscored(decision)
        return decision

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

    def pop_metrics(self) -> dict[str, float] | None:
        """The gnmr/* metrics since the last call (current active/candidates, summed flips, mean exceedance, max
        risk), or None when no step was decided since (a skipped step waits for the next decided one)."""
        w, steps = self._window, self._window_steps
        if not steps:
            return None
        metrics = {f"gnmr/{k}": w[k] for k in _METRICS if k in w}
        metrics["gnmr/exceedance_rate"] = w.get("exceedance_rate", 0.0) / steps
        self._window, self._window_steps = {}, 0
        return metrics

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

    # ------------------------------------------------------------------ checkpoints and the end
    def exported(self) -> dict[str, Any]:
        """What a checkpoint keeps of the run (the callback's exported attributes); the trace is flushed first, so
        that every step the checkpoint covers is on disk before the checkpoint exists."""
        self.flush()
        return {
            "controller_state": self.controller.json_state() if self.controller is not None else None,
            "summary_state": self.summary.state() if self.summary is not None else None,
            "unit_names": [u.name for u in self.units] or None,
            "unit_fidelity_state": self._meter_states(),
        }

    def _meter_states(self) -> dict[str, Any] | None:
        """Per unit name, what its measuring carries across steps (`RecoverableUnit.meter_state`); None: none (a unit
        that does not measure, as under the paper's policy, carries nothing). Stored as `unit_fidelity_state`: the
        state of the fidelity measuring, under the key checkpoints have always had."""
        states = {u.name: s for u in self.units if (s := u.meter_state()) is not None}
        return states or None

    def flush(self) -> None:
        if self._trace is not None:
            self._trace.flush()

    def report(self, output_dir: str) -> None:
        """At the end of training (on the main process): show the summary, warn when the budget was full, and write
        the summary to `output_dir`."""
        assert self.summary is not None
        with own_lines():
            _show(self.summary.format())
            self._warn_budget(output_dir)
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, SUMMARY_FILE), "w") as f:
            json.dump(self.summary.as_dict(), f, indent=2)

    def _warn_budget(self, output_dir: str) -> None:
        """Say so when the budget kept units off the recovery path that asked for it persistently (broken units
        under the cause policy, units risky step after step under the paper's): the run was not protected there."""
        assert self.summary is not None
        left = self.summary.left_out(persistent=True)
        if not left:
            return
        trace = os.path.join(output_dir, self.config.trace_file) if self.config.trace_file else "<trace>"
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

    def close(self) -> None:
        """Remove hooks, return every unit to its low-cost path, close the trace and unmark the model. Idempotent."""
        if self.capture is not None:
            self.capture.remove()  # kept, unhooked: what it read (`scaler`, `pending`) stays readable after the run
        for unit in self.units:
            unit.close()
        if self._trace is not None:
            self._trace.close()
            self._trace = None
        run = self.model.__dict__.get(RUN_ATTR)
        if run is not None and run[0]() is self:
            del self.model.__dict__[RUN_ATTR]


@contextlib.contextmanager
def own_lines() -> Iterator[None]:
    """Around what GNMR prints or logs while the Trainer's progress bar is drawn: the bar (tqdm, on stderr) keeps the
    cursor at the end of its line, and a terminal shows stdout and stderr together, so a summary or a warning written
    then would go on that line (`8/8 [01:00<00:00, 7.45s/it]GNMR summary`). tqdm's own remedy: clear the bars,
    write, draw them again below. Without a bar on the screen, nothing changes."""
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


def _unit_kinds(units: Sequence[RecoverableUnit]) -> dict[str, dict[str, int]]:
    """{key: {value: count}} over what each unit's `describe()` reports (its signal kind, its source, ...)."""
    kinds: dict[str, Counter[str]] = {}
    for unit in units:
        for key, value in unit.describe().items():
            kinds.setdefault(key, Counter())[str(value)] += 1
    return {key: dict(counts.most_common()) for key, counts in kinds.items()}
