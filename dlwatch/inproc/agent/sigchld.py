"""torch's SIGCHLD handler, set aside while dlwatch's own code runs in the main thread.

torch's handler raises "DataLoader worker (pid N) is killed by signal" wherever the main thread
happens to be when a worker dies.  Inside dlwatch's code that exception would be swallowed by a
catch-all that guards the training loop from dlwatch's own failures, or surface with dlwatch's
frames.  ``with HeldSigchld():`` notes a SIGCHLD instead; on leaving, torch's handler is put back
and, if one was noted, run once: it raises its own exception as it would have, and the code at
the boundary to the program takes dlwatch's frames off it (:func:`unhide`), so it surfaces in the
program's loop as bare.
"""

from __future__ import annotations

import signal
import threading
from typing import Any

import _signal as _sig  # signal's C half: the same handlers without the enum round trip (every checked batch)

from dlwatch.inproc.frames import strip_own_frames

_SIGCHLD = int(getattr(signal, "SIGCHLD", 0))


class HeldSigchld:
    """``with HeldSigchld():`` torch's SIGCHLD handler waits while the block runs.

    Only a Python-level handler (torch's) is set aside, and only in the main thread (Python runs
    signal handlers there only, so elsewhere nothing can interrupt dlwatch).  It is replaced by a
    noting handler, not SIG_IGN: ignoring SIGCHLD would make the kernel reap children by itself.
    ``quiet=True``: torch's exception for a SIGCHLD noted meanwhile is dropped (at interpreter exit,
    and in the Ctrl-C wait, where the KeyboardInterrupt goes on instead).  Cost: two
    ``signal.signal`` calls (never on the per-batch path of unsampled batches).
    """

    __slots__ = ("handler", "seen", "quiet")

    def __init__(self, quiet: bool = False) -> None:
        self.handler: Any = None
        self.seen = False
        self.quiet = quiet

    def _note(self, signum: int, frame: Any) -> None:
        self.seen = True

    def __enter__(self) -> "HeldSigchld":
        try:
            if threading.current_thread() is not threading.main_thread():
                return self
            current = _sig.getsignal(_SIGCHLD)
            if not callable(current):
                return self
            _sig.signal(_SIGCHLD, self._note)
            self.handler = current
        except (AttributeError, OSError, ValueError):
            pass
        return self

    def __exit__(self, tp: Any, value: Any, tb: Any) -> bool:
        """Put torch's handler back; if a SIGCHLD came meanwhile, run it now (it may raise torch's exception)."""
        handler, self.handler = self.handler, None
        if handler is None:
            return False
        try:
            _sig.signal(_SIGCHLD, handler)
        except (OSError, ValueError, TypeError):
            return False
        if self.seen:
            if not self.quiet:
                handler(signal.SIGCHLD, None)
            else:
                try:
                    handler(signal.SIGCHLD, None)
                except BaseException:
                    pass
        return False


def unhide(exc: BaseException) -> None:
    """Take dlwatch's frames off an exception that leaves dlwatch's code for the program's."""
    try:
        exc.__traceback__ = strip_own_frames(exc.__traceback__)
    except Exception:
        pass
