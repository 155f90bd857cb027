"""The matcher: a draft report dict and the playbooks in, findings (most likely first) out.

Pure: it reads the report (docs/report-schema.md: ``exception``,
``classification``, ``processes``, ``system``, ``loader``, ``events``,
``timeline``) through :class:`dlwatch.detect.evidence.Context` and never the system.
Each playbook signal is a conjunction of conditions (see
:class:`dlwatch.wire.playbooks.Signal`); a playbook matches when any of its signals
does, with the best signal's confidence (plus a little for each further signal that
agrees).  The evidence of a finding is what matched plus what its failure's module
measured (its ``enrich``, found through :mod:`dlwatch.detect.registry`); a playbook
with nothing that matched makes no finding, so a healthy report makes none at all.

Detector events are matched by their ``signal`` key (or by ``event`` for the same
name); a failure's ``derive`` adds the events a report implies but does not hold (its
detector's rule judged again over the report's raw data).  Nothing here names a failure.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

from dlwatch._log import get_logger
from dlwatch.detect import registry, remedy
from dlwatch.detect.evidence import Context, errnos_in, field as _field, frame_str as _frame_str, threads as _threads
from dlwatch.model import Finding
from dlwatch.wire.playbooks import Hint, Playbook, Signal

__all__ = ["match", "errnos_in"]

log = get_logger(__name__)


def match(report: Mapping[str, Any], playbooks: Iterable[Playbook], *, sources: Any = None) -> list[Finding]:
    """``sources``: the reader of the program's source files (see :class:`Context`)."""
    playbooks = tuple(playbooks)
    ctx = Context(report, playbooks, sources=sources)
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


# --------------------------------------------------------------------------- evaluation


def _eval_signal(sig: Signal, ctx: Context) -> dict[str, Any] | None:
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
        at_limit = ctx.fact("fd_at_limit") or ()  # a fact of the failure that provides it
        if bool(at_limit) != sig.fd_at_limit:
            return None
        if at_limit:
            hit["at_fd_limit"] = [a.get("pid") for a in at_limit]
    for name in sig.facts:  # named facts of the failures that provide them (registry.Failure.facts)
        if not ctx.fact(name):
            return None
    for name in sig.not_facts:
        if ctx.fact(name):
            return None
    if sig.facts:
        hit["facts"] = list(sig.facts)
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


def _eval_hints(pb: Playbook, ctx: Context) -> list[tuple[Hint, dict[str, Any]]]:
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


def _find_hint(hint: Hint, ctx: Context) -> dict[str, Any] | None:
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


def _match_one(pb: Playbook, ctx: Context) -> Finding | None:
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
    failure = registry.find(pb.id)
    variant = None
    if failure is not None and failure.enrich is not None:
        variant = failure.enrich(pb, ctx, evidence)
    hints = _eval_hints(pb, ctx)
    if hints:
        evidence["points_at"] = [found for _, found in hints]
    return Finding(
        playbook=pb.id,
        title=pb.title,
        confidence=round(confidence, 3),
        evidence=evidence,
        # never a remedy the loader's own settings make invalid (a timeout= for a loader without workers)
        remediation=remedy.fit(_remediation(pb, variant, [h for h, _ in hints]), ctx.loader),
    )


def _remediation(pb: Playbook, variant: str | tuple[str, ...] | None, hints: Sequence[Hint]) -> str:
    parts = [h.text for h in hints if h.text]
    # an enricher names one variant, or several that each measured one side (in order)
    chosen = [v for v in ((variant,) if isinstance(variant, str) else variant or ()) if v in pb.variants]
    if chosen:
        parts.extend(pb.variants[v] for v in chosen)
    else:  # cause not measured: show every variant, the reader picks
        parts.extend(pb.variants.values())
    if pb.remediation:
        parts.append(pb.remediation)
    return "\n\n".join(p.strip() for p in parts if p.strip())
