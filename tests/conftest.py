from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
torch.set_num_threads(2)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A tiny fp32 LLaMA saved as safetensors (the 'original checkpoint' of the INT8 model)."""
    from gnmr_hf.experiments.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def biased_llama_dir(tmp_path_factory):
    """A tiny LLaMA whose linears have non-zero biases (the default init zeros them, which would hide bias bugs)."""
    from transformers import AutoModelForCausalLM

    from gnmr_hf.experiments.tiny import build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("biased_llama"), attention_bias=True, mlp_bias=True)
    model = AutoModelForCausalLM.from_pretrained(path)
    torch.manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_()
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """Byte-tokenized local text for the Trainer tests."""
    from gnmr_hf.experiments.demo import byte_dataset
    from gnmr_hf.experiments.tiny import write_local_text

    return byte_dataset(write_local_text(tmp_path_factory.mktemp("data") / "train.txt", lines=128))


@pytest.fixture(scope="session")
def text_dir(tmp_path_factory):
    """A folder of 40 small local text files: a corpus for the pretraining recipes."""
    folder = tmp_path_factory.mktemp("corpus")
    for i in range(40):
        (folder / f"doc{i:02d}.txt").write_text(f"document {i}: " + "the quick brown fox jumps. " * 80)
    return folder


@pytest.fixture
def one_thread():
    # The tiny model's ops are microseconds long: a second OpenMP thread only adds barrier waits, which cost
    # milliseconds each on a busy machine.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
