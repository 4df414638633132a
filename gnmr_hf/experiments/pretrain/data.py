"""The text every arm trains on, and the order it sees it in: corpus, byte tokenizer, fixed blocks.

- **Corpus** (`load_corpus`): by default the Python standard library's own ``*.py`` sources, which every machine
  with Python has (about 30 MB; `site-packages` excluded), or any local text files or folder, or a `datasets` name
  (``hf:name`` or ``hf:name:config``, online). Files are sorted by path and every `val_every`-th file goes to the
  validation split, so no validation text is ever trained on.
- **Tokenizer** (`ByteTokenizer`): bytes are tokens (vocabulary 256). Nothing to train, nothing to download, and the
  loss is in nats per byte, comparable across corpora. A real model (`--model`) reads the same text in its own
  tokens instead (`retokenize`).
- **Data order** (`block_dataset`): the training batches are fixed before training (non-overlapping blocks of
  `seq_len` tokens in an order drawn from `data_seed` alone) and the Trainer reads them sequentially
  (`train_sampling_strategy="sequential"`), so the order does not depend on any random stream a backend consumes
  (stochastic rounding) and is identical in every arm. Validation is a fixed, evenly spaced set of blocks.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["ByteTokenizer", "Corpus", "block_dataset", "load_corpus", "retokenize", "text_codec"]


class ByteTokenizer:
    """Bytes are tokens: ids 0..255. `encode` takes str (UTF-8) or bytes; `decode` gives str (invalid UTF-8 is
    replaced, as a partial multi-byte character at a block edge would be)."""

    vocab_size = 256

    def encode(self, text: str | bytes) -> torch.Tensor:
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.zeros(0, dtype=torch.uint8)

    def decode(self, ids: Iterable[int] | torch.Tensor) -> str:
        values = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(values).decode("utf-8", errors="replace")


@dataclass
class Corpus:
    """Training and validation bytes as uint8 token tensors, and where they came from."""

    train: torch.Tensor
    validation: torch.Tensor
    source: str
    documents: int

    def fingerprint(self) -> str:
        """A short hash of both splits: two runs with the same fingerprint saw the same text."""
        digest = hashlib.sha256(self.train.numpy().tobytes())
        digest.update(self.validation.numpy().tobytes())
        return digest.hexdigest()[:16]


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subfolders, names in os.walk(root):
        # Installed packages live inside the stdlib folder; pruned here rather than filtered after a full walk.
        subfolders[:] = sorted(d for d in subfolders if d not in ("site-packages", "dist-packages", "__pycache__"))
        files += [Path(folder) / n for n in names if n.endswith(".py")]
    return sorted(files)


def _local_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if path.is_dir():
        return sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in (".txt", ".py", ".md", ".rst"))
    raise FileNotFoundError(f"load_corpus: {path} is neither a file nor a folder")


def _hf_documents(spec: str) -> list[bytes]:
    import datasets

    name, _, config = spec.partition(":")
    data = datasets.load_dataset(name, config or None, split="train")
    column = "text" if "text" in data.column_names else data.column_names[0]
    return [str(t).encode("utf-8") for t in data[column]]


def load_corpus(source: str = "stdlib", max_bytes: int | None = None, val_every: int = 20) -> Corpus:
    """The corpus `source` ('stdlib', a text file or folder, or 'hf:name[:config]'), split by document: every
    `val_every`-th document (in sorted path order) is validation. `max_bytes` caps the training split (0 or None:
    all of it) and the validation split at a tenth of it, taking whole documents in order; files past the caps are
    not read."""
    if source == "stdlib":
        documents: list[Path] | list[bytes] = _stdlib_files()
    elif source.startswith("hf:"):
        documents = _hf_documents(source[3:])
    else:
        documents = _local_files(Path(source))
    if len(documents) < 2:
        raise ValueError(f"load_corpus: {source!r} has {len(documents)} documents; at least 2 are needed to split")
    val_every = min(val_every, len(documents))
    caps = (max_bytes // 10, max_bytes) if max_bytes else (None, None)
    splits: tuple[list[bytes], list[bytes]] = ([], [])
    sizes = [0, 0]
    for i, doc in enumerate(documents):
        which = 0 if i % val_every == 0 else 1
        if caps[which] is not None and sizes[which] >= caps[which]:
            continue
        data = doc.read_bytes() if isinstance(doc, Path) else doc
        splits[which].append(data)
        sizes[which] += len(data) + 1
    tokenizer = ByteTokenizer()
    val, train = (tokenizer.encode(b"\n".join(split)) for split in splits)
    return Corpus(train, val, source, len(documents))


class _Blocks(torch.utils.data.Dataset):
    """Blocks of `seq_len` tokens at fixed starts: {"input_ids", "labels"} (the model shifts the labels)."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, starts: torch.Tensor) -> None:
        self.tokens, self.seq_len, self.starts = tokens, seq_len, starts

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        start = int(self.starts[i])
        ids = self.tokens[start : start + self.seq_len].long()
        return {"input_ids": ids, "labels": ids}


def block_dataset(tokens: torch.Tensor, seq_len: int, count: int, seed: int | None) -> torch.utils.data.Dataset:
    """`count` blocks of `seq_len` tokens. With a `seed`: non-overlapping blocks in a random order drawn from that
    seed alone (a new permutation each time all are used); with `seed=None`: evenly spaced blocks, for validation."""
    n_blocks = len(tokens) // seq_len
    if n_blocks < 1:
        raise ValueError(f"block_dataset: {len(tokens)} tokens hold no block of seq_len={seq_len}")
    if seed is None:
        if count > n_blocks:
            raise ValueError(f"block_dataset: {count} validation blocks asked, the split holds {n_blocks}")
        index = torch.linspace(0, n_blocks - 1, count).round().long()
    else:
        generator = torch.Generator().manual_seed(seed)
        epochs = -(-count // n_blocks)
        index = torch.cat([torch.randperm(n_blocks, generator=generator) for _ in range(epochs)])[:count]
    return _Blocks(tokens, seq_len, index * seq_len)


def text_codec(model: str) -> tuple[Callable[[str], torch.Tensor], Callable[[torch.Tensor], str]]:
    """(encode, decode) between text and the token ids a run of `model` trains on: bytes for "scratch"
    (`ByteTokenizer`), the real model's own tokenizer otherwise (int32 ids, as `retokenize` makes them)."""
    if model == "scratch":
        tokenizer = ByteTokenizer()
        return tokenizer.encode, tokenizer.decode
    from transformers import AutoTokenizer

    from ..models import resolve_model

    real = AutoTokenizer.from_pretrained(str(resolve_model(model)))

    def encode(text: str) -> torch.Tensor:
        return torch.tensor(real(text).input_ids, dtype=torch.int32)

    def decode(ids: torch.Tensor) -> str:
        return real.decode(ids.tolist())

    return encode, decode


def retokenize(corpus: Corpus, model: str) -> Corpus:
    """`corpus` in the tokens of the real model `model`'s tokenizer (int32), for `--model`; as it is for scratch."""
    if model == "scratch":
        return corpus
    encode, _ = text_codec(model)
    decode = ByteTokenizer().decode
    return Corpus(
        encode(decode(corpus.train)),
        encode(decode(corpus.validation)),
        f"{corpus.source} ({model} tokens)",
        corpus.documents,
    )
