"""Python stacks of live processes through py-spy: one ``py-spy dump`` per pid.

This module owns finding py-spy, running it against many pids in parallel under
timeouts, falling back from ``--native`` to a plain and then a ``--nonblocking``
dump, and turning py-spy's JSON (or its failure) into ``StackDump``.  It never
raises for a dead pid, a non-Python process, a refused ptrace or a missing
py-spy: each becomes ``StackDump(source="none", error=<one line with the fix>)``.

Measured here (py-spy 0.4.3, Linux 2 cores):
- ``py-spy dump --json`` ignores ``--subprocesses``, hence one run per pid.
- py-spy attaches with PTRACE_SEIZE (a SIGSTOPped target makes it fail with
  "unexpected waitpid result PtraceEvent(.., SIGSTOP, 128)"), so killing it in
  the middle of a dump does not leave the target stopped: 600 random SIGKILLs
  during plain and --native dumps never left a task in state T/t.  We still
  check after a kill and SIGCONT a target that we found running before and
  stopped after, because older py-spy versions used PTRACE_ATTACH, whose SIGSTOP
  can outlive a killed tracer.
- A SIGSTOPped target makes the blocking modes fail fast (no hang) while
  ``--nonblocking`` still reads it: hence the fallback order.
- ``--native --nonblocking`` is refused by py-spy ("Can't get native stack
  traces with the --nonblocking option"), so the nonblocking try is plain.
- Interrupting a sleeping target with ptrace shows in /proc afterwards: a main
  process asleep in poll(5 s) reads syscall 219 (restart_syscall) until that
  poll returns.  Read /proc before dumping stacks, not after.
"""

from __future__ import annotations

import dataclasses
import json
import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable, Sequence

from dlwatch.collect import bounds
from dlwatch.collect.pidhandle import ProcessHandle, RefusedSignal
from dlwatch.errors import PTRACE_HELP
from dlwatch.model import Frame, StackDump, ThreadStack

__all__ = [
    "PY_SPY_ENV",
    "INSTALL_HINT",
    "find_py_spy",
    "dump_stacks",
    "dump_stack",
    "parse_py_spy_json",
    "cut_at_worker_loop",
    "summarize_py_spy_error",
]

PY_SPY_ENV = "DLWATCH_PY_SPY"  # a path to py-spy; the empty string disables py-spy
INSTALL_HINT = "install py-spy (pip install py-spy) or put it on PATH"

# Modes, best first: (StackDump.source, extra py-spy arguments, name used in error text)
_NATIVE = ("py-spy-native", ("--native",), "--native dump")
_PLAIN = ("py-spy", (), "dump")
_NONBLOCKING = ("py-spy-nonblocking", ("--nonblocking",), "--nonblocking dump")

_MAX_PARALLEL = 32  # one py-spy per pid; never more at once, however big the machine
_OVER_MEMORY = "memory"  # _run_once's reason for a py-spy stopped by its memory limit
# what py-spy (Rust) says when an allocation fails under its RLIMIT_DATA
_MEMORY_ERRORS = ("memory allocation of", "Out of memory", "Cannot allocate memory", "out of memory")
_MAX_ERROR_CHARS = 300
_MAX_STDERR_BYTES = 64 << 10  # py-spy's error text; more is a backtrace we drop anyway
_OVER = "output"  # _run_once's reason for a py-spy whose output passed bounds.MAX_PY_SPY_OUTPUT_BYTES


class _Fatal(Exception):
    """A failure that no other py-spy mode can fix (dead pid, not Python, EPERM)."""


# --------------------------------------------------------------------------- finding py-spy


def _which(name: str) -> str | None:
    """shutil.which over PATH's absolute entries only: an empty or "." entry would run whatever
    another user left in the working directory (as root, under `dlwatch attach`)."""
    path = os.environ.get("PATH", os.defpath)
    return shutil.which(name, path=os.pathsep.join(p for p in path.split(os.pathsep) if os.path.isabs(p)))


