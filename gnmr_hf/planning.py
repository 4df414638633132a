"""The carve-out before training (`plan`) and the impact ranking it and `gnmr-hf advise` print (`ImpactRanking`).

    ranking = gnmr_hf.plan(model, batches, backend="block_fp", backend_options="low_format=e2m1")
    ranking.carve_out(0.15)          # the 15% of units whose cheap path costs the loss most
    print(ranking.format(budget=0.15))

`plan` is a calibration pass on the user's own model and data: the units are found as a run would find them, every
unit measures its impact (`gnmr_hf.impact`: what its cheap path costs the loss, in nats per token, from one forward
and backward) on every row of every batch, and the mean over the batches ranks them. No optimizer step is taken and
nothing is left on the model: the units are closed, the gradients it had are put back, its train/eval mode too, and
the random state is forked (a cheap path that rounds stochastically does not move the caller's stream).

The ranking turns into the carve-outs users paste, a unit list in four forms: this package's `exclude`, a torchao
`module_filter_fn`, accelerate's `AORecipeKwargs(module_filter_func=...)`, and bitsandbytes'
`llm_int8_skip_modules`. The share of the loss a carve-out buys is estimated as its units' share of the summed
impact: first-order in the units (recovering two units together is taken to buy the sum of what each buys alone).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch only where a plan runs: `gnmr-hf advise` prints a ranking without it
    import torch
    from torch import nn

__all__ = ["ImpactRanking", "parse_budget", "plan"]

# The shares of the summed impact for which `format` names the smallest carve-out.
SHARES = (0.9, 0.99)


def parse_budget(value: str | float | int, num_units: int | None = None, what: str = "budget") -> int | float:
    """A budget as given: a count of units (an int >= 1, at most `num_units` when known) or a fraction of them (a
    number in (0, 1)). Errors name `what` and what is allowed."""
    allowed = f"{what} must be a count of units (an int >= 1) or a fraction of them (a number in (0, 1))"
    if isinstance(value, bool):
        raise ValueError(f"{allowed}, got {value!r}")
    if isinstance(value, str):
        text = value.strip()
        try:
            number: float = int(text)
        except ValueError:
            try:
                number = float(text)
            except ValueError:
                raise ValueError(f"{allowed}, got {value!r}") from None
    elif isinstance(value, int | float):
        number = value
    else:
        raise ValueError(f"{allowed}, got {value!r}")
    if isinstance(number, int) or (float(number).is_integer() and number >= 1):
        count = int(number)
        if count < 1:
            raise ValueError(f"{allowed}, got {value!r}")
        if num_units is not None and count > num_units:
            raise ValueError(f"{what} {count} is more than the {num_units} units found")
        return count
    if not (0 < number < 1) or math.isnan(number):
        raise ValueError(f"{allowed}, got {value!r}")
    return float(number)


@dataclass
class ImpactRanking:
    """Units and their impact (nats per token; NaN: never measured), in controller order, and what they were
    measured on. `ranked` puts the largest first (ties to the lower index, unmeasured last)."""

    units: list[str]
    impact: list[float]
    backend: str = ""
    source: str = ""  # what the impacts come from: "plan: 4 batches of 4 x 128 tokens", "trace: ..."
    facts: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if len(self.units) != len(self.impact):
            raise ValueError(f"ImpactRanking: {len(self.units)} units but {len(self.impact)} impacts")

    @property
    def ranked(self) -> list[tuple[str, float]]:
        order = sorted(range(len(self.units)), key=lambda i: (math.isnan(self.impact[i]), -_key(self.impact[i]), i))
        return [(self.units[i], self.impact[i]) for i in order]

    @property
    def total(self) -> float:
        return sum(v for v in self.impact if not math.isnan(v))

    def count(self, budget: int | float) -> int:
        """The number of units a budget (a count, or a fraction of the units) takes."""
        if isinstance(budget, float):
            return max(1, round(budget * len(self.units)))
        return min(int(budget), len(self.units))

    def carve_out(self, budget: int | float | str) -> list[str]:
        """The units to keep off the cheap path at `budget` (a count, or a fraction of the units): the largest
        impacts, measured ones only."""
        k = self.count(parse_budget(budget, len(self.units)) if isinstance(budget, str) else budget)
        return [name for name, value in self.ranked[:k] if not math.isnan(value)]

    def curve(self) -> list[float]:
        """The estimated share of the summed impact the top k units buy, for k = 1..N."""
        total, running, shares = self.total, 0.0, []
        for _, value in self.ranked:
            running += 0.0 if math.isnan(value) else value
            shares.append(running / total if total > 0 else 0.0)
        return shares

    def smallest(self, share: float) -> list[str]:
        """The smallest carve-out whose units' summed impact reaches `share` of the total (empty when nothing is
        measured or the total is 0)."""
        if self.total <= 0:
            return []
        for k, reached in enumerate(self.curve(), start=1):
            if reached >= share - 1e-12:
                return [name for name, _ in self.ranked[:k]]
        return [name for name, _ in self.ranked]

    def to_dict(self, budget: int | float | None = None) -> dict[str, Any]:
        data: dict[str, Any] = {
            "backend": self.backend,
            "source": self.source,
            "ranked": [{"unit": n, "impact": None if math.isnan(v) else v} for n, v in self.ranked],
            "total_impact": self.total,
            "smallest": {f"{share:g}": self.smallest(share) for share in SHARES},
            **self.facts,
        }
        if budget is not None:
            data["budget"] = budget
            data["carve_out"] = self.carve_out(budget)
        return data

    def format(self, budget: int | float | None = None, top: int = 20) -> str:
        """The ranking, the curve at a few k, the smallest carve-outs for 90% and 99%, and the carve-out at
        `budget` in the four forms users paste."""
        n = len(self.units)
        lines = [
            f"impact ranking: {n} {self.backend} units ({self.source}); summed impact {self.total:.4g} nats/token"
        ]
        curve, ranked = self.curve(), self.ranked
        width = max((len(name) for name, _ in ranked[:top]), default=4)
        lines.append(f"  {'unit':<{width}}  impact (nats/token)  share  cumulative")
        for k, (name, value) in enumerate(ranked[:top]):
            share = value / self.total if self.total > 0 and not math.isnan(value) else 0.0
            shown = "not measured" if math.isnan(value) else f"{value:.4g}"
            lines.append(f"  {name:<{width}}  {shown:>19}  {share:5.1%}  {curve[k]:9.1%}")
        if n > top:
            lines.append(f"  ... and {n - top} more")
        marks = sorted({k for k in (1, 2, 4, 8, 16, 32, 64, 128, round(0.05 * n), round(0.15 * n)) if 1 <= k <= n})
        lines.append("estimated share of the loss bought by the top k units: " + ", ".join(
            f"k={k} {curve[k - 1]:.0%}" for k in marks
        ))  # fmt: skip
        for share in SHARES:
            units = self.smallest(share)
            lines.append(f"smallest carve-out reaching {share:.0%}: {len(units)} units ({len(units) / n:.1%})")
        if budget is not None:
            units = self.carve_out(budget)
            bought = curve[len(units) - 1] if units else 0.0
            lines += ["", f"carve-out at budget {budget!r}: {len(units)} units, an estimated {bought:.0%}"]
            lines += carve_out_forms(units)
        return "\n".join(lines)


def _key(value: float) -> float:
    return -math.inf if math.isnan(value) else value


def carve_out_forms(names: Sequence[str]) -> list[str]:
    """The carve-out `names` (units kept off the cheap path) in the forms users paste."""
    patterns = ["^" + re.escape(n) + "$" for n in names]
    return [
        "# gnmr_hf (GNMRConfig / find_units): keep these off the managed cheap path",
        f"exclude = {patterns!r}",
        "",
        "# torchao: convert_to_float8_training(model, config=..., module_filter_fn=module_filter_fn)",
        "CARVE_OUT = {" + ", ".join(map(repr, names)) + "}",
        "def module_filter_fn(module, fqn):",
        "    return fqn not in CARVE_OUT",
        "",
        "# accelerate: Accelerator(mixed_precision='fp8', kwargs_handlers=[AORecipeKwargs(",
        "#     module_filter_func=module_filter_fn)])  (the same function as torchao's, above)",
        "",
        "# bitsandbytes: BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=...)",
        f"llm_int8_skip_modules = {list(names)!r}",
    ]


def plan(
    model: nn.Module,
    batches: Iterable[Mapping[str, torch.Tensor]],
    *,
    backend: str = "block_fp",
    backend_options: Mapping[str, Any] | str | None = None,
    include: Sequence[str] | None = None,
    exclude: Sequence[str] | None = None,
    module_filter_fn: Callable[[nn.Module, str], bool] | None = None,
) -> ImpactRanking:
    """Rank `model`'s units of `backend` by what their cheap path costs the loss on `batches` (each a dict the
    model takes, with labels, so that its output has a `.loss`): one forward and backward per batch, every unit
    measured on every row, no optimizer step, nothing left on the model (see the module docstring)."""
    from .impact import impacts
    from .registry import find_units

    units = find_units(
        model,
        backend,
        include=include,
        exclude=exclude,
        module_filter_fn=module_filter_fn,
        backend_options=backend_options,
    )
    try:
        if not any(u.measures_impact for u in units):
            raise ValueError(
                f"plan: the {backend} units do not measure their impact; plan ranks the units that do: block_fp's, "
                "and act_quant's linear and head kinds"
            )
        return _calibrate(model, units, batches, backend, impacts)
    finally:
        units.close()


def _calibrate(model: nn.Module, units: Any, batches: Iterable[Any], backend: str, impacts: Any) -> ImpactRanking:
    import torch

    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("plan: the model has no parameter that requires grad, so no gradient reaches the units")
    grads, was_training = [p.grad for p in params], model.training
    device = params[0].device
    step = [0]
    for unit in units:
        unit.impact.start(0, clock=lambda: step[0], every=1)
    total = torch.zeros(len(units), dtype=torch.float64, device=device)
    seen = torch.zeros(len(units), dtype=torch.float64, device=device)
    losses, tokens = [], 0
    model.train()
    try:
        with torch.random.fork_rng(devices=[] if device.type == "cpu" else [device]):
            for batch in batches:
                for p in params:
                    p.grad = None
                output = model(**batch)
                loss = getattr(output, "loss", None)
                if loss is None:
                    raise ValueError("plan: the model returned no loss; each batch must hold labels")
                loss.backward()
                values = impacts([u.impact.take() for u in units], device).to(torch.float64)
                measured = ~values.isnan()
                total += values.nan_to_num(0.0)
                seen += measured
                losses.append(float(loss.detach()))
                tokens += int(batch["input_ids"].numel()) if "input_ids" in batch else 0
                step[0] += 1
    finally:
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        model.train(was_training)
    if not losses:
        raise ValueError("plan: no batch was given")
    mean = torch.where(seen > 0, total / seen.clamp_min(1), torch.nan).tolist()
    facts = {"batches": len(losses), "tokens": tokens, "loss": sum(losses) / len(losses)}
    source = f"plan: {len(losses)} batches, {tokens} tokens, cheap-path loss {facts['loss']:.4f}"
    return ImpactRanking([u.name for u in units], mean, backend, source, facts)
