"""The ``producer-gone`` failure: the workers wait on a queue or pipe whose producer process died.

A decoder, a prefetcher or a reader process that the training process started feeds the
DataLoader's workers through a ``multiprocessing.Queue`` or a pipe.  When it dies (the OOM
killer, a crash, a ``kill``), nothing tells the workers: they block in ``get()`` forever and
the stall is a ``deadlock`` by every sign, but no lock is involved and the fork-lock remedy
is wrong.  A loader with no workers fed by a *thread* of the training process (a DALI-style
decoder, a prefetcher filling a ``queue.Queue``) has the same fate when the thread dies: the
training process tells the monitor of every thread that dies with an exception
(:mod:`dlwatch.inproc.threaddeath`, event ``thread_died``), and a stall whose loop waits in a
queue get with no workers is linked to the last one that died before it, with its exception:
no worker, no fork, no ``timeout=`` (torch refuses it without workers) is spoken of.  The monitor already tracks every process of the job; this module notes each one
that vanished (its pid, name, exit signal or status, when it was last seen), and links it to
a stall whose workers wait in a queue get or a named-pipe read: "workers wait in queue get;
process 1234 (started by the training process) was killed by SIGKILL 2 s before the stall".
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Iterable, Mapping

from dlwatch.detect.base import Detector, Observer, View
from dlwatch.detect.evidence import Context, judged_once
from dlwatch.detect.registry import Failure
from dlwatch.wire import contract
from dlwatch.detect.worker_killed import signal_name, wait_status_signal
from dlwatch.wire.playbooks import Playbook

PLAYBOOK = "producer-gone"
GONE = "process_gone"
THREAD = contract.THREAD_DIED.name
MAX_THREAD_FRAMES = 8
LINK = "producer_gone"
RECENT_S = 300.0  # a process that vanished this long before the stall began is no longer its cause
_WAITS = ("queue get",)
_PIPE_KINDS = ("pipe read",)


class ProcessGone(Detector):
    """Notes each process of the job other than the workers that vanished (an observation)."""

    playbook = PLAYBOOK

    def __init__(self, thresholds: Mapping[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.seen: set[int] = set()

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        out = []
        for p in view.procs.values():
            if p.role != "other" or not p.gone or p.pid in self.seen:
                continue
            self.seen.add(p.pid)
            history = list(p.history)
            status = next((s.exit_code for s in reversed(history) if s.exit_code is not None), None)
            alive = [s for s in history if not s.gone]
            last = alive[-1] if alive else None
            out.append(
                {
                    "event": "observation",
                    "signal": GONE,
                    "pid": p.pid,
                    "name": last.name if last is not None else None,
                    "exit_signal": signal_name(wait_status_signal(status)),
                    "exit_status": (status >> 8) & 0xFF
                    if status is not None and not wait_status_signal(status)
                    else None,
                    "last_seen_ts": last.ts if last is not None else None,
                    "gone_seen_ts": view.now,
                }
            )
        return out


def thread_died_event(ev: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of ``thread_died`` (the training process wrote it: bounded, typed, nothing else kept)."""
    frames = []
    for f in (ev.get("frames") if isinstance(ev.get("frames"), list) else [])[:MAX_THREAD_FRAMES]:
        if isinstance(f, Mapping) and isinstance(f.get("filename"), str) and isinstance(f.get("line"), int):
            frames.append(
                {"function": str(f.get("function") or "?")[:256], "filename": f["filename"], "line": f["line"]}
            )
    return {
        "event": THREAD,
        "ts": ev.get("ts"),
        "pid": ev.get("pid"),
        "thread": str(ev.get("thread") or "?")[:128],
        "exc_type": str(ev.get("exc_type") or "?")[:256],
        "message": str(ev.get("message") or "")[:512],
        "frames": frames,
    }


class ThreadDied(Observer):
    """Keeps each thread death the training process told of as an observation (evidence for a later stall)."""

    playbook = PLAYBOOK
    event = THREAD
    keys = ("thread", "exc_type", "message", "frames")
    max_kept = 32


def _thread_link(ctx: Context, stall_start: float | None) -> dict[str, Any] | None:
    """A loop with no workers waiting in a queue get, and a thread that died before the stall began."""
    if any(p.get("role") == "worker" and p.get("status") != "gone" for p in ctx.processes):
        return None
    if (ctx.loader.get("num_workers") or 0) > 0:
        return None
    main = next((p for p in ctx.processes if p.get("role") == "main"), None)
    if main is None or main.get("waiting_in") not in _WAITS:
        return None
    deaths = [e for e in ctx.signal_events(THREAD) if isinstance(e.get("ts"), (int, float))]
    if stall_start is not None:
        deaths = [e for e in deaths if stall_start - RECENT_S <= e["ts"] <= stall_start + 5.0]
    if not deaths:
        return None
    d = max(deaths, key=lambda e: e["ts"])
    before = round(stall_start - d["ts"], 1) if stall_start is not None else None
    where = next(iter(d.get("frames") or ()), None)
    at = f" at {str(where['filename']).rsplit('/', 1)[-1]}:{where['line']}" if where else ""
    exc = f"{d.get('exc_type')}: {d.get('message')}" if d.get("message") else str(d.get("exc_type"))
    line = (
        f"the loop waits in queue get in the training process (no workers); thread {d.get('thread')!r} "
        f"died with {exc}{at}"
        + (f" {before:g} s before the stall" if before is not None and before >= 0 else " as the stall began")
    )
    return {
        "producer": {"thread": d.get("thread"), "exc_type": d.get("exc_type"), "message": d.get("message")},
        "producer_frames": list(d.get("frames") or ())[:MAX_THREAD_FRAMES],
        "waiting_workers": [],
        "waiting_in": ["queue get"],
        "before_stall_s": before,
        "link": line,
        "kind": "thread",
    }


