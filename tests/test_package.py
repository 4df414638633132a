"""The public surface: a small explicit API, a light import, and clear errors at the callback's door."""

from __future__ import annotations

import subprocess
import sys

import pytest

import gnmr_hf
from gnmr_hf import GNMRCallback, GNMRConfig

HEAVY = ("transformers", "bitsandbytes", "peft", "lm_eval", "matplotlib", "accelerate", "torchao")


def test_import_gnmr_hf_imports_no_optional_or_trainer_dependency():
    code = f"import sys, gnmr_hf; print([m for m in {HEAVY!r} if m in sys.modules])"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_configuring_and_importing_the_optional_backends_imports_neither_torchao_nor_bitsandbytes():
    code = (
        "import sys, gnmr_hf; from gnmr_hf.units import get_backend; "
        "import gnmr_hf.backends.torchao as t, gnmr_hf.backends.bnb as b; "
        "[get_backend(n).parse_options('signal=auto') for n in ('bnb_int8', 'bnb_4bit', 'torchao_float8')]; "
        "gnmr_hf.GNMRConfig(backend='torchao_float8', backend_options='signal=weight'); "
        "gnmr_hf.GNMRConfig(backend='bnb_4bit', backend_options='source=dequantize'); "
        "assert t.is_torchao_available() and b.is_bnb_available(); "
        "print([m for m in ('torchao', 'bitsandbytes', 'peft', 'transformers') if m in sys.modules])"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_every_public_name_resolves():
    for name in gnmr_hf.__all__:
        assert getattr(gnmr_hf, name) is not None, name
    assert "GNMRCallback" in dir(gnmr_hf)
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        gnmr_hf.nope  # noqa: B018


def test_callback_accepts_a_config_a_dict_or_fields():
    assert GNMRCallback(GNMRConfig(max_active=3)).config.max_active == 3
    assert GNMRCallback({"max_active": 3}).config.max_active == 3
    assert GNMRCallback(max_active=3, lock_steps=2).config.lock_steps == 2


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"max_active": 0}, ValueError, "max_active"),
        ({"config": {"max_active": 2, "typo_field": 1}}, ValueError, "typo_field"),
        ({"config": 3}, TypeError, "GNMRConfig or a dict"),
        ({"config": GNMRConfig(), "max_active": 2}, TypeError, "either a GNMRConfig or keyword"),
    ],
)
def test_callback_rejects_bad_configs_naming_the_field(kwargs, error, message):
    with pytest.raises(error, match=message):
        GNMRCallback(**kwargs)


def test_callback_state_rebuilds_the_callback_like_the_trainer_does():
    callback = GNMRCallback(GNMRConfig(max_active=3, include=["q_proj"]))
    state = callback.state()
    rebuilt = type(callback)(**state["args"])  # what Trainer._load_callback_state does
    assert rebuilt.config == callback.config


def test_gnmr_config_parses_beside_training_arguments_without_clashes():
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((TrainingArguments, GNMRConfig))
    args, gnmr = parser.parse_args_into_dataclasses(
        ["--output_dir", "out", "--use_cpu", "--max_active", "3", "--include", "q_proj", "v_proj", "--monitor_only"]
    )
    assert args.use_cpu and gnmr.max_active == 3 and gnmr.include == ["q_proj", "v_proj"] and gnmr.monitor_only
