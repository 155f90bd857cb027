"""The ``fd-exhaustion`` failure: a process's fds above a share of its limit, or heading there.

The judgement is :func:`dlwatch.detect.thresholds.fd_pressure` (pure, shared with the
matcher); the detector only decides which processes to judge each poll.  For the matcher
this module judges the timeline again (``fd_pressure`` from the samples when the report
holds no such event), names the processes at their limit (the fact behind a playbook's
``fd_at_limit`` condition) and measures the evidence: the fullest process, its fd kinds
and the cause they point at.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterable, Mapping

from dlwatch import _regex
from dlwatch.detect import thresholds as th
from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import MAX_EVENTS, MAX_WORKERS, Context, strip_event
from dlwatch.detect.registry import Failure
from dlwatch.model import ProcSample
from dlwatch.wire.playbooks import Playbook

PLAYBOOK = "fd-exhaustion"

TREND_WINDOW = 30  # samples the fd trend is fitted on


class FdPressure(Detector):
    playbook = PLAYBOOK
    defaults = {
        "fd_share": th.FD_SHARE,
        "horizon_s": th.FD_HORIZON_S,
        "min_rise": th.FD_MIN_RISE,
        "min_window_s": th.FD_MIN_WINDOW_S,
        "trend_min_share": th.FD_TREND_MIN_SHARE,
    }

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        t = self.thresholds
        floor = min(t["fd_share"], t["trend_min_share"])
        for p in view.procs.values():
            if p.gone or len(p.history) < 2:
                continue
            last = p.history[-1]
            if last.num_fds is not None and last.fd_limit and last.num_fds < floor * last.fd_limit:
                continue  # below both of fd_pressure's bars: it would say None; skip the fit
            recent = list(itertools.islice(p.history, max(0, len(p.history) - TREND_WINDOW), None))
            evidence = th.fd_pressure(recent, **t)
            if evidence:
                if not evidence.get("fds") and p.last_fds is not None:
                    evidence["fds"] = p.last_fds.to_dict()
                return [
                    {
                        "ts": view.now,
                        "event": "threshold",
                        "signal": "fd_pressure",
                        "pid": p.pid,
                        "role": p.role,
                        "worker_id": p.worker_id,
                        **evidence,
                    }
                ]
        return ()


# --------------------------------------------------------------------------- the matcher's side

# Every pattern here runs on text the training program controls: RE2 (linear time), bounded text.
_SHM_FD_TEXT = _regex.compile(
    r"Communication with the workers is no longer possible|received 0 items of "
    r"ancdata|unable to open shared memory object"
)
_OPENS_FILE = _regex.compile(r"\bopen\(|Image\.open|np\.load|h5py|lmdb")


def _proc_fd_view(p: Mapping[str, Any], s: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "pid": p.get("pid"),
        "role": p.get("role"),
        "worker_id": p.get("worker_id"),
        "num_fds": s.get("num_fds"),
        "fd_limit": s.get("fd_limit"),
        "fds": s.get("fds"),
    }


def _from_timeline(ctx: Context) -> list[dict[str, Any]]:
    """``fd_pressure`` judged again over the timeline's samples, when the report holds no such event."""
    if ctx.signal_events("fd_pressure"):
        return []
    report = ctx.report
    histories: dict[int, list[ProcSample]] = {}
    for rec in report.get("timeline") or ():
        if not isinstance(rec, Mapping) or rec.get("kind") != "sample":
            continue
        for p in rec.get("procs") or ():
            if not isinstance(p, Mapping) or not isinstance(p.get("pid"), int):
                continue
            try:
                histories.setdefault(p["pid"], []).append(
                    ProcSample(
                        pid=p["pid"],
                        ts=float(p.get("ts", rec.get("ts", 0.0)) or 0.0),
                        num_fds=p.get("num_fds"),
                        fd_limit=p.get("fd_limit"),
                        gone=bool(p.get("gone")),
                    )
                )
            except (TypeError, ValueError):
                continue
    out = []
    t = ctx.thresholds(PLAYBOOK)
    for hist in histories.values():
        hist.sort(key=lambda s: s.ts)
        ev = th.fd_pressure(
            hist,
            fd_share=t.get("fd_share", th.FD_SHARE),
            horizon_s=t.get("horizon_s", th.FD_HORIZON_S),
            min_rise=t.get("min_rise", th.FD_MIN_RISE),
            min_window_s=t.get("min_window_s", th.FD_MIN_WINDOW_S),
            trend_min_share=t.get("trend_min_share", th.FD_TREND_MIN_SHARE),
        )
        if ev is not None:
            out.append({"event": "threshold", **ev, "derived": "timeline"})
    return out


