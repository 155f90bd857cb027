"""Signal a process, never a recycled pid and never one that changed hands: one handle per process.

A pid checked earlier is not the same process later: a local user can cycle a few
thousand pids in a third of a second, so a process that dlwatch vetted (a DataLoader
worker catching the dump signal, a py-spy target to resume) may have exited and
handed its pid to someone else's process by the time the signal goes out.  As root
under ``dlwatch attach`` that would deliver the dump signal, whose default action
terminates, to a root process.  The same process may also have *become* another: an
``execve`` of a setuid program keeps the pid (and the pidfd) but not the owner, and any
exec drops the dump handler that made the signal harmless.

``ProcessHandle.open(pid)`` is taken before the checks.  It records the process's
:class:`Identity`: real, effective, saved and filesystem uids and gids, start time, and
the identity (device, inode) of its executable.  Where the kernel and Python offer it
(Linux >= 5.3, Python >= 3.9) it holds a pidfd: the handle names that one process for
good, and the /proc reads are confirmed to be of it (a null signal through the pidfd
right after them).  ``send`` reads the identity *again* right before the signal (through
the pidfd's confirmation, as at open) and refuses on any difference: another uid or gid
(a setuid or setgid exec), another executable (an exec), another start time (without a
pidfd: a recycled pid); with ``uid=``, the real and the effective uid must both be that
uid.  Then the signal goes through ``signal.pidfd_send_signal`` (a process that exited is
ESRCH, never its successor), or ``os.kill`` without a pidfd.  What remains is the few
microseconds between that last read and the signal; in that window a setuid exec keeps the
real uid, so the target's own user could send the same signal to it.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass, field

__all__ = ["Identity", "ProcessHandle", "RefusedSignal", "identity", "read_identity"]


class RefusedSignal(Exception):
    """The process could not be confirmed to be the one checked: no signal was sent (the message says why)."""


@dataclass(frozen=True)
class Identity:
    """Who a process is, as far as a signal's safety goes."""

    uids: tuple[int, ...]  # real, effective, saved, filesystem
    gids: tuple[int, ...]
    start: int  # clock ticks since boot
    exe: tuple[int, int] | None  # (st_dev, st_ino) of /proc/PID/exe; None where it cannot be read

    @property
    def uid(self) -> int:
        return self.uids[1]  # the effective uid

    def differs(self, other: Identity) -> str | None:
        """What changed from ``other`` to this one, in words; None when nothing did."""
        if self.start != other.start:
            return f"started at tick {self.start}, not {other.start}: another process holds the pid"
        if self.uids != other.uids:
            return f"its uids are now {'/'.join(map(str, self.uids))}, not {'/'.join(map(str, other.uids))}"
        if self.gids != other.gids:
            return f"its gids are now {'/'.join(map(str, self.gids))}, not {'/'.join(map(str, other.gids))}"
        if self.exe != other.exe:
            return "it has executed another program since it was checked"
        return None


def read_identity(pid: int) -> Identity | None:
    """The :class:`Identity` of ``pid``, None if unreadable or gone."""
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
        uids = next(tuple(map(int, line.split()[1:5])) for line in status.splitlines() if line.startswith(b"Uid:"))
        gids = next(tuple(map(int, line.split()[1:5])) for line in status.splitlines() if line.startswith(b"Gid:"))
    except (ValueError, IndexError, StopIteration):
        return None
    if len(uids) != 4 or len(gids) != 4:
        return None
    try:
        st = os.stat(f"/proc/{pid}/exe")
        exe: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except OSError:
        exe = None
    return Identity(uids=uids, gids=gids, start=start, exe=exe)


def identity(pid: int) -> tuple[int, int] | None:
    """(effective uid, start time in clock ticks since boot) of ``pid``, None if unreadable or gone."""
    got = read_identity(pid)
    return None if got is None else (got.uid, got.start)


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
    ident: Identity | None = None  # everything read at open; None: only uid and start are known

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
            ident = cls._confirmed(pid, fd)
        except (ProcessLookupError, PermissionError):
            if fd is not None:
                os.close(fd)
            return None
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        return cls(pid=pid, uid=ident.uid, start=ident.start, fd=fd, ident=ident)

    @staticmethod
    def _confirmed(pid: int, fd: int | None) -> Identity:
        """The identity of the process at ``pid``, confirmed (with a pidfd) to be the pidfd's."""
        ident = read_identity(pid)
        if ident is None:
            raise ProcessLookupError(pid)
        if fd is not None:
            # the /proc reads above were of the pidfd's process only if it is still alive now
            signal.pidfd_send_signal(fd, 0)
        return ident

    @property
    def is_pidfd(self) -> bool:
        return self.fd is not None

    def send(self, sig: int, *, uid: int | None = None) -> None:
        """Deliver ``sig`` to this handle's process, or raise.

        ProcessLookupError: it exited (its pid may be someone else's now).  RefusedSignal:
        its uid is not ``uid``, or its identity read right now is not the one read at open (another
        uid or gid, another program, another start time).  PermissionError: the kernel refused.
        """
        if self.closed:
            raise RefusedSignal(f"handle on process {self.pid} is closed")
        if uid is not None and self.uid != uid:
            raise RefusedSignal(f"process {self.pid} runs as uid {self.uid}, not as the target's uid {uid}")
        now = self._confirmed(self.pid, self.fd)  # the final check, right before the signal
        was = self.ident or Identity(uids=now.uids, gids=now.gids, start=self.start, exe=now.exe)
        changed = now.differs(was)
        if changed is None and now.uid != self.uid:
            changed = f"it runs as uid {now.uid} now, not {self.uid}"
        if changed is not None:
            what = "now belongs to another process" if now.start != was.start else "changed"
            raise RefusedSignal(f"pid {self.pid} {what} since it was checked ({changed}): it was not signalled")
        if uid is not None and (now.uids[0] != uid or now.uids[1] != uid):
            raise RefusedSignal(
                f"process {self.pid} has real uid {now.uids[0]} and effective uid {now.uids[1]}, "
                f"not both the target's uid {uid}: it was not signalled"
            )
        if self.fd is not None:
            signal.pidfd_send_signal(self.fd, sig)
            return
        os.kill(self.pid, sig)

    def close(self) -> None:
        if self.fd is not None and not self.closed:
            os.close(self.fd)
        self.closed = True

    def __enter__(self) -> ProcessHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
