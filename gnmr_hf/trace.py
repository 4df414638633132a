"""The decision trace: one JSON line per optimizer step, and the summary computed from it.

The trace is the record of what GNMR did and why: which units ran in recovery, which entered and left, which
were risky, the riskiest risks and the thresholds. It is compact (indices, not masks: a quiet step of a 10k-unit
model is a few dozen bytes) and append-only. The first line is a header with the unit names and what the backend
reports about its units, so a trace can be read without the model. `step` is the Trainer's optimizer step (1-based,
`global_step` after it); `t` is the controller's own step count, which falls behind `step` only where the fp16
loss scaler skipped a step (written as a `"skip"` record: the controller never saw it).

Durability: lines are flushed once every `flush_seconds` at most, at every log, and before every checkpoint is
written (the callback flushes from its `state()`, which the Trainer calls while saving), so a checkpoint never
refers to a step whose line is still in a buffer. A flush per step would cost more than the decision itself on a
small model. A process killed hard loses at most the lines after the last flush, all after the last checkpoint,
which a resume from that checkpoint rewrites. A line cut in half by such a kill is dropped with a warning, by
the resume and by `gnmr-hf report` alike.

`TraceSummary` is fed either live (by the callback, from `HostDecision`s) or from a trace file (by
`gnmr-hf report`); both give the same numbers because both go through `TraceSummary.add`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .controller import HostDecision

__all__ = ["TraceSummary", "TraceWriter", "read_trace", "set_aside", "trace_path"]

logger = logging.getLogger("gnmr_hf")

TRACE_VERSION = 2
# The trace's name in a run's folder (`GNMRConfig.trace_file`'s default): what `gnmr-hf report RUN_FOLDER` reads.
TRACE_FILE = "gnmr_trace.jsonl"
# Version 1 (gnmr-hf 0.1.0) named two fields after what they were not: they hold a count of scored units and a risk.
_V1_NAMES = {"n_eligible": "n_scored", "max_score": "max_risk"}
# The cause policy's traced losses were `cause.severity` before the loss of a cheap path got one name; a resumed run
# appends today's name to a file that has the old one, so a record is read by the name it holds.
_OLD_CAUSE_NAMES = {"severity": "cheap_loss"}
# One compact encoder for every line: `json.dumps(..., separators=...)` would build a new encoder per step.
_ENCODER = json.JSONEncoder(separators=(",", ":"))


def decision_record(
    decision: HostDecision, step: int | None = None, marks: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON-safe trace line for one step (`step`: the Trainer's optimizer step; default the controller's), with
    the caller's `marks` on it (`GNMRCallback.mark_step`), where given."""
    record = {
        "type": "step",
        "step": decision.step if step is None else step,
        "t": decision.step,
        "active": decision.active.tolist(),
        "entered": decision.entered.tolist(),
        "exited": decision.exited.tolist(),
        "risky": decision.risky.tolist(),
        "n_scored": decision.n_scored,
        "n_candidates": decision.n_candidates,
        "max_risk": None if math.isnan(decision.max_risk) else _json_float(decision.max_risk),
        "top": [
            [i, _json_float(s)] for i, s in zip(decision.top_units.tolist(), decision.top_risks.tolist(), strict=True)
        ],
        "alpha": decision.alpha,
        "beta": decision.beta,
        "left_out": decision.left_out.tolist(),
    } | decision.extras
    if marks:
        record["marks"] = dict(marks)
    return record


def _json_float(x: float) -> float | str:
    # Strict JSON has no infinity; a non-finite gradient gives risk +inf, written as the string "inf".
    return x if x != math.inf else "inf"