def find_py_spy() -> str | None:
    """The py-spy executable to use, or None.

    ``$DLWATCH_PY_SPY`` wins when set (empty = disabled); then PATH; then the
    py-spy next to ``sys.executable``, because a venv's bin directory is often
    not on PATH when the interpreter is started by its full path.
    """
    env = os.environ.get(PY_SPY_ENV)
    if env is not None:
        if not env:
            return None
        if os.sep in env:
            return env if os.path.isfile(env) and os.access(env, os.X_OK) else None
        return _which(env)
    found = _which("py-spy")
    if found:
        return found
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    if os.path.isfile(beside) and os.access(beside, os.X_OK):
        return beside
    return None


def _missing_reason() -> str:
    env = os.environ.get(PY_SPY_ENV)
    if env == "":
        return f"py-spy is disabled (${PY_SPY_ENV} is empty); {INSTALL_HINT}"
    if env:
        return f"${PY_SPY_ENV}={env} is not an executable; {INSTALL_HINT}"
    return f"py-spy not found; {INSTALL_HINT}"


# --------------------------------------------------------------------------- parsing


def _as_int(value: Any) -> int | None:
    # bool is an int subclass; a JSON true is not a thread id
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _as_str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _as_bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _frame(raw: Any) -> Frame | None:
    if not isinstance(raw, dict):
        return None
    name = _as_str(raw.get("name")) or "<unknown>"
    filename = _as_str(raw.get("filename"))
    line = _as_int(raw.get("line"))
    # py-spy sets "module" (the shared object) only on native frames; Python
    # frames have module null.  Native frames without debug info have line 0.
    native = raw.get("module") is not None
    if line is not None and line <= 0:
        line = None
    return Frame(function=name, filename=filename, line=line, native=native)


def _is_worker_loop(frame: Frame) -> bool:
    if frame.native:
        return False
    # py-spy >= 0.4 prints qualified names; a bare "_worker_loop" is the module-level function
    if frame.function.rsplit(".", 1)[-1] != "_worker_loop":
        return False
    return frame.filename is None or frame.filename.replace("\\", "/").endswith("_utils/worker.py")


def cut_at_worker_loop(frames: Sequence[Frame]) -> tuple[Frame, ...]:
    """Drop everything outside torch's ``_worker_loop`` (frames are innermost first).

    A forked worker's stack continues below ``_worker_loop`` into the frames the
    parent had when it forked (``Popen._launch``, ``DataLoader.__iter__``, the
    user's ``main``): true in memory, but misleading in a report, since that code
    is not running in the worker.  Stacks without ``_worker_loop`` are returned
    unchanged.
    """
    for i, frame in enumerate(frames):
        if _is_worker_loop(frame):
            return tuple(frames[: i + 1])
    return tuple(frames)


def _thread(raw: Any) -> ThreadStack | None:
    if not isinstance(raw, dict):
        return None
    raw_frames = raw.get("frames")
    frames: list[Frame] = []
    if isinstance(raw_frames, list):
        for rf in raw_frames:
            f = _frame(rf)
            if f is not None:
                frames.append(f)
    return bounds.trim_thread(
        ThreadStack(
            thread_id=_as_int(raw.get("thread_id")),
            name=_as_str(raw.get("thread_name")),
            native_tid=_as_int(raw.get("os_thread_id")),
            active=_as_bool(raw.get("active")),
            owns_gil=_as_bool(raw.get("owns_gil")),
            frames=cut_at_worker_loop(frames),
        )
    )


