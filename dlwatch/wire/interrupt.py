"""A Ctrl-C after a long wait: what the training process tells the monitor, and how it hears back.

The user who presses Ctrl-C after the loop has waited for a batch (or sat in its body) for a long
time is most likely stopping a hang.  The training process notes the ``KeyboardInterrupt`` where it
lands, before the DataLoader's iterator is dropped (its workers ignore SIGINT, and torch's shutdown
would end them): an ``interrupt`` event (see :func:`event`) and a wake-up on the monitor's stdin.
The monitor judges the wait against the stall allowance that applied (``SHARE`` of it, see
``dlwatch.detect.stall``); when it was long enough it takes every process's stacks and writes an
incident with trigger ``interrupt``.  Either way it then creates ``ack_path(run_dir, seq)``, which
the training process waits for (``ACK_TIMEOUT_S`` at most; a second Ctrl-C ends the wait at once)
before the ``KeyboardInterrupt`` goes on, unchanged.

A short wait costs nothing: the training process knows the smallest allowance that can apply
(``MIN_ALLOWANCE_S``, or the user's explicit timeout) and tells the monitor nothing below
``SHARE`` of it.

``ACK_TIMEOUT_S`` is what a Ctrl-C may cost in all, the monitor's stop at exit included (the
README's "20 s at most"): :class:`ExitBudget` starts at the Ctrl-C, and the wait for the answer,
the wait for the monitor to stop and the finishing child (when the monitor is gone) share it.  A
stopped monitor (SIGSTOP, a debugger) can neither answer nor stop: the training process stops
waiting for it as soon as it sees it stopped (:func:`is_stopped`), and kills it at exit rather than
wait for a stop it cannot make.
"""

from __future__ import annotations

import os
import stat
import time

from dlwatch._fs import create_private

SHARE = 0.25  # of the stall allowance that applied: a wait this long is likely a hang the user is stopping
# the smallest allowance each kind of wait can get without an explicit timeout (dlwatch.detect.stall:
# ADAPTIVE_FLOOR_S, FIRST_BATCH_S, BODY_BLOCKED_S; tests/test_interrupt.py checks they agree)
MIN_ALLOWANCE_S = {"data": 60.0, "first": 300.0, "body": 300.0}
ACK_TIMEOUT_S = 20.0  # the monitor's window (1 s) and stack dumps (5 s a process, in parallel), with room
ACK_NAME = "interrupt-ack"

STOP_RESERVE_S = 3.0  # of the budget, kept for the monitor's stop and the summary after the wait
MIN_STEP_S = 0.5  # the least a step of the exit gets, however little of the budget is left

WAITING = "waiting_for_data"
BODY = "in_loop_body"


def kind(where: str, first_batch: bool) -> str:
    """The allowance a wait is judged by: ``data``, ``first`` (the first batch of an epoch) or ``body``."""
    if where == BODY:
        return "body"
    return "first" if first_batch else "data"


def worth_telling(where: str, first_batch: bool, waited_s: float, explicit_s: float | None) -> bool:
    """Whether a wait of ``waited_s`` could reach ``SHARE`` of any allowance the monitor may apply."""
    allowance = explicit_s if explicit_s is not None else MIN_ALLOWANCE_S[kind(where, first_batch)]
    return waited_s >= SHARE * allowance


def is_stopped(pid: int) -> bool:
    """Whether ``pid`` (the monitor: a child of the caller, so its pid is not reused while unreaped)
    is stopped (state T, or t under a tracer): it cannot answer or exit until it is continued."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read()
    except OSError:
        return False
    fields = text[text.rfind(b")") + 2 :].split()
    return bool(fields) and fields[0] in (b"T", b"t")


class ExitBudget:
    """What is left of one Ctrl-C's ``ACK_TIMEOUT_S`` (see the module docstring)."""

    def __init__(self, total_s: float = ACK_TIMEOUT_S, now: float | None = None) -> None:
        self.deadline = (time.monotonic() if now is None else now) + total_s

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def for_answer(self) -> float:
        """The wait for the monitor's answer: the budget less what stopping the monitor needs."""
        return max(0.0, self.left() - STOP_RESERVE_S)

    def for_step(self, usual_s: float) -> float:
        """A later step's wait (the monitor's stop, the finishing child): ``usual_s``, or what is left.
        A budget already spent is of a Ctrl-C the program caught and went on after: ``usual_s``."""
        left = self.left()
        return usual_s if left <= 0 else min(usual_s, max(MIN_STEP_S, left))


def ack_path(run_dir: str, seq: int) -> str:
    return os.path.join(run_dir, f"{ACK_NAME}-{int(seq)}")


MAX_FRAMES = 200  # as collect.bounds keeps of a thread: the innermost 150 and the outermost 50


def normalize(ev: dict[str, object]) -> dict[str, object] | None:
    """The ``interrupt`` event well-typed (see :func:`dlwatch.wire.events.normalize`), or None to skip it."""
    seq, where, waited = ev.get("seq"), ev.get("where"), ev.get("waited_s")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0 or where not in (WAITING, BODY):
        return None
    if not isinstance(waited, (int, float)) or isinstance(waited, bool) or not 0 <= waited < 1e9:
        return None
    ev["first_batch"] = ev.get("first_batch") is True
    frames = []
    raw = ev.get("frames")
    for f in raw[:MAX_FRAMES] if isinstance(raw, list) else ():
        if not isinstance(f, dict) or not isinstance(f.get("function"), str):
            continue
        name, line = f.get("filename"), f.get("line")
        frames.append(
            {
                "function": f["function"][:256],
                "filename": name[:4096] if isinstance(name, str) else None,
                "line": line if isinstance(line, int) and not isinstance(line, bool) else None,
            }
        )
    ev["frames"] = frames
    omitted = ev.get("frames_omitted")
    ev["frames_omitted"] = omitted if isinstance(omitted, int) and not isinstance(omitted, bool) else 0
    thread = ev.get("thread")
    ev["thread"] = thread[:256] if isinstance(thread, str) else None
    return ev


def answer(path: str) -> None:
    """The monitor's answer: a byte into the training process's FIFO at ``path`` (the file itself
    when it made none).  Never through a link; never blocks; never raises."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        try:
            os.close(create_private(path))
        except OSError:
            pass
        return
    except OSError:  # ENXIO: nobody reads it any more (the training process stopped waiting)
        return
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, b"1")
    except OSError:
        pass
    finally:
        os.close(fd)
