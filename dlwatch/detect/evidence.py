"""Reading a report for judgement: the matcher's context and the helpers every failure's evidence uses.

Pure: a draft report dict (docs/report-schema.md) in, plain values out; never the system.
:class:`Context` is what the matcher (``detect/match.py``) evaluates a playbook's
conditions on and what each failure's enricher (see :mod:`dlwatch.detect.registry`)
reads its evidence from: the exception, the processes with their stacks, the loader,
the system, and the events (the report's and the timeline's, deduplicated, plus those
each failure's ``derive`` judges again from the report's raw data).  Nothing here
names a failure: a failure's own facts (``fd_at_limit``) come from its module.
"""

from __future__ import annotations

import os

from typing import Any, Iterable, Mapping, Sequence

from dlwatch import _regex
from dlwatch.detect import registry
from dlwatch.wire.playbooks import Playbook

__all__ = [
    "Context",
    "MAX_EVENTS",
    "MAX_FRAMES",
    "MAX_WORKERS",
    "errnos_in",
    "field",
    "frame_str",
    "is_user_frame",
    "main_thread_frames",
    "samples_of",
    "signal_events",
    "strip_event",
    "threads",
    "worker_view",
]

# Every pattern here runs on text the training program controls: RE2 (linear time), bounded text.
_ERRNO_BRACKET = _regex.compile(r"\[Errno (\d+)\]")
_ERRNO_TORCH = _regex.compile(r":\s+[A-Za-z][A-Za-z ,'-]*? \((\d+)\)")  # "...: No space left on device (28)"
_LIBRARY_PATH = _regex.compile(r"[/\\](site|dist)-packages[/\\]|[/\\]lib[/\\]python3[^/\\]*[/\\]|[/\\]torch[/\\]")
MAX_FRAMES = 8
MAX_WORKERS = 8
MAX_EVENTS = 5


def errnos_in(exception: Mapping[str, Any] | None) -> tuple[int, ...]:
    """The exception's errno plus any that torch or the OS printed into its text, in order."""
    if not exception:
        return ()
    found: list[int] = []
    if isinstance(exception.get("errno"), int):
        found.append(exception["errno"])
    text = exception_text(exception)
    for rx in (_ERRNO_BRACKET, _ERRNO_TORCH):
        found.extend(int(m.group(1)) for m in rx.finditer(text))
    return tuple(dict.fromkeys(found))


def exception_text(exception: Mapping[str, Any]) -> str:
    """Message and traceback, bounded: patterns never see more than _regex.MAX_TEXT_CHARS of it."""
    return _regex.bound_text(f"{exception.get('message') or ''}\n{exception.get('traceback') or ''}")


def field(value: Any) -> str:
    return str(value or "")[: _regex.MAX_FIELD_CHARS]


def frame_str(f: Mapping[str, Any]) -> str:
    where = f.get("filename") or "?"
    line = f.get("line")
    return f"{f.get('function') or '?'} ({where}{':' + str(line) if line else ''})"


def threads(proc: Mapping[str, Any]) -> list[list[Mapping[str, Any]]]:
    stack = proc.get("stack") or {}
    out = []
    for t in stack.get("threads") or ():
        frames = [f for f in (t.get("frames") or ()) if isinstance(f, Mapping)]
        if frames:
            out.append(cut_parent_frames(frames))
    return out


