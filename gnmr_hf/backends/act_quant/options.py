"""The options of the act_quant backend: which units (`kinds`), their bits on each path, the absmax scaling, and the
attention backward's guards (docs/act_quant.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...signals import SignalOptions, signal_option
from .saving import UNQUANTIZED, SaveSpec

KINDS = ("linear", "attention", "mlp", "norm", "head")
SCALINGS = ("tensor", "row", "group")
BITS = (2, 3, 4, 5, 6, 7, 8, UNQUANTIZED)


@dataclass
class ActQuantOptions(SignalOptions):
    """Options of the `act_quant` backend (see docs/act_quant.md)."""

    low_bits: int = field(
        default=4, metadata={"help": "Bits of the saved activations on the cheap path: 2..8, or 16 (unquantized)."}
    )
    high_bits: int = field(
        default=8, metadata={"help": "Bits of the saved activations in recovery: 2..8, or 16; >= low_bits."}
    )
    scaling: str = field(
        default="tensor",
        metadata={
            "help": "Absmax scale granularity: 'tensor' (one per saved tensor), 'row' (one per row of the last "
            "dimension: per token, per token and head for q/k/v) or 'group' (one per group_size elements of it)."
        },
    )
    group_size: int = field(
        default=32, metadata={"help": "Elements per scale with scaling='group'; must divide the last dimension."}
    )
    stochastic: bool = field(default=False, metadata={"help": "Stochastic (unbiased) rounding instead of nearest."})
    kinds: list[str] = field(
        default_factory=lambda: ["linear"],
        metadata={
            "help": "Which units to make: 'linear' (nn.Linear saved inputs), 'attention' (saved q, k, v of "
            "attention), 'mlp' (the SwiGLU product's operands), 'norm' (RMSNorm inputs), 'head' (the output head's "
            "input, with the loss in chunks) or 'all'; several separated by ';' on the command line, e.g. "
            "'kinds=linear;attention'."
        },
    )
    renormalize: bool = field(
        default=False,
        metadata={"help": "Attention backward: divide the recomputed probabilities by their row sum (ablation)."},
    )
    max_row_total: float = field(
        default=1.0,
        metadata={
            "help": "Attention backward: a recomputed probability row whose sum exceeds this is scaled down to it "
            "(a row of probabilities sums to at most 1); rows below keep what the cheap path lost. > 0; 'inf' "
            "leaves the rows as recomputed, as the tiny-model tables of docs/results.md were measured."
        },
    )
    signal: str = signal_option(
        note=" Linear, norm and head units: attention units use their q/k/v projection weights, mlp units their "
        "gate/up projections' LoRA adapters or weights."
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        self.check_choice("low_bits", BITS)
        self.check_choice("high_bits", BITS)
        if self.high_bits < self.low_bits:
            raise ValueError(
                f"option 'high_bits' must be >= low_bits (the recovery path is the high-fidelity one), "
                f"got high_bits={self.high_bits}, low_bits={self.low_bits}"
            )
        self.check_choice("scaling", SCALINGS)
        self.check_int("group_size", 1)
        if not (isinstance(self.max_row_total, (int, float)) and self.max_row_total > 0):  # refuses nan too
            raise ValueError(
                f"option 'max_row_total' must be a number > 0 (1.0: rows of probabilities sum to at most 1; 'inf': "
                f"no cap), got {self.max_row_total!r}"
            )
        self.max_row_total = float(self.max_row_total)
        kinds = [self.kinds] if isinstance(self.kinds, str) else list(self.kinds)
        if kinds == ["all"]:
            kinds = list(KINDS)
        if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds):
            raise ValueError(
                f"option 'kinds' must be a non-empty list of distinct values from {list(KINDS)}, or 'all', got "
                f"{self.kinds!r}"
            )
        self.kinds = kinds

    def spec(self, bits: int) -> SaveSpec:
        """How to save a tensor at `bits` with these options (one `SaveSpec` per value, kept: every forward asks)."""
        key = (bits, self.scaling, self.group_size, self.stochastic)
        specs = self.__dict__.setdefault("_specs", {})
        if key not in specs:
            specs[key] = SaveSpec(*key)
        return specs[key]

    def extra_bytes(self, *tensors: torch.Tensor) -> int:
        """Bytes saving `tensors` at `high_bits` takes beyond saving them at `low_bits`: what recovery holds."""
        high, low = self.spec(self.high_bits), self.spec(self.low_bits)
        return sum(high.nbytes(t.shape, t.element_size()) - low.nbytes(t.shape, t.element_size()) for t in tensors)
