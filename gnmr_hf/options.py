"""A backend's options: a dataclass it declares, read from Python, JSON or ``key=value`` text, checked by name.

`GNMRConfig.backend_options` keeps the raw value (a dict, or the text given on the command line, read into a dict
here without knowing the backend); the backend's own class types and validates it once, when the units are built.
Every input form is typed by the same rules, from the field's annotation (`BackendOptions.parse`), so `bits=5`,
``{"bits": 5.0}`` and ``--backend_options bits=5`` give the same option and ``bits=5.5`` the same error.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
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
    with errors that name the option (`check_choice`, `check_int`, `check_bool`).

    `parse` reads a mapping, a JSON object or ``key=value,...`` text and types each value by its field's annotation,
    the same way for all three: `int` takes an integral number (5 or 5.0, not 5.5 or true), `float` any number,
    `bool` only true or false, `str` a string, `X | None` also none (null), `list[X]` a list of X (in text, or as one
    string, items separated by ';'); a string is read as the command line writes it ("5", "true"). A field of
    another type gets the value as given. Messages name the option; `Backend.parse_options` puts the backend's name
    in front.
    """

    def check_choice(self, name: str, allowed: Sequence[Any]) -> None:
        """Option `name` must be one of `allowed` (ValueError)."""
        value = getattr(self, name)
        if value not in allowed:
            raise ValueError(f"option {name!r} must be one of {list(allowed)}, got {value!r}")

    def check_int(self, name: str, minimum: int, maximum: int | None = None) -> None:
        """Option `name` must be an int (TypeError) >= `minimum`, and <= `maximum` if given (ValueError)."""
        value = getattr(self, name)
        bounds = f">= {minimum}" if maximum is None else f"in {minimum}..{maximum}"
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"option {name!r} must be an int {bounds}, got {value!r}")
        if value < minimum or (maximum is not None and value > maximum):
            raise ValueError(f"option {name!r} must be an int {bounds}, got {value}")

    def check_bool(self, name: str) -> None:
        """Option `name` must be True or False (TypeError)."""
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
        values = {name: _typed(value, hints[name], name) for name, value in data.items()}
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
            data = json.loads(text, object_pairs_hook=lambda pairs: _unique(pairs, what, text))
        except json.JSONDecodeError as err:
            raise ValueError(f"{what}: {text!r} is not a valid JSON object: {err}") from None
        if not isinstance(data, dict):
            raise ValueError(f"{what}: {text!r} is not a JSON object")
        return data
    pairs = []
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"{what}: {item!r} in {text!r} is not 'key=value' (separate several with commas)")
        pairs.append((key.strip(), value.strip()))
    return _unique(pairs, what, text)


def _unique(pairs: list[tuple[str, Any]], what: str, text: str) -> dict[str, Any]:
    """`dict(pairs)`, refusing a key given twice: `dict` (and `json.loads`) would keep the last value silently, so
    `source=auto,source=checkpoint` would run with one of two values the user wrote."""
    data: dict[str, Any] = {}
    for key, value in pairs:
        if key in data:
            raise ValueError(f"{what}: option {key!r} is given twice in {text!r}; give each option once")
        data[key] = value
    return data


def _as_int(value: Any) -> int:
    if isinstance(value, str):
        text = value.strip()
        try:
            return int(text)
        except ValueError:
            value = float(text)  # "5.0" and "1e3" are integral numbers too; "five" is a ValueError
    if isinstance(value, bool):
        raise ValueError(value)
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real) and float(value).is_integer():
        return int(value)
    raise ValueError(value)


def _as_float(value: Any) -> float:
    if isinstance(value, str):
        return float(value.strip())
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(value)
    return float(value)


def _as_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(value)


def _as_str(value: Any) -> str:
    if not isinstance(value, str):
        raise ValueError(value)
    return value


# The scalar types an option is typed to: how, and what a message says is allowed.
_SCALARS: dict[Any, tuple[Any, str]] = {
    int: (_as_int, "int (5 or 5.0, not 5.5 or true)"),
    float: (_as_float, "float (any number)"),
    bool: (_as_bool, "bool (true or false)"),
    str: (_as_str, "str"),
}


def _allowed(hint: Any) -> str:
    """What an option of type `hint` takes, for messages."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("none" if a is type(None) else _allowed(a) for a in args)
    if origin in (list, tuple):
        inner = getattr(args[0], "__name__", str(args[0])) if args else "Any"
        return f"list[{inner}] (in text, items separated by ';')"
    return _SCALARS[hint][1] if hint in _SCALARS else getattr(hint, "__name__", str(hint))


def _typed(value: Any, hint: Any, name: str) -> Any:
    """`value` as option `name`'s annotated type `hint`, whichever form it came in; a ValueError says what is
    allowed. A type without a rule here passes the value through (the class's `__post_init__` checks it)."""
    try:
        return _convert(value, hint)
    except (TypeError, ValueError):
        raise ValueError(f"option {name!r} must be {_allowed(hint)}, got {value!r}") from None


def _convert(value: Any, hint: Any) -> Any:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and (value is None or (isinstance(value, str) and value.lower() in ("none", "null"))):
            return None
        for arg in args:
            if arg is not type(None):
                try:
                    return _convert(value, arg)
                except (TypeError, ValueError):
                    pass
        raise ValueError(value)
    if origin in (list, tuple):
        items = [v for v in value.split(";") if v] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ValueError(value)
        inner = args[0] if args else Any
        typed = [_convert(item, inner) for item in items]
        return tuple(typed) if origin is tuple else typed
    if hint in _SCALARS:
        return _SCALARS[hint][0](value)
    return value
