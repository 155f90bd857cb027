"""A stall in a process with no workers whose data comes from a thread: the thread and the exception it
died with are named, and nothing is said of workers, fork or a loader timeout (torch refuses timeout=
without workers).  Real threads, real hangs, real stall incidents (tests/targets/producer_thread.py).
"""

from __future__ import annotations

import time

from conftest import incidents, load, wait_for


def _stall(target, tmp_path, mode):
    reports = str(tmp_path / "reports")
    t = target("producer_thread.py", mode, reports)
    t.wait_line("READY", timeout=60)
    got = wait_for(lambda: incidents(reports), timeout=60, interval=0.2)
    assert got, "no stall incident within 60 s"
    return load(got[0])


def test_a_dead_decoder_thread_is_named_with_its_exception(target, tmp_path):
    report = _stall(target, tmp_path, "dies")
    assert report["trigger"] == "stall"
    top = report["findings"][0]
    assert top["playbook"] == "producer-gone"
    ev = top["evidence"]
    assert "thread 'decoder'" in ev["producer"] and "RuntimeError: corrupt JPEG in shard 7" in ev["producer"]
    assert ev["producer_frames"][0]["function"] == "decode"
    text = (top["title"] + top["remediation"]).lower()
    assert "worker" not in text and "fork" not in text and "spawn" not in text
    assert "timeout=120" not in top["remediation"]  # torch refuses DataLoader(timeout=) without workers
    assert all(f["playbook"] != "worker-deadlock" for f in report["findings"])


def test_a_stall_with_nothing_dead_names_no_producer_and_no_workers(target, tmp_path):
    report = _stall(target, tmp_path, "alive")
    ids = [f["playbook"] for f in report["findings"]]
    assert "producer-gone" not in ids and "worker-deadlock" not in ids


def test_an_unrelated_thread_dying_while_the_loop_is_fed_is_no_incident(target, tmp_path):
    reports = str(tmp_path / "reports")
    t = target("producer_thread.py", "side", reports)
    out, err = t.communicate(timeout=90)
    assert t.proc.returncode == 0 and "DONE" in out, err[-2000:]
    assert "ValueError: metrics upload failed" in err  # the program's own report of the death, unchanged
    time.sleep(0.5)
    assert incidents(reports) == []
