"""Why a DataLoader loop stalled: pure judgement over /proc samples and stacks.

This module owns the per-process verdict (``status``, ``waiting_in``,
``cpu_progress_s`` of report.json's ``processes[]``) and the run's stall
``classification``: ``deadlock``, ``lost-batch``, ``slow``, ``main-blocked`` or
``dead-worker``.  No I/O: the monitor takes two ProcSamples per process an
interval apart and the stacks, and passes them in.

Evidence, strongest first: the stack (which code a thread waits in), then the
syscall number of /proc/<pid>/syscall (which kind of wait), then the scheduler
state.  wchan names are not used: they differ between kernels.
"""

from __future__ import annotations

import os

import platform
from dataclasses import dataclass
from typing import Iterable, Sequence

from dlwatch.model import Frame, ProcSample, StackDump, ThreadStack, _ToDict

__all__ = [
    "CPU_PROGRESS_MIN_S",
    "CLASSIFICATIONS",
    "STATUSES",
    "ProcessObservation",
    "ProcessVerdict",
    "StallVerdict",
    "classify_stall",
    "judge_process",
    "syscall_category",
    "waiting_in_from_stack",
    "is_waiting_for_data",
    "main_thread",
]

# CPU seconds between the two reads below which a process counts as making no
# progress.  /proc's clock tick is 10 ms, and a hung process still wakes now and
# then (torch's worker and main loops poll with a 5 s timeout, py-spy's attach
# costs a tick or two), so a few ticks are noise.  Five ticks separate that
# noise from real work for the >= 0.5 s intervals the monitor samples a stall
# over (a busy worker burns ~interval seconds).
CPU_PROGRESS_MIN_S = 0.05

CLASSIFICATIONS = ("deadlock", "lost-batch", "slow", "main-blocked", "dead-worker")
STATUSES = ("running", "blocked", "idle", "gone")

# waiting_in values that mean "will come back by itself": a worker blocked in
# these is slow, not deadlocked.
_TRANSIENT_WAITS = ("sleep", "io")


# --------------------------------------------------------------------------- inputs and outputs


@dataclass(frozen=True)
class ProcessObservation:
    """What the monitor saw of one process: two /proc reads and maybe a stack."""

    pid: int
    role: str  # "main", "worker" or "other"
    before: ProcSample | None
    after: ProcSample | None
    stack: StackDump | None = None
    worker_id: int | None = None


@dataclass(frozen=True)
class ProcessVerdict(_ToDict):
    pid: int
    status: str  # running | blocked | idle | gone
    waiting_in: str | None  # lock acquire | queue get | poll | sleep | io | native: <fn> | ...
    cpu_progress_s: float | None  # CPU seconds between the two reads; None if unreadable
    role: str = "other"
    worker_id: int | None = None
    where: str | None = None  # innermost frame of the program's own code: "func (file:line)"
    in_dataloader: bool | None = None  # main only: inside the DataLoader's __next__


@dataclass(frozen=True)
class StallVerdict(_ToDict):
    classification: str  # one of CLASSIFICATIONS
    processes: tuple[ProcessVerdict, ...]
    reason: str  # one line for people


# --------------------------------------------------------------------------- syscalls

