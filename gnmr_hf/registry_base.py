"""One registry for what a config names: `GNMRConfig(backend=...)` chooses a `Backend`, `GNMRConfig(policy=...)` a
`Policy`, and both are looked up the same way, so they share this class.

A registry maps a name to an item. Its built-in items are listed explicitly, in a function that lives beside them
(`gnmr_hf.backends.builtin_backends`, `gnmr_hf.policies.builtin_policies`) and runs on the first lookup: `import
gnmr_hf` imports no backend or policy, and nothing is found by scanning a folder, so a reader sees every built-in in
one place. An outside item is added with `register`; it may not take a built-in's name, so a config that names a
built-in gets the built-in whatever a script registered before. This module imports neither backends nor policies:
each registry is handed the function that lists its built-ins, so the imports point one way (down, to the items).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable
from typing import Generic, TypeVar

__all__ = ["Registry"]

T = TypeVar("T")


class Registry(Generic[T]):
    """name -> item, for one kind of item.

    Args:
        kind / plural: what the items are ("backend", "backends"), as the messages say it.
        builtin: returns the built-in items, in the order `names()` lists them; called once, on the first lookup.
        name_of: an item's name.
        suggest: an unknown name's error suggests the closest known name ("did you mean ...?").
        sort_names: `names()` is sorted alphabetically; otherwise the built-ins come first, in their listed order,
            then the registered names, sorted.
    """

    def __init__(
        self,
        kind: str,
        plural: str,
        builtin: Callable[[], Iterable[T]],
        name_of: Callable[[T], str],
        *,
        suggest: bool = True,
        sort_names: bool = False,
    ) -> None:
        self.kind, self.plural = kind, plural
        self.registered: dict[str, T] = {}
        self._list_builtin, self._name_of = builtin, name_of
        self._suggest, self._sort_names = suggest, sort_names
        self._builtin: dict[str, T] | None = None

    @property
    def builtin(self) -> dict[str, T]:
        """The built-in items by name (their modules are imported on the first call)."""
        if self._builtin is None:
            self._builtin = {self._name_of(item): item for item in self._list_builtin()}
        return self._builtin

    def register(self, item: T) -> T:
        """Add `item` under its name (replacing an earlier registration of that name); a built-in's name is refused.
        The caller checks the item itself first: what a valid item is differs by kind."""
        name = self._name_of(item)
        if name in self.builtin:
            raise ValueError(f"register_{self.kind}: {name!r} is a built-in {self.kind} and cannot be replaced")
        self.registered[name] = item
        return item

    def names(self) -> list[str]:
        """Every name `get` accepts now, built-in and registered."""
        if self._sort_names:
            return sorted({**self.builtin, **self.registered})
        return [*self.builtin, *sorted(self.registered)]

    def get(self, name: str) -> T:
        """The item called `name`; an unknown name is a `ValueError` listing the known names (and, with `suggest`,
        the closest one)."""
        if name in self.registered:
            return self.registered[name]
        if name in self.builtin:
            return self.builtin[name]
        close = difflib.get_close_matches(str(name), self.names(), n=1) if self._suggest else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise ValueError(f"unknown {self.kind} {name!r}{hint}; known {self.plural} are {self.names()}")
