"""Stall classification with hand-built samples and stacks (no processes)."""

from __future__ import annotations

import pytest

from dlwatch.detect.classify import (
    CLASSIFICATIONS,
    CPU_PROGRESS_MIN_S,
    ProcessObservation,
    classify_stall,
    is_waiting_for_data,
    judge_process,
    syscall_category,
    waiting_in_from_stack,
)
from dlwatch.model import Frame, ProcSample, StackDump, ThreadStack

SITE = "/venv/lib/python3.11/site-packages"
STDLIB = "/usr/lib/python3.11"
DL = f"{SITE}/torch/utils/data/dataloader.py"
WORKER = f"{SITE}/torch/utils/data/_utils/worker.py"
FETCH = f"{SITE}/torch/utils/data/_utils/fetch.py"

FUTEX, POLL, NANOSLEEP, READ, RESTART = 202, 7, 230, 0, 219  # x86_64


def py(name: str, file: str, line: int = 1) -> Frame:
    return Frame(name, file, line)


def native(name: str, lib: str = "/usr/lib/libc.so.6") -> Frame:
    return Frame(name, lib, None, native=True)


# Stacks, innermost first, shaped like py-spy's output on torch 2.13 / Python 3.11
QUEUE_GET = [
    py("_PollLikeSelector.select", f"{STDLIB}/selectors.py", 415),
    py("wait", f"{STDLIB}/multiprocessing/connection.py", 947),
    py("Connection._poll", f"{STDLIB}/multiprocessing/connection.py", 440),
    py("_ConnectionBase.poll", f"{STDLIB}/multiprocessing/connection.py", 257),
    py("Queue.get", f"{STDLIB}/multiprocessing/queues.py", 113),
]
WORKER_IDLE = QUEUE_GET + [py("_worker_loop", WORKER, 334)]
WORKER_LOCKED = [
    py("LockedDataset.__getitem__", "/home/user/train/data.py", 21),
    py("_MapDatasetFetcher.fetch.<locals>.<listcomp>", FETCH, 54),
    py("_MapDatasetFetcher.fetch", FETCH, 54),
    py("_worker_loop", WORKER, 374),
]
WORKER_LOCKED_NATIVE = [
    native("0x7f20e0ea3f16"),
    native("PyThread_acquire_lock_timed", "/usr/lib/libpython3.11.so.1.0"),
    native("lock_PyThread_acquire_lock", "/usr/lib/libpython3.11.so.1.0"),
] + WORKER_LOCKED
MAIN_WAITING = QUEUE_GET + [
    py("_MultiProcessingDataLoaderIter._try_get_data", DL, 1291),
    py("_MultiProcessingDataLoaderIter._get_data", DL, 1464),
    py("_MultiProcessingDataLoaderIter._next_data", DL, 1505),
    py("_BaseDataLoaderIter.__next__", DL, 725),
    py("<module>", "/home/user/train/train.py", 18),
]
MAIN_IN_BODY = [
    py("train_step", "/home/user/train/train.py", 40),
    py("<module>", "/home/user/train/train.py", 50),
]
MAIN_SINGLE_LOCKED = [  # num_workers=0: the dataset runs in the main process
    py("LockedDataset.__getitem__", "/home/user/train/data.py", 21),
    py("_MapDatasetFetcher.fetch", FETCH, 54),
    py("_SingleProcessDataLoaderIter._next_data", DL, 790),
    py("_BaseDataLoaderIter.__next__", DL, 725),
    py("<module>", "/home/user/train/train.py", 18),
]


def stack(pid: int, frames: list[Frame], source: str = "py-spy") -> StackDump:
    return StackDump(
        pid=pid,
        source=source,
        threads=(ThreadStack(thread_id=1, name="MainThread", native_tid=pid, frames=tuple(frames)),),
    )


