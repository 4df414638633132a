"""GNMRConfig: validation that names the field, threshold schedules, and the HfArgumentParser round trip."""

from __future__ import annotations

import dataclasses
import math
import warnings

import pytest

from gnmr_hf import GNMRConfig
from gnmr_hf.config import _CAUSE_FIELDS
from gnmr_hf.policy import make_policy

SCHEDULE = dict(threshold_schedule="linear", alpha_final=2.0, beta_final=1.5, schedule_steps=5)

# (overrides, exception type, field named in the message)
INVALID = [
    ({"max_active": 0}, ValueError, "max_active"),
    ({"max_active": 2.0}, TypeError, "max_active"),
    ({"max_active": True}, TypeError, "max_active"),
    ({"max_active": "4"}, TypeError, "max_active"),
    ({"lock_steps": 0}, ValueError, "lock_steps"),
    ({"lock_steps": 1.5}, TypeError, "lock_steps"),
    ({"window": 0}, ValueError, "window"),
    ({"window": None}, TypeError, "window"),
    ({"min_history": 0}, ValueError, "min_history"),
    ({"min_history": -3}, ValueError, "min_history"),
    ({"schedule_steps": -1}, ValueError, "schedule_steps"),
    ({"trace_top_k": -1}, ValueError, "trace_top_k"),
    ({"alpha": 0.0}, ValueError, "alpha"),
    ({"alpha": -1.0}, ValueError, "alpha"),
    ({"alpha": math.inf}, ValueError, "alpha"),
    ({"alpha": math.nan}, ValueError, "alpha"),
    ({"alpha": "3"}, TypeError, "alpha"),
    ({"alpha": True}, TypeError, "alpha"),
    ({"beta": 0}, ValueError, "beta"),
    ({"beta": None}, TypeError, "beta"),
    ({"threshold_schedule": "exponential"}, ValueError, "threshold_schedule"),
    ({"backend": ""}, TypeError, "backend"),
    ({"backend": 3}, TypeError, "backend"),
    ({"backend_options": "source"}, ValueError, "backend_options"),
    ({"backend_options": "{not json"}, ValueError, "backend_options"),
    ({"backend_options": 3}, TypeError, "backend_options"),
    ({"alpha_final": 2.0}, ValueError, "alpha_final"),
    ({"beta_final": 2.0}, ValueError, "beta_final"),
    ({**SCHEDULE, "alpha_final": None}, ValueError, "alpha_final"),
    ({**SCHEDULE, "beta_final": None}, ValueError, "beta_final"),
    ({**SCHEDULE, "alpha_final": -2.0}, ValueError, "alpha_final"),
    ({**SCHEDULE, "beta_final": math.inf}, ValueError, "beta_final"),
    ({**SCHEDULE, "schedule_steps": 0}, ValueError, "schedule_steps"),
    ({"include": "q_proj"}, TypeError, "include"),
    ({"include": ["q_proj", 3]}, TypeError, "include"),
    ({"exclude": ["("]}, ValueError, "exclude"),
    ({"monitor_only": "yes"}, TypeError, "monitor_only"),
    ({"monitor_only": 1}, TypeError, "monitor_only"),
    ({"trace_file": None}, TypeError, "trace_file"),
    ({"relapse_lock": 1}, TypeError, "relapse_lock"),
    ({"relapse_lock_cap": 0}, ValueError, "relapse_lock_cap"),
    ({"relapse_lock": True, "lock_steps": 8, "relapse_lock_cap": 4}, ValueError, "relapse_lock_cap"),
    ({"policy": ""}, TypeError, "policy"),  # a name (which names exist is checked when the callback is built)
    ({"policy_options": "no-equals-sign"}, ValueError, "policy_options"),
    ({"cause_suspect": 0.0}, ValueError, "cause_suspect"),
    ({"cause_suspect": 1.5}, ValueError, "cause_suspect"),
    ({"cause_peer_factor": 1.0}, ValueError, "cause_peer_factor"),
    ({"cause_fidelity_rows": -1}, ValueError, "cause_fidelity_rows"),
    ({"cause_fidelity_rows": 2.5}, TypeError, "cause_fidelity_rows"),
    ({"cause_recovery_every": 0}, ValueError, "cause_recovery_every"),
    ({"cause_recovery_every": 2.0}, TypeError, "cause_recovery_every"),
    ({"cause_recovery_every": 9, "lock_steps": 8}, ValueError, "cause_recovery_every"),
    ({"policy": "cause", "lock_steps": 8, "relapse_lock_cap": 4}, ValueError, "relapse_lock_cap"),
]


