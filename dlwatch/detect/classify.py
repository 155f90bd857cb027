"""Why a DataLoader loop stalled: pure judgement over /proc samples and stacks.

This module owns the per-process verdict (``status``, ``waiting_in``,
``cpu_progress_s``, ``alive_by``, ``io_wait`` of report.json's ``processes[]``)
and the run's stall ``classification``: ``deadlock``, ``lost-batch``, ``slow``,
``main-blocked``, ``dead-worker`` or ``io-wait``.  No I/O: the monitor reads
/proc several times across a window, then the threads' syscalls and sockets
(IoSample) and the stacks, and passes them in.

Evidence, strongest first: the stack (which code a thread waits in), then the
syscall number of /proc/<pid>/syscall (which kind of wait), then the scheduler
state.  wchan names are not used: they differ between kernels.

Alive is judged over the whole window, not at one instant: a process that was
runnable (state R) in any read, whose run delay grew (it waited for a CPU: a
starved process), whose CPU time grew at all, that woke up (context switches:
a ``cond.wait(timeout=1)`` loop) or moved bytes is not deadlocked.  A deadlock
needs none of these and a lock wait.  A process waiting on a socket or a file
read that never returns (in its main thread, or in a pool thread its main
thread waits for through ``Future.result``/``Event.wait``) is ``io-wait``.
"""

from __future__ import annotations

import dataclasses
import os
import re
from dataclasses import dataclass
from typing import Iterable, Sequence

from dlwatch.collect import syscalls
from dlwatch.collect.syscalls import category as syscall_category
from dlwatch.model import Frame, IoSample, ProcSample, SocketPeer, StackDump, ThreadIo, ThreadStack, _ToDict

__all__ = [
    "CPU_PROGRESS_MIN_S",
    "CLASSIFICATIONS",
    "STATUSES",
    "IoWait",
    "ProcessObservation",
    "ProcessVerdict",
    "StallVerdict",
    "classify_stall",
    "collective_from_stack",
    "judge_process",
    "alive_signs",
    "io_wait",
    "syscall_category",
    "waiting_in_from_stack",
    "is_waiting_for_data",
    "main_thread",
]

# CPU seconds between the first and last read of the window at or above which a
# process is "running".  /proc's clock tick is 10 ms; five ticks separate real work
# from a process that only wakes now and then.  Below it a process is not running,
# but any CPU time at all is still a sign of life (see alive_signs): the window is
# read before py-spy attaches, so a stuck process gains none.
CPU_PROGRESS_MIN_S = 0.05

CLASSIFICATIONS = ("deadlock", "lost-batch", "slow", "main-blocked", "dead-worker", "io-wait")
STATUSES = ("running", "blocked", "idle", "gone")

# waiting_in values that mean "will come back by itself": a worker blocked in
# these is slow, not deadlocked.
_TRANSIENT_WAITS = ("sleep", "io")


# --------------------------------------------------------------------------- inputs and outputs


@dataclass(frozen=True)
class ProcessObservation:
    """What the monitor saw of one process: /proc reads across a window and maybe a stack.

    ``before`` and ``after`` open and close the window; ``reads`` are the reads
    in between (state R in any read is a runnable process).  ``io`` is read at
    the end of the window, before a stack dumper attached.
    """

    pid: int
    role: str  # "main", "worker" or "other"
    before: ProcSample | None
    after: ProcSample | None
    stack: StackDump | None = None
    worker_id: int | None = None
    reads: tuple[ProcSample, ...] = ()
    io: IoSample | None = None
    io_before: IoSample | None = None  # the same at the start of the window


@dataclass(frozen=True)
class IoWait(_ToDict):
    """A wait on remote or file I/O that did not return over the window."""

    # socket poll | socket recv | socket send | socket connect | file read | uninterruptible |
    # pipe open (a FIFO with no partner) | open (no fd yet: a hung mount) | pipe read | pipe write | file lock
    kind: str
    basis: str  # what showed it: "stack", "syscall", "state D"
    tid: int | None = None  # the thread that waits
    thread: str | None = None  # its name, from the stack
    via: str | None = None  # "thread pool": the main thread waits for this thread (Future.result, Event.wait)
    syscall: int | None = None
    peer: str | None = None  # "ip:port" of the socket waited on (or the process's only live TCP peer)
    tcp_state: str | None = None
    sockets: tuple[SocketPeer, ...] = ()  # the process's TCP sockets other than listeners
    file: str | None = None  # the file, FIFO or lock file waited on (the syscall's fd or path), else None
    where: str | None = None  # innermost frame of the program's own code in the waiting thread


