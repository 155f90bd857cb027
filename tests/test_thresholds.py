"""Pure threshold detectors on hand-built samples, with their boundaries."""

from __future__ import annotations

from hypothesis import given, strategies as st

from dlwatch.detect.thresholds import (
    fd_near_limit,
    fd_pressure,
    fd_trend,
    held_shm_bytes,
    inflight_shm_bytes,
    shm_pressure,
)
from dlwatch.model import FdSummary, ProcSample, SystemSample

MiB = 1024 * 1024


def hist(counts: list[int], limit: int = 1024, dt: float = 1.0, pid: int = 7) -> list[ProcSample]:
    return [ProcSample(pid=pid, ts=100.0 + i * dt, num_fds=c, fd_limit=limit) for i, c in enumerate(counts)]


def test_just_under_the_share_is_quiet() -> None:
    # 921/1024 = 0.8994 < 0.9, flat: no trend either
    assert fd_pressure(hist([921, 921, 921])) is None


def test_at_the_share_fires() -> None:
    ev = fd_pressure(hist([922, 922, 922]))  # 922/1024 = 0.9004
    assert ev is not None and ev["reason"] == "above_share"
    assert ev["pid"] == 7 and ev["num_fds"] == 922 and ev["fd_limit"] == 1024 and ev["signal"] == "fd_pressure"


def test_flat_high_but_stable_is_quiet() -> None:
    assert fd_pressure(hist([800] * 20)) is None


def test_single_sample_under_share_is_quiet() -> None:
    assert fd_pressure(hist([900])) is None


def test_trend_reaching_limit_within_horizon_fires() -> None:
    # +20 fds/s from 500: (1024-560)/20 = 23.2 s to the limit
    ev = fd_pressure(hist([500, 520, 540, 560]))
    assert ev is not None and ev["reason"] == "trend"
    assert abs(ev["slope_fds_per_s"] - 20.0) < 1e-6 and abs(ev["limit_in_s"] - 23.2) < 0.05


def test_trend_beyond_horizon_is_quiet() -> None:
    # +2 fds/s from 100: ~460 s away
    assert fd_pressure(hist([100, 102, 104, 106])) is None
    # ... unless the horizon is longer (thresholds come from the playbook)
    assert fd_pressure(hist([300, 302, 304, 306]), horizon_s=1000)["reason"] == "trend"


def test_worker_startup_burst_is_quiet() -> None:
    # a worker opening 20 fds in its first half second is starting, not leaking
    assert fd_pressure(hist([10, 20, 30], dt=0.2)) is None  # window 0.4 s < min_window_s
    # a steady climb at a low count: not yet (trend_min_share), but the limit is a parameter
    assert fd_pressure(hist([30, 60, 90, 120], dt=1.0)) is None
    assert fd_pressure(hist([30, 60, 90, 120]), trend_min_share=0.0)["reason"] == "trend"


def test_small_limit_leak_is_seen_before_the_crash() -> None:
    # limit 128 (the fd example), +18 fds/s: seen at 36 fds, 5 s before the limit
    ev = fd_pressure(hist([0, 9, 18, 27, 36, 45], limit=128, dt=0.5))
    assert ev is not None and ev["reason"] == "trend" and ev["limit_in_s"] < 10


def test_too_few_points_or_jitter_is_quiet() -> None:
    assert fd_pressure(hist([500, 560])) is None  # 2 points < min_points
    assert fd_pressure(hist([1000, 1001, 1002]), fd_share=0.99) is None  # rise 2 < min_rise 4
    assert fd_pressure(hist([600, 610, 600, 610, 600])) is None  # no net trend


def test_share_threshold_is_a_parameter() -> None:
    assert fd_pressure(hist([512] * 3), fd_share=0.5)["reason"] == "above_share"
    assert fd_pressure(hist([511] * 3), fd_share=0.5) is None


def test_missing_figures_are_quiet() -> None:
    assert fd_pressure([]) is None
    assert fd_pressure([ProcSample(pid=1, ts=1.0, num_fds=10)]) is None  # no limit read
    assert fd_pressure([ProcSample(pid=1, ts=1.0, num_fds=1000, fd_limit=1024, gone=True)]) is None


