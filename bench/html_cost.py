"""What report.html costs, and where: ``python bench/html_cost.py [--samples N] [--procs N]``.

Renders one incident with a full timeline window (build.TIMELINE_WINDOW samples of a
1 main + N workers job) the way dlwatch does: in the short-lived isolated child
(``python -I -m dlwatch.report.html DIR``) that build.write starts, and prints the
child's wall time and peak RSS (``ru_maxrss`` of the waited child), the page size, and
the RSS of the process that wrote the incident before and after (it does not render,
so it should not move).  Not part of bench/run.py: it takes a few seconds.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tests"))

import psutil  # noqa: E402

from dlwatch._spawn import python_argv  # noqa: E402
from dlwatch.report import build, store  # noqa: E402


def big_report(samples: int, workers: int) -> dict:
    now = time.time()
    r = store.skeleton(trigger="stall", pid=100, now=now)
    r["progress"] = {"batches": 1000, "epochs": 1, "stall_s": 60.0, "data_wait_s": 30.0, "step_s": 200.0}
    procs = [(100, "main")] + [(101 + i, "worker") for i in range(workers)]
    r["processes"] = [build.process_entry(pid, role, sample={"num_fds": 50, "fd_limit": 1024, "rss": 1 << 30})
                      for pid, role in procs]
    r["timeline"] = [{"kind": "sample", "ts": now - samples + i,
                      "heartbeat": {"batches": i * 4, "data_wait_s": i * 0.1, "step_s": i * 0.9, "last_interval_s": 0.25},
                      "procs": [{"pid": pid, "role": role, "num_fds": 50 + i, "fd_limit": 1024, "rss": (1 << 30) + i * 4096,
                                 "uss": (1 << 27) + i * 4096, "cpu_s": i * 0.5} for pid, role in procs],
                      "system": {"shm_total": 8 << 30, "shm_free": (8 << 30) - i * (1 << 20), "mlocked": 1 << 24},
                      "gpus": [{"index": 0, "util_percent": 50 + i % 40}]} for i in range(samples)]
    return r


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=build.TIMELINE_WINDOW)
    ap.add_argument("--procs", type=int, default=8, help="workers per sample")
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    os.environ["DLWATCH_HTML"] = "0"  # this process writes the incident; the child is started below, timed
    me = psutil.Process()
    with tempfile.TemporaryDirectory() as d:
        rss_before = me.memory_info().rss
        path = build.write(big_report(args.samples, args.procs), d)
        rss_after = me.memory_info().rss
        walls = []
        for _ in range(args.runs):
            page = os.path.join(path, "report.html")
            if os.path.exists(page):
                os.unlink(page)
            t0 = time.perf_counter()
            subprocess.run(python_argv(module="dlwatch.report.html", args=[path]), check=True)
            walls.append(time.perf_counter() - t0)
        child_rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        size = os.path.getsize(os.path.join(path, "report.html"))
    walls.sort()
    print(f"timeline: {args.samples} samples x {args.procs + 1} processes")
    print(f"render child: median {walls[len(walls) // 2] * 1000:.0f} ms wall (min {walls[0] * 1000:.0f}, "
          f"max {walls[-1] * 1000:.0f}), peak RSS {child_rss / 2**20:.1f} MiB")
    print(f"report.html: {size / 1024:.1f} KiB")
    print(f"writer RSS: {rss_before / 2**20:.1f} MiB before build.write, {rss_after / 2**20:.1f} MiB after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
