"""The reason checker (tests/reasoncheck.py) itself: it passes a consistent verdict and fails the
contradictions real reports had (the FIFO stall said "waiting but alive" next to alive_by: [])."""

from __future__ import annotations

import pytest

import reasoncheck
from dlwatch.detect.classify import ProcessObservation, classify_stall
from dlwatch.model import ProcSample


def _report(reason: str, *workers: dict) -> dict:
    return {"trigger": "stall", "classification_reason": reason, "processes": list(workers)}


W0 = {"pid": 11, "role": "worker", "worker_id": 0, "status": "blocked", "alive_by": [], "io_wait": None}
W1 = {"pid": 12, "role": "worker", "worker_id": 1, "status": "blocked", "alive_by": [], "io_wait": None}


def test_the_fifo_contradiction_is_caught():
    reason = (
        "2 of 2 workers waiting but alive (a transient wait, or waking up): worker 0 (pid 11) blocked in io "
        "at Files.__getitem__ (io_hang.py:112) 0.00 s CPU (+1 more); main waits for data"
    )
    with pytest.raises(AssertionError):
        reasoncheck.check(_report(reason, W0, W1))


def test_a_wrong_count_a_wrong_status_and_wrong_signs_are_caught():
    with pytest.raises(AssertionError):  # three workers said, two in the table
        reasoncheck.check(_report("1 of 3 workers still working (CPU or I/O): worker 0 (pid 11) blocked", W0, W1))
    with pytest.raises(AssertionError):  # the table says blocked
        reasoncheck.check(_report("1 of 2 workers still working (CPU or I/O): worker 0 (pid 11) running", W0, W1))
    with pytest.raises(AssertionError):  # alive by cpu, the table says nothing
        reasoncheck.check(_report("x: worker 0 (pid 11) blocked in lock acquire 0.00 s CPU alive: cpu; main", W0))


def test_verdicts_of_the_classifier_pass():
    # a worker asleep in a futex with no sign of life, and one that woke: what classify_stall says of them
    def obs(pid: int, cpu: float, ctx: int) -> ProcessObservation:
        before = ProcSample(pid=pid, ts=0.0, state="S", cpu_s=1.0, syscall=202, run_count=5)
        after = ProcSample(pid=pid, ts=1.0, state="S", cpu_s=1.0 + cpu, syscall=202, run_count=5 + ctx)
        return ProcessObservation(pid=pid, role="worker", before=before, after=after, worker_id=pid - 11)

    for observations in ([obs(11, 0.0, 0), obs(12, 0.0, 0)], [obs(11, 0.0, 3)]):
        v = classify_stall(observations, main_waiting_for_data=True, machine="x86_64")
        report = _report(v.reason, *[dict(p.to_dict(), alive_by=list(p.alive_by)) for p in v.processes])
        reasoncheck.check(report)
