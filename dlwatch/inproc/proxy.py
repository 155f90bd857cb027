"""The stand-in for a DataLoader's iterator that dlwatch's wrappers share (no imports: ``dlwatch run``'s
bootstrap loads it in every Python process of the program)."""

from __future__ import annotations

from typing import Any


class IteratorProxy:
    """An iterator standing in for a DataLoader's: ``len()`` and attribute access fall through to
    the wrapped one (``len(it)``, ``it._workers``), so code that inspects the DataLoader's
    iterator sees what it saw before.  Subclasses set ``_it`` and define ``__next__``."""

    __slots__ = ("_it",)

    def __iter__(self) -> "IteratorProxy":
        return self

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)
