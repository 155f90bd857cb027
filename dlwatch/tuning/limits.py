"""The machine's limits a candidate must fit in, read once when a tune starts, and the rules on them.

Memory: the smallest of MemAvailable, the room left under the cgroup's memory limit, and a
budget the caller imposes.  /dev/shm: its free space.  Descriptors: RLIMIT_NOFILE (soft).
A candidate is *stopped* while it runs when it reaches ``STOP_SHARE`` of a room (before the
kernel's OOM killer or an ENOSPC ends it less cleanly), and a finished row *fits* when its
peaks stayed within ``FIT_SHARE`` of every room.  Pure over the figures: the guard reads them.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from typing import Any

from dlwatch.collect import system
from dlwatch.model import SystemSample
from dlwatch.report import display

STOP_SHARE = 0.9  # a running candidate is stopped at 90% of a room
FIT_SHARE = 0.8  # a measured row fits when its peak stayed within 80% of every room
MACHINE_FLOOR_SHARE = 0.1  # stopped when the machine's MemAvailable falls under 10% of what it was


@dataclass(frozen=True)
class Machine:
    """The rooms at the start of the tune (bytes; None where unknown or unlimited)."""

    usable_cpus: float | None
    cpus: dict[str, Any]
    mem_available: int | None
    cgroup_limit: int | None
    cgroup_usage: int | None
    memory_budget: int | None
    shm_total: int | None
    shm_free: int | None
    shm_used: int | None
    fd_limit: int | None
    cuda_available: bool

    @property
    def memory_room(self) -> tuple[int | None, str | None]:
        """(bytes a candidate may use, what bounds it)."""
        rooms: list[tuple[int, str]] = []
        if self.mem_available is not None:
            rooms.append((self.mem_available, "MemAvailable"))
        if self.cgroup_limit is not None and self.cgroup_usage is not None:
            rooms.append((max(0, self.cgroup_limit - self.cgroup_usage), "the cgroup's memory limit"))
        if self.memory_budget is not None:
            rooms.append((self.memory_budget, "the memory budget"))
        if not rooms:
            return None, None
        return min(rooms)

    def to_dict(self) -> dict[str, Any]:
        room, source = self.memory_room
        return {
            "usable_cpus": self.usable_cpus,
            "cpus": dict(self.cpus),
            "mem_available": self.mem_available,
            "cgroup_memory_limit": self.cgroup_limit,
            "cgroup_memory_usage": self.cgroup_usage,
            "memory_budget": self.memory_budget,
            "memory_room": room,
            "memory_room_source": source,
            "shm_total": self.shm_total,
            "shm_free": self.shm_free,
            "fd_limit": self.fd_limit,
            "cuda_available": self.cuda_available,
        }


def _cuda_available() -> bool:
    import sys

    torch = sys.modules.get("torch")
    try:
        return bool(torch is not None and torch.cuda.is_available())
    except Exception:
        return False


def read_machine(sample: SystemSample, memory_budget: int | None) -> Machine:
    cpus = system.usable_cpus()
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fd_limit = None if soft == resource.RLIM_INFINITY else int(soft)
    except (OSError, ValueError):
        fd_limit = None
    used = sample.shm_total - sample.shm_free if sample.shm_total is not None and sample.shm_free is not None else None
    usable = cpus.get("usable")
    return Machine(
        usable_cpus=float(usable) if isinstance(usable, (int, float)) else None,
        cpus=dict(cpus),
        mem_available=sample.mem_available,
        cgroup_limit=sample.cgroup_memory_limit,
        cgroup_usage=sample.cgroup_memory_usage,
        memory_budget=memory_budget,
        shm_total=sample.shm_total,
        shm_free=sample.shm_free,
        shm_used=used,
        fd_limit=fd_limit,
        cuda_available=_cuda_available(),
    )


def human(n: float | None) -> str:
    return display.human_bytes(n)


def stop_reason(
    m: Machine, *, mem: int | None, shm: int | None, fds: int | None, fd_limit: int | None, now: SystemSample | None
) -> tuple[str, str] | None:
    """(limit, why) when a running candidate must be stopped now; None while it is within every room.

    ``mem``: the candidate's private memory now (its processes' USS, estimated between reads);
    ``shm``: /dev/shm used above what it was at the tune's start; ``fds``: the most open
    descriptors of one of its processes, against that process's ``fd_limit``."""
    room, source = m.memory_room
    if mem is not None and room is not None and room > 0 and mem >= STOP_SHARE * room:
        return "memory", f"its memory reached {human(mem)} of the {human(room)} {source} allowed"
    if now is not None:
        if (
            now.cgroup_memory_limit is not None
            and now.cgroup_memory_usage is not None
            and now.cgroup_memory_usage >= 0.95 * now.cgroup_memory_limit
            and (m.cgroup_usage is None or m.cgroup_usage < 0.95 * now.cgroup_memory_limit)
        ):
            return "memory", (
                f"the cgroup's memory use reached {human(now.cgroup_memory_usage)} "
                f"of its {human(now.cgroup_memory_limit)} limit"
            )
        if (
            m.mem_available
            and now.mem_available is not None
            and now.mem_available < MACHINE_FLOOR_SHARE * m.mem_available
        ):
            return "memory", f"the machine's MemAvailable fell to {human(now.mem_available)}"
    if shm is not None and m.shm_free and shm >= STOP_SHARE * m.shm_free:
        return "shm", f"/dev/shm filled to {human(shm)} of the {human(m.shm_free)} that were free"
    if fds is not None and fd_limit and fds >= STOP_SHARE * fd_limit:
        return "fds", f"a process reached {fds} open descriptors of its limit {fd_limit} (RLIMIT_NOFILE)"
    return None


def broken_limits(
    m: Machine, *, mem: int | None, shm: int | None, fds: int | None, fd_limit: int | None
) -> tuple[str, ...]:
    """The rooms a measured row's peaks did not fit in (FIT_SHARE of each)."""
    out = []
    room, _ = m.memory_room
    if mem is not None and room is not None and mem > FIT_SHARE * room:
        out.append("memory")
    if shm is not None and m.shm_free is not None and shm > FIT_SHARE * m.shm_free:
        out.append("shm")
    limit = fd_limit or m.fd_limit
    if fds is not None and limit and fds > FIT_SHARE * limit:
        out.append("fds")
    return tuple(out)
