"""A x100 spike in one rank's *local* gradient, for the multi-process workers: if the ranks read the same norms
after the reduction, both see it; if one read its local gradient, only rank 0 would."""

from __future__ import annotations

from transformers import TrainerCallback


class LocalSpike(TrainerCallback):
    """x100 on the gradients of parameters whose name contains `spiked`, on `rank` 0's micro-batches of optimizer
    step `step` only, before the reduction across ranks."""

    def __init__(self, spiked: str, step: int, rank: int) -> None:
        self.spiked, self.step, self.rank = spiked, step, rank
        self.armed = False

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        for name, p in model.named_parameters():
            if p.requires_grad and self.spiked in name:
                p.register_hook(lambda g: g * 100.0 if self.armed and self.rank == 0 else g)
        self.armed = False

    def on_step_begin(self, args, state, control, **kwargs):
        self.armed = state.global_step + 1 == self.step
