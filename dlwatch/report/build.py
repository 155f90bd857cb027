"""Assemble an incident report from what was collected and judged, then write it.

One place builds every report (the monitor, ``dlwatch attach``, and the finisher when the
monitor is gone), so report.json has the same shape whoever wrote it: :func:`incident` makes
the typed :class:`~dlwatch.report.schema.Incident` from its parts, :func:`process` one of its
processes, :func:`add_findings` judges it, :func:`write` writes it.  The JSON object exists only
where it is the interface: the matcher and the job annotation read it (they read reports from
disk too), and the writer bounds, redacts and writes it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable, Mapping, Sequence

from dlwatch._log import get_logger
from dlwatch.report import render, schema, store
from dlwatch.report.schema import ExceptionInfo, Incident, ProcessEntry, Stack

log = get_logger("dlwatch.report")

TIMELINE_WINDOW = 120  # records copied into an incident


def summary_line(report: Incident | Mapping[str, Any]) -> str:
    r = schema.incident(report)
    line = _summary_line(r)
    related = r.extra.get("related") or ()
    first = related[0] if isinstance(related, list) and related and isinstance(related[0], dict) else None
    if first is not None and first.get("id"):  # one failure, one incident: the earlier report of it
        line += f" (first seen before any error: incident {first['id']})"
    return line


def _summary_line(r: Incident) -> str:
    trig = r.trigger
    findings = r.findings or ()
    top = f" -> {findings[0].title}" if findings and findings[0].title else ""
    job = r.job
    if job is not None and job.role == "waiting":
        rank = r.rank.rank if r.rank is not None else None
        top = (
            f" -> rank {rank if rank is not None else '?'} waits in {job.waiting_in} for another rank: see `{job.view}`"
        )
    if trig == "exception":
        exc = r.exception or ExceptionInfo()
        msg = (str(exc.message or "").strip().splitlines() or [""])[-1][:160]
        return f"{exc.type if exc.has('type') else 'exception'}: {msg}{top}"
    if trig == "stall":
        prog = r.progress or {}
        return f"no batch progress for {prog.get('stall_s', 0):.0f} s ({r.classification or 'unclassified'}){top}"
    if trig == "interrupt":
        prog = r.progress or {}
        where = "in the loop body" if prog.get("interrupted_in") == "in_loop_body" else "waiting for a batch"
        return (
            f"stopped with Ctrl-C after {prog.get('interrupted_after_s', 0):.0f} s {where} "
            f"({r.classification or 'unclassified'}){top}"
        )
    if trig == "attach":
        return f"attached to pid {r.pid}: {r.classification or 'unclassified'}{top}"
    if trig == "exit":
        return (r.summary or "the training process ended without leaving the watch block") + top
    return (r.summary or "a threshold was crossed") + top


def incident(
    trigger: str,
    pid: int,
    *,
    now: float,
    rank: Mapping[str, Any] | None = None,
    loader: Mapping[str, Any] | None = None,
    config: Mapping[str, Any] | None = None,
    progress: Mapping[str, Any] | None = None,
    exception: Mapping[str, Any] | None = None,
    processes: Iterable[ProcessEntry] = (),
    system: Mapping[str, Any] | None = None,
    gpus: Sequence[Mapping[str, Any]] = (),
    events: Sequence[Any] = (),
    timeline: Sequence[Any] = (),
    notes: Iterable[str] = (),
    quiet_notes: Iterable[str] = (),
) -> Incident:
    """A new incident from its parts, every key of schema 1 in documented order (the builder of
    the monitor, attach and the finisher).  ``rank`` (default: read from the environment) and the
    other parts as report.json holds them; ``processes`` from :func:`process`."""
    new = store.new_incident(trigger=trigger, pid=pid, now=now)
    return new.replace(
        rank=schema.Rank.from_dict(rank) if rank is not None else new.rank,
        loader=loader,
        progress=dict(progress) if progress is not None else {},
        exception=ExceptionInfo.from_dict(exception) if exception is not None else None,
        processes=tuple(processes),
        system=system,
        gpus=list(gpus),
        events=list(events),
        timeline=list(timeline),
        notes=tuple(notes),
        config=dict(config) if config is not None else {},
        # notes people see with -v only (a fact for machines, noise for people: no NVML on a machine
        # without an NVIDIA device); the key exists only where there is one
        **({"quiet_notes": list(quiet_notes)} if quiet_notes else {}),
    )


def _sync(report: dict[str, Any], built: Incident) -> None:
    """Bring a caller's dict up to ``built`` (the dict-in, mutate-in-place form of older callers)."""
    report.update(built.to_dict())


