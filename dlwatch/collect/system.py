"""System-wide probes: /proc/meminfo, /dev/shm, the cgroup memory controller (v1 and v2).

``read_system`` reads everything afresh; ``SystemProbe`` is the same reading for a monitor that
asks every poll, without what does not change between polls (see its docstring).
"""

from __future__ import annotations

import os
import time

from dlwatch.model import SystemSample

SHM_DIR = "/dev/shm"
_V1 = "/sys/fs/cgroup/memory"
_V2 = "/sys/fs/cgroup"


LIMIT_EVERY_S = 10.0  # SystemProbe re-reads the cgroup's memory limit this often (a resized job changes it)
# SystemProbe counts /dev/shm's torch_* files again only when the directory changed (its mtime), and
# at least this often: a shared host's /dev/shm can hold thousands of other jobs' files
SHM_RECOUNT_EVERY_S = 10.0
# a directory mtime this close to the count may hide a change made in the same clock tick right after it
_MTIME_SLACK_NS = 1_000_000_000
_KEEPABLE = ("/proc/", "/sys/")  # pseudo-filesystems whose files SystemProbe keeps open (see there)


def _read(path: str) -> str | None:
    try:  # os.open/os.read: a file object costs more than the read of a small /proc or /sys file
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return os.read(fd, 65536).decode("utf-8", "replace")
    except OSError:
        return None
    finally:
        os.close(fd)


def _int(text: str | None) -> int | None:
    if text is None:
        return None
    text = text.strip()
    if text.isascii() and text.isdigit():  # "²".isdigit() is true, int("²") raises
        value = int(text)
        return None if value >= 1 << 60 else value  # v1 "unlimited" is a huge number
    return None


