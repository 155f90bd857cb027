"""The length a program asked of its loader (``len(loader)``), as it got it: kept, never asked again.

A program that asks ``len(loader)`` (a progress bar's total, Lightning's batches per epoch, an LR
schedule's steps) expects that many batches an epoch.  dlwatch never calls a program's ``__len__``
itself (it may list a bucket, open a database, count calls): it keeps what the program's own call
returned, through the watched loader's class (``watch()``), the ``as`` form's ``len()``, and
``dlwatch run``'s hook on ``DataLoader.__len__``, in a weak dictionary (no loader is kept alive).
An epoch that ends (StopIteration) short of it is told to the monitor (``epoch_ended``); what that
means is judged there.  No imports: ``dlwatch run``'s bootstrap loads this in every process.
"""

from __future__ import annotations

import weakref
from typing import Any

_ASKED: Any = weakref.WeakKeyDictionary()  # loader -> the last len() the program got


def note(loader: Any, n: Any) -> None:
    """The program asked ``len(loader)`` and got ``n``."""
    if isinstance(n, int) and not isinstance(n, bool):
        try:
            _ASKED[loader] = n
        except TypeError:  # a loader that takes no weak reference (or is unhashable): not kept
            pass


def asked(loader: Any) -> int | None:
    """The length the program last got from ``len(loader)``; None if it never asked."""
    try:
        return _ASKED.get(loader)
    except TypeError:
        return None
