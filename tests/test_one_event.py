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
