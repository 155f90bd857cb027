"""System-wide probes: /proc/meminfo, /dev/shm, the cgroup memory controller (v1 and v2)."""

from __future__ import annotations

import os
import time

from dlwatch.collect.procfs import parse_kv_kib
from dlwatch.model import SystemSample

SHM_DIR = "/dev/shm"
_V1 = "/sys/fs/cgroup/memory"
_V2 = "/sys/fs/cgroup"


def _read(path: str) -> str | None:
    try:
        with open(path, "rb", buffering=0) as f:
            return f.read(65536).decode("utf-8", "replace")
    except OSError:
        return None


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


def cgroup_memory(pid: int, paths: tuple[str | None, str | None] | None = None
                  ) -> tuple[int | None, int | None, int | None]:
    """(limit, usage, oom_kill count) for the memory cgroup of ``pid``; None where unreadable.

    ``paths`` (from ``cgroup_paths``) may be passed to skip re-reading /proc/<pid>/cgroup.
    """
    v1, v2 = paths if paths is not None else cgroup_paths(pid)
    candidates = []  # (directory, limit file, usage file, file with the oom_kill line)
    if v1 is not None:
        for base in (os.path.join(_V1, v1.lstrip("/")), _V1):
            candidates.append((base, "memory.limit_in_bytes", "memory.usage_in_bytes", "memory.oom_control"))
    if v2 is not None:
        candidates.append((os.path.join(_V2, v2.lstrip("/")), "memory.max", "memory.current", "memory.events"))
    for base, limit_file, usage_file, events_file in candidates:
        limit = _read(os.path.join(base, limit_file))
        if limit is None:
            continue
        oom = None
        for line in (_read(os.path.join(base, events_file)) or "").splitlines():
            if line.startswith("oom_kill "):
                oom = _int(line.split()[1])
        return _int(limit), _int(_read(os.path.join(base, usage_file))), oom
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
    text = _read("/proc/vmstat") or ""
    idx = text.find("\noom_kill ")
    if idx < 0:
        return None
    return _int(text[idx + 10:].split("\n", 1)[0])


def read_system(pid: int, cgroup_paths: tuple[str | None, str | None] | None = None) -> SystemSample:
    mem = parse_kv_kib(_read("/proc/meminfo") or "", ("MemAvailable", "Mlocked"))
    total, free = shm_usage()
    limit, usage, ooms = cgroup_memory(pid, cgroup_paths)
    return SystemSample(ts=time.time(), mem_available=mem.get("MemAvailable"), mlocked=mem.get("Mlocked"),
                        shm_total=total, shm_free=free, shm_torch_files=torch_shm_files(),
                        cgroup_memory_limit=limit, cgroup_memory_usage=usage, cgroup_oom_kills=ooms,
                        vm_oom_kills=vm_oom_kills())


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
    return {"affinity": affinity, "cgroup_quota": round(quota, 3) if quota is not None else None,
            "cpu_count": os.cpu_count(), "usable": round(usable, 3) if usable is not None else None}
