"""Stalls that are not deadlocks, with real workers, real sockets, real py-spy: `slow` and `io-wait`.

The look-alikes of a deadlock that real jobs produce: workers starved of CPU (more
workers than cores), workers waiting on a remote store that never answers
(directly, or through a thread pool), and a worker polling a condition with a
timeout.  Each hangs for real; the monitor must not call any of them `deadlock`.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from typing import Iterator

import pytest

from conftest import incidents, load, wait_for


def workers(report):
    return [p for p in report["processes"] if p["role"] == "worker"]


def top(report) -> str | None:
    return report["findings"][0]["playbook"] if report["findings"] else None


@contextlib.contextmanager
def silent_listener(trickle_s: float | None = None) -> Iterator[int]:
    """A TCP listener on 127.0.0.1 that accepts every connection and never answers; closed in finally.

    With ``trickle_s``, it answers one byte every ``trickle_s`` seconds instead: a slow store.
    """
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    held: list[socket.socket] = []
    stop = threading.Event()

    def drip(conn: socket.socket) -> None:
        while not stop.wait(trickle_s):
            try:
                conn.sendall(b"x")
            except OSError:
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue  # look at `stop` again
            except OSError:
                return  # closed
            held.append(conn)
            if trickle_s is not None:
                threading.Thread(target=drip, args=(conn,), daemon=True).start()

    try:
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        srv.settimeout(0.2)
        t = threading.Thread(target=accept, daemon=True)
        t.start()
        yield srv.getsockname()[1]
    finally:
        stop.set()
        srv.close()
        for c in held:
            c.close()


def first_stall(tmp_path, t, timeout: float = 40) -> dict:
    t.wait_line("READY", timeout=60)
    found = wait_for(lambda: incidents(str(tmp_path)), timeout=timeout)
    t.remember()
    assert found, "no stall incident"
    report = load(found[0])
    assert report["trigger"] == "stall"
    return report


def test_sixteen_cpu_bound_workers_on_few_cores_are_slow_not_deadlock(tmp_path, target):
    # sixteen workers that only compute, on this machine's cores (two here): each gets a
    # sliver of a CPU, is runnable most of the time and waits on the run queue
    t = target("io_hang.py", "starved", str(tmp_path), "--workers", "16", "--stall-timeout", "3")
    report = first_stall(tmp_path, t)
    assert report["classification"] == "slow", report["classification_reason"]
    assert top(report) not in ("worker-deadlock", "io-stall")
    ws = workers(report)
    assert len(ws) == 16
    for w in ws:
        assert w["status"] == "running", (w["status"], w["alive_by"], w["cpu_progress_s"])
        assert w["io_wait"] is None
        # alive by what the kernel says, not only by CPU ticks: starved workers wait on a run queue
        assert set(w["alive_by"]) & {"runnable", "run-delay", "cpu"}
    if (os.cpu_count() or 1) < 16:
        assert any("run-delay" in w["alive_by"] for w in ws)


def test_worker_waiting_on_a_silent_socket_is_io_wait(tmp_path, target):
    with silent_listener() as port:
        t = target("io_hang.py", "socket", str(tmp_path), "--port", str(port))
        report = first_stall(tmp_path, t)
    assert report["classification"] == "io-wait", report["classification_reason"]
    assert top(report) == "io-stall"
    assert all(f["playbook"] != "worker-deadlock" for f in report["findings"])
    ws = workers(report)
    assert len(ws) == 2
    for w in ws:
        io = w["io_wait"]
        assert w["status"] == "blocked" and io is not None, w
        assert io["kind"] == "socket poll"  # a socket with a timeout waits in poll
        assert io["peer"] == f"127.0.0.1:{port}" and io["tcp_state"] == "ESTABLISHED"
        assert io["via"] is None and io["tid"] == w["pid"]
    ev = report["findings"][0]["evidence"]
    assert {w["worker_id"] for w in ev["workers"]} == {0, 1}
    assert ev["peers"] == [{"peer": f"127.0.0.1:{port}", "workers": 2}]
    assert ev["stall_s"] >= 1.5
    assert "timeout" in report["findings"][0]["remediation"]


def test_worker_waiting_through_a_thread_pool_is_io_wait(tmp_path, target):
    with silent_listener() as port:
        t = target("io_hang.py", "pool", str(tmp_path), "--port", str(port))
        report = first_stall(tmp_path, t)
    assert report["classification"] == "io-wait", report["classification_reason"]
    assert top(report) == "io-stall"
    for w in workers(report):
        io = w["io_wait"]
        assert io is not None, w
        # the main thread waits in Future.result (a lock wait), a pool thread in recv
        assert w["waiting_in"] == "io"
        assert io["via"] == "thread pool" and io["tid"] != w["pid"]
        assert io["thread"].startswith("fetch")
        assert io["kind"] == "socket recv"  # no socket timeout: recvfrom itself
        assert io["peer"] == f"127.0.0.1:{port}"
    ev = report["findings"][0]["evidence"]
    assert all(w["via"] == "thread pool" and w["thread"].startswith("fetch") for w in ev["workers"])


def test_slow_store_trickling_bytes_is_slow_not_io_wait(tmp_path, target):
    # the healthy look-alike of a silent store: a sample takes 40 s to arrive, but bytes arrive
    with silent_listener(trickle_s=0.1) as port:
        t = target("io_hang.py", "trickle", str(tmp_path), "--port", str(port))
        report = first_stall(tmp_path, t)
    assert report["classification"] == "slow", report["classification_reason"]
    assert top(report) not in ("worker-deadlock", "io-stall")
    for w in workers(report):
        assert w["io_wait"] is None and (w["status"], w["waiting_in"]) == ("running", "io"), w
        assert "io" in w["alive_by"]


def test_fork_held_lock_is_still_deadlock_with_no_sign_of_life(tmp_path, target):
    # the deadlock that io-wait and alive_by must not hide: tests/targets/hang.py deadlock
    t = target("hang.py", "deadlock", str(tmp_path))
    report = first_stall(tmp_path, t)
    assert report["classification"] == "deadlock" and top(report) == "lock-held-at-fork"
    assert "worker-deadlock" in [f["playbook"] for f in report["findings"]]
    assert all(f["playbook"] != "io-stall" for f in report["findings"])
    for w in workers(report):
        assert w["alive_by"] == [] and w["io_wait"] is None and w["cpu_progress_s"] == 0
        assert w["sample"]["run_ns"] is not None  # the window's counters were read, and stayed flat


def ready_or_skip(t, timeout: float) -> None:
    """Wait for READY; skip the test with the target's reason if it printed SKIP: instead."""
    import selectors
    import time

    sel = selectors.DefaultSelector()
    sel.register(t.proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                continue
            line = t.proc.stdout.readline()
            if not line:
                break
            if line.startswith("SKIP: "):
                pytest.skip(line[len("SKIP: ") :].strip())
            if line.startswith("READY"):
                t.remember()
                return
    finally:
        sel.close()
    raise AssertionError(f"target printed neither READY nor SKIP within {timeout}s")


def test_read_stuck_in_state_d_on_a_fuse_mount_is_io_wait(tmp_path, target):
    # a FUSE filesystem (served by the target itself, in its own mount namespace) that never
    # answers READ; a signal moves the readers from FUSE's interruptible wait to state D, as
    # a read from a hard-mounted NFS server that went away sits
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    reports = tmp_path / "reports"
    t = target("fuse_hang.py", str(reports), str(mnt))
    ready_or_skip(t, timeout=60)
    found = wait_for(lambda: incidents(str(reports)), timeout=40)
    t.remember()
    assert found, "no stall incident"
    report = load(found[0])
    assert report["trigger"] == "stall"
    assert report["classification"] == "io-wait", report["classification_reason"]
    assert top(report) == "io-stall"
    assert all(f["playbook"] != "worker-deadlock" for f in report["findings"])
    ws = workers(report)
    assert len(ws) == 2
    for w in ws:
        io = w["io_wait"]
        assert io is not None and w["status"] == "blocked", w
        assert io["kind"] == "file read" and io["basis"] == "state D"
        assert io["file"].startswith(str(mnt) + "/shard-") and io["tid"] == w["pid"]
        assert w["sample"]["state"] == "D" and w["alive_by"] == []
    ev = report["findings"][0]["evidence"]
    assert {x["worker_id"] for x in ev["workers"]} == {0, 1}
    assert all(p["peer"].startswith(str(mnt)) for p in ev["peers"])


def test_lock_wait_that_wakes_every_second_is_not_deadlock(tmp_path, target):
    t = target("io_hang.py", "wakes", str(tmp_path), "--workers", "1")
    report = first_stall(tmp_path, t)
    assert report["classification"] == "slow", report["classification_reason"]
    assert top(report) not in ("worker-deadlock", "io-stall")
    (w,) = workers(report)
    assert w["status"] == "blocked" and w["waiting_in"] == "lock acquire"
    assert "wakes" in w["alive_by"]
    assert w["io_wait"] is None


# --------------------------------------------------------------------------- waits with no fd yet, pipes, locks


def _reason_agrees(report) -> None:
    # the verdict's one line must not contradict its own evidence (#21 item 4)
    reason = report["classification_reason"]
    for w in workers(report):
        if "alive" in reason and "alive: " not in reason:
            assert w["alive_by"], reason
    assert "waiting but alive" not in reason or any(w["alive_by"] for w in workers(report)), reason


def test_open_of_a_fifo_with_no_writer_is_io_wait_naming_the_pipe(tmp_path, target):
    fifo = tmp_path / "samples.fifo"
    os.mkfifo(fifo)
    t = target("io_hang.py", "fifo", str(tmp_path / "r"), "--path", str(fifo))
    report = first_stall(tmp_path / "r", t)
    assert report["classification"] == "io-wait", report["classification_reason"]
    assert top(report) == "io-stall"
    for w in workers(report):
        io = w["io_wait"]
        assert io is not None and io["kind"] == "pipe open", w
        assert io["file"] == str(fifo)
    assert "named pipe" in report["classification_reason"] and "file read" not in report["classification_reason"]
    assert str(fifo) in report["findings"][0]["evidence"]["wait"]
    _reason_agrees(report)


def test_write_into_a_full_fifo_is_io_wait_naming_the_pipe(tmp_path, target):
    fifo = tmp_path / "out.fifo"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # there, and never reads
    try:
        t = target("io_hang.py", "fifo-write", str(tmp_path / "r"), "--path", str(fifo))
        report = first_stall(tmp_path / "r", t)
    finally:
        os.close(reader)
    assert report["classification"] == "io-wait", report["classification_reason"]
    kinds = {w["io_wait"]["kind"] for w in workers(report) if w["io_wait"]}
    assert "pipe write" in kinds, [w["io_wait"] for w in workers(report)]
    assert all(w["io_wait"]["file"] == str(fifo) for w in workers(report) if w["io_wait"])
    _reason_agrees(report)


def test_flock_held_by_another_process_is_io_wait_naming_the_file(tmp_path, target):
    import fcntl

    lock = tmp_path / "shard.lock"
    lock.write_bytes(b"")
    with open(lock, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t = target("io_hang.py", "flock", str(tmp_path / "r"), "--path", str(lock))
        report = first_stall(tmp_path / "r", t)
    assert report["classification"] == "io-wait", report["classification_reason"]
    assert top(report) == "io-stall"
    for w in workers(report):
        assert w["io_wait"] is not None and w["io_wait"]["kind"] == "file lock", w
        assert w["io_wait"]["file"] == str(lock)
    _reason_agrees(report)
