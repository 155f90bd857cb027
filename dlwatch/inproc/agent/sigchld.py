"""torch's SIGCHLD handler, set aside while dlwatch's own code runs in the main thread."""

from __future__ import annotations

import signal
import threading
from typing import Any

import _signal as _sig  # signal's C half: the same handlers without the enum round trip (every checked batch)

from dlwatch.inproc.frames import strip_own_frames


class _HeldSigchld:
    """torch's SIGCHLD handler, set aside while dlwatch's own code runs in the main thread.

    torch's handler raises "DataLoader worker (pid N) is killed by signal" wherever the main thread
    happens to be when a worker dies.  Inside dlwatch's code that exception would be swallowed by a
    catch-all that guards the training loop from dlwatch's own failures, or surface with dlwatch's
    frames.  While held, a SIGCHLD is only noted; on release torch's handler is put back and, if one
    was noted, run once: it raises its own exception as it would have, and the caller takes dlwatch's
    frames off it, so it surfaces in the program's loop as bare.
    """

    __slots__ = ("handler", "seen")

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.seen = False

    def _note(self, signum: int, frame: Any) -> None:
        self.seen = True


_SIGCHLD = int(getattr(signal, "SIGCHLD", 0))


def _hold_sigchld() -> _HeldSigchld | None:
    """Set a Python-level SIGCHLD handler (torch's) aside; None where there is none or not in the main thread.

    A noting handler, not SIG_IGN: ignoring SIGCHLD would make the kernel reap children by itself.
    Python runs signal handlers in the main thread only, so elsewhere nothing can interrupt dlwatch.
    """
    try:
        if threading.current_thread() is not threading.main_thread():
            return None
        current = _sig.getsignal(_SIGCHLD)
        if not callable(current):
            return None
        held = _HeldSigchld(current)
        _sig.signal(_SIGCHLD, held._note)
        return held
    except (AttributeError, OSError, ValueError):
        return None


def _release_sigchld(held: _HeldSigchld | None) -> None:
    """Put torch's handler back; if a SIGCHLD came meanwhile, run it now (it may raise torch's exception)."""
    if held is None:
        return
    try:
        _sig.signal(_SIGCHLD, held.handler)
    except (OSError, ValueError, TypeError):
        return
    if held.seen:
        held.handler(signal.SIGCHLD, None)


def _unhide(exc: BaseException) -> None:
    """Take dlwatch's frames off an exception that leaves dlwatch's code for the program's."""
    try:
        exc.__traceback__ = strip_own_frames(exc.__traceback__)
    except Exception:
        pass
