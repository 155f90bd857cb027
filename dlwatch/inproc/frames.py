"""dlwatch's own frames, taken off the tracebacks the program sees (its wrappers sit between
the program's ``for`` loop and torch's iterator only because the iteration is watched)."""

from __future__ import annotations

import os
from typing import Any


def _hidden_files() -> set[str]:
    here = os.path.dirname(os.path.abspath(__file__))
    return {os.path.join(here, name) for name in ("runhook.py", "agent.py", "proxy.py", "frames.py")}


def strip_own_frames(tb: Any, hidden: set[str] | None = None) -> Any:
    """``tb`` without the entries of dlwatch's own wrappers (runhook.py, agent.py, proxy.py).

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