class TraceWriter:
    """Appends decision records to a JSONL file; resuming truncates what came after the resumed step.

    A fresh run (`resume_step == 0`) starts a new file; the caller decides what happens to an old one (the
    callback sets it aside with `set_aside`, so nothing is overwritten silently).
    """

    def __init__(
        self, path: str | os.PathLike[str], header: dict[str, Any], resume_step: int = 0, flush_seconds: float = 1.0
    ) -> None:
        self.path = Path(path)
        self.flush_seconds = flush_seconds
        self.path.parent.mkdir(parents=True, exist_ok=True)
        kept: list[str] = []
        if resume_step > 0 and self.path.exists():
            # Keep the header and steps <= resume_step: the resumed run rewrites what followed.
            kept = [
                line
                for record, line in _records(self.path)
                if record.get("type") == "header" or record.get("step", 0) <= resume_step
            ]
        self._file = self.path.open("w")
        if kept:
            self._file.writelines(kept)
        else:
            self._write({"type": "header", "version": TRACE_VERSION, **header})
        self.flush()

    def _write(self, record: dict[str, Any]) -> None:
        self._file.write(_ENCODER.encode(record) + "\n")

    def write(self, decision: HostDecision, step: int | None = None, marks: Mapping[str, Any] | None = None) -> None:
        """Write one step's decision (`step`: the Trainer's optimizer step; default the controller's) and the
        caller's `marks` on it."""
        self._write(decision_record(decision, step, marks))
        self._maybe_flush()

    def write_skip(self, step: int, reason: str) -> None:
        """Record an optimizer step the controller did not observe (the fp16 loss scaler skipped it)."""
        self._write({"type": "skip", "step": step, "reason": reason})
        self._maybe_flush()

    def _maybe_flush(self) -> None:
        if time.monotonic() - self._flushed_at >= self.flush_seconds:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._flushed_at = time.monotonic()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


def _records(path: Path) -> Iterator[tuple[dict[str, Any], str]]:
    """(record, line) for each line of a trace, newline-terminated. A last line that is not valid JSON is what a
    process killed mid-write leaves: it is dropped with a warning. Any other bad line is an error."""
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(
            f"read_trace: {path} is not a text file, so not a gnmr-hf trace (JSON lines): {err}"
        ) from None
    lines = text.splitlines(keepends=True)
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            if lineno == len(lines):
                logger.warning(
                    "GNMR trace %s: dropped its last line, cut off mid-write (%d characters): %s", path, len(line), err
                )
                return
            if _is_one_json_document(text):
                raise ValueError(
                    f"read_trace: {path} is one JSON document (gnmr_summary.json?), not a gnmr-hf trace: a trace "
                    "has one JSON object per line, starting with a header (gnmr_trace.jsonl)"
                ) from None
            raise ValueError(f"read_trace: {path}:{lineno} is not JSON: {err}") from None
        if not isinstance(record, dict):
            raise ValueError(f"read_trace: {path}:{lineno} is not a JSON object")
        yield record, line if line.endswith("\n") else line + "\n"