@pytest.mark.parametrize(("overrides", "error", "field"), INVALID, ids=[repr(c[0]) for c in INVALID])
def test_invalid_value_raises_an_error_naming_the_field(overrides, error, field):
    with pytest.raises(error, match=rf"GNMRConfig\.{field}\b"):
        GNMRConfig(**overrides)


def test_defaults_are_valid():
    config = GNMRConfig()
    assert (config.max_active, config.lock_steps, config.window, config.min_history) == (4, 8, 8, 4)


def test_numpy_numbers_are_accepted_and_stored_as_python_numbers():
    np = pytest.importorskip("numpy")
    config = GNMRConfig(alpha=np.float32(3.0), beta=np.float64(2.5), max_active=np.int64(2), window=np.int32(4))
    assert (config.alpha, config.beta, config.max_active, config.window) == (3.0, 2.5, 2, 4)
    assert type(config.alpha) is float and type(config.max_active) is int
    assert GNMRConfig.from_dict(config.to_dict()) == config


def test_integer_thresholds_are_stored_as_floats():
    config = GNMRConfig(alpha=4, beta=2)
    assert config.alpha == 4.0 and isinstance(config.alpha, float)
    assert config.beta == 2.0 and isinstance(config.beta, float)


def test_constant_schedule_gives_the_same_thresholds_at_every_step():
    config = GNMRConfig(alpha=3.5, beta=2.5)
    assert {config.thresholds(t) for t in (1, 2, 100, 10**6)} == {(3.5, 2.5)}


def test_linear_schedule_moves_from_start_to_final_then_stays():
    config = GNMRConfig(alpha=4.0, beta=3.0, **{**SCHEDULE, "alpha_final": 2.0, "beta_final": 1.0})
    assert [config.thresholds(t) for t in (1, 2, 3, 4, 5, 6, 50)] == [
        (4.0, 3.0),
        (3.5, 2.5),
        (3.0, 2.0),
        (2.5, 1.5),
        (2.0, 1.0),
        (2.0, 1.0),
        (2.0, 1.0),
    ]


def test_cosine_schedule_is_half_way_at_the_middle_step_and_flat_at_the_ends():
    config = GNMRConfig(
        alpha=4.0, beta=3.0, threshold_schedule="cosine", alpha_final=2.0, beta_final=1.0, schedule_steps=5
    )
    alpha_1, _ = config.thresholds(1)
    alpha_2, _ = config.thresholds(2)
    alpha_3, beta_3 = config.thresholds(3)
    assert alpha_1 == 4.0
    assert alpha_2 == pytest.approx(4.0 - 2.0 * (1 - math.cos(math.pi / 4)) / 2)
    assert (alpha_3, beta_3) == pytest.approx((3.0, 2.0))
    assert config.thresholds(5) == pytest.approx((2.0, 1.0))
    assert config.thresholds(9) == pytest.approx((2.0, 1.0))


def test_dict_round_trip_gives_an_equal_config():
    config = GNMRConfig(max_active=2, include=["q_proj", "v_proj"], monitor_only=True, **SCHEDULE)
    assert GNMRConfig.from_dict(config.to_dict()) == config


def test_from_dict_rejects_unknown_fields_by_name():
    with pytest.raises(ValueError, match="max_actives"):
        GNMRConfig.from_dict({"max_actives": 3})


def test_hf_argument_parser_reads_the_config_from_cli_args():
    from transformers import HfArgumentParser

    args = ["--max_active", "2", "--alpha", "4", "--include", "q_proj", "v_proj", "--monitor_only", "true"]
    (config,) = HfArgumentParser(GNMRConfig).parse_args_into_dataclasses(args=args)
    assert config == GNMRConfig(max_active=2, alpha=4.0, include=["q_proj", "v_proj"], monitor_only=True)


def test_hf_argument_parser_applies_the_validation():
    from transformers import HfArgumentParser

    with pytest.raises(ValueError, match=r"GNMRConfig\.max_active"):
        HfArgumentParser(GNMRConfig).parse_args_into_dataclasses(args=["--max_active", "0"])


@pytest.mark.parametrize(
    "text",
    [
        '{"source": "dequantize", "signal": "lora"}',
        "source=dequantize,signal=lora",
        " source = dequantize , signal=lora ",
    ],
)
def test_backend_options_are_read_from_json_or_key_value_text(text):
    assert GNMRConfig(backend_options=text).backend_options == {"source": "dequantize", "signal": "lora"}


