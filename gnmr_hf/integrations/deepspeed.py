"""GNMR's signal under DeepSpeed ZeRO stages 1, 2 and 3 (`TrainingArguments(deepspeed=...)`, `accelerate launch
--use_deepspeed`). Not a public API: `GNMRCallback` uses it when the Trainer runs under DeepSpeed.

ZeRO keeps gradients inside its engine: each rank reduces the gradients into the slice of every parameter it owns
(ZeRO-3 owns a slice of the parameter itself too) and `.grad` is None at every Trainer event. The reduced gradient
exists from the end of the last backward of the accumulation window until the ZeRO optimizer's `step()`, which
accelerate's `backward()` runs right after `engine.backward()`, i.e. before `on_pre_optimizer_step`. DeepSpeed's
reader `safe_get_full_grad(p)` is a collective that works only in that interval: called later it raises on the rank
that owns the slice while the others wait in its all-reduce (a hang).

So the read runs inside the ZeRO optimizer's `step()`, wrapped here, before it: after the engine's reduction and
before its clipping and update, once per optimizer step (the engine calls `step()` only at the accumulation
boundary), on every rank. Each rank sums, per unit, the squares of the gradient slices it owns (ZeRO-1/2: the
fragment `safe_get_full_grad` itself copies into its buffer; ZeRO-3: `safe_get_local_grad`), adds the squares of
its output-gradient meters, and ONE all-reduce of [3, N] floats over the data-parallel group sums them (and which
meters fired, and which rank failed). The slices are disjoint and cover each tensor, so the sum is the squared norm
of the full averaged gradient. Every rank makes exactly one collective per step whatever its slices, so no rank can
wait on another: a rank whose read fails says so in the reduced tensor, and every rank raises. The alternative,
`safe_get_full_grad` per tensor, moves a full-size buffer per signal tensor (ZeRO-1/2 all-reduce it, ZeRO-3
all-gathers it) and must run in the same tensor order on every rank; docs/deepspeed.md has what each costs.

Flips: under ZeRO-1/2 parameters are replicated, so every backend flips as without DeepSpeed. Under ZeRO-3 the
engine gathers a module's parameters around its forward and backward only: backends whose recovery path computes
on the module's own weight inside its forward (`act_quant`, `block_fp`, `torchao_float8`) flip as usual and hold
no extra weight; the bitsandbytes backends are refused (`check_backend` says why).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..signals import NormGrid

__all__ = ["DeepSpeedZero", "check_backend", "runs_under_deepspeed"]

_ZERO3_REFUSED = {
    "bnb_int8": (
        "bitsandbytes 8-bit layers train with losses about 10x off under ZeRO-3 (bitsandbytes issue #1451, "
        "https://github.com/bitsandbytes-foundation/bitsandbytes/issues/1451), so GNMR would be scoring a broken run. "
        "Use ZeRO-2 (the INT8 base replicated, LoRA gradients and optimizer state partitioned), which GNMR supports"
    ),
    "bnb_4bit": (
        "ZeRO-3 partitions the packed 4-bit weight (bnb_4bit_quant_storage), and a unit builds its BF16 recovery "
        "weight outside the forward (checking a checkpoint row against the packed weight, or dequantizing it), where "
        "ZeRO-3 leaves only this rank's slice. Use ZeRO-2 (the 4-bit base replicated), which GNMR supports"
    ),
}


def runs_under_deepspeed(args: Any) -> bool:
    """Whether the Trainer with these `TrainingArguments` runs under DeepSpeed (a `deepspeed` config, a DeepSpeed
    plugin, or `accelerate launch --use_deepspeed`)."""
    return bool(
        getattr(args, "deepspeed", None)
        or getattr(args, "deepspeed_plugin", None) is not None
        or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true"
    )


def check_backend(stage: int, backend: str) -> None:
    """Raise a ValueError when GNMR cannot flip `backend`'s units under ZeRO `stage`."""
    reason = _ZERO3_REFUSED.get(backend) if stage == 3 else None
    if reason is not None:
        raise ValueError(f"GNMRCallback: backend {backend!r} under DeepSpeed ZeRO-3 is not supported: {reason}")


def _zero_stage(optimizer: Any) -> tuple[Any, int] | None:
    """The ZeRO optimizer inside the optimizer the Trainer passes (accelerate's `DeepSpeedOptimizerWrapper`) and its
    stage, or None."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    for _ in range(4):
        if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
            return optimizer, 3
        if isinstance(optimizer, DeepSpeedZeroOptimizer):
            return optimizer, 2 if optimizer.partition_gradients else 1
        optimizer = getattr(optimizer, "optimizer", None)
    return None


class _StepWrap:
    """Undoes the wrap of the ZeRO optimizer's `step` (the callback removes it like a hook handle)."""

    def __init__(self, optimizer: Any, wrapper: Callable[..., Any], original: Any, shadowed: bool) -> None:
        self.optimizer, self.wrapper, self.original, self.shadowed = optimizer, wrapper, original, shadowed

    def remove(self) -> None:
        if vars(self.optimizer).get("step") is self.wrapper:
            if self.shadowed:
                self.optimizer.step = self.original
            else:
                del self.optimizer.step


