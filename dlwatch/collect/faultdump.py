"""Python stacks without ptrace: faulthandler on a real-time signal.

This module is the monitor's half of the fallback used when py-spy is missing or
ptrace is refused (the watched processes' half, and the files both agree on, are
:mod:`dlwatch.wire.dumps`):

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

import dataclasses
import os
import re
import stat
import time
from typing import Callable, Mapping

from dlwatch.collect import bounds
from dlwatch.collect.pidhandle import ProcessHandle, RefusedSignal
from dlwatch.model import Frame, StackDump, ThreadStack
from dlwatch.wire.dumps import (  # the half that runs in the watched processes
    CRASH_SUFFIX,
    DUMP_SIGNAL,
    crash_path,
    install,
    install_crash,
    is_handler_installed,
)

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


def _read_regular(path: str, limit: int) -> bytes | None:
    """At most ``limit`` bytes of ``path`` if it is a regular file (no symlink followed, no FIFO
    opened blocking), else None: a worker's crash and interrupt files are the worker's writing."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        return os.read(fd, limit)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_crash(path: str, *, limit: int = 1 << 20) -> dict[str, object] | None:
    """The stack a crashed process left in its crash file, or None when it wrote nothing.

    Reads only a regular file (no symlink followed), at most ``limit`` bytes.  Returns
    ``{"signal": "SIGSEGV", "fatal_error": "Segmentation fault", "stack": StackDump dict}``.
    """
    data = _read_regular(path, limit)
    if data is None or not data.strip():
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


def read_interrupt(path: str, pid: int, *, limit: int = 1 << 20) -> StackDump | None:
    """The stacks a worker wrote when SIGINT reached it (dlwatch.wire.dumps.install_interrupt), or None.

    Regular files only (no symlink followed), at most ``limit`` bytes.
    """
    data = _read_regular(path, limit)
    if data is None:
        return None
    text = data.decode("utf-8", errors="replace")
    threads = parse_faulthandler(text)
    if not threads:
        return None
    # faulthandler lists the threads newest first: the main thread (the oldest) is the last
    threads = (*threads[:-1], dataclasses.replace(threads[-1], name=threads[-1].name or "MainThread"))
    return bounds.trim_dump(
        StackDump(pid=pid, source="faulthandler-sigint", threads=threads),
        cut_at_bytes=len(data) if len(data) >= limit else None,
    )


def _pid_of(path: str) -> int:
    name = os.path.basename(path)
    head = name[: -len(CRASH_SUFFIX)] if name.endswith(CRASH_SUFFIX) else name
    return int(head) if head.isascii() and head.isdigit() else 0
