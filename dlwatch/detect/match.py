"""The matcher: a draft report dict and the playbooks in, findings (most likely first) out.

Pure: it reads the report (docs/report-schema.md: ``exception``,
``classification``, ``processes``, ``system``, ``loader``, ``events``,
``timeline``) and never the system.  Each playbook signal is a conjunction of
conditions (see :class:`dlwatch.wire.playbooks.Signal`); a playbook matches when any
of its signals does, with the best signal's confidence (plus a little for each
further signal that agrees).  The evidence of a finding is what matched plus
what was measured for that failure; a playbook with nothing that matched makes
no finding, so a healthy report makes none at all.

Detector events it reads (emitted by the monitor, see dlwatch.detect.thresholds,
dlwatch.inproc.shapes and dlwatch.inproc.rngcheck), matched by their ``signal`` key (or by
``event`` for the same name):
``{"event": "threshold", "signal": "fd_pressure" | "shm_pressure" | "batch_shape" | "rng_duplicate"
| "rng_epoch_repeat", ...}`` and the raw ``{"event": "rng_fingerprint", "worker_id", "pid", "epoch",
"stage", "fingerprints", "states", "drawn", "rebound"}`` (judged by :func:`dlwatch.detect.rng.judge`).
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from dlwatch import _regex
from dlwatch.detect import thresholds as th
from dlwatch.detect import rng as rng_detect
from dlwatch._log import get_logger
from dlwatch.model import Finding, ProcSample
from dlwatch.wire.playbooks import Hint, Playbook, Signal

__all__ = ["match", "errnos_in"]

# Every pattern here runs on text the training program controls: RE2 (linear time), bounded text.
_ERRNO_BRACKET = _regex.compile(r"\[Errno (\d+)\]")
_ERRNO_TORCH = _regex.compile(r":\s+[A-Za-z][A-Za-z ,'-]*? \((\d+)\)")  # "...: No space left on device (28)"
_SHM_FD_TEXT = _regex.compile(
    r"Communication with the workers is no longer possible|received 0 items of "
    r"ancdata|unable to open shared memory object"
)
_OPENS_FILE = _regex.compile(r"\bopen\(|Image\.open|np\.load|h5py|lmdb")
_LIBRARY_PATH = _regex.compile(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python3[^/\\]*[/\\]|[/\\]torch[/\\]")
_MAX_FRAMES = 8
_MAX_WORKERS = 8
_MAX_EVENTS = 5

log = get_logger(__name__)


def errnos_in(exception: Mapping[str, Any] | None) -> tuple[int, ...]:
    """The exception's errno plus any that torch or the OS printed into its text, in order."""
    if not exception:
        return ()
    found: list[int] = []
    if isinstance(exception.get("errno"), int):
        found.append(exception["errno"])
    text = _exception_text(exception)
    for rx in (_ERRNO_BRACKET, _ERRNO_TORCH):
        found.extend(int(m.group(1)) for m in rx.finditer(text))
    return tuple(dict.fromkeys(found))


def _exception_text(exception: Mapping[str, Any]) -> str:
    """Message and traceback, bounded: patterns never see more than _regex.MAX_TEXT_CHARS of it."""
    return _regex.bound_text(f"{exception.get('message') or ''}\n{exception.get('traceback') or ''}")


def _field(value: Any) -> str:
    return str(value or "")[: _regex.MAX_FIELD_CHARS]


def match(report: Mapping[str, Any], playbooks: Iterable[Playbook]) -> list[Finding]:
    playbooks = tuple(playbooks)
    ctx = _Context(report, playbooks)
    findings: list[tuple[float, int, Finding]] = []
    for order, pb in enumerate(playbooks):
        try:
            finding = _match_one(pb, ctx)
        except Exception as exc:  # one broken user playbook must not hide the others
            finding = None
            log.warning("playbook_match_failed", playbook=pb.id, source=pb.source, error=f"{type(exc).__name__}: {exc}")
        if finding is not None:
            findings.append((finding.confidence, order, finding))
    findings.sort(key=lambda t: (-t[0], t[1]))
    return [f for _, _, f in findings]


