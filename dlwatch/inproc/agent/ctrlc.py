"""The training process's half of the Ctrl-C protocol (the monitor's is in dlwatch.wire.interrupt).

A KeyboardInterrupt after the loop waited long for a batch, or sat long in its body, is most likely
the user stopping a hang.  :meth:`CtrlC.note` tells the monitor (an ``interrupt`` event with the main
thread's stack where it landed, and a wake-up on its stdin) and waits on a FIFO until the monitor
has taken every process's stacks; the KeyboardInterrupt then goes on unchanged.
"""

from __future__ import annotations

import os
import select
import threading
import time
from typing import Any

from dlwatch.inproc.agent.sigchld import HeldSigchld
from dlwatch.inproc.frames import interrupted_frames
from dlwatch.wire import events, interrupt

DROP_RECENT_S = 15.0  # an iterator dropped this recently before a Ctrl-C reached the block's end was dropped by it


class CtrlC:
    """One run's Ctrl-C bookkeeping: what was told, and the loop body an iterator was dropped in."""

    __slots__ = ("session", "seq", "told", "dropped")

    def __init__(self, session: Any) -> None:
        self.session = session
        self.seq = 0  # interrupt events sent
        self.told = 0  # id() of the KeyboardInterrupt last told: one incident per Ctrl-C
        self.dropped: tuple[float, float] | None = None  # an iterator dropped in the loop body: (when, body began)

    def note(self, exc: BaseException, where: str, waited_s: float, first_batch: bool = False) -> None:
        """A KeyboardInterrupt after the loop waited ``waited_s``: maybe an ``interrupt`` incident.

        When the wait could be long enough (see dlwatch.wire.interrupt), the monitor hears of it and
        this thread waits, ``ACK_TIMEOUT_S`` at most, until it has judged the wait and taken every
        process's stacks; the DataLoader's workers are still there (torch makes them ignore SIGINT).
        A second Ctrl-C ends the wait.  Never raises: the KeyboardInterrupt goes on unchanged.
        """
        s = self.session
        try:
            if id(exc) == self.told or not s.active or not s.events_path or not s.run_dir:
                return
            self.told = id(exc)
            explicit = s.options.body_timeout if where == interrupt.BODY else s.options.stall_timeout
            monitor = s.monitor
            if not interrupt.worth_telling(where, first_batch, waited_s, explicit) or monitor is None:
                return
            if monitor.poll() is not None:
                return
            with HeldSigchld(quiet=True):  # a worker's death meanwhile is torch's to report, after this
                budget = s.exit_budget = interrupt.ExitBudget()  # the answer and the stop at exit share it
                self.seq += 1
                seq = self.seq
                frames, omitted = interrupted_frames(exc)
                ack = interrupt.ack_path(s.run_dir, seq)
                fifo = _open_ack(ack)
                try:
                    events.emit(
                        s.events_path,
                        "interrupt",
                        seq=seq,
                        where=where,
                        first_batch=first_batch,
                        waited_s=round(waited_s, 3),
                        thread=threading.current_thread().name,
                        frames=frames,
                        frames_omitted=omitted,
                    )
                    monitor.stdin.write(b"interrupt\n")  # type: ignore[union-attr]
                    monitor.stdin.flush()  # type: ignore[union-attr]
                    deadline = time.monotonic() + budget.for_answer()
                    # a stopped monitor (SIGSTOP) cannot answer: no wait for it
                    while (
                        monitor.poll() is None
                        and (left := deadline - time.monotonic()) > 0
                        and not interrupt.is_stopped(monitor.pid)
                    ):
                        # a blocking wait on the FIFO: no wake-ups the monitor would read as this process's life
                        if fifo is not None:
                            if select.select([fifo], [], [], min(left, 5.0))[0]:
                                break
                        elif os.path.lexists(ack):
                            break
                        else:
                            time.sleep(0.05)
                finally:
                    if fifo is not None:
                        os.close(fifo)
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: the user does not wait for the evidence; the first goes on
        except Exception:
            pass

    def note_in_body(self, exc: BaseException) -> None:
        """A KeyboardInterrupt leaving the block or the program: if it dropped an iterator whose loop
        body had run long (see _TimedIterator.__del__), the body's wait is judged as in :meth:`note`."""
        dropped, self.dropped = self.dropped, None
        if dropped is None or id(exc) == self.told:
            return
        when, began = dropped
        # dropped by this interrupt: torch's shutdown of stuck workers takes up to 5 s a worker, then this
        if time.monotonic() - when <= DROP_RECENT_S:
            self.note(exc, interrupt.BODY, when - began)


def _open_ack(path: str) -> int | None:
    """The read end of a new FIFO for the monitor's answer (see dlwatch.wire.interrupt), or None."""
    try:
        os.mkfifo(path, 0o600)  # in the private run directory
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
