"""A lock shared across processes that the training process itself holds: the report says so and gives the
remedy for a lock meant to be shared (not "create per-worker semaphores after the fork"); the look-alike,
the same lock held by another process of the job, names nobody in the training process.

Real hangs (tests/targets/shared_lock.py): real workers blocked in multiprocessing's SemLock, a real
stall incident with py-spy stacks.
"""

from __future__ import annotations

import os

from conftest import TARGETS, incidents, load, wait_for


def _stall(target, tmp_path, mode):
    reports = str(tmp_path / "reports")
    t = target("shared_lock.py", mode, reports)
    t.wait_line("READY", timeout=60)
    got = wait_for(lambda: incidents(reports), timeout=60, interval=0.2)
    assert got, "no stall incident within 60 s"
    report = load(got[0])
    assert report["trigger"] == "stall" and report["classification"] == "deadlock"
    return report


def test_the_training_process_holding_the_shared_lock_is_named(target, tmp_path):
    report = _stall(target, tmp_path, "main")
    top = report["findings"][0]
    assert top["playbook"] == "worker-deadlock"
    holder = top["evidence"]["holder"]
    assert holder.startswith("the training process") and "shared_lock.py" in holder and "ds.lock" in holder
    assert top["remediation"].startswith("**The training process holds the lock the workers need")
    assert "per-worker semaphores" not in top["remediation"].split("\n\n")[0]
    with open(os.path.join(TARGETS, "shared_lock.py")) as f:
        loop_line = next(i for i, line in enumerate(f, 1) if line.strip().startswith("with ds.lock:")) + 1
    # the program's own line, not dlwatch's wrapper around the iterator
    assert top["evidence"]["main"]["user_frame"].endswith(f"/shared_lock.py:{loop_line})")
    assert f"main at shared_lock.py:{loop_line}" in holder


def test_the_same_lock_held_by_another_process_names_nobody_in_the_training_process(target, tmp_path):
    report = _stall(target, tmp_path, "other")
    top = report["findings"][0]
    assert top["playbook"] == "worker-deadlock"
    assert not str(top["evidence"].get("holder", "")).startswith("the training process")
    assert top["remediation"].startswith("**A semaphore with no permits left.")