# Kinds of wait by syscall number.  restart_syscall is deliberately absent: it
# is what a sleeping poll/nanosleep reads as after a ptrace attach (py-spy)
# interrupted it, so it says nothing about the kind of wait.
_SYSCALLS: dict[str, dict[int, str]] = {
    "x86_64": {
        202: "lock acquire",  # futex
        449: "lock acquire",  # futex_waitv
        220: "lock acquire",  # semtimedop
        7: "poll", 23: "poll", 270: "poll", 271: "poll",  # poll select pselect6 ppoll
        232: "poll", 281: "poll", 441: "poll",  # epoll_wait epoll_pwait epoll_pwait2
        35: "sleep", 230: "sleep", 34: "sleep",  # nanosleep clock_nanosleep pause
        0: "io", 1: "io", 17: "io", 18: "io", 19: "io", 20: "io",  # read write pread pwrite readv writev
        295: "io", 296: "io", 45: "io", 44: "io", 47: "io", 46: "io",  # preadv pwritev recvfrom sendto recvmsg sendmsg
        43: "io", 288: "io", 42: "io",  # accept accept4 connect
        2: "io", 257: "io", 437: "io", 74: "io", 75: "io",  # open openat openat2 fsync fdatasync
        208: "io", 426: "io", 40: "io",  # io_getevents io_uring_enter sendfile
        61: "child wait", 247: "child wait",  # wait4 waitid
        70: "queue get",  # msgrcv
    },
    "aarch64": {
        98: "lock acquire",  # futex
        449: "lock acquire",  # futex_waitv
        192: "lock acquire",  # semtimedop
        72: "poll", 73: "poll",  # pselect6 ppoll (no poll/select on aarch64)
        22: "poll", 441: "poll",  # epoll_pwait epoll_pwait2
        101: "sleep", 115: "sleep",  # nanosleep clock_nanosleep
        63: "io", 64: "io", 67: "io", 68: "io", 65: "io", 66: "io",  # read write pread pwrite readv writev
        69: "io", 70: "io", 207: "io", 206: "io", 212: "io", 211: "io",  # preadv pwritev recvfrom sendto recvmsg sendmsg
        202: "io", 242: "io", 203: "io",  # accept accept4 connect
        56: "io", 437: "io", 82: "io", 83: "io",  # openat openat2 fsync fdatasync
        4: "io", 426: "io", 71: "io",  # io_getevents io_uring_enter sendfile
        260: "child wait", 95: "child wait",  # wait4 waitid
        188: "queue get",  # msgrcv
    },
}
_ARCH_ALIASES = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv8": "aarch64"}


def _arch(machine: str | None) -> str:
    m = (machine or platform.machine() or "").lower()
    return _ARCH_ALIASES.get(m, m)


def syscall_category(nr: int | None, machine: str | None = None) -> str | None:
    """The kind of wait a /proc/<pid>/syscall number means on this (or the given) arch.

    None for -1 (running in user space), unknown numbers and unknown arches.
    """
    if nr is None or nr < 0:
        return None
    return _SYSCALLS.get(_arch(machine), {}).get(nr)


# --------------------------------------------------------------------------- stacks

# Python code that only implements a wait: the wait is attributed to the frame
# that called into it.  Paths are matched by suffix so that any install prefix works.
_PLUMBING_FILES = (
    "/threading.py", "/queue.py", "/selectors.py", "/socket.py", "/ssl.py",
    "/subprocess.py", "/multiprocessing/connection.py", "/multiprocessing/queues.py",
    "/multiprocessing/synchronize.py", "/multiprocessing/managers.py",
    "/multiprocessing/popen_fork.py", "/multiprocessing/pool.py",
    "/concurrent/futures/_base.py", "/concurrent/futures/thread.py",
    "/asyncio/base_events.py", "/asyncio/selector_events.py",
)
_TORCH_DATA = "/torch/utils/data/"
_DATALOADER_FILE = "/torch/utils/data/dataloader.py"
_LOADER_WAIT_FUNCS = ("_next_data", "_get_data", "_try_get_data", "__next__")
_LOADER_POLL_FUNCS = ("_get_data", "_try_get_data")


def _path(frame: Frame) -> str:
    return (frame.filename or "").replace("\\", "/")


def _short_name(frame: Frame) -> str:
    return frame.function.rsplit(".", 1)[-1]


def _is_plumbing(frame: Frame) -> bool:
    return _path(frame).endswith(_PLUMBING_FILES)


def _is_queue_get(frame: Frame) -> bool:
    p = _path(frame)
    return _short_name(frame) in ("get", "get_nowait") and (
        p.endswith("/queue.py") or p.endswith("/multiprocessing/queues.py"))


def _python_wait_kind(frame: Frame) -> str | None:
    p, fn = _path(frame), _short_name(frame)
    if p.endswith(("/selectors.py", "/multiprocessing/connection.py")):
        if fn in ("select", "wait", "poll", "_poll"):
            return "poll"
        if fn.startswith(("recv", "_recv", "accept", "send", "_send")):
            return "io"
    if p.endswith(("/threading.py", "/multiprocessing/synchronize.py", "/concurrent/futures/_base.py")):
        if fn in ("wait", "acquire", "__enter__", "join", "result", "wait_for", "_wait_for_tstate_lock"):
            return "lock acquire"
    if p.endswith(("/socket.py", "/ssl.py")):
        return "io"
    if p.endswith("/subprocess.py") and fn in ("wait", "_wait", "_try_wait", "communicate"):
        return "child wait"
    return None


