"""List incident reports, or show one.

  dlwatch report              list the incidents in the default directory, newest first
  dlwatch report DIR          list the incidents in DIR
  dlwatch report ID|PATH      show one (an id in the default directory, or a directory holding report.json)
  dlwatch report --runs [DIR] list the run summaries (one per watched block), newest first
  dlwatch report RUN-ID       show a run summary (its advice and preflight findings, the measured figures)

The default directory is $DLWATCH_DIR or ./dlwatch-reports, as for dlwatch.watch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from dlwatch.config import DEFAULT_REPORT_DIR
from dlwatch.report import render, store, summary


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", nargs="?", help="incident id, incident directory, or a report directory to list")
    parser.add_argument("--dir", default=None, help="report directory for ids and listing (default: $DLWATCH_DIR or ./dlwatch-reports)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of text")
    parser.add_argument("--runs", action="store_true", help="list the run summaries instead of the incidents")


def run(args: argparse.Namespace) -> int:
    default_dir = args.dir or os.environ.get("DLWATCH_DIR") or DEFAULT_REPORT_DIR
    if args.runs:
        return _list_runs(args.target or default_dir, args.json)
    mode, path = store.resolve_report(args.target, default_dir)
    if mode == "summary":
        data = store.load_summary(path)
        if args.json:
            json.dump(data, sys.stdout, indent=2)
            print()
        else:
            for line in summary.terminal_lines(data):
                print(line)
            print(f"  summary: {os.path.join(path, 'summary.md')}")
        return 0
    if mode == "show":
        report = store.load_report(path)
        if args.json:
            json.dump(report, sys.stdout, indent=2)
            print()
        else:
            render.render_terminal(report, sys.stdout)
            print(f"  report: {os.path.join(path, 'report.md')}")
        return 0
    summaries, warnings = store.list_incidents(path)
    for w in warnings:
        print(f"dlwatch: warning: {w}", file=sys.stderr)
    if args.json:
        json.dump([s.to_dict() for s in summaries], sys.stdout, indent=2)
        print()
    else:
        for line in render.list_lines(summaries):
            print(line)
    return 0


def _list_runs(report_dir: str, as_json: bool) -> int:
    runs, warnings = store.list_runs(report_dir)
    for w in warnings:
        print(f"dlwatch: warning: {w}", file=sys.stderr)
    if as_json:
        json.dump([r.to_dict() for r in runs], sys.stdout, indent=2)
        print()
    else:
        for line in summary.list_lines(runs):
            print(line)
    return 0
