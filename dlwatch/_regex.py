"""Regular expressions that run in linear time: every playbook pattern is compiled here.

Playbook patterns are matched against exception text and stack frames that the
training program (or anyone who can make it raise) controls, inside the monitor
and, when the monitor is gone, inside the training process itself.  A
backtracking engine can take exponential time on such text (``(a+)+$`` on 30
characters takes seconds), so patterns are compiled with RE2 (``google-re2``),
which guarantees time linear in the text, and the text itself is bounded
(:func:`bound_text`).  A pattern RE2 cannot take (backreferences, lookaround)
is refused when the playbook is loaded, with the reason.
"""

from __future__ import annotations

from typing import Any

try:
    import re2 as _re2

    _OPTIONS = _re2.Options()
    _OPTIONS.log_errors = False  # RE2 would otherwise print each refused pattern on stderr
except ImportError:  # pragma: no cover - google-re2 is a dependency; see compile()
    _re2 = None
    _OPTIONS = None

__all__ = ["MAX_TEXT_CHARS", "Pattern", "RegexError", "bound_text", "compile"]

Pattern = Any  # an RE2 pattern: .search(text) -> match with .start(), .end(), .group()

# Exception text longer than this is matched on its head and tail only: the message and
# the innermost frames, which is where every shipped pattern looks.
MAX_TEXT_CHARS = 64 * 1024
_HEAD_CHARS = 16 * 1024
MAX_FIELD_CHARS = 4096  # one frame's function or filename, a type name, a waiting_in


class RegexError(ValueError):
    """A pattern the linear-time engine cannot take; the message says why."""


def compile(pattern: str) -> Pattern:
    if _re2 is None:
        raise RegexError(
            "the google-re2 package is not installed (pip install google-re2): "
            "playbook patterns need its linear-time engine"
        )
    try:
        return _re2.compile(pattern, _OPTIONS)
    except _re2.error as exc:
        reason = exc.args[0] if exc.args else exc
        if isinstance(reason, bytes):
            reason = reason.decode("utf-8", "replace")
        raise RegexError(
            f"{reason} (patterns run on RE2, which guarantees linear time: "
            "no backreferences, no lookahead or lookbehind)"
        ) from None


def bound_text(text: str, limit: int = MAX_TEXT_CHARS) -> str:
    """``text`` if short enough, else its head and tail joined by a marker line."""
    if len(text) <= limit:
        return text
    head = min(_HEAD_CHARS, limit // 4)
    return f"{text[:head]}\n...\n{text[len(text) - (limit - head) :]}"