_NATIVE_LOCK = ("pthread_mutex_lock", "__lll_lock_wait", "lll_lock_wait", "pthread_cond_wait",
                "pthread_cond_timedwait", "pthread_rwlock", "sem_wait", "sem_timedwait",
                "sem_clockwait", "PyThread_acquire_lock", "acquire_lock", "semlock_acquire",
                "futex_wait", "__futex_abstimed_wait", "PyCOND_WAIT")
_NATIVE_POLL = ("poll", "ppoll", "select", "pselect", "epoll_wait", "epoll_pwait",
                "select_poll_poll", "select_select", "select_epoll")
_NATIVE_SLEEP = ("nanosleep", "clock_nanosleep", "time_sleep", "pysleep", "usleep", "sleep")
_NATIVE_IO = ("read", "__libc_read", "pread64", "readv", "recv", "recvfrom", "recvmsg",
              "accept", "accept4", "sock_recv", "sock_accept", "_io__FileIO_read",
              "_bufferedreader_raw_read", "fsync", "write", "__libc_write", "open64", "openat")


def _is_address(name: str) -> bool:
    return name.startswith("0x") or not name or name.startswith("<")


def _native_wait_kind(name: str) -> str | None:
    base = name.split("(", 1)[0].strip()
    low = base.lower()
    if any(k.lower() in low for k in _NATIVE_LOCK):
        return "lock acquire"
    if any(low == k or low.startswith(k + "_") or low.endswith("_" + k) for k in _NATIVE_POLL):
        return "poll"
    if any(low == k or low.endswith("_" + k) or low.startswith(k + "_") for k in _NATIVE_SLEEP):
        return "sleep"
    if any(low == k.lower() or low.startswith(k.lower() + "_") for k in _NATIVE_IO):
        return "io"
    return None


def waiting_in_from_stack(thread: ThreadStack | None) -> str | None:
    """What a thread waits in, from its innermost meaningful frames; None if not telling.

    Frames are walked innermost first through native frames and Python
    "plumbing" (threading, selectors, multiprocessing) up to the first frame of
    the program's own code or torch; a ``Queue.get`` in that run wins (the wait
    the reader cares about is "queue get", not the poll inside it), then the
    first Python plumbing kind, then the first native kind, then the innermost
    named native function.  A stack whose innermost frame is the program's own
    code with no native frames says nothing: the caller falls back to the syscall.
    """
    if thread is None or not thread.frames:
        return None
    python_kind: str | None = None
    native_kind: str | None = None
    native_name: str | None = None
    for frame in thread.frames:
        if frame.native:
            if native_kind is None:
                native_kind = _native_wait_kind(frame.function)
            if native_name is None and not _is_address(frame.function):
                native_name = frame.function
            continue
        if _is_queue_get(frame):
            return "queue get"
        if _is_plumbing(frame):
            if python_kind is None:
                python_kind = _python_wait_kind(frame)
            continue
        break
    if python_kind:
        return python_kind
    if native_kind:
        return native_kind
    if native_name:
        return f"native: {native_name}"
    return None


def main_thread(dump: StackDump | None, pid: int) -> ThreadStack | None:
    """The thread whose OS id is the pid (the one /proc/<pid>/syscall describes)."""
    if dump is None or not dump.threads:
        return None
    for t in dump.threads:
        if t.native_tid == pid:
            return t
    for t in dump.threads:
        if t.name == "MainThread":
            return t
    # faulthandler gives no names or tids.  It prints the interpreter's thread
    # list, newest first, so the main thread (the oldest) comes last.  Its
    # "Current thread" is whichever thread the kernel delivered the signal to,
    # usually but not always the main thread, so that label is not used.
    return dump.threads[-1] if dump.source == "faulthandler" else dump.threads[0]


def _is_loader_wait(frame: Frame, funcs: Sequence[str]) -> bool:
    return (not frame.native and _path(frame).endswith(_DATALOADER_FILE)
            and _short_name(frame) in funcs)


def is_waiting_for_data(thread: ThreadStack | None) -> bool | None:
    """Whether this (main) thread is inside the DataLoader's ``__next__``; None if no stack."""
    if thread is None or not thread.frames:
        return None
    return any(_is_loader_wait(f, _LOADER_WAIT_FUNCS) for f in thread.frames)


# dlwatch's own frames (the timed iterator around next(loader)) are never "where" a program waits
_DLWATCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/"


def _is_own_code(frame: Frame) -> bool:
    return (not frame.native and not _is_plumbing(frame) and _TORCH_DATA not in _path(frame)
            and not (_path(frame).startswith(_DLWATCH_DIR)
                     and not _path(frame).startswith(_DLWATCH_DIR + "_examples/")))


