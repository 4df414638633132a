"""The stabilizers users reach for first when a low-precision run spikes, as arms beside GNMR: each keeps every unit
on the cheap path and changes the update, never the precision.

Each comes from its maintained package (the `stabilizers` extra, imported here lazily: `gnmr_hf` imports without
it), used as its authors document it. The Adam part of every arm is the recipe's (learning rate and its schedule,
betas, epsilon, weight decay), so an arm differs from `static_low` only in what the method adds; the method's own
knobs are its authors' defaults, or the `options` a run gives (a tuned setting, said so in its results).

- `zclip` (package `zclip`): `ZClip.step(model)` between the backward and the optimizer step, which the Trainer
  offers as `on_pre_optimizer_step` (`ZClipCallback`). The Trainer's own clipping is off; ZClip's `max_grad_norm`
  (1.0, the recipe's) stays its ceiling, as its authors ship it.
- `spam`, `stable_spam`, `adagc` (package `pytorch-optimizer`: SPAM, StableSPAM, AdaGC): the Trainer's optimizer,
  passed as `optimizer_cls_and_kwargs` so that the Trainer still builds its parameter groups and its schedule on
  it. SPAM and StableSPAM keep the Trainer's clipping at 1.0 (a user swaps the optimizer, nothing else); AdaGC
  replaces it (it clips globally at `lambda_abs` during its warm-up, then each tensor against its own EMA).
- `skip_step`: OLMo-core's `SkipStepOptimizer` rule, written here (`SkipStepAdamW`): importing it from
  `ai2-olmo-core` 3.0.0 runs `olmo_core.optim`'s `__init__`, which imports its model stack (`olmo_core.nn.transformer`)
  and `cached_path` (with it boto3 and google-cloud-storage), and the package pins torch < 2.14.
- `gnmr_cause_zclip`: the cause policy and ZClip together.

What each did lands in the arm's result.json (`Stabilizer.record()`): clipped steps or entries, skipped steps,
momentum resets, and the steps it acted on, which `benchmarks/fault_injection.py` holds against its fault schedule.
The counters of SPAM, StableSPAM and AdaGC read the optimizer's state before its step and apply the method's own
test to it (pytorch-optimizer 4.1: the methods do not report what they clipped).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback, TrainingArguments

__all__ = [
    "REQUIREMENTS",
    "STABILIZER_ARMS",
    "SkipStepAdamW",
    "Stabilizer",
    "ZClipCallback",
    "describe",
    "missing_package",
    "parse_options",
    "stabilizer_for",
]

STABILIZER_ARMS = ("zclip", "spam", "stable_spam", "adagc", "skip_step", "gnmr_cause_zclip")
# The import each arm needs, and the package that provides it.
REQUIREMENTS = {
    "zclip": ("zclip", "zclip"),
    "gnmr_cause_zclip": ("zclip", "zclip"),
    "spam": ("pytorch_optimizer", "pytorch-optimizer"),
    "stable_spam": ("pytorch_optimizer", "pytorch-optimizer"),
    "adagc": ("pytorch_optimizer", "pytorch-optimizer"),
}


def missing_package(arm: str) -> str | None:
    """The package arm `arm` needs and this environment lacks, else None."""
    import importlib.util

    module, package = REQUIREMENTS.get(arm, (None, None))
    return package if module is not None and importlib.util.find_spec(module) is None else None


def parse_options(text: str) -> dict[str, Any]:
    """`'k=v,k=v'` as keyword arguments: ints, floats and true/false/none as such, the rest as strings."""
    options: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"stabilizer_options: {item!r} is not key=value")
        lowered = value.strip().lower()
        if lowered in ("true", "false", "none"):
            options[key.strip()] = {"true": True, "false": False, "none": None}[lowered]
            continue
        for cast in (int, float):
            try:
                options[key.strip()] = cast(value)
                break
            except ValueError:
                pass
        else:
            options[key.strip()] = value.strip()
    return options


def _unwrap(optimizer: Any) -> torch.optim.Optimizer:
    """The optimizer inside accelerate's `AcceleratedOptimizer` (the Trainer passes the wrapper to callbacks)."""
    return getattr(optimizer, "optimizer", optimizer)


def _total_norm(tensors: list[torch.Tensor]) -> float:
    if not tensors:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors))))


# ------------------------------------------------------------------------------------------------ ZClip