@dataclass(frozen=True)
class ProcessVerdict(_ToDict):
    pid: int
    status: str  # running | blocked | idle | gone
    waiting_in: str | None  # lock acquire | queue get | poll | sleep | io | native: <fn> | ...
    cpu_progress_s: float | None  # CPU seconds over the window; None if unreadable
    role: str = "other"
    worker_id: int | None = None
    where: str | None = None  # innermost frame of the program's own code: "func (file:line)"
    in_dataloader: bool | None = None  # main only: inside the DataLoader's __next__
    alive_by: tuple[str, ...] = ()  # signs of life over the window: runnable run-delay cpu wakes io
    io_wait: IoWait | None = None


@dataclass(frozen=True)
class StallVerdict(_ToDict):
    classification: str  # one of CLASSIFICATIONS
    processes: tuple[ProcessVerdict, ...]
    reason: str  # one line for people


# --------------------------------------------------------------------------- stacks

# Python code that only implements a wait: the wait is attributed to the frame
# that called into it.  Paths are matched by suffix so that any install prefix works.
_PLUMBING_FILES = (
    "/threading.py",
    "/queue.py",
    "/selectors.py",
    "/socket.py",
    "/ssl.py",
    "/subprocess.py",
    "/multiprocessing/connection.py",
    "/multiprocessing/queues.py",
    "/multiprocessing/synchronize.py",
    "/multiprocessing/managers.py",
    "/multiprocessing/popen_fork.py",
    "/multiprocessing/pool.py",
    "/concurrent/futures/_base.py",
    "/concurrent/futures/thread.py",
    "/asyncio/base_events.py",
    "/asyncio/selector_events.py",
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
        p.endswith("/queue.py") or p.endswith("/multiprocessing/queues.py")
    )


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


_NATIVE_LOCK = (
    "pthread_mutex_lock",
    "__lll_lock_wait",
    "lll_lock_wait",
    "pthread_cond_wait",
    "pthread_cond_timedwait",
    "pthread_rwlock",
    "sem_wait",
    "sem_timedwait",
    "sem_clockwait",
    "PyThread_acquire_lock",
    "acquire_lock",
    "semlock_acquire",
    "futex_wait",
    "__futex_abstimed_wait",
    "PyCOND_WAIT",
)
_NATIVE_POLL = (
    "poll",
    "ppoll",
    "select",
    "pselect",
    "epoll_wait",
    "epoll_pwait",
    "select_poll_poll",
    "select_select",
    "select_epoll",
)
_NATIVE_SLEEP = ("nanosleep", "clock_nanosleep", "time_sleep", "pysleep", "usleep", "sleep")
_NATIVE_IO = (
    "read",
    "__libc_read",
    "pread64",
    "readv",
    "recv",
    "recvfrom",
    "recvmsg",
    "accept",
    "accept4",
    "sock_recv",
    "sock_accept",
    "_io__FileIO_read",
    "_bufferedreader_raw_read",
    "fsync",
    "write",
    "__libc_write",
    "open64",
    "openat",
)


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


# A rank waiting for the others: torch.distributed's collectives (Python frames), or the
# native frames of gloo, NCCL and c10d's process groups under them.
_DIST_DIR = "/torch/distributed/"
_COLLECTIVES = frozenset(
    (
        "all_reduce",
        "all_reduce_coalesced",
        "all_gather",
        "all_gather_into_tensor",
        "all_gather_object",
        "all_gather_coalesced",
        "all_to_all",
        "all_to_all_single",
        "barrier",
        "monitored_barrier",
        "broadcast",
        "broadcast_object_list",
        "reduce",
        "reduce_scatter",
        "reduce_scatter_tensor",
        "gather",
        "gather_object",
        "scatter",
        "scatter_object_list",
        "send",
        "recv",
        "isend",
        "irecv",
        "batch_isend_irecv",
        "wait",
        "_reduce_scatter_base",
        "_all_gather_base",
        "_coalescing_manager",
    )
)
# nccl<Op> / gloo::<op> / c10d::ProcessGroupGloo::Async<Op>Work -> torch's name of the op
_NATIVE_OPS = (
    re.compile(r"\bnccl(AllReduce|AllGather|ReduceScatter|Broadcast|Reduce|Send|Recv|GroupEnd|CommInitRank)\b"),
    re.compile(
        r"ProcessGroupGloo::Async(Allreduce|Allgather|Barrier|Broadcast|Reduce|ReduceScatter|"
        r"Gather|Scatter|Alltoall)"
    ),
    re.compile(
        r"\bgloo::(allreduce|allgather|allgatherv|barrier|broadcast|reduce|reduce_scatter|gather|"
        r"scatter|alltoall)\b"
    ),
)
_NATIVE_BACKEND = re.compile(r"\b(?:c10d::ProcessGroup(?:NCCL|Gloo)|gloo::|c10d::Work::wait|c10d::ProcessGroupNCCL)")
_OP_NAMES = {
    "allreduce": "all_reduce",
    "allgather": "all_gather",
    "allgatherv": "all_gather",
    "reducescatter": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "alltoall": "all_to_all",
    "groupend": "group",
    "comminitrank": "init_process_group",
}


