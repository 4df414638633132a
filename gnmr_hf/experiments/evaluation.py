"""Evaluate a model, or a fine-tune's adapter, with lm-evaluation-harness: MMLU, HellaSwag, held-out perplexity.

Every number comes from lm-eval itself: `lm_eval.simple_evaluate` over `lm_eval.models.huggingface.HFLM`, on task
definitions in lm-eval's YAML format. This module only decides what to hand it, and writes down what ran:

- **the model**: a model in memory (transformers or peft, with its tokenizer), a model folder or Hub name, or a
  fine-tune's `output_dir`: a peft adapter folder (its `adapter_config.json` names the base model) or a folder with
  a `gnmr_run.json` (`{"base_model": ..., "adapter": ...}`); optionally in 8-bit (bitsandbytes). We load it
  ourselves and give HFLM the loaded model, because HFLM's own loader cannot take a `BitsAndBytesConfig`.
- **the tasks**: MMLU 5-shot (`acc`) and HellaSwag 0-shot (`acc`, `acc_norm`) by default. When the Hub cannot be
  reached (see `offline_reason`), or when asked (`offline_tasks=True`):
  - `mmlu` runs `gnmr_mmlu`: MMLU's real test set (14,042 questions, 57 subjects) from a checksummed local copy
    (`gnmr_hf.experiments.mmlu`), with lm-eval's prompt and metric; only the k-shot examples differ (the same
    subject's first test questions, never the question itself, as MMLU's dev split is not in that copy);
  - `hellaswag` runs `gnmr_hellaswag_local`, a look-alike shipped in `gnmr_hf/experiments/data/eval/`: lm-eval's
    prompt, choices and metrics on items written for this project, so its numbers are not HellaSwag numbers.
  The log and `results.json` say which tasks really ran.
- **perplexity**: the `gnmr_perplexity` task scores held-out text with lm-eval's `loglikelihood_rolling`, as its
  `wikitext` task does (word_perplexity, byte_perplexity, bits_per_byte). We do not use
  `evaluate.load("perplexity")`: that metric is a script on the Hub, so offline it fails with
  `FileNotFoundError: Couldn't find a module script at .../perplexity/perplexity.py. Module 'perplexity' doesn't
  exist on the Hugging Face Hub either.`, and it takes a `model_id` to load by itself, so it could score neither
  an adapter nor an 8-bit model. docs/evaluation.md has the details.

lm-eval reads a task's `data_files` relative to the working directory, so the shipped task files are templates:
`write_local_tasks` fills in absolute paths and writes them to a folder that goes first in `include_path` (the
user's folders come after it, so they can override a task by name, as with lm-eval's `--include_path`).

`import gnmr_hf` never imports this module; lm-eval, peft and transformers are imported inside the functions.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import socket
import string
import tempfile
from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from .mmlu import MMLU_CONTINUATION_GROUP, MMLU_GROUP, write_mmlu_tasks

if TYPE_CHECKING:
    from collections.abc import Iterator

    from lm_eval.tasks import TaskManager

__all__ = [
    "DEFAULT_NUM_FEWSHOT",
    "DEFAULT_TASKS",
    "LOCAL_TASKS",
    "PERPLEXITY_TASK",
    "PER_DOCUMENT_FILE",
    "RUN_FILE",
    "ModelSource",
    "compare_results",
    "evaluate_model",
    "load_model",
    "offline_reason",
    "paired_difference",
    "per_document",
    "resolve_model_source",
    "write_local_tasks",
    "write_results",
]

logger = logging.getLogger(__name__)

DEFAULT_TASKS = ("mmlu", "hellaswag")
# The real task each local look-alike stands in for when the Hub is out of reach.
LOCAL_TASKS = {"mmlu": MMLU_GROUP, "mmlu_continuation": MMLU_CONTINUATION_GROUP, "hellaswag": "gnmr_hellaswag_local"}
# Of those, the ones that are only look-alikes (their items were written for this project).
LOOK_ALIKES = ("gnmr_hellaswag_local",)
# The shots these benchmarks are reported with (MMLU 5-shot, HellaSwag 0-shot); `num_fewshot` overrides them.
DEFAULT_NUM_FEWSHOT = {
    "mmlu": 5,
    MMLU_GROUP: 5,
    "mmlu_continuation": 0,
    MMLU_CONTINUATION_GROUP: 0,
    "hellaswag": 0,
    "gnmr_hellaswag_local": 0,
}
PERPLEXITY_TASK = "gnmr_perplexity"
# What a fine-tune recipe writes into its output_dir to say which base model its adapter belongs to.
RUN_FILE = "gnmr_run.json"
# Each document's score, one JSON object a line, written beside results.json when `log_samples` is on: what
# `compare_results` pairs arms on (the same questions, compared question by question).
PER_DOCUMENT_FILE = "per_document.jsonl"
_DOC_FIELDS = ("task", "doc_id", "doc_hash", "prompt_hash")

# What an offline `mmlu` is, said once for the log and results.md.
MMLU_NOTE = (
    f"mmlu ran as {MMLU_GROUP}: MMLU's real test questions (14,042 over 57 subjects) from a local copy "
    "(gnmr_hf.experiments.mmlu), lm-eval's prompt and acc metric; k-shot examples are the same subject's first test "
    "questions, never the question itself (lm-eval's mmlu takes them from the dev split, which the copy lacks)."
)
# The local MMLU forms (letters, continuation): real MMLU questions, said as such wherever they stand in.
_MMLU_GROUPS = (MMLU_GROUP, MMLU_CONTINUATION_GROUP)


def _mmlu_note(asked: str, run: str) -> str:
    """MMLU_NOTE for the form that ran (`mmlu`, or its continuation form)."""
    return MMLU_NOTE.replace("mmlu ran as " + MMLU_GROUP, f"{asked} ran as {run}", 1)


DATA_DIR = Path(__file__).parent / "data" / "eval"
DEFAULT_HELDOUT_FILE = DATA_DIR / "heldout.txt"
# The top-level keys of lm-eval's result dict that are keyed by task name: merged across our lm-eval calls and
# kept in results.json unchanged. The rest (configs, environment, timings) describes one call, not the results.
_RESULT_KEYS = ("results", "groups", "group_subtasks", "versions", "n-shot", "higher_is_better", "n-samples")
# Values the HF libraries read as "on" in HF_HUB_OFFLINE and friends (huggingface_hub's own rule).
_TRUE_VALUES = {"1", "ON", "YES", "TRUE"}
_OFFLINE_VARIABLES = ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE")


def offline_reason(timeout: float = 3.0) -> str | None:
    """Why the real tasks' datasets cannot come from the Hub now, or None when they can.

    Cheap on purpose, since it runs before every evaluation: first the variables the HF libraries obey
    (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE), then one TCP connection to the Hub endpoint
    (`HF_ENDPOINT`, default https://huggingface.co) that gives up after `timeout` seconds. No request is sent, so
    a machine that reaches the Hub only through an HTTP proxy looks offline: pass `offline_tasks=False` there.
    """
    for name in _OFFLINE_VARIABLES:
        if os.environ.get(name, "").strip().upper() in _TRUE_VALUES:
            return f"{name}={os.environ[name]}"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    host = endpoint.hostname or "huggingface.co"
    port = endpoint.port or (80 if endpoint.scheme == "http" else 443)
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError as err:
        return f"the Hub ({host}:{port}) is unreachable: {err}"
    return None


def write_local_tasks(folder: str | Path, perplexity_file: str | Path | None = None, *, mmlu: bool = True) -> Path:
    """Write the local task YAMLs, with absolute data paths, into `folder`; return it for `include_path`.

    Tasks: `gnmr_mmlu` (MMLU's real test set, one task per subject; `mmlu=False` skips it, as it needs the
    cached or downloadable copy of `gnmr_hf.experiments.mmlu`), `gnmr_hellaswag_local` and `gnmr_perplexity` over
    `perplexity_file` (plain text, one document per paragraph) or the shipped `heldout.txt`.
    """
    heldout = Path(perplexity_file) if perplexity_file is not None else DEFAULT_HELDOUT_FILE
    if not heldout.is_file():
        raise FileNotFoundError(f"perplexity_file={str(perplexity_file)!r} is not a file")
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    # Paths go inside double-quoted YAML strings; JSON string escaping is valid there.
    values = {
        "data_dir": json.dumps(str(DATA_DIR.resolve()))[1:-1],
        "heldout_file": json.dumps(str(heldout.resolve()))[1:-1],
    }
    for template in sorted((DATA_DIR / "tasks").iterdir()):
        (folder / template.name).write_text(string.Template(template.read_text()).substitute(values))
    if mmlu:
        write_mmlu_tasks(folder)
    return folder


@dataclass(frozen=True)
class ModelSource:
    """Where each part of the model comes from: the base weights, an optional peft adapter, the tokenizer."""

    base: str
    adapter: str | None
    tokenizer: str
    # What a fine-tune's gnmr_run.json says the base was trained in (its int8 and gnmr arms load it in 8-bit).
    load_in_8bit: bool = False
    # bitsandbytes' LLM.int8() outlier threshold the base was trained with (gnmr_run.json; its default 6.0 when
    # absent): 0.0 is pure INT8, and evaluating such a fine-tune with outlier decomposition would score another model.
    llm_int8_threshold: float = 6.0


def resolve_model_source(
    model: str | os.PathLike[str] | None, adapter: str | os.PathLike[str] | None = None
) -> ModelSource:
    """Work out base model, adapter and tokenizer from `model` (a path or Hub name) and an optional `adapter`.

    `model` may be a model folder or Hub name, a name of `REAL_MODELS` (`smollm2-135m`), a peft adapter folder (its
    adapter_config.json names the base in `base_model_name_or_path`), or a fine-tune output_dir holding a
    `gnmr_run.json` with `base_model` and optionally `adapter` (relative to that folder; default: the folder itself).
    The tokenizer comes from the adapter folder when it holds one (a fine-tune may have added tokens), otherwise from
    the base.
    """
    if model is None or str(model) == "":
        if adapter is not None:
            raise ValueError(
                f"adapter={str(adapter)!r} needs a base model: pass model=BASE as well, or pass the adapter folder "
                "as model (its adapter_config.json names the base model)"
            )
        raise ValueError("model is required: a model folder, a Hub name or a fine-tune output_dir")
    name = str(model)
    path = Path(name).expanduser()
    from gnmr_hf.experiments.models import REAL_MODELS, resolve_model

    if name in REAL_MODELS and not path.exists():
        # A real model by the name the recipes take (`smollm2-135m`): its converted local folder, so that the
        # untrained base is evaluated by the same name it was fine-tuned from.
        path = resolve_model(name)
        name = str(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"model={name!r} is a file; expected a model folder, a Hub name or a fine-tune output_dir")
    if not path.is_dir():
        if _looks_like_path(name):
            raise FileNotFoundError(f"model={name!r}: no such folder")
        return _with_adapter(name, _checked_adapter(adapter))

    run_file = path / RUN_FILE
    if run_file.is_file():
        spec = json.loads(run_file.read_text())
        if not spec.get("base_model"):
            raise ValueError(f"{run_file} has no 'base_model'; it must name the model the adapter was trained on")
        run_adapter = spec.get("adapter")
        if run_adapter is not None and adapter is not None:
            raise ValueError(f"adapter={str(adapter)!r} given, but {run_file} already names adapter={run_adapter!r}")
        chosen = adapter if adapter is not None else (path / run_adapter if run_adapter is not None else path)
        source = _with_adapter(str(spec["base_model"]), _checked_adapter(chosen))
        return dataclasses.replace(
            source,
            load_in_8bit=bool(spec.get("load_in_8bit", False)),
            llm_int8_threshold=float(spec.get("llm_int8_threshold", 6.0)),
        )

    adapter_config = path / "adapter_config.json"
    if adapter_config.is_file():
        if adapter is not None:
            raise ValueError(
                f"model={name!r} is itself a peft adapter folder; pass its base model as model to use "
                f"adapter={str(adapter)!r}"
            )
        base = json.loads(adapter_config.read_text()).get("base_model_name_or_path")
        if not base:
            raise ValueError(
                f"{adapter_config} names no base_model_name_or_path: pass model=BASE and adapter={name!r}"
            )
        return _with_adapter(str(base), str(path))

    if not (path / "config.json").is_file():
        raise ValueError(
            f"model={name!r} holds none of config.json (a model), adapter_config.json (a peft adapter) or {RUN_FILE}"
        )
    return _with_adapter(name, _checked_adapter(adapter))


def _looks_like_path(name: str) -> bool:
    """True when `name` cannot be a Hub repo id, so a missing folder of that name is the user's error to hear."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    if name.startswith((".", "/", "~")):
        return True
    try:
        validate_repo_id(name)
    except HFValidationError:
        return True
    return False


def _checked_adapter(adapter: str | os.PathLike[str] | None) -> str | None:
    if adapter is None:
        return None
    if not (Path(adapter) / "adapter_config.json").is_file():
        raise FileNotFoundError(
            f"adapter={str(adapter)!r}: no adapter_config.json there (save it with save_pretrained)"
        )
    return str(adapter)


def _with_adapter(base: str, adapter: str | None) -> ModelSource:
    has_tokenizer = adapter is not None and (Path(adapter) / "tokenizer_config.json").is_file()
    return ModelSource(base=base, adapter=adapter, tokenizer=adapter if has_tokenizer else base)


# How an INT8 base is evaluated (`int8_eval`): bitsandbytes' own 8-bit inference, or its INT8 weights de-quantized.
INT8_EVALS = ("bnb", "fp32", "bf16")


def _check_int8_eval(int8_eval: str, load_in_8bit: bool) -> None:
    if int8_eval not in INT8_EVALS:
        raise ValueError(f"int8_eval={int8_eval!r}: choose from {', '.join(INT8_EVALS)}")
    if int8_eval != "bnb" and not load_in_8bit:
        raise ValueError(
            f"int8_eval={int8_eval!r} de-quantizes an 8-bit base: it needs load_in_8bit (or a fine-tune whose "
            "gnmr_run.json says load_in_8bit), and a model given as a path or name"
        )


def load_model(
    source: ModelSource,
    *,
    load_in_8bit: bool = False,
    device: str = "cpu",
    offline: str | None = None,
    int8_eval: str = "bnb",
) -> tuple[Any, Any]:
    """Load `source` as (model, tokenizer): the base with `dtype="auto"` (as HFLM does), then the adapter.

    `load_in_8bit` quantizes the base with `BitsAndBytesConfig(load_in_8bit=True)` on `device`
    (bitsandbytes >= 0.45 runs 8-bit matmuls on CPU too). With it, `int8_eval` says how the INT8 base runs:
    "bnb" (bitsandbytes' own inference: LLM.int8(), each input row rounded to INT8, outlier columns in 16 bits), or
    "fp32" / "bf16": the INT8 weights de-quantized into plain `nn.Linear` layers of that dtype (transformers'
    `PreTrainedModel.dequantize`, which calls bitsandbytes' `int8_vectorwise_dequant`: the code times its row scale
    over 127, the weight the 8-bit layer multiplies by), the adapter then merged into them (`merge_and_unload`), so
    that evaluation runs at the plain model's speed on the same weights; what that leaves out is the inputs' INT8
    rounding.
    `offline`: why the Hub is out of reach (from `offline_reason`), or None; when set, only local files and the HF
    cache are read, so a Hub name that is not cached fails at once instead of after a minute of connection retries.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig

    _check_int8_eval(int8_eval, load_in_8bit)
    kwargs: dict[str, Any] = {"dtype": "auto", "device_map": device, "local_files_only": offline is not None}
    if load_in_8bit:
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_8bit=True, llm_int8_threshold=source.llm_int8_threshold
        )
        # bitsandbytes' 8-bit matmul computes in fp16: a base in another dtype (a checkpoint saved in fp32) would
        # have its inputs cast on every call, with a warning each time. De-quantized, the INT8 codes are made from
        # fp32 weights, as the CPU fine-tunes make them (gnmr_hf.experiments.models: the rest in fp32 on a CPU).
        kwargs["dtype"] = torch.float16 if int8_eval == "bnb" else torch.float32
    try:
        model = AutoModelForCausalLM.from_pretrained(source.base, **kwargs)
    except OSError as err:
        where = (
            f"; the Hub is out of reach ({offline}), so only local folders and the HF cache were tried"
            if offline
            else ""
        )
        raise OSError(
            f"model={source.base!r} could not be loaded as a local folder or Hub model{where}: {err}"
        ) from err
    if int8_eval != "bnb":
        dtype = torch.float32 if int8_eval == "fp32" else torch.bfloat16
        model.dequantize(dtype=dtype)
        model.to(dtype)  # the parameters that were never quantized (embeddings, norms) too
        # transformers drops the quantizer and its config but leaves this mark, which peft reads as "8-bit base".
        model.is_loaded_in_8bit = False
    if source.adapter is not None:
        from peft import PeftModel

        from .models import peft_quietly

        with peft_quietly():
            model = PeftModel.from_pretrained(model, source.adapter)
        if int8_eval != "bnb":
            # Merged into the de-quantized weights: W + B A in the eval dtype, one GEMM per linear.
            model = model.merge_and_unload()
    return model.eval(), AutoTokenizer.from_pretrained(source.tokenizer, local_files_only=offline is not None)


def _check_cached(base: str, offline: str) -> None:
    """Offline, a base model named by its Hub id must be in the HF cache: say so now, not after the task index."""
    from huggingface_hub import try_to_load_from_cache

    if Path(base).is_dir() or isinstance(try_to_load_from_cache(base, "config.json"), str):
        return
    raise OSError(
        f"model={base!r} is neither a local folder nor in the HF cache, and the Hub is out of reach ({offline}): "
        "download it where the Hub is reachable (`hf download " + base + "`), or pass a local folder"
    )


def evaluate_model(
    model: Any,
    *,
    tokenizer: Any = None,
    adapter: str | os.PathLike[str] | None = None,
    load_in_8bit: bool | None = None,
    tasks: str | Sequence[str] = DEFAULT_TASKS,
    num_fewshot: int | None = None,
    limit: int | float | None = None,
    include_path: str | os.PathLike[str] | Sequence[str | os.PathLike[str]] | None = None,
    offline_tasks: bool | None = None,
    perplexity_file: str | os.PathLike[str] | None = None,
    batch_size: int | str = 1,
    device: str | None = None,
    output_dir: str | os.PathLike[str] | None = None,
    task_manager: TaskManager | None = None,
    int8_eval: str = "bnb",
    log_samples: bool = False,
) -> dict[str, Any]:
    """Evaluate `model` with lm-eval and return lm-eval's results, plus a `metadata` entry saying what ran.

    Args:
        model: a transformers/peft model in memory (give its `tokenizer`, or HFLM loads the one named by the model),
            or a model folder, Hub name, peft adapter folder or fine-tune output_dir (see `resolve_model_source`).
        adapter: a peft adapter folder to apply on top of `model`.
        load_in_8bit: load the base in 8-bit with bitsandbytes (only for a `model` given as a path or name);
            None: as the fine-tune's gnmr_run.json says (False without one).
        int8_eval: with an 8-bit base, "bnb" (bitsandbytes' own 8-bit inference, the default) or "fp32" / "bf16"
            (its INT8 weights de-quantized, the adapter merged: the same weights at the plain model's speed, without
            LLM.int8()'s input rounding; see `load_model`).
        tasks: lm-eval task names, as a list or comma-separated; `mmlu` and `hellaswag` become their local
            look-alikes when offline. Each task runs with its own default shots (`DEFAULT_NUM_FEWSHOT`) unless
            `num_fewshot` is given, which then applies to every task but the perplexity one (it has no prompt).
        limit: documents per task (per subject for MMLU), or a fraction below 1, as lm-eval's `limit`.
        include_path: folder(s) of your own task YAMLs, exactly as lm-eval's `--include_path`.
        offline_tasks: True runs the local look-alikes, False the real tasks, None decides by `offline_reason()`.
        perplexity_file: plain text (documents separated by a blank line) to score with `gnmr_perplexity`; the task
            is added to `tasks`.
        batch_size: HFLM's batch size (an int, or "auto").
        device: where a model given as a path is loaded ("cpu", "cuda", "cuda:1"; default: cuda when available).
        output_dir: where results.json, results.md and the rendered task YAMLs (lm_eval_tasks/) go; None writes
            nothing.
        task_manager: an `lm_eval.tasks.TaskManager` to reuse instead of building one (building the index of all
            lm-eval tasks takes ~15 s). It must index the local tasks: build it with
            `include_path=write_local_tasks(folder)`.
        log_samples: keep lm-eval's per-document records (`samples`, by task: each request's log-likelihoods);
            they stay out of results.json.
    """
    import lm_eval
    from lm_eval.models.huggingface import HFLM

    task_list = _task_list(tasks)
    _check_options(num_fewshot, limit, batch_size, task_manager, include_path, perplexity_file)
    user_paths = _paths(include_path)
    source = None
    if isinstance(model, (str, os.PathLike)) or model is None:
        source = resolve_model_source(model, adapter)
        load_in_8bit = source.load_in_8bit if load_in_8bit is None else load_in_8bit
    elif adapter is not None or load_in_8bit:
        raise ValueError(
            "adapter and load_in_8bit apply to a model given as a path or name; for a model in memory, quantize "
            "it and apply the adapter (peft.PeftModel.from_pretrained) before calling evaluate_model"
        )
    _check_int8_eval(int8_eval, bool(load_in_8bit))

    # Checked once: it decides the tasks and, for a model given by name, whether the Hub is tried at all.
    hub_offline = offline_reason() if offline_tasks is None or source is not None else None
    if hub_offline and source is not None:
        _check_cached(source.base, hub_offline)
    if offline_tasks is None:
        reason = hub_offline
    else:
        reason = "offline_tasks=True" if offline_tasks else None
    plan = {name: LOCAL_TASKS.get(name, name) if reason else name for name in task_list}
    if perplexity_file is not None:
        plan.setdefault(PERPLEXITY_TASK, PERPLEXITY_TASK)
    shots = {
        run: 0 if run == PERPLEXITY_TASK else num_fewshot if num_fewshot is not None else DEFAULT_NUM_FEWSHOT.get(run)
        for run in plan.values()
    }
    _log_plan(plan, reason, shots)

    with _task_folder(output_dir) as local_dir:
        if task_manager is None:
            from lm_eval.tasks import TaskManager

            write_local_tasks(local_dir, perplexity_file, mmlu=bool(set(_MMLU_GROUPS) & set(plan.values())))
            task_manager = TaskManager(include_path=[str(local_dir), *user_paths])
        # Task names are checked before the model is loaded: a typo should not cost a 13B load.
        _check_known(list(plan.values()), task_manager)
        if source is not None:
            device = device or _default_device()
            hf_model, loaded_tokenizer = load_model(
                source, load_in_8bit=load_in_8bit, device=device, offline=hub_offline, int8_eval=int8_eval
            )
            tokenizer = tokenizer if tokenizer is not None else loaded_tokenizer
        else:
            hf_model = model
        lm = HFLM(pretrained=hf_model, tokenizer=tokenizer, batch_size=batch_size)
        merged: dict[str, Any] = {}
        # One lm-eval call per few-shot setting: simple_evaluate's num_fewshot applies to all the tasks it is given.
        for n_shot in dict.fromkeys(shots.values()):
            names = [run for run, n in shots.items() if n == n_shot]
            with _own_fewshot_choice():
                out = lm_eval.simple_evaluate(
                    model=lm,
                    tasks=names,
                    num_fewshot=n_shot,
                    limit=limit,
                    task_manager=task_manager,
                    log_samples=log_samples,
                )
            for key in _RESULT_KEYS:
                merged.setdefault(key, {}).update(out.get(key) or {})
            if log_samples:
                merged.setdefault("samples", {}).update(out.get("samples") or {})

    merged["metadata"] = {
        "model": source.base if source else getattr(hf_model, "name_or_path", type(hf_model).__name__),
        "adapter": source.adapter if source else None,
        "load_in_8bit": bool(load_in_8bit),
        "llm_int8_threshold": source.llm_int8_threshold if source and load_in_8bit else None,
        "int8_eval": int8_eval if load_in_8bit else None,
        "tasks_requested": task_list,
        "tasks_run": list(plan.values()),
        "task_map": plan,
        "offline": reason is not None,
        "offline_reason": reason,
        "num_fewshot": shots,
        "limit": limit,
        "batch_size": batch_size,
        "device": str(getattr(hf_model, "device", device)),
        "include_path": user_paths,
        "perplexity_file": str(Path(perplexity_file).resolve()) if perplexity_file is not None else None,
        "lm_eval_version": _version("lm_eval"),
        "transformers_version": _version("transformers"),
        "peft_version": _version("peft") if source and source.adapter else None,
    }
    if output_dir is not None:
        write_results(merged, output_dir)
    return merged


class _FewshotOverwrite(logging.Filter):
    """Drops lm-eval's "Overwriting default num_fewshot of <task> from <default> to <k>". MMLU's task files (lm-eval's
    and ours) set no num_fewshot, so its 5 shots can only be asked for with simple_evaluate's num_fewshot, and
    lm-eval warns once per subtask: 57 lines per MMLU run, all about the choice `evaluate_model` made on purpose and
    states once itself (the "Tasks:" line, results.json's num_fewshot)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Overwriting default num_fewshot")


@contextmanager
def _own_fewshot_choice() -> Iterator[None]:
    log = logging.getLogger("lm_eval.evaluator")  # where lm-eval 0.4 logs it
    quiet = _FewshotOverwrite()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _task_list(tasks: str | Sequence[str]) -> list[str]:
    names = [t.strip() for t in tasks.split(",")] if isinstance(tasks, str) else [str(t).strip() for t in tasks]
    names = [t for t in dict.fromkeys(names) if t]
    if not names:
        raise ValueError(f"tasks={tasks!r} names no task; e.g. 'mmlu,hellaswag'")
    return names


def _check_options(
    num_fewshot: int | None,
    limit: int | float | None,
    batch_size: int | str,
    task_manager: TaskManager | None,
    include_path: Any,
    perplexity_file: Any,
) -> None:
    if num_fewshot is not None and num_fewshot < 0:
        raise ValueError(f"num_fewshot={num_fewshot} must be >= 0 (or None for each task's default)")
    if limit is not None and limit <= 0:
        raise ValueError(f"limit={limit} must be > 0: a number of documents, or a fraction below 1")
    if isinstance(batch_size, int) and batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be >= 1 or 'auto'")
    if task_manager is not None and (include_path is not None or perplexity_file is not None):
        raise ValueError(
            "task_manager is used as given: build it with the include_path and perplexity_file you need "
            "(TaskManager(include_path=[write_local_tasks(folder, perplexity_file), ...])) instead of passing them"
        )


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _paths(include_path: Any) -> list[str]:
    if include_path is None:
        return []
    if isinstance(include_path, (str, os.PathLike)):
        include_path = [include_path]
    missing = [str(p) for p in include_path if not Path(p).is_dir()]
    if missing:
        raise FileNotFoundError(f"include_path: not a folder: {', '.join(missing)}")
    return [str(Path(p).resolve()) for p in include_path]


def _log_plan(plan: dict[str, str], reason: str | None, shots: dict[str, int | None]) -> None:
    for asked, run in plan.items():
        if asked != run and run in _MMLU_GROUPS:
            logger.warning("Offline (%s): %s", reason, _mmlu_note(asked, run))
        elif asked != run:
            logger.warning(
                "Offline (%s): running the local look-alike task %s in place of %s: the real task's prompt and "
                "metrics on items written for gnmr-hf, so its numbers are not %s numbers.",
                reason,
                run,
                asked,
                asked,
            )
    shown = [
        run if shots[run] is None or run == PERPLEXITY_TASK else f"{run} ({shots[run]}-shot)" for run in plan.values()
    ]
    logger.info("Tasks: %s", ", ".join(shown))


def _check_known(names: list[str], task_manager: TaskManager) -> None:
    import difflib

    known = set(task_manager.all_tasks)
    unknown = [name for name in names if name not in known]
    if not unknown:
        return
    hints = []
    for name in unknown:
        close = difflib.get_close_matches(name, sorted(known), n=5)
        hints.append(f"{name!r} (close: {', '.join(close)})" if close else repr(name))
    subjects = tuple(f"{group}_" for group in _MMLU_GROUPS)  # one task per MMLU subject: listed as their group
    local = sorted(n for n in known if n.startswith("gnmr_") and not n.startswith(subjects))
    raise ValueError(
        f"tasks: unknown task {'; '.join(hints)}. The defaults are {', '.join(DEFAULT_TASKS)}; the local tasks are "
        f"{', '.join(local) or 'not indexed'}; list all {len(known)} with `lm-eval ls tasks [--include_path DIR]`"
    )


@contextmanager
def _task_folder(output_dir: str | os.PathLike[str] | None) -> Iterator[Path]:
    """output_dir/lm_eval_tasks, kept as a record of what ran; or a temporary folder when nothing is written."""
    if output_dir is not None:
        yield Path(output_dir) / "lm_eval_tasks"
        return
    with tempfile.TemporaryDirectory(prefix="gnmr_lm_eval_tasks_") as tmp:
        yield Path(tmp)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package.replace("_", "-"))
    except PackageNotFoundError:
        return None


def write_results(results: dict[str, Any], output_dir: str | os.PathLike[str]) -> Path:
    """Write `results` (as `evaluate_model` returns them) to output_dir/results.json and a results.md table."""
    from lm_eval.utils import make_table

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    kept = {key: value for key, value in results.items() if key != "samples"}  # per-document records: too long
    (out / "results.json").write_text(json.dumps(kept, indent=2, default=str) + "\n")
    if results.get("samples"):
        rows = per_document(results["samples"])
        (out / PER_DOCUMENT_FILE).write_text("".join(json.dumps(row) + "\n" for row in rows))
    meta = results["metadata"]
    lines = [
        f"# Evaluation of {meta['model']}" + (f" + adapter {meta['adapter']}" if meta["adapter"] else ""),
        "",
        f"- tasks run: {', '.join(meta['tasks_run'])}",
        f"- offline: {meta['offline']}" + (f" ({meta['offline_reason']})" if meta["offline"] else ""),
        f"- num_fewshot: {meta['num_fewshot']}; limit: {meta['limit']}; 8-bit: {meta['load_in_8bit']}"
        + (f" (llm_int8_threshold {meta['llm_int8_threshold']})" if meta.get("llm_int8_threshold") is not None else "")
        + (f", run as {meta['int8_eval']}" if meta.get("int8_eval") not in (None, "bnb") else ""),
        f"- lm-eval {meta['lm_eval_version']}, transformers {meta['transformers_version']}",
        "",
    ]
    for asked, run in meta["task_map"].items():
        if asked != run and run in _MMLU_GROUPS:
            lines += [f"`{asked}` ran as `{run}`: {_mmlu_note(asked, run)}", ""]
        elif asked != run:
            lines += [f"`{asked}` ran as the local look-alike `{run}`: these are not {asked} numbers.", ""]
    lines.append(make_table(results))
    if results.get("groups"):
        lines += ["", make_table(results, "groups")]
    (out / "results.md").write_text("\n".join(lines))
    return out / "results.json"


def per_document(samples: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """lm-eval's logged samples reduced to what pairs arms: per document its task, `doc_id`, lm-eval's hashes of the
    document and of its prompt (two arms asked the same question in the same words when both match), and each
    scalar metric lm-eval scored it with (`acc`, `acc_norm`, ...; the perplexity task's (value, weight) pairs are
    left out: they are not per-document scores)."""
    rows = []
    for task, docs in samples.items():
        for doc in docs:
            metrics = {
                name: float(doc[name])
                for name in doc.get("metrics", ())
                if isinstance(doc.get(name), (int, float)) and not isinstance(doc.get(name), bool)
            }
            if metrics:
                rows.append(
                    {
                        "task": task,
                        "doc_id": doc["doc_id"],
                        "doc_hash": doc.get("doc_hash"),
                        "prompt_hash": doc.get("prompt_hash"),
                        **metrics,
                    }
                )
    return rows


def paired_difference(reference: Sequence[float], other: Sequence[float]) -> dict[str, float | int]:
    """`other` against `reference` on the same documents: the mean of the per-document differences, its standard
    error (the differences' sample standard deviation over sqrt(n): the paired test, which is far tighter than the
    two accuracies' own standard errors when the arms agree on most questions), and the documents each arm alone
    got right (the discordant pairs, for a 0/1 metric)."""
    if len(reference) != len(other):
        raise ValueError(f"paired_difference: {len(reference)} reference scores against {len(other)}")
    n = len(reference)
    if n == 0:
        raise ValueError("paired_difference: no document in common")
    diffs = [b - a for a, b in zip(reference, other, strict=True)]
    mean = sum(diffs) / n
    var = sum((d - mean) ** 2 for d in diffs) / (n - 1) if n > 1 else math.nan
    return {
        "n": n,
        "difference": mean,
        "stderr": math.sqrt(var / n) if n > 1 else math.nan,
        "only_other": sum(1 for d in diffs if d > 0),
        "only_reference": sum(1 for d in diffs if d < 0),
    }


def compare_results(
    sources: Sequence[str | os.PathLike[str]],
    output_dir: str | os.PathLike[str],
    names: Sequence[str] | None = None,
    reference: str | None = None,
) -> dict[str, Any]:
    """Put several arms' results side by side: output_dir/comparison.md (arms as columns) and comparison.json.

    `sources` are results.json files or the folders holding them (e.g. the int8, gnmr and bf16 runs' eval
    folders); `names` label the arms (default: the folder names). Rows are the tasks each arm ran at top level
    (a group's aggregate, not its subtasks) and their metrics as lm-eval names them ("acc,none"), each value with
    its stderr. Arms that differ in tasks, shots, limit or offline mode are flagged: their numbers do not compare.

    Where every arm kept its per-document scores (evaluated with `log_samples`, per_document.jsonl beside its
    results.json), each arm is also set against `reference` (a name; default: the first arm) on the documents both
    scored, question by question (`paired_difference`: the mean difference and its paired standard error, per top-level
    task, over all its subtasks' documents). A document whose prompt differs between two arms is not paired.
    """
    files = [Path(s) / "results.json" if Path(s).is_dir() else Path(s) for s in sources]
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"sources: no results.json at {', '.join(missing)}")
    labels = list(names) if names is not None else [f.parent.name for f in files]
    if len(labels) != len(files) or len(set(labels)) != len(labels):
        raise ValueError(f"names={labels!r} must give one distinct name per source ({len(files)} sources)")
    arms = {label: json.loads(f.read_text()) for label, f in zip(labels, files, strict=True)}

    rows: dict[tuple[str, str], dict[str, dict[str, float | None]]] = {}
    for label, arm in arms.items():
        for task in arm["metadata"]["tasks_run"]:
            for key, value in arm["results"].get(task, {}).items():
                metric, _, filt = key.partition(",")
                # sample_len is how many documents were scored, not a metric.
                if metric.endswith("_stderr") or metric == "sample_len":
                    continue
                if not isinstance(value, (int, float)) or isinstance(value, bool):
                    continue
                stderr = arm["results"][task].get(f"{metric}_stderr,{filt}")
                row = rows.setdefault((task, key), {})
                row[label] = {"value": value, "stderr": stderr if isinstance(stderr, (int, float)) else None}

    fields = ("tasks_run", "num_fewshot", "limit", "offline")
    differ = [
        f for f in fields if len({json.dumps(arm["metadata"].get(f), sort_keys=True) for arm in arms.values()}) > 1
    ]
    if reference is not None and reference not in labels:
        raise ValueError(f"reference={reference!r} must be one of the arms' names {labels}")
    reference = reference or labels[0]
    paired = _paired(
        arms, {label: f.parent / PER_DOCUMENT_FILE for label, f in zip(labels, files, strict=True)}, reference
    )
    table = {
        "arms": labels,
        "sources": [str(f) for f in files],
        "differ_in": differ,
        "rows": [{"task": task, "metric": key, "arms": values} for (task, key), values in rows.items()],
        "reference": reference,
        "paired": paired,
    }
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "comparison.json").write_text(json.dumps(table, indent=2) + "\n")
    lines = ["| task | metric | " + " | ".join(labels) + " |", "|---|---|" + "---|" * len(labels)]
    for row in table["rows"]:
        cells = [_cell(row["arms"].get(label)) for label in labels]
        lines.append(f"| {row['task']} | {row['metric']} | " + " | ".join(cells) + " |")
    if differ:
        lines += ["", f"Warning: the arms differ in {', '.join(differ)}; their numbers do not compare directly."]
    if paired:
        lines += [
            "",
            f"Paired against `{table['reference']}`, on the same documents (mean difference ± its paired standard "
            "error; the documents only this arm / only the reference got right):",
            "",
            "| task | metric | arm | documents | difference | only arm / only reference |",
            "|---|---|---|---:|---|---|",
        ]
        for row in paired:
            lines.append(
                f"| {row['task']} | {row['metric']} | {row['arm']} | {row['n']} | "
                f"{row['difference']:+.4f} ± {row['stderr']:.4f} | {row['only_other']} / {row['only_reference']} |"
            )
    (out / "comparison.md").write_text("\n".join(lines) + "\n")
    return table


def _leaves(task: str, groups: dict[str, list[str]]) -> list[str]:
    """A task's scored subtasks: itself, or a group's leaves (lm-eval's group_subtasks, nested)."""
    if task not in groups or not groups[task]:
        return [task]
    return [leaf for sub in groups[task] for leaf in _leaves(sub, groups)]


def _paired(arms: dict[str, dict[str, Any]], files: dict[str, Path], reference: str) -> list[dict[str, Any]]:
    """Each arm against `reference` per top-level task and metric, on the documents both scored with the same
    prompt; [] unless every arm has its per-document file."""
    if not all(f.is_file() for f in files.values()):
        return []
    docs = {}
    for label, f in files.items():
        by_key: dict[tuple[str, int], dict[str, Any]] = {}
        for line in f.read_text().splitlines():
            row = json.loads(line)
            by_key[(row["task"], row["doc_id"])] = row
        docs[label] = by_key
    ref = arms[reference]
    groups = ref.get("group_subtasks") or {}
    out = []
    for task in ref["metadata"]["tasks_run"]:
        leaves = set(_leaves(task, groups))
        ref_docs = {key: row for key, row in docs[reference].items() if key[0] in leaves}
        metrics = sorted({m for row in ref_docs.values() for m in row if m not in _DOC_FIELDS})
        for label in arms:
            if label == reference:
                continue
            common = [
                key
                for key in ref_docs
                if key in docs[label] and docs[label][key].get("prompt_hash") == ref_docs[key].get("prompt_hash")
            ]
            for metric in metrics:
                keys = [k for k in common if metric in ref_docs[k] and metric in docs[label][k]]
                if not keys:
                    continue
                stats = paired_difference([ref_docs[k][metric] for k in keys], [docs[label][k][metric] for k in keys])
                out.append({"task": task, "metric": metric, "arm": label, **stats})
    return out


def _cell(entry: dict[str, float | None] | None) -> str:
    if entry is None:
        return "-"
    text = f"{entry['value']:.4f}"
    return text + (f" ± {entry['stderr']:.4f}" if entry["stderr"] is not None else "")