def cut_parent_frames(frames: list[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    # a forked worker's stack continues below _worker_loop into the parent's frames
    for i, f in enumerate(frames):
        if f.get("function") == "_worker_loop":
            return frames[: i + 1]
    return frames


def main_thread_frames(p: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The frames of the thread named MainThread (not a queue feeder thread listed first)."""
    for t in (p.get("stack") or {}).get("threads") or ():
        if isinstance(t, Mapping) and t.get("name") == "MainThread":
            return cut_parent_frames([f for f in (t.get("frames") or ()) if isinstance(f, Mapping)])
    return []


def worker_view(p: Mapping[str, Any]) -> dict[str, Any]:
    """One process as evidence shows it: state, what it waits in, its main thread's frames."""
    s = p.get("sample") or {}
    ts = threads(p)
    main = next((t for t in ts if any(f.get("function") == "_worker_loop" for f in t)), None)
    if main is None:
        main = main_thread_frames(p) or (ts[0] if ts else [])
    view = {
        "pid": p.get("pid"),
        "worker_id": p.get("worker_id"),
        "status": p.get("status"),
        "state": s.get("state"),
        "syscall": s.get("syscall"),
        "wchan": s.get("wchan"),
        "waiting_in": p.get("waiting_in"),
        "cpu_progress_s": p.get("cpu_progress_s"),
        "frames": [frame_str(f) for f in main[:MAX_FRAMES]],
    }
    user = next((f for f in main if is_user_frame(f)), None)
    if user is not None:
        view["user_frame"] = frame_str(user)
    return {k: v for k, v in view.items() if v not in (None, [])}


# dlwatch's own code (its wrappers sit in the training loop's stack): never the user's frame, wherever
# dlwatch is installed (a checkout or an editable install is not under site-packages); the examples it
# ships (dlwatch/_examples in a normal install) are programs like the user's
_OWN_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_OWN_PROGRAMS = (os.path.join(_OWN_DIR, "_examples") + os.sep,)


def is_own_frame(f: Mapping[str, Any]) -> bool:
    name = str(f.get("filename") or "")
    return name.startswith(_OWN_DIR) and not name.startswith(_OWN_PROGRAMS)


def is_user_frame(f: Mapping[str, Any]) -> bool:
    name = str(f.get("filename") or "")
    return (
        bool(name)
        and not f.get("native")
        and not name.startswith("<")
        and not _LIBRARY_PATH.search(name)
        and not is_own_frame(f)
    )


def strip_event(e: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in e.items() if k not in ("event", "kind")}


def last_signal_evidence(name: str) -> Any:
    """An enricher that adds the evidence of the last ``name`` signal (what its detector measured)
    to a finding, keeping what the finding already holds."""

    def enrich(pb: Any, ctx: "Context", ev: dict[str, Any]) -> str | None:
        events = ctx.signal_events(name)
        if events:
            ev.update({k: v for k, v in strip_event(events[-1]).items() if k not in ev})
        return None

    return enrich


def judged_once(name: str, judge: Any) -> Any:
    """A derivation (``Failure.derive``): the threshold signal ``name`` that ``judge(ctx)`` finds in a
    report, unless the report already holds that signal (the monitor judged it live)."""

    def derive(ctx: "Context") -> list[dict[str, Any]]:
        if ctx.signal_events(name):
            return []
        got = judge(ctx)
        return [{"event": "threshold", "signal": name, **got}] if got else []

    return derive


def signal_events(events: Sequence[Mapping[str, Any]], name: str) -> list[Mapping[str, Any]]:
    """The events of a signal, by their ``signal`` key or by ``event`` for the same name."""
    return [e for e in events if e.get("signal") == name or e.get("event") == name]


def samples_of(report: Mapping[str, Any], pid: Any) -> list[Mapping[str, Any]]:
    """The timeline samples of one process while it lived, oldest first."""
    out = []
    for rec in report.get("timeline") or ():
        if isinstance(rec, Mapping) and rec.get("kind") == "sample":
            for p in rec.get("procs") or ():
                if isinstance(p, Mapping) and p.get("pid") == pid and not p.get("gone"):
                    out.append(p)
    return out


_UNSET = object()


class Context:
    """One report as the matcher and the enrichers read it (built once per ``match`` call).

    ``sources``: what may read the program's source files for this report (a
    :class:`dlwatch.collect.source.SourceReader`, with the target's rights and one budget; None:
    a reader for this process's own uid is made when one is first needed).  Nothing else here
    reads the system."""

    def __init__(self, report: Mapping[str, Any], playbooks: Sequence[Playbook], *, sources: Any = None) -> None:
        self.report = report
        self.playbooks = playbooks
        self.sources = sources
        self._once: dict[str, Any] = {}
        self.exception: Mapping[str, Any] | None = report.get("exception") or None
        exc = self.exception or {}
        self.text = exception_text(exc)
        self.errnos = errnos_in(self.exception)
        self.classification = report.get("classification")
        self.loader: Mapping[str, Any] = report.get("loader") or {}
        self.system: Mapping[str, Any] = report.get("system") or {}
        self.processes = [p for p in (report.get("processes") or ()) if isinstance(p, Mapping)]
        self._facts: dict[str, Any] = {}
        self.events = self._collect_events(report)
        for failure in registry.failures():  # each sees the events so far, and adds only what is missing
            if failure.derive is not None:
                self.events.extend(failure.derive(self))

    # events: report["events"] plus event records of the timeline, deduplicated
    @staticmethod
    def _collect_events(report: Mapping[str, Any]) -> list[Mapping[str, Any]]:
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
        return out

    def signal_events(self, name: str) -> list[Mapping[str, Any]]:
        return signal_events(self.events, name)

    def thresholds(self, playbook: str) -> Mapping[str, float]:
        """The ``[thresholds]`` of a playbook among those being matched ({} when it is not loaded)."""
        pb = next((p for p in self.playbooks if p.id == playbook), None)
        return pb.thresholds if pb is not None else {}

    def once(self, key: str, compute: Any) -> Any:
        """``compute(self)``, computed once per report (a judgement several enrichers read)."""
        if key not in self._once:
            self._once[key] = compute(self)
        return self._once[key]

    def fact(self, name: str) -> Any:
        """A failure's named fact about this report (computed once), or None when no failure provides it."""
        value = self._facts.get(name, _UNSET)
        if value is _UNSET:
            provider = registry.fact_providers().get(name)
            value = provider(self) if provider is not None else None
            self._facts[name] = value
        return value

    def frames(self, role: str) -> Iterable[tuple[Mapping[str, Any], Mapping[str, Any]]]:
        for p in self.processes:
            if role != "any" and p.get("role") != role:
                continue
            for frames in threads(p):
                for f in frames:
                    yield p, f