def test_fds_breakdown_is_carried() -> None:
    s = ProcSample(pid=3, ts=1.0, num_fds=1020, fd_limit=1024, fds=FdSummary(file=1000, pipe=4))
    ev = fd_pressure([s])
    assert ev["fds"]["file"] == 1000


def test_trend_slope() -> None:
    assert fd_trend(hist([1, 3, 5])) == 2.0
    assert fd_trend(hist([1])) is None
    assert fd_trend([ProcSample(pid=1, ts=5.0, num_fds=1), ProcSample(pid=1, ts=5.0, num_fds=9)]) is None


def test_near_limit() -> None:
    assert fd_near_limit(1022, 1024)  # where torch's feeder thread dies: limit minus 2
    assert fd_near_limit(61, 64)
    assert not fd_near_limit(900, 1024)
    assert not fd_near_limit(None, 1024) and not fd_near_limit(10, None) and not fd_near_limit(10, 0)


@given(st.integers(1, 100_000), st.floats(0.05, 0.99))
def test_flat_under_share_never_fires(limit: int, share: float) -> None:
    count = int(limit * share) - 1
    if count < 0:
        return
    assert fd_pressure(hist([count] * 5, limit=limit), fd_share=share) is None


# --------------------------------------------------------------------------- shm


def sysample(total: int | None, free: int | None, files: int | None = None) -> SystemSample:
    return SystemSample(ts=5.0, shm_total=total, shm_free=free, shm_torch_files=files)


def test_inflight_need() -> None:
    assert inflight_shm_bytes(10 * MiB, 2, 4) == 80 * MiB
    assert inflight_shm_bytes(10 * MiB, None, 4) == 80 * MiB  # torch's default prefetch_factor is 2
    assert inflight_shm_bytes(10 * MiB, 2, 0) == 0
    assert inflight_shm_bytes(None, 2, 4) is None


def test_shm_healthy_is_quiet() -> None:
    assert shm_pressure(sysample(64 * MiB, 60 * MiB), need_bytes=8 * MiB) is None
    assert shm_pressure(sysample(64 * MiB, 60 * MiB)) is None


def test_shm_nearly_full_of_another_tenant_is_quiet_while_the_need_fits() -> None:
    # 2 % free: another tenant's files; this job needs 1 MiB in flight
    assert shm_pressure(sysample(100 * MiB, 2 * MiB), need_bytes=1 * MiB) is None
    assert shm_pressure(sysample(100 * MiB, 2 * MiB, files=500), need_bytes=2 * MiB) is None  # exactly fits
    assert shm_pressure(sysample(100 * MiB, 2 * MiB), need_bytes=2 * MiB + 1)["reason"] == "free_below_need"
    # full, and the need unknown (no batch measured yet): no proof of anything
    assert shm_pressure(sysample(100 * MiB, 0)) is None
    assert shm_pressure(sysample(100 * MiB, 0), {"num_workers": 2, "prefetch_factor": 2}) is None


def test_shm_num_workers_zero_needs_nothing() -> None:
    loader = {"batch_bytes": 64 * MiB, "prefetch_factor": None, "num_workers": 0}
    assert shm_pressure(sysample(4 * MiB, 0), loader) is None  # tiny and full: batches never go there