def _native_collective(name: str) -> str | None:
    for rx in _NATIVE_OPS:
        m = rx.search(name)
        if m is not None:
            key = m.group(1).lower()
            return _OP_NAMES.get(key, key)
    if _NATIVE_BACKEND.search(name) is None:
        return None
    low = name.lower()
    return "gloo" if "gloo" in low else "nccl" if "nccl" in low else "c10d"


def collective_from_stack(thread: ThreadStack | None) -> str | None:
    """The collective a thread waits in (``all_reduce``, ``barrier``, ...); None if it waits in none.

    Only the innermost frames count, up to the first frame of the program's own code: a
    loop body that calls ``all_reduce`` and is now waiting for data is not in a collective.
    A Python frame of ``torch.distributed`` names the op best; native gloo/NCCL/c10d frames
    (py-spy ``--native``) name it when Python frames are missing.
    """
    if thread is None or not thread.frames:
        return None
    native: str | None = None
    for frame in thread.frames:
        if frame.native:
            if native is None and not _is_address(frame.function):
                native = _native_collective(frame.function)
            continue
        p = _path(frame)
        if _DIST_DIR in p:
            fn = _short_name(frame)
            if fn in _COLLECTIVES:
                return fn
            continue
        if _is_plumbing(frame) or "/torch/" in p:
            continue
        break
    return native


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
    collective = collective_from_stack(thread)
    if collective is not None:
        return f"collective: {collective}"
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
    return not frame.native and _path(frame).endswith(_DATALOADER_FILE) and _short_name(frame) in funcs


def is_waiting_for_data(thread: ThreadStack | None) -> bool | None:
    """Whether this (main) thread is inside the DataLoader's ``__next__``; None if no stack."""
    if thread is None or not thread.frames:
        return None
    return any(_is_loader_wait(f, _LOADER_WAIT_FUNCS) for f in thread.frames)


# dlwatch's own frames (the timed iterator around next(loader)) are never "where" a program waits
_DLWATCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))).replace("\\", "/") + "/"


def _is_own_code(frame: Frame) -> bool:
    return (
        not frame.native
        and not _is_plumbing(frame)
        and _TORCH_DATA not in _path(frame)
        and _DIST_DIR not in _path(frame)  # a collective's frames: the caller is where it waits
        and not (_path(frame).startswith(_DLWATCH_DIR) and not _path(frame).startswith(_DLWATCH_DIR + "_examples/"))
    )


def _where(thread: ThreadStack | None, *, skip: tuple[str, ...] = ()) -> str | None:
    """Innermost frame of the program's own code (a dataset, the loop body)."""
    if thread is None:
        return None
    for f in thread.frames:
        if _is_own_code(f) and not any(part in _path(f) for part in skip):
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


# --------------------------------------------------------------------------- alive over the window


def _window(obs: ProcessObservation) -> list[ProcSample]:
    return [r for r in (obs.before, *obs.reads, obs.after) if r is not None and not r.gone]


def _grew(reads: Sequence[ProcSample], *keys: str) -> bool:
    """Whether the sum of these counters rose between the first and last read that has them all."""

    def total(r: ProcSample) -> float | None:
        vals = [getattr(r, k) for k in keys]
        return None if any(v is None for v in vals) else float(sum(vals))

    have = [t for t in (total(r) for r in reads) if t is not None]
    return len(have) >= 2 and have[-1] > have[0]


