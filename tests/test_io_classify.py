"""Alive-over-a-window and io-wait with hand-built samples, stacks and /proc text (no processes).

Stacks are shaped like py-spy 0.4 --native output on Python 3.11 (read from the real hangs
in test_io_hang.py).  The D-state cases (NFS, a FUSE mount that never answers) are covered
here; test_io_hang.py covers them for real where a FUSE mount can be made.
"""

from __future__ import annotations

import os
import sys

import pytest

from dlwatch.collect import procfs
from dlwatch.detect.classify import ProcessObservation, alive_signs, classify_stall, io_wait, judge_process
from dlwatch.detect.match import match
from dlwatch.model import Frame, IoSample, ProcSample, SocketPeer, StackDump, ThreadIo, ThreadStack
from dlwatch.wire.playbooks import load_playbooks

SITE = "/venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"
DL = f"{SITE}/torch/utils/data/dataloader.py"
WORKER = f"{SITE}/torch/utils/data/_utils/worker.py"
FETCH = f"{SITE}/torch/utils/data/_utils/fetch.py"
SOCKMOD = "/src/Python-3.11.7/Modules/socketmodule.c"
LIBC = "/usr/lib/x86_64-linux-gnu/libc.so.6"
LIBPY = "/usr/lib/libpython3.11.so.1.0"
M = "x86_64"
FUTEX, POLL, READ, RECVFROM, CONNECT, OPENAT = 202, 7, 0, 45, 42, 257


def py(name: str, file: str, line: int = 1) -> Frame:
    return Frame(name, file, line)


def nat(name: str, lib: str = LIBC) -> Frame:
    return Frame(name, lib, None, native=True)


TAIL = [py("_MapDatasetFetcher.fetch", FETCH, 54), py("_worker_loop", WORKER, 349)]
SOCKET_POLL = [
    nat("poll"),
    nat("internal_select", SOCKMOD),
    nat("sock_call_ex", SOCKMOD),
    nat("sock_recv", SOCKMOD),
    py("Remote.fetch", "/job/data.py", 20),
    py("Remote.__getitem__", "/job/data.py", 30),
] + TAIL
SOCKET_POLL_PYONLY = [py("Remote.fetch", "/job/data.py", 20), py("Remote.__getitem__", "/job/data.py", 30)] + TAIL
LOCKED = [
    nat("0x7f44ac8a3f16"),
    nat("PyThread_acquire_lock_timed", LIBPY),
    nat("lock_PyThread_acquire_lock", LIBPY),
    py("Locked.__getitem__", "/job/data.py", 12),
] + TAIL
FUTURE_RESULT = [
    nat("0x7f44ac8a3f16"),
    nat("PyThread_acquire_lock_timed", LIBPY),
    py("Condition.wait", f"{STDLIB}/threading.py", 320),
    py("Future.result", f"{STDLIB}/concurrent/futures/_base.py", 451),
    py("Remote.__getitem__", "/job/data.py", 30),
] + TAIL
POOL_RECV = [
    nat("recv"),
    nat("sock_call_ex", SOCKMOD),
    nat("sock_recv", SOCKMOD),
    py("Remote.fetch", "/job/data.py", 20),
    py("_WorkItem.run", f"{STDLIB}/concurrent/futures/thread.py", 58),
    py("_worker", f"{STDLIB}/concurrent/futures/thread.py", 83),
]
HTTP_READ = [
    py("SocketIO.readinto", f"{STDLIB}/socket.py", 706),
    py("HTTPResponse._read_status", f"{STDLIB}/http/client.py", 279),
    py("Client.get", "/job/client.py", 8),
] + TAIL
METRICS_THREAD = [
    nat("poll"),
    nat("internal_select", SOCKMOD),
    nat("sock_recv", SOCKMOD),
    py("Metrics.loop", "/job/metrics.py", 5),
]
FILE_READ = [nat("read"), nat("_Py_read", LIBPY), py("Shards.__getitem__", "/job/data.py", 44)] + TAIL
QUEUE_IDLE = [
    py("_PollLikeSelector.select", f"{STDLIB}/selectors.py", 415),
    py("wait", f"{STDLIB}/multiprocessing/connection.py", 947),
    py("Queue.get", f"{STDLIB}/multiprocessing/queues.py", 113),
    py("_worker_loop", WORKER, 334),
]
MAIN_WAITING = QUEUE_IDLE[:-1] + [
    py("_MultiProcessingDataLoaderIter._try_get_data", DL, 1291),
    py("_MultiProcessingDataLoaderIter._next_data", DL, 1505),
    py("<module>", "/job/train.py", 18),
]

