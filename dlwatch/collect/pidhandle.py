"""Signal a process, never a recycled pid: one handle per process, taken when it is checked.

A pid checked earlier is not the same process later: a local user can cycle a few
thousand pids in a third of a second, so a process that dlwatch vetted (a DataLoader
worker catching the dump signal, a py-spy target to resume) may have exited and
handed its pid to someone else's process by the time the signal goes out.  As root
under ``dlwatch attach`` that would deliver the dump signal, whose default action
terminates, to a root process.

``ProcessHandle.open(pid)`` is taken before the checks.  Where the kernel and
Python offer it (Linux >= 5.3, Python >= 3.9) it holds a pidfd: the handle names
that one process for good, its uid and start time are read and then confirmed to
belong to it (a null signal through the pidfd), and ``send`` goes through
``signal.pidfd_send_signal``; a process that exited is ESRCH, never its successor.
Without a pidfd the handle remembers the uid and start time, and ``send`` reads
them again right before ``os.kill`` and refuses on any difference or doubt (the
remaining window is the few microseconds between that read and the kill).

``send(sig, uid=...)`` also refuses a process whose uid is not the one given: the
target's, so that a process of another user is never signalled on its behalf.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

__all__ = ["ProcessHandle", "RefusedSignal", "identity"]


class RefusedSignal(Exception):
    """The process could not be confirmed to be the one checked: no signal was sent (the message says why)."""


def identity(pid: int) -> tuple[int, int] | None:
    """(effective uid, start time in clock ticks since boot) of ``pid``, None if unreadable or gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        with open(f"/proc/{pid}/status", "rb") as f:
            status = f.read()
    except OSError:
        return None
    try:
        fields = stat[stat.rindex(b")") + 2 :].split()
        start = int(fields[19])  # field 22, starttime; fields[] begins at field 3 (state)
        uid = next(int(line.split()[2]) for line in status.splitlines() if line.startswith(b"Uid:"))
    except (ValueError, IndexError, StopIteration):
        return None
    return uid, start


def _pidfd_usable() -> bool:
    return hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


@dataclass
class ProcessHandle:
    """One process, as it was when the handle was taken; close it (or use ``with``)."""

    pid: int
    uid: int
    start: int
    fd: int | None = None
    closed: bool = field(default=False, repr=False)

    @classmethod
    def open(cls, pid: int) -> ProcessHandle | None:
        """A handle on the process that holds ``pid`` now; None when there is none (or it cannot be read)."""
        fd = None
        if _pidfd_usable():
            try:
                fd = os.pidfd_open(pid)
            except ProcessLookupError:
                return None
            except OSError:
                fd = None  # ENOSYS (old kernel), EMFILE: fall back to the recheck
        try:
            ident = identity(pid)
            if ident is None:
                raise ProcessLookupError(pid)
            if fd is not None:
                # the /proc reads above were of the pidfd's process only if it is still alive now
                signal.pidfd_send_signal(fd, 0)
        except (ProcessLookupError, PermissionError):
            if fd is not None:
                os.close(fd)
            return None
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return cls(pid=pid, uid=ident[0], start=ident[1], fd=fd)

    @property
    def is_pidfd(self) -> bool:
        return self.fd is not None

    def send(self, sig: int, *, uid: int | None = None) -> None:
        """Deliver ``sig`` to this handle's process, or raise.

        ProcessLookupError: it exited (its pid may be someone else's now).  RefusedSignal:
        its uid is not ``uid``, or (without a pidfd) the pid no longer shows the same uid and
        start time.  PermissionError: the kernel refused.
        """
        if self.closed:
            raise RefusedSignal(f"handle on process {self.pid} is closed")
        if uid is not None and self.uid != uid:
            raise RefusedSignal(f"process {self.pid} runs as uid {self.uid}, not as the target's uid {uid}")
        if self.fd is not None:
            signal.pidfd_send_signal(self.fd, sig)
            return
        now = identity(self.pid)
        if now is None:
            raise ProcessLookupError(self.pid)
        if now != (self.uid, self.start):
            raise RefusedSignal(
                f"pid {self.pid} now belongs to another process (uid {now[0]}, started at "
                f"tick {now[1]}, not {self.start}): it was not signalled"
            )
        os.kill(self.pid, sig)

    def close(self) -> None:
        if self.fd is not None and not self.closed:
            os.close(self.fd)
        self.closed = True

    def __enter__(self) -> ProcessHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
