"""What the monitor process costs: CPU per poll against watched processes, CPU share, RSS.

Poll cost: a real ``Monitor`` over a real DataLoader with 1, 8, 32 or 64 idle
persistent workers.  The Monitor runs in a helper process of its own (``python
bench/monitor_cost.py --poll-helper ...``), because a Monitor skips its own
descendants, and here the targets would be descendants of the benchmark.  Each
poll is timed with ``time.process_time`` (CPU, not wall).

CPU share and RSS: a healthy training loop with 8 workers under ``dlwatch.watch``
at the default poll interval; the monitor's utime+stime from /proc over a window.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

from bench._common import REPO, Target, median, proc_cpu_s, proc_status_kib, target

STEADY_POLLS = 20


def _cpu_us(fn: Callable[[], object], reps: int) -> float:
    c0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - c0) / reps * 1e6


def _poll_helper(run_dir: str, polls: int) -> None:
    """In a fresh process: build the Monitor as the monitor process does, poll, print JSON."""
    import dataclasses
    import json as json_mod

    from dlwatch import monitor
    from dlwatch.collect import procfs
    from dlwatch.collect.system import read_system
    from dlwatch.detect import thresholds
    from dlwatch.report import build

    m = monitor.Monitor(run_dir)
    c0 = time.process_time()
    m.poll()  # the first poll: discovery, fd and memory detail, GPU probe set-up
    first = time.process_time() - c0
    steady = []
    for _ in range(polls):
        time.sleep(0.01)
        c0 = time.process_time()
        m.poll()
        steady.append(time.process_time() - c0)
    tracked = [t for t in m.procs.values() if not t.gone]
    pids = [t.pid for t in tracked]
    n, reps = len(pids), 10

    # The parts of one poll, each per process where it is per process (CPU microseconds).
    samples = [t.history[-1] for t in tracked]
    parts = {
        "read_proc": _cpu_us(lambda: [procfs.read_proc(p) for p in pids], reps) / n,
        "fd_summary (1 poll in 5)": _cpu_us(lambda: [procfs.fd_summary(p) for p in pids], reps) / n,
        "mem_detail smaps_rollup+maps (every 10 s)":
            _cpu_us(lambda: [procfs.read_proc(p, mem_detail=True) for p in pids], reps) / n
            - _cpu_us(lambda: [procfs.read_proc(p) for p in pids], reps) / n,
        "num_fds by listdir(/proc/P/fd) (now)": _cpu_us(
            lambda: [len(os.listdir(f"/proc/{p}/fd")) for p in pids], reps) / n,
        "num_fds by stat(/proc/P/fd).st_size (Linux >= 6.2)": _cpu_us(
            lambda: [os.stat(f"/proc/{p}/fd").st_size for p in pids], reps) / n,
        "discover (descendants, comm)": _cpu_us(m._discover, reps) / n,
        "to_dict+compact+json": _cpu_us(lambda: json_mod.dumps(build.compact(
            [dict(s.to_dict(), role="worker") for s in samples]), default=str), reps) / n,
        "fd_pressure, 20 samples": _cpu_us(
            lambda: [thresholds.fd_pressure(list(t.history)[-20:]) for t in tracked], reps) / n,
    }
    parts["read_system (per poll, not per process)"] = _cpu_us(lambda: read_system(m.main_pid), reps)

    # After HISTORY polls every process holds HISTORY samples: fill them as a long, quiet run
    # would (one sample a second) and time whole polls again.
    for t in tracked:
        last = t.history[-1]
        t.history.extend(dataclasses.replace(last, ts=last.ts - monitor.HISTORY + i)
                         for i in range(monitor.HISTORY - len(t.history)))
    parts[f"fd_pressure, {monitor.HISTORY} samples"] = _cpu_us(
        lambda: [thresholds.fd_pressure(list(t.history)) for t in tracked], reps) / n
    full = []
    for _ in range(max(5, polls // 2)):
        c0 = time.process_time()
        m.poll()
        full.append(time.process_time() - c0)
    print(json.dumps({
        "procs": n,
        "history_len": monitor.HISTORY,
        "first_poll_s": first,
        "poll_s": sorted(steady),
        "poll_full_history_s": sorted(full),
        "parts_us_per_proc": parts,
    }))


def _write_config(run_dir: str, main_pid: int, workers: int, report_dir: str) -> None:
    # what agent.Watch._start writes, minus what the poll does not read
    os.makedirs(os.path.join(run_dir, "dumps"), mode=0o700)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump({"pid": main_pid, "started_at": time.time(), "report_dir": report_dir,
                   "options": {"report_dir": report_dir, "poll_interval": 1.0, "stall_timeout": None,
                               "enabled": True, "playbooks": []},
                   "loader": {"num_workers": workers, "batch_size": 1}}, f)


def poll_cost(sizes: tuple[int, ...], polls: int) -> dict[str, Any]:
    targets: list[Target] = []
    rows = []
    with tempfile.TemporaryDirectory(prefix="dlwatch-bench-") as tmp:
        try:
            targets = [Target("idle", str(n)) for n in sizes]  # start all at once: forks overlap
            ready = [t.wait_ready(120) for t in targets]
            for n, t, words in zip(sizes, targets, ready):
                run_dir = os.path.join(tmp, f"run-{n}")
                _write_config(run_dir, t.pid, n, tmp)
                out = subprocess.run([sys.executable, "-m", "bench.monitor_cost", "--poll-helper", run_dir,
                                      str(polls)], capture_output=True, text=True, timeout=120, check=True,
                                     cwd=REPO)
                row = json.loads(out.stdout)
                row["expected_procs"] = len(words)  # main + workers
                rows.append(row)
        finally:
            for t in targets:
                t.kill()
    # least squares: poll CPU = fixed + per_proc * procs, on the median steady poll
    xs = [r["procs"] for r in rows]
    ys = [median(r["poll_s"]) for r in rows]
    slope = _slope(xs, ys)
    my = sum(ys) / len(ys)
    intercept = my - slope * sum(xs) / len(xs)
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    full = [median(r["poll_full_history_s"]) for r in rows]
    return {
        "rows": [{
            "workers": size,
            "procs": r["procs"],
            "first_poll_us": r["first_poll_s"] * 1e6,
            "poll_us_median": median(r["poll_s"]) * 1e6,
            "poll_us_mean": sum(r["poll_s"]) / len(r["poll_s"]) * 1e6,  # includes the 1-in-5 fd breakdowns
            "poll_us_per_proc": median(r["poll_s"]) * 1e6 / r["procs"],
            "history_len": r["history_len"],
            "poll_full_history_us_median": f * 1e6,
            "poll_full_history_us_per_proc": f * 1e6 / r["procs"],
            "parts_us_per_proc": r["parts_us_per_proc"],
        } for size, r, f in zip(sizes, rows, full)],
        "fit_us_per_proc": slope * 1e6,
        "fit_fixed_us": intercept * 1e6,
        "fit_r2": 1 - ss_res / ss_tot if ss_tot else 1.0,
        "fit_full_history_us_per_proc": _slope(xs, full) * 1e6,
    }


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def share(workers: int, window_s: float) -> dict[str, Any]:
    """The monitor's CPU share and memory under a healthy training loop at the default interval."""
    settle_s = 1.5
    with tempfile.TemporaryDirectory(prefix="dlwatch-bench-") as tmp:
        with target("train", str(workers), str(settle_s + window_s + 2.0), tmp) as (t, words):
            mon = int(words[0])
            time.sleep(settle_s)  # the start-up is measured on its own
            c0, w0 = proc_cpu_s(mon), time.monotonic()
            main0 = proc_cpu_s(t.pid)
            time.sleep(window_s)
            c1, w1 = proc_cpu_s(mon), time.monotonic()
            main1 = proc_cpu_s(t.pid)
            rss = proc_status_kib(mon, "VmRSS")
            hwm = proc_status_kib(mon, "VmHWM")
            timeline = os.path.join(words[1], "timeline.jsonl")
            samples = sum(1 for line in open(timeline) if '"kind": "sample"' in line)
            try:
                t.proc.wait(window_s + 15)  # leaves the block itself: the monitor must stop cleanly
                clean_exit = t.proc.returncode == 0
            except subprocess.TimeoutExpired:
                clean_exit = False
    return {
        "workers": workers,
        "window_s": w1 - w0,
        "monitor_cpu_s": c1 - c0,
        "monitor_share_of_core": (c1 - c0) / (w1 - w0),
        "main_share_of_core": (main1 - main0) / (w1 - w0),
        "monitor_rss_mib": rss / 1024 if rss else None,
        "monitor_peak_rss_mib": hwm / 1024 if hwm else None,
        "timeline_samples": samples,
        "clean_exit": clean_exit,
    }


def run(quick: bool) -> dict[str, Any]:
    sizes = (1, 8, 32) if quick else (1, 8, 32, 64)
    return {
        "poll": poll_cost(sizes, 10 if quick else STEADY_POLLS),
        "share": share(8, 5.0 if quick else 20.0),
    }


if __name__ == "__main__":
    if sys.argv[1:2] == ["--poll-helper"]:
        _poll_helper(sys.argv[2], int(sys.argv[3]))
    else:
        print(json.dumps(run("--quick" in sys.argv), indent=1))
