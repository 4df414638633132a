"""What the pretraining runs say: the arms' table, GNMR against the oracle, and how units re-enter recovery.

    python benchmarks/pretrain_analysis.py runs/attn                  # a recipe output_dir
    python benchmarks/pretrain_analysis.py runs/attn --plot docs/pretrain_attn.png --title "4/8-bit, q/k/v + linear"

Reads what `recipes/pretrain_actquant.py` wrote under the folder and prints, in markdown:

1. the results table (`gnmr_hf.experiments.pretrain.results_table`) and, with `--plot`, the loss curves;
2. GNMR against the oracle (`gnmr_hf.experiments.oracle.oracle_agreement`), per seed of every arm that probed
   it, with k its `max_active`: precision@k of GNMR's risk ranking and of random rankings, precision of the set it
   recovered and the share of the oracle's k largest values it holds, Spearman correlation of risk and gap beside
   random scores; and the units with the largest mean gap;
   the same against the counterfactual oracle (recovery benefits) for the runs that probed it
   (`--oracle_benefits`);
3. re-entry intervals from the traces of the gnmr arms: for every unit, the steps it spent on the cheap path
   between leaving recovery and being selected again. A re-entry within `lock_steps` of leaving is a *relapse* (the
   relapse-aware lock doubles the lock there); the table gives entries, relapses, the median interval, and the
   units that relapse most.
"""

from __future__ import annotations

import argparse
import statistics
from collections import Counter
from pathlib import Path

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports():
    from gnmr_hf.experiments.oracle import oracle_agreement, read_oracle
    from gnmr_hf.experiments.pretrain import load_results, plot_loss_curves, results_table
    from gnmr_hf.trace import read_trace


def reentries(trace: Path) -> tuple[list[str], list[tuple[int, int]], int, int]:
    """(unit names, [(unit, steps on the cheap path before re-entry)], entries, lock_steps) of one trace."""
    header, records = read_trace(trace)
    steps = [r for r in records if r["type"] == "step"]
    last_exit: dict[int, int] = {}
    intervals, entries = [], 0
    for record in steps:
        for unit in record["entered"]:
            entries += 1
            if unit in last_exit:
                intervals.append((unit, record["step"] - last_exit[unit]))
        for unit in record["exited"]:
            last_exit[unit] = record["step"]
    return header["units"], intervals, entries, header["config"]["lock_steps"]


def agreement_row(path: Path, names: list[str], records: list[dict], oracle: str) -> str:
    """One markdown row: the agreement of the run at `path` with `oracle`, and the units it ranks first on mean."""
    arm, seed = path.parts[-3], path.parts[-2]
    k = read_trace(path.parent / "gnmr_trace.jsonl")[0]["config"]["max_active"]
    agreement = oracle_agreement(records, k, oracle=oracle)
    finite = [r[oracle] for r in records if all(v == v for v in r[oracle])]
    means = [sum(values[i] for values in finite) / len(finite) if finite else float("nan") for i in range(len(names))]
    top = sorted(range(len(names)), key=lambda i: -means[i])[:4]
    largest = ", ".join(f"{names[i].replace('model.layers.', 'L')} {means[i]:.2g}" for i in top)
    return (
        f"| {arm} | {seed} | {agreement['probes']} | {agreement['precision_at_k']:.2f} | "
        f"{agreement['random_precision_at_k']:.2f} | {agreement['recovered_set_precision']:.2f} "
        f"({agreement['probes_with_recovered_units']}) | {agreement['recovered_share']:.2f} | "
        f"{agreement['spearman']:.2f} | "
        f"{agreement['random_spearman']:.2f} | {largest} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--plot", type=Path, default=None, help="Write the loss curves to this PNG.")
    parser.add_argument("--title", default="")
    cli = parser.parse_args()
    results = load_results(cli.root)
    print(results_table(results), "\n")
    if cli.plot:
        plot_loss_curves(results, cli.plot, title=cli.title)

    runs = [(path, *read_oracle(path)) for path in sorted(cli.root.glob("*/seed*/oracle.jsonl"))]
    for oracle, title in (("gaps", "largest mean gaps"), ("benefits", "largest mean benefits")):
        probed = [(path, names, records) for path, names, records in runs if records and oracle in records[0]]
        if oracle == "benefits" and not probed:
            continue
        print(f"Oracle: {oracle}\n")
        print(
            "| arm | seed | probes | precision@k GNMR | precision@k random | recovered-set precision "
            f"| recovered share | Spearman GNMR | Spearman random | {title} |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for path, names, records in probed:
            print(agreement_row(path, names, records, oracle))
        print()

    print("| arm | seed | entries | re-entries | relapses (<= lock_steps) | median interval | most relapsing units |")
    print("|---|---|---|---|---|---|---|")
    for trace in sorted(cli.root.glob("gnmr*/seed*/gnmr_trace.jsonl")):
        arm, seed = trace.parts[-3], trace.parts[-2]
        names, intervals, entries, lock_steps = reentries(trace)
        relapses = [u for u, gap in intervals if gap <= lock_steps]
        common = Counter(relapses).most_common(3)
        who = ", ".join(f"{names[u].replace('model.layers.', 'L')} x{n}" for u, n in common) or "-"
        median = statistics.median(g for _, g in intervals) if intervals else "-"
        print(f"| {arm} | {seed} | {entries} | {len(intervals)} | {len(relapses)} | {median} | {who} |")


if __name__ == "__main__":
    main()
