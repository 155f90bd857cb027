"""Per-process probes read straight from /proc: cheap figures every poll, costly ones on request.

Every poll (tens of microseconds a process): /proc/<pid>/stat (state, CPU time,
threads), statm (RSS), the fd count, the soft RLIMIT_NOFILE, syscall, wchan.
On a stall (``sched_detail``, about 35 us more, so not every poll): schedstat
(ns on a CPU, run delay, times switched in), the context switches of status and
the byte counts of io, so that a stall can tell a starved or periodically
waking process from a dead one.
On request (``fd_detail``: one readlink per fd; ``mem_detail``: smaps_rollup and
maps, about 2.4 ms a process): what the fds point to, USS/PSS, /dev/shm mappings.
On a stall only (``read_io``): each thread's state and syscall with its fd, and
the TCP peers of the process's sockets from its network namespace's tables.

A process that vanishes between two reads is normal: the sample says ``gone``.
A figure that cannot be read (permission, an old kernel) is None; one failing
read never stops the others.
"""

from __future__ import annotations

import collections
import ipaddress
import operator
import os
import re
import resource
import stat
import sys
import time
from typing import Any

from dlwatch.collect import syscalls
from dlwatch.wire.reportdir import RUN_ID, RUNS_DIR
from dlwatch.model import FdSummary, IoSample, ProcSample, SocketPeer, ThreadIo, proc_sample

CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")
SHM_PREFIX = "/dev/shm/"


class _Gone(Exception):
    pass


_RDONLY = os.O_RDONLY | os.O_CLOEXEC


class ProcFiles:
    """The every-poll /proc files of one process, opened once and read again from the start.

    A /proc file regenerates its text on each read at offset 0, so ``os.pread(fd, n, 0)`` on
    a file kept open gives what a fresh open would, without the open and close (the path walk
    through /proc/<pid>) that cost more than the read itself: about 11 us instead of 24 for a
    poll's four files, warm.  The files are opened relative to /proc/<pid> itself, opened
    first, so they all name the process that directory named: once that process is gone a
    read fails (ESRCH, ENOENT) and the sample says ``gone``, even if its pid was reused by then.

    Holds at most ``FDS`` descriptors (the directory and ``NAMES``); whoever keeps one closes
    it (``close``) when the process is gone or forgotten.  A refused open is not kept: it is
    tried again at the next read, as a read by path would be.
    """

    NAMES = ("stat", "statm", "syscall", "wchan")
    FDS = 1 + len(NAMES)
    __slots__ = ("pid", "_dir", "_fds", "last")

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._dir: int | None = None
        self._fds: dict[str, int] = {}
        # the last every-poll read (read_proc): (what was read, the carried figures, the sample's values)
        self.last: tuple[list[Any], tuple[Any, ...] | None, dict[str, Any]] | None = None

    def read(self, name: str) -> str:
        """The text of /proc/<pid>/<name>; _Gone once the process is."""
        try:
            fd = self._fds.get(name)
            if fd is None:
                if self._dir is None:
                    self._dir = os.open(f"/proc/{self.pid}", _RDONLY | os.O_DIRECTORY)
                fd = self._fds[name] = os.open(name, _RDONLY, dir_fd=self._dir)
            return os.pread(fd, 8192, 0).decode("utf-8", "replace")
        except (FileNotFoundError, ProcessLookupError):
            raise _Gone from None

    def read_every(self) -> list[Any]:
        """What every poll reads of the process, in one call: stat, statm, syscall and wchan's texts and
        the fd count (``num_fds``); _Gone once the process is, OSError for a refused read."""
        read = self.read
        return [read("stat"), read("statm"), read("syscall"), read("wchan"), self.num_fds()]

    def num_fds(self) -> int:
        """``num_fds`` of the same process: a stat of fd/ in the directory already open."""
        if self._dir is None:
            return num_fds(self.pid)
        try:
            size = os.stat("fd", dir_fd=self._dir).st_size
            return size if size > 0 else len(os.listdir(f"/proc/{self.pid}/fd"))
        except (FileNotFoundError, ProcessLookupError):
            raise _Gone from None

    def close(self) -> None:
        fds, self._fds = list(self._fds.values()), {}
        if self._dir is not None:
            fds.append(self._dir)
            self._dir = None
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:  # a table dropped without close() must not leak descriptors
        try:
            self.close()
        except Exception:  # at interpreter exit the os module may be torn down: the kernel closes them then
            pass


