"""What the `block_fp` emulation costs per training step on a CPU, per format and scaling mode, vs the plain model.

    OMP_NUM_THREADS=1 python benchmarks/block_fp_cost.py --steps 10 --out runs/block_fp_cost.json
    OMP_NUM_THREADS=1 python benchmarks/block_fp_cost.py --steps 10 --only 'e2m1 (fp32|nvfp4)'

The probe-scale LLaMA of the pretraining recipe (d=128, 4 layers, batch 16 x 128 bytes), one forward + backward per
step, every q/k/v/o/gate/up/down projection a unit. Reported: CPU time of this process per step (median), which
other jobs on a shared machine disturb far less than wall time, and its ratio to the plain model. A unit in recovery
costs what a unit on the cheap path costs in its own format, so the rows are also the per-step cost of static_low
(low format) and static_high (high format); a GNMR step lies between them, by the share of units recovered.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from pathlib import Path

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("block_fp"):
    import torch

    from gnmr_hf import find_units
    from gnmr_hf.experiments.pretrain import build_model, llama_config

PROJECTIONS = [r"\.(q|k|v|o|gate|up|down)_proj$"]
# (label, block_fp options or None for the plain model)
SETTINGS = [
    ("plain fp32 (reference arm)", None),
    ("e2m1 fp32 scales", {"low_format": "e2m1"}),
    ("e2m3 fp32 scales", {"low_format": "e2m3"}),
    ("e3m2 fp32 scales", {"low_format": "e3m2"}),
    ("e4m3 fp32 scales", {"low_format": "e4m3", "high_format": "bf16"}),
    ("e5m2 fp32 scales", {"low_format": "e5m2"}),
    ("bf16", {"low_format": "e4m3", "high_format": "bf16", "recover": True}),
    ("e2m1 mx", {"low_format": "e2m1", "scaling": "mx"}),
    ("e3m2 mx", {"low_format": "e3m2", "scaling": "mx"}),
    ("e2m1 nvfp4", {"low_format": "e2m1", "high_format": "bf16", "scaling": "nvfp4"}),
    (
        "e2m1 nvfp4, 1x16 weights",
        {"low_format": "e2m1", "high_format": "bf16", "scaling": "nvfp4", "weight_blocks": "1x16"},
    ),
    (
        "e2m1 nvfp4 + wgrad_rht + stochastic_rounding",
        {
            "low_format": "e2m1",
            "high_format": "bf16",
            "scaling": "nvfp4",
            "wgrad_rht": True,
            "stochastic_rounding": True,
        },
    ),
]


def cpu_seconds_per_step(options: dict | None, steps: int) -> float:
    model = build_model(llama_config(d_model=128, n_layers=4, n_heads=4, seq_len=128), seed=0)
    ids = torch.randint(0, 256, (16, 128), generator=torch.Generator().manual_seed(0))
    options = dict(options or {})
    recover = options.pop("recover", False)
    units = find_units(model, "block_fp", include=PROJECTIONS, **options) if options else []
    for unit in units if recover else []:
        unit.enter_recovery()
    times = []
    for _ in range(steps + 1):  # the first step warms up the allocator and is not counted
        start = time.process_time()
        model(input_ids=ids, labels=ids).loss.backward()
        times.append(time.process_time() - start)
    for unit in units:
        unit.close()
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--only", default="", help="a regex: only the settings whose label it finds (and plain)")
    args = parser.parse_args()
    settings = [SETTINGS[0], *(s for s in SETTINGS[1:] if re.search(args.only, s[0]))]
    rows = [(label, cpu_seconds_per_step(options, args.steps)) for label, options in settings]
    plain = rows[0][1]
    print(f"threads {torch.get_num_threads()}, torch {torch.__version__}\n")
    print("| GEMM inputs | CPU s/step | vs plain |\n|---|---:|---:|")
    for label, seconds in rows:
        print(f"| {label} | {seconds:.3f} | {seconds / plain:.2f} |")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
