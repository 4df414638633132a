"""The original weights of a quantized model, read from its local safetensors: the exact recovery source.

A model loaded in 8-bit or 4-bit keeps no high-precision copy of its weights, which is the memory it exists to
save. The checkpoint it was loaded from still has them: `model.safetensors`, or the shards named by
`model.safetensors.index.json`, in the folder `name_or_path` points to (or the Hub cache snapshot of a Hub id;
never the network). Files are opened memory-mapped with `safe_open`, once each and only when needed, and a
recovery weight reads one tensor: a unit in recovery costs its own weight, never a whole shard.

Before a checkpoint tensor is trusted as a module's weight, `problem()` checks its presence, shape and dtype and
asks the backend's `matches(row)` whether its first row quantizes to the module's first quantized row: a
checkpoint the model was not quantized from (another revision, merged adapters, a re-saved fine-tune) fails
that check and is not used. The check reads one row, never a whole tensor.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

__all__ = ["CheckpointSource"]

# Checkpoint dtypes worth recovering from: anything narrower than BF16 is no better than a quantized weight.
_FLOAT_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


class CheckpointSource:
    """A model's local safetensors: key -> file, each file opened once (memory-mapped) and only when needed."""

    def __init__(self, directory: Path, weight_map: dict[str, str]) -> None:
        self.directory = directory
        self.weight_map = weight_map
        self._handles: dict[str, Any] = {}

    @classmethod
    def locate(cls, model: nn.Module) -> tuple[CheckpointSource | None, str]:
        """The checkpoint of `model` (a transformers model, or a peft model around one), or None and why not."""
        get_base_model = getattr(model, "get_base_model", None)
        base = get_base_model() if callable(get_base_model) else model
        name = getattr(base, "name_or_path", None) or getattr(getattr(base, "config", None), "_name_or_path", None)
        if not name:
            return None, "the model has no name_or_path (it was not loaded with from_pretrained)"
        directory = Path(name) if Path(name).is_dir() else _hub_snapshot(str(name))
        if directory is not None:
            index = directory / "model.safetensors.index.json"
            single = directory / "model.safetensors"
            if index.is_file():
                return cls(directory, json.loads(index.read_text())["weight_map"]), ""
            if single.is_file():
                checkpoint = cls(directory, {})
                checkpoint.weight_map = dict.fromkeys(checkpoint._open(single.name).keys(), single.name)
                return checkpoint, ""
        return None, (
            f"the model's name_or_path {name!r} is neither a local directory nor a Hub model in the local cache "
            "holding model.safetensors or model.safetensors.index.json"
        )

    def _open(self, filename: str) -> Any:
        handle = self._handles.get(filename)
        if handle is None:
            from safetensors import safe_open

            handle = safe_open(str(self.directory / filename), framework="pt")
            self._handles[filename] = handle
        return handle

    def problem(self, key: str, shape: tuple[int, ...], matches: Callable[[torch.Tensor], bool]) -> str | None:
        """Why `key` cannot serve as the high-precision weight of shape `shape`; None when it can.

        `matches(row)` gets row 0 of the checkpoint tensor (shape [1, in_features]) and says whether it quantizes
        to the module's row 0 the way the backend's library quantizes.
        """
        filename = self.weight_map.get(key)
        if filename is None:
            return f"the checkpoint in {str(self.directory)!r} has no tensor {key!r}"
        if not (self.directory / filename).is_file():
            return f"the checkpoint file {str(self.directory / filename)!r} holding {key!r} is missing"
        tensor_slice = self._open(filename).get_slice(key)
        found, dtype = tuple(tensor_slice.get_shape()), tensor_slice.get_dtype()
        if found != tuple(shape):
            return f"the checkpoint tensor {key!r} has shape {list(found)}, the module's weight {list(shape)}"
        if dtype not in _FLOAT_DTYPES:
            return f"the checkpoint tensor {key!r} is {dtype}, not a floating-point weight of at least 16 bits"
        if not matches(tensor_slice[0:1]):
            return (
                f"row 0 of the checkpoint tensor {key!r} does not quantize to the module's row 0, so the model was "
                "not quantized from this checkpoint (another revision, merged adapters, a re-saved fine-tune?)"
            )
        return None

    def tensor(self, key: str) -> torch.Tensor:
        return self._open(self.weight_map[key]).get_tensor(key)


def _hub_snapshot(repo_id: str) -> Path | None:
    """The snapshot directory of a Hub model in the default local cache (`main` revision); never the network.

    transformers 5 no longer records which revision it loaded, so a model loaded from another revision can find
    `main` here; the row check in `CheckpointSource.problem` is what keeps such a checkpoint from being used.
    """
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    for filename in ("model.safetensors.index.json", "model.safetensors"):
        try:
            path = try_to_load_from_cache(repo_id, filename)
        except ValueError:  # not a valid repo id (e.g. a local path that no longer exists)
            return None
        if isinstance(path, str):
            return Path(path).parent
    return None
