"""Exit codes of the DataLoader workers behind an exception, read in the training process.

torch raises ``DataLoader worker (pid(s) N) exited unexpectedly`` without the signal
that ended the worker, and reaps it at once, so the monitor (not its parent) rarely
sees the zombie's wait status.  The iterator that raised is in the traceback's
frames (``self`` of ``_try_get_data``/``_next_data``); its ``_workers`` are
``multiprocessing`` processes whose ``exitcode`` is negative for a signal.  Runs only
when an exception leaves the watch block; never raises.
"""

from __future__ import annotations

from typing import Any

__all__ = ["worker_exitcodes"]

MAX_FRAMES = 200


def _iterators(exc: BaseException) -> list[Any]:
    found: list[Any] = []
    seen: set[int] = set()
    chain: list[BaseException] = []
    e: BaseException | None = exc
    while e is not None and id(e) not in seen and len(chain) < 8:
        seen.add(id(e))
        chain.append(e)
        e = e.__cause__ or e.__context__
    for err in chain:
        tb = err.__traceback__
        n = 0
        while tb is not None and n < MAX_FRAMES:
            obj = tb.tb_frame.f_locals.get("self")
            if (
                obj is not None
                and isinstance(getattr(obj, "_workers", None), list)
                and all(o is not obj for o in found)
            ):
                found.append(obj)
            tb, n = tb.tb_next, n + 1
    return found


def worker_exitcodes(exc: BaseException) -> dict[str, int]:
    """{pid: exitcode} of the workers that have ended, of every DataLoader iterator in the traceback."""
    out: dict[str, int] = {}
    try:
        for it in _iterators(exc):
            for w in it._workers:
                code = getattr(w, "exitcode", None)  # waitpid(WNOHANG) once, as torch's own checks do
                pid = getattr(w, "pid", None)
                if isinstance(code, int) and isinstance(pid, int):
                    out[str(pid)] = code
    except Exception:
        pass
    return out
