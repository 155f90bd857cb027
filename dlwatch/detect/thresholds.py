"""Pure threshold detectors: samples in, an evidence dict (a signal) or None out.

Nothing here reads the system or a playbook file: the thresholds are arguments
with defaults, and the caller passes the playbook's values
(``Playbook.threshold(name, default)``).  The monitor emits each returned dict as
a timeline event ``{"event": "threshold", **evidence}``; the matcher in
``dlwatch.detect.match`` reads those events back by their ``signal`` key.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Mapping, Sequence

from dlwatch.collect.growth import slope
from dlwatch.model import FdSummary, ProcSample, SystemSample

__all__ = [
    "FD_SHARE",
    "FD_HORIZON_S",
    "SHM_NEED_FACTOR",
    "fd_near_limit",
    "fd_pressure",
    "fd_trend",
    "held_shm_bytes",
    "inflight_shm_bytes",
    "shm_pressure",
]

FD_SHARE = 0.9  # share of the soft RLIMIT_NOFILE above which fds are "under pressure"
FD_HORIZON_S = 60.0  # a trend that reaches the limit sooner than this is pressure too
FD_MIN_RISE = 4  # fds the window must have grown by before a trend is believed
FD_MIN_POINTS = 3
FD_MIN_WINDOW_S = 2.0  # a trend needs this much history: workers open fds quickly while they start
FD_TREND_MIN_SHARE = 0.25  # ... and a count already this share of the limit
FD_AT_LIMIT_SHARE = 0.95  # "at or near the limit" (a stall or a bare EOFError is then fd exhaustion)
FD_AT_LIMIT_MARGIN = 4  # ... or within this many fds of it
SHM_NEED_FACTOR = 1.0  # free /dev/shm below need × this is pressure


def fd_trend(history: Sequence[ProcSample]) -> float | None:
    """Least-squares slope of num_fds over time, fds per second; None with < 2 usable points."""
    return slope([(s.ts, s.num_fds) for s in history if s.num_fds is not None and not s.gone])


def fd_pressure(
    history: Sequence[ProcSample],
    *,
    fd_share: float = FD_SHARE,
    horizon_s: float = FD_HORIZON_S,
    min_rise: float = FD_MIN_RISE,
    min_points: int = FD_MIN_POINTS,
    min_window_s: float = FD_MIN_WINDOW_S,
    trend_min_share: float = FD_TREND_MIN_SHARE,
) -> dict[str, Any] | None:
    """fds of one process above ``fd_share`` of its soft limit, or heading there within ``horizon_s``.

    ``history`` is the samples of one pid, oldest first.  The latest sample with both
    num_fds and fd_limit is judged; the trend needs ``min_points`` samples over at least
    ``min_window_s``, a rise of ``min_rise`` fds, and a count of ``trend_min_share`` of the
    limit, so a flat count (however high, if under the share), one-fd jitter and the
    burst of opens while a worker starts stay quiet.
    """
    usable = [s for s in history if s.num_fds is not None and not s.gone]
    latest = next((s for s in reversed(usable) if s.fd_limit), None)
    if latest is None or latest.num_fds is None or not latest.fd_limit or latest.fd_limit <= 0:
        return None
    limit, count = latest.fd_limit, latest.num_fds
    share = count / limit
    slope = fd_trend(usable) if len(usable) >= min_points else None
    rise = (count - min(s.num_fds for s in usable)) if usable else 0  # type: ignore[type-var]
    eta: float | None = None
    window_s = usable[-1].ts - usable[0].ts
    if slope is not None and slope > 0 and rise >= min_rise and window_s >= min_window_s and share >= trend_min_share:
        eta = max(0.0, (limit - count) / slope)
    if share >= fd_share:
        reason = "above_share"
    elif eta is not None and eta <= horizon_s:
        reason = "trend"
    else:
        return None
    return {
        "signal": "fd_pressure",
        "reason": reason,
        "pid": latest.pid,
        "ts": latest.ts,
        "num_fds": count,
        "fd_limit": limit,
        "fd_share": round(share, 4),
        "threshold_share": fd_share,
        "slope_fds_per_s": None if slope is None else round(slope, 3),
        "limit_in_s": None if eta is None else round(eta, 1),
        "horizon_s": horizon_s,
        "window_s": round(window_s, 3),
        "fds": latest.fds.to_dict() if latest.fds is not None else None,
    }


def fd_near_limit(
    num_fds: int | None, fd_limit: int | None, *, share: float = FD_AT_LIMIT_SHARE, margin: int = FD_AT_LIMIT_MARGIN
) -> bool:
    """At or near the soft limit: the state in which opens fail (EMFILE) or a feeder thread dies."""
    if num_fds is None or not fd_limit or fd_limit <= 0:
        return False
    return num_fds >= fd_limit - margin or num_fds / fd_limit >= share


def inflight_shm_bytes(batch_bytes: int | None, prefetch_factor: int | None, num_workers: int | None) -> int | None:
    """What the loader keeps in shared memory at once: batch bytes × prefetch_factor × num_workers.

    None when unknown; 0 with no workers (batches then never travel through /dev/shm).
    Both sharing strategies take this room in /dev/shm: under ``file_descriptor`` (the
    default) a segment is unlinked at once but its pages stay until the last fd and
    mapping go; under ``file_system`` it is a named ``torch_*`` file until then.
    """
    if num_workers is not None and num_workers <= 0:
        return 0
    if not batch_bytes or not num_workers:
        return None
    return int(batch_bytes) * int(prefetch_factor or 2) * int(num_workers)


def held_shm_bytes(procs: Iterable[tuple[ProcSample | None, FdSummary | None]]) -> int:
    """/dev/shm bytes this job already holds: per process, the larger of what it maps and holds by fd.

    ``procs`` is (latest sample, latest fd breakdown) of each live process of the job.
    Mappings cover both sharing strategies (``torch_* (deleted)`` segments and named
    files); fds cover segments received but not mapped yet.  A segment that two of the
    job's processes map counts twice: an upper bound, which :func:`shm_pressure` caps at
    the job's own need.
    """
    total = 0
    for sample, fds in procs:
        mapped = (sample.shm_map_bytes or 0) if sample is not None and not sample.gone else 0
        by_fd = (fds.shm_bytes or 0) if fds is not None else 0
        total += max(mapped, by_fd)
    return total


def shm_pressure(
    system: SystemSample,
    need_bytes: int | Mapping[str, Any] | None = None,
    *,
    held_bytes: int | Callable[[], int] = 0,
    need_factor: float = SHM_NEED_FACTOR,
) -> dict[str, Any] | None:
    """This job's batches in flight do not fit in /dev/shm: judged against the job's own need only.

    ``need_bytes`` is the in-flight need (see :func:`inflight_shm_bytes`), or the
    report's ``loader`` dict, from which it is computed when that has ``batch_bytes``.
    ``held_bytes`` is what this job's processes already hold there
    (:func:`held_shm_bytes`): those bytes are counted as used in ``shm_free`` but are
    the job's own batches in flight, which it reuses.  A callable is asked only when they
    could matter (free space below the need): the monitor sums them over every process.

    - ``smaller_than_need``: /dev/shm is smaller in total than the need;
    - ``free_below_need``: free space plus what the job holds (at most its need) is
      less than the need.

    Nothing else fires: a /dev/shm that is small, or nearly full of another tenant's
    files, is fine for a job whose need fits; with ``num_workers=0`` the need is 0
    (batches never travel through /dev/shm); an unknown need (no batch measured yet)
    proves nothing.
    """
    loader: Mapping[str, Any] = {}
    if isinstance(need_bytes, Mapping):
        loader = need_bytes
        need_bytes = inflight_shm_bytes(
            loader.get("batch_bytes"), loader.get("prefetch_factor"), loader.get("num_workers")
        )
    total, free = system.shm_total, system.shm_free
    if not total or total <= 0 or free is None or not need_bytes or need_bytes <= 0:
        return None
    need = int(need_bytes * need_factor)
    if callable(held_bytes):
        held_bytes = held_bytes() if free < need else 0  # with free >= need, what is held changes nothing
    held = max(0, int(held_bytes or 0))
    available = free + min(held, need)
    if total < need:
        reason = "smaller_than_need"
    elif available < need:
        reason = "free_below_need"
    else:
        return None
    ev: dict[str, Any] = {
        "signal": "shm_pressure",
        "reason": reason,
        "ts": system.ts,
        "shm_total": total,
        "shm_free": free,
        "free_share": round(free / total, 4),
        "need_bytes": need_bytes,
        "held_bytes": held,
        "available_bytes": available,
        "shm_torch_files": system.shm_torch_files,
    }
    if loader.get("sharing_strategy"):
        ev["sharing_strategy"] = loader.get("sharing_strategy")
    return ev
