"""The dump and crash files of a run, and the half of them that runs in the watched processes.

``install(dump_dir)`` runs inside each watched process (the training process and every
DataLoader worker): it registers ``faulthandler`` on ``DUMP_SIGNAL`` to write all threads'
stacks to ``<dump_dir>/<pid>.txt`` when the monitor asks (:mod:`dlwatch.collect.faultdump`
sends the signal and reads the file).  ``install_crash(dump_dir)`` runs in each worker:
faulthandler on the fatal signals into ``<dump_dir>/<pid>.crash.txt``, read by the monitor
after a native crash.
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal's C half: no enum round trip, in each worker
import faulthandler
import os
import signal
from typing import Callable

from dlwatch._fs import append_new_or_private

# SIGUSR1/2 are often taken by users and schedulers (SLURM, torchelastic); glibc
# reserves the first two real-time signals for itself (SIGRTMIN already skips
# them).  +6 is an arbitrary fixed slot, the same in every process of a run.
DUMP_SIGNAL: int = int(signal.SIGRTMIN) + 6
_SIGINT = int(signal.SIGINT)

# (pid that registered, fd, path).  A forked child inherits this, the
# registration and the fd; install() notices the pid changed and re-registers.
_installed: tuple[int, int, str] | None = None


def _caught_signals(pid: int | str) -> int | None:
    """The SigCgt bit mask of a process (bit n-1 = signal n), None if unreadable."""
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"SigCgt:"):
                    return int(line.split()[1], 16)
    except (OSError, ValueError, IndexError):
        return None
    return None


def is_handler_installed(pid: int) -> bool:
    """Whether pid currently catches DUMP_SIGNAL (so sending it will not kill it)."""
    mask = _caught_signals(pid)
    return mask is not None and bool(mask & (1 << (DUMP_SIGNAL - 1)))


# dump directories this process (or the parent it was forked from) made or found: a worker's three
# files then cost no mkdir each (a failed mkdir raises, and in a process that has just forked every
# page the exception touches is a copy-on-write fault)
_dirs: set[str] = set()


def _dump_dir(dump_dir: str) -> None:
    """The run's dump directory, made only as a child of a run directory that exists.

    Never its parents: a worker that starts (or a forkserver worker that installs) after the
    watch removed its run directory must not bring a ``.runs/<id>`` back, with the umask's mode.
    A directory seen before is not made again: should it be gone, the file's open fails as the
    mkdir would have (its parent gone) and the install answers None.
    """
    if dump_dir in _dirs:
        return
    try:
        os.mkdir(dump_dir, 0o700)
    except FileExistsError:
        pass
    _dirs.add(dump_dir)


def _point_at(fd: int, register: Callable[[int], object], inherited: tuple[int, int, str] | None) -> bool:
    """Point a faulthandler handler at ``fd`` (``register(fd)``): False, with ``fd`` closed, when it fails.

    Once it points there, the file it pointed at before (the copy a forked child inherited from its
    parent, or a previous run directory's) is no longer referenced and is closed here; the parent
    keeps its own copy."""
    try:
        register(fd)
    except Exception:
        os.close(fd)
        return False
    if inherited is not None and inherited[1] != fd:
        try:
            os.close(inherited[1])
        except OSError:
            pass
    return True


def install(dump_dir: str) -> str | None:
    """Register faulthandler on DUMP_SIGNAL, writing to ``<dump_dir>/<pid>.txt``.

    Cheap (a few syscalls) and never raises: returns the dump file's path, or
    None when the fallback cannot be installed here (an unwritable directory,
    no real-time signals, or someone else's handler already on DUMP_SIGNAL).
    Call it again in a forked child: it then registers a file of its own and
    closes the copy of the parent's fd it inherited.
    """
    global _installed
    try:
        pid = os.getpid()
        path = os.path.join(dump_dir, f"{pid}.txt")
        if _installed is not None and _installed[0] == pid and _installed[2] == path:
            return path
        inherited = _installed
        if inherited is None and is_handler_installed(pid):
            # Not ours (we have no record of installing it): replacing a handler the
            # program relies on would break it, so fall back to nothing instead.
            return None
        _dump_dir(dump_dir)
        # O_APPEND: the monitor truncates this file before each request; every
        # write then lands at the new end, not at a stale offset past it (which
        # would leave a hole of NUL bytes in front of the dump).
        fd = append_new_or_private(path)  # O_APPEND, 0600; never through a link, never another user's file
        if not _point_at(
            fd, lambda f: faulthandler.register(DUMP_SIGNAL, file=f, all_threads=True, chain=False), inherited
        ):
            return None
        _installed = (pid, fd, path)
        return path
    except Exception:
        return None


def uninstall() -> None:
    """Undo ``install`` in this process (the watch block ended); never raises."""
    global _installed
    try:
        import faulthandler

        if _installed is not None and _installed[0] == os.getpid():
            faulthandler.unregister(DUMP_SIGNAL)
            os.close(_installed[1])
            _installed = None
    except Exception:
        pass


CRASH_SUFFIX = ".crash.txt"


# (pid, fd, path) of the crash file this process enabled
_crash: tuple[int, int, str] | None = None


def crash_path(dump_dir: str, pid: int) -> str:
    return os.path.join(dump_dir, f"{int(pid)}{CRASH_SUFFIX}")


def install_crash(dump_dir: str) -> str | None:
    """In a DataLoader worker: faulthandler on SIGSEGV/SIGBUS/SIGABRT/SIGFPE/SIGILL into a private file.

    The worker then writes every thread's Python stack before it dies of a native crash,
    the line of the dataset that torch's "killed by signal" never names.  When the
    program already enabled faulthandler (``-X faulthandler``, ``PYTHONFAULTHANDLER``,
    pytest), its own choice stays as it is and this returns None.  Never raises.
    """
    global _crash
    try:
        pid = os.getpid()
        if _crash is not None and _crash[0] == pid:
            return _crash[2]
        if faulthandler.is_enabled() and _crash is None:
            return None  # the program's own setting: not ours to change
        _dump_dir(dump_dir)
        path = crash_path(dump_dir, pid)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        if not _point_at(fd, lambda f: faulthandler.enable(file=f, all_threads=True), _crash):
            return None
        _crash = (pid, fd, path)
        return path
    except Exception:
        return None


INTERRUPT_SUFFIX = ".int.txt"

# (pid, fd, path) of the interrupt file this process registered
_interrupt: tuple[int, int, str] | None = None


def interrupt_path(dump_dir: str, pid: int) -> str:
    return os.path.join(dump_dir, f"{int(pid)}{INTERRUPT_SUFFIX}")


def install_interrupt(dump_dir: str) -> str | None:
    """In a DataLoader worker: every thread's Python stack into a private file when SIGINT arrives.

    A terminal's Ctrl-C reaches the whole process group: torch's workers end on the
    KeyboardInterrupt at once, and the monitor, told of the Ctrl-C by the training process
    (dlwatch.wire.interrupt), finds them gone.  faulthandler's handler writes the stacks from
    the signal itself and then chains to Python's own (``chain=True``): the KeyboardInterrupt
    is raised where it was raised before, and ``signal.getsignal(SIGINT)`` still answers
    ``default_int_handler``.  Only where SIGINT has Python's default handler (a worker that
    ignores it, or has its own, keeps it as it is).  Never raises.
    """
    global _interrupt
    try:
        pid = os.getpid()
        if _interrupt is not None and _interrupt[0] == pid:
            return _interrupt[2]
        if _signal.getsignal(_SIGINT) is not signal.default_int_handler:
            return None
        _dump_dir(dump_dir)
        path = interrupt_path(dump_dir, pid)
        fd = append_new_or_private(path)
        if not _point_at(
            fd, lambda f: faulthandler.register(_SIGINT, file=f, all_threads=True, chain=True), _interrupt
        ):
            return None
        _interrupt = (pid, fd, path)
        return path
    except Exception:
        return None