def test_backend_options_come_from_the_command_line_beside_training_arguments():
    from transformers import HfArgumentParser, TrainingArguments

    args = ["--output_dir", "/tmp/x", "--max_active", "3", "--backend_options", "source=dequantize,signal=lora"]
    config, _ = HfArgumentParser((GNMRConfig, TrainingArguments)).parse_args_into_dataclasses(args=args)
    assert config.backend_options == {"source": "dequantize", "signal": "lora"} and config.max_active == 3
    assert GNMRConfig.from_dict(config.to_dict()) == config


@pytest.mark.parametrize("path", ["../x.jsonl", "runs/../../x.jsonl", "/tmp/x.jsonl"])
def test_a_trace_file_outside_output_dir_is_refused_naming_the_field(path):
    with pytest.raises(ValueError, match=r"GNMRConfig\.trace_file must be a path inside the Trainer's output_dir"):
        GNMRConfig(trace_file=path)


def test_a_trace_file_in_a_subfolder_of_output_dir_is_accepted():
    assert GNMRConfig(trace_file="traces/gnmr_trace.jsonl").trace_file == "traces/gnmr_trace.jsonl"


@pytest.mark.parametrize("text", ["source=auto,source=checkpoint", '{"source": "auto", "source": "checkpoint"}'])
def test_an_option_given_twice_is_refused_naming_it(text):
    with pytest.raises(ValueError, match=r"GNMRConfig\.backend_options: option 'source' is given twice"):
        GNMRConfig(backend_options=text)


# ------------------------------------------------------------ the cause policy's options, once GNMRConfig fields

DEPRECATED = "removed in a later minor version"


@pytest.mark.parametrize(
    ("field", "value", "option"),
    [
        ("cause_suspect", 0.25, "suspect"),
        ("cause_peer_factor", 8.0, "peer_factor"),
        ("cause_fidelity_rows", 64, "fidelity_rows"),
        ("cause_recovery_every", 2, "recovery_every"),
    ],
)
def test_a_cause_field_still_works_with_a_deprecation_warning_as_the_cause_policys_option(field, value, option):
    with pytest.warns(DeprecationWarning, match=rf"^GNMRConfig\.{field} is deprecated and will be {DEPRECATED}; "):
        config = GNMRConfig(policy="cause", **{field: value})
    assert config.policy_options == {option: value}
    assert getattr(make_policy(config).opts, option) == value
    assert getattr(config, field) == getattr(GNMRConfig(), field)  # one value, in the options form


def test_a_cause_field_at_its_default_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GNMRConfig(policy="cause", cause_suspect=0.5, cause_peer_factor=4.0, cause_fidelity_rows=256)


def test_a_cause_field_and_the_same_option_together_are_refused_naming_both():
    message = r"GNMRConfig\.cause_suspect=0\.25 and policy_options 'suspect'=0\.3 set the same option"
    with pytest.warns(DeprecationWarning), pytest.raises(ValueError, match=message):
        GNMRConfig(policy="cause", cause_suspect=0.25, policy_options={"suspect": 0.3})


def test_a_checkpoints_config_with_cause_fields_builds_and_is_saved_again_in_the_options_form():
    saved = {**GNMRConfig().to_dict(), "policy": "cause", "cause_suspect": 0.25, "cause_recovery_every": 2}
    with pytest.warns(DeprecationWarning):
        config = GNMRConfig.from_dict(saved)
    assert config.policy_options == {"suspect": 0.25, "recovery_every": 2}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert GNMRConfig.from_dict(config.to_dict()) == config


def test_a_cause_field_from_the_command_line_still_parses_into_the_option():
    from transformers import HfArgumentParser

    with pytest.warns(DeprecationWarning, match="cause_recovery_every"):
        (config,) = HfArgumentParser(GNMRConfig).parse_args_into_dataclasses(
            ["--policy", "cause", "--cause_recovery_every", "2"]
        )
    assert config.policy_options == {"recovery_every": 2}


def test_the_cause_options_defaults_are_the_deprecated_fields_defaults():
    from gnmr_hf.policies.cause import CauseOptions

    defaults = {f.name: f.default for f in dataclasses.fields(GNMRConfig)}
    options = CauseOptions()
    assert {f: getattr(options, o) for f, o in _CAUSE_FIELDS.items()} == {f: defaults[f] for f in _CAUSE_FIELDS}


def test_recovery_every_of_the_config_is_a_deprecated_alias_of_the_policys():
    config = GNMRConfig(policy="cause", lock_steps=6, policy_options="recovery_every=2")
    with pytest.warns(DeprecationWarning, match=r"GNMRConfig\.recovery_every is deprecated"):
        assert config.recovery_every == 2
    with pytest.warns(DeprecationWarning):
        assert GNMRConfig(policy="cause", lock_steps=5).recovery_every == 3
