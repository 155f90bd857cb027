"""producer-gone: the link between workers waiting on a queue and a process of the job that vanished.

The real reproduction is examples/producer_gone.py (tests/test_examples.py: a decoder process
SIGKILLed while the workers take samples from its queue).  Here, the judgement on reports built
as the monitor builds them, with the look-alikes it must stay quiet on: workers deadlocked on a
lock while some helper process had exited, a producer that vanished long before the stall, and
workers that wait in a queue get with every process of the job alive.
"""

from __future__ import annotations

import datetime as _dt

from dlwatch.detect.match import match
from dlwatch.wire.playbooks import load_playbooks

NOW = 1_800_000_000.0


def _report(waiting_in: str, gone_ts: float | None, *, exit_signal: str | None = "SIGKILL", stall_s: float = 4.0):
    workers = [
        {"pid": 21 + i, "role": "worker", "worker_id": i, "status": "blocked", "waiting_in": waiting_in, "alive_by": []}
        for i in range(2)
    ]
    events = []
    if gone_ts is not None:
        events.append(
            {
                "event": "observation",
                "signal": "process_gone",
                "pid": 99,
                "name": "decoder",
                "exit_signal": exit_signal,
                "exit_status": None if exit_signal else 0,
                "last_seen_ts": gone_ts,
                "gone_seen_ts": gone_ts + 0.2,
            }
        )
    return {
        "trigger": "stall",
        "created_at": _dt.datetime.fromtimestamp(NOW, _dt.timezone.utc).isoformat(),
        "classification": "deadlock",
        "progress": {"stall_s": stall_s},
        "loader": {"multiprocessing_context": "fork"},
        "processes": [{"pid": 10, "role": "main", "status": "idle", "waiting_in": "queue get"}, *workers],
        "events": events,
        "exception": None,
    }


def _top(report):
    found = match(report, load_playbooks())
    return [f.playbook for f in found], (found[0].evidence if found else {})


def test_workers_in_queue_get_after_the_producer_was_killed_name_it():
    names, ev = _top(_report("queue get", NOW - 4.0 - 2.0))
    assert names[:2] == ["producer-gone", "worker-deadlock"]
    assert ev["link"] == (
        "2 worker(s) wait in queue get; process 99 (decoder), started by the training process, "
        "was killed by SIGKILL 2 s before the stall"
    )
    assert ev["producer"] == "pid 99 (decoder), SIGKILL" and ev["before_stall_s"] == 2.0


def test_a_producer_that_exited_cleanly_is_named_with_its_status():
    _names, ev = _top(_report("queue get", NOW - 5.0, exit_signal=None))
    assert "exited with status 0" in ev["link"]


def test_look_alikes_stay_quiet():
    # a lock deadlock while a helper had exited: not a producer's fault
    assert "producer-gone" not in _top(_report("lock acquire", NOW - 5.0))[0]
    # the process vanished long before the stall began: not its cause
    assert "producer-gone" not in _top(_report("queue get", NOW - 4.0 - 3600.0))[0]
    # every process of the job alive: nothing to link
    assert "producer-gone" not in _top(_report("queue get", None))[0]


def test_worker_deadlock_remedy_follows_the_waiting_site():
    found = {f.playbook: f for f in match(_report("queue get", None), load_playbooks())}
    text = found["worker-deadlock"].remediation
    assert "A queue or pipe nobody feeds" in text and "held across fork" not in text
    found = {f.playbook: f for f in match(_report("lock acquire", None), load_playbooks())}
    text = found["worker-deadlock"].remediation
    assert "A lock held across fork" in text and "nobody feeds" not in text
