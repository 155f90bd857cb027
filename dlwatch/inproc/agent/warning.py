"""dlwatch's one warning category, and the warning that points at the program's own line."""

from __future__ import annotations

from dlwatch.inproc.frames import user_stacklevel
from dlwatch.redact import warn


class DlwatchWarning(RuntimeWarning):
    """dlwatch could not do something; training goes on unchanged."""


def warn_program(message: str) -> None:
    """One ``DlwatchWarning``, shown at the program's line (filter it the usual way)."""
    warn(f"dlwatch: {message}", DlwatchWarning, stacklevel=user_stacklevel())