def alive_signs(obs: ProcessObservation) -> tuple[str, ...]:
    """Signs of life over the window, in a fixed order.

    ``runnable``: state R in any read; ``run-delay``: it waited on a run queue (it
    wants a CPU it cannot get: a starved process, not a stuck one); ``cpu``: CPU
    time grew at all; ``wakes``: its main thread was switched in (a sleeper
    waking on a timeout); ``io``: bytes went through its read/recv/write/send.
    schedstat and context switches are the main thread's; CPU time and bytes
    are the whole process's.
    """
    reads = _window(obs)
    signs = []
    if any(r.state == "R" for r in reads):
        signs.append("runnable")
    if _grew(reads, "run_delay_ns"):
        signs.append("run-delay")
    if _grew(reads, "cpu_s") or _grew(reads, "run_ns"):
        signs.append("cpu")
    if _grew(reads, "num_ctx_switches_voluntary", "num_ctx_switches_involuntary") or _grew(reads, "run_count"):
        signs.append("wakes")
    if _grew(reads, "read_chars", "write_chars"):
        signs.append("io")
    return tuple(signs)


def _run_delay_s(obs: ProcessObservation) -> float:
    reads = [r for r in _window(obs) if r.run_delay_ns is not None]
    if len(reads) < 2:
        return 0.0
    return max(0, reads[-1].run_delay_ns - reads[0].run_delay_ns) / 1e9  # type: ignore[operator]


# --------------------------------------------------------------------------- io waits

# A thread in remote I/O: native frames of CPython's socket and ssl modules and
# OpenSSL, or Python frames of the stdlib's and common clients' network code.
_SOCKET_NATIVE = re.compile(
    r"^sock_|_sock_|^internal_(connect|select)|^SSL_(read|write|peek|do_handshake|connect)"
    r"|^_ssl__SSLSocket_|^ssl3_read|^BIO_read|^sock_call",
    re.IGNORECASE,
)
_NET_FILES = (
    "/socket.py",
    "/ssl.py",
    "/http/client.py",
    "/urllib/request.py",
    "/ftplib.py",
    "/urllib3/",
    "/requests/",
    "/botocore/",
    "/httpx/",
    "/httpcore/",
    "/aiohttp/",
    "/grpc/",
    "/s3fs/",
    "/gcsfs/",
    "/adlfs/",
    "/smart_open/",
    "/fsspec/implementations/http",
)
# The main thread waits for another thread's result: Future.result, Event.wait, Condition.wait
_HANDOFF_FILES = ("/concurrent/futures/_base.py", "/threading.py")
_HANDOFF_FUNCS = ("result", "wait", "wait_for", "exception", "as_completed", "_wait_for_tstate_lock", "join")
_POLL_NATIVE = ("poll", "ppoll", "select", "pselect", "epoll_wait", "epoll_pwait", "__poll")
_IDLE_TCP = ("LISTEN", "TIME_WAIT", "CLOSE")


def _thread_by_tid(dump: StackDump | None, tid: int) -> ThreadStack | None:
    if dump is None:
        return None
    return next((t for t in dump.threads if t.native_tid == tid), None)


def _socket_frames(thread: ThreadStack | None) -> bool:
    """Whether the thread waits inside socket/SSL/HTTP client code (innermost frames)."""
    if thread is None:
        return False
    for frame in thread.frames:
        if frame.native:
            if _SOCKET_NATIVE.search(frame.function.split("(", 1)[0].strip()):
                return True
            continue
        return any(part in _path(frame) for part in _NET_FILES)
    return False


def _native_socket_kind(thread: ThreadStack | None) -> str | None:
    """socket poll / recv / send / connect from the innermost native frames."""
    if thread is None:
        return None
    for frame in thread.frames:
        if not frame.native:
            break
        low = frame.function.split("(", 1)[0].strip().lower()
        if low in _POLL_NATIVE or low.endswith(("_poll", "_select")) or "internal_select" in low:
            return "socket poll"
        if "connect" in low:
            return "socket connect"
        if "recv" in low or "read" in low:
            return "socket recv"
        if "send" in low or "write" in low:
            return "socket send"
    return None


def _hands_off(thread: ThreadStack | None) -> bool:
    """Main thread in Future.result / Event.wait / Condition.wait / Thread.join."""
    if thread is None:
        return False
    for frame in thread.frames:
        if frame.native:
            continue
        if _path(frame).endswith(_HANDOFF_FILES) and _short_name(frame) in _HANDOFF_FUNCS:
            return True
        if not _is_plumbing(frame):
            return False
    return False


