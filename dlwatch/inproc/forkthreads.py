"""Where the training process's other threads were at each fork of a DataLoader worker.

A worker forked while another thread of the training process held a lock inherits that
lock held, by a thread that does not exist in the worker: the worker blocks on it forever
(the seed's deadlock).  Once the fork has passed, nobody can say which thread held it:
py-spy and pystack see the worker waiting and the parent moved on.  dlwatch is in the
training process at that moment, so it records, at each fork of the iterator being built
(``os.register_at_fork(before=...)``, armed only while dlwatch builds a DataLoader iterator
with fork workers), every other thread's name and innermost Python frames, and whether it
was merely idle (waiting on an Event, a Condition, a queue, a selector).  The monitor's
``worker-deadlock`` judgement later names the likely holder from this record.

Cost: one ``sys._current_frames()`` and a walk of a few frames per thread, per worker fork
(bench/forkthreads_cost.py).  Never raises into the fork; never runs in the child.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import Any

__all__ = ["arm", "disarm", "take", "snapshot"]

MAX_THREADS = 16  # threads recorded per fork (the forking thread is never one of them)
MAX_FRAMES = 6  # innermost Python frames per thread
MAX_FORKS = 16  # forks recorded per iterator (one per worker)

# idle waits: a thread in one of these at the fork holds no lock of the program's (it waits for one,
# or for an event); (file suffix, function)
_IDLE = (
    ("threading.py", "wait"),
    ("threading.py", "_wait_for_tstate_lock"),
    ("queue.py", "get"),
    ("selectors.py", "select"),
    ("socket.py", "accept"),
    ("multiprocessing/connection.py", "_poll"),
    ("multiprocessing/connection.py", "wait"),
)
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the dlwatch package

_armed = False
_pid = 0
_forks: list[list[dict[str, Any]]] = []
_registered = False


def _frames(frame: Any) -> list[dict[str, Any]]:
    out = []
    while frame is not None and len(out) < MAX_FRAMES:
        code = frame.f_code
        out.append({"function": code.co_name, "filename": code.co_filename, "line": frame.f_lineno})
        frame = frame.f_back
    return out


def _idle(frames: list[dict[str, Any]]) -> str | None:
    if not frames:
        return None
    top = frames[0]
    for suffix, func in _IDLE:
        if top["function"] == func and top["filename"].endswith(suffix):
            return f"{func} ({suffix})"
    return None


def snapshot(skip_ident: int | None = None) -> list[dict[str, Any]]:
    """Every thread but ``skip_ident`` (default: the calling one): name, innermost frames, idle or not.

    dlwatch's own threads and those of torch's DataLoader (pin memory, queue feeders) are left
    out: they hold no lock of the program's across a fork (multiprocessing resets its own)."""
    me = threading.get_ident() if skip_ident is None else skip_ident
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        if ident == me or len(out) >= MAX_THREADS:
            continue
        frames = _frames(frame)
        files = [f["filename"] for f in frames]
        if any(f.startswith(_OWN + os.sep) for f in files):
            continue
        if any("torch/utils/data/_utils/pin_memory.py" in f or f.endswith("multiprocessing/queues.py") for f in files):
            continue
        out.append(
            {"name": names.get(ident, f"thread-{ident}"), "ident": ident, "frames": frames, "idle": _idle(frames)}
        )
    return out


def _before_fork() -> None:
    if not _armed or os.getpid() != _pid or len(_forks) >= MAX_FORKS:
        return
    try:
        _forks.append(snapshot())
    except Exception:  # never into the fork
        pass


def arm() -> None:
    """Record the threads at each fork from now until :func:`take` (an iterator is being built)."""
    global _armed, _pid, _registered
    if not _registered:
        os.register_at_fork(before=_before_fork)
        _registered = True
    _forks.clear()
    _pid = os.getpid()
    _armed = True


def disarm() -> None:
    global _armed
    _armed = False
    _forks.clear()


def take() -> list[list[dict[str, Any]]]:
    """The records since :func:`arm`, one per fork in fork order (worker i is the i-th), and disarm."""
    global _armed
    _armed = False
    got = list(_forks)
    _forks.clear()
    return got
