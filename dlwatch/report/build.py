"""Assemble an incident report from what was collected and judged, then write it.

One place builds every report (monitor, attach, and the in-process fallback when
the monitor is gone), so report.json has the same shape whoever wrote it.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterable, Mapping, Sequence

from dlwatch._log import get_logger
from dlwatch.report import render, store

log = get_logger("dlwatch.report")

TIMELINE_WINDOW = 120  # records copied into an incident


def summary_line(report: Mapping[str, Any]) -> str:
    line = _summary_line(report)
    related = report.get("related") or ()
    first = related[0] if isinstance(related, list) and related and isinstance(related[0], dict) else None
    if first is not None and first.get("id"):  # one failure, one incident: the earlier report of it
        line += f" (first seen before any error: incident {first['id']})"
    return line


def _summary_line(report: Mapping[str, Any]) -> str:
    trig = report.get("trigger")
    exc = report.get("exception") or {}
    findings = report.get("findings") or []
    top = (
        f" -> {findings[0]['title']}" if findings and isinstance(findings[0], dict) and findings[0].get("title") else ""
    )
    job = report.get("job") or {}
    if isinstance(job, dict) and job.get("role") == "waiting":
        rank = (report.get("rank") or {}).get("rank")
        top = (
            f" -> rank {rank if rank is not None else '?'} waits in {job.get('waiting_in')} for another rank: "
            f"see `{job.get('view')}`"
        )
    if trig == "exception":
        msg = (str(exc.get("message") or "").strip().splitlines() or [""])[-1][:160]
        return f"{exc.get('type', 'exception')}: {msg}{top}"
    if trig == "stall":
        prog = report.get("progress") or {}
        return f"no batch progress for {prog.get('stall_s', 0):.0f} s ({report.get('classification') or 'unclassified'}){top}"
    if trig == "attach":
        return f"attached to pid {report.get('pid')}: {report.get('classification') or 'unclassified'}{top}"
    if trig == "exit":
        return (report.get("summary") or "the training process ended without leaving the watch block") + top
    return (report.get("summary") or "a threshold was crossed") + top


def add_findings(
    report: dict[str, Any],
    playbook_dirs: Sequence[str] = (),
    *,
    playbooks: Sequence[Any] | None = None,
    ignore: Iterable[str] = (),
) -> None:
    """Match playbooks (``playbooks`` when already loaded, else those of ``playbook_dirs``).

    A playbook in ``ignore`` (the ``ignore`` option) makes no finding; the report says so.
    A failure here becomes a note, never a lost report.
    """
    try:
        from dlwatch.detect.match import match
        from dlwatch.wire.playbooks import load_playbooks

        if playbooks is None:
            playbooks = load_playbooks(tuple(playbook_dirs))
        skip = set(ignore)
        # advice playbooks are never matched into an incident: they belong to the run summary
        findings = match(report, [pb for pb in playbooks if pb.id not in skip and not getattr(pb, "is_advice", False)])
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


def write(report: dict[str, Any], report_dir: str, *, extra_files: Mapping[str, bytes] | None = None) -> str:
    """Write the incident, falling back to a private temporary directory if report_dir fails."""
    if not report.get("summary") or report["trigger"] in ("exception", "stall", "attach"):
        report["summary"] = summary_line(report)
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
    return path


def write_run_summary(
    summary: dict[str, Any], report_dir: str, *, keep_runs: int, timeline_dir: str | None
) -> str | None:
    """Write ``runs/<id>/`` (falling back to the private temporary directory if report_dir fails),
    remove the oldest summaries beyond ``keep_runs`` there (never this one), and start the child
    that draws its report.html from the timeline files in ``timeline_dir``, handed to it open.

    What the monitor and the training process (when the monitor is gone) both do at the end of a
    block.  Returns the summary's path, or None when no directory took it; never raises.
    """
    from dlwatch.report import summary as sm

    path = None
    for base in (report_dir, store.fallback_dir()):
        try:
            path = store.write_summary(base, summary, render_markdown=sm.render_markdown)
            break
        except OSError as exc:
            log.warning("summary_write_failed", report_dir=base, error=str(exc))
    if path is None:
        return None
    base = os.path.dirname(os.path.dirname(path))
    store.prune_runs(base, keep_runs, spare=os.path.basename(path))
    from dlwatch.wire.job import safe_name

    rank = summary.get("rank") if isinstance(summary.get("rank"), dict) else {}
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
    now = time.time()
    report = store.skeleton(trigger="exception", pid=os.getpid() if pid is None else pid, now=now)
    report["loader"] = cfg.get("loader")
    report["config"] = cfg.get("options") or {}
    report["exception"] = dict(exception)
    report["timeline"] = read_timeline(run_dir)
    report["notes"].append(
        "the monitor process was not running; this report was written by the training process "
        "and holds no samples taken after the monitor stopped"
    )
    opts = cfg.get("options") or {}
    add_findings(report, opts.get("playbooks") or (), ignore=opts.get("ignore") or ())
    return write(report, report_dir)


def compact(obj: Any) -> Any:
    """Drop None values from sample dicts: timelines stay small and readable."""
    if isinstance(obj, dict):
        return {k: compact(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return [compact(v) for v in obj]
    return obj


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
    from dlwatch.redact import redact_argv

    return {
        "pid": pid,
        "role": role,
        "worker_id": worker_id,
        "start_method": start_method,
        "name": name,
        "cmdline": " ".join(redact_argv(list(cmdline))) if cmdline else None,
        "sample": dict(sample) if sample else None,
        "status": None,
        "waiting_in": None,
        "cpu_progress_s": None,
        "stack": None,
    }