def parse_py_spy_json(
    pid: int, text: str | bytes, *, source: str = "py-spy", duration_s: float | None = None
) -> StackDump:
    """``py-spy dump --json`` output -> StackDump.  Never raises.

    Truncated, garbled or unexpected output gives ``source="none"`` with the
    reason in ``error``; entries of the wrong shape inside a good list are
    skipped rather than failing the whole dump.
    """
    try:
        if isinstance(text, bytes):
            text = text.decode("utf-8", errors="replace")
        data = json.loads(text)
    except (ValueError, RecursionError, TypeError) as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return StackDump(
            pid=pid, source="none", duration_s=duration_s, error=f"py-spy output is not valid JSON ({first[:120]})"
        )
    if not isinstance(data, list):
        return StackDump(
            pid=pid,
            source="none",
            duration_s=duration_s,
            error=f"py-spy output is not a list of threads (got {type(data).__name__})",
        )
    # (the output itself is bounded: bounds.MAX_PY_SPY_OUTPUT_BYTES, see _run_once)
    threads, omitted = bounds.trim_threads(t for t in (_thread(raw) for raw in data) if t is not None)
    if not threads:
        return StackDump(pid=pid, source="none", duration_s=duration_s, error="py-spy output holds no threads")
    return StackDump(pid=pid, source=source, threads=threads, duration_s=duration_s, threads_omitted=omitted)


# --------------------------------------------------------------------------- py-spy's errors


def summarize_py_spy_error(stderr: str | bytes) -> str:
    """py-spy's stderr (an anyhow error, maybe with a Rust backtrace) -> one line.

    "Error: X" plus the innermost distinct "Caused by" entry; the backtrace goes.
    """
    if isinstance(stderr, bytes):
        stderr = stderr.decode("utf-8", errors="replace")
    headline: str | None = None
    causes: list[str] = []
    in_causes = False
    for raw in stderr.splitlines():
        line = raw.strip()
        if not line:
            continue
        if line.startswith("Stack backtrace:"):
            break
        if line.startswith("Caused by:"):
            in_causes = True
            continue
        if in_causes:
            # "0: No such file or directory (os error 2)"
            head, sep, rest = line.partition(": ")
            causes.append(rest.strip() if sep and head.isascii() and head.isdigit() else line)
            continue
        if headline is None:
            headline = line[len("Error:") :].strip() if line.startswith("Error:") else line
    if headline is None:
        return "py-spy failed without a message"
    text = headline
    if causes and causes[-1] != headline:
        text = f"{headline}: {causes[-1]}"
    return text[:_MAX_ERROR_CHARS]


