"""The ``lock-held-at-fork`` failure: the workers deadlocked on a lock that a named thread of the
training process held when they forked.

The training process records, at each worker fork, where its other threads were
(:mod:`dlwatch.inproc.forkthreads`, event ``fork_threads``); this module keeps that record
as evidence (an observation, in every later report) and, when a stall is classified
``deadlock`` with workers waiting on a lock, finds the holder with
:mod:`dlwatch.detect.lockowner`: the thread whose frame at the fork sat inside a region of
the very lock expression the workers acquire, in the same file.  Only a named holder is a
finding (``lock_held_at_fork``); otherwise the report stays ``worker-deadlock``, with the
threads alive at the fork listed there as evidence and the holder "unknown".
"""

from __future__ import annotations

import os
from typing import Any, Iterable, Mapping

from dlwatch.collect.source import SourceReader
from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import Context, main_thread_frames, threads
from dlwatch.detect.lockowner import acquire_site, find_holder, site_files
from dlwatch.detect.registry import Failure
from dlwatch.wire import contract
from dlwatch.wire.playbooks import Playbook

PLAYBOOK = "lock-held-at-fork"
EVENT = contract.FORK_THREADS.name
MAX_FORKS = 16
MAX_THREADS = 16
MAX_FRAMES = 6


def _frame(f: Any) -> dict[str, Any] | None:
    if not isinstance(f, Mapping):
        return None
    line = f.get("line")
    if not isinstance(f.get("filename"), str) or not isinstance(line, int) or isinstance(line, bool):
        return None
    return {"function": str(f.get("function") or "?"), "filename": f["filename"], "line": line}


def _thread(t: Any) -> dict[str, Any] | None:
    if not isinstance(t, Mapping):
        return None
    frames = [fr for fr in (_frame(f) for f in (t.get("frames") or ())[:MAX_FRAMES]) if fr is not None]
    idle = t.get("idle")
    return {"name": str(t.get("name") or "?")[:128], "frames": frames, "idle": idle if isinstance(idle, str) else None}


def fork_threads_event(ev: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of ``fork_threads`` (the training process wrote it: bounded, typed, nothing else kept)."""
    pids, forks = ev.get("pids"), ev.get("forks")
    if not isinstance(pids, list) or not isinstance(forks, list):
        return None
    ev["pids"] = [p for p in pids[:256] if isinstance(p, int) and not isinstance(p, bool)]
    ev["forks"] = [
        [th for th in (_thread(t) for t in fork[:MAX_THREADS]) if th is not None]
        for fork in forks[:MAX_FORKS]
        if isinstance(fork, list)
    ]
    return ev


class ForkRecord(Detector):
    """Keeps each iterator's fork record as an observation (evidence for a later deadlock report);
    a record equal to the previous one (the same threads at the same lines, epoch after epoch)
    is kept once."""

    playbook = PLAYBOOK

    def __init__(self, thresholds: Mapping[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.last: Any = None

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        if ev.get("event") != EVENT or not ev.get("forks"):
            return ()
        key = ev.get("forks")
        if key == self.last:
            return ()
        self.last = key
        return ({"event": "observation", "signal": EVENT, "pids": ev.get("pids"), "forks": ev.get("forks")},)


def _sources(ctx: Context) -> SourceReader:
    """The report's reader of source files: the caller's (``dlwatch attach``: the target's uid, one
    budget for the whole attach), else one for this process's own uid (the monitor is the job's user)."""
    if not isinstance(ctx.sources, SourceReader):
        ctx.sources = SourceReader()
    return ctx.sources


def judge(ctx: Context) -> dict[str, Any] | None:
    """{"holder", "candidates", "alive", "basis", "site", "worker"} for the first worker waiting on
    a lock whose fork was recorded; None when there is nothing to judge (no deadlock, no record).

    Judged once per report (the deriver and two enrichers ask); the source files it needs are read
    together, once, through the report's :class:`SourceReader`, and only their outlines come back."""
    return ctx.once("lock_held_at_fork", _judge)  # type: ignore[no-any-return]


def _judge(ctx: Context) -> dict[str, Any] | None:
    if ctx.classification != "deadlock":
        return None
    records = [e for e in ctx.events if e.get("signal") == EVENT or e.get("event") == EVENT]
    if not records:
        return None
    blocked = [
        (p, main_thread_frames(p) or next(iter(threads(p)), []))
        for p in ctx.processes
        if p.get("role") == "worker" and p.get("status") == "blocked"
    ]
    if not blocked:
        return None
    reader = _sources(ctx)
    # the files any blocked worker's acquire site can be in, innermost first, read in one go
    paths = list(dict.fromkeys(path for _p, frames in blocked for path in site_files(frames)))
    got = reader.outlines(paths[: reader.budget.files])
    outlines = got.get
    for p, frames in blocked:
        site = acquire_site(frames, outlines)
        if site is None:
            continue
        pid = p.get("pid")
        rec = next((r for r in reversed(records) if pid in (r.get("pids") or ())), records[-1])
        forks = rec.get("forks") or []
        pids = rec.get("pids") or []
        idx = pids.index(pid) if pid in pids else len(forks) - 1
        fork = forks[min(idx, len(forks) - 1)] if forks else []
        found = find_holder(site, fork, outlines)
        return {**found, "site": site, "worker": {"pid": pid, "worker_id": p.get("worker_id")}}
    why = reader.basis()
    if why is None:
        return None
    # no site found, and some source gave no outline: the deadlock's report says which and why
    first = records[-1].get("forks") or [[]]
    return {**find_holder(None, first[-1] if first else [], outlines), "basis": why, "site": None, "worker": None}


def _derive(ctx: Context) -> list[dict[str, Any]]:
    if ctx.signal_events("lock_held_at_fork"):
        return []
    got = judge(ctx)
    if got is None or got["holder"] is None:
        return []
    return [{"event": "threshold", "signal": "lock_held_at_fork", **got}]


def _enrich(pb: Playbook, ctx: Context, ev: dict[str, Any]) -> str | None:
    found = ctx.signal_events("lock_held_at_fork")
    got = dict(found[-1]) if found else judge(ctx)
    if not got or not got.get("holder"):
        return None
    h, site = got["holder"], got["site"]
    base = os.path.basename(str(h["filename"]))
    idle = f" (it was waiting in {h['idle']}, still inside)" if h.get("idle") else ""
    ev["holder"] = (
        f'thread "{h["name"]}" was at {base}:{h["line"]} in {h["function"]}(), inside the region of '
        f"`{h['lock']}` that opens at line {h['region_line']}{idle}, when the workers forked"
    )
    ev["lock"] = (
        f"`{site['expr']}`, acquired by the workers at {os.path.basename(str(site['filename']))}:{site['line']}"
    )
    ev["holder_thread"] = h["name"]
    ev["holder_frame"] = f"{h['function']} ({h['filename']}:{h['line']})"
    ev["threads_at_fork"] = [
        f"{t.get('name')}: {t.get('where') or '?'}" + (f" (idle: {t['idle']})" if t.get("idle") else "")
        for t in got.get("alive") or ()
    ]
    return None


FAILURE = Failure(
    playbook=PLAYBOOK,
    detectors=(ForkRecord,),
    enrich=_enrich,
    derive=_derive,
    evidence_forms={
        "holder": "text",
        "lock": "text",
        "holder_thread": "text",
        "holder_frame": "text",
        "threads_at_fork": "lines",
    },
    events={contract.FORK_THREADS: fork_threads_event},
    examples=("lock_owner", "deadlock", "ddp_deadlock"),
)
