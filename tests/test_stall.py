"""Stall detection logic on hand-built heartbeats (the real hangs are in test_hang.py)."""

from __future__ import annotations

from dlwatch.detect.stall import (
    ADAPTIVE_FLOOR_S,
    BODY_BLOCKED_S,
    BODY_FLOOR_S,
    FIRST_BATCH_S,
    Activity,
    StallDetector,
    stall_site,
)
from dlwatch.wire.heartbeat import STATE_BODY, STATE_OUTSIDE, STATE_WAITING, Heartbeat


def hb(batches, state, ts_last, ts_wait, epoch_batches=None, interval=0.0, epochs=1):
    return Heartbeat(
        batches=batches,
        epoch_batches=batches if epoch_batches is None else epoch_batches,
        epochs=epochs,
        state=state,
        pid=1,
        ts_last_batch=ts_last,
        ts_wait_start=ts_wait,
        total_wait_s=0.0,
        total_step_s=0.0,
        last_interval_s=interval,
    )


def test_explicit_timeout_applies_to_the_first_batch_too():
    d = StallDetector(2.0)
    assert d.update(hb(0, STATE_WAITING, 0.0, 100.0), 101.0) is None
    ev = d.update(hb(0, STATE_WAITING, 0.0, 100.0), 102.5)
    assert ev is not None and ev.kind == "stall" and ev.first_batch and ev.timeout_s == 2.0


def test_adaptive_first_batch_allowance_then_floor():
    d = StallDetector(None)
    assert d.update(hb(0, STATE_WAITING, 0.0, 100.0), 100.0 + ADAPTIVE_FLOOR_S + 1) is None  # start-up
    ev = d.update(hb(0, STATE_WAITING, 0.0, 100.0), 100.0 + FIRST_BATCH_S + 1)
    assert ev.kind == "stall" and ev.timeout_s == FIRST_BATCH_S
    d = StallDetector(None)
    d.update(hb(5, STATE_BODY, 200.0, 199.9, interval=0.1), 200.0)
    assert d.update(hb(5, STATE_WAITING, 200.0, 200.05), 200.0 + ADAPTIVE_FLOOR_S - 1) is None
    ev = d.update(hb(5, STATE_WAITING, 200.0, 200.05), 200.0 + ADAPTIVE_FLOOR_S + 1)
    assert ev.kind == "stall" and ev.timeout_s == ADAPTIVE_FLOOR_S and not ev.first_batch


def test_adaptive_grows_with_a_slow_healthy_model():
    d = StallDetector(None)
    t = 1000.0
    for i in range(1, 50):  # 30 s a batch: slow, healthy
        t += 30.0
        assert d.update(hb(i, STATE_BODY, t, t - 1, interval=30.0), t) is None
    assert d.timeout(False) == 300.0  # 10 x p99
    assert d.update(hb(49, STATE_WAITING, t, t - 1), t + 120) is None  # 2 minutes: not a stall for this model
    assert d.update(hb(49, STATE_WAITING, t, t - 1), t + 301).kind == "stall"


def test_one_event_per_stall_and_resume_is_reported():
    d = StallDetector(1.0)
    d.update(hb(3, STATE_BODY, 10.0, 9.9), 10.0)
    assert d.update(hb(3, STATE_WAITING, 10.0, 10.1), 11.5).kind == "stall"
    for t in (12.0, 20.0, 100.0):  # a long stall: no flood
        assert d.update(hb(3, STATE_WAITING, 10.0, 10.1), t) is None
    ev = d.update(hb(4, STATE_BODY, 101.0, 10.1, interval=91.0), 101.0)
    assert ev.kind == "resumed" and ev.stall_s >= 90
    assert d.update(hb(4, STATE_WAITING, 101.0, 101.1), 102.5).kind == "stall"  # a new stall is a new event


def test_outside_the_loop_is_never_a_stall():
    d = StallDetector(1.0)
    d.update(hb(3, STATE_BODY, 10.0, 9.9), 10.0)
    assert d.update(hb(3, STATE_OUTSIDE, 10.0, 9.9), 500.0) is None  # validation between epochs
    assert d.update(None, 600.0) is None


# --------------------------------------------------------------------------- the loop body


def test_stall_timeout_is_for_data_only_a_body_pause_has_its_own_allowance():
    d = StallDetector(2.0)  # an explicit stall_timeout: the data wait allowance
    d.update(hb(5, STATE_BODY, 100.0, 99.9), 100.0)
    busy = Activity(cpu_s=10.0, busy=True)
    for t in (103.0, 175.0, 600.0):  # a 75 s evaluation, a 10 min checkpoint: quiet
        assert d.update(hb(5, STATE_BODY, 100.0, 99.9), t, busy) is None
    ev = d.update(hb(5, STATE_BODY, 100.0, 99.9), 100.0 + BODY_FLOOR_S + 1, busy)
    assert ev.kind == "stall" and ev.allowance == "body" and ev.timeout_s == BODY_FLOOR_S


def test_data_wait_after_a_long_body_pause_counts_from_the_end_of_the_body():
    d = StallDetector(2.0)
    d.update(hb(5, STATE_BODY, 100.0, 99.9), 100.0)
    assert d.update(hb(5, STATE_BODY, 100.0, 99.9), 175.0, Activity(busy=True)) is None
    assert d.update(hb(5, STATE_WAITING, 100.0, 99.9), 175.5) is None  # not 75 s of waiting for data
    ev = d.update(hb(5, STATE_WAITING, 100.0, 99.9), 177.5)
    assert ev.kind == "stall" and ev.allowance == "data" and 2.0 <= ev.stall_s <= 3.0