PEER = SocketPeer(
    fd=5, inode=7001, family="tcp", local="10.0.0.2:41000", remote="10.0.0.9:9000", tcp_state="ESTABLISHED"
)
LISTENER = SocketPeer(fd=3, inode=7000, family="tcp", local="0.0.0.0:8080", remote="0.0.0.0:0", tcp_state="LISTEN")


def sample(
    pid: int,
    ts: float,
    *,
    state: str = "S",
    cpu: float = 1.0,
    syscall: int | None = FUTEX,
    run_ns: int | None = 10**9,
    delay: int | None = 10**6,
    count: int | None = 100,
    vol: int | None = 50,
    invol: int | None = 5,
    rchar: int | None = 4096,
    wchar: int | None = 512,
) -> ProcSample:
    return ProcSample(
        pid=pid,
        ts=ts,
        state=state,
        cpu_s=cpu,
        syscall=syscall,
        run_ns=run_ns,
        run_delay_ns=delay,
        run_count=count,
        num_ctx_switches_voluntary=vol,
        num_ctx_switches_involuntary=invol,
        read_chars=rchar,
        write_chars=wchar,
    )


def threads(pid: int, *named: tuple[str, int, list[Frame]]) -> StackDump:
    return StackDump(
        pid=pid,
        source="py-spy-native",
        threads=tuple(
            ThreadStack(thread_id=i, name=n, native_tid=tid, frames=tuple(f)) for i, (n, tid, f) in enumerate(named)
        ),
    )


def obs(
    pid: int,
    role: str = "worker",
    *,
    reads: list[ProcSample] | None = None,
    stack: StackDump | None = None,
    io: IoSample | None = None,
    worker_id: int | None = 0,
    **flat,
) -> ProcessObservation:
    """Flat counters across the window unless ``reads`` says otherwise (first/middle.../last)."""
    rs = reads or [sample(pid, 100.0 + 0.25 * i, **flat) for i in range(5)]
    return ProcessObservation(
        pid=pid, role=role, before=rs[0], after=rs[-1], reads=tuple(rs[1:-1]), stack=stack, io=io, worker_id=worker_id
    )


def main_obs() -> ProcessObservation:
    return obs(10, "main", syscall=POLL, worker_id=None, stack=threads(10, ("MainThread", 10, MAIN_WAITING)))


def io_of(pid: int, *ts: ThreadIo, sockets=(PEER,), files=()) -> IoSample:
    return IoSample(pid=pid, ts=101.0, threads=ts, sockets=tuple(sockets), files=tuple(files))


# --------------------------------------------------------------------------- alive over the window


def test_starved_worker_runnable_in_one_read_is_running() -> None:
    rs = [sample(21, 100.0), sample(21, 100.25, state="R"), sample(21, 100.5), sample(21, 100.75), sample(21, 101.0)]
    v = judge_process(obs(21, reads=rs, stack=threads(21, ("MainThread", 21, LOCKED))), machine=M)
    assert v.status == "running" and v.alive_by == ("runnable",)