def proc(
    pid: int,
    role: str,
    *,
    cpu: tuple[float, float] = (1.0, 1.0),
    state: str = "S",
    syscall: int | None = FUTEX,
    frames: list[Frame] | None = None,
    worker_id: int | None = None,
    gone: bool = False,
) -> ProcessObservation:
    before = ProcSample(pid=pid, ts=100.0, state=state, cpu_s=cpu[0], syscall=syscall)
    after = (
        ProcSample(pid=pid, ts=101.0, gone=True)
        if gone
        else ProcSample(pid=pid, ts=101.0, state=state, cpu_s=cpu[1], syscall=syscall)
    )
    return ProcessObservation(
        pid=pid,
        role=role,
        before=before,
        after=after,
        worker_id=worker_id,
        stack=stack(pid, frames) if frames is not None else None,
    )


def main_waiting(**kw) -> ProcessObservation:
    kw.setdefault("syscall", POLL)
    return proc(10, "main", frames=MAIN_WAITING, **kw)


def worker(i: int, **kw) -> ProcessObservation:
    return proc(20 + i, "worker", worker_id=i, **kw)


# --------------------------------------------------------------------------- classifications


def test_deadlock_fork_held_lock() -> None:
    v = classify_stall(
        [main_waiting(), worker(0, frames=WORKER_LOCKED), worker(1, frames=WORKER_LOCKED_NATIVE)], expected_workers=2
    )
    assert v.classification == "deadlock"
    w0, w1 = v.processes[1:]
    assert (w0.status, w0.waiting_in) == ("blocked", "lock acquire")  # from syscall 202
    assert (w1.status, w1.waiting_in) == ("blocked", "lock acquire")  # from the native frames
    assert w0.where == "LockedDataset.__getitem__ (data.py:21)"
    assert v.processes[0].status == "idle" and v.processes[0].waiting_in == "queue get"
    assert "2 of 2 workers blocked" in v.reason and "\n" not in v.reason


def test_deadlock_without_stacks_from_syscalls() -> None:
    v = classify_stall([proc(10, "main", syscall=POLL), worker(0), worker(1)])
    assert v.classification == "deadlock"
    assert [p.status for p in v.processes] == ["idle", "blocked", "blocked"]


def test_lost_batch() -> None:
    v = classify_stall(
        [main_waiting(), worker(0, frames=WORKER_IDLE, syscall=POLL), worker(1, frames=WORKER_IDLE, syscall=POLL)]
    )
    assert v.classification == "lost-batch"
    assert all(p.status == "idle" for p in v.processes)
    assert v.processes[1].waiting_in == "queue get"


def test_lost_batch_from_heartbeat_without_stacks() -> None:
    v = classify_stall([proc(10, "main", syscall=POLL), worker(0, syscall=POLL)], main_waiting_for_data=True)
    assert v.classification == "lost-batch"


def test_slow_worker_burning_cpu() -> None:
    v = classify_stall(
        [
            main_waiting(),
            worker(0, cpu=(1.0, 1.9), state="R", syscall=-1, frames=WORKER_LOCKED),
            worker(1, frames=WORKER_IDLE, syscall=POLL),
        ]
    )
    assert v.classification == "slow"
    assert v.processes[1].status == "running" and v.processes[1].cpu_progress_s == pytest.approx(0.9)


def test_slow_worker_in_io_state_d() -> None:
    # D in the last read only: a disk read in passing (a D throughout the window is io-wait, below)
    o = worker(0, state="D", syscall=READ, frames=WORKER_LOCKED)
    o = ProcessObservation(
        pid=o.pid,
        role=o.role,
        worker_id=0,
        stack=o.stack,
        before=ProcSample(pid=o.pid, ts=100.0, state="S", cpu_s=1.0, syscall=FUTEX),
        after=o.after,
    )
    v = classify_stall([main_waiting(), o])
    assert v.classification == "slow"
    assert (v.processes[1].status, v.processes[1].waiting_in) == ("running", "io")


def test_slow_worker_sleeping_in_dataset_is_not_deadlock() -> None:
    v = classify_stall([main_waiting(), worker(0, syscall=NANOSLEEP, frames=WORKER_LOCKED)])
    assert v.classification == "slow"
    assert (v.processes[1].status, v.processes[1].waiting_in) == ("blocked", "sleep")