class ZClipCallback(TrainerCallback):
    """`zclip.ZClip` in a Trainer: `ZClip.step(model)` in `on_pre_optimizer_step`, after the backward and before
    the optimizer step, as its README places it. Counts, by their effect on the gradient norm, the steps it clipped
    and those it clipped below its fixed ceiling (`max_grad_norm`): the z-score's own clips."""

    def __init__(self, **zclip_kwargs: Any) -> None:
        from zclip import ZClip

        self.zclip = ZClip(**zclip_kwargs)
        self.clipped_steps: list[int] = []
        self.zscore_steps: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        before = self.zclip.step(model)
        after = _total_norm([p.grad for p in model.parameters() if p.grad is not None])
        step = state.global_step + 1
        if not math.isfinite(before) or after < before * (1 - 1e-4):
            self.clipped_steps.append(step)
            ceiling = self.zclip.max_grad_norm or math.inf
            if math.isfinite(before) and after < min(before, ceiling) * (1 - 1e-4):
                self.zscore_steps.append(step)

    def record(self) -> dict[str, Any]:
        return {
            "clipped_steps": len(self.clipped_steps),
            "zscore_clipped_steps": len(self.zscore_steps),
            "acted_steps": self.zscore_steps,
        }


# -------------------------------------------------------------------------------- SPAM, StableSPAM, AdaGC


class _OptimizerCounter(TrainerCallback):
    """Reads the Trainer's optimizer in `on_pre_optimizer_step`, before its step, and counts what the step will clip
    and reset by the method's own test (`count(optimizer) -> (clipped, reset)`)."""

    def __init__(self, count: Callable[[Any], tuple[int, bool]], unit: str) -> None:
        self.count, self.unit = count, unit
        self.clipped = 0
        self.acted_steps: list[int] = []
        self.reset_steps: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        clipped, reset = self.count(_unwrap(optimizer))
        step = state.global_step + 1
        self.clipped += clipped
        if clipped:
            self.acted_steps.append(step)
        if reset:
            self.reset_steps.append(step)

    def record(self) -> dict[str, Any]:
        return {
            f"clipped_{self.unit}": self.clipped,
            "steps_with_clipping": len(self.acted_steps),
            "momentum_resets": len(self.reset_steps),
            "acted_steps": self.acted_steps,
        }


def _params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]


def spam_count(optimizer: Any) -> tuple[int, bool]:
    """SPAM (pytorch-optimizer 4.1) at its coming step: the gradient entries whose square exceeds `threshold` times
    their second moment (clipped to that bound), and whether the step resets the moments (every
    `update_proj_gap` steps; clipping then waits `grad_accu_steps`)."""
    step = optimizer.state["total_step"] + 1
    reset = step % optimizer.update_proj_gap == 0
    gap, wait = optimizer.update_proj_gap, optimizer.grad_accu_steps
    if reset or optimizer.threshold == 0 or step < wait or (gap and step % gap < wait):
        return 0, reset
    clipped = 0
    for p in _params(optimizer):
        state = optimizer.state[p]
        if "exp_avg_sq" not in state:
            continue
        grad = p.grad[state["mask"]] if "mask" in state else p.grad
        clipped += int((grad.square() > optimizer.threshold * state["exp_avg_sq"]).sum())
    return clipped, reset


def stable_spam_count(optimizer: Any) -> tuple[int, bool]:
    """StableSPAM (pytorch-optimizer 4.1) at its coming step: the gradient entries above the bias-corrected EMA of
    their tensor's largest magnitude (AdaClip: scaled down to it), and whether the step resets the moments."""
    step = optimizer.total_step + 1
    theta = optimizer.theta
    clipped = 0
    for p in _params(optimizer):
        state = optimizer.state[p]
        grad = p.grad
        largest = grad.abs().max()
        previous = state["m_max_t"] if "m_max_t" in state else torch.zeros((), dtype=grad.dtype)
        bound = previous.lerp(largest, 1.0 - theta) / (1.0 - theta**step)
        clipped += int((grad.abs() > bound).sum())
    return clipped, step % optimizer.update_proj_gap == 0


