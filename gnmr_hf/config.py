"""`GNMRConfig`: every knob of the GNMR policy and of its Trainer integration, as a dataclass that
`HfArgumentParser` can read (also beside `TrainingArguments`).

Fields are named in words for the paper's symbols; the one table of symbols and fields, with the decisions the
paper leaves open, is in docs/method.md. A leaf: the backend and the policy are names and their options are kept raw
(text is read into a dict); each validates its own when the callback is built, so making a config imports and
registers nothing.
"""

from __future__ import annotations

import math
import numbers
import re
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import PurePath
from typing import Any

from .options import _typed, parse_options_text

__all__ = ["GNMRConfig"]

_SCHEDULES = ("constant", "linear", "cosine")
# The deprecated fields of the cause policy's options, and each one's option (`gnmr_hf.policies.cause.CauseOptions`).
_CAUSE_FIELDS = {
    "cause_suspect": "suspect",
    "cause_peer_factor": "peer_factor",
    "cause_fidelity_rows": "fidelity_rows",
    "cause_recovery_every": "recovery_every",
}


@dataclass
class GNMRConfig:
    """Configuration of the GNMR controller and its Trainer integration (symbols: see docs/method.md)."""

    max_active: int = field(
        default=4,
        metadata={"help": "maxO: hard cap on units in the recovery path at any step (>= 1)."},
    )
    lock_steps: int = field(
        default=8,
        metadata={"help": "T_lock: steps a unit stays in recovery after its last risky step (>= 1)."},
    )
    window: int = field(
        default=8,
        metadata={"help": "delta: number of past GNMR values averaged for DGNMR (>= 1)."},
    )
    alpha: float = field(
        default=3.0,
        metadata={"help": "Threshold on GNMR (a unit is risky when GNMR > alpha); > 0."},
    )
    beta: float = field(
        default=3.0,
        metadata={"help": "Threshold on DGNMR (a unit is risky when DGNMR > beta); > 0."},
    )
    min_history: int = field(
        default=4,
        metadata={"help": "Warm-up: a unit gets a GNMR score only after this many finite past norms (>= 1)."},
    )
    threshold_schedule: str = field(
        default="constant",
        metadata={
            "help": "How alpha and beta move over the optimizer step: 'constant', 'linear' or 'cosine' "
            "from (alpha, beta) at step 1 to (alpha_final, beta_final) at step schedule_steps.",
            # HfArgumentParser hands metadata to add_argument: --help lists the values, argparse checks them.
            "choices": _SCHEDULES,
        },
    )
    alpha_final: float | None = field(
        default=None, metadata={"help": "alpha at step schedule_steps (required unless schedule is constant)."}
    )
    beta_final: float | None = field(
        default=None, metadata={"help": "beta at step schedule_steps (required unless schedule is constant)."}
    )
    schedule_steps: int = field(
        default=0, metadata={"help": "Length of the threshold schedule in optimizer steps (>= 1 if used)."}
    )
    relapse_lock: bool = field(
        default=False,
        metadata={
            "help": "Relapse-aware lock (off: the paper's fixed lock): a unit selected again within lock_steps "
            "steps of leaving recovery gets double its previous lock, up to relapse_lock_cap."
        },
    )
    relapse_lock_cap: int = field(
        default=64, metadata={"help": "Longest lock the relapse-aware lock gives, in steps (>= lock_steps)."}
    )
    policy: str = field(
        default="paper",
        metadata={
            "help": "Which policy chooses the recovery set: 'paper' (default): the paper's selection, bit for bit. "
            "'cause': also measure what each unit's cheap path loses (1 = its backend's bound), recover the unit "
            "that causes a symptom, units broken from the start, hold them while their cheap path stays lossy "
            "(docs/method.md, 'The cause policy'). 'impact': rank the units by what their cheap path costs the "
            "loss, estimated online, and recover the costliest under the budget (docs/method.md, 'The impact "
            "policy'; its options are its policy_options). Or a name given to gnmr_hf.register_policy. Checked "
            "when the callback is built."
        },
    )
    policy_options: dict | str | None = field(
        default=None,
        metadata={
            "help": "The policy's own options, as a JSON object or 'key=value,key=value' text (a dict in Python), "
            "e.g. 'suspect=0.5,fidelity_rows=256' for policy='cause' (gnmr_hf.policies.cause.CauseOptions) or "
            "'min_impact=0.002,every=4' for policy='impact'; the paper's policy takes none (its knobs are the fields "
            "here). Validated by the policy."
        },
    )
    # The cause policy's options were these fields until they became its own (`CauseOptions`): each still works for a
    # release, moved into `policy_options` under policy='cause' (below, `_move_cause_fields`).
    cause_suspect: float = field(
        default=0.5,
        metadata={
            "help": "Deprecated (removed in a later minor version): policy_options 'suspect' of policy='cause'."
        },
    )
    cause_peer_factor: float = field(
        default=4.0,
        metadata={
            "help": "Deprecated (removed in a later minor version): policy_options 'peer_factor' of policy='cause'."
        },
    )
    cause_fidelity_rows: int = field(
        default=256,
        metadata={
            "help": "Deprecated (removed in a later minor version): policy_options 'fidelity_rows' of policy='cause'."
        },
    )
    cause_recovery_every: int | None = field(
        default=None,
        metadata={
            "help": "Deprecated (removed in a later minor version): policy_options 'recovery_every' of policy='cause'."
        },
    )
    # Integration knobs: the controller ignores these, the callback reads them.
    backend: str = field(
        default="bnb_int8",
        metadata={
            "help": "Which units to manage: 'bnb_int8' (default), 'bnb_4bit', 'torchao_float8', 'act_quant', "
            "'block_fp', or a name given to gnmr_hf.register_backend. Checked when the units are built."
        },
    )
    backend_options: dict | str | None = field(
        default=None,
        metadata={
            "help": "The backend's own options, as a JSON object or 'key=value,key=value' text (a dict in Python), "
            "e.g. 'source=dequantize,signal=lora' for bnb_int8. Validated by the backend; see its options class."
        },
    )
    include: list[str] | None = field(
        default=None, metadata={"help": "Regexes; only modules whose name matches one are units."}
    )
    exclude: list[str] | None = field(
        default=None, metadata={"help": "Regexes; modules whose name matches one are never units."}
    )
    monitor_only: bool = field(
        default=False, metadata={"help": "Score and log every step, but never change a unit's precision."}
    )
    trace_file: str = field(
        default="gnmr_trace.jsonl",
        metadata={"help": "Name of the JSONL decision trace, written in the Trainer's output_dir ('' = none)."},
    )
    trace_top_k: int = field(
        default=16, metadata={"help": "Scores of the k riskiest units are written to the trace each step."}
    )

    def __post_init__(self) -> None:
        self._check_int("max_active", 1)
        self._check_int("lock_steps", 1)
        self._check_int("window", 1)
        self._check_int("min_history", 1)
        self._check_int("schedule_steps", 0)
        self._check_int("trace_top_k", 0)
        self._check_int("relapse_lock_cap", 1)
        if not isinstance(self.relapse_lock, bool):
            raise TypeError(f"GNMRConfig.relapse_lock must be a bool, got {self.relapse_lock!r}")
        if (self.relapse_lock or self.policy in ("cause", "impact")) and self.relapse_lock_cap < self.lock_steps:
            raise ValueError(
                f"GNMRConfig.relapse_lock_cap must be >= lock_steps={self.lock_steps} with relapse_lock=True or "
                f"policy='cause' or 'impact' (their lock is relapse-aware), got {self.relapse_lock_cap}"
            )
        self._check_threshold("alpha")
        self._check_threshold("beta")
        self._check_choice("threshold_schedule", _SCHEDULES)
        if not isinstance(self.policy, str) or not self.policy:
            raise TypeError(f"GNMRConfig.policy must be a policy's name (a non-empty str), got {self.policy!r}")
        self.policy_options = parse_options_text(self.policy_options, what="GNMRConfig.policy_options")
        self._check_threshold("cause_suspect")
        if self.cause_suspect > 1:
            raise ValueError(f"GNMRConfig.cause_suspect must be in (0, 1], got {self.cause_suspect}")
        self._check_int("cause_fidelity_rows", 0)
        if self.cause_recovery_every is not None:
            self._check_int("cause_recovery_every", 1)
            if self.cause_recovery_every > self.lock_steps:
                raise ValueError(
                    f"GNMRConfig.cause_recovery_every must be <= lock_steps={self.lock_steps} (a unit still lossy "
                    f"must be measured again before its lock runs out), got {self.cause_recovery_every}"
                )
        self._check_threshold("cause_peer_factor")
        if self.cause_peer_factor <= 1:
            raise ValueError(f"GNMRConfig.cause_peer_factor must be > 1, got {self.cause_peer_factor}")
        self._move_cause_fields()
        if not isinstance(self.backend, str) or not self.backend:
            raise TypeError(f"GNMRConfig.backend must be a backend's name (a non-empty str), got {self.backend!r}")
        self._check_backend_options()
        if self.threshold_schedule == "constant":
            for name in ("alpha_final", "beta_final"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"GNMRConfig.{name} is only used with a threshold_schedule of 'linear' or 'cosine', "
                        f"got {name}={getattr(self, name)!r} with threshold_schedule='constant'"
                    )
        else:
            for name in ("alpha_final", "beta_final"):
                if getattr(self, name) is None:
                    raise ValueError(
                        f"GNMRConfig.{name} is required with threshold_schedule={self.threshold_schedule!r}"
                    )
                self._check_threshold(name)
            if self.schedule_steps < 1:
                raise ValueError(
                    f"GNMRConfig.schedule_steps must be >= 1 with threshold_schedule="
                    f"{self.threshold_schedule!r}, got {self.schedule_steps}"
                )
        if not isinstance(self.monitor_only, bool):
            raise TypeError(f"GNMRConfig.monitor_only must be True or False, got {self.monitor_only!r}")
        if not isinstance(self.trace_file, str):
            raise TypeError(
                f"GNMRConfig.trace_file must be a file name (a str; '' writes no trace), got {self.trace_file!r}"
            )
        trace = PurePath(self.trace_file)
        if trace.is_absolute() or trace.anchor or ".." in trace.parts:
            # The trace is part of the run's record: it lives with the run's checkpoints and summary, where a resume
            # and `gnmr-hf report RUN_FOLDER` find it, and a second run never writes over another folder's.
            raise ValueError(
                "GNMRConfig.trace_file must be a path inside the Trainer's output_dir (a file name, or a relative "
                f"path without '..'; '' writes no trace), got {self.trace_file!r}"
            )
        for name in ("include", "exclude"):
            value = getattr(self, name)
            if value is None:
                continue
            if isinstance(value, str) or not all(isinstance(v, str) for v in value):
                raise TypeError(f"GNMRConfig.{name} must be a list of regex strings or None, got {value!r}")
            for pattern in value:
                try:
                    re.compile(pattern)
                except re.error as err:
                    raise ValueError(f"GNMRConfig.{name} has an invalid regex {pattern!r}: {err}") from None

    def _move_cause_fields(self) -> None:
        """The deprecated `cause_*` fields: each one set (to other than its default) warns, and under policy='cause'
        moves into `policy_options` under its option's name, the field back to its default, so that the config has one
        value and `to_dict()` (a checkpoint's, a trace header's) writes the options form. Under another policy the
        field never had an effect and is left as it is."""
        defaults = {f.name: f.default for f in fields(self)}
        for name, option in _CAUSE_FIELDS.items():
            value = getattr(self, name)
            if value == defaults[name]:
                continue
            warnings.warn(
                f"GNMRConfig.{name} is deprecated and will be removed in a later minor version; give the cause "
                f"policy's option instead: policy_options={{{option!r}: {value!r}}}",
                DeprecationWarning,
                stacklevel=4,  # the caller of GNMRConfig(...): past this method, __post_init__ and __init__
            )
            if self.policy != "cause":
                continue
            if option in self.policy_options:
                raise ValueError(
                    f"GNMRConfig.{name}={value!r} and policy_options {option!r}={self.policy_options[option]!r} set "
                    f"the same option of the cause policy; give it once, as policy_options {option!r} ({name} is "
                    "deprecated)"
                )
            self.policy_options[option] = value
            setattr(self, name, defaults[name])

    def _check_int(self, name: str, minimum: int) -> None:
        # numbers.Integral admits numpy integers (a value read from an array or a sweep), not bools.
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"GNMRConfig.{name} must be an int >= {minimum}, got {value!r}")
        if value < minimum:
            raise ValueError(f"GNMRConfig.{name} must be an int >= {minimum}, got {value}")
        setattr(self, name, int(value))

    def _check_threshold(self, name: str) -> None:
        # numbers.Real admits numpy floats (np.float32(3.0) is not a Python float), not bools.
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"GNMRConfig.{name} must be a finite number > 0, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"GNMRConfig.{name} must be a finite number > 0, got {value}")
        setattr(self, name, float(value))

    def _check_backend_options(self) -> None:
        """Read `backend_options` (dict, JSON or key=value text) into a plain dict (JSON-safe for checkpoints),
        values as given: what they mean is the backend's to check."""
        self.backend_options = parse_options_text(self.backend_options, what="GNMRConfig.backend_options")

    def _check_choice(self, name: str, allowed: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(f"GNMRConfig.{name} must be one of {list(allowed)}, got {value!r}")

    @property
    def recovery_every(self) -> int:
        """Deprecated (removed in a later minor version): how often a unit in recovery measures, as the cause policy
        resolves it (`CausePolicy.recovery_every`, `Policy.fidelity_schedule()`); read here without the policy, whose
        module imports torch, so that the config stays a leaf."""
        warnings.warn(
            "GNMRConfig.recovery_every is deprecated and will be removed in a later minor version; the cause policy's "
            "option resolved is gnmr_hf.policy.make_policy(config).fidelity_schedule()[1]",
            DeprecationWarning,
            stacklevel=2,
        )
        every = self.cause_recovery_every
        if self.policy == "cause":  # the field moved into the options: typed as CauseOptions types it
            every = _typed(self.policy_options.get("recovery_every"), int | None, "recovery_every")
        return every if every is not None else -(-self.lock_steps // 2)

    def thresholds(self, step: int) -> tuple[float, float]:
        """(alpha_t, beta_t) at optimizer step `step` (1-based). Computed on the host: no device sync."""
        if self.threshold_schedule == "constant":
            return self.alpha, self.beta
        progress = min(max(step - 1, 0) / max(self.schedule_steps - 1, 1), 1.0)
        if self.threshold_schedule == "cosine":
            progress = 0.5 * (1.0 - math.cos(math.pi * progress))
        assert self.alpha_final is not None and self.beta_final is not None
        return (
            self.alpha + (self.alpha_final - self.alpha) * progress,
            self.beta + (self.beta_final - self.beta) * progress,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GNMRConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"GNMRConfig got unknown fields {unknown}; known fields are {sorted(known)}")
        return cls(**data)
