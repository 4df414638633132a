"""A backend's options: a dataclass it declares, read from Python, JSON or ``key=value`` text, checked by name.

`GNMRConfig.backend_options` keeps the raw value (a dict, or the text given on the command line, read into a dict
here without knowing the backend); the backend's own class validates it once, when the units are built.
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["BackendOptions", "parse_options_text"]

OptionsT = TypeVar("OptionsT", bound="BackendOptions")


@dataclass
class BackendOptions:
    """Base class of a backend's options: a dataclass whose fields are the options, validated in `__post_init__`
    with errors that name the option (`check_choice`, `check_int`, `check_bool` help). `parse` reads a mapping, a
    JSON object or ``key=value,...`` text, converting text to the field types (int, float, bool, str, their
    Optional forms, and lists of them separated by ';'). Messages name the option; `Backend.parse_options` puts
    the backend's name in front.
    """

    def check_choice(self, name: str, allowed: Sequence[Any]) -> None:
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(f"option {name!r} must be one of {list(allowed)}, got {value!r}")

    def check_int(self, name: str, minimum: int, maximum: int | None = None) -> None:
        value = getattr(self, name)
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"option {name!r} must be an int {bounds}, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"option {name!r} must be an int {bounds}, got {value}")

    def check_bool(self, name: str) -> None:
        value = getattr(self, name)
        if not isinstance(value, bool):
            raise TypeError(f"option {name!r} must be True or False, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls: type[OptionsT], options: Mapping[str, Any] | str | None) -> OptionsT:
        """An instance from a mapping, a JSON object string, ``key=value,...`` text, or None (the defaults)."""
        data = parse_options_text(options, what="options")
        known = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"has unknown options {unknown}; known options are {sorted(known)}")
        hints = typing.get_type_hints(cls)
        values = {name: _coerce(value, hints[name], name) for name, value in data.items()}
        return cls(**values)


def parse_options_text(options: Mapping[str, Any] | str | None, what: str) -> dict[str, Any]:
    """A dict from a mapping, a JSON object string, ``key=value,key=value`` text, or None."""
    if options is None:
        return {}
    if isinstance(options, Mapping):
        return dict(options)
    if not isinstance(options, str):
        raise TypeError(f"{what} must be a dict, a JSON object or 'key=value,...' text, got {type(options).__name__}")
    text = options.strip()
    if not text:
        return {}
    if text.startswith("{"):
        try:
            data = json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{what}: {text!r} is not a valid JSON object: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{what}: {text!r} is not a JSON object")
        return data
    data = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: {item!r} in {text!r} is not 'key=value' (separate several with commas)")
        data[key.strip()] = value.strip()
    return data


def _coerce(value: Any, hint: Any, name: str) -> Any:
    """Text from the command line to the option's type; other values pass through (validation is the class's)."""
    if not isinstance(value, str):
        return value
    args = typing.get_args(hint)
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        if value.lower() in ("none", "null") and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        return _coerce(value, inner[0], name) if len(inner) == 1 else value
    if origin in (list, tuple) and args:
        return [_coerce(v, args[0], name) for v in value.split(";") if v]
    try:
        if hint is bool:
            lowered = value.lower()
            if lowered not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(value)
            return lowered in ("true", "1", "yes")
        if hint in (int, float):
            return hint(value)
    except ValueError:
        raise ValueError(f"option {name!r} must be {hint.__name__}, got {value!r}") from None
    return value