def _report_ts(ctx: Context) -> float | None:
    try:
        return _dt.datetime.fromisoformat(str(ctx.report.get("created_at"))).timestamp()
    except (TypeError, ValueError):
        return None


def _waiting_workers(ctx: Context) -> list[Mapping[str, Any]]:
    out = []
    for p in ctx.processes:
        if p.get("role") != "worker" or p.get("status") != "blocked":
            continue
        io = p.get("io_wait") if isinstance(p.get("io_wait"), Mapping) else {}
        if p.get("waiting_in") in _WAITS or io.get("kind") in _PIPE_KINDS:
            out.append(p)
    return out


def judge(ctx: Context) -> dict[str, Any] | None:
    """The vanished process most likely to be the workers' producer, with the link; None if none."""
    if ctx.classification not in ("deadlock", "io-wait", "main-blocked"):
        return None
    now = _report_ts(ctx)
    stall_s = (ctx.report.get("progress") or {}).get("stall_s")
    stall_start = now - stall_s if now is not None and isinstance(stall_s, (int, float)) else None
    thread = _thread_link(ctx, stall_start)
    if thread is not None:
        return thread
    if ctx.classification == "main-blocked":
        return None
    waiting = _waiting_workers(ctx)
    gone = [e for e in ctx.signal_events(GONE) if isinstance(e.get("pid"), int)]
    if not waiting or not gone:
        return None

    def when(e: Mapping[str, Any]) -> float | None:
        ts = e.get("last_seen_ts") or e.get("gone_seen_ts")
        return float(ts) if isinstance(ts, (int, float)) else None

    if stall_start is not None:
        gone = [e for e in gone if when(e) is not None and stall_start - RECENT_S <= when(e) <= stall_start + 5.0]  # type: ignore[operator]
    if not gone:
        return None
    g = max(gone, key=lambda e: when(e) or 0.0)  # the last to go before the stall
    before = round(stall_start - when(g), 1) if stall_start is not None and when(g) is not None else None  # type: ignore[operator]
    how = (
        f"was killed by {g['exit_signal']}"
        if g.get("exit_signal")
        else f"exited with status {g['exit_status']}"
        if g.get("exit_status") is not None
        else "vanished"
    )
    kinds = sorted({str(p.get("waiting_in") if p.get("waiting_in") in _WAITS else "pipe read") for p in waiting})
    name = f" ({g['name']})" if g.get("name") else ""
    line = (
        f"{len(waiting)} worker(s) wait in {', '.join(kinds)}; process {g['pid']}{name}, started by the training "
        f"process, {how}"
        + (f" {before:g} s before the stall" if before is not None and before >= 0 else " as the stall began")
    )
    return {
        "producer": {k: g.get(k) for k in ("pid", "name", "exit_signal", "exit_status", "last_seen_ts")},
        "waiting_workers": [p.get("pid") for p in waiting],
        "waiting_in": kinds,
        "before_stall_s": before,
        "link": line,
        "kind": "process",
    }


def _enrich(pb: Playbook, ctx: Context, ev: dict[str, Any]) -> str | None:
    found = ctx.signal_events(LINK)
    got = dict(found[-1]) if found else judge(ctx)
    if not got:
        return None
    prod = got["producer"]
    ev["link"] = got["link"]
    if got.get("before_stall_s") is not None and got["before_stall_s"] >= 0:
        ev["before_stall_s"] = got["before_stall_s"]
    if got.get("kind") == "thread":
        exc = f"{prod.get('exc_type')}: {prod.get('message')}" if prod.get("message") else str(prod.get("exc_type"))
        ev["producer"] = f"thread {prod.get('thread')!r} of the training process, died with {exc}"
        if got.get("producer_frames"):
            ev["producer_frames"] = got["producer_frames"]
        return "thread"
    how = prod.get("exit_signal") or (
        f"exit status {prod['exit_status']}" if prod.get("exit_status") is not None else "exit unknown"
    )
    ev["producer"] = f"pid {prod.get('pid')}" + (f" ({prod['name']})" if prod.get("name") else "") + f", {how}"
    ev["waiting_workers"] = ", ".join(str(p) for p in got["waiting_workers"])
    return "process"


FAILURE = Failure(
    playbook=PLAYBOOK,
    detectors=(ProcessGone, ThreadDied),
    enrich=_enrich,
    derive=judged_once(LINK, judge),
    evidence_forms={
        "link": "text",
        "producer": "text",
        "producer_frames": "stack",
        "waiting_workers": "text",
        "before_stall_s": "seconds",
    },
    events={contract.THREAD_DIED: thread_died_event},
    examples=("producer_gone",),
)
