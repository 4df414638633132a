"""block_fp backend: every GEMM input of an `nn.Linear`, forward and backward, in a block-scaled low-bit float.

The cheap path rounds the input and weight (forward) and the output gradient (backward) to `low_format` (FP6 e3m2
by default, FP4 e2m1) with DeepSeek-V3 scaling (1x128 activation tiles, 128x128 weight blocks, FP32 scales), OCP
MX, or NVIDIA's NVFP4 recipe (1x16 blocks with E4M3 scales over an FP32 scale per tensor, 16x16 weight blocks, and
as options a random Hadamard rotation of the weight-gradient GEMM's inputs and stochastic rounding of the output
gradient); recovery does the same in `high_format` (FP8 e4m3, or BF16). Emulated with `gnmr_hf.quant`; the weight
itself is never written, so recovery holds nothing. Formats, scaling and error bounds: docs/block_fp.md.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..fidelity import TensorCache, pending_operand, resolve, take_rows
from ..quant import FORMATS, quantize_blocks, random_hadamard, rotate_rows
from ..signals import SignalOptions
from ..units import Backend, DispatchContext, RecoverableUnit, SwitchedUnit, not_plain_linear

__all__ = [
    "BACKENDS",
    "BLOCK_FP",
    "BlockFPLinear",
    "BlockFPOptions",
    "BlockFPUnit",
    "GemmFormat",
    "block_fp_linear",
]

HIGH_FORMATS = ("e4m3", "e5m2", "bf16")
SCALINGS = ("fp32", "mx", "nvfp4")
WEIGHT_BLOCKS = ("16x16", "1x16")
# DeepSeek-V3's tile and block edge with FP32 scales; the OCP MX block with power-of-two scales; NVFP4's block (and
# its Hadamard rotation's size), with E4M3 scales.
TILE = 128
MX_BLOCK = 32
NVFP4_BLOCK = 16


@dataclass(frozen=True)
class GemmFormat:
    """How one path rounds the inputs of a Linear's GEMMs: an element format (a key of `quant.FORMATS`, or "bf16")
    and a scaling mode ("fp32": 1x128 tiles, 128x128 weight blocks, FP32 scales; "mx": 32-element blocks,
    power-of-two scales; "nvfp4": 1x16 blocks, E4M3 scales over an FP32 scale per tensor, and `weight_blocks`).

    NVFP4's other recipe parts, for any scaling: `wgrad_rht` rotates both inputs of the weight-gradient GEMM along
    the tokens by a 16x16 random Hadamard matrix (from `seed`; the product is unchanged in exact arithmetic), and
    `stochastic_rounding` rounds the output gradient stochastically, with draws seeded by (`seed`, `draw`, the
    GEMM): a unit sets `draw` per training pass, so that every rank and a resumed run draw the same numbers. `draw`
    is not compared: a format with another draw is the same format.

    `BlockFPLinear` rounds the Linear's input through `input_operand` and its output gradient through
    `grad_operand`, and a measure rounds sampled rows of them through `input_rows` and `grad_rows`: a format that
    treats either apart overrides those (`gnmr_hf/experiments/faults.py`, `benchmarks/head_gemm_split.py`)."""

    fmt: str
    scaling: str
    # Keyword-only, so that a subclass's own fields can still follow fmt and scaling positionally.
    weight_blocks: str = field(default="16x16", kw_only=True)
    wgrad_rht: bool = field(default=False, kw_only=True)
    stochastic_rounding: bool = field(default=False, kw_only=True)
    seed: int = field(default=0, kw_only=True)
    draw: int = field(default=0, kw_only=True, compare=False)

    def operand(
        self, t: torch.Tensor, contract: int, *, weight: bool = False, generator: torch.Generator | None = None
    ) -> torch.Tensor:
        """2-D `t` as a GEMM multiplies it, float32: blocks run along dimension `contract` (0 rows, 1 columns) of t,
        the dimension the GEMM sums over; with `weight=True`, FP32 scaling's 128x128 blocks and NVFP4's 16x16 ones
        (unless `weight_blocks="1x16"`) whatever `contract`. `generator`: round stochastically with its draws."""
        if self.fmt == "bf16":
            return t.to(torch.bfloat16).to(torch.float32)
        if self.scaling == "mx":
            block, scale = _along(MX_BLOCK, contract), "pow2"
        elif self.scaling == "nvfp4":
            square = weight and self.weight_blocks == "16x16"
            block, scale = (NVFP4_BLOCK, NVFP4_BLOCK) if square else _along(NVFP4_BLOCK, contract), "nvfp4"
        else:
            block, scale = (TILE, TILE) if weight else _along(TILE, contract), "fp32"
        return quantize_blocks(t, self.fmt, block, scale=scale, stochastic=generator is not None, generator=generator)

    def input_operand(self, x2: torch.Tensor, contract: int) -> torch.Tensor:
        """`operand` of a Linear's input `x2` ([tokens, features]); along the tokens (the weight-gradient GEMM's
        input) rotated first with `wgrad_rht`, its rows then zero-padded to a multiple of 16."""
        if contract == 0 and self.wgrad_rht:
            x2 = rotate_rows(x2, _rotation(self.seed, x2.device))
        return self.operand(x2, contract)

    def grad_operand(self, g2: torch.Tensor, contract: int) -> torch.Tensor:
        """`operand` of a Linear's output gradient `g2` ([tokens, out features]), rotated as `input_operand` rotates
        the input, and rounded stochastically with `stochastic_rounding`."""
        if contract == 0 and self.wgrad_rht:
            g2 = rotate_rows(g2, _rotation(self.seed, g2.device))
        return self.operand(g2, contract, generator=self.grad_generator(g2.device, contract))

    def grad_generator(self, device: torch.device, contract: int) -> torch.Generator | None:
        """The generator of the output gradient's stochastic rounding in the GEMM that contracts over `contract`
        (None: round to nearest): seeded from (`seed`, `draw`, `contract`) alone, never from torch's global one."""
        if not self.stochastic_rounding:
            return None
        digest = hashlib.blake2b(f"{self.seed}/{self.draw}/{contract}".encode(), digest_size=8).digest()
        return torch.Generator(device).manual_seed(int.from_bytes(digest, "little") >> 1)

    def input_rows(self, x_rows: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """What `input_operand(x2, 1)` reads at the rows `index` of x2 (all when None), from those rows alone
        (`x_rows`): activation tiles run along a row, so the rows round apart as in the whole (with NVFP4 within
        the per-tensor scale, which here is the rows' own: an estimate)."""
        return self.operand(x_rows, 1)

    def grad_rows(self, g_rows: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
        """`input_rows` of the output gradient: what `grad_operand(g2, 1)` reads at the rows `index` of g2."""
        return self.operand(g_rows, 1, generator=self.grad_generator(g_rows.device, 1))


def _along(size: int, contract: int) -> tuple[int, int]:
    """A block of `size` elements along dimension `contract` of a 2-D operand."""
    return (1, size) if contract else (size, 1)


@functools.lru_cache(maxsize=8)
def _rotation(seed: int, device: torch.device) -> torch.Tensor:
    # One 16x16 matrix per run (every unit, every step), as the recipe's fixed random signs.
    return random_hadamard(NVFP4_BLOCK, seed, device=device)


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
        probe: Any = None,
    ) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        xq, wq = fmt.input_operand(x2, 1), fmt.operand(weight, 1, weight=True)
        out = xq @ wq.t()
        if bias is not None:
            out += bias
        ctx.save_for_backward(x, weight)
        ctx.fmt, ctx.has_bias = fmt, bias is not None
        ctx.probe = None if probe is None else _forward_probe(probe, fmt, x, x2, xq, weight, wq)
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
            measure_gq = ctx.probe is not None and ctx.probe[1] == fmt
            gq = fmt.grad_operand(g2, 1) if ctx.needs_input_grad[0] or measure_gq else None
            if ctx.probe is not None:
                _backward_probe(ctx.probe, fmt, g2, gq)
            if ctx.needs_input_grad[0]:
                grad_x = gq @ fmt.operand(weight, 0, weight=True)
                grad_x = grad_x.reshape(x.shape).to(x.dtype)
            if ctx.needs_input_grad[1]:
                x2 = x.reshape(-1, x.shape[-1])
                grad_w = (fmt.grad_operand(g2, 0).t() @ fmt.input_operand(x2, 0)).to(weight.dtype)
            if ctx.has_bias and ctx.needs_input_grad[2]:
                grad_b = g2.sum(0, dtype=torch.float32).to(weight.dtype)
        return grad_x, grad_w, grad_b, None, None, None


# probe: (the measuring unit, its cheap format, the units' shared cache). The fprop operands' loss is taken in the
# forward, the dgrad operand's (the output gradient) in the backward, one report of the worst, each on the unit's
# sample of rows; on the recovery path the cheap format rounds those rows a second time, only to measure (activation
# tiles are row-local, so the sampled rows round as in the whole). The output gradient has a row per token too: the
# same rows are read. An input several units read (q, k, v projections: one normalized hidden state; gate and up:
# another) is measured once, and that one part is reported by each of them. The weight (not a per-token tensor, and
# its 128x128 blocks are not row-local) is read whole, on the unit's every `recovery_every`-th step only
# (`BlockFPUnit.weight_part`).


@torch.no_grad()
def _forward_probe(
    probe: tuple[Any, GemmFormat, TensorCache], fmt: GemmFormat, x: torch.Tensor, x2: torch.Tensor, xq: torch.Tensor,
    weight: torch.Tensor, wq: torch.Tensor,
) -> tuple[Any, ...]:  # fmt: skip
    unit, cheap, cache = probe
    rows = unit.meter.rows(x2)
    # The units of a step draw the same rows (one index tensor, compared by identity).
    key = ("input", cheap, rows, x._version)
    x_part = cache.get(x, key)
    if x_part is None:
        x_rows = take_rows(x2, rows)
        xq_rows = take_rows(xq, rows) if cheap == fmt else cheap.input_rows(x_rows, rows)
        x_part = pending_operand(x_rows, xq_rows)
        cache.put(x, key, x_part)
    w_part = unit.weight_part(weight, wq if cheap == fmt else None)
    return unit, cheap, rows, [x_part, w_part]


@torch.no_grad()
def _backward_probe(probe: tuple[Any, ...], fmt: GemmFormat, g2: torch.Tensor, gq: torch.Tensor | None) -> None:
    unit, cheap, rows, forward_parts = probe
    g_rows = take_rows(g2, rows)
    cheap_g = take_rows(gq, rows) if cheap == fmt else cheap.grad_rows(g_rows, rows)
    unit.meter.report(*forward_parts, pending_operand(g_rows, cheap_g))


def block_fp_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, fmt: GemmFormat, probe: Any = None
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` with every GEMM input, forward and backward, rounded as `fmt` says. Under
    autocast the output has autocast's dtype (as `nn.Linear`'s would), but the emulated GEMMs stay float32.
    `probe`: (unit, cheap format), for the unit to report the loss of the cheap format on these operands."""
    device = x.device.type
    out_dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else x.dtype
    with torch.autocast(device, enabled=False):
        return BlockFPLinear.apply(x, weight, bias, fmt, out_dtype, probe)


@dataclass
class BlockFPOptions(SignalOptions):
    """Options of the `block_fp` backend (see docs/block_fp.md)."""

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
            "FP32 scales; 'mx': OCP MX, 32-element blocks with power-of-two scales; 'nvfp4': NVIDIA's NVFP4 "
            "(low_format e2m1 only), 1x16 blocks with E4M3 scales over an FP32 scale per tensor, weights in "
            "weight_blocks (the recovery path then keeps FP32 scaling, or bf16)."
        },
    )
    weight_blocks: str = field(
        default="16x16",
        metadata={
            "help": "With scaling=nvfp4, the weight's blocks: '16x16' (the recipe: the forward and the backward read "
            "the same quantized weight) or '1x16' (along the contraction dimension of each GEMM, as activations)."
        },
    )
    wgrad_rht: bool = field(
        default=False,
        metadata={
            "help": "Cheap path: rotate both inputs of the weight-gradient GEMM along the tokens by a 16x16 random "
            "Hadamard matrix (seeded by rounding_seed) before rounding them; the product is unchanged in exact "
            "arithmetic (NVFP4's recipe)."
        },
    )
    stochastic_rounding: bool = field(
        default=False,
        metadata={
            "help": "Cheap path: round the output gradient (the dgrad and wgrad GEMMs' input) stochastically, "
            "unbiased, with draws from rounding_seed and the unit's count of training passes (NVFP4's recipe)."
        },
    )
    rounding_seed: int = field(
        default=0,
        metadata={"help": "Seed of wgrad_rht's random signs and of stochastic_rounding's draws (not torch's RNG)."},
    )
    quantize_lm_head: bool = field(
        default=False,
        metadata={"help": "Make the output head (lm_head) a unit too; DeepSeek-V3 keeps it in high precision."},
    )
    quantize_eval: bool = field(
        default=False,
        metadata={
            "help": "In eval mode, quantize as in training (default: eval runs the plain F.linear). Applies while the "
            "units are open: an evaluation during training; the callback closes them at train end, after which the "
            "model is the plain one."
        },
    )
    impact_wgrad: bool = field(
        default=False,
        metadata={
            "help": "policy='impact': a unit's impact also weighs the cheap path's rounding of the weight-gradient "
            "GEMM's input (along the tokens), as act_quant's weighs a saved input: that weight gradient is the "
            "exact one of a forward through the rounded input. False: the forward's rounding alone."
        },
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("low_format", sorted(FORMATS))
        self.check_choice("high_format", HIGH_FORMATS)
        if self.high_format == self.low_format:
            raise ValueError(
                f"option 'high_format' must differ from low_format (the recovery path would be the cheap "
                f"path), got both {self.low_format!r}"
            )
        self.check_choice("scaling", SCALINGS)
        if self.scaling == "nvfp4" and self.low_format != "e2m1":
            raise ValueError(
                f"option 'low_format' must be 'e2m1' with scaling='nvfp4' (NVFP4's element format), got "
                f"{self.low_format!r}"
            )
        self.check_choice("weight_blocks", WEIGHT_BLOCKS)
        if self.weight_blocks != "16x16" and self.scaling != "nvfp4":
            raise ValueError(
                f"option 'weight_blocks' applies to scaling='nvfp4' only; with scaling={self.scaling!r} leave it "
                f"'16x16', got {self.weight_blocks!r}"
            )
        self.check_bool("wgrad_rht")
        self.check_bool("stochastic_rounding")
        self.check_int("rounding_seed", 0, 2**32 - 1)
        self.check_bool("quantize_lm_head")
        self.check_bool("quantize_eval")
        self.check_bool("impact_wgrad")


class BlockFPUnit(SwitchedUnit):
    """One `nn.Linear` whose GEMMs run on `low_format` (cheap) or `high_format` (recovery). Build it with
    `find_units(model, "block_fp")`, not directly. `low` and `high` are the two paths' `GemmFormat`s; an
    experiment may replace `low` (what the cheap path loses is measured on it on both paths)."""

    options: BlockFPOptions
    measures_impact = True
    fidelity_bound = (
        "GEMM inputs in low_format (input and weight of the fprop, output gradient of the dgrad): the worst of "
        "max(relative L2 error / 2, row-sum bias / 0.1)"
    )

    def __init__(self, name: str, module: nn.Module, ctx: DispatchContext[BlockFPOptions]) -> None:
        options = ctx.options
        self.low = GemmFormat(
            options.low_format,
            options.scaling,
            weight_blocks=options.weight_blocks,
            wgrad_rht=options.wgrad_rht,
            stochastic_rounding=options.stochastic_rounding,
            seed=options.rounding_seed,
        )
        # NVFP4 is an FP4 recipe: an FP8 recovery path keeps DeepSeek-V3's FP32-scaled tiles (bf16 has no scales).
        self.high = GemmFormat(options.high_format, "fp32" if options.scaling == "nvfp4" else options.scaling)
        self._cache = ctx.once(_probe_cache)
        self._weight_held: tuple[int, Any] | None = None
        # Training passes on the cheap path with stochastic rounding: each pass's draws (`GemmFormat.draw`).
        self._passes = 0
        super().__init__(name, module, ctx)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "formats": f"{self.low.fmt}/{self.high.fmt}", "scaling": self.low.scaling}

    def weight_part(self, weight: torch.Tensor, cheap_wq: torch.Tensor | None) -> Any:
        """The measured part of the weight on the cheap path (`cheap_wq`: its cheap rounding where the forward has
        it), measured on this unit's every `recovery_every`-th step (`meter.in_phase`) and reported again on the steps
        between, up to `recovery_every - 1` steps old.

        Why: the weight is a parameter, so its rounding changes only by what the optimizer moves it between steps
        (about `lr` of it), while reading it whole costs more than the unit's per-token operands together on a
        small model (docs/method.md, "The cause policy"). A unit in recovery measures on exactly these steps, so its
        weight part is always fresh. Within one step (micro-batches) the weight is measured once."""
        step, held = self.meter.step, self._weight_held
        if held is not None:
            age = step - held[0]
            if age == 0 or (0 < age < self.meter.recovery_every and not self.meter.in_phase(step)):
                return held[1]
        wq = self.low.operand(weight, 1, weight=True) if cheap_wq is None else cheap_wq
        part = pending_operand(weight, wq)
        self._weight_held = (step, part)
        return part

    def meter_state(self) -> dict[str, Any] | None:
        # The held weight measure: a resumed run reports it on the steps the uninterrupted run did (exactly: a
        # float32 loss survives JSON's float64). The count of passes that seeds stochastic rounding: a resumed run
        # draws what the uninterrupted one drew.
        state: dict[str, Any] = {}
        if self._weight_held is not None:
            step, part = self._weight_held
            state.update(weight_measured_at=step, weight_loss=float(resolve(part)))
        if self.options.stochastic_rounding:
            state["rounding_passes"] = self._passes
        return state or None

    def load_meter_state(self, state: dict[str, Any]) -> None:
        if "rounding_passes" in state:
            passes = state["rounding_passes"]
            if isinstance(passes, bool) or not isinstance(passes, int) or passes < 0:
                raise ValueError(f"block_fp unit {self.name!r}: 'rounding_passes' must be an int >= 0, got {passes!r}")
            self._passes = passes
            if state.keys() == {"rounding_passes"}:
                return
        try:
            step, loss = int(state["weight_measured_at"]), float(state["weight_loss"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(
                f"block_fp unit {self.name!r}: a meter state needs an int 'weight_measured_at' and a float "
                f"'weight_loss', got {state!r}"
            ) from e
        loss_tensor = torch.tensor(loss, dtype=torch.float32, device=self.module.weight.device)
        self._weight_held = (step, loss_tensor)

    def cheap_forward(self, x: torch.Tensor) -> torch.Tensor:
        low = self.low
        if self.options.stochastic_rounding and self.module.training and torch.is_grad_enabled():
            # One draw per training pass, from this unit's name and count alone: the same on every rank and, with
            # the count restored (`meter_state`), after a resume; a forward recomputed by gradient checkpointing
            # counts too, the same way in every run.
            self._passes += 1
            low = replace(low, draw=_draw(self.name, self._passes))
        return self._linear(x, low)

    def recovery_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._linear(x, self.high)

    def _linear(self, x: torch.Tensor, fmt: GemmFormat) -> torch.Tensor:
        m = self.module
        if not m.training and not self.options.quantize_eval:
            return F.linear(x, m.weight, m.bias)
        probe = (self, self.low, self._cache) if self.meter.due else None
        out = block_fp_linear(x, m.weight, m.bias, fmt, probe)
        if self.impact.due:
            out = self._offer_impact(x, out, fmt)
        return out

    @torch.no_grad()
    def _offer_impact(self, x: torch.Tensor, out: torch.Tensor, fmt: GemmFormat) -> torch.Tensor:
        """The cheap path's change of the output on the impact meter's sample of rows: what the cheap GEMM gives
        minus the exact one (in the output's dtype, so that its own rounding cancels). On the cheap path the cheap
        rows are the output's own; in recovery they are computed from the cheap rounding of the sampled input rows
        and of the weight, only to measure (the activation tiles are row-local, so the rows round as in the whole).
        The forward's error only: the backward's GEMMs round the same operands along other blocks, at the same
        order of error, a factor common to the units of the backend that a ranking does not see. Returns the output to
        hand on (`ImpactMeter.offer`: a leaf where it needs no gradient, as a frozen weight's on an input that needs
        none does)."""
        x2, out2 = x.reshape(-1, x.shape[-1]), out.reshape(-1, out.shape[-1])
        index = self.impact.rows(x2)
        x_rows = take_rows(x2, index).float()
        weight, bias = self.module.weight.float(), self.module.bias
        exact = F.linear(x_rows, weight, None if bias is None else bias.float()).to(out.dtype).float()
        if fmt == self.low:
            cheap = take_rows(out2, index).float()
        else:
            cheap_x, cheap_w = self.low.input_rows(x_rows, index), self.low.operand(weight, 1, weight=True)
            cheap = F.linear(cheap_x, cheap_w, None if bias is None else bias.float()).to(out.dtype).float()
        also = None
        if self.options.impact_wgrad and self.module.weight.requires_grad:
            # The weight gradient's input, rounded along the tokens (its blocks span rows, so the whole input is
            # rounded and the sampled rows taken), rotated back where wgrad_rht rotated it: the weight gradient is
            # that of Y' = x' W^T, so its change of the output is (x' - x) W^T with the exact weight.
            low = self.low
            wgrad_x = low.input_operand(x2.float(), 0)
            if low.wgrad_rht:
                wgrad_x = rotate_rows(wgrad_x, _rotation(low.seed, wgrad_x.device).t())
            also = F.linear(take_rows(wgrad_x[: x2.shape[0]], index) - x_rows, weight)
        return self.impact.offer(out, cheap - exact, index, in_forward=True, also=also)


def _draw(name: str, passes: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{name}/{passes}".encode(), digest_size=8).digest(), "little")


def _probe_cache(ctx: DispatchContext) -> TensorCache:
    return TensorCache()


def _output_head(ctx: DispatchContext) -> nn.Module | None:
    """The model's output projection: `get_output_embeddings()` of a transformers model, else a module named
    lm_head."""
    get = getattr(ctx.model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return head if head is not None else dict(ctx.model.named_modules()).get("lm_head")


def _block_fp_unit(module: nn.Module, ctx: DispatchContext[BlockFPOptions]) -> type[RecoverableUnit] | None:
    """Every `nn.Linear`, the output head only with `quantize_lm_head=True`."""
    if not isinstance(module, nn.Linear):
        return None
    if not ctx.options.quantize_lm_head and module is ctx.once(_output_head):
        return None
    # The unit computes its own GEMM from the module's weight in place of its forward: refuse a quantized layer
    # now, not at the first forward with a dtype or shape error deep in autograd.
    quantized = not_plain_linear(module)
    if quantized is not None:
        raise ValueError(
            f"backend 'block_fp' cannot take a {quantized} layer: block_fp wraps the plain nn.Linear layers of a "
            "model that is not quantized (it quantizes their GEMM inputs itself). For a bitsandbytes model use "
            "backend='bnb_int8' (Linear8bitLt) or 'bnb_4bit' (Linear4bit), for torchao Float8Linear "
            "'torchao_float8'; or keep these layers out with exclude"
        )
    return BlockFPUnit


BLOCK_FP = Backend(
    name="block_fp",
    unit_for=_block_fp_unit,
    options=BlockFPOptions,
    hint=(
        "The block_fp backend manages nn.Linear layers (the output head only with quantize_lm_head=True); check "
        "include/exclude, or choose the backend that matches the model's layers (GNMRConfig.backend)."
    ),
)

BACKENDS = (BLOCK_FP,)
