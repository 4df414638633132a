"""Several processes and hard kills: DDP and FSDP2 on 2 CPU processes (gloo, loopback), SIGKILL and resume.

The workers live in tests/workers/; each test launches them as users do (`accelerate launch`, `torchrun`, plain
`python`) and fails with the workers' output.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gnmr_hf.trace import read_trace

from trainer_utils import free_port, launch

WORKERS = Path(__file__).parent / "workers"


def ranks(out: Path, prefix: str = "") -> tuple[dict, dict]:
    return tuple(json.loads((out / f"{prefix}rank{r}.json").read_text()) for r in (0, 1))


def test_ddp_ranks_read_the_same_norms_and_take_the_same_decisions(tiny_llama_dir, tmp_path):
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2"]
    port = ["--main_process_ip", "127.0.0.1", "--main_process_port", str(free_port())]
    launch([*accelerate, *port, str(WORKERS / "ddp_worker.py"), str(tiny_llama_dir), str(tmp_path)])
    for mode in ("lora", "meters"):
        zero, one = ranks(tmp_path, f"{mode}_")
        assert len(zero["records"]) == 10
        for a, b in zip(zero["records"], one["records"], strict=True):
            # A spike in rank 0's local gradient only; identical norms and decisions on both ranks.
            assert a == b, (mode, a["step"])
        step_6 = zero["records"][5]
        assert step_6["entered"] and not any(r["entered"] for r in zero["records"][:5])
    # The meters mode really scores units on output gradients each rank metered on its own data.
    assert "output_grad" in ranks(tmp_path, "meters_")[0]["signals"]
    # policy="cause": each rank measured its cheap paths' loss on its own data; the averaged vector and the decisions
    # agree.
    zero, one = ranks(tmp_path, "cause_")
    assert all("cheap_loss" in r for r in zero["records"]) and zero["records"] == one["records"]
    assert zero["records"][5]["entered"]
    # policy="impact": each rank measured every unit's impact on its own data; the averaged vector (finite, every
    # unit) and the decisions agree, and the budget is spent on the largest.
    zero, one = ranks(tmp_path, "impact_")
    assert zero["records"] == one["records"]
    for record in zero["records"]:
        impact = record["impact"]
        assert all(v == v and v > 0 for v in impact)  # measured on every unit, every step
        assert len(record["active"]) == 2
    first = zero["records"][0]
    assert sorted(first["active"]) == sorted(sorted(range(14), key=lambda i: -first["impact"][i])[:2])
    # Quiet units on: each rank reads its own copy of the quiet mask, and the ranks agree on it, on which units
    # measured each step and on the decisions; a quiet unit skips steps (every other one here) and is never dropped.
    zero, one = ranks(tmp_path, "impact_quiet_")
    assert zero["records"] == one["records"]
    records = zero["records"]
    assert any(r["quiet"] for r in records)
    skipped = 0
    for before, now, after in zip(records, records[1:], records[2:], strict=False):
        measured = {i for i, v in enumerate(now["impact"]) if v == v}
        for i in set(before["quiet"]) - measured:
            skipped += 1
            assert i in now["quiet"] or after["impact"][i] == after["impact"][i], (now["step"], i)
        assert measured >= set(range(14)) - set(before["quiet"])  # a unit not quiet measures every step (every=1)
    assert skipped > 0


@pytest.mark.parametrize("backend", ["act_quant", "block_fp", "bf16_cast"])
def test_fsdp2_sharded_norms_equal_the_unsharded_norms_and_ranks_agree(tmp_path, backend):
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    port = ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    launch([*torchrun, *port, str(WORKERS / "fsdp2_worker.py"), str(tmp_path), backend])
    zero, one = ranks(tmp_path)
    assert zero["sharded"] and one["sharded"]  # the gradients really were DTensor shards
    assert len(zero["names"]) == 14 and zero["names"] == one["names"]  # 2 layers x 7 projections, lm_head excluded
    for a, b in zip(zero["records"], one["records"], strict=True):
        assert a == b  # bit-identical norms and decisions on both ranks
        assert a["norms"] == pytest.approx(a["reference"], rel=1e-5)  # = DTensor.full_tensor() norms
        assert not any(a["missing"])
    assert zero["records"][5]["entered"] and not any(r["entered"] for r in zero["records"][:5])


@pytest.mark.parametrize("backend", ["act_quant", "block_fp"])
def test_fsdp2_cause_policy_reads_the_fidelity_of_the_unsharded_model_and_ranks_agree(tmp_path, backend):
    # FSDP2 frees each layer's gathered weights after its forward, while block_fp's weight measure is finished at the
    # end of the step: the loss GNMR reads at the first step must still be the unsharded model's on the same
    # batches (averaged over the ranks), exactly.
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    port = ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    launch([*torchrun, *port, str(WORKERS / "fsdp2_worker.py"), str(tmp_path), backend, "cause"])
    zero, one = ranks(tmp_path)
    assert zero["sharded"] and zero["records"] == one["records"]
    assert all(len(r["cheap_loss"]) == 14 and all(0 < f < 1 for f in r["cheap_loss"]) for r in zero["records"])
    assert zero["records"][0]["cheap_loss"] == zero["reference_cheap_loss"] == one["reference_cheap_loss"]
    # The x50 output-gradient spike at step 6 is a symptom whose family loses nothing suspect: noise, no entry.
    assert not any(r["entered"] for r in zero["records"])


def test_a_sigkilled_run_resumed_from_its_checkpoint_writes_the_trace_of_an_uninterrupted_run(
    tiny_llama_dir, tmp_path
):
    worker = [sys.executable, str(WORKERS / "train_worker.py"), str(tiny_llama_dir)]
    # The uninterrupted run, in this process (the same worker code).
    sys.path.insert(0, str(WORKERS))
    try:
        import train_worker

        monkey_argv = ["train_worker.py", str(tiny_llama_dir), str(tmp_path / "reference")]
        saved, sys.argv = sys.argv, monkey_argv
        try:
            train_worker.main()
        finally:
            sys.argv = saved
    finally:
        sys.path.remove(str(WORKERS))
    reference = read_trace(tmp_path / "reference" / "gnmr_trace.jsonl")

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([*worker, str(run), "--pause_after", "10"], stdout=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 240
        for line in proc.stdout:
            if line.startswith("PAUSED 10") or time.monotonic() > deadline:
                break
        assert (run / "checkpoint-8" / "trainer_state.json").is_file()
    finally:
        proc.send_signal(signal.SIGKILL)  # no atexit, no flush, no on_train_end
        proc.wait()
    launch([*worker, str(run), "--resume", str(run / "checkpoint-8")])
    header, records = read_trace(run / "gnmr_trace.jsonl")
    # Every step exactly once (none lost, none doubled), and the decisions of the uninterrupted run.
    assert [r["step"] for r in records] == list(range(1, 13))
    assert records == reference[1]
    assert header == reference[0]
    # The lock taken at step 6 spans the checkpoint at step 8: the resumed run releases the unit at step 9.
    assert records[7]["active"] and records[8]["exited"] == records[7]["active"]