def _kind_from_syscall(nr: int | None, fd_target: str | None, machine: str | None) -> str | None:
    cat = syscall_category(nr, machine)
    if fd_target is not None and fd_target.startswith("socket:"):
        if syscalls.is_connect(nr, machine):
            return "socket connect"
        if syscalls.is_send(nr, machine):
            return "socket send"
        return "socket recv" if cat == "io" else None
    if cat == "poll":
        return "socket poll"
    if syscalls.is_connect(nr, machine):
        return "socket connect"
    return None


def _regular_file(target: str | None) -> bool:
    return target is not None and target.startswith("/") and not target.startswith(("/dev/", "/proc/", "/sys/"))


def _blocking_wait(t: ThreadIo, machine: str | None) -> tuple[str, str | None] | None:
    """(kind, path) of a thread blocked where no socket and no regular file read is: an open with no
    fd yet (a FIFO whose other end never comes, a hung mount), a read or write on a named pipe
    (its partner gone or never there, or the pipe full), a file lock another process holds.  An
    anonymous pipe is not here: torch's own queues read those (a producer that died is the
    deadlock's business, not I/O)."""
    nr = t.syscall
    if syscalls.is_open(nr, machine):
        # in state D an open is I/O in the kernel (a hung mount): "uninterruptible" as before, now with
        # its path; asleep in S it waits for something to come (a FIFO's other end)
        kind = "uninterruptible" if t.state == "D" else "pipe open" if t.fifo else "open"
        return kind, t.path
    if syscalls.is_lock_wait(nr, t.args, machine):
        return "file lock", t.fd_target if _regular_file(t.fd_target) else None
    if t.fifo and t.fd_target and not t.fd_target.startswith(("pipe:", "socket:")):
        if syscalls.is_file_read(nr, machine):
            return "pipe read", t.fd_target
        if syscalls.is_send(nr, machine):
            return "pipe write", t.fd_target
    return None


