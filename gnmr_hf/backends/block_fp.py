"""`block_fp`: every GEMM of a Linear, forward and backward, on block-scaled low-bit floats, DeepSeek-V3 style: a
cheap low-bit format (default FP6 e3m2) on the cheap path, FP8 e4m3 (or e5m2, or BF16) in recovery. The paper's
second scenario, emulated on the CPU with exact rounding.

A Linear `y = x W^T + b` runs three GEMMs per training step, and this backend rounds the two inputs of each one:

| GEMM  | computes    | contracts over   | first input, scaled per     | second input, scaled per     |
|-------|-------------|------------------|-----------------------------|------------------------------|
| fprop | y = x W^T   | in_features (K)  | x: 1 token x 128 channels   | W: 128 x 128 block           |
| dgrad | dx = dy W   | out_features (N) | dy: 1 token x 128 channels  | W: the same 128 x 128 blocks |
| wgrad | dW = dy^T x | tokens (M)       | dy: 128 tokens x 1 channel  | x: 128 tokens x 1 channel    |

That is DeepSeek-V3's fine-grained quantization (technical report, section 3.3.2): activations and output
gradients in 1x128 tiles, weights in 128x128 blocks, one FP32 scale `amax / max_finite` each, computed online
from the tensor itself (no history). A tile always runs along the GEMM's *contraction* dimension, so that its
scale factors out of each 128-element partial sum, which the hardware then promotes to FP32 with that scale.
Hence the wgrad's tiles run along the tokens: DeepSeek "converts the activation from a 1x128 tile to a 128x1
tile in the backward pass", and DeepGEMM's and torchao's wgrad kernels (`fp8_blockwise_mm` in
`torchao.prototype.blockwise_fp8_training`) scale both inputs per 128 tokens. A 128x128 block is symmetric under
transposition, so the one quantized weight serves the fprop and the dgrad. The obvious alternative, one tiling
per tensor whatever the GEMM (say, x per token everywhere), would put a scale inside each wgrad partial sum:
no real kernel can run it, so it would emulate nothing.

`scaling="mx"` is the OCP Microscaling alternative, which Blackwell GPUs run natively: 32-element blocks along
the contraction dimension for every input (weights too: 1x32 for the fprop, 32x1 for the dgrad, so the weight
is quantized twice) with power-of-two (E8M0) scales.

The rounding is `gnmr_hf.quant.quantize_blocks` (torch's float8 casts for e4m3/e5m2, exact bit-level rounding
for FP4/FP6, saturating, NaN/inf kept visible: a non-finite value poisons its own block only); the scaled
values are multiplied in float32 with autocast off, which is what the FP32 promotion of DeepSeek's partial sums
computes (it does not model the ~14-bit accumulators of H800 tensor cores that the promotion works around).
`high_format="bf16"` rounds the inputs to bfloat16, without scales, as a plain BF16 GEMM does. The bias, not a
GEMM, is added in float32, and its gradient is the exact column sum of dy. The output has the input's dtype
(autocast's under autocast, as `nn.Linear` does), dx the input's and dW the weight's.

Carve-outs (DeepSeek-V3 keeps the embedding, the output head, the MoE gating, the normalizations and the
attention operators in their original precision): only `nn.Linear` modules can be units, so embeddings, norms,
the attention softmax and its two matmuls, and transformers' MoE routers and fused experts (3-D Parameters, not
`nn.Linear`) are never touched. The output head *is* an `nn.Linear`; it is left out unless
`quantize_lm_head=True` (it is the model's `get_output_embeddings()`, or a module named `lm_head`). Anything
else is chosen with `find_units`' `include` / `exclude` / `module_filter_fn`.

A flip costs nothing: both paths are the same Function over the same master weight, differing only in the
format they round to, so entering recovery allocates nothing (0 bytes in the ledger), adds no Parameter and
never touches the optimizer. The format is read when the forward runs and travels with the autograd graph, so
a step already in flight finishes in the format it started with: a decision made from step t's gradients
applies from step t + 1.

Evaluation: in eval mode (`model.eval()`, as `Trainer.evaluate` sets it) a unit runs the plain `F.linear`,
unless `quantize_eval=True`. The validation loss then measures the trained weights, the same way in every arm
of a comparison, and not whichever formats GNMR's recovery set happened to hold at that moment; set it to
quantize inference too (as serving in FP8 would).

Cost: per unit and step the emulation rounds four activation-sized tensors (x and dy, each in its two tilings)
and the weight twice (fprop and dgrad), each in a few elementwise passes; on the probe-scale model that doubles
the CPU time of a training step (docs/block_fp.md measures it per format). That is the emulation's cost, not the
method's: on FP8 hardware the rounding is fused into the GEMMs' operand loads and the low format is the cheap one.
Real FP8 kernels are not wired in: torchao 0.18's `fp8_blockwise_mm` runs this very recipe in e4m3 on SM90
GPUs (bf16 inputs, dimensions multiple of 128, no bias), but no such GPU was available to test it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..quant import FORMATS, quantize_blocks
from ..units import Backend, BackendOptions, DispatchContext, display_name
from .adapters import SIGNALS, resolve_signal, signal_option, tuner_layer
from .switch import SwitchedUnit

__all__ = [
    "BLOCK_FP",
    "BlockFPLinear",
    "BlockFPOptions",
    "BlockFPUnit",
    "GemmFormat",
    "block_fp_linear",
    "dispatch_block_fp",
]

HIGH_FORMATS = ("e4m3", "e5m2", "bf16")
SCALINGS = ("fp32", "mx")
# DeepSeek-V3's tile and block edge with FP32 scales; the OCP MX block with power-of-two scales.
TILE = 128
MX_BLOCK = 32


@dataclass(frozen=True)
class GemmFormat:
    """How one path rounds the inputs of a Linear's GEMMs: an element format (a key of `quant.FORMATS`, or "bf16")
    and a scaling mode ("fp32": 1x128 tiles, 128x128 weight blocks, FP32 scales; "mx": 32-element blocks,
    power-of-two scales)."""

    fmt: str
    scaling: str

    def operand(self, t: torch.Tensor, contract: int, *, weight: bool = False) -> torch.Tensor:
        """2-D `t` as a GEMM multiplies it, float32: blocks run along dimension `contract` (0 rows, 1 columns) of t,
        the dimension the GEMM sums over; with `weight=True` and FP32 scaling, 128x128 blocks whatever `contract`."""
        if self.fmt == "bf16":
            return t.to(torch.bfloat16).to(torch.float32)
        if self.scaling == "mx":
            return quantize_blocks(t, self.fmt, (1, MX_BLOCK) if contract else (MX_BLOCK, 1), scale="pow2")
        if weight:
            return quantize_blocks(t, self.fmt, (TILE, TILE))
        return quantize_blocks(t, self.fmt, (1, TILE) if contract else (TILE, 1))


class BlockFPLinear(torch.autograd.Function):
    """`x W^T + b` with the inputs of its fprop, dgrad and wgrad GEMMs rounded as `fmt` says (see the module
    docstring for the tiles). Saves x and W themselves (references, no copy) and quantizes again in the backward,
    so that each GEMM input is rounded exactly once from its exact value. Call it with autocast off
    (`block_fp_linear` does)."""

    @staticmethod
    def forward(
        ctx: Any,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        fmt: GemmFormat,
        out_dtype: torch.dtype,
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        out = fmt.operand(x2, 1) @ fmt.operand(weight, 1, weight=True).t()
        if bias is not None:
            out += bias
        ctx.save_for_backward(x, weight)
        ctx.fmt, ctx.has_bias = fmt, bias is not None
        return out.reshape(*x.shape[:-1], weight.shape[0]).to(out_dtype)

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight = ctx.saved_tensors
        fmt: GemmFormat = ctx.fmt
        g2 = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        # The backward runs outside the forward's autocast-off context; an enclosing autocast must not recast the
        # float32 emulated operands either.
        with torch.autocast(grad_out.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                grad_x = fmt.operand(g2, 1) @ fmt.operand(weight, 0, weight=True)
                grad_x = grad_x.reshape(x.shape).to(x.dtype)
            if ctx.needs_input_grad[1]:
                x2 = x.reshape(-1, x.shape[-1])
                grad_w = (fmt.operand(g2, 0).t() @ fmt.operand(x2, 0)).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = g2.sum(0, dtype=torch.float32).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None


def block_fp_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fmt: GemmFormat) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with every GEMM input, forward and backward, rounded as `fmt` says. Under
    autocast the output has autocast's dtype (as `nn.Linear`'s would), but the emulated GEMMs stay float32."""
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        return BlockFPLinear.apply(x, weight, bias, fmt, out_dtype)


