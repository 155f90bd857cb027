"""The ``worker-memory-growth`` failure: DataLoader workers whose private memory grows with every sample.

Each worker's USS (private pages; the monitor reads it every 10 s, and every 2 s for
a process faulting in pages) is judged by :func:`dlwatch.collect.growth.steady_growth`,
over the reads taken after the loop had its first batch from every worker (start-up,
a fresh interpreter importing torch, is not growth).
What is judged is the part of USS a copy or a leak grows: the pages the worker alone maps
*and wrote* (``private_dirty``: anonymous memory, copy-on-write copies, shmem it filled).  The
pages it alone maps and only read (``private_clean``: nearly all page cache of a file it
memory-maps, as a ``datasets``/numpy-memmap dataset does) rise with every new page it touches
too, but they are reclaimable cache, never a copy: they are shown apart and never judged.
The copy-on-read signature is that private memory rising while RSS stays flat (shared pages of
the parent's dataset turning private as the worker touches them), in every worker alike.
The time to the memory limit (the cgroup's limit less its usage, or MemAvailable,
whichever is nearer) is projected from the workers' summed growth: within
``horizon_s`` it is a ``threshold`` incident, before the OOM killer acts; beyond that
it is advice (``{"event": "advice", "playbook": "worker-memory-growth", ...}``) for the
run summary, once per run.
"""

from __future__ import annotations

from typing import Any, Iterable

from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import last_signal_evidence
from dlwatch.detect.registry import Failure
from dlwatch.collect.growth import slope, steady_growth, time_to_limit
from dlwatch.model import ProcSample, SystemSample

MAX_SHOWN = 8


def headroom(system: SystemSample | None) -> tuple[int | None, str | None, int | None]:
    """(bytes left before the nearest memory limit, which limit, the limit itself)."""
    if system is None:
        return None, None, None
    options = []
    if system.cgroup_memory_limit and system.cgroup_memory_usage is not None:
        options.append(
            (system.cgroup_memory_limit - system.cgroup_memory_usage, "cgroup memory limit", system.cgroup_memory_limit)
        )
    if system.mem_available is not None:
        options.append((system.mem_available, "MemAvailable", None))
    if not options:
        return None, None, None
    left, name, limit = min(options, key=lambda o: o[0])
    return max(0, left), name, limit


def _judged(s: ProcSample) -> int | None:
    """The figure a copy or a leak grows: private dirty pages where read, else (older readers) USS."""
    return s.private_dirty if s.private_dirty is not None else s.uss


