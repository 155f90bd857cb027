"""Cost of the detectors' on_poll with 1+8 processes and a full history: ``python bench/detector_cost.py``.

Hand-built samples (no processes): what a poll adds for judging, not for reading /proc.
Prints microseconds per poll for all detectors when no new USS read arrived (the usual
poll), and for the memory detectors on the poll right after a USS read of every process.
"""

from __future__ import annotations

import collections
import json
import time
from typing import Any

from dlwatch import detect
from dlwatch.detect.base import View
from dlwatch.detect.memory_growth import WorkerMemoryGrowth
from dlwatch.detect.pinned_memory import PinnedMemoryGrowth
from dlwatch.model import ProcSample, SystemSample

MiB = 1 << 20


class _Proc:
    def __init__(self, pid: int, role: str, samples: list[ProcSample]) -> None:
        self.pid, self.role, self.worker_id, self.gone, self.crash, self.last_fds = pid, role, pid, False, None, None
        self.history = collections.deque(samples, maxlen=120)

    @property
    def last(self) -> ProcSample:
        return self.history[-1]


def _view() -> View:
    procs = {}
    for pid in range(9):
        hist = [
            ProcSample(
                pid=pid,
                ts=1000.0 + i,
                rss=500 * MiB,
                uss=300 * MiB,
                uss_ts=1000.0 + (i // 10) * 10,
                vm_lck=0,
                minflt=i,
                num_fds=40,
                fd_limit=1024,
            )
            for i in range(120)
        ]
        procs[pid] = _Proc(pid, "worker" if pid else "main", hist)
    system = SystemSample(
        ts=1119.0,
        mem_available=20 << 30,
        mlocked=10 * MiB,
        cgroup_memory_limit=1 << 30,
        cgroup_memory_usage=500 * MiB,
        cgroup_oom_kills=0,
    )
    return View(now=1119.0, procs=procs, loader=None, loader_pids=frozenset(), system=system, heartbeat=None)


def run(n: int = 2000) -> dict[str, Any]:
    view = _view()
    dets = detect.build({})
    for d in dets:
        list(d.on_poll(view))
    t0 = time.perf_counter()
    for _ in range(n):
        for d in dets:
            list(d.on_poll(view))
    out: dict[str, Any] = {"all_detectors_us": round((time.perf_counter() - t0) / n * 1e6, 1)}
    for cls in (WorkerMemoryGrowth, PinnedMemoryGrowth):
        t0 = time.perf_counter()
        for _ in range(n):
            list(cls().on_poll(view))  # a fresh detector: every process judged, as after a USS read
        out[f"{cls.__name__}_after_uss_read_us"] = round((time.perf_counter() - t0) / n * 1e6, 1)
    return out


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
