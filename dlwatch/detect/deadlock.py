"""The ``worker-deadlock`` failure: the loop waits for a batch and no worker makes progress.

No detector of its own: a stall is its own trigger (:mod:`dlwatch.detect.stall`) and
its verdict is the stall's classification (:mod:`dlwatch.detect.classify`), which the
playbook's signals name.  This module measures the finding's evidence: every worker
and the main process with their state, what they wait in and their stacks, and the
loader settings that bear on it (start method, timeout).
"""

from __future__ import annotations

from typing import Any

from dlwatch.detect.evidence import MAX_FRAMES, MAX_WORKERS, Context, main_thread_frames, threads, worker_view
from dlwatch.detect.registry import Failure
from dlwatch.wire.playbooks import Playbook

PLAYBOOK = "worker-deadlock"


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
    _fork_threads(ctx, ev)
    return waiting_site(workers)


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
        for frames in [main_thread_frames(p) or next(iter(threads(p)), [])]:
            for f in frames[:MAX_FRAMES]:
                fn = str(f.get("function") or "")
                if fn.endswith(_QUEUE):  # a queue's get waits on its own lock too: the queue is the site
                    return "queue"
                if fn.endswith(_CONDITION):
                    return "condition"
                if fn.endswith(_SEMAPHORE):
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
    evidence_forms={"main": "process", "multiprocessing_context": "text", "holder": "text", "threads_at_fork": "lines"},
    examples=("lock_unknown_holder",),  # the seed's deadlock names its holder: lock-held-at-fork's example
)