def _at_limit(ctx: Context) -> list[dict[str, Any]]:
    """The processes at or near their fd limit now, or in an ``fd_pressure`` event measured before."""
    t = ctx.thresholds(PLAYBOOK)
    share = t.get("at_limit_share", th.FD_AT_LIMIT_SHARE)
    margin = int(t.get("at_limit_margin", th.FD_AT_LIMIT_MARGIN))
    out: list[dict[str, Any]] = []
    pids: set[Any] = set()
    for p in ctx.processes:
        s = p.get("sample") or {}
        if th.fd_near_limit(s.get("num_fds"), s.get("fd_limit"), share=share, margin=margin):
            out.append(_proc_fd_view(p, s))
            pids.add(p.get("pid"))
    for ev in ctx.signal_events("fd_pressure"):  # measured before the process died or was re-read
        if ev.get("pid") not in pids and th.fd_near_limit(
            ev.get("num_fds"), ev.get("fd_limit"), share=share, margin=margin
        ):
            out.append(
                {
                    "pid": ev.get("pid"),
                    "role": ev.get("role"),
                    "worker_id": ev.get("worker_id"),
                    "num_fds": ev.get("num_fds"),
                    "fd_limit": ev.get("fd_limit"),
                    "fds": ev.get("fds"),
                    "from": "fd_pressure event",
                }
            )
            pids.add(ev.get("pid"))
    return out


def _fd_cause(fds: Mapping[str, Any] | None, num_fds: int | None, min_share: float) -> str | None:
    if not fds or not num_fds:
        return None
    files, shm = int(fds.get("file") or 0), int(fds.get("shm") or 0)
    kind, count = ("regular-files", files) if files >= shm else ("shm-fds", shm)
    return kind if count > 0 and count >= min_share * num_fds else None


def _enrich(pb: Playbook, ctx: Context, ev: dict[str, Any]) -> str | None:
    def share(v: Mapping[str, Any]) -> float:
        return (v.get("num_fds") or 0) / v["fd_limit"] if v.get("fd_limit") else 0.0

    fd_share = pb.threshold("fd_share", th.FD_SHARE)
    pressure = ctx.signal_events("fd_pressure")
    # the processes that tell the story: at the limit, above the share, or seen climbing
    at_limit = ctx.fact("fd_at_limit") or []
    views = list(at_limit)
    for p in ctx.processes:
        view = _proc_fd_view(p, p.get("sample") or {})
        if share(view) >= fd_share and all(v.get("pid") != view["pid"] for v in views):
            views.append(view)
    for e in reversed(pressure):
        if all(v.get("pid") != e.get("pid") for v in views) and e.get("num_fds") is not None:
            views.append({k: e.get(k) for k in ("pid", "role", "worker_id", "num_fds", "fd_limit", "fds")})
    views.sort(key=share, reverse=True)
    cause, basis = None, None
    if views:
        top = views[0]
        fds = top.get("fds") or {}
        ev.update(
            {
                "pid": top.get("pid"),
                "role": top.get("role"),
                "worker_id": top.get("worker_id"),
                "num_fds": top.get("num_fds"),
                "fd_limit": top.get("fd_limit"),
                "fd_share": round(share(top), 4) if top.get("fd_limit") else None,
            }
        )
        if fds:
            ev["fds"] = {k: fds.get(k) for k in ("file", "shm", "socket", "pipe", "other", "shm_bytes")}
            ev["top_files"] = [list(x) for x in (fds.get("top_files") or ())][:5]
        min_share = pb.threshold("cause_min_share", 0.3)
        # the fullest process may lack an fd breakdown: take the next one (or a pressure event) that has it
        for v in views + list(reversed(pressure)):
            cause = _fd_cause(v.get("fds"), v.get("num_fds"), min_share)
            if cause:
                basis = f"fd kinds of pid {v.get('pid')}"
                break
    else:  # nothing near a limit now (a failed worker is gone): show the counts as context only
        counts = [_proc_fd_view(p, p.get("sample") or {}) for p in ctx.processes]
        counts = [
            {k: c.get(k) for k in ("pid", "role", "worker_id", "num_fds", "fd_limit")}
            for c in counts
            if c.get("num_fds") is not None
        ]
        if counts:
            ev["fd_counts"] = counts[: MAX_WORKERS + 1]
    if at_limit:
        ev["at_fd_limit"] = [
            {k: a.get(k) for k in ("pid", "role", "worker_id", "num_fds", "fd_limit")} for a in at_limit
        ]
    strategy = ctx.loader.get("sharing_strategy")
    if strategy:
        ev["sharing_strategy"] = strategy
    if cause is None and _SHM_FD_TEXT.search(ctx.text):
        cause, basis = "shm-fds", "torch's error is about passing shared memory by fd"
    if cause is None and strategy == "file_system":
        cause, basis = "regular-files", "the file_system strategy keeps no fd per shared tensor"
    if cause is None and ctx.exception and _OPENS_FILE.search(ctx.text):
        cause, basis = "regular-files", "the failing call in the traceback opens a file"
    ev["cause"] = cause or "unknown"
    if basis:
        ev["cause_basis"] = basis
    if pressure:
        ev["pressure"] = [strip_event(e) for e in pressure[-MAX_EVENTS:]]
    return cause


FAILURE = Failure(
    playbook=PLAYBOOK,
    detectors=(FdPressure,),
    enrich=_enrich,
    derive=_from_timeline,
    facts={"fd_at_limit": _at_limit},
    evidence_forms={
        "num_fds": "count",
        "fd_limit": "count",
        "fds": "fds",
        "top_files": "text",
        "sharing_strategy": "text",
    },
    examples=("fd_exhaustion",),
)