@dataclass
class BlockFPOptions(BackendOptions):
    """Options of the `block_fp` backend (see the module docstring)."""

    backend: ClassVar[str] = "block_fp"

    low_format: str = field(
        default="e3m2",
        metadata={
            "help": f"Element format of the cheap path's GEMM inputs: one of {sorted(FORMATS)} (e2m1 = FP4, "
            "e2m3 and e3m2 = FP6, e4m3 and e5m2 = FP8)."
        },
    )
    high_format: str = field(
        default="e4m3",
        metadata={"help": f"Element format of the recovery path's GEMM inputs: one of {list(HIGH_FORMATS)}."},
    )
    scaling: str = field(
        default="fp32",
        metadata={
            "help": "'fp32': DeepSeek-V3's 1x128 tiles (activations, gradients) and 128x128 blocks (weights) with "
            "FP32 scales; 'mx': OCP MX, 32-element blocks with power-of-two scales."
        },
    )
    quantize_lm_head: bool = field(
        default=False,
        metadata={"help": "Make the output head (lm_head) a unit too; DeepSeek-V3 keeps it in high precision."},
    )
    quantize_eval: bool = field(
        default=False,
        metadata={"help": "In eval mode, quantize as in training (default: eval runs the plain F.linear)."},
    )
    signal: str = signal_option()

    def __post_init__(self) -> None:
        self.check_choice("low_format", sorted(FORMATS))
        self.check_choice("high_format", HIGH_FORMATS)
        if self.high_format == self.low_format:
            raise ValueError(
                f"block_fp option 'high_format' must differ from low_format (the recovery path would be the cheap "
                f"path), got both {self.low_format!r}"
            )
        self.check_choice("scaling", SCALINGS)
        for name in ("quantize_lm_head", "quantize_eval"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"block_fp option {name!r} must be True or False, got {getattr(self, name)!r}")
        self.check_choice("signal", SIGNALS)


