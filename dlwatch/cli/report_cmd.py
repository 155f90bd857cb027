"""List incident reports, or show one.

  dlwatch report              list the incidents in the default directory, newest first, then the run summaries
  dlwatch report DIR          list the incidents and run summaries in DIR
  dlwatch report ID|PATH      show one (an id in the default directory, or a directory holding report.json)
  dlwatch report --runs [DIR] list the run summaries (one per watched block), newest first
  dlwatch report RUN-ID       show a run summary (its advice and preflight findings, the measured figures)
  dlwatch report --job [DIR]  the newest multi-rank job in DIR: which rank stalled first and how, which
                              ranks only waited for it in a collective, stragglers, the time line
                              (--job-id ID: another job of DIR)
  dlwatch report ID --html    print the path of its report.html (charts over the timeline), writing it if missing
                              (into a directory of another user, never: a private temporary file instead)
  dlwatch report RUN-ID --html  the same for a run summary (runs/RUN-ID/report.html: charts over the whole run)

The default directory is $DLWATCH_DIR or ./dlwatch-reports, as for dlwatch.watch.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from dlwatch.wire.config import DEFAULT_REPORT_DIR
from dlwatch.errors import ReportError, UsageError
from dlwatch.redact import outbound
from dlwatch.report import render, store, summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", nargs="?", help="incident id, incident directory, or a report directory to list")
    parser.add_argument(
        "--dir", default=None, help="report directory for ids and listing (default: $DLWATCH_DIR or ./dlwatch-reports)"
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--runs", action="store_true", help="list the run summaries instead of the incidents")
    parser.add_argument(
        "--job", action="store_true", help="merge the incidents and figures of every rank of the newest job in DIR"
    )
    parser.add_argument("--job-id", default=None, metavar="ID", help="with --job: the job to show (default: newest)")
    parser.add_argument(
        "--html",
        action="store_true",
        help="write the incident's or run summary's report.html if it is missing (or --force) and print its path",
    )
    parser.add_argument("--force", action="store_true", help="with --html: write report.html again")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show the quiet notes too (e.g. no NVML on a machine without a GPU)",
    )


def run(args: argparse.Namespace) -> int:
    default_dir = args.dir or os.environ.get("DLWATCH_DIR") or DEFAULT_REPORT_DIR
    if args.job or args.job_id:
        return _job(args.target or default_dir, args.job_id, args.json)
    if args.runs:
        return _list_runs(args.target or default_dir, args.json)
    mode, path = store.resolve_report(args.target, default_dir)
    if mode == "summary" and not (args.html or args.force):
        data = outbound(store.load_summary(path))  # shown redacted, like an incident
        if args.json:
            json.dump(data, sys.stdout, indent=2)
            print()
        else:
            try:  # load_summary checked the types the renderer uses; this is the last line
                lines = list(summary.terminal_lines(data, verbose=args.verbose))
            except Exception as exc:
                raise ReportError(
                    f"{path} cannot be shown: {type(exc).__name__}: {exc}",
                    help="it was not written by a complete dlwatch run; remove it",
                ) from None
            for line in lines:
                print(render.terminal_line(line))
            print(render.terminal_line(f"  summary: {os.path.join(path, 'summary.md')}"))
        return 0
    if args.job or args.job_id:
        return _job(args.target or default_dir, args.job_id, args.json)
    mode, path = store.resolve_report(args.target, default_dir)
    if args.html or args.force:
        if mode not in ("show", "summary"):
            raise UsageError("--html needs one incident or run: dlwatch report ID --html (or RUN-ID --html)")
        from dlwatch.report import html

        page = os.path.join(path, html.HTML_NAME)
        if args.force or not os.path.isfile(page):
            what = "incident" if mode == "show" else "run summary's"
            try:  # a run summary's page is drawn from the samples kept next to it (runs/<id>/timeline.jsonl)
                page = html.write_html(path) if mode == "show" else html.write_summary_html(path)
            except OSError as exc:
                raise ReportError(
                    f"cannot write {page}: {exc.strerror or exc}",
                    help=f"check that the {what} directory is yours and writable",
                ) from None
            except ReportError:
                raise
            except Exception as exc:  # load_report checked the types the page uses; this is the last line
                raise ReportError(
                    f"{path} cannot be drawn: {type(exc).__name__}: {exc}",
                    help="it was not written by a complete dlwatch run; remove it",
                ) from None
        here = os.path.abspath(path)
        if os.path.commonpath([os.path.abspath(page), here]) != here:
            print(
                render.terminal_line(
                    outbound(
                        f"dlwatch: warning: {path} is not yours (its owner could swap it for a link): nothing was written "
                        f"there; the page went to a private file instead"
                    )
                ),
                file=sys.stderr,
            )
        print(render.terminal_line(outbound(page)))
        return 0
    if mode == "show":
        report = outbound(store.load_report(path))  # a report of an older dlwatch is shown redacted too
        if args.json:
            json.dump(report, sys.stdout, indent=2)
            print()
        else:
            try:  # load_report checked the types the renderer uses; this is the last line
                width = shutil.get_terminal_size((100, 24)).columns if sys.stdout.isatty() else 100
                lines = list(
                    render.terminal_view(
                        report, color=render.use_color(sys.stdout), width=max(60, width), verbose=args.verbose
                    )
                )
            except Exception as exc:
                raise ReportError(
                    f"{path} cannot be shown: {type(exc).__name__}: {exc}",
                    help="it was not written by a complete dlwatch run; remove it",
                ) from None
            for line in lines:
                print(line)
            print(render.terminal_line(f"  report: {os.path.join(path, 'report.md')}"))
        return 0
    summaries, warnings = store.list_incidents(path)
    for w in warnings:
        print(render.terminal_line(outbound(f"dlwatch: warning: {w}")), file=sys.stderr)
    if args.json:
        json.dump(outbound([s.to_dict() for s in summaries]), sys.stdout, indent=2)  # older reports too
        print()
    else:
        for line in render.list_lines(summaries):
            print(outbound(line))
        runs, run_warnings = store.list_runs(path)  # the run summaries too (--runs: those alone)
        for w in run_warnings:
            print(render.terminal_line(outbound(f"dlwatch: warning: {w}")), file=sys.stderr)
        if runs:
            print()
            for line in summary.list_lines(runs):
                print(render.terminal_line(line))
    return 0


def _list_runs(report_dir: str, as_json: bool) -> int:
    runs, warnings = store.list_runs(report_dir)
    for w in warnings:
        print(render.terminal_line(outbound(f"dlwatch: warning: {w}")), file=sys.stderr)
    if as_json:
        json.dump(outbound([r.to_dict() for r in runs]), sys.stdout, indent=2)
        print()
    else:
        for line in summary.list_lines(runs):
            print(render.terminal_line(line))
    return 0


def _job(report_dir: str, job_id: str | None, as_json: bool) -> int:
    from dlwatch.errors import NotFoundError
    from dlwatch.report.jobview import job_lines, job_view

    if not os.path.isdir(report_dir):
        raise NotFoundError(
            f"no report directory {report_dir}",
            help="pass the directory the ranks wrote to (DLWATCH_DIR or watch(report_dir=...))",
        )
    view = outbound(job_view(report_dir, job_id))
    for w in view.get("warnings") or ():
        print(render.terminal_line(outbound(f"dlwatch: warning: {w}")), file=sys.stderr)
    if as_json:
        json.dump(view, sys.stdout, indent=2)
        print()
    else:
        for line in job_lines(view):
            print(render.terminal_line(line))
    return 0