class DeepSpeedZero:
    """Reads per-unit gradient norms under a ZeRO optimizer. Build it with `from_trainer`.

    Attributes: `optimizer` (DeepSpeed's ZeRO optimizer), `stage` (1, 2 or 3), `group` (its data-parallel group).
    """

    def __init__(self, optimizer: Any, stage: int) -> None:
        self.optimizer, self.stage = optimizer, stage
        self.group = optimizer.dp_process_group
        self.tensors: list[torch.Tensor] = []
        self.meters: list[tuple[int, Any]] = []
        self.num_units = 0

    @classmethod
    def from_trainer(cls, args: Any, optimizer: Any, backend: str) -> DeepSpeedZero | None:
        """None when the Trainer does not run under DeepSpeed; raises when it does in a way GNMR cannot read or
        flip. Called before units are found: under ZeRO-3 a backend's dispatcher may read a partitioned weight."""
        if not runs_under_deepspeed(args):
            return None
        found = _zero_stage(optimizer)
        if found is None:
            raise ValueError(
                "GNMRCallback: under DeepSpeed GNMR needs a ZeRO optimizer (stage 1, 2 or 3), but the Trainer's "
                f"optimizer is {type(optimizer).__name__} (ZeRO stage 0, or the engine has not been built yet). Set "
                "zero_optimization.stage to 1, 2 or 3, or train with DDP or FSDP2"
            )
        zero, stage = found
        if zero.dtype == torch.float16:
            raise ValueError(
                "GNMRCallback: DeepSpeed fp16 is not supported: its loss scaler multiplies the partitioned "
                "gradients and skips overflowing steps inside the ZeRO optimizer, where GNMR cannot see either. Use "
                'bf16 ("bf16": {"enabled": true}) or fp32'
            )
        check_backend(stage, backend)
        return cls(zero, stage)

    def install(self, units: Sequence[Any], sink: Callable[[torch.Tensor, torch.Tensor], None]) -> _StepWrap:
        """Read the norms of `units` just before every ZeRO optimizer step and hand them to `sink(norms, missing)`.
        Returns a handle whose `remove()` undoes it."""
        self._prepare(units)
        original = self.optimizer.step
        shadowed = "step" in vars(self.optimizer)

        def step(*args: Any, **kwargs: Any) -> Any:
            sink(*self.compute())
            return original(*args, **kwargs)

        self.optimizer.step = step
        return _StepWrap(self.optimizer, step, original, shadowed)

    def _prepare(self, units: Sequence[Any]) -> None:
        groups = self.optimizer.fp16_groups if self.stage == 3 else self.optimizer.bit16_groups
        managed = {id(p) for group in groups for p in group}
        self.num_units = len(units)
        self.tensors, self.meters, owner = [], [], []
        static_missing = []
        for i, unit in enumerate(units):
            tensors = [t for t in unit.signal_tensors() if id(t) in managed]
            self.tensors.extend(tensors)
            owner.extend([i] * len(tensors))
            if not tensors and unit.output_grad is not None:
                self.meters.append((i, unit.output_grad))
            # A unit whose signal tensors the optimizer does not train has no gradient on any rank.
            static_missing.append(not tensors and unit.output_grad is None)
        for t in self.tensors:
            if self.stage < 3 and not hasattr(t, "_hp_mapping"):
                raise RuntimeError(
                    "GNMRCallback: this DeepSpeed version links no gradient fragment to a ZeRO-1/2 parameter "
                    "(no _hp_mapping), which GNMR reads as safe_get_full_grad does; please report it"
                )
        first = self.tensors[0] if self.tensors else next(units[0].module.parameters())
        self.device = first.device
        self._grid = NormGrid(owner, self.num_units, self.device)
        self._static_missing = torch.tensor(static_missing, dtype=torch.bool, device=self.device)
        self._metered = torch.zeros(self.num_units, dtype=torch.bool, device=self.device)
        self._metered[[i for i, _ in self.meters]] = True

    def _local_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """The slice of `param`'s reduced gradient this rank owns, flat; None when it owns none."""
        if self.stage == 3:
            from deepspeed.utils import safe_get_local_grad

            return safe_get_local_grad(param)
        mapping = param._hp_mapping
        if mapping is None:
            return None
        fragment = mapping.get_lp_grad_fragment(param._index_in_param_group).flatten()
        if fragment.numel() == param.numel():
            # A full-size accumulation buffer (bf16): only the owned fragment counts, as in safe_get_full_grad.
            address = mapping.lp_fragment_address
            fragment = fragment.narrow(0, address.start, address.numel)
        return fragment

    def _local_squares(self) -> torch.Tensor:
        """[2, N]: this rank's per-unit sums of squared gradient slices and meter squares; which meters fired."""
        out = torch.zeros(2, self.num_units, dtype=torch.float32, device=self.device)
        present, grads = [], []
        for j, t in enumerate(self.tensors):
            g = self._local_grad(t)
            if g is not None and g.numel():
                present.append(j)
                grads.append(g)
        out[0] = self._grid.squares(grads, self._grid.slot_tensor(present))
        for i, meter in self.meters:
            value = meter.take()
            if value is not None:
                out[0, i] += value.to(self.device)
                out[1, i] = 1.0
        return out

    @torch.no_grad()
    def compute(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(norms float32 [N], missing bool [N]), identical on every rank; NaN where missing. One all-reduce."""
        error: BaseException | None = None
        try:
            local = self._local_squares()
        except Exception as err:  # still join the all-reduce, so that no rank waits forever
            error, local = err, torch.zeros(2, self.num_units, dtype=torch.float32, device=self.device)
        failed = torch.tensor([[0.0 if error is None else 1.0] * self.num_units], device=self.device)
        both = torch.cat([local, failed])
        torch.distributed.all_reduce(both, group=self.group)
        if both[2, 0].item() > 0:
            raise RuntimeError(
                f"GNMRCallback: reading the ZeRO gradients failed on {int(both[2, 0].item())} rank(s)"
            ) from error
        missing = self._static_missing | (self._metered & (both[1] == 0))
        return both[0].sqrt().masked_fill_(missing, torch.nan), missing
