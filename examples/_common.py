"""What every example shares: the --report-dir option and printing where the reports went.

Each example prints one line ``REPORT <path>`` per incident it caused (none for
the healthy ones); ``dlwatch demo`` and the tests read those lines.
"""

from __future__ import annotations

import argparse
import os


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--report-dir", default=os.environ.get("DLWATCH_DIR", "./dlwatch-reports"),
                        help="where dlwatch writes incidents (default: $DLWATCH_DIR or ./dlwatch-reports)")
    args = parser.parse_args()
    args.report_dir = os.path.abspath(args.report_dir)
    return args


def incidents(report_dir: str) -> set[str]:
    """Incident directories: every entry not starting with '.' (those are runs and half-written ones)."""
    try:
        names = os.listdir(report_dir)
    except FileNotFoundError:
        return set()
    return {os.path.join(report_dir, n) for n in names
            if not n.startswith(".") and os.path.isfile(os.path.join(report_dir, n, "report.json"))}


def print_reports(report_dir: str, before: set[str]) -> int:
    """Print ``REPORT <path>`` for each incident that appeared since ``before``; return how many."""
    # oldest first: ids carry the time only to the second, the file's mtime tells them apart
    new = sorted(incidents(report_dir) - before, key=lambda p: os.stat(os.path.join(p, "report.json")).st_mtime)
    for path in new:
        print(f"REPORT {path}", flush=True)
    if not new:
        print(f"no incident (nothing written to {report_dir})", flush=True)
    return len(new)


def print_summary(watch) -> list[str]:
    """Print ``SUMMARY <path>`` and ``ADVICE <id>`` lines for the run summary of a finished block."""
    summary = watch.summary
    if not summary:
        print("no run summary", flush=True)
        return []
    path = os.path.join(watch.report_dir, "runs", summary["id"])
    print(f"SUMMARY {path}", flush=True)
    loop = summary.get("loop") or {}
    print(f"loop: {loop.get('batches')} batches, {loop.get('epochs')} epochs, steady data wait "
          f"{loop.get('steady_data_wait_share')} of the loop", flush=True)
    ids = [f["playbook"] for f in summary.get("advice") or ()]
    for f in summary.get("advice") or ():
        print(f"ADVICE {f['playbook']}", flush=True)
    if not ids:
        print("no advice", flush=True)
    return ids
