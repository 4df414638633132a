"""peft adapters seen from a unit: which tuner layer wraps a module, which tensors are its adapters, and the
gradient a linear-like unit is scored on.

A unit is the *base* module (the INT8 `Linear8bitLt`, the `nn.Linear`...). With peft LoRA on it, the base module
is the `base_layer` of a tuner layer, and the trainable tensors, whose gradients exist, live on that tuner layer.
peft says which layer wraps which: every tuner layer is a `BaseTunerLayer` and `get_base_layer()` returns the
module it wraps, so the map is built from peft's own API, never from name suffixes. peft is imported lazily:
without it no module has a tuner layer.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..units import DispatchContext

__all__ = ["SIGNALS", "Signal", "active_adapters", "adapter_tensors", "resolve_signal", "signal_option", "tuner_layer"]

# The gradient a linear-like unit can be scored on; "auto" picks the first that exists in this order.
SIGNALS = ("auto", "lora", "weight", "output_grad")


def signal_option(weight: str = "its own trainable weight", note: str = "") -> Any:
    """The `signal` field every backend's options declare (validated with `check_choice("signal", SIGNALS)`)."""
    return field(
        default="auto",
        metadata={
            "help": f"The gradient a unit is scored on: 'lora' (its LoRA parameters), 'weight' ({weight}), "
            f"'output_grad' (the gradient of its output), or 'auto' (lora, else weight, else output_grad).{note}"
        },
    )


def tuner_layer(ctx: DispatchContext, module: nn.Module) -> nn.Module | None:
    """The peft tuner layer whose base layer is `module`, or None. The map is built once per `find_units` call."""
    layers = ctx.shared.get("peft_tuner_layers")
    if layers is None:
        layers = {}
        if importlib.util.find_spec("peft") is not None:
            from peft.tuners.tuners_utils import BaseTunerLayer

            for candidate in ctx.model.modules():
                if isinstance(candidate, BaseTunerLayer):
                    layers[id(candidate.get_base_layer())] = candidate
        ctx.shared["peft_tuner_layers"] = layers
    return layers.get(id(module))


def adapter_tensors(tuner: nn.Module) -> list[torch.Tensor]:
    """Trainable parameters of the active adapters of a peft tuner layer, in peft's own layer-name order.

    Several active adapters (`set_adapter(["a", "b"])`) all count. Keyed by identity: peft lists a DoRA layer's
    name twice in `adapter_layer_names`, and a parameter may be shared; counted twice it would double its share
    of the unit's norm.
    """
    active = set(tuner.active_adapters)
    tensors: dict[int, torch.Tensor] = {}
    for layer_name in tuner.adapter_layer_names:
        for adapter, layer in getattr(tuner, layer_name).items():
            if adapter not in active:
                continue
            params = [layer] if isinstance(layer, nn.Parameter) else list(layer.parameters())
            tensors.update((id(p), p) for p in params if p.requires_grad)
    return list(tensors.values())


def active_adapters(model: nn.Module) -> tuple[str, ...] | None:
    """The active adapters of a peft model (or of a transformers model with adapters loaded), else None."""
    value: Any = getattr(model, "active_adapters", None)
    if callable(value):  # transformers' integration: a method that raises when no adapter is loaded
        try:
            value = value()
        except (ValueError, AttributeError):
            return None
    if value is None:
        return None
    return (value,) if isinstance(value, str) else tuple(value)


@dataclass
class Signal:
    """What a unit is scored on: `kind` ("lora", "weight" or "output_grad") and the tensors whose `.grad` is the
    signal (empty for "output_grad", which meters the gradient of the module's output instead)."""

    kind: str
    tensors: list[torch.Tensor]


def resolve_signal(choice: str, name: str, module: nn.Module, tuner: nn.Module | None, backend: str) -> Signal:
    """The signal of a linear-like unit for the option `signal=choice`.

    "lora": the trainable tensors of the active adapters of the peft layer around the module; "weight": the
    module's own weight, when it is trainable; "output_grad": an `OutputGradMeter` on the module's output (it
    fires only where the output requires grad: before the first trainable parameter, call
    `model.enable_input_require_grads()`); "auto": lora, else weight, else output_grad.
    """
    lora = adapter_tensors(tuner) if tuner is not None else []
    weight = getattr(module, "weight", None)
    trainable_weight = isinstance(weight, torch.Tensor) and weight.requires_grad
    kind = choice
    if kind == "auto":
        kind = "lora" if lora else "weight" if trainable_weight else "output_grad"
    if kind == "lora" and not lora:
        raise ValueError(
            f"{backend} unit {name!r}: signal='lora' but the module has no peft adapter with trainable parameters; "
            "use signal='weight' or 'output_grad', or exclude it"
        )
    if kind == "weight" and not trainable_weight:
        raise ValueError(
            f"{backend} unit {name!r}: signal='weight' but its weight does not require grad; use signal='lora' or "
            "'output_grad'"
        )
    return Signal(kind, {"lora": lora, "weight": [weight], "output_grad": []}[kind])
