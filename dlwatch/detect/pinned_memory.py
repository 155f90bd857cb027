"""The ``pinned-memory-growth`` failure: locked (pinned) memory of the job rising steadily.

Pinned host memory (``pin_memory=True`` buffers, a cache of pinned tensors) is locked
memory: the host's ``Mlocked`` (/proc/meminfo, every poll) and each process's
``VmLck`` (with its soft RLIMIT_MEMLOCK, at the USS cadence).  A finding needs a
watched process that holds locked memory (another user's mlock on a shared host is
not this job's), and either Mlocked growing steadily (see
:func:`dlwatch.collect.growth.steady_growth`) or a process's VmLck rising to
``limit_share`` of its RLIMIT_MEMLOCK.  A near limit (RLIMIT_MEMLOCK, the cgroup's, MemAvailable)
within ``horizon_s`` (locked pages count toward the cgroup's memory too) is a ``threshold`` incident; a far one is advice for the run
summary.  Flat locked memory, however large, stays quiet.
"""

from __future__ import annotations

import collections
from typing import Any, Iterable

from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import last_signal_evidence
from dlwatch.detect.registry import Failure
from dlwatch.collect.growth import steady_growth, time_to_limit


class PinnedMemoryGrowth(Detector):
    playbook = "pinned-memory-growth"
    defaults = {
        "min_rate_bytes_per_s": float(1 << 20),
        "min_rise_bytes": float(64 << 20),
        "min_window_s": 8.0,
        "window_s": 120.0,
        "horizon_s": 900.0,
        "limit_share": 0.9,
    }

    def __init__(self, thresholds: Any = None) -> None:
        super().__init__(thresholds)
        self.mlocked: collections.deque[tuple[float, float]] = collections.deque(maxlen=600)
        self.advised = False
        self.lockers: dict[int, tuple[float, dict[str, Any] | None]] = {}  # pid -> (last USS read, its view)

    def _lockers(self, view: View) -> list[dict[str, Any]]:
        """Watched processes holding locked memory, with how much it rose in the window."""
        out = []
        for p in view.procs.values():
            last = p.last
            if last is None or last.uss_ts is None:
                continue
            cached = self.lockers.get(p.pid)
            if cached is not None and cached[0] == last.uss_ts:  # no new read since: same view
                if cached[1] is not None:
                    out.append(dict(cached[1], gone=p.gone))
                continue
            self.lockers[p.pid] = (last.uss_ts, None)
            if not last.vm_lck and (cached is None or cached[1] is None):
                continue  # holds no locked memory, and held none at the last read
            reads = {
                s.uss_ts: s
                for s in p.history
                if s.uss_ts is not None and s.vm_lck is not None and view.now - s.uss_ts <= self.thresholds["window_s"]
            }
            if not reads:
                continue
            pts = sorted(reads.values(), key=lambda s: s.uss_ts)
            last = pts[-1]
            if not last.vm_lck:
                continue
            found = {
                "pid": p.pid,
                "role": p.role,
                "worker_id": p.worker_id,
                "gone": p.gone,
                "vm_lck": last.vm_lck,
                "vm_lck_rise": last.vm_lck - min(s.vm_lck for s in pts),
                "memlock_limit": last.memlock_limit,
                "memlock_share": round(last.vm_lck / last.memlock_limit, 4) if last.memlock_limit else None,
            }
            self.lockers[p.pid] = (last.uss_ts, found)
            out.append(found)
        if len(self.lockers) > 4 * len(view.procs) + 64:
            self.lockers = {pid: v for pid, v in self.lockers.items() if pid in view.procs}
        return out

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        t = self.thresholds
        sysm = view.system
        if sysm is not None and sysm.mlocked is not None:
            self.mlocked.append((sysm.ts, float(sysm.mlocked)))
        lockers = [x for x in self._lockers(view) if not x["gone"]]
        if not lockers:
            return ()
        pts = [pt for pt in self.mlocked if view.now - pt[0] <= t["window_s"]]
        g = steady_growth(
            pts, min_rate=t["min_rate_bytes_per_s"], min_rise=t["min_rise_bytes"], min_window_s=t["min_window_s"]
        )
        near = [
            x
            for x in lockers
            if x["memlock_share"] is not None and x["memlock_share"] >= t["limit_share"] and x["vm_lck_rise"] > 0
        ]
        rising = [x for x in lockers if x["vm_lck_rise"] > 0]
        if g is None and not near:
            return ()
        if g is not None and not rising and not near:
            return ()  # the host's locked memory grows, but not in this job's processes
        options = []
        if sysm is not None and sysm.mem_available is not None:
            options.append((sysm.mem_available, "MemAvailable"))
        if sysm is not None and sysm.cgroup_memory_limit and sysm.cgroup_memory_usage is not None:
            options.append((max(0, sysm.cgroup_memory_limit - sysm.cgroup_memory_usage), "cgroup memory limit"))
        for x in rising:
            if x["memlock_limit"]:
                options.append((max(0, x["memlock_limit"] - x["vm_lck"]), f"RLIMIT_MEMLOCK of pid {x['pid']}"))
        left, limit_name = min(options, key=lambda o: o[0]) if options else (None, None)
        eta = time_to_limit(left, g["rate_bytes_per_s"]) if g is not None else None
        evidence: dict[str, Any] = {
            "signal": "pinned_memory_growth",
            "mlocked": sysm.mlocked if sysm is not None else None,
            "growth": g,
            "lockers": lockers[:8],
            "headroom_bytes": left,
            "limit": limit_name,
            "limit_in_s": None if eta is None else round(eta, 1),
            "horizon_s": t["horizon_s"],
        }
        if near:
            return [{"ts": view.now, "event": "threshold", "reason": "near_memlock_limit", **evidence}]
        if eta is not None and eta <= t["horizon_s"]:
            return [{"ts": view.now, "event": "threshold", "reason": "limit_soon", **evidence}]
        if self.advised:
            return ()
        self.advised = True
        evidence.pop("signal")
        return [
            {
                "ts": view.now,
                "event": "advice",
                "playbook": self.playbook,
                "advice": "pinned_memory_growth",
                "reason": "limit_far" if eta is not None else "no_limit_known",
                **evidence,
            }
        ]


FAILURE = Failure(
    playbook=PinnedMemoryGrowth.playbook,
    detectors=(PinnedMemoryGrowth,),
    enrich=last_signal_evidence("pinned_memory_growth"),  # the growth fit, the limit and when it is reached
    evidence_forms={
        "mlocked": "bytes",
        "growth": "growth",
        "lockers": "table",
        "limit": "text",
        "limit_in_s": "seconds",
    },
    examples=("pinned_growth",),
)
