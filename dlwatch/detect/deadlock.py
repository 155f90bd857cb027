"""The ``worker-deadlock`` failure: the loop waits for a batch and no worker makes progress.

No detector of its own: a stall is its own trigger (:mod:`dlwatch.detect.stall`) and
its verdict is the stall's classification (:mod:`dlwatch.detect.classify`), which the
playbook's signals name.  This module measures the finding's evidence: every worker
and the main process with their state, what they wait in and their stacks, and the
loader settings that bear on it (start method, timeout).  Its fact
``workers_progressing`` keeps a torch timeout from being called a deadlock while the
workers are still starting or working, and its remediation never recommends what the
loader already does (spawn, a timeout).
"""

from __future__ import annotations

from typing import Any

from dlwatch.collect import syscalls
from dlwatch.detect.evidence import (
    MAX_FRAMES,
    MAX_WORKERS,
    Context,
    main_thread_frames,
    samples_of,
    threads,
    worker_view,
)
from dlwatch.detect.registry import Failure
from dlwatch.wire.playbooks import Playbook

PLAYBOOK = "worker-deadlock"
NO_FORK = ("spawn", "forkserver")  # start methods that copy no lock or thread pool from the main process
CPU_RISE_S = 0.05  # CPU seconds between the last two reads of a worker that count as working (ticks are 0.01 s)


def workers_progressing(ctx: Context) -> list[dict[str, Any]]:
    """The loader's live workers that are not deadlocked, each with why (empty: none is known to be).

    Starting: the loader started it and it has not registered yet (a spawned interpreter
    importing torch; registration comes first in ``worker_init_fn``).  Working: running
    on a CPU at the last read, CPU time rising between its last reads, or asleep on a
    timer (``time.sleep`` in the dataset waits for time, not for a lock).
    """
    started = {p for e in ctx.signal_events("loader_workers") for p in (e.get("pids") or ())}
    registered = {e.get("pid") for e in ctx.signal_events("worker_registered")}
    out: list[dict[str, Any]] = []
    for p in ctx.processes:
        s = p.get("sample") or {}
        if p.get("role") != "worker" or p.get("status") == "gone" or s.get("gone") or s.get("state") in ("Z", "X"):
            continue
        pid = p.get("pid")
        why = None
        if pid in started and pid not in registered:
            why = "starting"
        elif s.get("state") == "R" or p.get("status") == "running":
            why = "running"
        elif isinstance(p.get("cpu_progress_s"), (int, float)) and p["cpu_progress_s"] >= CPU_RISE_S:
            why = "cpu rising"
        elif syscalls.category(s.get("syscall") if isinstance(s.get("syscall"), int) else None) == "sleep":
            why = "sleeping on a timer"
        else:
            cpu = [x.get("cpu_s") for x in samples_of(ctx.report, pid)[-2:]]
            if len(cpu) == 2 and all(isinstance(c, (int, float)) for c in cpu) and cpu[1] - cpu[0] >= CPU_RISE_S:
                why = "cpu rising"
        if why is not None:
            out.append({"pid": pid, "worker_id": p.get("worker_id"), "why": why})
    return out


def loader_has_workers(ctx: Context) -> bool:
    """The loader works through worker processes: its ``num_workers``, or workers in the report (attach,
    where the loader's settings are not known; a report that knows neither leaves it to the verdict).
    Without them, "the workers deadlocked" is not true."""
    nw = ctx.loader.get("num_workers")
    if isinstance(nw, int) and not isinstance(nw, bool):
        return nw > 0
    if not ctx.processes:  # nothing known of the job (a report without its processes): the verdict decides
        return True
    return any(p.get("role") == "worker" for p in ctx.processes)


def _enrich(pb: Playbook, ctx: Context, ev: dict[str, Any]) -> str | None:
    workers = [p for p in ctx.processes if p.get("role") == "worker"]
    if workers:
        ev["workers"] = [worker_view(p) for p in workers[:MAX_WORKERS]]
        if len(workers) > MAX_WORKERS:
            ev["workers_not_shown"] = len(workers) - MAX_WORKERS
    main = next((p for p in ctx.processes if p.get("role") == "main"), None)
    if main is not None:
        mv = worker_view(main)
        mv.pop("worker_id", None)
        ev["main"] = mv
    if ctx.loader.get("multiprocessing_context") is not None:
        ev["multiprocessing_context"] = ctx.loader.get("multiprocessing_context")
    if ctx.loader.get("timeout") is not None:
        ev["timeout"] = ctx.loader.get("timeout")
    held = _held_by_training_process(ctx, workers, main)
    if held is not None:
        ev["holder"] = (
            f"the training process (pid {main.get('pid') if main else '?'}), main thread: "
            f"{held['function']} at {_base(held['filename'])}:{held['line']}, inside "
            f"{held['lock']} (taken at line {held['region_line']}) while it waits for the workers' batches"
        )
    else:
        _fork_threads(ctx, ev)
    # the remedy follows the waiting site, and never recommends what the loader already does
    method = ctx.loader.get("multiprocessing_context") or next(
        (p.get("start_method") for p in workers if p.get("start_method")), None
    )
    site = waiting_site(workers)
    if held is not None:
        primary = "held-by-training-process"
    elif site in ("lock", None):
        primary = "no-fork-start" if method in NO_FORK else "lock"
    else:
        primary = site
    timeout = ctx.loader.get("timeout")
    has_timeout = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
    return (primary,) if has_timeout else (primary, "no-timeout")