def io_wait(obs: ProcessObservation, *, machine: str | None = None) -> IoWait | None:
    """The I/O wait of a process with no CPU progress, or None if it is not waiting on I/O.

    Threads are judged main thread first, then the others only when the main
    thread hands off to them (``Future.result``/``Event.wait``): a background
    thread on a socket beside a main thread stuck on a fork-held lock is a
    deadlock, not an I/O wait.
    """
    io = obs.io
    dump = obs.stack
    reads = _window(obs)
    main_t = main_thread(dump, obs.pid)
    sockets = tuple(s for s in (io.sockets if io else ()) if s.tcp_state not in _IDLE_TCP)
    threads = list(io.threads) if io and not io.gone else []
    main_io = next((t for t in threads if t.tid == obs.pid), None)

    def peer_of(target: str | None) -> SocketPeer | None:
        if target and target.startswith("socket:[") and target.endswith("]"):
            inode = target[8:-1]
            found = next((s for s in sockets if str(s.inode) == inode), None)
            if found is not None:
                return found
        return sockets[0] if len(sockets) == 1 else None

    def build(
        kind: str, basis: str, tid: int | None, stack: ThreadStack | None, nr: int | None, target: str | None
    ) -> IoWait:
        peer = peer_of(target) if kind.startswith("socket") else None
        return IoWait(
            kind=kind,
            basis=basis,
            tid=tid,
            thread=stack.name if stack else None,
            syscall=nr,
            peer=peer.remote if peer else None,
            tcp_state=peer.tcp_state if peer else None,
            sockets=sockets if kind.startswith("socket") else (),
            file=target if _regular_file(target) else None,
            where=_where(stack, skip=_NET_FILES),
        )

    def socket_wait(tid: int, stack: ThreadStack | None, nr: int | None, target: str | None) -> IoWait | None:
        if stack is not None and _is_queue_get_wait(stack):
            return None  # torch's own queue waits are not remote I/O
        on_socket = target is not None and target.startswith("socket:")
        by_stack = _socket_frames(stack)
        if by_stack:
            kind = _native_socket_kind(stack) or _kind_from_syscall(nr, target, machine) or "socket recv"
            return build(kind, "stack", tid, stack, nr, target)
        if on_socket:
            kind = _kind_from_syscall(nr, target, machine)
            if kind is not None:
                return build(kind, "syscall", tid, stack, nr, target)
        return None

    # 1. the main thread itself: socket, file read, or uninterruptible sleep
    nr_main = main_io.syscall if main_io else (obs.after.syscall if obs.after else None)
    target_main = main_io.fd_target if main_io else None
    found = socket_wait(obs.pid, main_t, nr_main, target_main)
    if found is None and main_t is not None and sockets and not _is_queue_get_wait(main_t):
        # a socket with a timeout waits in poll: CPython's sock_recv polls first.  Without
        # native frames the innermost Python frame is the caller of recv(); a poll from the
        # program's own code (not torch's queue) in a process with a live TCP peer is that wait.
        if syscall_category(nr_main, machine) == "poll" and _own_innermost(main_t):
            found = build("socket poll", "syscall", obs.pid, main_t, nr_main, None)
    if found is not None:
        return found
    all_d = bool(reads) and all(r.state == "D" for r in reads)
    blocking = _blocking_wait(main_io, machine) if main_io is not None else None
    if blocking is not None:
        kind, path = blocking
        basis = "state D" if all_d or main_io.state == "D" else "syscall"  # type: ignore[union-attr]
        return dataclasses.replace(
            build(kind, basis, obs.pid, main_t, main_io.syscall, None),  # type: ignore[union-attr]
            file=path,
        )
    if main_io is not None and _regular_file(main_io.fd_target) and syscalls.is_file_read(main_io.syscall, machine):
        if all_d or main_io.state == "D" or (obs.after is not None and obs.after.state in ("S", "D")):
            return build(
                "file read",
                "state D" if all_d or main_io.state == "D" else "syscall",
                obs.pid,
                main_t,
                main_io.syscall,
                main_io.fd_target,
            )
    if all_d:
        return build("uninterruptible", "state D", obs.pid, main_t, nr_main, target_main)

    # 2. another thread, when the main thread waits for it
    if not _hands_off(main_t):
        return None
    for t in threads:
        if t.tid == obs.pid:
            continue
        stack = _thread_by_tid(dump, t.tid)
        found = socket_wait(t.tid, stack, t.syscall, t.fd_target)
        blocking = _blocking_wait(t, machine) if found is None else None
        if blocking is not None:
            found = dataclasses.replace(
                build(blocking[0], "state D" if t.state == "D" else "syscall", t.tid, stack, t.syscall, None),
                file=blocking[1],
            )
        if found is None and _regular_file(t.fd_target) and syscalls.is_file_read(t.syscall, machine):
            found = build("file read", "state D" if t.state == "D" else "syscall", t.tid, stack, t.syscall, t.fd_target)
        if found is None and t.state == "D":
            found = build("uninterruptible", "state D", t.tid, stack, t.syscall, t.fd_target)
        if found is not None:
            return dataclasses.replace(found, via="thread pool")
    if dump is not None:  # no IoSample thread list (unreadable): the stacks alone
        for st in dump.threads:
            if st is main_t or st.native_tid == obs.pid:
                continue
            if _socket_frames(st):
                kind = _native_socket_kind(st) or "socket recv"
                return dataclasses.replace(build(kind, "stack", st.native_tid, st, None, None), via="thread pool")
    return None


def _thread_woke(obs: ProcessObservation, tid: int | None) -> bool:
    """Whether the thread was switched in between the two IoSamples (unknown: no)."""
    if tid is None or obs.io is None or obs.io_before is None:
        return False
    start = next((t for t in obs.io_before.threads if t.tid == tid), None)
    end = next((t for t in obs.io.threads if t.tid == tid), None)
    if start is None or end is None or start.run_count is None or end.run_count is None:
        return False
    return end.run_count > start.run_count or (end.run_ns or 0) > (start.run_ns or 0)


def _is_queue_get_wait(thread: ThreadStack) -> bool:
    return waiting_in_from_stack(thread) == "queue get"


def _own_innermost(thread: ThreadStack) -> bool:
    """The innermost Python frame is the program's (or a client library's) code, not plumbing."""
    for f in thread.frames:
        if f.native:
            continue
        return not _is_plumbing(f) and _TORCH_DATA not in _path(f)
    return False


# --------------------------------------------------------------------------- per process


def _cpu_progress(before: ProcSample | None, after: ProcSample | None) -> float | None:
    if before is None or after is None or before.gone or after.gone:
        return None
    if before.cpu_s is None or after.cpu_s is None:
        return None
    return max(0.0, round(after.cpu_s - before.cpu_s, 6))