def _read(path: str) -> str:
    # os.open/os.read, not open(): a file object costs about 1.5 us more per read, and a poll
    # reads four files per watched process
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except (FileNotFoundError, ProcessLookupError):
        raise _Gone from None
    try:
        return os.read(fd, 8192).decode("utf-8", "replace")
    except (FileNotFoundError, ProcessLookupError):
        raise _Gone from None
    finally:
        os.close(fd)


def parse_stat(text: str) -> dict[str, object]:
    """Fields of /proc/<pid>/stat we use.  comm may hold spaces and ')': split at the last ')'."""
    rpar = text.rfind(")")
    lpar = text.find("(")
    if rpar < 0 or lpar < 0 or rpar < lpar:
        raise ValueError("malformed stat")
    rest = text[rpar + 2 :].split()
    if len(rest) < 20:
        raise ValueError("truncated stat")
    out: dict[str, object] = {
        "name": text[lpar + 1 : rpar],
        "state": rest[0],
        "ppid": int(rest[1]),
        "minflt": int(rest[7]),
        "cpu_s": (int(rest[11]) + int(rest[12])) / CLK_TCK,
        "num_threads": int(rest[17]),
        "starttime": int(rest[19]),
    }
    # field 52 (Linux >= 3.5): the wait status; meaningful for a zombie (its parent has not reaped it)
    if rest[0] == "Z" and len(rest) >= 50 and _digits(rest[49].lstrip("-")):
        out["exit_code"] = int(rest[49])
    return out


def _stat_fields(text: str) -> dict[str, object]:
    """``parse_stat`` less ``ppid`` and ``starttime``, for a sample (read_proc, every poll): only the
    first 20 fields split off (a zombie's exit status, field 52, is looked for in the whole line)."""
    rpar = text.rfind(")")
    lpar = text.find("(")
    if rpar < 0 or lpar < 0 or rpar < lpar:
        raise ValueError("malformed stat")
    rest = text[rpar + 2 :].split(None, 20)
    if len(rest) < 20:
        raise ValueError("truncated stat")
    state = rest[0]
    out: dict[str, object] = {
        "name": text[lpar + 1 : rpar],
        "state": state,
        "minflt": int(rest[7]),
        "cpu_s": (int(rest[11]) + int(rest[12])) / CLK_TCK,
        "num_threads": int(rest[17]),
    }
    int(rest[1]), int(rest[19])  # as parse_stat: a garbled ppid or starttime is a garbled stat
    if state == "Z":
        code = parse_stat(text).get("exit_code")
        if code is not None:
            out["exit_code"] = code
    return out


def parse_syscall(text: str) -> int | None:
    """First field of /proc/<pid>/syscall: the syscall number; 'running' (user space) is -1."""
    head = text.split(None, 1)
    if not head:
        return None
    if head[0] == "running":
        return -1
    try:
        return int(head[0])
    except ValueError:
        return None


def parse_syscall_args(text: str) -> tuple[int | None, tuple[int, ...]]:
    """/proc/<pid>/syscall: (number, the six arguments) when blocked in a syscall; -1 running."""
    parts = text.split()
    nr = parse_syscall(text)
    if nr is None or nr < 0 or len(parts) < 7:
        return nr, ()
    try:
        return nr, tuple(int(a, 16) for a in parts[1:7])
    except ValueError:
        return nr, ()


def parse_schedstat(text: str) -> tuple[int, int, int] | None:
    """/proc/<pid>/schedstat: (ns on a CPU, ns waiting on a run queue, times switched in)."""
    parts = text.split()
    if len(parts) < 3:
        return None
    try:
        run_ns, delay_ns, count = (int(x) for x in parts[:3])
    except ValueError:
        return None
    return (run_ns, delay_ns, count) if min(run_ns, delay_ns, count) >= 0 else None


def schedstat(pid: int) -> tuple[int, int, int] | None:
    """The main thread's /proc/<pid>/schedstat alone (ns on a CPU, ns waiting on a run queue, times
    switched in); None for a gone process or a kernel without CONFIG_SCHED_INFO."""
    try:
        return parse_schedstat(_read(f"/proc/{pid}/schedstat"))
    except (_Gone, OSError):
        return None