_SHARED_LOCKS = ("/multiprocessing/synchronize.py",)  # SemLock: a lock or semaphore every process shares


def _base(path: str) -> str:
    return str(path).rsplit("/", 1)[-1]


def _held_by_training_process(ctx: Context, workers: list[Any], main: Any) -> dict[str, Any] | None:
    """Where the training process's main thread holds the lock its blocked workers wait on, or None.

    Only a lock shared across processes can be held there for the workers (a threading lock is
    copied at fork; a lock held across fork is lock-held-at-fork's case): the blocked workers must
    wait in multiprocessing's SemLock, and the training process's own code (its frames outside
    libraries and dlwatch) must sit inside a region of a lock of the same name.
    """
    from dlwatch.detect.evidence import is_user_frame
    from dlwatch.detect.lock_held import _sources
    from dlwatch.detect.lockowner import acquire_site, held_in_stack, site_files

    if main is None or ctx.classification != "deadlock":
        return None
    shared = []
    for p in workers:
        if p.get("status") != "blocked":
            continue
        frames = (main_thread_frames(p) or next(iter(threads(p)), []))[:MAX_FRAMES]
        if any(str(f.get("filename") or "").endswith(_SHARED_LOCKS) for f in frames):
            shared.append(frames)
    if not shared:
        return None
    own = [f for f in main_thread_frames(main) if is_user_frame(f)]
    reader = _sources(ctx)
    # the files of the first waiting worker's acquire site and of the training process's frames, read
    # in one go within the report's budget (only their outlines come back)
    paths = list(dict.fromkeys([*site_files(shared[0]), *(str(f["filename"]) for f in own if f.get("filename"))]))
    outlines = reader.outlines(paths[: reader.budget.files]).get
    for frames in shared:
        site = acquire_site(frames, outlines)
        if site is not None:
            return held_in_stack(site, own, outlines)
    return None


_QUEUE = ("Queue.get", "SimpleQueue.get", "Connection.recv", "Connection.recv_bytes", "Queue.get_nowait")
_CONDITION = ("Condition.wait", "Event.wait", "Condition.wait_for", "Barrier.wait")
_SEMAPHORE = ("Semaphore.acquire", "BoundedSemaphore.acquire", "SemLock.__enter__", "SemLock.acquire")


def waiting_site(workers: list[Any]) -> str | None:
    """The remediation variant for what the blocked workers wait on: lock, queue, condition or
    semaphore (from the innermost Python frames of the first one that shows it), else None."""
    for p in workers:
        if p.get("status") != "blocked":
            continue
        # the thread that runs the worker loop: a queue's feeder thread idles in Condition.wait
        frames = (main_thread_frames(p) or next(iter(threads(p)), []))[:MAX_FRAMES]
        names = [str(f.get("function") or "") for f in frames]
        # a queue's get waits on its own lock or semaphore too: a queue anywhere in the frames is the site
        if any(n.endswith(_QUEUE) for n in names):
            return "queue"
        for n in names:
            if n.endswith(_CONDITION):
                return "condition"
            if n.endswith(_SEMAPHORE):
                return "semaphore"
        waiting = p.get("waiting_in")
        if waiting == "queue get":
            return "queue"
        if waiting == "lock acquire":
            return "lock"
    return None


def _fork_threads(ctx: Context, ev: dict[str, Any]) -> None:
    """The threads of the training process at the workers' fork, when recorded and no holder was named
    (then lock-held-at-fork is the finding): listed as alive, the holder said to be unknown."""
    from dlwatch.detect.lock_held import judge

    got = judge(ctx)
    if got is None or got.get("holder") is not None:
        return
    ev["holder"] = f"unknown: {got['basis']}"
    ev["threads_at_fork"] = [
        f"{t.get('name')}: {t.get('where') or '?'}" + (f" (idle: {t['idle']})" if t.get("idle") else "")
        for t in got.get("alive") or ()
    ]


FAILURE = Failure(
    playbook=PLAYBOOK,
    enrich=_enrich,
    facts={"workers_progressing": workers_progressing, "loader_has_workers": loader_has_workers},
    evidence_forms={"main": "process", "multiprocessing_context": "text", "holder": "text", "threads_at_fork": "lines"},
    examples=("lock_unknown_holder",),  # the seed's deadlock names its holder: lock-held-at-fork's example
)
