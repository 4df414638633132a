"""An INT8 base evaluated by bitsandbytes' own 8-bit inference against its INT8 weights de-quantized (`--int8_eval`).

    python benchmarks/int8_eval.py --model tiny --limit 2 --out runs/int8_eval/tiny.json
    OMP_NUM_THREADS=1 python benchmarks/int8_eval.py --model smollm2-135m --limit 1 --subjects 8 \\
        --out runs/int8_eval/smollm2.json

Loads the same INT8 base (`BitsAndBytesConfig(load_in_8bit=True)`, llm_int8_threshold 6, bitsandbytes' default, or
what a fine-tune's gnmr_run.json records) once per mode, runs the same MMLU questions through lm-eval in each (the
offline copy, `--num_fewshot` shots, `--limit` questions per subject over the first `--subjects` subjects, 0: all 57),
and reports per mode the seconds per request (lm-eval's log-likelihood requests: one per answer choice) and the
accuracy, and between the modes, on the same requests, the log-likelihood difference (mean and largest absolute, in
nats) and the questions whose chosen answer differs.
`--model tiny` builds the tests' tiny LLaMA (random weights); otherwise a name of
`gnmr_hf.experiments.models.REAL_MODELS`, a local transformers folder, or a fine-tune's output_dir (its adapter
merged into the de-quantized weights in the fp32/bf16 modes); `--adapter DIR` puts an adapter on a base.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any
from unittest import mock

from gnmr_hf.commandline import quiet_unused_imports

with quiet_unused_imports("bnb_int8"):
    from gnmr_hf.experiments.evaluation import INT8_EVALS, evaluate_model, write_local_tasks
    from gnmr_hf.experiments.mmlu import MMLU_GROUP, MMLU_SUBJECTS


def _model_folder(model: str, scratch: Path) -> str:
    if model == "tiny":
        from gnmr_hf.experiments.tiny import build_tiny_llama, char_tokenizer

        path = build_tiny_llama(scratch / "tiny")
        char_tokenizer().save_pretrained(path)
        return str(path)
    from gnmr_hf.experiments.models import REAL_MODELS, resolve_model

    return str(resolve_model(model)) if model in REAL_MODELS or model.endswith(".gguf") else model


def _requests(samples: dict[str, list[dict[str, Any]]]) -> dict[tuple[str, int], dict[str, Any]]:
    """(task, doc_id) -> that question's choices' log-likelihoods and whether it was answered right."""
    out = {}
    for task, docs in samples.items():
        for doc in docs:
            lls = [float(resp[0][0]) for resp in doc["resps"]]
            out[(task, int(doc["doc_id"]))] = {"lls": lls, "acc": float(doc["acc"])}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, a REAL_MODELS name, or a local transformers folder")
    parser.add_argument("--adapter", default=None, help="a peft adapter folder to evaluate on the INT8 base")
    parser.add_argument("--modes", nargs="+", default=["bnb", "fp32"], choices=INT8_EVALS)
    parser.add_argument("--limit", type=int, default=1, help="questions per MMLU subject")
    parser.add_argument("--subjects", type=int, default=8, help="the first N subjects (0: all 57)")
    parser.add_argument("--num_fewshot", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the report as JSON here")
    cli = parser.parse_args(argv)
    if cli.limit < 1:
        parser.error(f"--limit must be >= 1, got {cli.limit}")
    if not 0 <= cli.subjects <= MMLU_SUBJECTS:
        parser.error(f"--subjects must be in 0..{MMLU_SUBJECTS}, got {cli.subjects}")
    if len(set(cli.modes)) != len(cli.modes):
        parser.error("--modes: name each mode once")
    from lm_eval.tasks import TaskManager

    from gnmr_hf.experiments.evaluation import resolve_model_source

    report: dict[str, Any] = {"model": cli.model, "adapter": cli.adapter,
                              "limit": cli.limit, "num_fewshot": cli.num_fewshot, "modes": {}}  # fmt: skip
    per_mode = {}
    with tempfile.TemporaryDirectory() as scratch:
        folder = _model_folder(cli.model, Path(scratch))
        source = resolve_model_source(folder, cli.adapter)  # a missing base or adapter fails here, not later
        report["threshold"] = source.llm_int8_threshold
        task_folder = write_local_tasks(Path(scratch) / "tasks")
        manager = TaskManager(include_path=[str(task_folder)], include_defaults=False)
        # Subjects in name order, the first --subjects of them: the same questions for every mode.
        tasks = sorted(p.stem for p in task_folder.glob(f"{MMLU_GROUP}_*.yaml"))[: cli.subjects or None]
        report["subjects"] = [task.removeprefix(MMLU_GROUP + "_") for task in tasks]
        # Timed: lm-eval's log-likelihood calls alone (not the load, nor building the requests).
        from lm_eval.models.huggingface import HFLM

        timed = {"seconds": 0.0}
        loglikelihood = HFLM.loglikelihood

        def timed_loglikelihood(self: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return loglikelihood(self, *args, **kwargs)
            finally:
                timed["seconds"] += time.perf_counter() - start

        with mock.patch.object(HFLM, "loglikelihood", timed_loglikelihood):
            for mode in cli.modes:
                timed["seconds"] = 0.0
                results = evaluate_model(
                    folder,
                    adapter=cli.adapter,
                    load_in_8bit=True,
                    tasks=tasks,
                    num_fewshot=cli.num_fewshot,
                    limit=cli.limit,
                    offline_tasks=True,
                    device="cpu",
                    task_manager=manager,
                    int8_eval=mode,
                    log_samples=True,
                )
                seconds = timed["seconds"]
                requests = _requests(results["samples"])
                n_requests = sum(len(r["lls"]) for r in requests.values())
                per_mode[mode] = requests
                report["modes"][mode] = {
                    "seconds": seconds,
                    "requests": n_requests,
                    "seconds_per_request": seconds / n_requests,
                    "accuracy": statistics.fmean(r["acc"] for r in requests.values()),
                    "questions": len(requests),
                }

    first, *others = cli.modes
    for mode in others:
        keys = sorted(set(per_mode[first]) & set(per_mode[mode]))
        diffs = [b - a for k in keys for a, b in zip(per_mode[first][k]["lls"], per_mode[mode][k]["lls"], strict=True)]
        picks = [
            max(range(len(per_mode[m][k]["lls"])), key=per_mode[m][k]["lls"].__getitem__)
            for k in keys
            for m in (first, mode)
        ]
        report["modes"][mode]["against_" + first] = {
            "mean_abs_ll_diff": statistics.fmean(abs(d) for d in diffs),
            "max_abs_ll_diff": max(abs(d) for d in diffs),
            "mean_ll_diff": statistics.fmean(diffs),
            "answers_differ": sum(a != b for a, b in zip(picks[0::2], picks[1::2], strict=True)),
            "accuracy_diff": report["modes"][mode]["accuracy"] - report["modes"][first]["accuracy"],
            "speedup": report["modes"][first]["seconds_per_request"] / report["modes"][mode]["seconds_per_request"],
        }
    for mode, row in report["modes"].items():
        line = (
            f"{mode}: {row['questions']} questions, {row['requests']} requests, {row['seconds_per_request']:.3f} s "
            f"per request, accuracy {row['accuracy']:.3f}"
        )
        against = row.get("against_" + first)
        if against:
            line += (
                f"; against {first}: {against['speedup']:.1f}x faster, log-likelihood |diff| mean "
                f"{against['mean_abs_ll_diff']:.4f} max {against['max_abs_ll_diff']:.4f} nats, "
                f"{against['answers_differ']} answers differ"
            )
        print(line)
    if cli.out is not None:
        cli.out.parent.mkdir(parents=True, exist_ok=True)
        cli.out.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