class WorkerMemoryGrowth(Detector):
    playbook = "worker-memory-growth"
    defaults = {
        "min_rate_bytes_per_s": float(1 << 20),
        "min_rise_bytes": float(64 << 20),
        "min_window_s": 8.0,
        "window_s": 120.0,
        "horizon_s": 900.0,
        "flat_rss_share": 0.3,
        "min_observed_share": 0.1,
    }

    def __init__(self, thresholds: Any = None) -> None:
        super().__init__(thresholds)
        self.advised = False
        self.judged: dict[int, tuple[float, dict[str, Any] | None]] = {}  # pid -> (last USS read, its growth)
        self.first_epoch: dict[int, int] = {}  # pid -> the epoch (heartbeat) in which it was first seen
        self.ready: dict[int, float] = {}  # pid -> when the loop had its first batches from its generation

    def _ready_since(self, pid: int, view: View, n_workers: int) -> float | None:
        """When this worker's generation had delivered its first batches (None: not yet, or unknown).

        Start-up is not growth: a spawned worker importing torch on a loaded machine climbs
        steadily for seconds (45 -> 245 MB in 8 s measured) before its first sample.  Its
        memory is judged from the poll at which the loop had one batch per worker in the
        worker's epoch (torch hands batches out in order, one from each worker in turn), or
        a later epoch began (persistent workers).
        """
        if pid in self.ready:
            return self.ready[pid]
        hb = view.heartbeat
        if hb is None:
            return None  # no loop progress known: nothing tells start-up from growth
        first = self.first_epoch.setdefault(pid, hb.epochs)
        num_workers = (view.loader or {}).get("num_workers")
        need = num_workers if isinstance(num_workers, int) and num_workers > 0 else n_workers
        if hb.epochs > first or hb.epoch_batches >= max(1, need):
            self.ready[pid] = view.now
            return view.now
        return None

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        t = self.thresholds
        growing = []
        workers = [p for p in view.procs.values() if p.role == "worker" and not p.gone]
        for p in workers:
            since = self._ready_since(p.pid, view, len(workers))
            if since is None:
                continue
            last = p.last
            if last is None or last.uss_ts is None:
                continue
            cached = self.judged.get(p.pid)
            if cached is not None and cached[0] == last.uss_ts:  # no new USS read since: same judgement
                if cached[1] is not None:
                    growing.append(cached[1])
                continue
            self.judged[p.pid] = (last.uss_ts, None)
            reads = {}
            for s in p.history:  # one point per USS read (the monitor carries the figure forward between reads)
                if (
                    s.uss_ts is not None
                    and _judged(s) is not None
                    and not s.gone
                    and s.uss_ts >= since  # after its first batches: start-up is not growth
                    and view.now - s.uss_ts <= t["window_s"]
                ):
                    reads[s.uss_ts] = s
            if len(reads) < 4:
                continue
            pts = sorted(reads.values(), key=lambda s: s.uss_ts)
            g = steady_growth(
                [(s.uss_ts, float(_judged(s))) for s in pts],  # type: ignore[arg-type]
                min_rate=t["min_rate_bytes_per_s"],
                min_rise=t["min_rise_bytes"],
                min_window_s=t["min_window_s"],
            )
            if g is None:
                continue
            rss = [(s.uss_ts, float(s.rss)) for s in pts if s.rss is not None]
            rss_rate = slope(rss) if len(rss) >= 2 else None
            found = {
                "pid": p.pid,
                "worker_id": p.worker_id,
                "uss": g,  # the fit of what was judged: private_dirty where it was read, else USS
                "judged": "private_dirty" if pts[-1].private_dirty is not None else "uss",
                "uss_first": pts[0].uss,
                "uss_last": pts[-1].uss,
                # file pages only this worker maps (reclaimable cache): shown, never judged
                "file_backed_first": pts[0].private_clean,
                "file_backed_last": pts[-1].private_clean,
                "rss_first": pts[0].rss,
                "rss_last": pts[-1].rss,
                "rss_rate_bytes_per_s": None if rss_rate is None else round(rss_rate),
            }
            self.judged[p.pid] = (last.uss_ts, found)
            growing.append(found)
        if len(self.judged) > 4 * max(1, len(workers)) + 64:  # forget workers long gone
            live = {p.pid for p in workers}
            self.judged = {pid: v for pid, v in self.judged.items() if pid in live}
        if len(self.first_epoch) > 4 * max(1, len(workers)) + 64:
            live = {p.pid for p in workers}
            self.first_epoch = {pid: v for pid, v in self.first_epoch.items() if pid in live}
            self.ready = {pid: v for pid, v in self.ready.items() if pid in live}
        if not growing:
            return ()
        rate = sum(g["uss"]["rate_bytes_per_s"] for g in growing)
        left, limit_name, limit = headroom(view.system)
        eta = time_to_limit(left, rate)
        cor = all(
            g["rss_rate_bytes_per_s"] is not None
            and g["rss_rate_bytes_per_s"] <= t["flat_rss_share"] * g["uss"]["rate_bytes_per_s"]
            for g in growing
        )
        evidence: dict[str, Any] = {
            "signal": "worker_memory_growth",
            "workers_growing": len(growing),
            "workers": len(workers),
            # USS up with RSS flat can only be shared pages turning private: the signature holds per
            # worker; the other workers may still lack the USS reads to be judged
            "copy_on_read": bool(cor),
            "all_workers_growing": len(growing) == len(workers),
            "rate_bytes_per_s": rate,
            "headroom_bytes": left,
            "limit": limit_name,
            "limit_bytes": limit,
            "limit_in_s": None if eta is None else round(eta, 1),
            "horizon_s": t["horizon_s"],
            "growth": growing[:MAX_SHOWN],
        }
        if view.system is not None:
            evidence["mem_available"] = view.system.mem_available
            evidence["cgroup_memory_usage"] = view.system.cgroup_memory_usage
        if eta is not None and eta <= t["horizon_s"]:
            # A projection is only as good as the trend behind it: 10 s of growth says little about
            # the next 10 minutes.  Wait until the trend was watched for a share of the time it
            # projects (a real leak keeps growing and gets there well before the limit).
            observed_s = max(g["uss"]["window_s"] for g in growing)
            evidence["observed_s"] = observed_s
            if observed_s < t["min_observed_share"] * eta:
                return ()
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
                "advice": "worker_memory_growth",
                "reason": "limit_far" if eta is not None else "no_limit_known",
                **evidence,
            }
        ]


FAILURE = Failure(
    playbook=WorkerMemoryGrowth.playbook,
    detectors=(WorkerMemoryGrowth,),
    enrich=last_signal_evidence("worker_memory_growth"),  # the growth fit, the limit and when it is reached
    evidence_forms={
        "workers_growing": "count",
        "copy_on_read": "text",
        "all_workers_growing": "text",
        "rate_bytes_per_s": "text",
    },
    examples=("copy_on_read",),
)
