"""`GNMRConfig`: every knob of the GNMR policy, as a dataclass `HfArgumentParser` can read.

The paper (arXiv 2606.00539) names its knobs with symbols; we name them with words and map them once here:

| field        | paper     | meaning                                                                 |
|--------------|-----------|-------------------------------------------------------------------------|
| `max_active` | maxO      | hard cap on units in the recovery (high-fidelity) path at any step      |
| `lock_steps` | T_lock    | steps a selected unit stays in recovery after its last risky step       |
| `window`     | delta     | number of past GNMR values averaged for the short-window score DGNMR    |
| `alpha`      | alpha_t   | threshold on GNMR = n_t / mean(n_1..n_{t-1})                            |
| `beta`       | beta_t    | threshold on DGNMR = GNMR_t / mean(GNMR_{t-delta}..GNMR_{t-1})          |

The fields below the table are the decisions the paper leaves open (see docs/method.md for the reasons):
warm-up (`min_history`), threshold schedules (`threshold_schedule`, `alpha_final`, `beta_final`,
`schedule_steps`), and how the Trainer integration runs (`backend`, `monitor_only`, ...).
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, field, fields
from typing import Any

# The backend module imports neither bitsandbytes nor peft at import time, so this stays light.
from .backends.bnb_int8 import SIGNALS, SOURCES
from .units import known_backends

__all__ = ["GNMRConfig"]

_SCHEDULES = ("constant", "linear", "cosine")


@dataclass
class GNMRConfig:
    """Configuration of the GNMR controller and its Trainer integration.

    Symbols (paper -> field): maxO -> `max_active`, T_lock -> `lock_steps`, delta -> `window`,
    alpha_t -> `alpha` (with `threshold_schedule`), beta_t -> `beta`.
    """

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
            "from (alpha, beta) at step 1 to (alpha_final, beta_final) at step schedule_steps."
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
    # Integration knobs: the controller ignores these, the callback reads them.
    backend: str = field(
        default="bnb_int8",
        metadata={"help": "Which units to manage: 'bnb_int8', or a name given to gnmr_hf.register_backend."},
    )
    recovery_source: str = field(
        default="auto",
        metadata={
            "help": "Where the BF16 recovery weight comes from: 'checkpoint' (the model's local safetensors), "
            "'dequantize' (the INT8 weight and its scales), or 'auto' (checkpoint when available)."
        },
    )
    signal: str = field(
        default="auto",
        metadata={
            "help": "The gradient a unit is scored on: 'lora' (its LoRA parameters), 'weight' (its own "
            "trainable weight), 'output_grad' (the gradient of its output, via a backward hook), or "
            "'auto' (lora, else weight, else output_grad)."
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
        self._check_threshold("alpha")
        self._check_threshold("beta")
        self._check_choice("threshold_schedule", _SCHEDULES)
        self._check_choice("backend", known_backends())
        self._check_choice("recovery_source", SOURCES)
        self._check_choice("signal", SIGNALS)
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

    def _check_int(self, name: str, minimum: int) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"GNMRConfig.{name} must be an int >= {minimum}, got {value!r}")
        if value < minimum:
            raise ValueError(f"GNMRConfig.{name} must be an int >= {minimum}, got {value}")

    def _check_threshold(self, name: str) -> None:
        value = getattr(self, name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"GNMRConfig.{name} must be a finite number > 0, got {value!r}")
        if not math.isfinite(value) or value <= 0:
            raise ValueError(f"GNMRConfig.{name} must be a finite number > 0, got {value}")
        setattr(self, name, float(value))

    def _check_choice(self, name: str, allowed: tuple[str, ...]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(f"GNMRConfig.{name} must be one of {list(allowed)}, got {value!r}")

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
