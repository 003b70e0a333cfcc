"""A name -> function registry that refuses duplicates; every algorithm choice goes through one.

Start-up validation (``config/validate.py``) reads its choices from these registries, so a newly
registered estimator, loss or mode is selectable without editing a second list.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Registry(Generic[T]):
    """Named entries of one kind (``kind`` is used in error messages, e.g. "advantage estimator")."""

    def __init__(self, kind: str):
        self.kind = kind
        self._entries: dict[str, T] = {}

    def add(self, name: str, entry: T) -> T:
        """Register ``entry`` as ``name``; a name registered twice is an error (two entries would
        otherwise silently shadow each other, depending on import order)."""
        if name in self._entries:
            raise ValueError(
                f"{self.kind} {name!r} is already registered (by {_describe(self._entries[name])}); "
                f"choose another name."
            )
        self._entries[name] = entry
        return entry

    def register(self, *names: str) -> Callable[[T], T]:
        """Decorator: register the decorated function under every name of ``names``."""

        def wrap(entry: T) -> T:
            for name in names:
                self.add(name, entry)
            return entry

        return wrap

    def get(self, name: str) -> T:
        if name not in self._entries:
            raise ValueError(f"Unknown {self.kind} {name!r}; choose one of {', '.join(self.names())}.")
        return self._entries[name]

    def names(self) -> tuple[str, ...]:
        """Registered names, sorted."""
        return tuple(sorted(self._entries))

    def __contains__(self, name: object) -> bool:
        return name in self._entries


def _describe(entry: object) -> str:
    module, name = getattr(entry, "__module__", None), getattr(entry, "__qualname__", None)
    return f"{module}.{name}" if module and name else repr(entry)