def test_starved_worker_by_run_delay_alone_is_running() -> None:
    # state S in every read (it happened to be off the run queue each time) but it waited for a CPU
    rs = [sample(21, 100.0 + 0.25 * i, delay=10**6 + i * 40_000_000, syscall=-1) for i in range(5)]
    v = judge_process(obs(21, reads=rs), machine=M)
    assert v.status == "running" and v.alive_by == ("run-delay",)


def test_sixteen_starved_workers_are_slow_not_deadlock() -> None:
    def starved(i: int) -> ProcessObservation:
        pid = 20 + i
        rs = [
            sample(
                pid,
                100.0 + 0.25 * k,
                state="R" if (k + i) % 3 == 0 else "S",
                syscall=-1,
                cpu=1.0 + 0.01 * (k // 4),
                run_ns=10**9 + k * 3_000_000,
                delay=k * 20_000_000,
                count=100 + k,
            )
            for k in range(5)
        ]
        return obs(pid, reads=rs, worker_id=i, stack=threads(pid, ("MainThread", pid, LOCKED[3:])))

    v = classify_stall([main_obs()] + [starved(i) for i in range(16)], expected_workers=16, machine=M)
    assert v.classification == "slow"
    assert all(p.status == "running" for p in v.processes[1:])
    assert all(p.cpu_progress_s < 0.05 for p in v.processes[1:])  # the old test: each looked blocked


def test_lock_wait_that_wakes_is_slow_not_deadlock() -> None:
    rs = [
        sample(21, 100.0 + 0.25 * i, vol=50 + (i >= 2), count=100 + (i >= 2), run_ns=10**9 + 40_000 * (i >= 2))
        for i in range(5)
    ]
    v = classify_stall([main_obs(), obs(21, reads=rs, stack=threads(21, ("MainThread", 21, LOCKED)))], machine=M)
    assert v.classification == "slow"
    w = v.processes[1]
    assert (w.status, w.waiting_in) == ("blocked", "lock acquire")
    assert w.alive_by == ("cpu", "wakes")
    assert "waking" in v.reason


def test_fork_held_lock_with_flat_counters_is_deadlock() -> None:
    ws = [
        obs(
            20 + i,
            worker_id=i,
            stack=threads(20 + i, ("MainThread", 20 + i, LOCKED)),
            io=io_of(20 + i, ThreadIo(tid=20 + i, state="S", syscall=FUTEX, args=(1, 2, 3, 0, 0, 0)), sockets=()),
        )
        for i in range(2)
    ]
    v = classify_stall([main_obs()] + ws, expected_workers=2, machine=M)
    assert v.classification == "deadlock"
    assert all(p.alive_by == () and p.io_wait is None for p in v.processes[1:])


def test_unreadable_counters_fall_back_to_cpu_ticks() -> None:
    # no schedstat, status or io (another user's process without ptrace access): flat ticks, a lock
    v = judge_process(
        obs(
            21,
            run_ns=None,
            delay=None,
            count=None,
            vol=None,
            invol=None,
            rchar=None,
            wchar=None,
            stack=threads(21, ("MainThread", 21, LOCKED)),
        ),
        machine=M,
    )
    assert v.status == "blocked" and v.alive_by == ()


def test_a_few_microseconds_on_the_run_queue_is_a_wake_not_starving() -> None:
    rs = [sample(21, 100.0 + 0.25 * i, delay=10**6 + 30_000 * (i >= 3), count=100 + (i >= 3)) for i in range(5)]
    v = judge_process(obs(21, reads=rs, stack=threads(21, ("MainThread", 21, LOCKED))), machine=M)
    assert (v.status, v.alive_by) == ("blocked", ("run-delay", "wakes"))


def test_single_process_loader_polling_a_lock_is_slow() -> None:
    frames = LOCKED[:4] + [py("_SingleProcessDataLoaderIter._next_data", DL, 790), py("<module>", "/job/train.py", 18)]
    waking = [sample(10, 100.0 + 0.25 * i, count=100 + i) for i in range(5)]
    v = classify_stall(
        [obs(10, "main", worker_id=None, reads=waking, stack=threads(10, ("MainThread", 10, frames)))],
        expected_workers=0,
        machine=M,
    )
    assert v.classification == "slow"
    stuck = classify_stall(
        [obs(10, "main", worker_id=None, stack=threads(10, ("MainThread", 10, frames)))], expected_workers=0, machine=M
    )
    assert stuck.classification == "deadlock"


def test_alive_signs_need_two_reads() -> None:
    only = sample(21, 100.0, state="S")
    o = ProcessObservation(pid=21, role="worker", before=None, after=only)
    assert alive_signs(o) == ()


# --------------------------------------------------------------------------- io-wait: sockets


def test_socket_poll_with_native_frames_is_io_wait() -> None:
    w = obs(
        21,
        syscall=POLL,
        stack=threads(21, ("MainThread", 21, SOCKET_POLL)),
        io=io_of(
            21, ThreadIo(tid=21, state="S", syscall=POLL, args=(0x7FF0, 1, 600000, 0, 0, 0)), sockets=(LISTENER, PEER)
        ),
    )
    v = classify_stall([main_obs(), w], machine=M)
    assert v.classification == "io-wait"
    p = v.processes[1]
    assert (p.status, p.waiting_in) == ("blocked", "io")
    assert p.io_wait.kind == "socket poll" and p.io_wait.basis == "stack"
    assert p.io_wait.peer == "10.0.0.9:9000" and p.io_wait.tcp_state == "ESTABLISHED"
    assert p.io_wait.sockets == (PEER,)  # the listener is nobody's peer
    assert "10.0.0.9:9000" in v.reason


def test_socket_poll_without_native_frames_uses_syscall_and_peer() -> None:
    w = obs(
        21,
        syscall=POLL,
        stack=threads(21, ("MainThread", 21, SOCKET_POLL_PYONLY)),
        io=io_of(21, ThreadIo(tid=21, state="S", syscall=POLL)),
    )
    v = judge_process(w, machine=M)
    assert v.io_wait is not None and v.io_wait.kind == "socket poll" and v.io_wait.basis == "syscall"


def test_socket_recv_from_the_syscall_fd_without_stack() -> None:
    w = obs(
        21,
        syscall=RECVFROM,
        io=io_of(
            21, ThreadIo(tid=21, state="S", syscall=RECVFROM, args=(5, 0, 0, 0, 0, 0), fd=5, fd_target="socket:[7001]")
        ),
    )
    v = judge_process(w, machine=M)
    assert v.io_wait.kind == "socket recv" and v.io_wait.peer == "10.0.0.9:9000"


def test_socket_connect_that_hangs() -> None:
    syn = SocketPeer(
        fd=5, inode=7002, family="tcp", local="10.0.0.2:41001", remote="10.0.0.66:443", tcp_state="SYN_SENT"
    )
    w = obs(
        21,
        syscall=CONNECT,
        io=io_of(21, ThreadIo(tid=21, state="S", syscall=CONNECT, fd=5, fd_target="socket:[7002]"), sockets=(syn,)),
    )
    v = judge_process(w, machine=M)
    assert v.io_wait.kind == "socket connect" and v.io_wait.tcp_state == "SYN_SENT"


def test_http_client_frames_are_socket_waits() -> None:
    w = obs(21, syscall=POLL, stack=threads(21, ("MainThread", 21, HTTP_READ)), io=io_of(21))
    assert judge_process(w, machine=M).io_wait.kind == "socket poll"


def test_thread_pool_future_result_with_recv_in_another_thread() -> None:
    stack = threads(21, ("fetch_0", 25, POOL_RECV), ("MainThread", 21, FUTURE_RESULT))
    io = io_of(
        21,
        ThreadIo(tid=21, state="S", syscall=FUTEX),
        ThreadIo(tid=25, state="S", syscall=RECVFROM, fd=5, fd_target="socket:[7001]"),
    )
    v = classify_stall([main_obs(), obs(21, stack=stack, io=io)], machine=M)
    assert v.classification == "io-wait"
    wait = v.processes[1].io_wait
    assert (wait.kind, wait.via, wait.tid, wait.thread) == ("socket recv", "thread pool", 25, "fetch_0")
    assert wait.peer == "10.0.0.9:9000"
    assert "via thread pool" in v.reason


def test_background_socket_thread_does_not_hide_a_fork_held_lock() -> None:
    # a metrics thread polling its socket beside a main thread stuck on a lock: a deadlock
    stack = threads(21, ("metrics", 26, METRICS_THREAD), ("MainThread", 21, LOCKED))
    io = io_of(21, ThreadIo(tid=21, state="S", syscall=FUTEX), ThreadIo(tid=26, state="S", syscall=POLL))
    o = obs(21, stack=stack, io=io)
    assert io_wait(o, machine=M) is None
    v = classify_stall([main_obs(), o], machine=M)
    assert v.classification == "deadlock"
    assert v.processes[1].io_wait is None


def test_idle_worker_with_a_keepalive_socket_is_not_io_wait() -> None:
    # torch's own wait for work, in a worker that keeps a connection to its store open
    w = obs(21, syscall=POLL, stack=threads(21, ("MainThread", 21, QUEUE_IDLE)), io=io_of(21))
    v = classify_stall([main_obs(), w], machine=M)
    assert v.classification == "lost-batch" and v.processes[1].io_wait is None


def test_bytes_arriving_is_a_slow_transfer_not_a_stall() -> None:
    rs = [sample(21, 100.0 + 0.25 * i, syscall=POLL, rchar=4096 + i * 65536) for i in range(5)]
    w = obs(21, reads=rs, stack=threads(21, ("MainThread", 21, SOCKET_POLL)), io=io_of(21))
    v = classify_stall([main_obs(), w], machine=M)
    assert v.classification == "slow"
    assert v.processes[1].io_wait is None and "io" in v.processes[1].alive_by


def test_pool_thread_that_woke_in_the_window_is_a_transfer_in_progress() -> None:
    # recv() bytes are not in /proc/<pid>/io: the waiting thread's own schedstat says data came
    stack = threads(21, ("fetch_0", 25, POOL_RECV), ("MainThread", 21, FUTURE_RESULT))

    def io(count: int) -> IoSample:
        return io_of(
            21,
            ThreadIo(tid=21, state="S", syscall=FUTEX, run_count=40),
            ThreadIo(tid=25, state="S", syscall=POLL, run_count=count, run_ns=count * 1000),
        )

    o = obs(21, stack=stack, io=io(130))
    moving = ProcessObservation(**{**o.__dict__, "io_before": io(120)})
    stuck = ProcessObservation(**{**o.__dict__, "io_before": io(130)})
    v = classify_stall([main_obs(), moving], machine=M)
    assert v.classification == "slow"
    assert (v.processes[1].status, v.processes[1].waiting_in, v.processes[1].io_wait) == ("running", "io", None)
    assert "io" in v.processes[1].alive_by
    assert classify_stall([main_obs(), stuck], machine=M).classification == "io-wait"


def test_socket_wait_with_cpu_progress_is_running() -> None:
    rs = [sample(21, 100.0 + 0.25 * i, cpu=1.0 + 0.1 * i, syscall=POLL) for i in range(5)]
    w = obs(21, reads=rs, stack=threads(21, ("MainThread", 21, SOCKET_POLL)), io=io_of(21))
    assert judge_process(w, machine=M).status == "running"


# --------------------------------------------------------------------------- io-wait: files, state D


def test_nfs_read_in_state_d_is_io_wait_with_the_file() -> None:
    w = obs(
        21,
        state="D",
        syscall=READ,
        stack=threads(21, ("MainThread", 21, FILE_READ)),
        io=io_of(
            21,
            ThreadIo(
                tid=21, state="D", syscall=READ, args=(7, 0, 0, 0, 0, 0), fd=7, fd_target="/mnt/nfs/shard-00017.tar"
            ),
            sockets=(),
        ),
    )
    v = classify_stall([main_obs(), w], machine=M)
    assert v.classification == "io-wait"
    wait = v.processes[1].io_wait
    assert (wait.kind, wait.basis, wait.file) == ("file read", "state D", "/mnt/nfs/shard-00017.tar")
    assert "a file read (/mnt/nfs/shard-00017.tar)" in v.reason


def test_fuse_read_sleeping_interruptibly_is_io_wait() -> None:
    # FUSE waits for its daemon interruptibly first: state S, in read() on a regular file
    w = obs(
        21,
        syscall=READ,
        io=io_of(
            21, ThreadIo(tid=21, state="S", syscall=READ, fd=7, fd_target="/mnt/bucket/img/000001.jpg"), sockets=()
        ),
    )
    v = judge_process(w, machine=M)
    assert v.io_wait.kind == "file read" and v.io_wait.basis == "syscall"


def test_state_d_throughout_without_an_fd_is_uninterruptible() -> None:
    # an open() or stat() on a hung NFS mount: no fd to name
    w = obs(
        21,
        state="D",
        syscall=OPENAT,
        io=io_of(21, ThreadIo(tid=21, state="D", syscall=OPENAT), sockets=(), files=("/mnt/nfs/index.json",)),
    )
    v = classify_stall([main_obs(), w], machine=M)
    assert v.classification == "io-wait" and v.processes[1].io_wait.kind == "uninterruptible"


def test_pool_thread_in_state_d_behind_future_result() -> None:
    stack = threads(21, ("reader_0", 25, FILE_READ[:2]), ("MainThread", 21, FUTURE_RESULT))
    io = io_of(
        21,
        ThreadIo(tid=21, state="S", syscall=FUTEX),
        ThreadIo(tid=25, state="D", syscall=READ, fd=9, fd_target="/mnt/nfs/a.bin"),
        sockets=(),
    )
    wait = judge_process(obs(21, stack=stack, io=io), machine=M).io_wait
    assert (wait.kind, wait.via, wait.file, wait.thread) == ("file read", "thread pool", "/mnt/nfs/a.bin", "reader_0")


def test_single_process_loader_waiting_on_a_socket() -> None:
    main = obs(
        10,
        "main",
        worker_id=None,
        syscall=POLL,
        stack=threads(
            10,
            (
                "MainThread",
                10,
                SOCKET_POLL[:5]
                + [py("_SingleProcessDataLoaderIter._next_data", DL, 790), py("<module>", "/job/train.py", 18)],
            ),
        ),
        io=io_of(10),
    )
    v = classify_stall([main], expected_workers=0, machine=M)
    assert v.classification == "io-wait"


# --------------------------------------------------------------------------- playbooks


def _report(v, stall_s: float = 42.0) -> dict:
    return {
        "classification": v.classification,
        "progress": {"stall_s": stall_s},
        "loader": {"timeout": 0},
        "processes": [p.to_dict() for p in v.processes],
        "exception": None,
    }


def test_io_stall_finding_names_worker_thread_kind_peer_and_duration() -> None:
    stack = threads(21, ("fetch_0", 25, POOL_RECV), ("MainThread", 21, FUTURE_RESULT))
    io = io_of(
        21,
        ThreadIo(tid=21, state="S", syscall=FUTEX),
        ThreadIo(tid=25, state="S", syscall=RECVFROM, fd=5, fd_target="socket:[7001]"),
    )
    v = classify_stall([main_obs(), obs(21, stack=stack, io=io, worker_id=3)], machine=M)
    findings = match(_report(v), load_playbooks())
    assert [f.playbook for f in findings] == ["io-stall"]
    ev = findings[0].evidence
    (w,) = ev["workers"]
    assert (w["worker_id"], w["pid"], w["thread"], w["kind"], w["via"], w["peer"]) == (
        3,
        21,
        "fetch_0",
        "socket recv",
        "thread pool",
        "10.0.0.9:9000",
    )
    assert ev["peers"] == [{"peer": "10.0.0.9:9000", "workers": 1}] and ev["stall_s"] == 42.0
    assert ev["wait"] == (
        "worker 3 (pid 21, thread fetch_0 via thread pool): socket recv on 10.0.0.9:9000 ESTABLISHED for 42.0 s"
    )
    text = findings[0].remediation.lower()
    assert "timeout" in text and "cache" in text and "add workers" in text and "store can serve" in text


def test_worker_deadlock_does_not_fire_on_io_wait_and_io_stall_not_on_deadlock() -> None:
    io_v = classify_stall(
        [main_obs(), obs(21, syscall=POLL, stack=threads(21, ("MainThread", 21, SOCKET_POLL)), io=io_of(21))], machine=M
    )
    dl_v = classify_stall([main_obs(), obs(21, stack=threads(21, ("MainThread", 21, LOCKED)))], machine=M)
    assert [f.playbook for f in match(_report(io_v), load_playbooks())] == ["io-stall"]
    assert [f.playbook for f in match(_report(dl_v), load_playbooks())] == ["worker-deadlock"]


# --------------------------------------------------------------------------- /proc parsers


def _hex4(ip: bytes) -> str:
    return "%08X" % int.from_bytes(ip, sys.byteorder)


def test_parse_tcp_tables_ipv4_ipv6_and_garbage() -> None:
    v4 = f"{_hex4(bytes([127, 0, 0, 1]))}:1F90"
    v4r = f"{_hex4(bytes([10, 1, 2, 3]))}:C350"
    v6 = "".join(_hex4(bytes(range(i, i + 4))) for i in (0x20, 0x24, 0x28, 0x2C)) + ":01BB"
    mapped = "".join(_hex4(b) for b in (b"\0\0\0\0", b"\0\0\0\0", b"\0\0\xff\xff", bytes([192, 168, 0, 5]))) + ":0050"
    head = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
    text = (
        head
        + f"   0: {v4} {v4r} 01 00000000:00000000 00:00000000 00000000  1000        0 4242 1 0 20 4 30 10 -1\n"
        + f"   1: {v4} {v6} 02 00000000:00000000 00:00000000 00000000  1000        0 4343 1 0 20 4 30 10 -1\n"
        + f"   2: {v4} {mapped} 08 0 0 0 0 0 4444\n"
        + "   3: ZZZZ:1 0:0 01 0 0 0 0 0 77\n"  # garbage address
        + f"   6: -0000001:0050 {v4r} 01 0 0 0 0 0 78\n"  # parses as a negative int
        + "   4: short line\n"
        + f"   5: {v4} {v4r} 01 0 0 0 0 0 notanumber\n"
    )
    table = procfs.parse_tcp_table(text)
    assert table[4242] == ("127.0.0.1:8080", "10.1.2.3:50000", "ESTABLISHED")
    assert table[4343][1] == "[2021:2223:2425:2627:2829:2a2b:2c2d:2e2f]:443" and table[4343][2] == "SYN_SENT"
    assert table[4444][1:] == ("192.168.0.5:80", "CLOSE_WAIT")
    assert set(table) == {4242, 4343, 4444}
    assert procfs.parse_tcp_table("") == {} and procfs.parse_tcp_table("\x00\xff" * 100) == {}


@pytest.mark.parametrize(
    "text,expected", [("123 456 7\n", (123, 456, 7)), ("1 2\n", None), ("a b c", None), ("-1 0 0", None), ("", None)]
)
def test_parse_schedstat(text: str, expected) -> None:
    assert procfs.parse_schedstat(text) == expected


def test_schedstat_of_a_live_and_a_gone_process() -> None:
    import subprocess

    child = subprocess.Popen([sys.executable, "-c", "sum(range(3_000_000))"])
    try:
        child.wait(timeout=30)
        assert procfs.schedstat(child.pid) is None  # reaped: gone, not an error
    finally:
        child.kill()
        child.wait()
    own = procfs.schedstat(os.getpid())
    if own is None:
        pytest.skip("no /proc/<pid>/schedstat on this kernel (CONFIG_SCHED_INFO)")
    ran, _waited, count = own
    assert ran > 0 and count > 0


def test_parse_syscall_args_status_and_io() -> None:
    assert procfs.parse_syscall_args("45 0x5 0x7f00 0x10000 0x0 0x0 0x0 0x7ffd 0x7f12\n") == (
        45,
        (5, 0x7F00, 0x10000, 0, 0, 0),
    )
    assert procfs.parse_syscall_args("running\n") == (-1, ())
    assert procfs.parse_syscall_args("-1 0x7ffd 0x7f12\n") == (-1, ())
    assert procfs.parse_syscall_args("7 0xzz 0 0 0 0 0 0 0") == (7, ())
    assert procfs.parse_ctx_switches("Name:\tx\nvoluntary_ctxt_switches:\t14\nnonvoluntary_ctxt_switches:\t43\n") == (
        14,
        43,
    )
    assert procfs.parse_ctx_switches("voluntary_ctxt_switches:\tlots\n") == (None, None)
    assert procfs.parse_io_chars("rchar: 10\nwchar: 20\nsyscr: 3\n") == (10, 20)
    assert procfs.parse_io_chars("garbage") == (None, None)


def test_read_io_of_a_real_socket_pair_and_a_gone_pid() -> None:
    import os
    import socket

    srv = socket.socket()
    try:
        srv.bind(("127.0.0.1", 0))
        srv.listen(1)
        cli = socket.create_connection(srv.getsockname())
        try:
            got = procfs.read_io(os.getpid())
            mine = [s for s in got.sockets if s.fd == cli.fileno()]
            assert mine and mine[0].remote == "127.0.0.1:%d" % srv.getsockname()[1]
            assert mine[0].tcp_state == "ESTABLISHED" and mine[0].family == "tcp"
            assert got.threads and got.threads[0].tid == os.getpid()
        finally:
            cli.close()
    finally:
        srv.close()
    assert procfs.read_io(2**22 + 12345).gone
    s = procfs.read_proc(os.getpid(), sched_detail=True)
    assert s.run_ns is not None and s.num_ctx_switches_voluntary is not None and s.read_chars is not None
    plain = procfs.read_proc(os.getpid())  # every poll: not these (they cost ~35 us a process)
    assert plain.run_ns is None and plain.num_ctx_switches_voluntary is None and plain.read_chars is None


# --------------------------------------------------------------------------- fuzz: /proc text is untrusted

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

REAL_TCP = open(f"/proc/{__import__('os').getpid()}/net/tcp").read()[:3000]


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=0, max_value=len(REAL_TCP)), st.text(max_size=60))
def test_parse_tcp_table_never_raises(cut, junk):
    for text in (REAL_TCP[:cut], REAL_TCP[:cut] + junk, junk + REAL_TCP[cut:], junk):
        for inode, (local, remote, state) in procfs.parse_tcp_table(text).items():
            assert inode > 0 and ":" in local and ":" in remote and state


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=120))
def test_small_parsers_never_raise(text):
    nr, args = procfs.parse_syscall_args(text)
    assert nr is None or isinstance(nr, int)
    assert all(isinstance(a, int) for a in args)
    assert procfs.parse_schedstat(text) is None or len(procfs.parse_schedstat(text)) == 3
    procfs.parse_ctx_switches(text)
    procfs.parse_io_chars(text)