def _digits(text: str) -> bool:
    """ASCII digits only: str.isdigit() is also true for "²" and other Unicode digits that int() refuses."""
    return text.isascii() and text.isdigit()


def parse_ctx_switches(text: str) -> tuple[int | None, int | None]:
    """(voluntary, involuntary) context switches from /proc/<pid>/status."""
    vol = invol = None
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches"):
            val = rest.strip()
            if _digits(val):
                if key[0] == "v":
                    vol = int(val)
                else:
                    invol = int(val)
    return vol, invol


def parse_io_chars(text: str) -> tuple[int | None, int | None]:
    """(rchar, wchar) from /proc/<pid>/io."""
    got: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("rchar", "wchar") and _digits(rest.strip()):
            got[key] = int(rest.strip())
    return got.get("rchar"), got.get("wchar")


TCP_STATES = {
    1: "ESTABLISHED",
    2: "SYN_SENT",
    3: "SYN_RECV",
    4: "FIN_WAIT1",
    5: "FIN_WAIT2",
    6: "TIME_WAIT",
    7: "CLOSE",
    8: "CLOSE_WAIT",
    9: "LAST_ACK",
    10: "LISTEN",
    11: "CLOSING",
    12: "NEW_SYN_RECV",
}


def _hex_addr(text: str) -> str | None:
    """'0100007F:1F90' -> '127.0.0.1:8080'; IPv6 as '[::1]:8080'.

    The kernel prints each 32-bit word of the address as a number in host order.
    """
    addr, sep, port = text.partition(":")
    if not sep or len(addr) not in (8, 32):
        return None
    try:
        raw = b"".join(int(addr[i : i + 8], 16).to_bytes(4, sys.byteorder) for i in range(0, len(addr), 8))
        portnum = int(port, 16)
    except (ValueError, OverflowError):  # "-0000001" parses as an int and overflows 4 bytes
        return None
    if not 0 <= portnum <= 0xFFFF:
        return None
    ip = ipaddress.ip_address(raw)
    if ip.version == 6:
        mapped = ip.ipv4_mapped
        return f"{mapped}:{portnum}" if mapped is not None else f"[{ip}]:{portnum}"
    return f"{ip}:{portnum}"


def parse_tcp_table(text: str) -> dict[int, tuple[str, str, str]]:
    """/proc/<pid>/net/tcp or tcp6 -> {inode: (local, remote, state)}; bad lines are skipped."""
    out: dict[int, tuple[str, str, str]] = {}
    for line in text.splitlines()[1:]:
        parts = line.split()
        if len(parts) < 10:
            continue
        local, remote = _hex_addr(parts[1]), _hex_addr(parts[2])
        try:
            state = TCP_STATES.get(int(parts[3], 16), parts[3][:4])
            inode = int(parts[9])
        except ValueError:
            continue
        if local is None or remote is None or inode <= 0:
            continue
        out[inode] = (local, remote, state)
    return out


