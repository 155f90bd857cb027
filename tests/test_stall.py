"""Stall detection logic on hand-built heartbeats (the real hangs are in test_hang.py)."""

from __future__ import annotations

from dlwatch.detect.stall import ADAPTIVE_FLOOR_S, FIRST_BATCH_S, StallDetector
from dlwatch.heartbeat import STATE_BODY, STATE_OUTSIDE, STATE_WAITING, Heartbeat


def hb(batches, state, ts_last, ts_wait, epoch_batches=None, interval=0.0, epochs=1):
    return Heartbeat(batches=batches, epoch_batches=batches if epoch_batches is None else epoch_batches,
                     epochs=epochs, state=state, pid=1, ts_last_batch=ts_last, ts_wait_start=ts_wait,
                     total_wait_s=0.0, total_step_s=0.0, last_interval_s=interval)


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
    assert d.update(hb(49, STATE_BODY, t, t - 1), t + 120) is None  # 2 minutes: not a stall for this model
    assert d.update(hb(49, STATE_BODY, t, t - 1), t + 301).kind == "stall"


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
