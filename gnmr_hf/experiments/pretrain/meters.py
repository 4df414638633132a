"""What an arm costs, measured where it is spent: seconds per optimizer step and bytes saved for backward.

`SavedTensorMeter` counts through torch's saved-tensor hooks, so the bytes are those of the tensors autograd really
keeps (a backend that stores its saved activations at 4 bits shows 4 bits here), not an estimate from shapes.
`StepMeter` is the Trainer callback that times each optimizer step and reads the meter once per step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn
from transformers import TrainerCallback

__all__ = ["SavedTensorMeter", "StepMeter"]


class SavedTensorMeter:
    """Counts the bytes autograd saves for backward inside a `with` block, through torch's saved-tensor hooks.

    Each storage is counted once (a tensor saved by several ops, or views of one buffer, cost its memory once), and
    storages in `exclude` (a model's parameters: saved by reference, not activations) not at all. `nbytes` is the
    total, `by_dtype` the split per saved dtype (uint8 = packed codes); `reset()` starts a new count.
    """

    def __init__(self, exclude: nn.Module | None = None) -> None:
        self._exclude = set() if exclude is None else {p.untyped_storage().data_ptr() for p in exclude.parameters()}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self.reset()

    def reset(self) -> None:
        self._seen: set[int] = set()
        self.nbytes = 0
        self.by_dtype: dict[str, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self._exclude and ptr not in self._seen:
            self._seen.add(ptr)
            self.nbytes += storage.nbytes()
            key = str(t.dtype).removeprefix("torch.")
            self.by_dtype[key] = self.by_dtype.get(key, 0) + storage.nbytes()
        return t

    def __enter__(self) -> SavedTensorMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


class StepMeter(TrainerCallback):
    """Seconds per optimizer step (on_step_begin to on_step_end) and bytes saved for backward per step.

    Put it last in the callback list, so that work other callbacks do at step begin (an oracle probe) is not
    timed or counted.
    """

    def __init__(self) -> None:
        self.seconds: list[float] = []
        self.saved_bytes: list[int] = []
        self._meter: SavedTensorMeter | None = None
        self._start = 0.0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._meter = SavedTensorMeter(exclude=model)
        self._meter.__enter__()

    def on_step_begin(self, args, state, control, **kwargs):
        assert self._meter is not None
        self._meter.reset()
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        assert self._meter is not None
        self.seconds.append(time.perf_counter() - self._start)
        self.saved_bytes.append(self._meter.nbytes)

    def on_train_end(self, args, state, control, **kwargs):
        if self._meter is not None:
            self._meter.__exit__(None, None, None)
            self._meter = None
