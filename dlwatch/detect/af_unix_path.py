"""The ``af-unix-path-too-long`` failure: the workers' socket path is too long, so no batch arrives.

Under torch's ``file_descriptor`` sharing strategy each worker binds a Unix socket under
``$TMPDIR/pymp-XXXXXXXX/`` to hand the training process its batch's fds.  A ``$TMPDIR`` of 76
bytes or more (a job scheduler's per-job scratch directory, a deep home directory) makes that path
longer than Linux's 107 bytes: the worker's queue feeder thread dies with ``OSError: AF_UNIX path
too long`` (on stderr only), the worker lives on, and the loop waits forever with every process
idle: a stall classified ``lost-batch`` that nothing else explains.  With ``forkserver`` the
training process binds the same kind of path to start its server and raises the same error.  Under
``file_system`` torch's shared-memory manager binds ``$TMPDIR/torch-shm-dir-XXXXXX/manager.sock``
(74 bytes of ``$TMPDIR`` are enough) and a worker raises ``torch_shm_manager at "...": Invalid
argument``: matched with the training process's finding, never on that text alone.

The training process checks the path as each iterator starts its workers
(``dlwatch.inproc.sockpath``, no side effects) and sends ``af_unix_path`` when it is too long;
kept here as an observation, it names the cause of the stall that follows.  The exception form is
matched on torch's own text by the playbook.
"""

from __future__ import annotations

from typing import Any, Mapping

from dlwatch.detect.base import Observer
from dlwatch.detect.evidence import Context, judged_once
from dlwatch.detect.registry import Failure
from dlwatch.wire import contract

PLAYBOOK = "af-unix-path-too-long"
EVENT = contract.AF_UNIX_PATH.name
STALL = "af_unix_path_stall"  # the stall judged to be this failure (a threshold signal, derived)
FIELDS = ("socket", "path_len", "path_max", "base", "sharing_strategy", "start_method", "batches")
MAX_BASE_CHARS = 4096  # PATH_MAX: a longer "directory" is not one
MAX_KEPT = 64  # one an iterator that starts workers; a run of many epochs keeps the first ones


def af_unix_path_event(ev: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of ``af_unix_path`` (the training process wrote it: typed, bounded, nothing else kept)."""
    length, limit, base = ev.get("path_len"), ev.get("path_max"), ev.get("base")
    if type(length) is not int or type(limit) is not int or not isinstance(base, str) or length <= limit:
        return None
    out = {
        "event": EVENT,
        "ts": ev.get("ts"),
        "pid": ev.get("pid"),
        "path_len": length,
        "path_max": limit,
        "base": base[:MAX_BASE_CHARS],
    }
    for key in ("socket", "sharing_strategy", "start_method"):
        out[key] = ev[key][:64] if isinstance(ev.get(key), str) else None
    out["batches"] = ev["batches"] if type(ev.get("batches")) is int else None
    return out


class SocketPathTooLong(Observer):
    """Keeps each of the training process's findings as an observation: the evidence of a stall that follows."""

    playbook = PLAYBOOK
    event = EVENT
    keys = FIELDS
    max_kept = MAX_KEPT


def judge(ctx: Context) -> dict[str, Any] | None:
    """The stall this failure explains: the loop waits for data, and not one batch arrived since an
    iterator started workers whose socket path was too long.  A loader whose batches hold no tensor
    sends no fd and runs; a batch after the check means the path stopped nothing: no claim then."""
    seen = [e for e in ctx.signal_events(EVENT) if e.get("event") == "observation"]
    progress = ctx.report.get("progress")
    if not seen or not isinstance(progress, Mapping) or progress.get("state") != "waiting_for_data":
        return None
    last = seen[-1]
    before, now = last.get("batches"), progress.get("batches")
    if type(before) is not int or type(now) is not int or now != before:
        return None
    out = {k: last.get(k) for k in FIELDS if k != "batches"}
    whose = (
        "torch's shared-memory manager binds its socket"
        if last.get("socket") == "torch_shm_manager"
        else "each worker binds a socket to send a batch"
    )
    out["link"] = (
        f"no batch arrived since the iterator started its workers ({now} in all): under the "
        f"{last.get('sharing_strategy') or '?'} strategy {whose} under {last.get('base')!r}, and that "
        f"path is {last.get('path_len')} bytes, {last.get('path_max')} at most on Linux"
    )
    return out


def _enrich(pb: Any, ctx: Context, ev: dict[str, Any]) -> str | None:
    """The stall's link and the path's figures; for the exception form, the figures the training
    process sent (when it did) beside torch's text."""
    found = ctx.signal_events(STALL) or [e for e in ctx.signal_events(EVENT) if e.get("event") == "observation"]
    if found:
        got = found[-1]
        ev.update({k: got[k] for k in ("link", *FIELDS) if k != "batches" and k not in ev and got.get(k) is not None})
    return None


FAILURE = Failure(
    playbook=PLAYBOOK,
    detectors=(SocketPathTooLong,),
    enrich=_enrich,
    derive=judged_once(STALL, judge),
    evidence_forms={
        "link": "text",
        "socket": "text",
        "path_len": "count",
        "path_max": "count",
        "base": "text",
        "sharing_strategy": "text",
    },
    events={contract.AF_UNIX_PATH: af_unix_path_event},
    examples=("af_unix_path_too_long",),
)