def _tracer_pid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as fh:
            for line in fh:
                if line.startswith(b"TracerPid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _classify_failure(pid: int, stderr: str, summary: str) -> _Fatal | None:
    low = stderr.lower()
    if (
        "permission denied" in low
        or "operation not permitted" in low
        or "(os error 1)" in low
        or "(os error 13)" in low
    ):
        # A second tracer is refused with EPERM too; that needs a different fix.
        tracer = _tracer_pid(pid)
        if tracer:
            return _Fatal(
                f"process {pid} is already traced by pid {tracer} (a debugger or another py-spy); detach it and retry"
            )
        return _Fatal(f"permission denied reading process {pid}; {PTRACE_HELP}")
    if "failed to find python version" in low or "not a python process" in low:
        return _Fatal(f"process {pid} is not a Python process (py-spy: {summary})")
    if (
        "check that the process is running" in low
        or "no such process" in low
        or "(os error 3)" in low
        or not os.path.exists(f"/proc/{pid}")
    ):
        return _Fatal(f"process {pid} no longer exists")
    return None


# --------------------------------------------------------------------------- running py-spy


def _task_states(pid: int) -> dict[int, str]:
    """Scheduler state letter of every thread of pid; {} if it is gone."""
    states: dict[int, str] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return states
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat", "rb") as fh:
                stat = fh.read()
            states[int(tid)] = stat[stat.rindex(b")") + 2 :][:1].decode("ascii", "replace")
        except (OSError, ValueError):
            continue
    return states


def _is_stopped(states: dict[int, str]) -> bool:
    return any(s in ("T", "t") for s in states.values())


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    # py-spy prints a Rust backtrace under RUST_BACKTRACE=1 (set in many dev shells);
    # we only want the error text.
    env["RUST_BACKTRACE"] = "0"
    env["RUST_LIB_BACKTRACE"] = "0"
    return env


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # its own session: the group id is its pid
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.kill()
    except OSError:
        pass


def _read_bounded(proc: subprocess.Popen[bytes], timeout_s: float) -> tuple[bytes, bytes, str | None]:
    """(stdout, stderr, why it stopped early: None, "timeout" or _OVER) of a running py-spy.

    stdout is kept up to bounds.MAX_PY_SPY_OUTPUT_BYTES (one byte more means too much: stop
    there), stderr up to _MAX_STDERR_BYTES; memory never grows with what the target holds.
    """
    caps = {proc.stdout: bounds.MAX_PY_SPY_OUTPUT_BYTES, proc.stderr: _MAX_STDERR_BYTES}
    chunks: dict[Any, list[bytes]] = {f: [] for f in caps}
    sizes = {f: 0 for f in caps}
    deadline = time.monotonic() + max(timeout_s, 0.01)
    with selectors.DefaultSelector() as sel:
        for f in caps:
            sel.register(f, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return b"".join(chunks[proc.stdout]), b"".join(chunks[proc.stderr]), "timeout"
            for key, _events in sel.select(left):
                f = key.fileobj
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(f)
                    continue
                room = caps[f] - sizes[f]
                if room > 0:
                    chunks[f].append(chunk[:room])
                sizes[f] += len(chunk)
                if f is proc.stdout and sizes[f] > caps[f]:
                    return b"".join(chunks[proc.stdout]), b"".join(chunks[proc.stderr]), _OVER
    try:
        proc.wait(timeout=max(deadline - time.monotonic(), 0.01))
    except subprocess.TimeoutExpired:  # both pipes closed, yet it runs on
        return b"".join(chunks[proc.stdout]), b"".join(chunks[proc.stderr]), "timeout"
    return b"".join(chunks[proc.stdout]), b"".join(chunks[proc.stderr]), None


def limited_argv(argv: Sequence[str]) -> list[str]:
    """``argv`` run under a cap on its heap: ``RLIMIT_DATA`` set by ``/bin/sh`` right before it
    execs py-spy (no Python runs between fork and exec: the parent may have threads).  The data
    limit counts py-spy's private writable memory, not the target's libraries that ``--native``
    maps (a torch process's are about 440 MB of address space): RLIMIT_AS would refuse those."""
    if not os.path.exists("/bin/sh"):
        return list(argv)
    kib = str(bounds.MAX_PY_SPY_MEMORY_BYTES >> 10)
    # a lower hard limit already in force stays (ulimit fails): py-spy runs under that one
    return ["/bin/sh", "-c", 'ulimit -d "$1" 2>/dev/null; shift; exec "$@"', "sh", kib, *argv]


def _out_of_memory(rc: int | None, err: bytes) -> bool:
    text = err[-4096:].decode("utf-8", "replace")
    return rc in (-signal.SIGABRT, 128 + signal.SIGABRT) or any(m in text for m in _MEMORY_ERRORS)


def parallel_limit() -> int:
    """How many py-spy may run at once here: two per usable CPU (each mostly waits on the target), no
    more than a quarter of the available memory can hold at their memory limit, 32 at most, 1 at least."""
    try:
        from dlwatch.collect.system import usable_cpus

        cpus = usable_cpus().get("usable") or os.cpu_count() or 1
    except Exception:
        cpus = os.cpu_count() or 1
    by_cpu = max(2, int(2 * float(cpus)))
    by_memory = _MAX_PARALLEL
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    by_memory = int(line.split()[1]) * 1024 // (4 * bounds.MAX_PY_SPY_MEMORY_BYTES)
                    break
    except (OSError, ValueError, IndexError):
        pass
    return max(1, min(_MAX_PARALLEL, by_cpu, by_memory))


def _run_once(
    exe: str, pid: int, extra: Sequence[str], timeout_s: float, was_stopped: bool
) -> tuple[int | str | None, bytes, bytes]:
    """One py-spy run; rc None = timed out, _OVER = its output passed the cap (either way killed,
    and the target resumed if we stopped it)."""
    proc = subprocess.Popen(
        limited_argv([exe, "dump", "--json", *extra, "--pid", str(pid)]),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_child_env(),
        close_fds=True,
        # own process group, so that a hung py-spy and anything it started die together
        start_new_session=True,
    )
    # the process py-spy works on: the one to resume below, never a process that took its pid since
    resume = ProcessHandle.open(pid)
    try:
        out, err, stopped = _read_bounded(proc, timeout_s)
        if stopped is None:
            if proc.returncode != 0 and _out_of_memory(proc.returncode, err):
                return _OVER_MEMORY, out, err
            return proc.returncode, out, err
        _kill_group(proc)
        proc.wait()
        # The kernel detaches a dead tracer's tracees.  With PTRACE_SEIZE (py-spy
        # 0.4) nothing is left stopped; with PTRACE_ATTACH the attach SIGSTOP can
        # still be pending and stop the target for good.  Resume only a target
        # that was running before we started, never one the user stopped.
        if resume is not None and not was_stopped and _is_stopped(_task_states(pid)):
            try:
                resume.send(signal.SIGCONT)
            except (OSError, RefusedSignal):
                pass
        return (None if stopped == "timeout" else _OVER), out, err
    finally:
        for f in (proc.stdout, proc.stderr):
            if f is not None:
                f.close()
        if resume is not None:
            resume.close()


def dump_stack(pid: int, *, native: bool = True, timeout_s: float = 5.0, py_spy: str | None = None) -> StackDump:
    """The stacks of one process; never raises.  See ``dump_stacks``."""
    start = time.monotonic()

    def done(source: str, error: str | None, threads: tuple[ThreadStack, ...] = ()) -> StackDump:
        return StackDump(
            pid=pid, source=source, threads=threads, error=error, duration_s=round(time.monotonic() - start, 6)
        )

    try:
        exe = py_spy if py_spy is not None else find_py_spy()
        if not exe:
            return done("none", _missing_reason() if py_spy is None else f"py-spy disabled; {INSTALL_HINT}")
        states = _task_states(pid)
        if not states:
            return done("none", f"process {pid} no longer exists")
        if states.get(pid) in ("Z", "X", "x"):
            return done("none", f"process {pid} has exited (zombie, not yet reaped by its parent)")
        was_stopped = _is_stopped(states)

        modes = [_NATIVE, _PLAIN, _NONBLOCKING] if native else [_PLAIN, _NONBLOCKING]
        failures: list[str] = []
        deadline = start + timeout_s
        for i, (source, extra, label) in enumerate(modes):
            remaining = deadline - time.monotonic()
            if remaining <= 0.01:
                failures.append(f"{label} skipped: no time left of {timeout_s:g} s")
                break
            # Share what is left between this try and the ones after it, so a
            # hanging --native run cannot eat the budget of the fallbacks.
            budget = remaining if i == len(modes) - 1 else remaining / 2
            try:
                rc, out, err = _run_once(exe, pid, extra, budget, was_stopped)
            except OSError as exc:
                return done("none", f"cannot run py-spy at {exe}: {exc.strerror or exc}; {INSTALL_HINT}")
            if rc is None:
                failures.append(f"{label} timed out after {budget:.2f} s (killed)")
                continue
            if rc == _OVER_MEMORY:  # another mode would build the same answer: no retry
                cut = done(
                    "none",
                    f"py-spy reached its memory limit ({bounds.MAX_PY_SPY_MEMORY_BYTES >> 20} MiB) on process "
                    f"{pid} (very deep stacks, very many threads or very long names) and was stopped: not read",
                )
                return dataclasses.replace(cut, memory_cut_bytes=bounds.MAX_PY_SPY_MEMORY_BYTES)
            if rc == _OVER:  # another mode would read the same stacks: no retry
                over = done(
                    "none",
                    f"py-spy's output for process {pid} passed "
                    f"{bounds.MAX_PY_SPY_OUTPUT_BYTES >> 20} MiB (very deep stacks or very many "
                    "threads): not read",
                )
                return dataclasses.replace(over, cut_at_bytes=bounds.MAX_PY_SPY_OUTPUT_BYTES)
            if rc != 0:
                stderr = err.decode("utf-8", errors="replace")
                summary = summarize_py_spy_error(stderr)
                fatal = _classify_failure(pid, stderr, summary)
                if fatal is not None:
                    return done("none", str(fatal))
                failures.append(f"{label} failed: {summary}")
                continue
            parsed = parse_py_spy_json(pid, out, source=source)
            if parsed.source == "none":
                failures.append(f"{label}: {parsed.error}")
                continue
            return done(source, "; ".join(failures) or None, parsed.threads)
        return done("none", "; ".join(failures)[: 3 * _MAX_ERROR_CHARS] or "py-spy gave no stacks")
    except Exception as exc:  # a probe must degrade to a note, never raise into the monitor
        return done("none", f"stack dump failed: {type(exc).__name__}: {exc}")


def dump_stacks(
    pids: Iterable[int],
    *,
    native: bool = True,
    timeout_s: float = 5.0,
    py_spy: str | None = None,
    parallel: int | None = None,
) -> dict[int, StackDump]:
    """``{pid: StackDump}`` for every pid, dumped ``parallel`` at a time (default
    :func:`parallel_limit`, sized to this machine); never raises.

    Each pid gets one ``py-spy dump --json`` (``--native`` first when asked, then
    plain, then ``--nonblocking``), all within ``timeout_s`` of wall time per pid,
    each py-spy under a memory limit (``bounds.MAX_PY_SPY_MEMORY_BYTES``);
    a py-spy that does not finish is killed with its process group.  A pid whose
    turn comes more than ``2 * timeout_s`` after the first started is not dumped
    (``not_run``: many hung py-spy at once would otherwise hold the caller for
    ``timeout_s`` per round).  The StackDump's ``error`` says why a better mode
    failed, or, with ``source="none"``, why there is no stack and what to do about it.
    ``py_spy`` overrides ``find_py_spy()``.
    """
    unique = list(dict.fromkeys(int(p) for p in pids))
    if not unique:
        return {}
    exe = py_spy if py_spy is not None else find_py_spy()
    if not exe:
        reason = _missing_reason() if py_spy is None else f"py-spy disabled; {INSTALL_HINT}"
        return {pid: StackDump(pid=pid, source="none", error=reason) for pid in unique}
    if len(unique) == 1:
        return {unique[0]: dump_stack(unique[0], native=native, timeout_s=timeout_s, py_spy=exe)}
    width = max(1, min(len(unique), parallel if parallel is not None else parallel_limit()))
    deadline = time.monotonic() + 2 * timeout_s

    def one(pid: int) -> StackDump:
        if time.monotonic() > deadline:
            return StackDump(
                pid=pid,
                source="none",
                error=f"not dumped: the stack dumps' {2 * timeout_s:g} s were spent before its turn "
                f"({width} py-spy at a time on this machine)",
                not_run=True,
            )
        return dump_stack(pid, native=native, timeout_s=timeout_s, py_spy=exe)

    with ThreadPoolExecutor(max_workers=width, thread_name_prefix="dlwatch-py-spy") as pool:
        futures = {pid: pool.submit(one, pid) for pid in unique}
        return {pid: fut.result() for pid, fut in futures.items()}