def _where(thread: ThreadStack | None) -> str | None:
    """Innermost frame of the program's own code (a dataset, the loop body)."""
    if thread is None:
        return None
    for f in thread.frames:
        if _is_own_code(f):
            file = (f.filename or "?").replace("\\", "/").rsplit("/", 1)[-1]
            return f"{f.function} ({file}:{f.line})" if f.line is not None else f"{f.function} ({file})"
    return None


def _idle_in(thread: ThreadStack | None, role: str) -> bool | None:
    """Asleep in torch's own wait for work (worker) or for data (main)?  None if no stack.

    Idle means every Python frame inside the torch frame is plumbing with a
    Queue.get among them: a worker in ``_worker_loop`` -> ``index_queue.get``, the
    main in ``_try_get_data`` -> ``data_queue.get``.  A dataset frame in between
    (``__getitem__`` under ``_next_data`` with num_workers=0) is not idle.
    """
    if thread is None or not thread.frames:
        return None
    saw_get = False
    for f in thread.frames:
        if f.native:
            continue
        if _is_queue_get(f):
            saw_get = True
            continue
        if _is_plumbing(f):
            continue
        if role == "worker":
            return saw_get and _short_name(f) == "_worker_loop"
        if role == "main":
            return saw_get and _is_loader_wait(f, _LOADER_POLL_FUNCS)
        return False
    return False


# --------------------------------------------------------------------------- per process


def _cpu_progress(before: ProcSample | None, after: ProcSample | None) -> float | None:
    if before is None or after is None or before.gone or after.gone:
        return None
    if before.cpu_s is None or after.cpu_s is None:
        return None
    return max(0.0, round(after.cpu_s - before.cpu_s, 6))


def judge_process(obs: ProcessObservation, *, machine: str | None = None) -> ProcessVerdict:
    """status / waiting_in / cpu_progress_s of one process."""
    after = obs.after
    thread = main_thread(obs.stack, obs.pid)
    progress = _cpu_progress(obs.before, after)
    in_loader = is_waiting_for_data(thread) if obs.role == "main" else None

    def verdict(status: str, waiting_in: str | None) -> ProcessVerdict:
        return ProcessVerdict(pid=obs.pid, status=status, waiting_in=waiting_in,
                              cpu_progress_s=progress, role=obs.role, worker_id=obs.worker_id,
                              where=_where(thread), in_dataloader=in_loader)

    if after is None or after.gone or after.state in ("Z", "X", "x"):
        return verdict("gone", None)

    stack_kind = waiting_in_from_stack(thread)
    sys_kind = syscall_category(after.syscall, machine)
    if progress is not None and progress >= CPU_PROGRESS_MIN_S:
        return verdict("running", None)
    if after.state == "D":
        # uninterruptible sleep is I/O (disk, NFS, page faults); it accrues no CPU
        return verdict("running", "io")
    if after.state == "R" and progress is None:
        return verdict("running", None)
    if after.state in ("T", "t"):
        return verdict("blocked", "stopped")

    waiting_in = stack_kind or sys_kind
    idle = _idle_in(thread, obs.role)
    if idle is None:
        # No stack: torch's waits for work/data are polls with a timeout (syscall
        # poll/ppoll); a dataset stuck on a lock sits in futex.
        idle = obs.role in ("worker", "main") and sys_kind == "poll"
    return verdict("idle" if idle else "blocked", waiting_in)


# --------------------------------------------------------------------------- the whole run


def _describe(v: ProcessVerdict) -> str:
    who = f"worker {v.worker_id}" if v.role == "worker" and v.worker_id is not None else v.role
    bits = [f"{who} (pid {v.pid}) {v.status}"]
    if v.waiting_in:
        bits.append(f"in {v.waiting_in}")
    if v.where:
        bits.append(f"at {v.where}")
    if v.cpu_progress_s is not None:
        bits.append(f"{v.cpu_progress_s:.2f} s CPU")
    return " ".join(bits)


def _summary(verdicts: Iterable[ProcessVerdict]) -> str:
    vs = list(verdicts)
    if not vs:
        return ""
    first = vs[0]
    extra = f" (+{len(vs) - 1} more)" if len(vs) > 1 else ""
    return _describe(first) + extra