class BlockFPUnit(SwitchedUnit):
    """One `nn.Linear` whose GEMMs run on `low_format` (cheap) or `high_format` (recovery). Build it with
    `find_units(model, "block_fp")`, not directly."""

    def __init__(self, name: str, module: nn.Linear, *, options: BlockFPOptions, **kwargs: Any) -> None:
        self.options = options
        self.low = GemmFormat(options.low_format, options.scaling)
        self.high = GemmFormat(options.high_format, options.scaling)
        super().__init__(name, module, backend="block_fp", **kwargs)

    def describe(self) -> dict[str, Any]:
        return {"signal": self.signal, "formats": f"{self.low.fmt}/{self.high.fmt}", "scaling": self.low.scaling}

    def recovery_bytes(self) -> int:
        return 0

    def _enter(self) -> int:
        return 0

    def cheap_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.low)

    def recovery_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.high)

    def _linear(self, x: torch.Tensor, fmt: GemmFormat) -> torch.Tensor:
        m = self.module
        if not m.training and not self.options.quantize_eval:
            return F.linear(x, m.weight, m.bias)
        return block_fp_linear(x, m.weight, m.bias, fmt)


def _output_head(ctx: DispatchContext) -> nn.Module | None:
    """The model's output projection: `get_output_embeddings()` of a transformers model, else a module named
    lm_head. Looked up once per `find_units` call."""
    if "block_fp_output_head" not in ctx.shared:
        get = getattr(ctx.model, "get_output_embeddings", None)
        head = get() if callable(get) else None
        if head is None:
            head = dict(ctx.model.named_modules()).get("lm_head")
        ctx.shared["block_fp_output_head"] = head
    return ctx.shared["block_fp_output_head"]


def dispatch_block_fp(module: nn.Module, fqn: str, ctx: DispatchContext) -> BlockFPUnit | None:
    """A `BlockFPUnit` for an `nn.Linear` (the output head only with `quantize_lm_head=True`), else None."""
    options: BlockFPOptions = ctx.options  # type: ignore[assignment]
    if not isinstance(module, nn.Linear):
        return None
    if not options.quantize_lm_head and (module is _output_head(ctx) or display_name(fqn) == "lm_head"):
        return None
    name = display_name(fqn)
    tuner = tuner_layer(ctx, module)
    return BlockFPUnit(
        name,
        module,
        options=options,
        ledger=ctx.ledger,
        signal=resolve_signal(options.signal, name, module, tuner, "block_fp"),
        tuner=tuner,
    )


BLOCK_FP = Backend(
    name="block_fp",
    dispatchers=(dispatch_block_fp,),
    options=BlockFPOptions,
    hint=(
        "The block_fp backend manages nn.Linear layers (the output head only with quantize_lm_head=True); check "
        "include/exclude, or choose the backend that matches the model's layers (GNMRConfig.backend)."
    ),
)
