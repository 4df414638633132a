"""The command-line conventions every entry point shares (the `gnmr-hf` command, recipes/ and benchmarks/): a user's
mistake on the command line (a bad value, an unknown backend, policy or option) prints one line, `error: <message
naming the flag>`, and exits 2, before any heavy import; a traceback means a bug. Only the libraries a command needs
are imported, after its flags are checked, so `--help` and errors are quick and come without other libraries'
import-time messages (`quiet_unused_imports`).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import logging
import sys
from collections.abc import Iterator, Sequence
from typing import Any, NoReturn

__all__ = [
    "check_config",
    "fail",
    "one_line_errors",
    "parse_or_fail",
    "quiet_unused_imports",
    "unrecognized",
]

# Loggers that speak while their library is imported, each with the one backend whose run they concern. transformers
# imports torchao whenever it is installed (for its quantizer registry): CUDA kernels that fail to load on a CPU
# machine, enum registrations torch calls deprecated. bitsandbytes, on a CPU with AVX512-BF16, looks for a 4-bit
# matmul kernel in the `kernels` package and says when it is missing (its own slower kernel then runs 4-bit layers).
_IMPORT_LOGGERS = {
    "torchao": "torchao_float8",
    "torch.utils._pytree": "torchao_float8",
    "bitsandbytes.backends.cpu.ops": "bnb_4bit",
    # bitsandbytes' CPU 4-bit path fetches its kernel through the `kernels` package at import; kernels >= 0.19.1
    # logs a publisher-trust warning there whenever the Hub is offline.
    "kernels": "bnb_4bit",
}
# What deepspeed logs at import when it finds no GPU (`_import_deepspeed_quietly`).
_DEEPSPEED_CPU_GUESS = "Setting accelerator to CPU"


def fail(message: str) -> NoReturn:
    """A user error: one line on stderr, exit status 2 (argparse's status for a usage error)."""
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


_UNRECOGNIZED = "unrecognized arguments: "


def one_line_errors(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`parser`, reporting its own errors (unknown flag, bad type, missing value) with `fail`: argparse's usage
    block is as long as the flag list (640 lines beside `TrainingArguments`) and hides the one line that matters.
    An unknown flag gets the nearest known one as a suggestion (`unrecognized`)."""

    def error(message: str) -> NoReturn:
        if message.startswith(_UNRECOGNIZED):
            fail(unrecognized(parser, message[len(_UNRECOGNIZED) :].split()))
        fail(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def unrecognized(parser: argparse.ArgumentParser, args: Sequence[str]) -> str:
    """The one-line message for arguments `parser` does not know, with the closest of its flags to each unknown one
    (`--max_activ`: did you mean --max_active?), so a typo in one of hundreds of flags needs no --help."""
    # Each spelling of a flag (HfArgumentParser adds --max-active beside --max_active) -> the flag's first name.
    long = [[s for s in a.option_strings if s.startswith("--")] for a in parser._actions]
    names = {s: spellings[0] for spellings in long for s in spellings}
    hints = []
    for arg in args:
        if arg.startswith("-"):
            flag = arg.split("=", 1)[0]
            close = difflib.get_close_matches(flag, names, n=1, cutoff=0.6)
            if close:
                hints.append(f"{flag}: did you mean {names[close[0]]}?")
    return _UNRECOGNIZED + " ".join(args) + (f" ({'; '.join(hints)})" if hints else "")


def parse_or_fail(parser: Any, argv: Sequence[str] | None) -> tuple[Any, ...]:
    """`parser.parse_args_into_dataclasses(argv)` (an `HfArgumentParser`), with the dataclasses' validation errors
    (`__post_init__` raises ValueError or TypeError naming the field) and unknown arguments reported by `fail`."""
    one_line_errors(parser)
    try:
        *parsed, remaining = parser.parse_args_into_dataclasses(
            args=None if argv is None else list(argv), return_remaining_strings=True
        )
    except (ValueError, TypeError) as err:
        fail(str(err))
    if remaining:
        fail(unrecognized(parser, remaining))
    return tuple(parsed)


def check_config(config: Any) -> None:
    """Validate a `GNMRConfig`'s backend and policy with their own options classes, so that a bad name or option
    stops the command before any model is loaded. The one place the commands ask a backend and a policy to parse
    their options."""
    from .policy import get_policy
    from .registry import get_backend

    try:
        backend = get_backend(config.backend)
    except ValueError as err:
        fail(f"--backend: {err}")
    try:
        backend.parse_options(config.backend_options)
    except (ValueError, TypeError) as err:
        fail(f"--backend_options: {err}")
    try:
        policy = get_policy(config.policy)
    except ValueError as err:
        fail(f"--policy: {err}")
    try:
        policy.options.parse(config.policy_options)
    except (ValueError, TypeError) as err:
        fail(f"--policy_options: {policy.name} {err}")


@contextlib.contextmanager
def quiet_unused_imports(backend: str | None = None) -> Iterator[None]:
    """Around the heavy imports of a command: hush the import-time messages of torchao and bitsandbytes unless
    they concern `backend` (torchao's for torchao_float8, the 4-bit kernel's for bnb_4bit; None: a command without
    a backend), so that the command's own output is what the user reads first. A script in recipes/ or benchmarks/
    makes all its imports but the standard library's inside it, at the top, so that its `--help` and its errors
    come first too. Where the block imported transformers, deepspeed is imported at its end, if installed, without the
    line its import logs on a machine without a GPU (`_import_deepspeed_quietly`)."""
    loggers = [logging.getLogger(name) for name, concerns in _IMPORT_LOGGERS.items() if concerns != backend]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
        _import_deepspeed_quietly()
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.setLevel(level)


def _not_the_cpu_guess(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith(_DEEPSPEED_CPU_GUESS)


def _import_deepspeed_quietly() -> None:
    """Import deepspeed now, if installed, without its "Setting accelerator to CPU" line. accelerate imports it the
    first time it unwraps a model (every Trainer run, every save_pretrained), and that import logs the line on every
    machine without a GPU, where running on the CPU is what the user asked for; it logs on its own logger, whose level
    and handler the import itself sets, so no level set beforehand holds. Imported here, with that one line filtered
    out for the import's duration, the later import is a no-op and says nothing."""
    if "deepspeed" in sys.modules or "transformers" not in sys.modules:
        return
    if importlib.util.find_spec("deepspeed") is None:
        return
    deepspeed_logger = logging.getLogger("DeepSpeed")
    deepspeed_logger.addFilter(_not_the_cpu_guess)
    try:
        import deepspeed  # noqa: F401
    except Exception:  # a broken install fails again, with its error, where the run needs deepspeed
        pass
    finally:
        deepspeed_logger.removeFilter(_not_the_cpu_guess)