def classify_stall(observations: Iterable[ProcessObservation], *,
                   main_waiting_for_data: bool | None = None,
                   expected_workers: int | None = None,
                   machine: str | None = None) -> StallVerdict:
    """Judge a stalled run: one classification, a verdict per process, one reason line.

    ``main_waiting_for_data``: whether the main process is inside the
    DataLoader's ``__next__`` (from the heartbeat); None = unknown, then it is
    read from the main stack (``_next_data``/``_get_data``/``_try_get_data``/
    ``__next__`` in torch/utils/data/dataloader.py) or, without one, from the main
    syscall (torch waits for data in poll).  ``expected_workers``: how many
    workers the loader should have; fewer live ones is a dead worker.
    ``machine`` overrides ``platform.machine()`` for syscall numbers.

    Order of judgement: a dead worker explains everything after it; then a main
    process outside the loader (the loop body, not the data, is stuck); then,
    with the main waiting for data, the workers: any making progress -> slow;
    any blocked in a lock -> deadlock; all idle -> the batch the main waits for
    was lost.
    """
    obs = list(observations)
    verdicts = tuple(judge_process(o, machine=machine) for o in obs)
    mains = [v for v in verdicts if v.role == "main"]
    workers = [v for v in verdicts if v.role == "worker"]
    main = mains[0] if mains else None

    def out(classification: str, reason: str) -> StallVerdict:
        return StallVerdict(classification=classification, processes=verdicts, reason=reason)

    gone = [w for w in workers if w.status == "gone"]
    live = [w for w in workers if w.status != "gone"]
    if gone:
        return out("dead-worker", f"{len(gone)} of {len(workers)} DataLoader workers gone: "
                                  + ", ".join(_describe(w) for w in gone))
    if expected_workers is not None and len(live) < expected_workers:
        return out("dead-worker", f"only {len(live)} live DataLoader workers of {expected_workers} "
                                  "expected: the others exited or were killed")

    if main is not None and main.status == "gone":
        return out("main-blocked", f"the main process (pid {main.pid}) is gone")

    waiting = main_waiting_for_data
    how = "heartbeat"
    if waiting is None and main is not None:
        waiting, how = main.in_dataloader, "stack"
        if waiting is None:
            after = next((o.after for o in obs if o.pid == main.pid), None)
            if syscall_category(after.syscall if after else None, machine) == "poll":
                waiting, how = True, "syscall"

    if waiting is False:
        state = _describe(main) if main else "the main process"
        busy = " busy" if main is not None and main.status == "running" else ""
        workers_note = (f"; workers: {', '.join(sorted({w.status for w in live}))}" if live
                        else "; no workers")
        return out("main-blocked", f"the main process is{busy} outside the DataLoader "
                                   f"(in the loop body): {state}{workers_note}")

    running = [w for w in live if w.status == "running"]
    blocked = [w for w in live if w.status == "blocked"]
    hard = [w for w in blocked if w.waiting_in not in _TRANSIENT_WAITS]
    waits = "waits for data" if waiting else "state unknown"
    if waiting and how != "heartbeat":
        waits += f" (from its {how})"

    if not live:  # num_workers=0: the main process loads the data itself
        if main is None:
            return out("slow", "no processes observed: nothing to judge")
        if main.status == "running":
            return out("slow", f"no workers; the main process is loading data itself: {_describe(main)}")
        if main.status == "idle" and waiting:
            return out("dead-worker", "the main process waits for data from workers but no "
                                      f"live worker was observed: {_describe(main)}")
        if main.waiting_in in _TRANSIENT_WAITS:
            return out("slow", f"no workers; the main process waits in {main.waiting_in} "
                               f"while loading data: {_describe(main)}")
        if waiting:
            return out("deadlock", "no workers; the main process is blocked inside the "
                                   f"DataLoader with no CPU progress: {_describe(main)}")
        return out("main-blocked", f"no workers; the main process is blocked: {_describe(main)}")

    if running or (blocked and not hard):
        busy = running or blocked
        return out("slow", f"{len(busy)} of {len(live)} workers still working "
                           f"(CPU or I/O): {_summary(busy)}; main {waits}")
    if hard:
        note = f"; main {waits}" if waiting else "; main state unknown"
        return out("deadlock", f"{len(hard)} of {len(live)} workers blocked with no CPU progress: "
                               f"{_summary(hard)}{note}")
    if waiting:
        return out("lost-batch", f"all {len(live)} workers idle in their loop waiting for work "
                                 f"while the main process {waits}: the batch it waits for was "
                                 "never produced or was lost")
    return out("main-blocked", f"all {len(live)} workers idle and the main process is not "
                               "seen waiting for data (no main stack): likely stuck in the loop body")