def test_main_blocked_in_loop_body() -> None:
    v = classify_stall([proc(10, "main", frames=MAIN_IN_BODY), worker(0, frames=WORKER_IDLE, syscall=POLL)])
    assert v.classification == "main-blocked"
    assert v.processes[0].status == "blocked" and v.processes[0].in_dataloader is False
    assert "outside the DataLoader" in v.reason


def test_main_blocked_by_heartbeat_even_if_workers_blocked() -> None:
    v = classify_stall([proc(10, "main"), worker(0)], main_waiting_for_data=False)
    assert v.classification == "main-blocked"


def test_main_busy_in_loop_body_is_main_blocked() -> None:
    v = classify_stall([proc(10, "main", cpu=(1, 3), state="R", syscall=-1, frames=MAIN_IN_BODY)])
    assert v.classification == "main-blocked" and "busy" in v.reason


def test_dead_worker_gone() -> None:
    v = classify_stall([main_waiting(), worker(0, gone=True), worker(1, frames=WORKER_IDLE, syscall=POLL)])
    assert v.classification == "dead-worker"
    assert v.processes[1].status == "gone" and v.processes[1].waiting_in is None


def test_dead_worker_zombie() -> None:
    v = classify_stall([main_waiting(), worker(0, state="Z", syscall=None)])
    assert v.classification == "dead-worker" and v.processes[1].status == "gone"


def test_dead_worker_fewer_than_expected() -> None:
    v = classify_stall([main_waiting(), worker(0, frames=WORKER_IDLE, syscall=POLL)], expected_workers=2)
    assert v.classification == "dead-worker" and "1 live" in v.reason


# --------------------------------------------------------------------------- num_workers=0


def test_single_process_running_is_slow() -> None:
    v = classify_stall(
        [proc(10, "main", cpu=(1, 2), state="R", syscall=-1, frames=MAIN_SINGLE_LOCKED)], expected_workers=0
    )
    assert v.classification == "slow"


def test_single_process_blocked_in_dataset_is_deadlock() -> None:
    v = classify_stall([proc(10, "main", frames=MAIN_SINGLE_LOCKED)], expected_workers=0)
    assert v.classification == "deadlock"
    assert v.processes[0].status == "blocked" and v.processes[0].in_dataloader is True


def test_single_process_blocked_outside_loader() -> None:
    v = classify_stall([proc(10, "main", frames=MAIN_IN_BODY)])
    assert v.classification == "main-blocked"


def test_main_waiting_for_workers_that_are_not_there() -> None:
    v = classify_stall([main_waiting()])
    assert v.classification == "dead-worker"


# --------------------------------------------------------------------------- boundaries


def test_one_worker_only() -> None:
    assert classify_stall([main_waiting(), worker(0, frames=WORKER_LOCKED)]).classification == "deadlock"
    assert classify_stall([main_waiting(), worker(0, frames=WORKER_IDLE, syscall=POLL)]).classification == "lost-batch"


@pytest.mark.parametrize("noise", [0.01, 0.02, CPU_PROGRESS_MIN_S - 0.001])
def test_cpu_below_progress_is_not_running_but_alive(noise: float) -> None:
    # the window is read before py-spy attaches, so any CPU at all is the process's own:
    # not "running" (no progress), but alive, so never a deadlock
    v = classify_stall([main_waiting(), worker(0, cpu=(5.0, 5.0 + noise), frames=WORKER_LOCKED)])
    assert v.classification == "slow"
    w = v.processes[1]
    assert w.cpu_progress_s == pytest.approx(noise)
    assert w.status == "blocked" and w.alive_by == ("cpu",)


def test_no_cpu_at_all_is_deadlock() -> None:
    v = classify_stall([main_waiting(), worker(0, cpu=(5.0, 5.0), frames=WORKER_LOCKED)])
    assert v.classification == "deadlock" and v.processes[1].alive_by == ()


def test_cpu_at_threshold_is_progress() -> None:
    v = classify_stall([main_waiting(), worker(0, cpu=(5.0, 5.0 + CPU_PROGRESS_MIN_S), frames=WORKER_LOCKED)])
    assert v.classification == "slow"


