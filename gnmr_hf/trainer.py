"""`GNMRTrainer`: a `transformers.Trainer` with GNMR wired in; swap the class and pass `gnmr_config=`.

    trainer = GNMRTrainer(model=model, args=args, train_dataset=ds, gnmr_config=GNMRConfig(max_active=4))

It behaves exactly like `Trainer(...)` plus `add_callback(GNMRCallback(gnmr_config))`, except that the callback
is put first in the callback list, so the GNMR metrics it adds to each log reach every reporting integration.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch import nn
from transformers import Trainer

from .callback import GNMRCallback
from .config import GNMRConfig

__all__ = ["GNMRTrainer"]


class GNMRTrainer(Trainer):
    """`Trainer` + GNMR. Extra args: `gnmr_config` (a `GNMRConfig` or dict) and `gnmr_module_filter_fn`."""

    def __init__(
        self,
        *args: Any,
        gnmr_config: GNMRConfig | dict[str, Any] | None = None,
        gnmr_module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
        **kwargs: Any,
    ) -> None:
        # Built first: it checks the config's backend and options, so a mistake there is reported before the
        # Trainer prepares (moves, wraps) the model.
        # First in the list: Trainer.log() hands one dict to the callbacks in order, so the reporting
        # integrations after it see the GNMR metrics it adds.
        gnmr = GNMRCallback(gnmr_config, module_filter_fn=gnmr_module_filter_fn, ahead_of_reporting=True)
        super().__init__(*args, **kwargs)
        self.gnmr = gnmr
        self.callback_handler.callbacks.insert(0, self.gnmr)

    def train(self, *args: Any, **kwargs: Any) -> Any:
        output = super().train(*args, **kwargs)
        # restore_callback_states_from_checkpoint rebuilds the callback object; keep `self.gnmr` pointing at
        # the one that ran.
        for callback in self.callback_handler.callbacks:
            if isinstance(callback, GNMRCallback):
                self.gnmr = callback
                break
        return output
