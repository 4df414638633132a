"""The pretraining machinery: corpus, tokenizer, data order, model, baselines' budgets, and the recipe end to end."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from gnmr_hf import GNMRConfig, GNMRController, find_units
from gnmr_hf.experiments.baselines import best_static_units, first_last_units
from gnmr_hf.experiments.pretrain import ByteTokenizer, block_dataset, llama_config, load_corpus

from trainer_utils import load_recipe


def recipe():
    return load_recipe("pretrain_actquant")


def test_byte_tokenizer_round_trips_utf8():
    tokenizer = ByteTokenizer()
    ids = tokenizer.encode("héllo, wörld")
    assert ids.dtype == torch.uint8 and len(ids) == len("héllo, wörld".encode())
    assert tokenizer.decode(ids) == "héllo, wörld"


def test_the_corpus_splits_by_document_so_no_validation_text_is_trained_on(text_dir):
    corpus = load_corpus(str(text_dir), val_every=10)
    train, val = bytes(corpus.train.tolist()).decode(), bytes(corpus.validation.tolist()).decode()
    assert corpus.documents == 40
    for i in range(40):
        assert (f"document {i}:" in val) == (i % 10 == 0)
        assert (f"document {i}:" in train) == (i % 10 != 0)


def test_the_standard_library_corpus_is_python_source():
    corpus = load_corpus("stdlib", max_bytes=50_000)
    assert 50_000 <= len(corpus.train) < 200_000 and len(corpus.validation) > 0
    assert b"def " in bytes(corpus.train[:50_000].tolist())


def test_the_batch_order_depends_only_on_the_data_seed():
    tokens = torch.arange(1000) % 256
    a = block_dataset(tokens.to(torch.uint8), 10, 150, seed=3)
    torch.manual_seed(123)  # another random stream moving must not matter
    b = block_dataset(tokens.to(torch.uint8), 10, 150, seed=3)
    c = block_dataset(tokens.to(torch.uint8), 10, 150, seed=4)
    assert torch.equal(a.starts, b.starts) and not torch.equal(a.starts, c.starts)
    # Non-overlapping blocks, each used once per pass over the data.
    assert sorted(a.starts[:100].tolist()) == list(range(0, 1000, 10))
    assert torch.equal(a[0]["input_ids"], a[0]["labels"])


def test_the_llama_config_has_the_asked_shape():
    config = llama_config(d_model=96, n_layers=3, n_heads=3, seq_len=64)
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads) == (96, 3, 3)
    assert config.intermediate_size == 256 and config.vocab_size == 256 and config.attention_dropout == 0.0


# -------------------------------------------------------------------------------------------------- baselines


def controller_for(policy, options=None, n=8, **config):
    """A controller over n act_quant units with the baseline `policy` (its name) and its `options`."""
    units = find_units(nn.Sequential(*[nn.Linear(2, 2) for _ in range(n)]), "act_quant")
    cfg = GNMRConfig(backend="act_quant", policy=policy, policy_options=options, **config)
    return GNMRController(cfg, n, names=units.names), units


def run_policy(controller, steps, spike_at=None, spike_unit=0, n=8):
    actives = []
    torch.manual_seed(0)
    for t in range(1, steps + 1):
        norms = 1.0 + 0.05 * torch.rand(n)
        if spike_at is not None and t == spike_at:
            norms[spike_unit] = 50.0
        actives.append(controller.observe(norms).active.clone())
    return torch.stack(actives)


def test_static_policies_recover_every_unit_or_none():
    high, _ = controller_for("static_high")
    low, _ = controller_for("static_low")
    assert high.active.all() and run_policy(high, 5).all()
    assert not low.active.any() and not run_policy(low, 5).any()


def test_random_selection_spends_the_mean_budget_and_never_exceeds_max_active():
    controller, _ = controller_for("random", {"mean_active": 1.5, "seed": 0}, max_active=3, lock_steps=4)
    active = run_policy(controller, 400)  # active[i] is the set decided at step i + 1
    counts = active.sum(1).float()
    assert counts.max() <= 3 and abs(counts.mean().item() - 1.5) < 0.2
    # Held for lock_steps: a new draw only at decision steps 4, 8, 12, ...
    changes = (active[1:] != active[:-1]).any(1).nonzero().flatten() + 1
    assert len(changes) > 0 and all((int(c) + 1) % 4 == 0 for c in changes)


def test_a_fixed_carve_out_keeps_exactly_its_units():
    controller, _ = controller_for("carve_out", {"units": ["1", "5"]})
    assert run_policy(controller, 5).nonzero()[:, 1].unique().tolist() == [1, 5]
    with pytest.raises(ValueError, match="not units"):
        controller_for("carve_out", {"units": ["nope"]})


def test_the_first_last_carve_out_alternates_the_end_layers():
    names = [f"model.layers.{i}.{p}" for i in range(4) for p in ("self_attn", "mlp.up_proj", "mlp.down_proj")]
    assert first_last_units(names, 3) == [
        "model.layers.0.self_attn",
        "model.layers.3.self_attn",
        "model.layers.0.mlp.up_proj",
    ]
    # A budget past the two end layers widens inward from both ends: layers 0 and 3, then 1 and 2.
    assert first_last_units(names, 8)[6:] == ["model.layers.1.self_attn", "model.layers.2.self_attn"]
    assert len(set(first_last_units(names, 12))) == 12
    with pytest.raises(ValueError, match=r"count must be in 0\.\.12"):
        first_last_units(names, 13)
    odd = [n for n in names if ".3." not in n]  # layers 0..2: the middle layer comes last, once
    assert first_last_units(odd, 9)[6:] == [
        "model.layers.1.self_attn",
        "model.layers.1.mlp.up_proj",
        "model.layers.1.mlp.down_proj",
    ]


def test_the_best_static_carve_out_takes_the_largest_mean_gaps():
    gaps = {"a": 0.1, "b": 3.0, "c": float("nan"), "d": 2.0}
    assert best_static_units(gaps, 2) == ["b", "d"]


def test_the_global_z_score_detector_fires_on_a_total_norm_spike_within_the_budget():
    controller, _ = controller_for("global_z", {"warmup": 10}, max_active=2, lock_steps=3)
    active = run_policy(controller, 40, spike_at=30, spike_unit=6)
    assert not active[:29].any()
    assert active[29, 6] and active[29].sum() == 2  # the spiking unit and the next largest norm
    assert active[30:32].any(1).all() and not active[33:].any()


# ---------------------------------------------------------------------------------------------- end to end


def test_the_tiny_preset_runs_end_to_end(tmp_path, text_dir, one_thread):
    out = tmp_path / "run"
    results = recipe().main(
        [
            *("--preset", "tiny", "--output_dir", str(out), "--corpus", str(text_dir)),
            *("--arms", "static_low", "gnmr", "random", "--max_steps", "6", "--eval_steps", "3"),
            *("--oracle_every", "3", "--oracle_benefits", "true", "--trace_top_k", "64"),
            *("--backend_options", "kinds=linear;attention"),
        ]
    )
    assert [r["arm"] for r in results] == ["static_low", "gnmr", "random"]
    assert all(r["final_eval_loss"] < 5.6 for r in results)  # below ln(256): it learned something
    gnmr = json.loads((out / "gnmr" / "seed0" / "result.json").read_text())
    assert gnmr["units"] == 2 * (1 + 7) and gnmr["saved_bytes_per_step"] > 0
    probes = (out / "gnmr" / "seed0" / "oracle.jsonl").read_text().splitlines()[1:]
    assert len(probes) == 2
    assert all(len(json.loads(line)["benefits"]) == gnmr["units"] for line in probes)
    table = (out / "results.md").read_text()
    assert table.count("\n") == 2 + 3 and (out / "loss_curves.png").is_file()


# ------------------------------------------------------------------------------------------- the arm plan


def _parse(*argv):
    from gnmr_hf.experiments.pretrain import parse_recipe_arguments

    return parse_recipe_arguments(["--preset", "tiny", "--output_dir", "unused", *argv], backend="act_quant")


def test_the_default_arms_are_those_the_other_flags_allow():
    _, pretrain, _ = _parse()
    assert "carve_best" not in pretrain.arms and "carve_named" not in pretrain.arms
    _, pretrain, _ = _parse("--oracle_every", "5", "--carve_named", "self_attn$")
    assert {"carve_best", "carve_named"} <= set(pretrain.arms)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--arms", "carve_named"), "arm carve_named needs --carve_named"),
        (("--arms", "random"), "arm random takes GNMR's budget: put gnmr before it"),
        (("--arms", "gnmr", "carve_best"), "arm carve_best needs --oracle_every K > 0"),
        (("--oracle_benefits", "true"), "oracle_benefits needs --oracle_every K > 0"),
        (("--arms", "carve_named", "--carve_named", "self_attn$"), "--carve_named self_attn$ matches no unit"),
        # One pattern of two matching is not enough: the arm would carve out less than it was given.
        (
            ("--arms", "carve_named", "--carve_named", "q_proj$", "^lm_head$"),
            "--carve_named ^lm_head$ matches no unit",
        ),
    ],
)
def test_an_arm_plan_that_cannot_run_is_refused_before_the_first_arm(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        recipe().main(["--preset", "tiny", "--output_dir", str(tmp_path / "run"), *argv])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err
    assert not (tmp_path / "run").exists()  # nothing trained


def test_results_say_when_the_gap_is_within_seed_noise():
    from gnmr_hf.experiments.pretrain import results_table

    def run(arm, seed, loss):
        return {
            "arm": arm,
            "seed": seed,
            "final_eval_loss": loss,
            "final_eval_ppl": 1.0,
            "sec_per_step": 0.1,
            "saved_bytes_per_step": 0.0,
        }

    noisy = [
        run("static_high", 0, 2.00),
        run("static_high", 1, 2.10),
        run("static_low", 0, 2.02),
        run("static_low", 1, 2.11),
        run("gnmr", 0, 2.01),
        run("gnmr", 1, 2.10),
    ]
    table = results_table(noisy)
    assert "(gap within noise)" in table and "'gap closed' is noise here" in table
    assert "one seed its noise is unmeasured" in results_table(noisy[::2])


def _row(arm, loss, backend="act_quant", saved=2**20):
    return {
        "arm": arm,
        "seed": 0,
        "final_eval_loss": loss,
        "final_eval_ppl": 1.0,
        "sec_per_step": 0.1,
        "saved_bytes_per_step": saved,
        "backend": backend,
    }


def test_a_share_of_the_gap_that_rounds_to_zero_is_0_percent_not_minus_0():
    from gnmr_hf.experiments.pretrain import results_table

    table = results_table([_row("static_high", 2.0), _row("static_low", 3.0), _row("gnmr", 3.003)])
    assert "| gnmr | 0 | 3.0030 | 1.000 | 0% |" in table and "-0%" not in table  # -0.3% of the gap


def test_the_loss_plot_separates_arms_a_thousandth_apart_and_names_identical_ones_together(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from gnmr_hf.experiments.pretrain import plot_loss_curves

    def run(arm, offset):
        curve = [[10, 4.7 + offset], [20, 4.44 + offset]]
        return {**_row(arm, 4.44 + offset), "eval_loss": curve, "train_loss": curve}

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)  # keep the figure to read it back
    runs = [run("static_high", 0.0), run("static_low", 4e-4), run("gnmr", 4e-4), run("random", 4e-4)]
    path = plot_loss_curves(runs, tmp_path / "loss_curves.png")
    assert path.is_file()
    top_left, bottom_left = figures[0].axes[0], figures[0].axes[2]
    labels = [t.get_text().replace("\n", " ") for t in top_left.get_legend().get_texts()]
    assert labels == ["static_high (seed 0)", "static_low = gnmr = random (seed 0, identical)"]
    # Below, each arm minus static_high: the 4e-4 the loss axis cannot show.
    assert [list(line.get_ydata()) for line in bottom_left.get_lines()[:2]] == [[0.0, 0.0], pytest.approx([4e-4] * 2)]
    assert "minus static_high" in bottom_left.get_ylabel()
    styles = {(line.get_linestyle(), line.get_marker()) for line in top_left.get_lines()}
    assert len(styles) == 2  # each line its own dash and marker, not only its own colour


def test_block_fp_tables_state_the_saved_bytes_once_instead_of_a_column_of_one_number():
    from gnmr_hf.experiments.pretrain import results_table

    runs = [_row("reference", 2.0, None), *(_row(a, 2.5, "block_fp") for a in ("static_high", "static_low", "gnmr"))]
    table = results_table(runs)
    assert "saved MB/step" not in table
    assert "Saved for backward: 1.0 MB/step in every arm (block_fp keeps each GEMM's inputs in fp32" in table
    # act_quant stores saved activations at the path's bits: there the column varies by arm and stays.
    table = results_table([_row("static_high", 2.0, saved=2**21), _row("static_low", 2.5), _row("gnmr", 2.2)])
    assert "saved MB/step" in table and "| 2.0 |" in table and "Saved for backward" not in table
