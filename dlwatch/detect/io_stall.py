"""The ``io-stall`` failure: the workers wait on I/O (a socket, a file) that does not come.

No detector of its own: a stall is its own trigger and :func:`dlwatch.detect.classify.io_wait`
names what each process waits on (``io_wait`` in the report's processes).  This module
measures the finding's evidence: who waits, in which thread, on what peer or file, and
for how long.
"""

from __future__ import annotations

from typing import Any, Mapping

from dlwatch.detect.evidence import MAX_WORKERS, Context
from dlwatch.detect.registry import Failure
from dlwatch.wire.playbooks import Playbook

PLAYBOOK = "io-stall"


def _enrich(pb: Playbook, ctx: Context, ev: dict[str, Any]) -> str | None:
    """Which workers wait, in which thread, on what (peer ip:port or file), and for how long."""
    waiting = [p for p in ctx.processes if isinstance(p.get("io_wait"), Mapping)]
    waiting.sort(
        key=lambda p: (
            p.get("role") != "worker",
            p.get("worker_id") if isinstance(p.get("worker_id"), int) else 1 << 30,
        )
    )
    views = []
    peers: dict[str, int] = {}
    for p in waiting:
        w = p["io_wait"]
        view = {
            "pid": p.get("pid"),
            "role": p.get("role"),
            "worker_id": p.get("worker_id"),
            "kind": w.get("kind"),
            "thread": w.get("thread"),
            "tid": w.get("tid"),
            "via": w.get("via"),
            "peer": w.get("peer"),
            "tcp_state": w.get("tcp_state"),
            "file": w.get("file"),
            "syscall": w.get("syscall"),
            "basis": w.get("basis"),
            "where": w.get("where") or p.get("where"),
        }
        if not view["peer"] and w.get("sockets"):  # poll on one of several sockets: name them all
            view["sockets"] = [
                f"{s.get('remote')} {s.get('tcp_state')}" for s in w["sockets"][:4] if isinstance(s, Mapping)
            ]
        views.append({k: v for k, v in view.items() if v is not None})
        key = w.get("peer") or w.get("file")
        if key:
            peers[str(key)] = peers.get(str(key), 0) + 1
    stall_s = (ctx.report.get("progress") or {}).get("stall_s")
    if views:  # one line for people first: who waits, on what, how, for how long
        v0 = views[0]
        who = f"worker {v0['worker_id']}" if v0.get("worker_id") is not None else str(v0.get("role") or "process")
        more = f" (+{len(views) - 1} more)" if len(views) > 1 else ""
        thread = f", thread {v0.get('thread') or v0.get('tid')}" + (f" via {v0['via']}" if v0.get("via") else "")
        on = v0.get("peer") or v0.get("file") or ", ".join(v0.get("sockets") or ()) or "?"
        state = f" {v0['tcp_state']}" if v0.get("tcp_state") else ""
        since = f" for {stall_s:.1f} s" if isinstance(stall_s, (int, float)) else ""
        ev["wait"] = f"{who} (pid {v0.get('pid')}{thread}): {v0.get('kind')} on {on}{state}{since}{more}"
        ev["workers"] = views[:MAX_WORKERS]
        if len(views) > MAX_WORKERS:
            ev["workers_not_shown"] = len(views) - MAX_WORKERS
    if peers:
        ev["peers"] = [{"peer": k, "workers": n} for k, n in sorted(peers.items(), key=lambda kv: -kv[1])]
    if stall_s is not None:
        ev["stall_s"] = stall_s
    if ctx.loader.get("timeout") is not None:
        ev["timeout"] = ctx.loader.get("timeout")
    return None


FAILURE = Failure(
    playbook=PLAYBOOK,
    enrich=_enrich,
    evidence_forms={"wait": "text", "peers": "table", "stall_s": "seconds"},
    examples=("io_stall",),
)