def judge_process(obs: ProcessObservation, *, machine: str | None = None) -> ProcessVerdict:
    """status / waiting_in / cpu_progress_s / alive_by / io_wait of one process."""
    after = obs.after
    thread = main_thread(obs.stack, obs.pid)
    progress = _cpu_progress(obs.before, after)
    in_loader = is_waiting_for_data(thread) if obs.role == "main" else None
    alive = alive_signs(obs)

    def verdict(status: str, waiting_in: str | None, io: IoWait | None = None) -> ProcessVerdict:
        return ProcessVerdict(
            pid=obs.pid,
            status=status,
            waiting_in=waiting_in,
            cpu_progress_s=progress,
            role=obs.role,
            worker_id=obs.worker_id,
            where=_where(thread),
            in_dataloader=in_loader,
            alive_by=alive if status != "gone" else (),
            io_wait=io,
        )

    if after is None or after.gone or after.state in ("Z", "X", "x"):
        return verdict("gone", None)

    stack_kind = waiting_in_from_stack(thread)
    sys_kind = syscall_category(after.syscall, machine)
    if progress is not None and progress >= CPU_PROGRESS_MIN_S:
        return verdict("running", None)
    if after.state in ("T", "t"):
        return verdict("blocked", "stopped")
    if "io" not in alive:  # bytes moving: a slow transfer, judged below as alive
        io = io_wait(obs, machine=machine)
        if io is not None and _thread_woke(obs, io.tid):
            # the thread in the socket wait woke in the window: data arrives (a slow
            # transfer) or a short timeout fires and the client retries; alive, not stuck
            alive = (*alive, "io")
            return verdict("running", "io")
        if io is not None:
            return verdict("blocked", "io", io)
    if "runnable" in alive or _run_delay_s(obs) >= CPU_PROGRESS_MIN_S:
        # it wants a CPU: starved (many workers on few cores), not stuck.  A sleeper that
        # wakes waits a few microseconds on the run queue too: that is a wake, not starving
        return verdict("running", None)
    if after.state == "D":
        # uninterruptible sleep is I/O (disk, NFS, page faults); it accrues no CPU
        return verdict("running", "io")
    if after.state == "R" and progress is None:
        return verdict("running", None)

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
    if v.io_wait is not None:
        w = v.io_wait
        bits.append(f"in {w.kind}")
        if w.via:
            bits.append(f"(thread {w.thread or w.tid}, via {w.via})")
        if w.peer:
            bits.append(f"on {w.peer}")
        elif w.file:
            bits.append(f"on {w.file}")
    elif v.waiting_in:
        bits.append(f"in {v.waiting_in}")
    if v.where:
        bits.append(f"at {v.where}")
    if v.cpu_progress_s is not None:
        bits.append(f"{v.cpu_progress_s:.2f} s CPU")
    if v.alive_by and v.status != "gone":
        bits.append(f"alive: {', '.join(v.alive_by)}")
    return " ".join(bits)


def _wakes(v: ProcessVerdict) -> bool:
    """A blocked process that woke, ran or moved bytes in the window polls; it is not deadlocked."""
    return bool(set(v.alive_by) & {"cpu", "wakes", "io", "runnable", "run-delay"})


def _io_what(v: ProcessVerdict) -> str:
    w = v.io_wait
    if w is None:
        return "I/O"
    if w.kind.startswith("socket"):
        return "a socket" + (f" ({w.peer})" if w.peer else "")
    what = {
        "pipe open": "an open of a named pipe whose other end never came",
        "open": "an open that never returned",
        "pipe read": "a named pipe read",
        "pipe write": "a named pipe write (the pipe is full)",
        "file lock": "a file lock held elsewhere",
    }.get(w.kind, "a file read")
    return what + (f" ({w.file})" if w.file else "")


def _summary(verdicts: Iterable[ProcessVerdict]) -> str:
    vs = list(verdicts)
    if not vs:
        return ""
    first = vs[0]
    extra = f" (+{len(vs) - 1} more)" if len(vs) > 1 else ""
    return _describe(first) + extra


