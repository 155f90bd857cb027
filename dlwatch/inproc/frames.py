"""dlwatch's own frames, taken off the tracebacks the program sees (its wrappers sit between
the program's ``for`` loop and torch's iterator only because the iteration is watched)."""

from __future__ import annotations

import os
import sys
from typing import Any

_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the dlwatch package
# examples/ is installed inside the package as dlwatch._examples (pyproject.toml package-dir): they are
# programs (``dlwatch demo`` runs them from there), whose frames are the program's, not dlwatch's own
_EXAMPLES = os.path.join(_PACKAGE, "_examples") + os.sep


def is_own_file(filename: str) -> bool:
    """``filename`` is dlwatch's own code (not a program, not an example shipped inside the package)."""
    path = os.path.abspath(filename)
    return path.startswith(_PACKAGE) and not path.startswith(_EXAMPLES)


def user_stacklevel() -> int:
    """The ``stacklevel`` that points a warning, warned by the caller of this function, at the first
    frame outside dlwatch's own code: the program's line (its ``for`` loop).  Where every frame is
    dlwatch's (an exit handler), the outermost one, never ``sys:1`` (a stack walked past its end)."""
    level, frame = 1, sys._getframe(1)
    while frame is not None and is_own_file(frame.f_code.co_filename):
        if frame.f_back is None:
            return level
        frame = frame.f_back
        level += 1
    return level


_HIDDEN: frozenset[str] | None = None


def _hidden_files() -> frozenset[str]:
    """The files of dlwatch's wrappers: runhook.py, proxy.py, this one, and every module of agent/."""
    global _HIDDEN
    if _HIDDEN is None:
        here = os.path.dirname(os.path.abspath(__file__))
        agent = os.path.join(here, "agent")
        try:
            rooms = [os.path.join(agent, name) for name in os.listdir(agent) if name.endswith(".py")]
        except OSError:
            rooms = []
        _HIDDEN = frozenset([*(os.path.join(here, n) for n in ("runhook.py", "proxy.py", "frames.py")), *rooms])
    return _HIDDEN


def strip_own_frames(tb: Any, hidden: frozenset[str] | None = None) -> Any:
    """``tb`` without the entries of dlwatch's own wrappers (runhook.py, agent/, proxy.py).

    Those frames sit between the program's ``for`` loop and torch's iterator only because
    the iteration is watched; an uncaught exception prints the traceback plain python prints.
    """
    hidden = _hidden_files() if hidden is None else hidden

    def ours(entry: Any) -> bool:
        return entry is not None and entry.tb_frame.f_code.co_filename in hidden

    while ours(tb):
        tb = tb.tb_next
    cur = tb
    while cur is not None:
        nxt = cur.tb_next
        while ours(nxt):
            nxt = nxt.tb_next
        if nxt is not cur.tb_next:
            cur.tb_next = nxt
        cur = nxt
    return tb


def interrupted_frames(exc: BaseException, limit: int = 200) -> tuple[list[dict[str, Any]], int]:
    """The main thread's Python stack where ``exc`` landed, innermost first (as py-spy gives it).

    The traceback's entries (from the frame that caught it down to where it was raised) below the
    frames that enclose the catching one, without dlwatch's own wrappers.  Past ``limit`` frames the
    innermost ``limit * 3 // 4`` and the outermost rest are kept; returns them and how many were left out.
    """
    hidden = _hidden_files()
    entries: list[tuple[str, str, int | None]] = []
    tb = exc.__traceback__
    outer = tb.tb_frame.f_back if tb is not None else None
    while tb is not None:
        code = tb.tb_frame.f_code
        entries.append((code.co_name, code.co_filename, tb.tb_lineno))
        tb = tb.tb_next
    entries.reverse()  # innermost first
    while outer is not None:
        code = outer.f_code
        entries.append((code.co_name, code.co_filename, outer.f_lineno))
        outer = outer.f_back
    frames = [{"function": f, "filename": name, "line": line} for f, name, line in entries if name not in hidden]
    if len(frames) <= limit:
        return frames, 0
    inner = limit * 3 // 4
    return frames[:inner] + frames[len(frames) - (limit - inner) :], len(frames) - limit
