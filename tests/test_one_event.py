"""One event, one incident: a threshold incident is held a moment, and an exception or stall of the same
failure in that moment is written alone with the threshold noted in it (the fd climb and "Too many open
files" in the same second were two incidents).  The hold on hand-built incidents (deterministic); the real
run is tests/test_examples.py::test_fd_exhaustion."""

from __future__ import annotations

import time

from dlwatch.monitor import incidents as incmod
from dlwatch.report.schema import Incident


def _incident(trigger: str, playbook: str) -> Incident:
    return Incident.from_dict(
        {
            "schema_version": 1,
            "id": f"x-{trigger}",
            "trigger": trigger,
            "created_at": "2026-12-03T12:00:00+00:00",
            "summary": "s",
            "findings": [
                {"playbook": playbook, "title": playbook, "confidence": 0.9, "evidence": {}, "remediation": ""}
            ],
            "notes": [],
        }
    )


def _room(written: list) -> incmod.Incidents:
    room = incmod.Incidents.__new__(incmod.Incidents)
    room.held, room.warned_in = [], {}
    room._write = lambda report, extra=None: written.append(report) or f"/r/{report.trigger}-{len(written)}"
    return room


def test_an_exception_of_the_same_failure_in_the_hold_is_one_incident():
    written: list = []
    room = _room(written)
    room.held.append((time.monotonic() + 60, _incident("threshold", "fd-exhaustion"), "fd-exhaustion", time.time()))
    room.held.append((time.monotonic() + 60, _incident("threshold", "shm-exhaustion"), "shm-exhaustion", time.time()))
    room.write(_incident("exception", "fd-exhaustion"))
    # the other failure's threshold is written first (its own event), then the exception alone, noting it
    assert [(r.trigger, r.findings[0].playbook) for r in written] == [
        ("threshold", "shm-exhaustion"),
        ("exception", "fd-exhaustion"),
    ]
    assert any("fd-exhaustion crossed its threshold" in n and "one event, one incident" in n for n in written[1].notes)
    assert room.held == [] and room.warned_in == {"shm-exhaustion": "threshold-1"}


def test_a_threshold_whose_hold_ends_is_written_and_a_later_exception_stays_its_own():
    written: list = []
    room = _room(written)
    room.held.append((time.monotonic() - 0.1, _incident("threshold", "fd-exhaustion"), "fd-exhaustion", time.time()))
    room.flush()
    assert [r.trigger for r in written] == ["threshold"] and room.warned_in == {"fd-exhaustion": "threshold-1"}
    room.write(_incident("exception", "fd-exhaustion"))
    assert [r.trigger for r in written] == ["threshold", "exception"]
    assert not any("crossed its threshold" in n for n in written[1].notes)  # linked as seen-before instead


def test_dlwatch_run_files_are_never_the_programs_top_files(tmp_path):
    """The fd breakdown's top files are the program's: a run directory's heartbeat (dlwatch's own, open in
    the training process) is counted with the fds but never named as the file the program keeps open."""
    import os

    from dlwatch.collect import procfs

    run = tmp_path / ".runs" / "20261203T102146Z-4573-0d1943"
    run.mkdir(parents=True)
    data = tmp_path / "shard.bin"
    data.write_bytes(b"x")
    own = [open(run / "heartbeat", "wb") for _ in range(3)]  # more than the data file: it would rank first
    mine = [open(data, "rb")]
    try:
        fds = procfs.fd_summary(os.getpid())
        names = [path for path, _ in fds.top_files]
        assert str(data) in names and not any("/.runs/" in n for n in names)
        assert fds.file >= 4  # still counted
    finally:
        for f in own + mine:
            f.close()


def test_progress_says_the_epoch_the_loop_is_in_not_how_many_started():
    """An epoch-1 incident said "2 epochs" (the count of epochs started next to a batch count)."""
    from dlwatch.report.render import progress_words

    assert progress_words({"batches": 19, "epochs": 2, "epoch_batches": 3}) == (
        "in epoch 1, 3 batches into it (19 batches in all)"
    )
    assert progress_words({"batches": 0, "epochs": 0}) == "0 batches, before the first epoch"
    assert progress_words({"batches": 1, "epochs": 1}) == "in epoch 0 (1 batch in all)"


def test_a_worker_asleep_in_its_own_work_is_sleeping_not_waiting_for_work():
    """A worker that slept 60 s in __getitem__ was "waiting_for_work 100 %" in the summary, while the stall
    incident said "blocked, sleep" for the same worker: a timed sleep is its own state."""
    from dlwatch.collect.runstats import classify_interval
    from dlwatch.collect.syscalls import number
    from dlwatch.model import ProcSample

    nanosleep = number("clock_nanosleep")
    poll = number("poll")
    prev = ProcSample(pid=1, ts=0.0, state="S", cpu_s=1.0)
    asleep = ProcSample(pid=1, ts=2.0, state="S", cpu_s=1.0, syscall=nanosleep)
    idle = ProcSample(pid=1, ts=2.0, state="S", cpu_s=1.0, syscall=poll)
    assert classify_interval(prev, asleep, loop_in_body=False) == {"running": 0.0, "sleeping": 2.0}
    assert classify_interval(prev, idle, loop_in_body=False) == {"running": 0.0, "waiting_for_work": 2.0}


def test_an_epoch_1_incident_lists_its_own_workers_not_epoch_0s_as_gone(target, tmp_path):
    from conftest import incidents, load, wait_for

    reports = str(tmp_path / "reports")
    t = target("epoch_hang.py", reports)
    t.wait_line("READY", timeout=60)
    got = wait_for(lambda: incidents(reports), timeout=60, interval=0.2)
    assert got, "no stall incident"
    report = load(got[0])
    workers = [p for p in report["processes"] if p["role"] == "worker"]
    assert len(workers) == 2 and all(p.get("status") != "gone" for p in workers), workers
    assert any("worker(s) of earlier epochs" in n for n in report["notes"])
    assert report["progress"]["epochs"] == 2  # the count started; the text says "in epoch 1"