def adagc_count(optimizer: Any) -> tuple[int, bool]:
    """AdaGC (pytorch-optimizer 4.1) at its coming step: during its warm-up (`warmup_steps`, or a tensor without
    its EMA yet) every tensor, when the global gradient norm is above `lambda_abs`; after it, each tensor whose norm
    is above `lambda_rel` times its EMA `gamma`. AdaGC resets nothing."""
    clipped = 0
    for group in optimizer.param_groups:
        step = group.get("step", 0) + 1
        params = [p for p in group["params"] if p.grad is not None]
        eps = group["eps"]
        warm = {id(p) for p in params if "gamma" not in optimizer.state[p] or step < group["warmup_steps"]}
        if warm and _total_norm([p.grad for p in _params(optimizer)]) + eps > group["lambda_abs"]:
            clipped += len(warm)
        for p in params:
            if id(p) in warm:
                continue
            gamma = optimizer.state[p]["gamma"].clamp_min(eps)
            clipped += int(p.grad.norm().clamp_min(eps) > group["lambda_rel"] * gamma)
    return clipped, False


# ------------------------------------------------------------------------------------------- skip-step


class SkipStepAdamW(torch.optim.AdamW):
    """AdamW that skips an update whose loss or gradient norm is more than `sigma_factor` standard deviations above
    the mean of the last `rolling_interval_length` steps: OLMo-core's `SkipStepOptimizer` rule (ai2-olmo-core 3.0.0,
    `olmo_core/optim/skip_step_optimizer.py`), which this module says why it does not import.

    As there: no step is skipped before half the window (64 steps) has been seen; the statistics are
    `torch.std_mean` of the previous steps' values (unbiased); the current step's values join the window whether it is
    skipped or not; a skipped step changes neither the weights, nor the moments, nor AdamW's step count (OLMo's
    `SkipStepAdamW` multiplies all three by its step factor 0). As OLMo's train module does, the gradient is clipped
    to `max_grad_norm` here (the Trainer's own clipping is off in this arm) and the norm the rule reads is the one
    before clipping. `latest_loss` must be set before each `step()` (`SkipStepFeed`). The arm builds it with the
    Trainer's own AdamW arguments (`fused=True` under its default `optim`), so that it differs from static_low by
    the rule alone, down to the rounding."""

    def __init__(
        self,
        params: Any,
        *,
        max_grad_norm: float | None = 1.0,
        rolling_interval_length: int = 128,
        sigma_factor: float = 6,
        **adamw: Any,
    ) -> None:
        super().__init__(params, **adamw)
        self.max_grad_norm = max_grad_norm
        self.rolling_interval_length, self.sigma_factor = rolling_interval_length, sigma_factor
        self.latest_loss: float | None = None
        self._losses: deque[float] = deque(maxlen=rolling_interval_length + 1)
        self._grad_norms: deque[float] = deque(maxlen=rolling_interval_length + 1)
        self.steps = 0
        self.skipped: list[tuple[int, str]] = []  # (1-based step, "loss" / "grad_norm" / "both")

    def _over(self, history: deque[float]) -> bool:
        values = torch.tensor(list(history), dtype=torch.float64)
        std, mean = torch.std_mean(values[:-1])
        return not bool(values[-1] - mean <= self.sigma_factor * std)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        if self.latest_loss is None:
            raise RuntimeError("SkipStepAdamW.step: set latest_loss first (SkipStepFeed does, in a Trainer)")
        grads = [p.grad for p in _params(self)]
        if self.max_grad_norm:
            norm = float(torch.nn.utils.clip_grad_norm_(_params(self), self.max_grad_norm))
        else:
            norm = _total_norm(grads)
        self._losses.append(float(self.latest_loss))
        self._grad_norms.append(norm)
        self.latest_loss = None
        self.steps += 1
        if len(self._losses) >= max(2, self.rolling_interval_length // 2):
            on_loss, on_norm = self._over(self._losses), self._over(self._grad_norms)
            if on_loss or on_norm:
                why = "both" if on_loss and on_norm else "loss" if on_loss else "grad_norm"
                self.skipped.append((self.steps, why))
                return None
        return super().step(closure)


class SkipStepFeed(TrainerCallback):
    """Gives `SkipStepAdamW` each step's training loss: the mean of the losses the model returns in training mode
    during the step (a forward hook; the rule is scale-free, so a mean or a sum over micro-batches decides alike)."""

    def __init__(self) -> None:
        self._losses: list[float] = []
        self._handle: Any = None
        self.optimizer: SkipStepAdamW | None = None

    def _on_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        loss = getattr(output, "loss", None)
        if module.training and torch.is_grad_enabled() and loss is not None:
            self._losses.append(float(loss.detach()))

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._handle = model.register_forward_hook(self._on_forward)

    def on_step_begin(self, args, state, control, **kwargs):
        self._losses.clear()

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        self.optimizer = _unwrap(optimizer)
        self.optimizer.latest_loss = sum(self._losses) / len(self._losses) if self._losses else math.nan

    def on_train_end(self, args, state, control, **kwargs):
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def record(self) -> dict[str, Any]:
        skipped = self.optimizer.skipped if self.optimizer is not None else []
        return {
            "skipped_steps": len(skipped),
            "skipped_on_loss": sum(1 for _, why in skipped if why in ("loss", "both")),
            "skipped_on_grad_norm": sum(1 for _, why in skipped if why in ("grad_norm", "both")),
            "acted_steps": [step for step, _ in skipped],
        }


# ------------------------------------------------------------------------------------------------- arms


@dataclass
class Stabilizer:
    """What a stabilizer arm adds to its Trainer: callbacks, an optimizer (`optimizer_cls_and_kwargs`, None: the
    Trainer's AdamW) and the Trainer's own `max_grad_norm` (0: off)."""

    arm: str
    method: str
    options: dict[str, Any]
    max_grad_norm: float
    callbacks: list[TrainerCallback] = field(default_factory=list)
    optimizer_cls_and_kwargs: tuple[type, dict[str, Any]] | None = None

    def record(self) -> dict[str, Any]:
        """The arm's method, the options given beyond its defaults, and what it did."""
        did: dict[str, Any] = {}
        for callback in self.callbacks:
            did.update(callback.record())
        return {"method": self.method, "options": self.options, "trainer_max_grad_norm": self.max_grad_norm, **did}


def stabilizer_for(arm: str, args: TrainingArguments, options: dict[str, Any] | None = None) -> Stabilizer:
    """The stabilizer of arm `arm` (one of `STABILIZER_ARMS`) for a Trainer run with `args`; `options` are keyword
    arguments of the method's class beyond its defaults."""
    if arm not in STABILIZER_ARMS:
        raise ValueError(f"stabilizer: arm must be one of {list(STABILIZER_ARMS)}, got {arm!r}")
    options = dict(options or {})
    adam = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    if arm in ("zclip", "gnmr_cause_zclip"):
        return Stabilizer(arm, "zclip.ZClip", options, 0.0, [ZClipCallback(**options)])
    if arm == "skip_step":
        # The Trainer's own AdamW with the rule on top: the same implementation (fused, by default) as static_low's.
        from transformers import Trainer

        cls, adamw = Trainer.get_optimizer_cls_and_kwargs(args)
        if cls is not torch.optim.AdamW:
            raise ValueError(f"arm skip_step adds its rule to torch's AdamW; --optim {args.optim} is {cls.__name__}")
        kwargs = {**adamw, "max_grad_norm": args.max_grad_norm, **options}
        return Stabilizer(arm, "SkipStepAdamW", options, 0.0, [SkipStepFeed()], (SkipStepAdamW, kwargs))
    from pytorch_optimizer import SPAM, AdaGC, StableSPAM

    cls, count, unit, trainer_clip = {
        "spam": (SPAM, spam_count, "entries", args.max_grad_norm),
        "stable_spam": (StableSPAM, stable_spam_count, "entries", args.max_grad_norm),
        "adagc": (AdaGC, adagc_count, "tensor_steps", 0.0),
    }[arm]
    method, optimizer = f"pytorch_optimizer.{cls.__name__}", (cls, {**adam, **options})
    return Stabilizer(arm, method, options, trainer_clip, [_OptimizerCounter(count, unit)], optimizer)


def describe(record: dict[str, Any] | None) -> str:
    """One table cell: what a stabilizer did over a run, from its `record()`."""
    if not record:
        return "-"
    parts = []
    if "zscore_clipped_steps" in record:
        parts.append(f"{record['clipped_steps']} clipped steps ({record['zscore_clipped_steps']} by its z-score)")
    if "skipped_steps" in record:
        parts.append(f"{record['skipped_steps']} skipped steps")
    for key in ("clipped_entries", "clipped_tensor_steps"):
        if key in record:
            what = key.removeprefix("clipped_").replace("_", "-")
            parts.append(f"{record[key]} {what} clipped in {record['steps_with_clipping']} steps")
    if record.get("momentum_resets"):
        parts.append(f"{record['momentum_resets']} momentum resets")
    return ", ".join(parts)