def add_findings(
    report: Incident | dict[str, Any],
    playbook_dirs: Sequence[str] = (),
    *,
    playbooks: Sequence[Any] | None = None,
    ignore: Iterable[str] = (),
    sources: Any = None,
) -> Incident:
    """``report`` with its findings: playbooks matched (``playbooks`` when already loaded, else
    those of ``playbook_dirs``), and the job annotation of a rank that only waits for others.

    ``sources``: the reader of the program's source files (a ``collect.source.SourceReader`` for
    the target's uid: ``dlwatch attach``); by default one for this process's own uid.

    A playbook in ``ignore`` (the ``ignore`` option) makes no finding; the report says so.
    A failure here becomes a note, never a lost report.  A dict is also brought up to date in place.
    """
    built = _judge(
        report.to_dict() if isinstance(report, Incident) else report, playbook_dirs, playbooks, ignore, sources
    )
    if isinstance(report, dict):
        _sync(report, built)
    return built


def _judge(
    report: dict[str, Any],
    playbook_dirs: Sequence[str],
    playbooks: Sequence[Any] | None,
    ignore: Iterable[str],
    sources: Any = None,
) -> Incident:
    """The matcher and the job annotation work on the JSON object (``report``, changed in place)."""
    if not isinstance(report.get("notes"), list):
        report["notes"] = list(report.get("notes") or ())
    try:
        from dlwatch.detect.match import match
        from dlwatch.wire.playbooks import load_playbooks

        if playbooks is None:
            playbooks = load_playbooks(tuple(playbook_dirs))
        skip = set(ignore)
        # advice playbooks are never matched into an incident: they belong to the run summary
        findings = match(
            report,
            [pb for pb in playbooks if pb.id not in skip and not getattr(pb, "is_advice", False)],
            sources=sources,
        )
        report["findings"] = [f.to_dict() if hasattr(f, "to_dict") else dict(f) for f in findings]
        if skip:
            note = f"playbooks ignored for this run (the ignore option): {', '.join(sorted(skip))}"
            if note not in report["notes"]:
                report["notes"].append(note)
    except ImportError:
        pass
    except Exception as exc:
        report["notes"].append(f"playbook matching failed: {type(exc).__name__}: {exc}")
    try:  # a rank that only waits for other ranks: no DataLoader finding, a pointer at the job view
        from dlwatch.report.jobview import annotate

        annotate(report)
    except Exception as exc:
        report["notes"].append(f"job annotation failed: {type(exc).__name__}: {exc}")
    return Incident.from_dict(report)


def write(report: Incident | dict[str, Any], report_dir: str, *, extra_files: Mapping[str, bytes] | None = None) -> str:
    """Write the incident, falling back to a private temporary directory if report_dir fails.

    A dict is brought up to what was written (its summary line, ``truncated``, a fallback note)."""
    if isinstance(report, Incident):
        return write_report(report, report_dir, extra_files=extra_files)[1]
    built, path = write_report(Incident.from_dict(report), report_dir, extra_files=extra_files)
    report.update(built)
    return path


def write_report(
    incident: Incident, report_dir: str, *, extra_files: Mapping[str, bytes] | None = None
) -> tuple[dict[str, Any], str]:
    """Write ``incident`` (see :func:`write`); return the JSON object as written (before redaction,
    which the store applies) and the incident's path."""
    if not incident.summary or incident.trigger in ("exception", "stall", "attach", "interrupt"):
        incident = incident.replace(summary=summary_line(incident))
    report = incident.to_dict()
    from dlwatch.report.trim import bound_report

    bound_report(report)  # report.json under its cap, saying what was left out (sets "truncated")
    try:
        path = store.write_incident(report_dir, report, render_markdown=render.render_markdown, extra_files=extra_files)
    except OSError as exc:
        fallback = store.fallback_dir()
        if os.path.abspath(report_dir) == os.path.abspath(fallback):
            raise
        log.warning("report_dir_unwritable", report_dir=report_dir, error=str(exc), fallback=fallback)
        report["notes"].append(f"could not write to {report_dir} ({exc.strerror or exc}); written here instead")
        path = store.write_incident(fallback, report, render_markdown=render.render_markdown, extra_files=extra_files)
    from dlwatch.report import html  # report.html in a short-lived child: not in this process's memory

    html.spawn_render(path)
    return report, path


