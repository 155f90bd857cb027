"""dlwatch's one warning category, and the warning that points at the program's own line."""

from __future__ import annotations

from typing import Iterable

from dlwatch.inproc.frames import user_stacklevel
from dlwatch.redact import warn


class DlwatchWarning(RuntimeWarning):
    """dlwatch could not do something; training goes on unchanged."""


def warn_program(message: str) -> None:
    """One ``DlwatchWarning``, shown at the program's line (filter it the usual way)."""
    warn(f"dlwatch: {message}", DlwatchWarning, stacklevel=user_stacklevel())


_ENV_WARNED: set[str] = set()  # bad DLWATCH_* values this process has warned about


def warn_env(problems: Iterable[str]) -> None:
    """One warning per bad environment value and process, however many watches start (see wire/config)."""
    for problem in problems:
        if problem not in _ENV_WARNED:
            _ENV_WARNED.add(problem)
            warn_program(problem)
