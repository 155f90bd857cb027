"""dlwatch's one warning category, and the warning that points at the program's own line."""

from __future__ import annotations

from dlwatch.inproc.frames import user_stacklevel as _user_stacklevel
from dlwatch.redact import warn


class DlwatchWarning(RuntimeWarning):
    """dlwatch could not do something; training goes on unchanged."""


def _warn(message: str) -> None:
    warn(f"dlwatch: {message}", DlwatchWarning, stacklevel=_user_stacklevel())  # at the program's line