def test_shm_counts_what_this_job_holds() -> None:
    # the job's own 3 in-flight batches of 4 MiB already take 12 of the 16 MiB used; 4 MiB free
    loader = {"batch_bytes": 4 * MiB, "prefetch_factor": 2, "num_workers": 2, "sharing_strategy": "file_system"}
    assert shm_pressure(sysample(20 * MiB, 4 * MiB), loader) is not None  # without what it holds: 4 < 16
    assert shm_pressure(sysample(20 * MiB, 4 * MiB), loader, held_bytes=12 * MiB) is None
    ev = shm_pressure(sysample(20 * MiB, 4 * MiB), loader, held_bytes=11 * MiB)
    assert ev["reason"] == "free_below_need" and ev["available_bytes"] == 15 * MiB
    assert ev["held_bytes"] == 11 * MiB and ev["need_bytes"] == 16 * MiB and ev["sharing_strategy"] == "file_system"
    # it holds 60 MiB (batches it keeps, and its in-flight ones): only the need counts as room it reuses
    assert shm_pressure(sysample(64 * MiB, 1 * MiB), loader, held_bytes=60 * MiB) is None  # 1 + 16 >= 16
    ev = shm_pressure(sysample(64 * MiB, 0), loader, held_bytes=60 * MiB)
    assert ev is None  # 0 + 16: its next batches go where its last ones were
    ev = shm_pressure(sysample(64 * MiB, 0), loader, held_bytes=10 * MiB)
    assert ev["reason"] == "free_below_need" and ev["available_bytes"] == 10 * MiB


def test_held_shm_bytes_from_samples() -> None:
    from dlwatch.model import FdSummary, ProcSample

    main = ProcSample(pid=1, ts=1.0, shm_map_bytes=6 * MiB)
    worker = ProcSample(pid=2, ts=1.0, shm_map_bytes=1 * MiB)
    gone = ProcSample(pid=3, ts=1.0, gone=True, shm_map_bytes=50 * MiB)
    fds = FdSummary(shm=3, shm_bytes=3 * MiB)
    assert held_shm_bytes([(main, None), (worker, fds), (gone, None), (None, None)]) == 9 * MiB
    assert held_shm_bytes([(ProcSample(pid=4, ts=1.0), None)]) == 0  # not read yet (slow cadence)


def test_shm_smaller_than_need() -> None:
    ev = shm_pressure(sysample(64 * MiB, 64 * MiB), need_bytes=96 * MiB)
    assert ev["reason"] == "smaller_than_need" and ev["need_bytes"] == 96 * MiB and ev["signal"] == "shm_pressure"
    assert (
        shm_pressure(sysample(64 * MiB, 64 * MiB), need_bytes=96 * MiB, held_bytes=96 * MiB)["reason"]
        == "smaller_than_need"
    )  # holding it cannot make /dev/shm bigger
    assert shm_pressure(sysample(256 * MiB, 50 * MiB), need_bytes=96 * MiB)["reason"] == "free_below_need"


def test_shm_takes_loader_dict() -> None:
    loader = {"batch_bytes": 16 * MiB, "prefetch_factor": 2, "num_workers": 4}
    assert shm_pressure(sysample(64 * MiB, 64 * MiB), loader)["reason"] == "smaller_than_need"
    assert shm_pressure(sysample(64 * MiB, 64 * MiB), {"num_workers": 4}) is None


def test_shm_detector_reads_the_job_from_the_view() -> None:
    from types import SimpleNamespace

    from dlwatch.detect.base import View
    from dlwatch.detect.shm import ShmPressure
    from dlwatch.model import ProcSample

    def view(shm_map_bytes: int, gone: bool = False) -> View:
        t = SimpleNamespace(gone=gone, last=ProcSample(pid=1, ts=1.0, shm_map_bytes=shm_map_bytes), last_fds=None)
        loader = {"batch_bytes": 2 * MiB, "prefetch_factor": 2, "num_workers": 2}
        return View(
            now=2.0,
            procs={1: t},
            loader=loader,
            loader_pids=frozenset(),
            system=sysample(32 * MiB, 4 * MiB),
            heartbeat=None,
        )

    det = ShmPressure({"need_factor": 1.0, "free_share": 0.5})  # an old playbook's free_share is ignored
    assert list(det.on_poll(view(4 * MiB))) == []  # 4 free + 4 held = 8 MiB = the need
    (ev,) = det.on_poll(view(4 * MiB, gone=True))
    assert ev["event"] == "threshold" and ev["reason"] == "free_below_need" and ev["held_bytes"] == 0


def test_shm_unknown_is_quiet() -> None:
    assert shm_pressure(sysample(None, None)) is None
    assert shm_pressure(sysample(0, 0)) is None
