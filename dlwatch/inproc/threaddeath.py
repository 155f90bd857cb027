"""A thread of the training process that dies with an exception: its name, the exception and its line, told to the monitor.

A producer thread (a DALI-style decoder, a prefetcher filling a ``queue.Queue``) feeds a loader
that has no workers; when it dies, nothing tells the loop, which waits in ``queue.get()`` for
good.  Python hands such a death to ``threading.excepthook`` before the thread ends
(docs/design.md's facts), so while a watch runs that hook is chained: the death is written to
the run's events (``thread_died``: the thread's name, the exception's type and first line, its
innermost frames) and then the hook that was there before runs, unchanged (the traceback on
stderr is the program's own).  Nothing else is touched; a program that sets its own hook later
simply replaces this one, and ``uninstall`` leaves a hook the program set meanwhile in place.
"""

from __future__ import annotations

import threading
import traceback
from typing import Any

from dlwatch.wire import contract, events

EVENT = contract.THREAD_DIED.name
MAX_FRAMES = 8
MAX_MESSAGE = 512

_state: dict[str, Any] = {"paths": []}  # "hook": ours, "previous": the hook before it, "paths": live watches'


def install(events_path: str) -> None:
    """Chain the hook (once per process); a death is told to the innermost live watch."""
    _state["paths"].append(events_path)
    if _state.get("hook") is not None and threading.excepthook is _state["hook"]:
        return
    previous = threading.excepthook

    def hook(args: Any) -> None:
        try:
            _record(args)
        except BaseException:
            pass  # a record that cannot be made never hides the program's own report of the death
        previous(args)

    _state["hook"], _state["previous"] = hook, previous
    threading.excepthook = hook


def uninstall(events_path: str) -> None:
    """This watch is over; with no watch left, put the previous hook back (unless the program set its own)."""
    paths = _state["paths"]
    if events_path in paths:
        paths.remove(events_path)
    if paths:
        return
    hook = _state.pop("hook", None)
    previous = _state.pop("previous", None)
    if hook is not None and threading.excepthook is hook:
        threading.excepthook = previous


def _record(args: Any) -> None:
    path = _state["paths"][-1] if _state["paths"] else None
    exc_type = getattr(args, "exc_type", None)
    if not path or exc_type is None or issubclass(exc_type, SystemExit):
        return  # SystemExit ends a thread quietly: the default hook ignores it too
    thread = getattr(args, "thread", None)
    value = getattr(args, "exc_value", None)
    frames = []
    tb = getattr(args, "exc_traceback", None)
    for fs in reversed(traceback.extract_tb(tb, limit=64)[-MAX_FRAMES:]):  # innermost first
        frames.append({"function": fs.name, "filename": fs.filename, "line": fs.lineno})
    # BaseException's own __str__ (its args): an exception class's override is user code, not ours to call
    text = BaseException.__str__(value) if isinstance(value, BaseException) else ""
    message = text.splitlines()[0] if text else ""
    events.emit(
        path,
        EVENT,
        thread=str(getattr(thread, "name", None) or "?")[:128],
        daemon=bool(getattr(thread, "daemon", False)),
        exc_type=f"{exc_type.__module__}.{exc_type.__qualname__}"
        if exc_type.__module__ != "builtins"
        else exc_type.__qualname__,
        message=message[:MAX_MESSAGE],
        frames=frames,
    )