def parse_kv_kib(text: str, keys: tuple[str, ...]) -> dict[str, int]:
    """'Key:   123 kB' lines (meminfo, smaps_rollup) -> bytes for the asked keys."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in keys:
            parts = rest.split()
            if parts and _digits(parts[0]):
                out[key] = int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)
    return out


def classify_fd_target(target: str) -> str:
    if target.startswith(SHM_PREFIX):
        return "shm"
    if target.startswith("socket:"):
        return "socket"
    if target.startswith("pipe:"):
        return "pipe"
    if target.startswith("/") and not target.startswith(("/dev/", "/proc/", "/sys/")):
        return "file"
    return "other"


# a file of a dlwatch run directory (<report dir>/.runs/<run id>/: the heartbeat, a dump file): dlwatch's
# own, counted with the process's fds but never named among the files the program keeps open
_OWN_RUN_FILE = re.compile(r"/" + re.escape(RUNS_DIR) + r"/" + RUN_ID.pattern + r"/")


def _fd_summary(pid: int, *, top: int = 5) -> FdSummary | None:
    base = f"/proc/{pid}/fd"
    try:
        names = os.listdir(base)
    except (FileNotFoundError, ProcessLookupError):
        raise _Gone from None
    except PermissionError:
        return None
    counts = collections.Counter()
    files: collections.Counter[str] = collections.Counter()
    shm_bytes = 0
    for name in names:
        try:
            target = os.readlink(f"{base}/{name}")
        except OSError:
            continue  # closed between listdir and readlink
        kind = classify_fd_target(target)
        counts[kind] += 1
        if kind == "file" and not _OWN_RUN_FILE.search(target):
            files[target] += 1
        elif kind == "shm":
            try:
                shm_bytes += os.stat(f"{base}/{name}").st_size
            except OSError:
                pass
    return FdSummary(
        file=counts["file"],
        shm=counts["shm"],
        socket=counts["socket"],
        pipe=counts["pipe"],
        other=counts["other"],
        shm_bytes=shm_bytes,
        top_files=tuple(files.most_common(top)),
    )


def shm_mappings(maps_text: str) -> tuple[int, int]:
    """(count of distinct /dev/shm objects mapped, bytes mapped) from /proc/<pid>/maps."""
    paths: set[str] = set()
    total = 0
    for line in maps_text.splitlines():
        idx = line.find(SHM_PREFIX)
        if idx < 0:
            continue
        addr = line.split(None, 1)[0]
        lo, _, hi = addr.partition("-")
        try:
            total += int(hi, 16) - int(lo, 16)
        except ValueError:
            continue
        paths.add(line[idx:])
    return len(paths), total


def _fd_limit(pid: int) -> int | None:
    try:
        soft, _hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
        return None if soft == resource.RLIM_INFINITY else int(soft)
    except ProcessLookupError:
        raise _Gone from None
    except (OSError, ValueError):
        pass
    try:  # prlimit needs CAP_SYS_RESOURCE for another user's process; limits is world-readable
        for line in _read(f"/proc/{pid}/limits").splitlines():
            if line.startswith("Max open files"):
                soft = line.split()[3]
                return None if soft == "unlimited" else int(soft)
    except (OSError, ValueError, IndexError):
        pass
    return None


CAP_IPC_LOCK = 14


def _has_cap(status_text: str, cap: int) -> bool:
    for line in status_text.splitlines():
        if line.startswith("CapEff:"):
            try:
                return bool(int(line.split()[1], 16) >> cap & 1)
            except (IndexError, ValueError):
                return False
    return False


def _memlock_limit(pid: int) -> int | None:
    try:
        soft, _hard = resource.prlimit(pid, resource.RLIMIT_MEMLOCK)
        return None if soft == resource.RLIM_INFINITY else int(soft)
    except ProcessLookupError:
        raise _Gone from None
    except (OSError, ValueError):
        pass
    try:
        for line in _read(f"/proc/{pid}/limits").splitlines():
            if line.startswith("Max locked memory"):
                soft = line.split()[3]
                return None if soft == "unlimited" else int(soft)
    except (OSError, ValueError, IndexError):
        pass
    return None


def num_fds(pid: int) -> int:
    """Open fds of ``pid``.  Linux >= 6.2 reports the count as the size of /proc/<pid>/fd
    (one stat, ~1 us, instead of a listdir that grows with the fd count: forked workers
    inherit their siblings' pipes); older kernels say 0 there, so fall back to listdir.
    """
    path = f"/proc/{pid}/fd"
    try:
        size = os.stat(path).st_size
        return size if size > 0 else len(os.listdir(path))
    except (FileNotFoundError, ProcessLookupError):
        raise _Gone from None


def fd_summary(pid: int, *, top: int = 5) -> FdSummary | None:
    """What the fds of ``pid`` point to; None if it is gone or refused."""
    try:
        return _fd_summary(pid, top=top)
    except _Gone:
        return None


def fd_limit(pid: int) -> int | None:
    """The soft RLIMIT_NOFILE of ``pid``; None if unlimited, gone or unreadable."""
    try:
        return _fd_limit(pid)
    except _Gone:
        return None


def _statm_rss(text: str) -> int:
    return int(text.split()[1]) * PAGE_SIZE


def _wchan_field(text: str) -> str | None:
    wchan = text.strip()
    return wchan if wchan not in ("", "0") else None


_CARRIED = (
    "uss",
    "pss",
    "private_dirty",
    "private_clean",
    "shm_maps",
    "shm_map_bytes",
    "uss_ts",
    "vm_lck",
    "memlock_limit",
)
_carried = operator.attrgetter(*_CARRIED)


def _kept_fields(got: list[Any]) -> dict[str, object]:
    """``read_proc``'s fields of what ``_read_kept`` read (all six, none refused), as its general way makes them."""
    stat, statm, syscall, wchan, nfds, limit = got
    try:
        fields = _stat_fields(stat)
    except ValueError:  # a garbled stat: nothing else (the general way stops reading there)
        return {}
    fields["num_fds"] = nfds
    fields["fd_limit"] = limit
    try:
        fields["rss"] = _statm_rss(statm)
    except (ValueError, IndexError):
        pass
    fields["syscall"] = parse_syscall(syscall)
    fields["wchan"] = _wchan_field(wchan)
    return fields


def _read_kept(pid: int, files: ProcFiles, carry: ProcSample | None) -> ProcSample | None:
    """``read_proc``'s every-poll read through kept files; None where the general way must say it (a file
    gone or refused: it reads again and tells which, with what it read before).

    A process whose six reads (stat, statm, syscall, wchan, the fd count, its fd limit) are what they
    were at its last read, with the very figures carried then, gets that read's values again, ``ts``
    apart: ``read_proc`` makes its sample from those inputs alone, so nothing is parsed or built field
    by field, and the timeline sees the same objects (``timeline._proc_text``).  An idle worker reads
    so poll after poll.
    """
    ts = time.time()
    try:
        got = files.read_every()
        got.append(_fd_limit(pid))
    except (_Gone, OSError):
        return None
    carried = _carried(carry) if carry is not None else None
    last = files.last
    if (
        last is not None
        and last[0] == got
        and (
            last[1] is carried is None
            or (last[1] is not None and carried is not None and all(map(operator.is_, last[1], carried)))
        )
    ):
        values = last[2].copy()
        values["ts"] = ts
        sample = object.__new__(ProcSample)
        object.__setattr__(sample, "__dict__", values)
        return sample
    fields = _kept_fields(got)
    if carried is not None and "uss" not in fields:
        fields.update(zip(_CARRIED, carried))
    sample = proc_sample(pid, ts, fields)
    files.last = (got, carried, vars(sample))
    return sample


def read_proc(
    pid: int,
    *,
    fd_detail: bool = False,
    mem_detail: bool = False,
    sched_detail: bool = False,
    carry: ProcSample | None = None,
    files: ProcFiles | None = None,
) -> ProcSample:
    """One sample of one process; never raises for a process that vanished or a refused read.

    ``sched_detail`` adds schedstat, context switches and byte counts (about 35 us more a
    process: read on a stall, across the observation window, not every poll).
    ``carry``: an earlier sample whose slow-cadence figures (USS/PSS, /dev/shm mappings,
    VmLck, the memlock limit) this one keeps when it has no USS of its own and the process is
    still there; given here rather than by ``dataclasses.replace`` afterwards, which builds
    the sample a second time on every poll.
    ``files``: the process's ``ProcFiles`` (kept by a caller that polls it), which the every-poll
    files are read through instead of by path (``_read_kept``).
    """
    if files is not None and not (fd_detail or mem_detail or sched_detail):
        kept = _read_kept(pid, files, carry)
        if kept is not None:
            return kept
    ts = time.time()
    fields: dict[str, object] = {}
    base = f"/proc/{pid}/"
    read = files.read if files is not None else (lambda name: _read(base + name))
    try:
        # name, state, cpu_s, num_threads, minflt and a zombie's exit_code: the sample's fields
        fields = _stat_fields(read("stat"))
        try:
            fields["num_fds"] = files.num_fds() if files is not None else num_fds(pid)
        except PermissionError:
            pass
        fields["fd_limit"] = _fd_limit(pid)
        try:
            fields["rss"] = _statm_rss(read("statm"))
        except (ValueError, IndexError):
            pass
        try:
            fields["syscall"] = parse_syscall(read("syscall"))
        except PermissionError:
            pass
        try:
            fields["wchan"] = _wchan_field(read("wchan"))
        except PermissionError:
            pass
        if sched_detail:
            try:  # absent without CONFIG_SCHED_INFO: that is not a gone process
                sched = parse_schedstat(_read(f"/proc/{pid}/schedstat"))
                if sched is not None:
                    fields["run_ns"], fields["run_delay_ns"], fields["run_count"] = sched
            except (_Gone, OSError):
                pass
            try:
                vol, invol = parse_ctx_switches(_read(f"/proc/{pid}/status"))
                fields["num_ctx_switches_voluntary"] = vol
                fields["num_ctx_switches_involuntary"] = invol
            except PermissionError:
                pass
            try:
                io = parse_io_chars(_read(f"/proc/{pid}/io"))
                fields["read_chars"], fields["write_chars"] = io
            except PermissionError:
                pass
        if fd_detail:
            fields["fds"] = _fd_summary(pid)
        if mem_detail:
            try:
                roll = parse_kv_kib(
                    _read(f"/proc/{pid}/smaps_rollup"), ("Pss", "Private_Clean", "Private_Dirty", "Private_Hugetlb")
                )
                if "Pss" in roll:
                    fields["pss"] = roll["Pss"]
                    fields["private_dirty"] = roll.get("Private_Dirty", 0) + roll.get("Private_Hugetlb", 0)
                    fields["private_clean"] = roll.get("Private_Clean", 0)
                    fields["uss"] = fields["private_clean"] + fields["private_dirty"]
                    fields["uss_ts"] = ts
            except PermissionError:
                pass
            cap_ipc_lock = False
            try:
                status = _read(f"/proc/{pid}/status")
                fields["vm_lck"] = parse_kv_kib(status, ("VmLck",)).get("VmLck")
                cap_ipc_lock = _has_cap(status, CAP_IPC_LOCK)
            except PermissionError:
                pass
            # CAP_IPC_LOCK lifts RLIMIT_MEMLOCK: the process then has no lock limit to approach
            fields["memlock_limit"] = None if cap_ipc_lock else _memlock_limit(pid)
            try:
                fields["shm_maps"], fields["shm_map_bytes"] = shm_mappings(_read(f"/proc/{pid}/maps"))
            except PermissionError:
                pass
    except _Gone:
        fields["gone"] = True
        return proc_sample(pid, ts, fields)
    except (ValueError, PermissionError):
        pass  # a garbled or refused stat: keep what was read
    if carry is not None and "uss" not in fields:
        fields.update(zip(_CARRIED, _carried(carry)))
    return proc_sample(pid, ts, fields)


MAX_THREADS = 64  # threads read per process: a worker has a few, a main process may have hundreds
MAX_FILES = 8
MAX_SOCKETS = 16
_MAX_FDS = 4096


def _big_read(path: str, limit: int = 1 << 20) -> str:
    with open(path, "rb", buffering=0) as f:
        return f.read(limit).decode("ascii", "replace")


# where a thread sleeps on a pipe or FIFO (kernel function names, stable in mainline for years; a
# kernel that names them otherwise only loses the word "pipe": the wait is still judged by its syscall)
FIFO_WCHANS = frozenset({"wait_for_partner", "fifo_open", "pipe_read", "pipe_write", "pipe_wait"})
MAX_PATH_BYTES = 4096  # PATH_MAX


def _wchan(text: str) -> str | None:
    name = text.strip()
    return name if name and name != "0" and name.isascii() and name.isprintable() and len(name) <= 64 else None


def _is_fifo(pid: int, fd: int, target: str | None) -> bool:
    """Whether the fd is a named pipe: fstat through /proc (no path of the target's is opened or
    followed).  Only for a path-like target not under /dev, /proc, /sys; a hung network mount never
    gets here for a FIFO check of a file it serves: those wait in state D and are judged before."""
    if not target or not target.startswith("/") or target.startswith(("/dev/", "/proc/", "/sys/")):
        return False
    try:
        return stat.S_ISFIFO(os.stat(f"/proc/{pid}/fd/{fd}").st_mode)
    except OSError:
        return False


def read_c_string(pid: int, address: int, limit: int = MAX_PATH_BYTES) -> str | None:
    """The NUL-terminated string at ``address`` in ``pid``'s memory (an open syscall's path), or None.

    Read through /proc/<pid>/mem with the rights py-spy needs too (the kernel checks ptrace
    access); bounded; never followed or opened: the text is shown, after redaction, nothing more.
    """
    if not 0 < address < (1 << 63):
        return None
    try:
        fd = os.open(f"/proc/{pid}/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.pread(fd, limit, address)
    except (OSError, OverflowError, ValueError):
        return None
    finally:
        os.close(fd)
    end = data.find(b"\0")
    if end <= 0:
        return None
    return data[:end].decode("utf-8", "backslashreplace")


def read_io(pid: int) -> IoSample:
    """Threads' states and syscalls, TCP peers and open files of one process; never raises.

    Everything here is text the target's kernel objects produce, but the target
    chooses its fds, paths and sockets: parse, never trust (paths are shown, not opened).
    """
    ts = time.time()
    threads: list[ThreadIo] = []
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if _digits(t))
    except (FileNotFoundError, ProcessLookupError):
        return IoSample(pid=pid, ts=ts, gone=True)
    except OSError:
        tids = []
    if pid in tids:  # the main thread first
        tids.remove(pid)
        tids.insert(0, pid)
    for tid in tids[:MAX_THREADS]:
        base = f"/proc/{pid}/task/{tid}"
        state = None
        try:
            state = str(parse_stat(_read(f"{base}/stat"))["state"])
        except (_Gone, OSError, ValueError):
            pass
        nr: int | None = None
        args: tuple[int, ...] = ()
        try:
            nr, args = parse_syscall_args(_read(f"{base}/syscall"))
        except (_Gone, OSError):
            pass
        fd = target = None
        if syscalls.is_fd_first(nr) and args and 0 <= args[0] < (1 << 31):
            fd = args[0]
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                pass
        run_ns = run_count = None
        try:
            sched = parse_schedstat(_read(f"{base}/schedstat"))
            if sched is not None:
                run_ns, _delay, run_count = sched
        except (_Gone, OSError):
            pass
        wchan = None
        try:
            wchan = _wchan(_read(f"{base}/wchan"))
        except (_Gone, OSError):
            pass
        path = None
        at = syscalls.open_path_arg(nr)
        if at is not None and len(args) > at:
            path = read_c_string(pid, args[at])
        fifo = wchan in FIFO_WCHANS or (fd is not None and _is_fifo(pid, fd, target))
        threads.append(
            ThreadIo(
                tid=tid,
                state=state,
                syscall=nr,
                args=args,
                fd=fd,
                fd_target=target,
                run_ns=run_ns,
                run_count=run_count,
                wchan=wchan,
                path=path,
                fifo=fifo,
            )
        )
    socket_fds: dict[int, int] = {}
    files: list[str] = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        names = []
    for name in names[:_MAX_FDS]:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:[") and link.endswith("]") and _digits(link[8:-1]) and _digits(name):
            socket_fds[int(link[8:-1])] = int(name)
        elif classify_fd_target(link) == "file" and link not in files and len(files) < MAX_FILES:
            files.append(link)
    sockets: list[SocketPeer] = []
    if socket_fds:
        for family in ("tcp", "tcp6"):
            try:
                table = parse_tcp_table(_big_read(f"/proc/{pid}/net/{family}"))
            except (OSError, ValueError):
                continue
            for inode, (local, remote, state) in table.items():
                if inode in socket_fds and len(sockets) < MAX_SOCKETS:
                    sockets.append(
                        SocketPeer(
                            fd=socket_fds[inode],
                            inode=inode,
                            family=family,
                            local=local,
                            remote=remote,
                            tcp_state=state,
                        )
                    )
    sockets.sort(key=lambda s: s.fd)
    return IoSample(pid=pid, ts=ts, threads=tuple(threads), sockets=tuple(sockets), files=tuple(files))


def children(pid: int) -> list[int]:
    """Direct children, from /proc/<pid>/task/*/children (no scan of every process)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            text = _read(f"/proc/{pid}/task/{tid}/children")
        except (_Gone, OSError):
            continue
        out.extend(int(x) for x in text.split() if _digits(x))
    return out


def descendants(pid: int, *, limit: int = 4096) -> list[int]:
    out: list[int] = []
    stack = [pid]
    while stack and len(out) < limit:
        for child in children(stack.pop()):
            out.append(child)
            stack.append(child)
    return out


def cmdline(pid: int) -> list[str] | None:
    try:
        raw = _read(f"/proc/{pid}/cmdline")
    except (_Gone, OSError):
        return None
    return [part for part in raw.split("\0") if part] or None


def comm(pid: int) -> str | None:
    try:
        return _read(f"/proc/{pid}/comm").strip()
    except (_Gone, OSError):
        return None
