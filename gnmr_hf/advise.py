"""`gnmr-hf advise TRACE`: turn a run into a static carve-out a user can keep.

    gnmr-hf advise runs/attn/gnmr_cause/seed0/gnmr_trace.jsonl

A unit the run *needed persistently* spent at least `--min_share` of the steps from its first entry into recovery to
the end of the run on the recovery path (default 0.5): what a static rule should keep off the cheap path. For those
units it prints the evidence (steps recovered, first entry, entries, why the cause policy recovered them, the loss it
measured on their cheap path, the units whose symptoms it was blamed for). A unit that the run did not hold (the
budget, `max_active`, was full) but that asked for recovery in at least `--min_share` of the steps from the first time
on is listed apart with its evidence: left out by the budget (the trace's `left_out`: the policy's candidates it could
not hold), or its traced loss past its bound (> 1); its cheap path was broken too, and a static rule, which has no
budget, should keep it off. Both kinds make the carve-out, printed in the forms users paste: this package's `exclude`
patterns, a torchao `module_filter_fn` (accelerate's `AORecipeKwargs(module_filter_func=...)` takes the same), and
bitsandbytes' `llm_int8_skip_modules`; and, for every unit, the precision it actually ran in (the share of steps on
each path). A trace of `policy="impact"` also ranks every unit by its impact (the mean of its traced estimates: what
its cheap path costs the loss), with the estimated share of the loss the top k buy, the smallest carve-outs that buy
90% and 99%, and the carve-out at `--budget` (a count of units, or a fraction of them), in the same forms. Every
pattern printed is checked against the trace's unit names, and so is every `--expect` pattern (a carve-out the user
already has): one that matches no unit is an error (exit status 2), not silence, since a filter that silently matches
nothing is how a carve-out gets lost (torchtitan PR #4008, accelerate PR #4147).
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from .planning import ImpactRanking, carve_out_forms

__all__ = ["Advice", "advise", "format_advice"]


@dataclass
class UnitEvidence:
    """What a trace says about one unit."""

    name: str
    recovered: int = 0
    first_entry: int | None = None
    entries: int = 0
    reasons: Counter[str] = field(default_factory=Counter)
    sources: Counter[str] = field(default_factory=Counter)
    losses: list[float] = field(default_factory=list)  # its cheap path's, as traced (`cause.cheap_loss`)
    broken: int = 0  # steps whose traced loss was past the bound
    first_broken: int | None = None
    left_out: int = 0  # steps the budget left it out (a candidate not held)
    first_left_out: int | None = None

    def asked_persistently(self, last: int, min_share: float) -> bool:
        """Broken, or left out by the budget, in at least `min_share` of the steps from the first time to `last`."""
        return any(
            first is not None and count >= min_share * (last - first + 1)
            for count, first in ((self.broken, self.first_broken), (self.left_out, self.first_left_out))
        )


@dataclass
class Advice:
    steps: int
    units: list[UnitEvidence]
    persistent: list[UnitEvidence]
    paths: list[str]
    backend: str
    # Broken or left out persistently, not held: the budget was full.
    unheld: list[UnitEvidence] = field(default_factory=list)
    max_active: int | None = None
    # The units ranked by impact, where the trace has it (policy="impact"): each unit's mean traced estimate.
    ranking: ImpactRanking | None = None

    @property
    def names(self) -> list[str]:
        """The carve-out: the units needed persistently, then those that asked persistently and were not held."""
        return [u.name for u in self.persistent + self.unheld]


def advise(path: str, min_share: float = 0.5) -> Advice:
    """Read a GNMR trace and find the units it needed persistently (see the module docstring)."""
    from .trace import read_trace  # here, not at the top: it imports torch, which `--help` and errors do not need

    header, records = read_trace(path)
    steps = [r for r in records if r.get("type") == "step"]
    if not steps:
        raise ValueError(f"{path}: the trace has no steps")
    names = list(header["units"])
    units = [UnitEvidence(n) for n in names]
    impact_sum, impact_count = [0.0] * len(names), [0] * len(names)
    for record in steps:
        step = int(record["step"])
        for i in record["active"]:
            units[i].recovered += 1
        for i in record["entered"]:
            units[i].entries += 1
            if units[i].first_entry is None:
                units[i].first_entry = step
        for i in record.get("left_out", ()):  # traces written before it was recorded have none
            units[i].left_out += 1
            if units[i].first_left_out is None:
                units[i].first_left_out = step
        for i, value in (record.get("impact") or {}).get("estimate", ()):
            impact_sum[i] += float(value)
            impact_count[i] += 1
        cause = record.get("cause")
        if cause:
            entered = set(record["entered"])
            for i, reason, source in cause["why"]:
                if i in entered:
                    units[i].reasons[reason] += 1
                    if source >= 0:
                        units[i].sources[names[source]] += 1
            for i, value in cause["cheap_loss"]:
                units[i].losses.append(float(value))
                if float(value) > 1:
                    units[i].broken += 1
                    if units[i].first_broken is None:
                        units[i].first_broken = step
    last = int(steps[-1]["step"])
    persistent = [
        u for u in units if u.first_entry is not None and u.recovered >= min_share * (last - u.first_entry + 1)
    ]
    held = {u.name for u in persistent}
    unheld = [u for u in units if u.name not in held and u.asked_persistently(last, min_share)]
    paths = header.get("paths") or ["low/high"] * len(names)
    max_active = (header.get("config") or {}).get("max_active")
    backend = str(header.get("backend", ""))
    ranking = None
    if any(impact_count):
        mean = [total / count if count else math.nan for total, count in zip(impact_sum, impact_count, strict=True)]
        source = f"trace: the mean of each unit's estimates over {len(steps)} steps"
        ranking = ImpactRanking(names, mean, backend, source)
    return Advice(len(steps), units, persistent, list(paths), backend, unheld, max_active, ranking)


def _pattern(name: str) -> str:
    return "^" + re.escape(name) + "$"


def unmatched(patterns: Sequence[str], names: Sequence[str]) -> list[str]:
    """The patterns of `patterns` that match no name (as `find_units` searches them)."""
    return [p for p in patterns if not any(re.search(p, n) for n in names)]


def format_advice(
    advice: Advice, expect: Sequence[str] = (), budget: int | float | None = None
) -> tuple[str, list[str]]:
    """The printed report and the list of errors (patterns that match no unit). Where the trace has impacts, the
    report ends with the units ranked by impact and the carve-outs they give (at `budget` too: a count of units, or
    a fraction of them); without them, a `budget` is an error: nothing ranks the units."""
    all_names = [u.name for u in advice.units]
    lines = [f"GNMR advice: {len(advice.units)} {advice.backend} units, {advice.steps} steps"]
    if not advice.persistent and not advice.unheld:
        lines.append("no unit needed the recovery path persistently: nothing to carve out")
    else:
        if advice.persistent:
            lines.append(f"units the run needed persistently ({len(advice.persistent)}):")
        for u in advice.persistent:
            share = u.recovered / advice.steps
            why = ", ".join(f"{r} x{c}" for r, c in u.reasons.most_common()) or "-"
            loss = f"median loss {statistics.median(u.losses):.3g}" if u.losses else "loss not traced"
            blamed = ", ".join(f"{s} x{c}" for s, c in u.sources.most_common(3))
            lines.append(
                f"  {u.name}: {u.recovered}/{advice.steps} steps recovered ({share:.0%}), first at step "
                f"{u.first_entry}, {u.entries} entries; why: {why}; {loss}"
                + (f"; symptoms in: {blamed}" if blamed else "")
            )
        if advice.unheld:
            cap = f"max_active={advice.max_active}" if advice.max_active is not None else "max_active"
            lines.append(
                f"units broken or left out persistently that the run did not hold ({len(advice.unheld)}; the budget, "
                f"{cap}, was full):"
            )
        for u in advice.unheld:
            evidence = []
            if u.first_left_out is not None:
                evidence.append(f"left out by the budget at {u.left_out} steps from step {u.first_left_out} on")
            if u.first_broken is not None:
                evidence.append(
                    f"loss past its bound at {u.broken} steps from step {u.first_broken} on, median "
                    f"{statistics.median(u.losses):.3g} over the {len(u.losses)} steps traced"
                )
            lines.append(f"  {u.name}: {'; '.join(evidence)}; {u.recovered} steps recovered")
        lines += ["", *carve_out_forms(advice.names)]
    lines += ["", "precision each unit ran in (cheap path / recovery path, share of steps):"]
    width = max(len(n) for n in all_names)
    for u, paths in zip(advice.units, advice.paths, strict=True):
        cheap, _, high = (f"{p}-bit" if p.isdigit() else p for p in paths.partition("/"))
        share = u.recovered / advice.steps
        lines.append(f"  {u.name:<{width}}  {cheap} {1 - share:.1%} / {high or '?'} {share:.1%}")
    errors = [
        f"pattern {p!r} ({what}) matches no unit"
        for what, pats in (("advised", [_pattern(n) for n in advice.names]), ("--expect", list(expect)))
        for p in unmatched(pats, all_names)
    ]
    if advice.ranking is not None:
        lines += ["", advice.ranking.format(budget=budget)]
    elif budget is not None:
        errors.append(
            "--budget: this trace has no impact estimates to rank the units by (a run with policy='impact' writes "
            "them; monitor_only=True to change nothing), or rank them before training with `gnmr-hf plan`"
        )
    return "\n".join(lines), errors