def classify_stall(
    observations: Iterable[ProcessObservation],
    *,
    main_waiting_for_data: bool | None = None,
    expected_workers: int | None = None,
    machine: str | None = None,
) -> StallVerdict:
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
    with the main waiting for data, the workers: any making progress (or runnable,
    or starved of CPU) -> slow; any blocked in a lock with no sign of life over the
    window -> deadlock; any waiting on a socket or a file read that never
    returned -> io-wait; blocked but waking or in a transient wait -> slow; all
    idle -> the batch the main waits for was lost.
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
        return out(
            "dead-worker",
            f"{len(gone)} of {len(workers)} DataLoader workers gone: " + ", ".join(_describe(w) for w in gone),
        )
    if expected_workers is not None and len(live) < expected_workers:
        return out(
            "dead-worker",
            f"only {len(live)} live DataLoader workers of {expected_workers} "
            "expected: the others exited or were killed",
        )

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

    if (
        waiting is False
        and main is not None
        and (main.waiting_in or "").startswith("collective: ")
        and not any(w.status == "blocked" and w.io_wait is None and not _wakes(w) for w in live)
    ):
        op = main.waiting_in[len("collective: ") :]  # type: ignore[index]
        loader = (
            f"its own DataLoader is healthy (workers: {', '.join(sorted({w.status for w in live}))})"
            if live
            else "it has no DataLoader workers"
        )
        return out(
            "main-blocked",
            f"the main process waits in the collective {op} for other ranks; "
            f"{loader}: the rank that stalled first is elsewhere "
            f"(see `dlwatch report --job`): {_describe(main)}",
        )

    if waiting is False:
        state = _describe(main) if main else "the main process"
        busy = " busy" if main is not None and main.status == "running" else ""
        workers_note = f"; workers: {', '.join(sorted({w.status for w in live}))}" if live else "; no workers"
        return out(
            "main-blocked",
            f"the main process is{busy} outside the DataLoader (in the loop body): {state}{workers_note}",
        )

    running = [w for w in live if w.status == "running"]
    io_waits = [w for w in live if w.io_wait is not None]
    blocked = [w for w in live if w.status == "blocked" and w.io_wait is None]
    hard = [w for w in blocked if w.waiting_in not in _TRANSIENT_WAITS and not _wakes(w)]
    waits = "waits for data" if waiting else "state unknown"
    if waiting and how != "heartbeat":
        waits += f" (from its {how})"

    if not live:  # num_workers=0: the main process loads the data itself
        if main is None:
            return out("slow", "no processes observed: nothing to judge")
        if main.io_wait is not None:
            return out(
                "io-wait",
                "no workers; the main process loads data itself and waits on "
                f"{_io_what(main)} that never returned: {_describe(main)}",
            )
        if main.status == "running":
            return out("slow", f"no workers; the main process is loading data itself: {_describe(main)}")
        if main.status == "idle" and waiting:
            return out(
                "dead-worker",
                f"the main process waits for data from workers but no live worker was observed: {_describe(main)}",
            )
        if main.waiting_in in _TRANSIENT_WAITS or (main.status == "blocked" and _wakes(main)):
            return out(
                "slow", f"no workers; the main process waits in {main.waiting_in} while loading data: {_describe(main)}"
            )
        if waiting:
            return out(
                "deadlock",
                "no workers; the main process is blocked inside the "
                f"DataLoader with no CPU progress: {_describe(main)}",
            )
        return out("main-blocked", f"no workers; the main process is blocked: {_describe(main)}")

    if running:
        return out(
            "slow",
            f"{len(running)} of {len(live)} workers still working (CPU or I/O): {_summary(running)}; main {waits}",
        )
    if hard:
        note = f"; main {waits}" if waiting else "; main state unknown"
        return out(
            "deadlock",
            f"{len(hard)} of {len(live)} workers blocked with no CPU progress "
            f"and no sign of life: {_summary(hard)}{note}",
        )
    if io_waits:
        return out(
            "io-wait",
            f"{len(io_waits)} of {len(live)} workers wait on {_io_what(io_waits[0])} "
            f"that never returned: {_summary(io_waits)}; main {waits}",
        )
    if blocked:
        # say what each is: waking (a sign of life over the window) or in a wait that ends by itself
        # (sleep, I/O in the kernel) with no sign of life yet; never "alive" without the evidence
        woke = [w for w in blocked if _wakes(w)]
        if len(woke) == len(blocked):
            what = "waiting but alive (waking up in the window)"
        elif not woke:
            kinds = ", ".join(sorted({w.waiting_in or "?" for w in blocked}))
            what = f"in a wait that ends by itself ({kinds}), no sign of life yet"
        else:
            what = f"waiting ({len(woke)} woke in the window, the others in a wait that ends by itself)"
        return out("slow", f"{len(blocked)} of {len(live)} workers {what}: {_summary(blocked)}; main {waits}")
    if waiting:
        return out(
            "lost-batch",
            f"all {len(live)} workers idle in their loop waiting for work "
            f"while the main process {waits}: the batch it waits for was "
            "never produced or was lost",
        )
    return out(
        "main-blocked",
        f"all {len(live)} workers idle and the main process is not "
        "seen waiting for data (no main stack): likely stuck in the loop body",
    )
