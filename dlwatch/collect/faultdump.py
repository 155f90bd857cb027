"""Python stacks without ptrace: faulthandler on a real-time signal.

This module owns both halves of the fallback used when py-spy is missing or
ptrace is refused:

- ``install(dump_dir)`` runs inside each watched process (the training process
  and every DataLoader worker): it registers ``faulthandler`` on
  ``DUMP_SIGNAL`` to write all threads' stacks to ``<dump_dir>/<pid>.txt``.
- ``request_dumps({pid: path})`` runs in the monitor: it empties each file,
  sends the signal, waits for the text to settle and parses it.

faulthandler writes from its C signal handler without taking the GIL, so this
works even when the target deadlocked while holding the GIL.  It shows only
Python frames, and no thread names.

The default action of a real-time signal is to terminate the process, so the
monitor signals only pids that reported an installed handler, and it checks the
pid's caught-signal mask (``SigCgt`` in /proc/<pid>/status) before sending, so
that a process that never installed is not killed.  The signal goes through a
handle taken before those checks (``pidhandle``: a pidfd), so that a pid recycled
after them, while the dump file is read, is never signalled.
"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Callable, Mapping

from dlwatch.collect import bounds
from dlwatch.collect.pidhandle import ProcessHandle, RefusedSignal
from dlwatch.model import Frame, StackDump, ThreadStack

__all__ = [
    "DUMP_SIGNAL",
    "crash_path",
    "install",
    "install_crash",
    "is_handler_installed",
    "read_crash",
    "request_dumps",
    "parse_faulthandler",
]

# SIGUSR1/2 are often taken by users and schedulers (SLURM, torchelastic); glibc
# reserves the first two real-time signals for itself (SIGRTMIN already skips
# them).  +6 is an arbitrary fixed slot, the same in every process of a run.
DUMP_SIGNAL: int = int(signal.SIGRTMIN) + 6

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
        import faulthandler

        pid = os.getpid()
        path = os.path.join(dump_dir, f"{pid}.txt")
        if _installed is not None and _installed[0] == pid and _installed[2] == path:
            return path
        inherited = _installed
        if inherited is None and is_handler_installed(pid):
            # Not ours (we have no record of installing it): replacing a handler the
            # program relies on would break it, so fall back to nothing instead.
            return None
        os.makedirs(dump_dir, mode=0o700, exist_ok=True)
        # O_APPEND: the monitor truncates this file before each request; every
        # write then lands at the new end, not at a stale offset past it (which
        # would leave a hole of NUL bytes in front of the dump).
        from dlwatch._fs import open_private

        fd = open_private(path)  # O_APPEND, 0600; never through a link, never another user's file
        try:
            faulthandler.register(DUMP_SIGNAL, file=fd, all_threads=True, chain=False)
        except Exception:
            os.close(fd)
            return None
        _installed = (pid, fd, path)
        if inherited is not None and inherited[1] != fd:
            try:
                # The fd inherited from the parent (or a previous directory): no
                # longer referenced by the handler; the parent keeps its own copy.
                os.close(inherited[1])
            except OSError:
                pass
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


# --------------------------------------------------------------------------- parsing

_HEADER = re.compile(
    r"^(?:Current thread|Thread) (?P<tid>0x[0-9a-fA-F]+)"
    r"(?: \[(?P<name>[^\]]*)\])?"  # newer Pythons may print a thread name
    r"(?: \(most recent call first\))?:\s*$"
)
_STACK_HEADER = re.compile(r"^Stack \(most recent call first\):\s*$")  # all_threads=False
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\?\?\?|-?\d+) in (?P<func>.*?)\s*$')


def parse_faulthandler(text: str | bytes) -> tuple[ThreadStack, ...]:
    """faulthandler's dump text -> threads, innermost frame first.  Never raises.

    Each thread is trimmed to collect.bounds (``frames_omitted`` says how many frames went);
    the number of threads is left to ``bounds.trim_dump``, which records it.

    Lines that are neither a thread header nor a frame are skipped ("<no Python
    frame>", "...", a second dump appended to the first, garbage); a frame
    before any header is put in a thread of unknown id.
    """
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        text = text.replace("\x00", "")
        threads: list[ThreadStack] = []
        tid: int | None = None
        name: str | None = None
        frames: list[Frame] = []
        started = False

        def flush() -> None:
            if started:
                # faulthandler's "Current thread" is the one that ran the signal
                # handler: not necessarily the GIL holder, so owns_gil stays None.
                threads.append(
                    bounds.trim_thread(ThreadStack(thread_id=tid, name=name, frames=tuple(frames), active=None))
                )

        for line in text.splitlines():
            m = _HEADER.match(line)
            if m or _STACK_HEADER.match(line):
                flush()
                started = True
                frames = []
                tid = int(m.group("tid"), 16) if m else None
                name = (m.group("name") or None) if m else None
                continue
            fm = _FRAME.match(line)
            if fm:
                if not started:
                    started, tid, name = True, None, None
                raw_line = fm.group("line")
                line_no = int(raw_line) if raw_line.isascii() and raw_line.lstrip("-").isdigit() else None
                func = fm.group("func") or "<unknown>"
                frames.append(
                    Frame(
                        function=func,
                        filename=fm.group("file") or None,
                        line=line_no if line_no and line_no > 0 else None,
                    )
                )
        flush()
        return tuple(threads)
    except Exception:
        return ()


# --------------------------------------------------------------------------- requesting


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:
        return -1


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as fh:
            return fh.read(bounds.MAX_DUMP_READ_BYTES)  # faulthandler's own limits keep an honest dump well under this
    except OSError:
        return b""


def request_dumps(
    pids_to_paths: Mapping[int, str],
    *,
    timeout_s: float = 2.0,
    settle_s: float = 0.05,
    read: Callable[[str], bytes | None] | None = None,
    allow: Callable[[int], bool] | None = None,
    raw: dict[int, bytes] | None = None,
    uid: int | None = None,
) -> dict[int, StackDump]:
    """Ask each process for a faulthandler dump and parse it; never raises.

    Only pids that installed the handler (``install`` returned ``path``) may be
    passed, and each is signalled only if /proc confirms it still catches
    DUMP_SIGNAL (and ``allow(pid)`` holds, when given: checked right before the
    signal).  A file counts as complete once it is non-empty and has not grown
    for ``settle_s``; the whole call returns within about ``timeout_s``.

    By default (the monitor: the run directory is its own) each file is emptied
    before the signal and read by path.  With ``read`` (attach: the files belong
    to the target's user) a file is only ever read, through ``read(path)``, never
    emptied nor written: the dump is what the file gained after the signal (the
    writer appends).  ``raw``, when given, receives the dump text of each pid.
    """
    start = time.monotonic()
    results: dict[int, StackDump] = {}
    pending: dict[int, str] = {}
    base: dict[int, int] = {}

    def fail(pid: int, error: str) -> None:
        results[pid] = StackDump(pid=pid, source="none", error=error, duration_s=round(time.monotonic() - start, 6))

    # Bytes read per pid, every poll included: a dump that keeps growing (a fake worker answering
    # the signal with megabytes) is read at most bounds.MAX_DUMP_BYTES_PER_PROCESS in all.
    spent: dict[int, int] = {}
    last_read: dict[int, bytes] = {}  # attach: what size() read in this round, parsed without a second read

    def contents(pid: int, path: str) -> bytes:
        if read is None:
            return _read(path)
        data = last_read.get(pid)
        if data is None:
            data = read(path) or b""
            spent[pid] = spent.get(pid, 0) + len(data)
        return data[base.get(pid, 0) : base.get(pid, 0) + bounds.MAX_DUMP_READ_BYTES]

    def is_full(pid: int, grown: int) -> bool:
        """No more of it will be read: the read cap is reached, or this pid's read budget is spent."""
        return (
            base.get(pid, 0) + grown >= bounds.MAX_DUMP_READ_BYTES
            or spent.get(pid, 0) >= bounds.MAX_DUMP_BYTES_PER_PROCESS
        )

    def parsed(pid: int, text: bytes, now: float, error: str | None = None) -> StackDump | None:
        threads = parse_faulthandler(text)
        if not threads:
            return None
        if raw is not None:
            raw[pid] = text
        cut = len(text) if is_full(pid, len(text)) else None
        return bounds.trim_dump(
            StackDump(pid=pid, source="faulthandler", threads=threads, error=error, duration_s=round(now - start, 6)),
            cut_at_bytes=cut,
        )

    want_uid = os.geteuid() if uid is None else uid
    for pid, path in pids_to_paths.items():
        pid = int(pid)
        # taken before the checks: they, and the signal, are about this one process, whatever
        # happens to its pid meanwhile (reading the dump file can take a while under attach)
        handle = ProcessHandle.open(pid)
        try:
            if handle is None:
                fail(pid, f"process {pid} no longer exists")
                continue
            if handle.uid != want_uid:
                fail(pid, f"process {pid} runs as uid {handle.uid}, not as the target's uid {want_uid} (not signalled)")
                continue
            if allow is not None and not allow(pid):
                fail(pid, f"process {pid} is not the target or one of its processes (not signalled)")
                continue
            if not is_handler_installed(pid):
                fail(
                    pid,
                    f"process {pid} has no dlwatch dump handler on signal {DUMP_SIGNAL} "
                    "(not signalled: it would kill the process)",
                )
                continue
            if read is not None:
                before = read(path)
                if before is None:
                    fail(pid, f"faulthandler dump file {path} of process {pid} cannot be read safely (not signalled)")
                    continue
                base[pid] = len(before)
            else:
                # The writer's fd is O_APPEND, so emptying the file from here is safe:
                # its next write goes to offset 0 of the emptied file.
                with open(path, "r+b") as fh:
                    fh.truncate(0)
                base[pid] = 0
            handle.send(DUMP_SIGNAL, uid=want_uid)
            pending[pid] = path
        except ProcessLookupError:
            fail(pid, f"process {pid} no longer exists (not signalled: its pid may be another process's now)")
        except RefusedSignal as exc:
            fail(pid, str(exc))
        except PermissionError as exc:
            fail(
                pid,
                f"cannot signal process {pid} or write {path}: {exc.strerror}; "
                "run dlwatch as the same user as the training process",
            )
        except OSError as exc:
            fail(pid, f"faulthandler dump file {path} unusable: {exc.strerror or exc}")
        finally:
            if handle is not None:
                handle.close()

    def size(pid: int) -> int:
        if read is None:
            return _size(pending[pid])
        data = read(pending[pid])
        spent[pid] = spent.get(pid, 0) + len(data or b"")
        if data is not None:
            last_read[pid] = data
        return -1 if data is None else max(0, len(data) - base[pid])

    last_size = {pid: 0 for pid in pending}
    last_change = {pid: time.monotonic() for pid in pending}
    deadline = start + timeout_s
    while pending:
        now = time.monotonic()
        for pid in list(pending):
            grown = size(pid)
            if grown != last_size[pid]:
                last_size[pid], last_change[pid] = grown, now
            if grown > 0 and (now - last_change[pid] >= settle_s or is_full(pid, grown)):
                path = pending.pop(pid)
                dump = parsed(pid, contents(pid, path), now)
                if dump is not None:
                    results[pid] = dump
                else:
                    fail(pid, f"faulthandler dump of process {pid} held no stack")
        if not pending:
            break
        if now >= deadline:
            for pid, path in pending.items():
                dump = parsed(
                    pid, contents(pid, path), now, error=f"dump still growing after {timeout_s:g} s; may be incomplete"
                )
                if dump is not None:  # partial but useful: say so
                    results[pid] = dump
                else:
                    state = "gone" if not os.path.exists(f"/proc/{pid}") else "alive"
                    fail(
                        pid,
                        f"no faulthandler dump from process {pid} within {timeout_s:g} s "
                        f"(process {state}; a stopped process cannot run the handler)",
                    )
            break
        time.sleep(0.01 if read is None else 0.05)
    return results


# --------------------------------------------------------------------------- a crashed process's last stack

CRASH_SUFFIX = ".crash.txt"
_FATAL = re.compile(r"^Fatal Python error: (?P<what>[^\n]*)$", re.MULTILINE)
# faulthandler's names for the fatal signals it handles
CRASH_SIGNALS = {
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Aborted": "SIGABRT",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}

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
        import faulthandler

        pid = os.getpid()
        if _crash is not None and _crash[0] == pid:
            return _crash[2]
        if faulthandler.is_enabled() and _crash is None:
            return None  # the program's own setting: not ours to change
        os.makedirs(dump_dir, mode=0o700, exist_ok=True)
        path = crash_path(dump_dir, pid)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            faulthandler.enable(file=fd, all_threads=True)
        except Exception:
            os.close(fd)
            return None
        inherited, _crash = _crash, (pid, fd, path)
        if inherited is not None:  # a forked child of a process that had its own crash file
            try:
                os.close(inherited[1])
            except OSError:
                pass
        return path
    except Exception:
        return None


def read_crash(path: str, *, limit: int = 1 << 20) -> dict[str, object] | None:
    """The stack a crashed process left in its crash file, or None when it wrote nothing.

    Reads only a regular file (no symlink followed), at most ``limit`` bytes.  Returns
    ``{"signal": "SIGSEGV", "fatal_error": "Segmentation fault", "stack": StackDump dict}``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        import stat as _stat

        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        data = os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)
    if not data.strip():
        return None
    text = data.decode("utf-8", errors="replace")
    m = _FATAL.search(text)
    what = m.group("what").strip() if m else None
    threads = parse_faulthandler(text)
    if what is None and not threads:
        return None
    dump = bounds.trim_dump(
        StackDump(pid=_pid_of(path), source="faulthandler-crash", threads=threads),
        cut_at_bytes=len(data) if len(data) >= limit else None,
    )
    return {"signal": CRASH_SIGNALS.get(what or ""), "fatal_error": what, "stack": dump.to_dict()}


def _pid_of(path: str) -> int:
    name = os.path.basename(path)
    head = name[: -len(CRASH_SUFFIX)] if name.endswith(CRASH_SUFFIX) else name
    return int(head) if head.isascii() and head.isdigit() else 0
