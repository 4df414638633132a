"""DeepSpeed ZeRO-2 and ZeRO-3: the Trainer on 2 CPU processes (gloo, loopback), and what is refused.

One worker launch (tests/workers/deepspeed_worker.py) runs the ZeRO-2, resume, ZeRO-3 and refused runs; the tests
below read its per-rank records. The first launch on a machine JIT-builds DeepSpeed's shared-memory comm op with
g++ (about 60 s on 2 cores), cached under TORCH_EXTENSIONS_DIR (torch's default: ~/.cache/torch_extensions).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from test_distributed import ranks

from gnmr_hf.integrations.deepspeed import DeepSpeedZero, check_backend

from trainer_utils import free_port, launch

pytest.importorskip("deepspeed")

WORKERS = Path(__file__).parent / "workers"
V_PROJ_1 = 9  # model.layers.1.self_attn.v_proj: 2 layers x 7 projections, in module order
DOWN_PROJ_1 = 13  # model.layers.1.mlp.down_proj


@pytest.fixture(scope="module")
def runs(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("deepspeed")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"]
    port = ["--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    launch([*torchrun, *port, str(WORKERS / "deepspeed_worker.py"), str(tiny_llama_dir), str(out)], timeout=400)
    return ranks(out)


def test_zero2_int8_lora_ranks_see_one_ranks_local_spike_identically(runs):
    zero, one = runs[0]["zero2"], runs[1]["zero2"]
    assert zero["names"] == one["names"] and len(zero["names"]) == 14
    # LoRA on q_proj/v_proj only: the other units are scored on output gradients, metered per rank and summed.
    assert set(zero["signals"]) == {"lora", "output_grad"}
    assert [r["step"] for r in zero["records"]] == list(range(1, 9))
    for a, b in zip(zero["records"], one["records"], strict=True):
        assert a == {**b, "reference_s": a["reference_s"]}  # bit-identical norms and decisions on both ranks
        assert not any(a["missing"])
    # The x100 spike was in rank 0's local gradient at step 5 (accumulation 2); both ranks select the unit then.
    assert [r["entered"] for r in zero["records"]] == [[], [], [], [], [V_PROJ_1], [], [], []]


def test_zero_norms_equal_deepspeeds_own_full_gradients(runs):
    for mode in ("zero2", "zero3"):
        for record in runs[0][mode]["records"]:
            for norm, reference in zip(record["norms"], record["reference"], strict=True):
                if reference is not None:  # None: an output-gradient unit, no parameter gradient to compare
                    assert math.isclose(norm, reference, rel_tol=1e-6), (mode, record["step"])


def test_zero3_block_fp_units_flip_on_partitioned_weights_and_ranks_agree(runs):
    zero, one = runs[0]["zero3"], runs[1]["zero3"]
    assert set(zero["signals"]) == {"weight"} and len(zero["names"]) == 14  # lm_head excluded
    for a, b in zip(zero["records"], one["records"], strict=True):
        assert a == {**b, "reference_s": a["reference_s"]}
    assert [r["active"] for r in zero["records"]] == [[], [], [], [], [DOWN_PROJ_1], [DOWN_PROJ_1], [], []]


def test_resume_from_a_deepspeed_checkpoint_gives_the_decisions_of_the_uninterrupted_run(runs):
    for rank in runs:
        uninterrupted, resumed = rank["zero2"]["records"][4:], rank["resume"]["records"]
        assert [r["step"] for r in resumed] == [5, 6, 7, 8]
        for a, b in zip(uninterrupted, resumed, strict=True):
            assert a == {**b, "reference_s": a["reference_s"]}


def test_zero3_refuses_bitsandbytes_int8_citing_its_upstream_issue(runs):
    for rank in runs:
        assert "backend 'bnb_int8' under DeepSpeed ZeRO-3 is not supported" in rank["refused"]["error"]
        assert "bitsandbytes issue #1451" in rank["refused"]["error"]


def test_zero3_refuses_bitsandbytes_4bit_and_zero2_accepts_every_builtin_backend():
    with pytest.raises(ValueError, match=r"'bnb_4bit' under DeepSpeed ZeRO-3 is not supported.*Use ZeRO-2"):
        check_backend(3, "bnb_4bit")
    for backend in ("bnb_int8", "bnb_4bit", "act_quant", "block_fp", "torchao_float8"):
        check_backend(2, backend)
        check_backend(1, backend)
    for backend in ("act_quant", "block_fp", "torchao_float8"):
        check_backend(3, backend)


def _zero_optimizer(dtype: torch.dtype):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zero = object.__new__(DeepSpeedZeroOptimizer)  # the attributes GNMR reads, without an engine
    zero.dtype, zero.partition_gradients, zero.dp_process_group = dtype, True, None
    return SimpleNamespace(optimizer=zero)  # as accelerate's DeepSpeedOptimizerWrapper holds it


def test_deepspeed_fp16_is_refused_and_bf16_zero2_is_read():
    args = SimpleNamespace(deepspeed={"zero_optimization": {"stage": 2}})
    with pytest.raises(ValueError, match=r"DeepSpeed fp16 is not supported.*Use bf16"):
        DeepSpeedZero.from_trainer(args, _zero_optimizer(torch.float16), "bnb_int8")
    assert DeepSpeedZero.from_trainer(args, _zero_optimizer(torch.bfloat16), "bnb_int8").stage == 2
    assert DeepSpeedZero.from_trainer(SimpleNamespace(deepspeed=None), None, "bnb_int8") is None


@pytest.mark.parametrize("optimizer", [None, torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)])
def test_deepspeed_without_a_zero_optimizer_is_refused(optimizer):
    with pytest.raises(ValueError, match=r"needs a ZeRO optimizer \(stage 1, 2 or 3\).*DDP or FSDP2"):
        DeepSpeedZero.from_trainer(SimpleNamespace(deepspeed="ds.json"), optimizer, "bnb_int8")


@pytest.mark.parametrize("stage", [2, 3])
def test_the_zero_accelerate_configs_launch_deepspeed_at_their_stage(stage):
    from accelerate.commands.config.config_args import load_config_from_file

    path = Path(__file__).resolve().parents[1] / "recipes" / "configs" / f"deepspeed_zero{stage}.yaml"
    config = load_config_from_file(str(path))
    assert config.distributed_type == "DEEPSPEED" and config.deepspeed_config["zero_stage"] == stage
    assert config.mixed_precision == "no"  # precision comes from the recipe's --bf16, as in the other configs
    assert path.read_text().startswith(f"# accelerate launch --config_file recipes/configs/{path.name} ")


def test_the_zero_memory_table_in_the_docs_is_what_the_script_prints():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    table = subprocess.run(
        [sys.executable, str(root / "benchmarks" / "zero_memory.py")], capture_output=True, text=True, check=True
    ).stdout
    rows = [line for line in table.splitlines() if line.startswith("| ")]
    assert len(rows) == 7 and all(row in (root / "docs" / "recipes.md").read_text() for row in rows)