# --------------------------------------------------------------------------- context


def _excerpt(text: str, m: Any, width: int = 200) -> str:
    start = text.rfind("\n", 0, m.start()) + 1
    end = text.find("\n", m.end())
    line = text[start : end if end >= 0 else len(text)].strip()
    return line if len(line) <= width else line[: width - 1] + "…"


def _frame_str(f: Mapping[str, Any]) -> str:
    where = f.get("filename") or "?"
    line = f.get("line")
    return f"{f.get('function') or '?'} ({where}{':' + str(line) if line else ''})"


def _threads(proc: Mapping[str, Any]) -> list[list[Mapping[str, Any]]]:
    stack = proc.get("stack") or {}
    out = []
    for t in stack.get("threads") or ():
        frames = [f for f in (t.get("frames") or ()) if isinstance(f, Mapping)]
        if frames:
            out.append(_cut_parent_frames(frames))
    return out


def _cut_parent_frames(frames: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    # a forked worker's stack continues below _worker_loop into the parent's frames
    for i, f in enumerate(frames):
        if f.get("function") == "_worker_loop":
            return frames[: i + 1]
    return frames


def _frame_matches(cond: Signal | Hint, f: Mapping[str, Any]) -> bool:
    function = _field(f.get("function"))
    filename = _field(f.get("filename"))
    if isinstance(cond, Hint) and cond.native is not None and bool(f.get("native")) != cond.native:
        return False
    if cond.frame is not None and not (cond.frame.search(function) or cond.frame.search(filename)):
        return False
    if cond.frame_function is not None and not cond.frame_function.search(function):
        return False
    if cond.frame_filename is not None and not cond.frame_filename.search(filename):
        return False
    return True


class _Context:
    def __init__(self, report: Mapping[str, Any], playbooks: Sequence[Playbook]) -> None:
        self.report = report
        self.exception: Mapping[str, Any] | None = report.get("exception") or None
        exc = self.exception or {}
        self.text = _exception_text(exc)
        self.errnos = errnos_in(self.exception)
        self.classification = report.get("classification")
        self.loader: Mapping[str, Any] = report.get("loader") or {}
        self.system: Mapping[str, Any] = report.get("system") or {}
        self.processes = [p for p in (report.get("processes") or ()) if isinstance(p, Mapping)]
        fd_pb = next((p for p in playbooks if p.id == "fd-exhaustion"), None)
        self.fd_thresholds = fd_pb.thresholds if fd_pb is not None else {}
        self.events = self._collect_events(report)
        self.at_limit = self._at_limit()

    # events: report["events"] plus event records of the timeline, deduplicated
    def _collect_events(self, report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
        out: list[Mapping[str, Any]] = []
        seen: set[tuple[Any, ...]] = set()
        records = list(report.get("events") or ())
        records += [r for r in (report.get("timeline") or ()) if isinstance(r, Mapping) and r.get("kind") == "event"]
        for ev in records:
            if not isinstance(ev, Mapping):
                continue
            key = (
                ev.get("ts"),
                ev.get("event"),
                ev.get("signal"),
                ev.get("pid"),
                ev.get("worker_id"),
                ev.get("batch_index"),
                ev.get("stage"),
            )
            if key in seen:
                continue
            seen.add(key)
            out.append(ev)
        out.extend(self._rng_from_fingerprints(out))
        if not self._signal_events(out, "fd_pressure"):
            out.extend(self._fd_from_timeline(report))
        return out

    @staticmethod
    def _signal_events(events: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
        return [e for e in events if e.get("signal") == name or e.get("event") == name]

    def signal_events(self, name: str) -> list[Mapping[str, Any]]:
        return self._signal_events(self.events, name)

    @classmethod
    def _rng_from_fingerprints(cls, events: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The rng detector's signals, judged again from raw fingerprint events (the same rule),
        for each signal the report does not already hold."""
        prints = [ev for ev in events if ev.get("event") == "rng_fingerprint"]
        if not prints:
            return []
        dups, repeats = rng_detect.judge(prints)
        checked = len({(ev.get("pid"), ev.get("worker_id")) for ev in prints})
        out = []
        for name, key, found in (("rng_duplicate", "duplicates", dups), ("rng_epoch_repeat", "repeats", repeats)):
            if found and not cls._signal_events(events, name):
                out.append(
                    {
                        "event": "threshold",
                        "signal": name,
                        key: found,
                        "num_workers_checked": checked,
                        "derived": "rng_fingerprint events",
                    }
                )
        return out

    def _fd_from_timeline(self, report: Mapping[str, Any]) -> list[dict[str, Any]]:
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
        t = self.fd_thresholds
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

    def _at_limit(self) -> list[dict[str, Any]]:
        t = self.fd_thresholds
        share = t.get("at_limit_share", th.FD_AT_LIMIT_SHARE)
        margin = int(t.get("at_limit_margin", th.FD_AT_LIMIT_MARGIN))
        out: list[dict[str, Any]] = []
        pids: set[Any] = set()
        for p in self.processes:
            s = p.get("sample") or {}
            if th.fd_near_limit(s.get("num_fds"), s.get("fd_limit"), share=share, margin=margin):
                out.append(self._proc_fd_view(p, s))
                pids.add(p.get("pid"))
        for ev in self.signal_events("fd_pressure"):  # measured before the process died or was re-read
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

    @staticmethod
    def _proc_fd_view(p: Mapping[str, Any], s: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "pid": p.get("pid"),
            "role": p.get("role"),
            "worker_id": p.get("worker_id"),
            "num_fds": s.get("num_fds"),
            "fd_limit": s.get("fd_limit"),
            "fds": s.get("fds"),
        }

    def frames(self, role: str) -> Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]]:
        for p in self.processes:
            if role != "any" and p.get("role") != role:
                continue
            for frames in _threads(p):
                for f in frames:
                    yield p, f


# --------------------------------------------------------------------------- evaluation


def _eval_signal(sig: Signal, ctx: _Context) -> dict[str, Any] | None:
    hit: dict[str, Any] = {"signal": sig.name, "confidence": sig.confidence}
    if sig.description:
        hit["description"] = sig.description
    exc = ctx.exception
    needs_exc = (
        sig.exception_type is not None
        or sig.exception_text is not None
        or bool(sig.errno)
        or sig.from_loader is not None
    )
    if needs_exc and not exc:
        return None
    if sig.not_errno and set(sig.not_errno) & set(ctx.errnos):
        return None
    if exc:
        if sig.exception_type is not None:
            if not sig.exception_type.search(_field(exc.get("type"))):
                return None
            hit["exception_type"] = exc.get("type")
        if sig.exception_text is not None:
            m = sig.exception_text.search(ctx.text)
            if m is None:
                return None
            hit["matched_text"] = _excerpt(ctx.text, m)
        if sig.errno:
            hits = [e for e in ctx.errnos if e in sig.errno]
            if not hits:
                return None
            hit["errno"] = hits[0]
        if sig.from_loader is not None:
            if bool(exc.get("from_loader")) != sig.from_loader:
                return None
            hit["from_loader"] = sig.from_loader
    if sig.classification:
        if ctx.classification not in sig.classification:
            return None
        hit["classification"] = ctx.classification
    if sig.signal is not None:
        events = ctx.signal_events(sig.signal)
        if not events:
            return None
        hit["events"] = len(events)
    if sig.fd_at_limit is not None:
        if bool(ctx.at_limit) != sig.fd_at_limit:
            return None
        if ctx.at_limit:
            hit["at_fd_limit"] = [a.get("pid") for a in ctx.at_limit]
    if sig.has_frame_condition:
        found = next(((p, f) for p, f in ctx.frames(sig.role) if _frame_matches(sig, f)), None)
        if found is None:
            return None
        p, f = found
        hit["frame"] = {
            "pid": p.get("pid"),
            "role": p.get("role"),
            "worker_id": p.get("worker_id"),
            "frame": _frame_str(f),
        }
    return hit


def _eval_hints(pb: Playbook, ctx: _Context) -> list[tuple[Hint, dict[str, Any]]]:
    out: list[tuple[Hint, dict[str, Any]]] = []
    names: set[str] = set()
    for hint in pb.hints:
        if hint.name in names:
            continue
        found = _find_hint(hint, ctx)
        if found is not None:
            names.add(hint.name)
            out.append((hint, found))
    return out


def _find_hint(hint: Hint, ctx: _Context) -> dict[str, Any] | None:
    has_frame = hint.frame is not None or hint.frame_function is not None or hint.frame_filename is not None
    for p in ctx.processes:
        if hint.role != "any" and p.get("role") != hint.role:
            continue
        if hint.waiting_in is not None and not hint.waiting_in.search(_field(p.get("waiting_in"))):
            continue
        where = {"hint": hint.name, "pid": p.get("pid"), "role": p.get("role"), "worker_id": p.get("worker_id")}
        if not has_frame:
            return {**where, "waiting_in": p.get("waiting_in")}
        for frames in _threads(p):
            for f in frames:
                if _frame_matches(hint, f):
                    return {**where, "frame": _frame_str(f)}
    return None


def _match_one(pb: Playbook, ctx: _Context) -> Finding | None:
    hits = [h for h in (_eval_signal(s, ctx) for s in pb.signals) if h is not None]
    if not hits:
        return None
    hits.sort(key=lambda h: -h["confidence"])
    best = hits[0]["confidence"]
    # agreeing signals add a little, never past the best signal's own certainty by much
    confidence = min(max(best, 0.99), best + 0.02 * (len(hits) - 1))
    evidence: dict[str, Any] = {"matched": hits}
    if ctx.exception:
        exc = ctx.exception
        lines = str(exc.get("message") or "").strip().splitlines()
        evidence["exception"] = {
            "type": exc.get("type"),
            "errno": ctx.errnos[0] if ctx.errnos else None,
            "message": lines[-1][:300] if lines else "",  # torch puts the cause last
            "from_loader": bool(exc.get("from_loader")),
        }
    enrich = _ENRICHERS.get(pb.id)
    variant = None
    if enrich is not None:
        variant = enrich(pb, ctx, evidence)
    hints = _eval_hints(pb, ctx)
    if hints:
        evidence["points_at"] = [found for _, found in hints]
    return Finding(
        playbook=pb.id,
        title=pb.title,
        confidence=round(confidence, 3),
        evidence=evidence,
        remediation=_remediation(pb, variant, [h for h, _ in hints]),
    )


def _remediation(pb: Playbook, variant: str | None, hints: Sequence[Hint]) -> str:
    parts = [h.text for h in hints if h.text]
    if variant is not None and variant in pb.variants:
        parts.append(pb.variants[variant])
    else:  # cause not measured: show every variant, the reader picks
        parts.extend(pb.variants.values())
    if pb.remediation:
        parts.append(pb.remediation)
    return "\n\n".join(p.strip() for p in parts if p.strip())


# --------------------------------------------------------------------------- per-playbook evidence


def _fd_cause(fds: Mapping[str, Any] | None, num_fds: int | None, min_share: float) -> str | None:
    if not fds or not num_fds:
        return None
    files, shm = int(fds.get("file") or 0), int(fds.get("shm") or 0)
    kind, count = ("regular-files", files) if files >= shm else ("shm-fds", shm)
    return kind if count > 0 and count >= min_share * num_fds else None


def _enrich_fd(pb: Playbook, ctx: _Context, ev: dict[str, Any]) -> str | None:
    def share(v: Mapping[str, Any]) -> float:
        return (v.get("num_fds") or 0) / v["fd_limit"] if v.get("fd_limit") else 0.0

    fd_share = pb.threshold("fd_share", th.FD_SHARE)
    pressure = ctx.signal_events("fd_pressure")
    # the processes that tell the story: at the limit, above the share, or seen climbing
    views = list(ctx.at_limit)
    for p in ctx.processes:
        view = _Context._proc_fd_view(p, p.get("sample") or {})
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
        counts = [_Context._proc_fd_view(p, p.get("sample") or {}) for p in ctx.processes]
        counts = [
            {k: c.get(k) for k in ("pid", "role", "worker_id", "num_fds", "fd_limit")}
            for c in counts
            if c.get("num_fds") is not None
        ]
        if counts:
            ev["fd_counts"] = counts[: _MAX_WORKERS + 1]
    if ctx.at_limit:
        ev["at_fd_limit"] = [
            {k: a.get(k) for k in ("pid", "role", "worker_id", "num_fds", "fd_limit")} for a in ctx.at_limit
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
        ev["pressure"] = [_strip_event(e) for e in pressure[-_MAX_EVENTS:]]
    return cause


def _enrich_shm(pb: Playbook, ctx: _Context, ev: dict[str, Any]) -> str | None:
    for key in ("shm_total", "shm_free", "shm_torch_files"):
        if ctx.system.get(key) is not None:
            ev[key] = ctx.system.get(key)
    loader = {
        k: ctx.loader.get(k)
        for k in ("batch_size", "num_workers", "prefetch_factor", "sharing_strategy")
        if ctx.loader.get(k) is not None
    }
    if loader:
        ev["loader"] = loader
    if ctx.errnos:
        ev["errno"] = ctx.errnos[0]
    pressure = ctx.signal_events("shm_pressure")
    if pressure:
        ev["pressure"] = [_strip_event(e) for e in pressure[-_MAX_EVENTS:]]
        need = next((e.get("need_bytes") for e in reversed(pressure) if e.get("need_bytes")), None)
        if need:
            ev["need_bytes"] = need
    return None


def _main_thread_frames(p: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The frames of the thread named MainThread (not a queue feeder thread listed first)."""
    for t in (p.get("stack") or {}).get("threads") or ():
        if isinstance(t, Mapping) and t.get("name") == "MainThread":
            return _cut_parent_frames([f for f in (t.get("frames") or ()) if isinstance(f, Mapping)])
    return []


def _worker_view(p: Mapping[str, Any]) -> dict[str, Any]:
    s = p.get("sample") or {}
    threads = _threads(p)
    main = next((t for t in threads if any(f.get("function") == "_worker_loop" for f in t)), None)
    if main is None:
        main = _main_thread_frames(p) or (threads[0] if threads else [])
    view = {
        "pid": p.get("pid"),
        "worker_id": p.get("worker_id"),
        "status": p.get("status"),
        "state": s.get("state"),
        "syscall": s.get("syscall"),
        "wchan": s.get("wchan"),
        "waiting_in": p.get("waiting_in"),
        "cpu_progress_s": p.get("cpu_progress_s"),
        "frames": [_frame_str(f) for f in main[:_MAX_FRAMES]],
    }
    user = next((f for f in main if _is_user_frame(f)), None)
    if user is not None:
        view["user_frame"] = _frame_str(user)
    return {k: v for k, v in view.items() if v not in (None, [])}


def _is_user_frame(f: Mapping[str, Any]) -> bool:
    name = str(f.get("filename") or "")
    return bool(name) and not f.get("native") and not name.startswith("<") and not _LIBRARY_PATH.search(name)


def _enrich_deadlock(pb: Playbook, ctx: _Context, ev: dict[str, Any]) -> str | None:
    workers = [p for p in ctx.processes if p.get("role") == "worker"]
    if workers:
        ev["workers"] = [_worker_view(p) for p in workers[:_MAX_WORKERS]]
        if len(workers) > _MAX_WORKERS:
            ev["workers_not_shown"] = len(workers) - _MAX_WORKERS
    main = next((p for p in ctx.processes if p.get("role") == "main"), None)
    if main is not None:
        mv = _worker_view(main)
        mv.pop("worker_id", None)
        ev["main"] = mv
    if ctx.loader.get("multiprocessing_context") is not None:
        ev["multiprocessing_context"] = ctx.loader.get("multiprocessing_context")
    if ctx.loader.get("timeout") is not None:
        ev["timeout"] = ctx.loader.get("timeout")
    return None


def _enrich_io(pb: Playbook, ctx: _Context, ev: dict[str, Any]) -> str | None:
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
        ev["workers"] = views[:_MAX_WORKERS]
        if len(views) > _MAX_WORKERS:
            ev["workers_not_shown"] = len(views) - _MAX_WORKERS
    if peers:
        ev["peers"] = [{"peer": k, "workers": n} for k, n in sorted(peers.items(), key=lambda kv: -kv[1])]
    if stall_s is not None:
        ev["stall_s"] = stall_s
    if ctx.loader.get("timeout") is not None:
        ev["timeout"] = ctx.loader.get("timeout")
    return None


def _enrich_batch(pb: Playbook, ctx: _Context, ev: dict[str, Any]) -> str | None:
    events = ctx.signal_events("batch_shape")
    if events:
        first = _strip_event(events[0])
        ev.update({k: v for k, v in first.items() if k not in ev})
        if len(events) > 1:
            ev["batch_shape_events"] = len(events)
    if not ev.get("collate_fn") and ctx.loader.get("collate_fn"):
        ev["collate_fn"] = ctx.loader.get("collate_fn")
    for key in ("batch_size", "drop_last"):
        if key not in ev and ctx.loader.get(key) is not None:
            ev[key] = ctx.loader.get(key)
    return None


def _enrich_rng(pb: Playbook, ctx: _Context, ev: dict[str, Any]) -> str | None:
    for signal, key in (("rng_duplicate", "duplicates"), ("rng_epoch_repeat", "repeats")):
        found: list[Any] = []
        for e in ctx.signal_events(signal):
            for d in e.get(key) or ():
                if d not in found:
                    found.append(d)
        if found:
            ev[key] = found
    if ev.get("repeats"):
        # workers restart each epoch; a sequential sampler means the very same samples get the
        # very same draws (on purpose only for a validation loader seeded alike every epoch)
        for key in ("persistent_workers", "sampler"):
            if ctx.loader.get(key) is not None:
                ev[key] = ctx.loader.get(key)
    if ctx.loader.get("worker_init_fn") is not None:
        ev["worker_init_fn"] = ctx.loader.get("worker_init_fn")
    if ev.get("duplicates") and not ev.get("repeats"):
        return "worker-copies"
    if ev.get("repeats") and not ev.get("duplicates"):
        return "epoch-repeat"
    return None  # both (or neither measured): every variant is shown


def _strip_event(e: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k not in ("event", "kind")}


def _samples_of(ctx: _Context, pid: Any) -> list[Mapping[str, Any]]:
    out = []
    for rec in ctx.report.get("timeline") or ():
        if isinstance(rec, Mapping) and rec.get("kind") == "sample":
            for p in rec.get("procs") or ():
                if isinstance(p, Mapping) and p.get("pid") == pid and not p.get("gone"):
                    out.append(p)
    return out


def _enrich_worker_killed(pb: Playbook, ctx: _Context, ev: dict[str, Any]) -> str | None:
    from dlwatch.detect.worker_killed import exit_cause, torch_worker_exit

    obs = [e for e in ctx.signal_events("worker_exit") if e.get("event") == "observation"]
    pids, sig_text = torch_worker_exit(ctx.text)
    crashed = [p for p in ctx.processes if p.get("role") == "worker" and p.get("crash")]
    gone = [p for p in ctx.processes if p.get("role") == "worker" and p.get("status") == "gone"]
    pid = (
        (pids[0] if pids else None)
        or next((e.get("pid") for e in obs), None)
        or next((p.get("pid") for p in crashed + gone), None)
    )
    if pid is None:
        return None
    mine = [e for e in obs if e.get("pid") == pid]
    merged: dict[str, Any] = {}
    for e in mine:  # later observations add what earlier ones lacked (an exit code read after torch raised)
        merged.update({k: v for k, v in e.items() if v is not None})
    proc = next((p for p in ctx.processes if p.get("pid") == pid), None)
    crash = (proc or {}).get("crash") or merged.get("crash") or {}
    sig = merged.get("exit_signal") or sig_text or crash.get("signal")
    share = merged.get("memory_share")
    before, after = merged.get("oom_kills_before") or {}, merged.get("oom_kills_after") or {}
    cg_b, cg_a = before.get("cgroup"), after.get("cgroup")
    if cg_b is not None and cg_a is not None:
        oom = cg_a > cg_b
    else:
        oom = before.get("host") is not None and after.get("host") is not None and after["host"] > before["host"]
    cause, basis = exit_cause(
        sig,
        oom_rose=oom,
        memory_share=share,
        crash_signal=crash.get("signal"),
        near_share=pb.threshold("near_limit_share", 0.9),
    )
    ev.update(
        {
            "pid": pid,
            "worker_id": (proc or {}).get("worker_id", merged.get("worker_id")),
            "exit_signal": sig,
            "cause": cause,
            "cause_basis": basis,
        }
    )
    if merged.get("exit_status") is not None:
        ev["exit_status"] = merged["exit_status"]
    if merged.get("last_seen_ts") is not None:
        ev["last_seen_ts"] = merged["last_seen_ts"]
    memory = (
        merged.get("memory")
        or [{"ts": s.get("ts"), "rss": s.get("rss"), "uss": s.get("uss")} for s in _samples_of(ctx, pid)][-12:]
    )
    if memory:
        ev["memory"] = memory
    limits = {
        k: merged.get(k, ctx.system.get(k)) for k in ("cgroup_memory_limit", "cgroup_memory_usage", "mem_available")
    }
    ev["memory_limit"] = {k: v for k, v in limits.items() if v is not None}
    if share is not None:
        ev["memory_share"] = share
    if before or after:
        ev["oom_kills"] = {
            "before": before or None,
            "after": after or None,
            "at_start": merged.get("oom_kills_at_start"),
        }
    shm = {k: merged.get(k, ctx.system.get(k)) for k in ("shm_total", "shm_free")}
    if any(v is not None for v in shm.values()):
        ev["shm"] = shm
    if crash:
        ev["crash"] = {"signal": crash.get("signal"), "fatal_error": crash.get("fatal_error")}
    if proc is not None and crash:
        threads = _threads(proc)  # the thread that crashed in the dataset's code first
        threads.sort(key=lambda t: not any(_is_user_frame(f) for f in t))
        frames = threads[0] if threads else []
        ev["crash_stack"] = [_frame_str(f) for f in frames[:_MAX_FRAMES]]
        user = next((f for f in frames if _is_user_frame(f)), None)
        if user is not None:
            ev["crash_frame"] = _frame_str(user)
    if cause == "sigbus":
        ev["see_also"] = "shm-exhaustion"
    growth = ctx.signal_events("worker_memory_growth") + [
        e for e in ctx.events if e.get("event") == "advice" and e.get("playbook") == "worker-memory-growth"
    ]
    if growth:
        ev["memory_growth_before"] = _strip_event(growth[-1])
    return cause if cause != "unknown" else None


def _enrich_growth(pb: Playbook, ctx: _Context, ev: dict[str, Any]) -> str | None:
    name = "worker_memory_growth" if pb.id == "worker-memory-growth" else "pinned_memory_growth"
    events = ctx.signal_events(name)
    if events:
        ev.update({k: v for k, v in _strip_event(events[-1]).items() if k not in ev})
    return None


_ENRICHERS = {
    "fd-exhaustion": _enrich_fd,
    "shm-exhaustion": _enrich_shm,
    "worker-deadlock": _enrich_deadlock,
    "io-stall": _enrich_io,
    "batch-dim-mismatch": _enrich_batch,
    "rng-duplication": _enrich_rng,
    "worker-killed": _enrich_worker_killed,
    "worker-memory-growth": _enrich_growth,
    "pinned-memory-growth": _enrich_growth,
}
