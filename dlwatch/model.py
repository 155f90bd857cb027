"""The data model shared by every layer: frozen dataclasses in raw units.

collect/ produces these, detect/ judges them, report/ serialises them.  Nothing
here reads the system or formats for people.  Each class has ``to_dict`` for the
report's JSON form (see docs/report-schema.md); field names there are the same
as here, so that a reader of report.json finds the code by grepping a key.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping


_SCALARS = (int, float, str, bool, type(None))


def _plain(obj: Any) -> Any:
    if type(obj) in _SCALARS:  # most fields: skip the slow checks (isinstance on typing ABCs)
        return obj
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _plain(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_plain(x) for x in obj]
    if isinstance(obj, Mapping):
        return {str(k): _plain(v) for k, v in obj.items()}
    return obj


def plain(obj: Any) -> Any:
    """The JSON form ``to_dict`` gives a value of the model (a field, a nested sample)."""
    return _plain(obj)


class _ToDict:
    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = _plain(self)  # a dataclass instance: always a dict
        return out


# --------------------------------------------------------------------------- collect


@dataclass(frozen=True)
class FdSummary(_ToDict):
    """What a process's open fds point to (one readlink per fd, so read slowly)."""

    file: int = 0  # regular files (not under /dev/shm)
    shm: int = 0  # /dev/shm objects, including torch's unlinked "(deleted)" segments
    socket: int = 0
    pipe: int = 0
    other: int = 0  # anon_inode, devices, ...
    shm_bytes: int = 0  # bytes of the /dev/shm objects held by fd
    top_files: tuple[tuple[str, int], ...] = ()  # most frequent regular-file paths, (path, count)


@dataclass
class TrackedProcess:
    """A process of the watched job as dlwatch found it: which process it is, not what it does.

    The one model of a tracked process: the monitor's table (``monitor.Tracked`` adds its
    per-poll state), ``dlwatch attach``/``top``'s discovery and the stall procedure
    (``forensics.investigate``) share it.  Not frozen: a process is found first and learnt
    about later (its dump file from a registration, ``gone`` when it exits).
    """

    pid: int
    role: str  # main, worker, other
    worker_id: int | None = None
    start_method: str | None = None
    dump_path: str | None = None  # faulthandler file, when the process installed it
    gone: bool = False


@dataclass(frozen=True)
class ProcSample(_ToDict):
    """One poll of one process. None where the figure could not be read this time."""

    pid: int
    ts: float  # time.time() of the read
    name: str | None = None  # /proc/<pid>/comm
    state: str | None = None  # scheduler state letter: R S D T Z ...
    cpu_s: float | None = None  # utime + stime, seconds
    num_threads: int | None = None
    num_fds: int | None = None
    fd_limit: int | None = None  # soft RLIMIT_NOFILE
    rss: int | None = None  # bytes
    uss: int | None = None  # bytes, slow cadence
    pss: int | None = None  # bytes, slow cadence
    syscall: int | None = None  # first field of /proc/<pid>/syscall; -1 = running in user space
    wchan: str | None = None
    fds: FdSummary | None = None  # slow cadence / when num_fds moves
    shm_maps: int | None = None  # count of /dev/shm mappings (slow cadence)
    shm_map_bytes: int | None = None
    gone: bool = False  # the process no longer exists
    # /proc/<pid>/schedstat of the main thread: ns on a CPU, ns runnable but waiting for one
    # (run delay: grows only while the thread wants to run), times it was switched in
    run_ns: int | None = None
    run_delay_ns: int | None = None
    run_count: int | None = None
    # /proc/<pid>/status of the main thread: a sleeper that wakes now and then counts up
    num_ctx_switches_voluntary: int | None = None
    num_ctx_switches_involuntary: int | None = None
    # /proc/<pid>/io (psutil's names): bytes through read()/recv() and write()/send() of every
    # thread, sockets and pipes included; None without ptrace-read access to the process
    read_chars: int | None = None
    write_chars: int | None = None
    minflt: int | None = None  # minor page faults so far (/proc/<pid>/stat); copy-on-write copies fault here
    exit_code: int | None = None  # a zombie's wait status (/proc/<pid>/stat field 52): low 7 bits = the signal
    uss_ts: float | None = None  # when uss/pss/vm_lck were read (they are carried forward between reads)
    vm_lck: int | None = None  # bytes locked in memory (VmLck, /proc/<pid>/status), slow cadence
    memlock_limit: int | None = None  # soft RLIMIT_MEMLOCK, bytes; None = unlimited or unreadable; slow cadence
    # USS in two parts (smaps_rollup, slow cadence): pages this process alone maps that it wrote
    # (anonymous memory, copy-on-write copies, shmem it filled: what a copy or a leak grows) and
    # those it only read (nearly all page cache of files it maps: reclaimable, never a copy)
    private_dirty: int | None = None
    private_clean: int | None = None


_PROC_TEMPLATE: dict[str, Any] = {
    f.name: None if f.default is dataclasses.MISSING else f.default for f in dataclasses.fields(ProcSample)
}
_PROC_NAMES = frozenset(_PROC_TEMPLATE)