def test_state_r_without_progress_is_runnable_so_running() -> None:
    # a starved process: it wants a CPU it does not get (it used to read as blocked)
    v = judge_process(worker(0, cpu=(5.0, 5.0), state="R", frames=WORKER_LOCKED))
    assert v.status == "running" and "runnable" in v.alive_by


def test_state_r_without_cpu_figures_is_running() -> None:
    o = ProcessObservation(pid=1, role="worker", before=None, after=ProcSample(pid=1, ts=1.0, state="R", syscall=-1))
    assert judge_process(o).status == "running" and judge_process(o).cpu_progress_s is None


def test_stopped_process_is_blocked() -> None:
    v = judge_process(worker(0, state="T", frames=WORKER_LOCKED))
    assert (v.status, v.waiting_in) == ("blocked", "stopped")


def test_cpu_going_backwards_is_clamped() -> None:
    assert judge_process(worker(0, cpu=(5.0, 4.0))).cpu_progress_s == 0.0


def test_missing_after_sample_is_gone() -> None:
    o = ProcessObservation(pid=1, role="worker", before=None, after=None)
    assert judge_process(o).status == "gone"


def test_main_state_unknown_and_workers_idle() -> None:
    # no main stack, main not in poll: cannot be lost-batch (nobody is seen waiting)
    v = classify_stall([proc(10, "main", syscall=FUTEX), worker(0, syscall=POLL)])
    assert v.classification == "main-blocked"


def test_restart_syscall_says_nothing() -> None:
    # what a sleeping poll reads as after a ptrace attach interrupted it
    assert syscall_category(RESTART, "x86_64") is None
    assert syscall_category(128, "aarch64") is None


def test_empty_observations() -> None:
    v = classify_stall([])
    assert v.classification in CLASSIFICATIONS and v.processes == ()


def test_other_role_is_ignored_for_classification() -> None:
    v = classify_stall(
        [
            main_waiting(),
            worker(0, frames=WORKER_IDLE, syscall=POLL),
            proc(30, "other", cpu=(0, 5), state="R", syscall=-1),
        ]
    )
    assert v.classification == "lost-batch"
    assert v.processes[2].status == "running"


# --------------------------------------------------------------------------- syscalls and stacks


@pytest.mark.parametrize(
    "machine,nr,kind",
    [
        ("x86_64", 202, "lock acquire"),
        ("x86_64", 7, "poll"),
        ("x86_64", 271, "poll"),
        ("x86_64", 23, "poll"),
        ("x86_64", 232, "poll"),
        ("x86_64", 281, "poll"),
        ("x86_64", 230, "sleep"),
        ("x86_64", 0, "io"),
        ("x86_64", -1, None),
        ("x86_64", None, None),
        ("aarch64", 98, "lock acquire"),
        ("aarch64", 73, "poll"),
        ("aarch64", 72, "poll"),
        ("aarch64", 22, "poll"),
        ("aarch64", 115, "sleep"),
        ("aarch64", 63, "io"),
        ("aarch64", 202, "io"),  # accept on aarch64 is futex's number on x86_64
        ("arm64", 98, "lock acquire"),
        ("AMD64", 202, "lock acquire"),
        ("riscv64", 98, None),
    ],
)
def test_syscall_category(machine: str, nr: int | None, kind: str | None) -> None:
    assert syscall_category(nr, machine) == kind


def test_aarch64_deadlock_from_syscalls() -> None:
    v = classify_stall([proc(10, "main", syscall=73), proc(20, "worker", syscall=98)], machine="aarch64")
    assert v.classification == "deadlock"
    assert v.processes[1].waiting_in == "lock acquire"
    # the same numbers on x86_64 mean something else (73 = flock, 98 = getrusage)
    v86 = classify_stall([proc(10, "main", syscall=73), proc(20, "worker", syscall=98)], machine="x86_64")
    assert v86.processes[1].waiting_in is None


def thread(frames: list[Frame]) -> ThreadStack:
    return ThreadStack(thread_id=1, frames=tuple(frames))