def write_run_summary(
    summary: schema.RunSummary | dict[str, Any], report_dir: str, *, keep_runs: int, timeline_dir: str | None
) -> str | None:
    """Write ``runs/<id>/`` (falling back to the private temporary directory if report_dir fails),
    remove the oldest summaries beyond ``keep_runs`` there (never this one), and start the child
    that draws its report.html from the timeline files in ``timeline_dir``, handed to it open.

    What the monitor and the training process (when the monitor is gone) both do at the end of a
    block.  Returns the summary's path, or None when no directory took it; never raises.
    """
    from dlwatch.report import summary as sm

    doc = summary.to_dict() if isinstance(summary, schema.RunSummary) else summary
    path = None
    for base in (report_dir, store.fallback_dir()):
        try:
            path = store.write_summary(base, doc, render_markdown=sm.render_markdown)
            break
        except OSError as exc:
            log.warning("summary_write_failed", report_dir=base, error=str(exc))
    if path is None:
        return None
    base = os.path.dirname(os.path.dirname(path))
    store.prune_runs(base, keep_runs, spare=os.path.basename(path))
    from dlwatch.wire.job import safe_name

    rank: dict[str, Any] = doc["rank"] if isinstance(doc.get("rank"), dict) else {}
    job = safe_name(str(rank["job_id"])) if rank.get("job_id") else None
    store.prune_jobs(base, keep_runs, spare=job)  # multi-rank figures (.jobs/) by the same cap, never this job's
    try:  # nothing is rendered or read in this process: it may be the monitor, with its memory budget
        from dlwatch.report import html

        html.spawn_render(path, timeline_dir=timeline_dir)  # never waits
    except Exception as exc:
        log.warning("html_failed", error=f"{type(exc).__name__}: {exc}")
    return path


def read_timeline(run_dir: str, limit: int = TIMELINE_WINDOW) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for name in ("timeline.1.jsonl", "timeline.jsonl"):
        try:
            with open(os.path.join(run_dir, name), "rb") as f:
                for line in f:
                    try:
                        out.append(json.loads(line))
                    except ValueError:
                        continue
        except OSError:
            continue
    return out[-limit:]


def exception_report_from_run(
    run_dir: str, report_dir: str, exception: Mapping[str, Any], *, pid: int | None = None
) -> str:
    """The exception incident of a block whose monitor is gone (``pid``: the training process;
    see :mod:`dlwatch.monitor.finish`)."""
    cfg: dict[str, Any] = {}
    try:
        with open(os.path.join(run_dir, "config.json"), "rb") as f:
            cfg = json.loads(f.read())
    except (OSError, ValueError):
        pass
    opts = cfg.get("options") or {}
    report = incident(
        "exception",
        os.getpid() if pid is None else pid,
        now=time.time(),
        loader=cfg.get("loader"),
        config=opts,
        exception=exception,
        timeline=read_timeline(run_dir),
        notes=[
            "the monitor process was not running; this report was written by the training process "
            "and holds no samples taken after the monitor stopped"
        ],
    )
    report = add_findings(report, opts.get("playbooks") or (), ignore=opts.get("ignore") or ())
    return write(report, report_dir)


def compact(obj: Any) -> Any:
    """Drop None values from sample dicts: timelines stay small and readable."""
    if isinstance(obj, dict):
        return {k: compact(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [compact(v) for v in obj]
    return obj


def process(
    pid: int,
    role: str,
    *,
    worker_id: int | None = None,
    start_method: str | None = None,
    name: str | None = None,
    cmdline: Iterable[str] | None = None,
    sample: Mapping[str, Any] | None = None,
    stack: Mapping[str, Any] | None = None,
    status: str | None = None,
    crash: Mapping[str, Any] | None = None,
) -> ProcessEntry:
    """One of the incident's ``processes[]``: its verdict fields empty until forensics fill them.
    ``crash`` (a worker that died of a fatal signal) comes after the documented keys, as it always has."""
    from dlwatch.redact import redact_argv

    entry = ProcessEntry(
        pid=pid,
        role=role,
        worker_id=worker_id,
        start_method=start_method,
        name=name,
        cmdline=" ".join(redact_argv(list(cmdline))) if cmdline else None,
        sample=dict(sample) if sample else None,
        status=None,
        waiting_in=None,
        cpu_progress_s=None,
        stack=None,
    )
    if crash is not None:
        entry = entry.replace(crash=dict(crash))
    if stack is not None:
        entry = entry.replace(stack=Stack.from_dict(stack) if isinstance(stack, Mapping) else stack)
    if status is not None:
        entry = entry.replace(status=status)
    return entry


def process_entry(
    pid: int,
    role: str,
    *,
    worker_id: int | None = None,
    start_method: str | None = None,
    name: str | None = None,
    cmdline: Iterable[str] | None = None,
    sample: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """:func:`process` as the JSON object."""
    return process(
        pid, role, worker_id=worker_id, start_method=start_method, name=name, cmdline=cmdline, sample=sample
    ).to_dict()