def cgroup_paths(pid: int, controller: str = "memory") -> tuple[str | None, str | None]:
    """(v1 ``controller`` cgroup path, v2 cgroup path) of ``pid`` from /proc/<pid>/cgroup."""
    v1 = v2 = None
    for line in (_read(f"/proc/{pid}/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            v2 = parts[2]
        elif controller in parts[1].split(","):
            v1 = parts[2]
    return v1, v2


_Files = tuple[str, str, str]  # the cgroup's limit file, usage file, file with the oom_kill line


def _cgroup_candidates(paths: tuple[str | None, str | None]) -> list[_Files]:
    v1, v2 = paths
    candidates = []
    if v1 is not None:
        for base in (os.path.join(_V1, v1.lstrip("/")), _V1):
            candidates.append(
                tuple(
                    os.path.join(base, f)
                    for f in ("memory.limit_in_bytes", "memory.usage_in_bytes", "memory.oom_control")
                )
            )
    if v2 is not None:
        base = os.path.join(_V2, v2.lstrip("/"))
        candidates.append(tuple(os.path.join(base, f) for f in ("memory.max", "memory.current", "memory.events")))
    return candidates  # type: ignore[return-value]


def _oom_kills(events_text: str | None) -> int | None:
    """The ``oom_kill N`` line of memory.oom_control (v1) or memory.events (v2)."""
    oom = None
    for line in (events_text or "").splitlines():
        if line.startswith("oom_kill "):
            oom = _int(line.split()[1])
    return oom


def cgroup_memory(
    pid: int, paths: tuple[str | None, str | None] | None = None
) -> tuple[int | None, int | None, int | None]:
    """(limit, usage, oom_kill count) for the memory cgroup of ``pid``; None where unreadable.

    ``paths`` (from ``cgroup_paths``) may be passed to skip re-reading /proc/<pid>/cgroup.
    """
    for limit_file, usage_file, events_file in _cgroup_candidates(paths if paths is not None else cgroup_paths(pid)):
        limit = _read(limit_file)
        if limit is None:
            continue
        return _int(limit), _int(_read(usage_file)), _oom_kills(_read(events_file))
    return None, None, None


def shm_usage(path: str = SHM_DIR) -> tuple[int | None, int | None]:
    try:
        st = os.statvfs(path)
    except OSError:
        return None, None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def torch_shm_files(path: str = SHM_DIR, cap: int = 100_000) -> int | None:
    """Named torch segments (file_system strategy); leftovers of a crash show up here too."""
    try:
        with os.scandir(path) as it:
            n = 0
            for i, entry in enumerate(it):
                if i >= cap:
                    break
                if entry.name.startswith("torch_"):
                    n += 1
            return n
    except OSError:
        return None


def vm_oom_kills() -> int | None:
    """The host's OOM kills since boot (/proc/vmstat ``oom_kill``, Linux >= 4.13); None if absent."""
    return _vm_oom_kills(_read("/proc/vmstat"))


def _vm_oom_kills(text: str | None) -> int | None:
    text = text or ""
    idx = text.find("\noom_kill ")
    if idx < 0:
        return None
    return _int(text[idx + 10 :].split("\n", 1)[0])


def _meminfo_kib(text: str, key: str) -> int | None:
    """``parse_kv_kib(text, (key,)).get(key)`` for /proc/meminfo, by one search instead of a split of
    its ~55 lines (most of what read_system cost beyond the reads); the same rules for the value."""
    if text.startswith(key + ":"):
        start = 0
    else:
        start = text.find("\n" + key + ":") + 1
        if start == 0:
            return None
    end = text.find("\n", start)
    parts = text[start + len(key) + 1 : end if end >= 0 else len(text)].split()
    if not parts or not (parts[0].isascii() and parts[0].isdigit()):
        return None
    return int(parts[0]) * (1024 if parts[1:2] == ["kB"] else 1)


def read_system(pid: int, cgroup_paths: tuple[str | None, str | None] | None = None) -> SystemSample:
    """Everything read afresh (attach, the monitor's last look after the training process died)."""
    probe = SystemProbe(pid, cgroup_paths)
    try:
        return probe.sample()
    finally:
        probe.close()


class SystemProbe:
    """``read_system`` of one process, poll after poll, without re-reading what does not change.

    Read once: the process's cgroup paths (unless given) and which of the candidate cgroup
    directories answers (found again as soon as it stops answering).  Read every
    ``LIMIT_EVERY_S``: the cgroup's memory limit.  Read every time: everything that moves
    (MemAvailable, Mlocked, /dev/shm, the cgroup's usage and OOM-kill count, the host's OOM
    kills), so that a death is judged on counters read after it.

    The files read every poll (/proc/meminfo, /proc/vmstat, the cgroup's files) are opened once
    and read again from offset 0 (``os.pread``): procfs and the cgroup filesystem (kernfs)
    regenerate a file's text on such a read, as a fresh open would, without the open and close,
    and fail it (ENODEV) once the cgroup is removed.  A kept file that fails a read is closed and
    opened again at the next read (a cgroup file that fails is looked for again, as before).  Only
    files under /proc and /sys are kept: a regular file (a test's fake cgroup) would go on reading
    its unlinked text.  ``close`` closes them.
    """

    def __init__(
        self, pid: int, cgroup_paths: tuple[str | None, str | None] | None = None, shm_dir: str = SHM_DIR
    ) -> None:
        self.pid = pid
        self._paths = cgroup_paths
        self._files: _Files | None = None  # the cgroup directory that answered
        self._limit: int | None = None
        self._limit_at = -LIMIT_EVERY_S
        self.shm_dir = shm_dir
        self._shm_key: tuple[int, int, int] | None = None  # (st_dev, st_ino, st_mtime_ns) when counted
        self._shm_files: int | None = None
        self._shm_at = -SHM_RECOUNT_EVERY_S
        self._kept: dict[str, int] = {}  # path -> descriptor read with pread

    def _read(self, path: str) -> str | None:
        """``_read(path)`` through a descriptor kept open; None (and the descriptor closed) on failure."""
        if not path.startswith(_KEEPABLE):
            return _read(path)
        fd = self._kept.get(path)
        try:
            if fd is None:
                fd = self._kept[path] = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            return os.pread(fd, 65536, 0).decode("utf-8", "replace")
        except OSError:
            self._forget(path)
            return None

    def _forget(self, path: str) -> None:
        fd = self._kept.pop(path, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass

    def close(self) -> None:
        for path in list(self._kept):
            self._forget(path)

    def __del__(self) -> None:  # a probe dropped without close() must not leak descriptors
        try:
            self.close()
        except Exception:  # at interpreter exit the os module may be torn down: the kernel closes them then
            pass

    def _torch_shm_files(self, now: float) -> int | None:
        """``torch_shm_files``, counted again only when /dev/shm changed or SHM_RECOUNT_EVERY_S passed.

        Creating, removing or renaming an entry sets the directory's mtime to that moment; a count
        is reused only while the mtime is the same as at the count and was already a second old then
        (a change in the same coarse clock tick as the count could keep the old mtime).
        """
        try:
            st = os.stat(self.shm_dir)
        except OSError:
            self._shm_key = None
            return torch_shm_files(self.shm_dir)
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if key == self._shm_key and now - self._shm_at < SHM_RECOUNT_EVERY_S:
            return self._shm_files
        settled = time.time_ns() - st.st_mtime_ns >= _MTIME_SLACK_NS
        self._shm_files = torch_shm_files(self.shm_dir)
        self._shm_key, self._shm_at = (key, now) if settled else (None, now)
        return self._shm_files

    def _cgroup(self, now: float) -> tuple[int | None, int | None, int | None]:
        if self._files is not None:
            limit_file, usage_file, events_file = self._files
            fresh = now - self._limit_at >= LIMIT_EVERY_S
            limit_text = self._read(limit_file) if fresh else ""
            usage = self._read(usage_file)
            if limit_text is not None and usage is not None:
                if fresh:
                    self._limit, self._limit_at = _int(limit_text), now
                return self._limit, _int(usage), _oom_kills(self._read(events_file))
            self._files = None  # gone or refused: look again, as read_system would
            for path in (limit_file, usage_file, events_file):
                self._forget(path)
        if self._paths is None:
            self._paths = cgroup_paths(self.pid)
        for files in _cgroup_candidates(self._paths):
            limit_text = self._read(files[0])
            if limit_text is None:
                continue
            self._files, self._limit, self._limit_at = files, _int(limit_text), now
            return self._limit, _int(self._read(files[1])), _oom_kills(self._read(files[2]))
        return None, None, None

    def sample(self) -> SystemSample:
        meminfo = self._read("/proc/meminfo") or ""
        total, free = shm_usage()
        now = time.monotonic()
        limit, usage, ooms = self._cgroup(now)
        return SystemSample(
            ts=time.time(),
            mem_available=_meminfo_kib(meminfo, "MemAvailable"),
            mlocked=_meminfo_kib(meminfo, "Mlocked"),
            shm_total=total,
            shm_free=free,
            shm_torch_files=self._torch_shm_files(now),
            cgroup_memory_limit=limit,
            cgroup_memory_usage=usage,
            cgroup_oom_kills=ooms,
            vm_oom_kills=_vm_oom_kills(self._read("/proc/vmstat")),
        )


def parse_cpu_max(text: str | None) -> float | None:
    """cgroup v2 ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") -> CPUs; None when unlimited."""
    parts = (text or "").split()
    if len(parts) != 2 or parts[0] == "max":
        return None
    try:
        quota, period = int(parts[0]), int(parts[1])
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def cpu_quota(pid: int) -> float | None:
    """The CPUs the cgroup CPU quota allows ``pid`` (v1 cfs_quota_us/cfs_period_us, v2 cpu.max).

    None when there is no quota or it cannot be read.  The tightest quota on the path up
    to the root applies, so every level is read.
    """
    v1, v2 = cgroup_paths(pid, "cpu")
    found: list[float] = []
    if v1 is not None:
        for root in ("/sys/fs/cgroup/cpu,cpuacct", "/sys/fs/cgroup/cpu"):
            if not os.path.isdir(root):
                continue
            rel = v1.strip("/")
            while True:
                base = os.path.join(root, rel) if rel else root
                quota = _read(os.path.join(base, "cpu.cfs_quota_us"))
                period = _read(os.path.join(base, "cpu.cfs_period_us"))
                try:
                    q, p = int((quota or "").strip()), int((period or "").strip())
                    if q > 0 and p > 0:
                        found.append(q / p)
                except ValueError:
                    pass
                if not rel:
                    break
                rel = os.path.dirname(rel)
            break
    if v2 is not None:
        rel = v2.strip("/")
        while True:
            base = os.path.join(_V2, rel) if rel else _V2
            cpus = parse_cpu_max(_read(os.path.join(base, "cpu.max")))
            if cpus is not None:
                found.append(cpus)
            if not rel:
                break
            rel = os.path.dirname(rel)
    return min(found) if found else None


def usable_cpus(pid: int = 0) -> dict[str, float | int | None]:
    """The CPUs ``pid`` (0: this process) may use: its affinity, the cgroup quota, and the smaller.

    ``os.cpu_count()`` counts the machine's CPUs, not those a container or a taskset allows.
    """
    try:
        affinity: int | None = len(os.sched_getaffinity(pid))
    except (OSError, AttributeError):
        affinity = None
    quota = cpu_quota(pid or os.getpid())
    candidates = [c for c in (affinity, quota, os.cpu_count()) if c]
    usable = min(candidates) if candidates else None
    return {
        "affinity": affinity,
        "cgroup_quota": round(quota, 3) if quota is not None else None,
        "cpu_count": os.cpu_count(),
        "usable": round(usable, 3) if usable is not None else None,
    }