def _is_one_json_document(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def trace_path(path: str | os.PathLike[str]) -> Path:
    """`path`, or where `path` is a run's folder (a Trainer's output_dir), the trace in it (`TRACE_FILE`)."""
    path = Path(path)
    if not path.is_dir():
        return path
    if (path / TRACE_FILE).is_file():
        return path / TRACE_FILE
    others = sorted(p.name for p in path.glob("*.jsonl"))
    raise FileNotFoundError(
        f"read_trace: the folder {path} has no {TRACE_FILE}"
        + (f"; pass one of its traces: {', '.join(others)}" if others else " (nor any other .jsonl file)")
    )


def read_trace(path: str | os.PathLike[str]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Return (header, records) of a trace file, or of a run folder's trace: the records are the "step" and "skip"
    lines, in order.

    A trace of gnmr-hf 0.1.0 (version 1) is read with its fields renamed to today's, and so is a cause-policy step
    written as `cause.severity` (now `cause.cheap_loss`). Errors are clear: no file, no header, a corrupt line (other
    than a cut-off last line, which is dropped with a warning).
    """
    path = trace_path(path)
    if not path.is_file():
        raise FileNotFoundError(f"read_trace: no trace file at {path}")
    header: dict[str, Any] | None = None
    records: list[dict[str, Any]] = []
    for lineno, (record, _) in enumerate(_records(path), 1):
        kind = record.get("type")
        if kind == "header":
            header = record
        elif kind in ("step", "skip"):
            if header is not None and header.get("version") == 1:
                record = {_V1_NAMES.get(k, k): v for k, v in record.items()}
            cause = record.get("cause")
            if isinstance(cause, dict) and not _OLD_CAUSE_NAMES.keys().isdisjoint(cause):
                record["cause"] = {_OLD_CAUSE_NAMES.get(k, k): v for k, v in cause.items()}
            if not isinstance(record.get("step"), int):
                raise ValueError(f"read_trace: {path}: record {lineno} has no integer 'step'")
            records.append(record)
        else:
            raise ValueError(f"read_trace: {path}: record {lineno} has unknown record type {kind!r}")
    if header is None:
        raise ValueError(f"read_trace: {path} has no header line; is it a gnmr-hf trace?")
    _check_header(path, header)
    for record in records:
        _check_units(path, record, len(header["units"]))
    return header, records


def _check_header(path: Path, header: dict[str, Any]) -> None:
    """What every reader relies on: a version this code knows, and the unit names the records' indices refer to."""
    version = header.get("version", 1)
    if isinstance(version, bool) or not isinstance(version, int) or not 1 <= version <= TRACE_VERSION:
        raise ValueError(
            f"read_trace: {path}: the header's 'version' is {version!r}; this gnmr-hf reads traces of version 1 to "
            f"{TRACE_VERSION} (a newer gnmr-hf wrote it: upgrade to read it)"
        )
    units = header.get("units")
    if not isinstance(units, list) or not all(isinstance(n, str) for n in units):
        got = "none" if units is None else f"{type(units).__name__} {units!r}"[:80]
        raise ValueError(
            f"read_trace: {path}: the header's 'units' must be the list of unit names the records' indices refer to, "
            f"got {got}; is it a gnmr-hf trace?"
        )


def _check_units(path: Path, record: dict[str, Any], n: int) -> None:
    """Every unit index a step record holds is one of the header's `n` units, so that a reader can index by it. (Which
    fields a reader needs is the reader's to check: a tool may read traces written with a few fields only.)"""
    if record.get("type") != "step":
        return
    where = f"read_trace: {path}: step {record['step']}"
    indices = {key: record[key] for key in ("active", "entered", "exited", "risky", "left_out") if key in record}
    cause = record.get("cause") if isinstance(record.get("cause"), dict) else {}
    # Rows that start with a unit: `top` [unit, risk]; the cause policy's `why` [unit, reason, source unit or -1] and
    # `cheap_loss` [unit, loss].
    for key, rows in (("top", record.get("top", [])), *((k, cause[k]) for k in ("why", "cheap_loss") if k in cause)):
        if not isinstance(rows, list) or not all(isinstance(row, list) and row for row in rows):
            raise ValueError(f"{where} has no list {key!r} of [unit, ...] rows (got {str(rows)[:60]})")
        indices[key] = [row[0] for row in rows]
        if key == "why":
            indices["why (source)"] = [row[2] for row in rows if len(row) > 2 and row[2] != -1]
    for key, values in indices.items():
        if not isinstance(values, list):
            raise ValueError(f"{where} has no list {key!r} of unit indices (got {str(values)[:60]})")
        bad = [i for i in values if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < n]
        if bad:
            raise ValueError(
                f"{where} has unit index {bad[0]!r} in {key!r}; the header names {n} units, so one is in 0..{n - 1}"
            )


def check_fields(path: str | os.PathLike[str], records: list[dict[str, Any]], fields: Sequence[str]) -> None:
    """Raise a ValueError naming the first step record of `path` that lacks one of `fields` (what its reader needs)."""
    for record in records:
        if record.get("type") == "step":
            missing = [key for key in fields if key not in record]
            if missing:
                raise ValueError(
                    f"read_trace: {path}: step {record['step']} has no {missing[0]!r}; a gnmr-hf trace's steps have "
                    f"{', '.join(map(repr, fields))}"
                )


def set_aside(path: str | os.PathLike[str]) -> Path | None:
    """Rename an existing file `name.ext` to the first free `name.N.ext` (N = 1, 2, ...); return the new path, or
    None if there was nothing to move. A new run never overwrites the record of an earlier one."""
    path = Path(path)
    if not path.exists():
        return None
    n = 1
    while (target := path.with_name(f"{path.stem}.{n}{path.suffix}")).exists():
        n += 1
    path.rename(target)
    return target


@dataclass
class TraceSummary:
    """Running totals over a decision stream: recovery fraction, flip rate, top units, and the units the budget
    left out (candidates of the policy that `max_active` kept off the recovery path)."""

    unit_names: list[str]
    steps: int = 0
    active_unit_steps: int = 0
    flips: int = 0
    risky_unit_steps: int = 0
    over_budget_steps: int = 0
    max_active_seen: int = 0
    skipped_steps: int = 0
    # The most units that asked for recovery at one step: the `max_active` that would have held them all.
    max_candidates_seen: int = 0
    # The trace's first step: > 1 where the run resumed from a checkpoint into a folder without the earlier trace, so
    # that its counts cover the steps from there on only (a live summary restored from the checkpoint covers all).
    first_step: int = 1
    recovery_steps: np.ndarray = field(default=None)  # type: ignore[assignment]
    risky_steps: np.ndarray = field(default=None)  # type: ignore[assignment]
    left_out_steps: np.ndarray = field(default=None)  # type: ignore[assignment]
    first_left_out: np.ndarray = field(default=None)  # type: ignore[assignment]  # the step (1-based), 0: never

    def __post_init__(self) -> None:
        n = len(self.unit_names)
        for name in ("recovery_steps", "risky_steps", "left_out_steps", "first_left_out"):
            if getattr(self, name) is None:
                setattr(self, name, np.zeros(n, dtype=np.int64))

    def add(self, active: Any, entered: Any, exited: Any, risky: Any, left_out: Any = None) -> None:
        """Count one step; the arguments are index arrays (or lists) of units. `left_out`: the candidates the budget
        left out; None (a trace written before it was recorded): the risky units outside `active`."""
        active = np.asarray(active, dtype=np.int64)
        risky = np.asarray(risky, dtype=np.int64)
        left = risky[~np.isin(risky, active)] if left_out is None else np.asarray(left_out, dtype=np.int64)
        self.steps += 1
        self.active_unit_steps += len(active)
        self.flips += len(entered) + len(exited)
        self.risky_unit_steps += len(risky)
        self.over_budget_steps += int(len(left) > 0)
        self.max_active_seen = max(self.max_active_seen, len(active))
        self.max_candidates_seen = max(self.max_candidates_seen, len(active) + len(left))
        self.recovery_steps[active] += 1
        self.risky_steps[risky] += 1
        self.left_out_steps[left] += 1
        self.first_left_out[left] = np.where(self.first_left_out[left] == 0, self.steps, self.first_left_out[left])

    def add_record(self, record: dict[str, Any]) -> None:
        if record.get("type") == "skip":
            self.skipped_steps += 1
        else:
            # A trace written before "left_out" was recorded has none: its risky units outside `active` stand in.
            self.add(record["active"], record["entered"], record["exited"], record["risky"], record.get("left_out"))

    @property
    def recovery_fraction(self) -> float:
        """Fraction of unit-steps spent in recovery."""
        total = self.steps * len(self.unit_names)
        return self.active_unit_steps / total if total else 0.0

    @property
    def flips_per_1k_steps(self) -> float:
        return 1000.0 * self.flips / self.steps if self.steps else 0.0

    def top_units(self, k: int = 10) -> list[tuple[str, int, int]]:
        """(name, steps in recovery, steps risky) of the k units longest in recovery; ties by unit order."""
        order = np.lexsort((np.arange(len(self.unit_names)), -self.risky_steps, -self.recovery_steps))
        rows = [(self.unit_names[i], int(self.recovery_steps[i]), int(self.risky_steps[i])) for i in order[:k]]
        return [row for row in rows if row[1] or row[2]]

    def left_out(self, persistent: bool = False) -> list[tuple[str, int]]:
        """(name, steps) of the units the budget left out, most steps first (ties by unit order); `persistent`:
        only those left out at least half of the steps from the first time on (as `gnmr-hf advise` reads a unit
        the run needed persistently), not a passing spike's."""
        first = self.first_left_out
        keep = self.left_out_steps > 0
        if persistent:
            keep &= 2 * self.left_out_steps >= self.steps - first + 1
        order = np.lexsort((np.arange(len(self.unit_names)), -self.left_out_steps))
        return [(self.unit_names[i], int(self.left_out_steps[i])) for i in order if keep[i]]

    def as_dict(self, k: int = 10) -> dict[str, Any]:
        return {
            "units": len(self.unit_names),
            "steps": self.steps,
            "recovery_fraction": self.recovery_fraction,
            "flips": self.flips,
            "flips_per_1k_steps": self.flips_per_1k_steps,
            "risky_unit_steps": self.risky_unit_steps,
            "steps_with_units_left_out": self.over_budget_steps,
            "max_active_seen": self.max_active_seen,
            "max_candidates_seen": self.max_candidates_seen,
            "units_left_out": [{"name": n, "steps": c} for n, c in self.left_out()],
            "skipped_steps": self.skipped_steps,
            "first_step": self.first_step,
            "top_units": [{"name": n, "recovery_steps": r, "risky_steps": s} for n, r, s in self.top_units(k)],
        }

    def format(self, k: int = 10) -> str:
        """A plain-text table for the console."""
        lines = [
            "GNMR summary",
            f"  units                          {len(self.unit_names)}",
            f"  optimizer steps                {self.steps}",
            *self._resumed(),
            f"  unit-steps in recovery         {self.recovery_fraction:.4%}",
            f"  flips per 1,000 steps          {self.flips_per_1k_steps:.1f}",
            f"  most units in recovery at once {self.max_active_seen}",
            f"  steps with units left out by the budget {self.over_budget_steps}",
        ]
        left = self.left_out()
        if left:
            shown = ", ".join(f"{n} {c}" for n, c in left[:k]) + (
                f" and {len(left) - k} more" if len(left) > k else ""
            )
            lines.append(
                f"  units left out by the budget (steps): {shown}; max_active={self.max_candidates_seen} would "
                "have held every unit that asked"
            )
        if self.skipped_steps:
            lines.append(f"  steps skipped by the fp16 loss scaler (not observed) {self.skipped_steps}")
        top = self.top_units(k)
        if top:
            width = max(len(n) for n, _, _ in top)
            lines.append("  top units (steps in recovery, steps risky):")
            lines += [f"    {n:<{width}}  {r:>6}  {s:>6}" for n, r, s in top]
        else:
            lines.append("  no unit was risky or in recovery")
        return "\n".join(lines)

    def _resumed(self) -> list[str]:
        if self.first_step <= 1:
            return []
        return [
            f"  this trace starts at step {self.first_step}, where the run resumed from a checkpoint: it counts steps "
            f"{self.first_step} on; steps 1-{self.first_step - 1} are in the earlier run's trace, and the run's own "
            "summary (printed at its end, gnmr_summary.json) counts them all"
        ]

    def state(self) -> dict[str, Any]:
        """JSON-safe totals, saved in checkpoints so a resumed run's summary covers the whole run."""
        return {
            "steps": self.steps,
            "active_unit_steps": self.active_unit_steps,
            "flips": self.flips,
            "risky_unit_steps": self.risky_unit_steps,
            "over_budget_steps": self.over_budget_steps,
            "max_active_seen": self.max_active_seen,
            "max_candidates_seen": self.max_candidates_seen,
            "skipped_steps": self.skipped_steps,
            "recovery_steps": self.recovery_steps.tolist(),
            "risky_steps": self.risky_steps.tolist(),
            "left_out_steps": self.left_out_steps.tolist(),
            "first_left_out": self.first_left_out.tolist(),
        }

    def load_state(self, state: dict[str, Any]) -> None:
        for key in (
            "steps",
            "active_unit_steps",
            "flips",
            "risky_unit_steps",
            "over_budget_steps",
            "max_active_seen",
        ):
            setattr(self, key, int(state[key]))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        self.recovery_steps = np.asarray(state["recovery_steps"], dtype=np.int64)
        self.risky_steps = np.asarray(state["risky_steps"], dtype=np.int64)
        # A checkpoint written before the budget's left-outs were counted has none.
        self.max_candidates_seen = int(state.get("max_candidates_seen", self.max_active_seen))
        n = len(self.unit_names)
        for name in ("left_out_steps", "first_left_out"):
            setattr(self, name, np.asarray(state.get(name, [0] * n), dtype=np.int64))

    @classmethod
    def from_trace(cls, path: str | os.PathLike[str]) -> tuple[TraceSummary, dict[str, Any], list[dict[str, Any]]]:
        header, records = read_trace(path)
        check_fields(path, records, ("active", "entered", "exited", "risky"))
        summary = cls(unit_names=list(header["units"]), first_step=records[0]["step"] if records else 1)
        for record in records:
            summary.add_record(record)
        return summary, header, [r for r in records if r["type"] == "step"]


def iter_scores(steps: list[dict[str, Any]], unit: int) -> Iterator[tuple[int, float]]:
    """(step, risk) of one unit wherever it was among the trace's top-k scores."""
    for record in steps:
        for i, s in record.get("top", ()):
            if i == unit:
                yield record["step"], float(s)
