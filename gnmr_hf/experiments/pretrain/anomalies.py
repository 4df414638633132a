"""Anomalous documents in the training batches: the rare data that breaks a low-bit path briefly.

Large runs tie loss spikes to specific batches, and those batches hold rare documents: one character repeated for
pages, base64 blobs, long digit strings, minified code. `--anomalies KIND[,KIND...] --anomaly_every N` puts such a
document into training on every N-th optimizer step (steps N, 2N, ...), the kinds taking turns in the order given:

- `repeat`: one character repeated (drawn from a small set of punctuation, a letter and a digit), so one token
  repeated once the tokenizer has merged it;
- `base64`: the base64 text of random bytes, one unbroken blob as in a data URI;
- `digits`: random decimal digits, one unbroken string;
- `minified`: the training text at a random place, with its whitespace removed (runs of whitespace become one space,
  and none is left beside punctuation), as a minifier leaves code.

Each anomalous document is generated here from the run's data seed and the step alone (never from a random stream
the model or a backend consumes), so every arm of a seed trains on the same anomalies at the same steps, and a
resumed run on the same ones. The text is tokenized as the corpus is (bytes for a model built from scratch, the real
model's own tokenizer for `--model`) and cut to `seq_len` tokens; it is trained on like any sequence (its labels are
its tokens). Validation stays on clean held-out text.

**What is replaced** (`--anomaly_scope`): by default one sequence, the first of the step's batch (`sequence`). A rare
document is one document among many in a real batch, and the batch's clean sequences keep the step's clean signal
beside it, so a spike measures what the one document does. `batch` replaces every sequence of the step (each its own
generated document), the stronger stress. With gradient accumulation the step's batch is all its micro-batches: the
first sequence of the first micro-batch, or all of them.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "AFTERMATH_STEPS",
    "ANOMALY_KINDS",
    "ANOMALY_SCOPES",
    "AnomalousBlocks",
    "AnomalySchedule",
    "anomalous_text",
    "clean_steps",
    "mark_anomalies",
]

ANOMALY_KINDS = ("repeat", "base64", "digits", "minified")
ANOMALY_SCOPES = ("sequence", "batch")
# The characters `repeat` draws from: punctuation runs (separator lines), a letter, a digit.
_REPEATED = "=-_*#~/.ax0"


@dataclass(frozen=True)
class AnomalySchedule:
    """Which optimizer steps (1-based, as the Trainer counts them) train on an anomalous document, and of which kind:
    steps `every`, 2 * `every`, ..., the kinds taking turns in order."""

    kinds: tuple[str, ...]
    every: int
    scope: str = "sequence"

    def __post_init__(self) -> None:
        if not self.kinds:
            raise ValueError(f"--anomalies: give at least one kind from {', '.join(ANOMALY_KINDS)}")
        unknown = [k for k in self.kinds if k not in ANOMALY_KINDS]
        if unknown:
            raise ValueError(
                f"--anomalies: {', '.join(map(repr, unknown))} is not an anomaly kind; choose from "
                f"{', '.join(ANOMALY_KINDS)}"
            )
        if isinstance(self.every, bool) or not isinstance(self.every, int) or self.every < 1:
            raise ValueError(f"--anomaly_every must be an int >= 1 (every N-th optimizer step), got {self.every!r}")
        if self.scope not in ANOMALY_SCOPES:
            raise ValueError(f"--anomaly_scope must be one of {', '.join(ANOMALY_SCOPES)}, got {self.scope!r}")

    @classmethod
    def parse(cls, kinds: str, every: int, scope: str = "sequence") -> AnomalySchedule:
        """From the flags: `kinds` comma-separated (``"repeat,base64"``)."""
        return cls(tuple(k.strip() for k in kinds.split(",") if k.strip()), every, scope)

    def steps(self, max_steps: int) -> list[tuple[int, str]]:
        """[(step, kind), ...] for the anomalous steps of a run of `max_steps` optimizer steps."""
        return [
            (s, self.kinds[i % len(self.kinds)]) for i, s in enumerate(range(self.every, max_steps + 1, self.every))
        ]

    def record(self, max_steps: int) -> dict[str, object]:
        """What `result.json` keeps: the flags and every anomalous step with its kind."""
        return {
            "kinds": list(self.kinds),
            "every": self.every,
            "scope": self.scope,
            "steps": [[s, k] for s, k in self.steps(max_steps)],
        }


def _minify(text: str) -> str:
    text = re.sub(r"\s+", " ", text)
    return re.sub(r" ?([^\w ]) ?", r"\1", text).strip()


def anomalous_text(kind: str, n_chars: int, generator: torch.Generator, source: str = "") -> str:
    """`n_chars` characters of an anomalous document of `kind` (`ANOMALY_KINDS`), drawn from `generator` alone;
    `minified` minifies `source` (clean text) instead and returns what is left of it."""
    if kind == "repeat":
        char = _REPEATED[int(torch.randint(len(_REPEATED), (1,), generator=generator))]
        return char * n_chars
    if kind == "base64":
        raw = torch.randint(256, (n_chars * 3 // 4 + 3,), generator=generator, dtype=torch.uint8)
        return base64.b64encode(raw.numpy().tobytes()).decode("ascii")[:n_chars]
    if kind == "digits":
        return "".join(map(str, torch.randint(10, (n_chars,), generator=generator).tolist()))
    if kind == "minified":
        return _minify(source)
    raise ValueError(f"anomalous_text: kind must be one of {ANOMALY_KINDS}, got {kind!r}")


class AnomalousBlocks(torch.utils.data.Dataset):
    """The training blocks `clean` with the anomalous documents of `schedule` in place: a dataset the Trainer reads
    in order, `batch` sequences per optimizer step (`per_device_train_batch_size * gradient_accumulation_steps`).

    `encode` turns text into token ids (as the corpus was tokenized) and `decode` token ids into text (the clean text
    `minified` starts from, taken from `tokens`, the training split). Every document is generated when the dataset
    is built, from `seed` and its step alone."""

    def __init__(
        self,
        clean: torch.utils.data.Dataset,
        schedule: AnomalySchedule,
        *,
        batch: int,
        seq_len: int,
        max_steps: int,
        seed: int,
        encode: Callable[[str], torch.Tensor],
        decode: Callable[[torch.Tensor], str],
        tokens: torch.Tensor,
    ) -> None:
        self.clean, self.schedule = clean, schedule
        self.kinds: dict[int, str] = {}
        self.replaced: dict[int, torch.Tensor] = {}
        rows = batch if schedule.scope == "batch" else 1
        for step, kind in schedule.steps(max_steps):
            for row in range(rows):
                index = (step - 1) * batch + row
                if index >= len(clean):
                    continue
                # One generator per document, seeded from the run's data seed and the document's place.
                generator = torch.Generator().manual_seed(1_000_003 * seed + index)
                self.replaced[index] = _document(kind, seq_len, generator, encode, decode, tokens)
                self.kinds[index] = kind

    def __len__(self) -> int:
        return len(self.clean)  # type: ignore[arg-type]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if i in self.replaced:
            ids = self.replaced[i]
            return {"input_ids": ids, "labels": ids}
        return self.clean[i]


def _document(
    kind: str,
    seq_len: int,
    generator: torch.Generator,
    encode: Callable[[str], torch.Tensor],
    decode: Callable[[torch.Tensor], str],
    tokens: torch.Tensor,
) -> torch.Tensor:
    """`seq_len` token ids of one anomalous document: generated text, longer each try until it tokenizes to enough."""
    n_chars = 4 * seq_len
    for _ in range(12):
        source = ""
        if kind == "minified":
            # Clean training text at a random place: twice seq_len tokens at first, more on each retry.
            width = min(len(tokens), n_chars // 2)
            start = int(torch.randint(max(1, len(tokens) - width), (1,), generator=generator))
            source = decode(tokens[start : start + width])
        ids = encode(anomalous_text(kind, n_chars, generator, source)).long()
        if len(ids) >= seq_len:
            return ids[:seq_len].clone()
        n_chars *= 2
    raise ValueError(f"anomalies: a {kind} document did not reach {seq_len} tokens; is the training text too short?")


# Steps after an anomalous one that are neither anomalous nor clean: a unit an anomaly breaks may stay broken a few
# steps (docs/lab/anomalies.md measured 1-2), so the benchmarks leave them out of the clean steps they compare with.
AFTERMATH_STEPS = 4


def clean_steps(steps: list[int], anomalous: Collection[int], skip: int, after: int = AFTERMATH_STEPS) -> list[int]:
    """The steps of `steps` past `skip` that are neither in `anomalous` nor within `after` steps after one of them."""
    near = {s + d for s in anomalous for d in range(1, after + 1)}
    return [s for s in steps if s > skip and s not in anomalous and s not in near]


_KIND_COLOURS = dict(zip(ANOMALY_KINDS, ("tab:orange", "tab:blue", "tab:brown", "tab:olive"), strict=True))


def mark_anomalies(axes: list[Any], anomalies: list[tuple[int, str]]) -> None:
    """Mark each anomalous step (`[step, kind]` pairs, as `result.json` records them) on every matplotlib axis in
    `axes` with a line in its kind's colour; the first axis gets one legend label per kind."""
    seen: set[str] = set()
    for step, kind in anomalies:
        for ax in axes:
            label = kind if ax is axes[0] and kind not in seen else None
            ax.axvline(step, color=_KIND_COLOURS.get(kind, "grey"), alpha=0.35, linewidth=1.0, label=label)
        seen.add(kind)