def test_waiting_in_from_stack() -> None:
    assert waiting_in_from_stack(thread(WORKER_IDLE)) == "queue get"
    assert waiting_in_from_stack(thread(WORKER_LOCKED_NATIVE)) == "lock acquire"
    assert waiting_in_from_stack(thread(WORKER_LOCKED)) is None  # C call under user code: use syscall
    assert waiting_in_from_stack(thread([native("clock_nanosleep"), native("time_sleep"), *MAIN_IN_BODY])) == "sleep"
    assert (
        waiting_in_from_stack(thread([native("0x7f01"), native("cv::resize", "/x/libopencv.so"), *MAIN_IN_BODY]))
        == "native: cv::resize"
    )
    assert (
        waiting_in_from_stack(
            thread(
                [
                    py("Condition.wait", f"{STDLIB}/threading.py", 327),
                    py("Queue.get", f"{STDLIB}/queue.py", 180),
                    *MAIN_IN_BODY,
                ]
            )
        )
        == "queue get"
    )
    assert (
        waiting_in_from_stack(thread([py("Event.wait", f"{STDLIB}/threading.py", 600), *MAIN_IN_BODY]))
        == "lock acquire"
    )
    assert waiting_in_from_stack(thread([py("socket.recv_into", f"{STDLIB}/socket.py", 706), *MAIN_IN_BODY])) == "io"
    assert (
        waiting_in_from_stack(
            thread(
                [
                    native("poll"),
                    native("select_poll_poll_impl", "/x/select.so"),
                    py("_PollLikeSelector.select", f"{STDLIB}/selectors.py"),
                    *MAIN_IN_BODY,
                ]
            )
        )
        == "poll"
    )
    assert waiting_in_from_stack(None) is None
    assert waiting_in_from_stack(thread([])) is None


def test_is_waiting_for_data() -> None:
    assert is_waiting_for_data(thread(MAIN_WAITING)) is True
    assert is_waiting_for_data(thread(MAIN_SINGLE_LOCKED)) is True
    assert is_waiting_for_data(thread(MAIN_IN_BODY)) is False
    assert is_waiting_for_data(None) is None


def test_faulthandler_stack_main_thread_is_last() -> None:
    # faulthandler has no names or tids: the "Current thread" (printed last) is the main thread
    dump = StackDump(
        pid=10,
        source="faulthandler",
        threads=(
            ThreadStack(thread_id=2, frames=(py("Queue._feed", f"{STDLIB}/multiprocessing/queues.py"),)),
            ThreadStack(thread_id=1, frames=tuple(MAIN_WAITING)),
        ),
    )
    o = ProcessObservation(pid=10, role="main", before=main_waiting().before, after=main_waiting().after, stack=dump)
    v = classify_stall([o, worker(0, frames=WORKER_IDLE, syscall=POLL)])
    assert v.classification == "lost-batch"


def test_verdicts_serialise() -> None:
    v = classify_stall([main_waiting(), worker(0, frames=WORKER_LOCKED)])
    d = v.to_dict()
    assert d["classification"] == "deadlock"
    assert set(d["processes"][0]) >= {"pid", "status", "waiting_in", "cpu_progress_s"}


def test_where_skips_dlwatch_own_frames_but_not_shipped_examples():
    import os

    import dlwatch
    from dlwatch.detect.classify import _where

    pkg = os.path.dirname(os.path.abspath(dlwatch.__file__))
    thread = ThreadStack(
        thread_id=1,
        name="MainThread",
        frames=(
            Frame("_TimedIterator.__next__", os.path.join(pkg, "agent.py"), 480),
            Frame("train", "/home/me/train.py", 12),
        ),
    )
    assert _where(thread) == "train (train.py:12)"
    example = ThreadStack(
        thread_id=1,
        name="MainThread",
        frames=(Frame("CachedSamples.__getitem__", os.path.join(pkg, "_examples", "deadlock.py"), 46),),
    )
    assert _where(example) == "CachedSamples.__getitem__ (deadlock.py:46)"
