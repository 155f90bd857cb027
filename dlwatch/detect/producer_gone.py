"""The ``producer-gone`` failure: the workers wait on a queue or pipe whose producer process died.

A decoder, a prefetcher or a reader process that the training process started feeds the
DataLoader's workers through a ``multiprocessing.Queue`` or a pipe.  When it dies (the OOM
killer, a crash, a ``kill``), nothing tells the workers: they block in ``get()`` forever and
the stall is a ``deadlock`` by every sign, but no lock is involved and the fork-lock remedy
is wrong.  The monitor already tracks every process of the job; this module notes each one
that vanished (its pid, name, exit signal or status, when it was last seen), and links it to
a stall whose workers wait in a queue get or a named-pipe read: "workers wait in queue get;
process 1234 (started by the training process) was killed by SIGKILL 2 s before the stall".
"""

from __future__ import annotations

import datetime as _dt
from typing import Any, Iterable, Mapping

from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import Context
from dlwatch.detect.registry import Failure
from dlwatch.detect.worker_killed import signal_name, wait_status_signal
from dlwatch.wire.playbooks import Playbook

PLAYBOOK = "producer-gone"
GONE = "process_gone"
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
    if ctx.classification not in ("deadlock", "io-wait"):
        return None
    waiting = _waiting_workers(ctx)
    gone = [e for e in ctx.signal_events(GONE) if isinstance(e.get("pid"), int)]
    if not waiting or not gone:
        return None
    now = _report_ts(ctx)
    stall_s = (ctx.report.get("progress") or {}).get("stall_s")
    stall_start = now - stall_s if now is not None and isinstance(stall_s, (int, float)) else None

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
    }


def _derive(ctx: Context) -> list[dict[str, Any]]:
    if ctx.signal_events(LINK):
        return []
    got = judge(ctx)
    return [{"event": "threshold", "signal": LINK, **got}] if got else []


def _enrich(pb: Playbook, ctx: Context, ev: dict[str, Any]) -> str | None:
    found = ctx.signal_events(LINK)
    got = dict(found[-1]) if found else judge(ctx)
    if not got:
        return None
    prod = got["producer"]
    how = prod.get("exit_signal") or (
        f"exit status {prod['exit_status']}" if prod.get("exit_status") is not None else "exit unknown"
    )
    ev["link"] = got["link"]
    ev["producer"] = f"pid {prod.get('pid')}" + (f" ({prod['name']})" if prod.get("name") else "") + f", {how}"
    ev["waiting_workers"] = ", ".join(str(p) for p in got["waiting_workers"])
    if got.get("before_stall_s") is not None and got["before_stall_s"] >= 0:
        ev["before_stall_s"] = got["before_stall_s"]
    return None


FAILURE = Failure(
    playbook=PLAYBOOK,
    detectors=(ProcessGone,),
    enrich=_enrich,
    derive=_derive,
    evidence_forms={
        "link": "text",
        "producer": "text",
        "waiting_workers": "text",
        "before_stall_s": "seconds",
    },
    examples=("producer_gone",),
)
