"""Where the training process's other threads were at each fork of a DataLoader worker.

A worker forked while another thread of the training process held a lock inherits that
lock held, by a thread that does not exist in the worker: the worker blocks on it forever
(the seed's deadlock).  Once the fork has passed, nobody can say which thread held it:
py-spy and pystack see the worker waiting and the parent moved on.  dlwatch is in the
training process at that moment, so it records, as the iterator that forks the workers is
about to be built (armed only then, for fork workers), every other thread's name and
innermost Python frames, and whether it was merely idle (waiting on an Event, a Condition, a
queue, a selector); ``os.register_at_fork(before=...)`` then notes each worker fork with that
record (nothing is read inside the fork itself).  The monitor's
``worker-deadlock`` judgement later names the likely holder from this record.

Cost: one ``sys._current_frames()`` and a walk of a few frames per thread, per iterator that
forks workers (bench/forkthreads_cost.py: the per-fork figure is now the per-iterator one).  Never raises into the fork; never runs in the child.
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
_OWN = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # the dlwatch package
# examples/ is installed inside it as dlwatch._examples (pyproject.toml package-dir): programs, whose
# threads are the program's (`dlwatch demo` runs them from there), not dlwatch's own
_EXAMPLES = os.path.join(_OWN, "_examples") + os.sep


def _own(filename: str) -> bool:
    return filename.startswith(_OWN) and not filename.startswith(_EXAMPLES)


_armed = False
_current: list[dict[str, Any]] | None = None
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


def _machinery(t: threading.Thread) -> bool:
    """torch's and multiprocessing's own threads (pin memory, queue feeders, resource sharer), known
    by their target before any of their frames is touched: they hold no lock of the program's
    across a fork, and walking their frames is not ours to do."""
    target = getattr(t, "_target", None)
    module = str(getattr(target, "__module__", "") or "")
    return module.startswith(("torch.", "multiprocessing.")) or t.name.startswith("QueueFeederThread")


def snapshot(skip_ident: int | None = None) -> list[dict[str, Any]]:
    """Every thread but ``skip_ident`` (default: the calling one): name, innermost frames, idle or not.

    dlwatch's own threads and those of torch's DataLoader (pin memory, queue feeders) are left
    out: they hold no lock of the program's across a fork (multiprocessing resets its own)."""
    me = threading.get_ident() if skip_ident is None else skip_ident
    threads = {t.ident: t for t in threading.enumerate()}
    skip = {ident for ident, t in threads.items() if _machinery(t)}
    names = {ident: t.name for ident, t in threads.items()}
    out = []
    current = sys._current_frames()
    # this thread's own frame (this function's, made into an object by the call) must not stay in a
    # local: the frame would then reference itself when it returns, and keep every frame above it
    # (with the iterator being built) alive in a cycle until the garbage collector runs; a worker
    # forked meanwhile inherits that garbage and its collector runs torch's __del__ there
    # ("can only test a child process")
    current.pop(threading.get_ident(), None)
    for ident in list(current):
        frame = current.pop(ident)
        if ident == me or ident in skip or len(out) >= MAX_THREADS:
            continue
        frames = _frames(frame)
        files = [f["filename"] for f in frames]
        if any(_own(f) for f in files):
            continue
        if any("torch/utils/data/_utils/pin_memory.py" in f or f.endswith("multiprocessing/queues.py") for f in files):
            continue
        out.append(
            {"name": names.get(ident, f"thread-{ident}"), "ident": ident, "frames": frames, "idle": _idle(frames)}
        )
    frame = None  # no frame object outlives this call through its locals
    return out


def _before_fork() -> None:
    # nothing is read inside fork: the record taken at arm() stands for every fork of the iterator
    # being built (a walk of the threads inside fork would run Python in the middle of it)
    if not _armed or os.getpid() != _pid or len(_forks) >= MAX_FORKS or _current is None:
        return
    _forks.append(_current)


def arm() -> None:
    """Record the threads at each fork from now until :func:`take` (an iterator is being built)."""
    global _armed, _pid, _registered, _current
    if not _registered:
        os.register_at_fork(before=_before_fork)
        _registered = True
    _forks.clear()
    try:
        _current = snapshot()
    except Exception:
        _current = None
    _pid = os.getpid()
    _armed = True


def disarm() -> None:
    global _armed, _current
    _armed = False
    _current = None
    _forks.clear()


def take() -> list[list[dict[str, Any]]]:
    """The records since :func:`arm`, one per fork in fork order (worker i is the i-th), and disarm."""
    global _armed, _current
    _armed = False
    _current = None
    got = list(_forks)
    _forks.clear()
    return got
