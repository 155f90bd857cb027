"""What report.html costs, and where: ``python bench/html_cost.py [--samples N] [--procs N] [--run-samples N]``.

Renders one incident with a full timeline window (build.TIMELINE_WINDOW samples of a
1 main + N workers job) the way dlwatch does: in the short-lived isolated child
(``python -I -m dlwatch.report.html DIR``) that build.write starts, and prints the
child's wall time and peak RSS (``ru_maxrss`` of the waited child), the page size, and
the RSS of the process that wrote the incident before and after (it does not render,
so it should not move).

Then a run summary's page the way the monitor has it drawn: a watch run directory with
a full timeline (timeline.1.jsonl + timeline.jsonl at the monitor's rotation cap, about
2 x 8 MiB: the most a run of any length leaves), its files handed open to the child
(``--timeline-fd``), which thins the samples, keeps them in runs/<id>/timeline.jsonl and
draws the page.  Each kind is timed in its own child process, so that ``ru_maxrss``
is that render's alone.  Last, what the monitor pays for starting the child (importing
dlwatch.report.html once, at the block's end).  Not part of bench/run.py: it takes a few seconds.
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
# the checkout, for bench._common: last, so that an installed dlwatch comes first
sys.path.append(os.path.dirname(HERE))

import psutil  # noqa: E402

from bench._common import add_install_option, dlwatch_under_test  # noqa: E402
from dlwatch._fs import json_line  # noqa: E402
from dlwatch._spawn import python_argv  # noqa: E402
from dlwatch.report import build, store  # noqa: E402
from dlwatch.report import summary as sm  # noqa: E402


def big_report(samples: int, workers: int) -> dict:
    now = time.time()
    r = store.skeleton(trigger="stall", pid=100, now=now)
    r["progress"] = {"batches": 1000, "epochs": 1, "stall_s": 60.0, "data_wait_s": 30.0, "step_s": 200.0}
    procs = [(100, "main")] + [(101 + i, "worker") for i in range(workers)]
    r["processes"] = [
        build.process_entry(pid, role, sample={"num_fds": 50, "fd_limit": 1024, "rss": 1 << 30}) for pid, role in procs
    ]
    r["timeline"] = [
        {
            "kind": "sample",
            "ts": now - samples + i,
            "heartbeat": {"batches": i * 4, "data_wait_s": i * 0.1, "step_s": i * 0.9, "last_interval_s": 0.25},
            "procs": [
                {
                    "pid": pid,
                    "role": role,
                    "num_fds": 50 + i,
                    "fd_limit": 1024,
                    "rss": (1 << 30) + i * 4096,
                    "uss": (1 << 27) + i * 4096,
                    "cpu_s": i * 0.5,
                }
                for pid, role in procs
            ],
            "system": {"shm_total": 8 << 30, "shm_free": (8 << 30) - i * (1 << 20), "mlocked": 1 << 24},
            "gpus": [{"index": 0, "util_percent": 50 + i % 40}],
        }
        for i in range(samples)
    ]
    return r


def sample(now: float, i: int, workers: int) -> dict:
    procs = [(100, "main")] + [(101 + w, "worker") for w in range(workers)]
    return {
        "kind": "sample",
        "ts": now + i * 0.2,
        "heartbeat": {
            "batches": i * 4,
            "epochs": 1 + i // 3000,
            "data_wait_s": i * 0.1,
            "step_s": i * 0.9,
            "last_interval_s": 0.25,
            "state": 1,
            "seq": i,
        },
        "procs": [
            {
                "pid": pid,
                "role": role,
                "name": "python",
                "state": "S",
                "num_fds": 50 + i % 7,
                "fd_limit": 1024,
                "rss": (1 << 30) + i * 4096,
                "uss": (1 << 27) + i * 4096,
                "cpu_s": i * 0.15,
                "num_threads": 4,
                "wchan": "do_epoll_wait",
                "io_read_bytes": i * 65536,
            }
            for pid, role in procs
        ],
        "system": {
            "shm_total": 8 << 30,
            "shm_free": (8 << 30) - i % 100 * (1 << 20),
            "mlocked": 1 << 24,
            "mem_available": 100 << 30,
            "load1": 3.0,
        },
        "gpus": [{"index": 0, "util_percent": 50 + i % 40, "memory_used": 1 << 33}],
    }


def full_run_dir(d: str, workers: int, cap: int, limit: int | None) -> tuple[str, int]:
    """A watch run directory whose timeline is at the rotation cap (or ``limit`` samples); samples written."""
    run_dir = os.path.join(d, "watch-run")
    os.mkdir(run_dir, 0o700)
    now, i = time.time() - 86400, 0
    for name in ("timeline.1.jsonl", "timeline.jsonl"):
        size = 0
        with open(os.path.join(run_dir, name), "wb") as f:
            while size < cap and (limit is None or i < limit):
                line = json_line(sample(now, i, workers))
                f.write(line)
                size += len(line)
                i += 1
    return run_dir, i


def summary_render(d: str, workers: int, limit: int | None) -> dict:
    """In a child of its own: write a summary, hand its timeline over open, time the render child."""
    from dlwatch.monitor.journal import TIMELINE_CAP_BYTES
    from dlwatch.report import html

    run_dir, n = full_run_dir(d, workers, TIMELINE_CAP_BYTES, limit)
    s = sm.skeleton(run_id="bench-run", pid=100, now=time.time(), started_at=time.time() - 86400)
    s["workers"] = [{"pid": 101 + w, "worker_id": w, "cpu_util": 0.75, "rss_peak": 1 << 30} for w in range(workers)]
    path = store.write_summary(os.path.join(d, "reports"), s, render_markdown=sm.render_markdown)
    fds = html._open_timeline(run_dir)
    args = [path] + [a for fd in fds for a in ("--timeline-fd", str(fd))]
    t0 = time.perf_counter()
    subprocess.run(python_argv(module="dlwatch.report.html", args=args), check=True, pass_fds=fds)
    wall = time.perf_counter() - t0
    for fd in fds:
        os.close(fd)
    return {
        "samples": n,
        "timeline_bytes": sum(os.path.getsize(os.path.join(run_dir, f)) for f in os.listdir(run_dir)),
        "wall_s": wall,
        "child_rss": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024,
        "page_bytes": os.path.getsize(os.path.join(path, "report.html")),
        "kept_bytes": os.path.getsize(os.path.join(path, html.TIMELINE_NAME)),
    }


def summary_main(argv: list[str]) -> int:  # the child that runs one summary render (its own ru_maxrss)
    import json

    workers, limit = int(argv[0]), (int(argv[1]) or None)
    with tempfile.TemporaryDirectory() as d:
        print(json.dumps(summary_render(d, workers, limit)))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=build.TIMELINE_WINDOW)
    ap.add_argument("--procs", type=int, default=8, help="workers per sample")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument(
        "--run-samples",
        type=int,
        default=0,
        help="samples in the run's timeline (default: as many as the rotation cap holds)",
    )
    add_install_option(ap)
    args = ap.parse_args()
    dlwatch_under_test(editable=args.editable)
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
    print(
        f"render child: median {walls[len(walls) // 2] * 1000:.0f} ms wall (min {walls[0] * 1000:.0f}, "
        f"max {walls[-1] * 1000:.0f}), peak RSS {child_rss / 2**20:.1f} MiB"
    )
    print(f"report.html: {size / 1024:.1f} KiB")
    print(f"writer RSS: {rss_before / 2**20:.1f} MiB before build.write, {rss_after / 2**20:.1f} MiB after")

    import json

    results = []
    for _ in range(max(1, args.runs // 2)):  # each builds a 16 MiB timeline first: fewer runs
        out = subprocess.run(
            [sys.executable, os.path.abspath(__file__), "--summary-child", str(args.procs), str(args.run_samples)],
            check=True,
            capture_output=True,
            text=True,
        )
        results.append(json.loads(out.stdout))
    results.sort(key=lambda r: r["wall_s"])
    r = results[len(results) // 2]
    print(
        f"run summary: timeline {r['samples']} samples x {args.procs + 1} processes "
        f"({r['timeline_bytes'] / 2**20:.1f} MiB, handed to the child open)"
    )
    print(
        f"summary render child: median {r['wall_s'] * 1000:.0f} ms wall (min {results[0]['wall_s'] * 1000:.0f}, "
        f"max {results[-1]['wall_s'] * 1000:.0f}), peak RSS {max(x['child_rss'] for x in results) / 2**20:.1f} MiB"
    )
    print(
        f"runs/<id>/report.html: {r['page_bytes'] / 1024:.1f} KiB; kept timeline.jsonl {r['kept_bytes'] / 1024:.1f} KiB"
    )
    # what the monitor pays to start the child: importing this module once, at the block's end
    code = (
        "import gc, psutil, dlwatch.monitor.loop, dlwatch.report.build, dlwatch.report.summary\n"
        "p = psutil.Process(); p.memory_full_info(); gc.collect(); a = p.memory_full_info().uss\n"
        "import dlwatch.report.html\ngc.collect(); print(p.memory_full_info().uss - a)"
    )
    subprocess.run([sys.executable, "-I", "-c", "import dlwatch.report.html"], check=True)  # its bytecode cached
    cost = int(subprocess.run([sys.executable, "-I", "-c", code], check=True, capture_output=True, text=True).stdout)
    print(f"monitor: importing dlwatch.report.html to start the child costs {cost / 1024:.0f} KiB USS, once")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--summary-child"]:
        sys.exit(summary_main(sys.argv[2:]))
    sys.exit(main())