def proc_sample(pid: int, ts: float, fields: Mapping[str, Any]) -> ProcSample:
    """``ProcSample(pid=pid, ts=ts, **fields)``, equal to it in every way, built without the
    frozen dataclass's ``__init__`` (one ``object.__setattr__`` per field, 32 of them: about
    7 us of a poll's 20 a process, against 1.3 here).  For the monitor's every-poll read;
    ProcSample has no ``__post_init__`` for this to skip (tests/test_timeline_record.py checks).
    """
    if not _PROC_NAMES.issuperset(fields):
        raise TypeError(f"ProcSample has no field {sorted(set(fields) - _PROC_NAMES)[0]!r}")
    values = _PROC_TEMPLATE.copy()  # every field, in field order, as __init__ leaves them
    values.update(fields)
    values["pid"], values["ts"] = pid, ts
    sample = object.__new__(ProcSample)
    object.__setattr__(sample, "__dict__", values)
    return sample


@dataclass(frozen=True)
class SocketPeer(_ToDict):
    """A TCP socket a process holds, from /proc/<pid>/fd and its net namespace's tcp tables."""

    fd: int
    inode: int
    family: str  # "tcp" (IPv4) or "tcp6"
    local: str  # "ip:port"
    remote: str  # "ip:port"; [v6]:port for IPv6
    tcp_state: str  # ESTABLISHED, SYN_SENT, CLOSE_WAIT, ...


@dataclass(frozen=True)
class ThreadIo(_ToDict):
    """What one thread is in the kernel for: /proc/<pid>/task/<tid>/{stat,syscall}."""

    tid: int
    state: str | None = None
    syscall: int | None = None  # -1 = running in user space
    args: tuple[int, ...] = ()  # the syscall's six arguments, raw
    fd: int | None = None  # the fd argument, for the syscalls whose first argument is one
    fd_target: str | None = None  # readlink of that fd: a path, "socket:[inode]", "pipe:[inode]"
    run_ns: int | None = None  # /proc/<pid>/task/<tid>/schedstat: ns on a CPU
    run_count: int | None = None  # times switched in (a wake: data arrived, a timeout fired)
    wchan: str | None = None  # /proc/<pid>/task/<tid>/wchan: the kernel function it sleeps in (pipe_read, ...)
    path: str | None = None  # an open syscall's path argument (no fd yet), read from the thread's memory
    fifo: bool = False  # the syscall's fd (or the opened path) is a named pipe


@dataclass(frozen=True)
class IoSample(_ToDict):
    """Where a process's threads wait and whom it talks to; read on a stall, not every poll."""

    pid: int
    ts: float
    threads: tuple[ThreadIo, ...] = ()
    sockets: tuple[SocketPeer, ...] = ()  # TCP sockets only (unix sockets and pipes are local)
    files: tuple[str, ...] = ()  # open regular files (not /dev, /proc, /sys, /dev/shm), first few
    gone: bool = False


@dataclass(frozen=True)
class SystemSample(_ToDict):
    ts: float
    mem_available: int | None = None  # bytes, /proc/meminfo MemAvailable
    mlocked: int | None = None  # bytes, /proc/meminfo Mlocked
    shm_total: int | None = None  # bytes, statvfs(/dev/shm)
    shm_free: int | None = None
    shm_torch_files: int | None = None  # count of named /dev/shm/torch_* files (file_system strategy)
    cgroup_memory_limit: int | None = None  # bytes; None = unlimited or unreadable
    cgroup_memory_usage: int | None = None
    cgroup_oom_kills: int | None = None
    vm_oom_kills: int | None = None  # the host's OOM kills so far (/proc/vmstat oom_kill): no cgroup limit needed


@dataclass(frozen=True)
class GpuSample(_ToDict):
    index: int
    name: str | None = None
    util_percent: int | None = None
    memory_used: int | None = None
    memory_total: int | None = None


# --------------------------------------------------------------------------- stacks


@dataclass(frozen=True)
class Frame(_ToDict):
    function: str
    filename: str | None = None
    line: int | None = None
    native: bool = False  # a C/C++ frame (py-spy --native)


@dataclass(frozen=True)
class ThreadStack(_ToDict):
    thread_id: int | None
    name: str | None = None
    native_tid: int | None = None  # OS tid where known
    active: bool | None = None
    owns_gil: bool | None = None
    frames: tuple[Frame, ...] = ()  # innermost first, as py-spy prints them
    # frames left out of the middle to keep to collect.bounds (0: all are here); they were
    # between frames[frames_omitted_after - 1] and frames[frames_omitted_after]
    frames_omitted: int = 0
    frames_omitted_after: int | None = None


@dataclass(frozen=True)
class StackDump(_ToDict):
    """The stacks of one process, or why there are none."""

    pid: int
    source: str  # "py-spy-native", "py-spy", "py-spy-nonblocking", "faulthandler", "none"
    threads: tuple[ThreadStack, ...] = ()
    error: str | None = None  # why this (or a better) source failed; with the fix where known
    duration_s: float | None = None
    threads_omitted: int = 0  # threads left out to keep to collect.bounds
    cut_at_bytes: int | None = None  # the dump's input (py-spy's JSON, the dump file) was cut after this many bytes
    memory_cut_bytes: int | None = None  # py-spy reached this memory limit and was stopped (report key only when set)
    not_run: bool = False  # py-spy never ran for it: the dumps' time was spent while it waited its turn

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if out.get("memory_cut_bytes") is None:  # the keys of an older report, unless something was cut
            out.pop("memory_cut_bytes", None)
        if not out.get("not_run"):
            out.pop("not_run", None)
        return out


# --------------------------------------------------------------------------- events and findings


@dataclass(frozen=True)
class Finding(_ToDict):
    playbook: str  # playbook id, kebab-case, stable
    title: str
    confidence: float  # 0..1
    evidence: Mapping[str, Any] = field(default_factory=dict)
    remediation: str = ""
