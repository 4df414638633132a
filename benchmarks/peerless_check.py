"""Which units of a cause-policy run have no peers, how lossy they measured, and when the peerless rule fires.

    python benchmarks/peerless_check.py runs/fp4_mx_cause/gnmr_cause/seed0/gnmr_trace.jsonl

A unit without peers (`gnmr_hf.policies.cause.UnitRelations`: fewer than 3 of the same unit in other layers) is
compared with the median of all measured units: broken when its cheap path's loss is past the policy's `suspect` and
`peer_factor` times that median (docs/method.md, "Relations: families and peers"). For each trace this prints,
per peerless unit, the steps its loss is in the trace's top-k losses (`cause.cheap_loss`), its largest value, and the
steps on which the rule fires while its own bound does not (loss in (suspect, 1]): what the rule adds to a run
recorded before it, read from the recorded losses. The median is taken over the losses the trace lists (`trace_top_k`
lossiest units); with fewer listed than units it is an upper bound of the true median, so a step counted here fires
for certain and a step not listed (the unit below the k-th largest loss) could not have fired unless that loss was
past `suspect`. A trace written before the loss was named `cheap_loss` (`cause.severity`), or before the policy's
options left `GNMRConfig` (`cause_suspect`, `cause_peer_factor`), reads the same.
"""

from __future__ import annotations

import argparse
import statistics

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports():
    import torch

    from gnmr_hf.config import _CAUSE_FIELDS
    from gnmr_hf.policies.cause import CauseOptions, UnitRelations
    from gnmr_hf.trace import read_trace


def peerless_report(path: str) -> list[str]:
    header, steps = read_trace(path)
    units, config = header["units"], header["config"]
    # The options as the run had them: its policy_options, over an older trace's cause_* fields.
    old = {option: config[name] for name, option in _CAUSE_FIELDS.items() if name in config}
    options = CauseOptions.parse({**old, **(config.get("policy_options") or {})})
    suspect, factor = options.suspect, options.peer_factor
    # The policy's own grouping: a unit in no peer group has row -1.
    rows = UnitRelations.from_names(units).device_tensors(torch.device("cpu"))["peer_row"]
    peerless = (rows < 0).nonzero().flatten().tolist()
    lines = [f"{path}: {len(units)} units, {len(peerless)} without peers (suspect {suspect}, peer factor {factor})"]
    losses = [dict(s["cause"]["cheap_loss"]) for s in steps if s.get("type") == "step" and "cause" in s]
    for i in peerless:
        listed = [loss[i] for loss in losses if i in loss]
        fires = sum(
            1
            for loss in losses
            if i in loss and suspect < loss[i] <= 1 and loss[i] > factor * statistics.median(loss.values())
        )
        largest = f"{max(listed):.3f}" if listed else "-"
        lines.append(
            f"  {units[i]}: listed at {len(listed)} of {len(losses)} steps, largest {largest}, "
            f"the peerless rule fires (under its bound) at {fires} steps"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("traces", nargs="+", help="gnmr_trace.jsonl files of policy='cause' runs")
    for path in parser.parse_args().traces:
        print("\n".join(peerless_report(path)))


if __name__ == "__main__":
    main()
