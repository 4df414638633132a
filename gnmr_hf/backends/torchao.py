"""torchao backend: `torchao_float8`, a `Float8Linear` on the cheap path, the plain high-precision matmul in recovery.

torchao's float8 training swaps `nn.Linear` modules for `Float8Linear` with `convert_to_float8_training(model,
config=..., module_filter_fn=...)`: the master weight stays in high precision (it is the very Parameter the
`nn.Linear` had), and each forward and backward casts the input, the weight and the output gradient to FP8 with
dynamic scales before the three matmuls. Which linears stay in high precision is fixed at conversion, by
`module_filter_fn` (by hand, or torchao's size heuristics). This backend makes that choice at run time: convert
every linear that may run in FP8, and GNMR moves the riskiest few back to the high-precision matmul, under a
budget, then back. A dynamic `module_filter_fn`.

A unit is one `Float8Linear`, bare or as the base layer of a peft LoRA layer. The switch (`SwitchedUnit`):

- cheap path: the module's own forward, bit for bit (FP8 forward and backward, emulated or real, as configured).
- recovery path: `F.linear(x, W, b)` on the SAME master weight and bias, computed in the *recovery dtype*:
  - with autocast enabled for the input's device, autocast's dtype (`torch.get_autocast_dtype`), and the
    output stays in it: exactly what the unconverted `nn.Linear` computes under that autocast, and the dtype
    `Float8Linear` itself returns there;
  - otherwise the master weight's dtype, with the input cast to it (`Float8Linear` accepts an input of another
    dtype, `F.linear` does not) and the output cast back to the input's dtype, as `Float8Linear` returns it.
  With the usual input of the weight's dtype this is `nn.Linear.forward` exactly (the tests assert
  `torch.equal`). Gradients flow to the same master weight, so the optimizer sees nothing change.

A flip writes nothing: no Parameter or buffer is added, moved or cast in place, and the `Float8Linear`'s config,
`linear_mm_config` and any scales are untouched (dynamic scaling keeps no scale state between steps anyway).
Entering recovery allocates nothing either, so a unit holds 0 bytes in the ledger. The recovery forward's
temporaries are those of a plain `nn.Linear`: under autocast, the cast copy of the weight that autograd saves for
the backward pass, freed by it, as for any autocast linear.

Signal (`signal` option, see `adapters.resolve_signal`): ``auto`` takes the LoRA parameters when peft wraps the
unit, else the master weight's gradient (pretraining, the usual float8 use), else the output gradient.

torch.compile: float8 training is usually compiled (that is where its speed comes from). The switch adds one
graph break per unit (see `SwitchedUnit`); the cheap path still compiles as a frame of its own, the recovery path
runs eagerly, and no flip recompiles anything. docs/backends.md has the measurements.

torchao is optional (`pip install gnmr-hf[torchao]`) and imported only by the dispatcher, when `find_units` runs
with this backend: `import gnmr_hf`, `GNMRConfig(backend="torchao_float8")` and importing this file import none.
"""

from __future__ import annotations

import functools
import importlib.util
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..units import Backend, BackendOptions, DispatchContext, display_name
from .adapters import SIGNALS, resolve_signal, signal_option, tuner_layer
from .switch import SwitchedUnit

__all__ = ["TORCHAO_FLOAT8", "Float8Options", "Float8Unit", "dispatch_torchao_float8", "is_torchao_available"]


@functools.lru_cache
def is_torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


@dataclass
class Float8Options(BackendOptions):
    """Options of the `torchao_float8` backend."""

    backend: ClassVar[str] = "torchao_float8"

    signal: str = signal_option("its master weight")

    def __post_init__(self) -> None:
        self.check_choice("signal", SIGNALS)


class Float8Unit(SwitchedUnit):
    """One torchao `Float8Linear`: its FP8 matmuls on the cheap path, `F.linear` on the same master weight in
    recovery. Build it with `find_units(model, "torchao_float8")`, not directly."""

    def describe(self) -> dict[str, Any]:
        return {"signal": self.signal, "emulate": bool(self.module.config.emulate)}

    def recovery_bytes(self) -> int:
        return 0

    def _enter(self) -> int:
        return 0

    def recovery_forward(self, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.module.weight, self.module.bias
        if torch.is_autocast_enabled(x.device.type):
            # Casting to autocast's dtype here is what autocast itself does to an nn.Linear's arguments.
            dtype = out_dtype = torch.get_autocast_dtype(x.device.type)
        else:
            dtype, out_dtype = weight.dtype, x.dtype
        # The casts are no-ops in the usual case; autograd carries the gradient through them to the master weight.
        out = F.linear(x.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype))
        return out.to(out_dtype)


def dispatch_torchao_float8(module: nn.Module, fqn: str, ctx: DispatchContext) -> Float8Unit | None:
    """A `Float8Unit` for a torchao `Float8Linear`, else None."""
    if not is_torchao_available():
        return None
    from torchao.float8.float8_linear import Float8Linear

    if not isinstance(module, Float8Linear):
        return None
    name = display_name(fqn)
    options: Float8Options = ctx.options  # type: ignore[assignment]
    tuner = tuner_layer(ctx, module)
    return Float8Unit(
        name,
        module,
        ledger=ctx.ledger,
        signal=resolve_signal(options.signal, name, module, tuner, "torchao_float8"),
        backend="torchao_float8",
        tuner=tuner,
    )


TORCHAO_FLOAT8 = Backend(
    name="torchao_float8",
    dispatchers=(dispatch_torchao_float8,),
    options=Float8Options,
    hint=(
        "The torchao_float8 backend manages torchao Float8Linear layers: convert the model for float8 training "
        "first, torchao.float8.convert_to_float8_training(model, config=Float8LinearConfig(...), "
        "module_filter_fn=...) (pip install gnmr-hf[torchao]), or choose the backend that matches the model's "
        "low-precision layers (GNMRConfig.backend): bitsandbytes Linear8bitLt is 'bnb_int8', Linear4bit 'bnb_4bit'."
    ),
)
