"""GNMRCallback inside trl's SFTTrainer (a Trainer subclass with its own data pipeline)."""

from __future__ import annotations

import pytest

from gnmr_hf import GNMRCallback, GNMRConfig
from gnmr_hf.experiments.demo import GradientSpikeCallback
from gnmr_hf.experiments.tiny import char_tokenizer, load_4bit_lora, load_int8_lora, write_local_text
from gnmr_hf.trace import read_trace

trl = pytest.importorskip("trl")

# Per backend: how the tiny LLaMA is loaded (8-bit or NF4, with LoRA), and the thresholds that keep the smooth
# toy data below them until the spike.
BACKENDS = {
    "bnb_int8": (load_int8_lora, dict(alpha=4.0, beta=4.0)),
    # Train mode, as under a Trainer (see tests/test_bnb4bit.py::load).
    "bnb_4bit": (lambda path: load_4bit_lora(path).train(), {}),
}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
def test_sft_trainer_runs_gnmr_and_catches_an_injected_spike(tiny_llama_dir, tmp_path, backend):
    from datasets import Dataset

    load, thresholds = BACKENDS[backend]
    lines = write_local_text(tmp_path / "train.txt", lines=64).read_text().splitlines()
    gnmr = GNMRCallback(GNMRConfig(backend=backend, max_active=2, lock_steps=2, window=2, min_history=2, **thresholds))
    spiked = "model.layers.0.self_attn.v_proj"
    args = trl.SFTConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        max_steps=8,
        per_device_train_batch_size=4,
        max_length=32,
        logging_steps=2,
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
    )
    trainer = trl.SFTTrainer(
        model=load(tiny_llama_dir),
        args=args,
        train_dataset=Dataset.from_dict({"text": lines}),
        processing_class=char_tokenizer(),
        callbacks=[gnmr, GradientSpikeCallback(spiked, step=5)],
    )
    trainer.train()
    header, steps = read_trace(tmp_path / "gnmr_trace.jsonl")
    assert header["config"]["backend"] == backend and len(steps) == 8
    assert header["units"].index(spiked) in steps[4]["entered"]
    assert all("gnmr/active" in h for h in trainer.state.log_history if "loss" in h)