def test_explicit_body_timeout_applies_to_any_body_pause():
    d = StallDetector(None, body_timeout=5.0)
    d.update(hb(5, STATE_BODY, 100.0, 99.9), 100.0)
    assert d.update(hb(5, STATE_BODY, 100.0, 99.9), 104.0, Activity(cpu_s=1.0, busy=True)) is None
    ev = d.update(hb(5, STATE_BODY, 100.0, 99.9), 105.5, Activity(cpu_s=9.0, busy=True))
    assert ev.kind == "stall" and ev.allowance == "body" and ev.timeout_s == 5.0


T0 = 1000.0


def test_body_allowance_grows_from_the_pauses_the_run_has_shown():
    d = StallDetector(None)
    d.update(hb(5, STATE_BODY, T0, T0 - 0.1), T0)
    for t in range(10, 1200, 10):  # a 20-minute evaluation that ends in progress
        assert d.update(hb(5, STATE_BODY, T0, T0 - 0.1), T0 + t, Activity(cpu_s=float(t), busy=True)) is None
    d.update(hb(6, STATE_BODY, T0 + 1200.0, T0 + 1199.0), T0 + 1200.0)
    assert d.longest_body_s >= 1190 and d.body_timeout() >= 3 * 1190 > BODY_FLOOR_S
    later = T0 + 1200.0
    for t in range(10, 3500, 10):  # the next evaluation takes 58 minutes: still quiet
        assert d.update(hb(6, STATE_BODY, later, later - 1), later + t, Activity(cpu_s=2e3 + t, busy=True)) is None


def test_a_blocked_job_in_the_body_is_a_stall_after_the_blocked_allowance():
    d = StallDetector(None)
    d.update(hb(5, STATE_BODY, T0, T0 - 0.1), T0)
    asleep = Activity(cpu_s=42.0, busy=False)  # every process asleep in a lock or poll: CPU flat
    ev = None
    t = 0.0
    while ev is None and t < BODY_FLOOR_S:
        t += 1.0
        ev = d.update(hb(5, STATE_BODY, T0, T0 - 0.1), T0 + t, asleep)
    assert ev is not None and ev.allowance == "body-blocked"
    assert BODY_BLOCKED_S <= ev.stall_s <= BODY_BLOCKED_S + 2


def test_periodic_wakeups_are_not_work_but_a_busy_reading_or_cpu_is():
    # a lock wait that wakes every 5 s (torch's pin-memory thread, a timed Condition.wait): a few ms
    d = StallDetector(None)
    d.update(hb(5, STATE_BODY, T0, T0 - 0.1), T0)
    ev = None
    for i in range(1, int(BODY_BLOCKED_S) + 5):
        ev = ev or d.update(hb(5, STATE_BODY, T0, T0 - 0.1), T0 + i, Activity(cpu_s=1.0 + 0.0005 * i))
    assert ev is not None and ev.allowance == "body-blocked"
    # an evaluation on a GPU: the CPU thread launches kernels and waits, a few % of a core
    d = StallDetector(None)
    d.update(hb(5, STATE_BODY, T0, T0 - 0.1), T0)
    for i in range(1, int(BODY_FLOOR_S) - 1, 5):
        assert d.update(hb(5, STATE_BODY, T0, T0 - 0.1), T0 + i, Activity(cpu_s=0.05 * i)) is None
    # a checkpoint to slow storage: the main process in write() with little CPU
    d = StallDetector(None)
    d.update(hb(5, STATE_BODY, T0, T0 - 0.1), T0)
    for i in range(1, int(BODY_FLOOR_S) - 1, 5):
        assert d.update(hb(5, STATE_BODY, T0, T0 - 0.1), T0 + i, Activity(cpu_s=3.0, busy=True)) is None


def test_progress_of_a_nested_watched_loop_is_progress():
    d = StallDetector(None, body_timeout=5.0)
    d.update(hb(5, STATE_BODY, 100.0, 99.9), 100.0)
    for t in range(101, 140):  # a validation loop under its own watch, 39 s, making progress
        assert d.update(hb(5, STATE_BODY, 100.0, 99.9), float(t), Activity(inner_progress=True)) is None
    assert d.update(hb(5, STATE_BODY, 100.0, 99.9), 143.0, Activity()) is None
    assert d.update(hb(5, STATE_BODY, 100.0, 99.9), 145.5, Activity()).kind == "stall"


def test_stall_site_ignores_pids_and_busy_processes_but_not_where_they_wait():
    def report(cls, worker_pid, where, main_where="train (t.py:9)"):
        return {
            "classification": cls,
            "processes": [
                {"role": "main", "pid": 1, "status": "idle", "waiting_in": "poll", "where": main_where},
                {
                    "role": "worker",
                    "pid": worker_pid,
                    "status": "blocked",
                    "waiting_in": "lock acquire",
                    "where": where,
                },
                {
                    "role": "worker",
                    "pid": worker_pid + 1,
                    "status": "running",
                    "waiting_in": None,
                    "where": "x (d.py:3)",
                },
            ],
        }

    a = report("deadlock", 10, "__getitem__ (d.py:5)")
    assert stall_site(a) == stall_site(report("deadlock", 20, "__getitem__ (d.py:5)"))
    assert stall_site(a) != stall_site(report("deadlock", 10, "__getitem__ (d.py:7)"))
    assert stall_site(a) != stall_site(report("slow", 10, "__getitem__ (d.py:5)"))
