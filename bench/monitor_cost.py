"""What the monitor process costs: CPU per poll against watched processes, CPU share, RSS.

Poll cost: a real ``Monitor`` over a real DataLoader with 1, 8, 32 or 64 idle
persistent workers.  The Monitor runs in a helper process of its own (``python
bench/monitor_cost.py --poll-helper ...``), because a Monitor skips its own
descendants, and here the targets would be descendants of the benchmark.  Each
poll is timed with ``time.process_time`` (CPU, not wall), and right after it, in
the same process, the raw /proc read: the files a poll reads with nothing around
them (``_raw_proc_read`` per process, ``_raw_system_read`` once), so that the two
figures see the same machine load.

``python bench/monitor_cost.py --poll-only [--sizes 1,8,32] [--polls N] [--code DIR]``
runs only the poll cost (a minute, and the 1+32 share's 65 s); ``--code DIR`` polls with another
checkout's ``dlwatch`` (a tree exported from an older commit); ``--before DIR [--rounds N]`` gives
poll/raw of both trees, their helpers alternating on the same processes, and both shares.
``--workload busy`` polls workers kept busy instead of idle ones: every poll then finds every process
changed, and none of what a poll keeps from the last one for an unchanged process applies (the
target is the idle case's; the busy figure says what a poll costs at worst).

CPU share and RSS: a healthy training loop with 8 workers, and one with 32, under ``dlwatch.watch``
at the default poll interval; the monitor's utime+stime from /proc over a window.  The 1+32 window
is 65 s: a quiet process's USS is read again every 60 s (``MEM_DETAIL_MAX_AGE_S``), and that read
(~2.5 ms a torch worker) belongs in the share.  ``--poll-only`` prints it too (``--share 0`` leaves
it out, ``--share-window S`` changes the window).

Targets: poll/raw <= 2.0 at 1+8; the monitor's CPU <= 0.5% of a core at 1+32.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable

# the checkout, for bench._common: last, so that an installed dlwatch comes first
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench._common import Target, median, proc_cpu_s, proc_status_kib, target

STEADY_POLLS = 60  # polls timed after a pause: the median of 20 read up to 0.2 apart from run to run
SHARE_WORKERS = 32
SHARE_WINDOW_S = 65.0  # longer than MEM_DETAIL_MAX_AGE_S: one refresh of every quiet process's USS falls in it


def _cpu_us(fn: Callable[[], object], reps: int) -> float:
    c0 = time.process_time()
    for _ in range(reps):
        fn()
    return (time.process_time() - c0) / reps * 1e6


def _read_file(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.read(fd, 65536)
    finally:
        os.close(fd)


def _raw_proc_read(pid: int) -> None:
    """What a poll reads of one process, with nothing around it (no parsing, no objects):
    /proc/PID/{stat,statm,syscall,wchan}, a stat of /proc/PID/fd (the fd count on Linux >= 6.2)
    and its RLIMIT_NOFILE.  The reads of a slower cadence (fd breakdown, USS) are left out, as
    the median poll leaves them out."""
    base = f"/proc/{pid}/"
    for name in ("stat", "statm", "syscall", "wchan"):
        _read_file(base + name)
    os.stat(base + "fd")
    resource.prlimit(pid, resource.RLIMIT_NOFILE)


def _cgroup_files(pid: int) -> list[str]:
    """The memory cgroup's usage and OOM-count files for pid (v1, else v2), found as dlwatch finds them."""
    v1 = v2 = None
    with open(f"/proc/{pid}/cgroup") as f:
        for line in f:
            parts = line.rstrip("\n").split(":", 2)
            if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
                v2 = parts[2]
            elif len(parts) == 3 and "memory" in parts[1].split(","):
                v1 = parts[2]
    for base, names in (
        (
            [os.path.join("/sys/fs/cgroup/memory", v1.lstrip("/")), "/sys/fs/cgroup/memory"] if v1 else [],
            ("memory.usage_in_bytes", "memory.oom_control"),
        ),
        ([os.path.join("/sys/fs/cgroup", v2.lstrip("/"))] if v2 else [], ("memory.current", "memory.events")),
    ):
        for d in base:
            if os.path.exists(os.path.join(d, names[0])):
                return [os.path.join(d, n) for n in names]
    return []


def _raw_system_read(cgroup_files: list[str]) -> None:
    """What a poll reads of the system, with nothing around it: /proc/meminfo, /proc/vmstat
    (the host's OOM kills), the cgroup's usage and OOM count, statvfs and a stat of /dev/shm."""
    for path in ("/proc/meminfo", "/proc/vmstat", *cgroup_files):
        _read_file(path)
    os.statvfs("/dev/shm")
    os.stat("/dev/shm")


def _poll_helper(run_dir: str, polls: int, code: str | None = None) -> None:
    """In a fresh process: build the Monitor as the monitor process does, poll, print JSON."""
    import dataclasses
    import json as json_mod

    if code:  # another checkout's dlwatch (imported nowhere before this point)
        sys.path.insert(0, os.path.abspath(code))
    from dlwatch.monitor import loop as monitor
    from dlwatch.collect import procfs
    from dlwatch.collect.system import read_system
    from dlwatch.detect import thresholds
    from dlwatch.report import build

    m = monitor.Monitor(run_dir)
    # the tree before the monitor's rooms kept these on the Monitor itself
    sampler = getattr(m, "sampler", m)
    discover = getattr(sampler, "discover", None) or getattr(m, "_discover")
    m._drain_events()  # the loader_workers event: every worker tracked as a worker (16 "other" at most)
    c0 = time.process_time()
    m.poll()  # the first poll: discovery, fd and memory detail, GPU probe set-up
    first = time.process_time() - c0
    cgroup_files = _cgroup_files(m.main_pid)
    steady, raw_procs, raw_system = [], [], []
    for _ in range(polls):
        # each poll, then the raw reads of the same processes: the same load.  Both after a pause,
        # as a monitor polls (once a second): caches are cold then, and a poll costs 2-3x what
        # the same poll costs back to back; the raw reads get the same pause so as not to look cheaper.
        time.sleep(0.01)
        c0 = time.process_time()
        m.poll()
        c1 = time.process_time()
        time.sleep(0.01)
        c2 = time.process_time()
        for t in list(m.procs.values()):  # in the poll's order: processes, then the system
            if not t.gone:
                _raw_proc_read(t.pid)
        c3 = time.process_time()
        _raw_system_read(cgroup_files)
        c4 = time.process_time()
        steady.append(c1 - c0)
        raw_procs.append(c3 - c2)
        raw_system.append(c4 - c3)
    # the same back to back (caches warm): what the code costs, apart from the machine's caches
    warm, warm_raw = [], []
    for _ in range(polls):
        c0 = time.process_time()
        m.poll()
        c1 = time.process_time()
        for t in list(m.procs.values()):
            if not t.gone:
                _raw_proc_read(t.pid)
        _raw_system_read(cgroup_files)
        warm.append(c1 - c0)
        warm_raw.append(time.process_time() - c1)
    tracked = [t for t in m.procs.values() if not t.gone]
    pids = [t.pid for t in tracked]
    n, reps = len(pids), 10

    # The parts of one poll, each per process where it is per process (CPU microseconds).
    samples = [t.history[-1] for t in tracked]
    parts = {
        "read_proc": _cpu_us(lambda: [procfs.read_proc(p) for p in pids], reps) / n,
        "fd_summary (1 poll in 5)": _cpu_us(lambda: [procfs.fd_summary(p) for p in pids], reps) / n,
        "mem_detail smaps_rollup+maps (every 10 s)": _cpu_us(
            lambda: [procfs.read_proc(p, mem_detail=True) for p in pids], reps
        )
        / n
        - _cpu_us(lambda: [procfs.read_proc(p) for p in pids], reps) / n,
        "num_fds by listdir(/proc/P/fd) (now)": _cpu_us(lambda: [len(os.listdir(f"/proc/{p}/fd")) for p in pids], reps)
        / n,
        "num_fds by stat(/proc/P/fd).st_size (Linux >= 6.2)": _cpu_us(
            lambda: [os.stat(f"/proc/{p}/fd").st_size for p in pids], reps
        )
        / n,
        "discover (descendants, comm)": _cpu_us(discover, reps) / n,
        "to_dict+compact+json": _cpu_us(
            lambda: json_mod.dumps(build.compact([dict(s.to_dict(), role="worker") for s in samples]), default=str),
            reps,
        )
        / n,
    }
    if hasattr(procfs, "ProcFiles"):  # as the monitor reads: its files kept open (absent from older trees)
        kept = [procfs.ProcFiles(p) for p in pids]
        parts["read_proc, files kept open (ProcFiles, as the monitor reads)"] = (
            _cpu_us(lambda: [procfs.read_proc(f.pid, files=f) for f in kept], reps) / n
        )
        for f in kept:
            f.close()
    try:  # the one-walk record (absent from a tree before it)
        from dlwatch.monitor import timeline as timeline_record

        parts["timeline_record+encode (one walk, redacted)"] = (
            _cpu_us(
                lambda: timeline_record.encode(
                    timeline_record.sample_record(0.0, None, [(s, "worker") for s in samples], None, ())
                ),
                reps,
            )
            / n
        )
        if hasattr(timeline_record, "sample_line"):  # the line straight from the samples (absent before it)
            parts["timeline sample_line (the line, no record)"] = (
                _cpu_us(
                    lambda: timeline_record.sample_line(0.0, None, [(s, "worker") for s in samples], None, ()), reps
                )
                / n
            )
    except ImportError:
        pass
    parts["fd_pressure, 20 samples"] = (
        _cpu_us(lambda: [thresholds.fd_pressure(list(t.history)[-20:]) for t in tracked], reps) / n
    )
    parts["read_system (per poll, not per process)"] = _cpu_us(lambda: read_system(m.main_pid), reps)
    probe = getattr(sampler, "system_probe", None)  # what the monitor reads every poll (absent before SystemProbe)
    if probe is not None:
        parts["SystemProbe.sample (per poll, not per process)"] = _cpu_us(probe.sample, reps)

    # After HISTORY polls every process holds HISTORY samples: fill them as a long, quiet run
    # would (one sample a second) and time whole polls again.
    history = tracked[0].history.maxlen  # HISTORY, wherever the tree defines it
    for t in tracked:
        last = t.history[-1]
        t.history.extend(dataclasses.replace(last, ts=last.ts - history + i) for i in range(history - len(t.history)))
    parts[f"fd_pressure, {history} samples"] = (
        _cpu_us(lambda: [thresholds.fd_pressure(list(t.history)) for t in tracked], reps) / n
    )
    full = []
    for _ in range(max(5, polls // 2)):
        time.sleep(0.01)  # paused like the steady polls (they ran back to back before: warm caches)
        c0 = time.process_time()
        m.poll()
        full.append(time.process_time() - c0)
    print(
        json.dumps(
            {
                "procs": n,
                "history_len": history,
                "first_poll_s": first,
                "poll_s": sorted(steady),
                "raw_procs_s": sorted(raw_procs),
                "raw_system_s": sorted(raw_system),
                "poll_over_raw": sorted(p / (r + y) for p, r, y in zip(steady, raw_procs, raw_system)),
                "warm_poll_s": sorted(warm),
                "warm_raw_s": sorted(warm_raw),
                "poll_full_history_s": sorted(full),
                "parts_us_per_proc": parts,
            }
        )
    )


def _write_config(
    run_dir: str, main_pid: int, workers: int, report_dir: str, worker_pids: list[int] | None = None
) -> None:
    # what agent.Watch._start writes, minus what the poll does not read; the loader_workers
    # event the agent writes when the workers start (without it the Monitor finds them as
    # "other" descendants and keeps 16 at most: runs before this one timed 1+16 as "1+32", "1+64")
    os.makedirs(os.path.join(run_dir, "dumps"), mode=0o700)
    with open(os.path.join(run_dir, "config.json"), "w") as f:
        json.dump(
            {
                "pid": main_pid,
                "started_at": time.time(),
                "report_dir": report_dir,
                "options": {
                    "report_dir": report_dir,
                    "poll_interval": 1.0,
                    "stall_timeout": None,
                    "enabled": True,
                    "playbooks": [],
                },
                "loader": {"num_workers": workers, "batch_size": 1},
            },
            f,
        )
    # and the heartbeat file the training process keeps (a poll reads it first; a missing one costs
    # an exception instead of a read)
    from dlwatch.wire import heartbeat

    heartbeat.HeartbeatWriter(os.path.join(run_dir, "heartbeat")).close(heartbeat.STATE_OUTSIDE)
    if worker_pids:
        with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
            f.write(
                json.dumps({"ts": time.time(), "event": "loader_workers", "pid": main_pid, "pids": worker_pids}) + "\n"
            )
        os.chmod(os.path.join(run_dir, "events.jsonl"), 0o600)


def poll_cost(sizes: tuple[int, ...], polls: int, code: str | None = None, workload: str = "idle") -> dict[str, Any]:
    targets: list[Target] = []
    rows = []
    with tempfile.TemporaryDirectory(prefix="dlwatch-bench-") as tmp:
        try:
            targets = [Target(workload, str(n)) for n in sizes]  # start all at once: forks overlap
            ready = [t.wait_ready(120) for t in targets]
            for n, t, words in zip(sizes, targets, ready):
                run_dir = os.path.join(tmp, f"run-{n}")
                _write_config(run_dir, t.pid, n, tmp, [int(w) for w in words[1:]])
                out = subprocess.run(
                    [
                        sys.executable,
                        os.path.abspath(__file__),  # from outside the checkout: the dlwatch under test
                        "--poll-helper",
                        run_dir,
                        str(polls),
                        *([code] if code else []),
                    ],
                    capture_output=True,
                    text=True,
                    timeout=300,
                    check=True,
                    cwd=tmp,
                )
                row = json.loads(out.stdout)
                row["expected_procs"] = len(words)  # main + workers
                rows.append(row)
        finally:
            for t in targets:
                t.kill()
    # least squares: poll CPU = fixed + per_proc * procs, on the median steady poll; the raw reads alike
    xs = [r["procs"] for r in rows]
    ys = [median(r["poll_s"]) for r in rows]
    raw = [median(r["raw_procs_s"]) for r in rows]
    slope, intercept, r2 = _fit(xs, ys)
    raw_slope, raw_intercept, _ = _fit(xs, raw)
    full = [median(r["poll_full_history_s"]) for r in rows]
    warm_slope, _, _ = _fit(xs, [median(r["warm_poll_s"]) for r in rows])
    first = rows[0]
    return {
        "code": code,
        "workload": workload,
        "rows": [
            {
                "workers": size,
                "procs": r["procs"],  # tracked by the Monitor; expected_procs: main + workers started
                "expected_procs": r["expected_procs"],
                "first_poll_us": r["first_poll_s"] * 1e6,
                "poll_us_median": median(r["poll_s"]) * 1e6,
                "poll_us_mean": sum(r["poll_s"]) / len(r["poll_s"]) * 1e6,  # includes the 1-in-5 discovery polls
                "poll_us_per_proc": median(r["poll_s"]) * 1e6 / r["procs"],
                "poll_us_spread": [
                    r["poll_s"][len(r["poll_s"]) // 4] * 1e6,
                    r["poll_s"][3 * len(r["poll_s"]) // 4] * 1e6,
                ],
                # the raw reads of the same processes right after each poll (same run, same load)
                "raw_proc_us_per_proc": median(r["raw_procs_s"]) * 1e6 / r["procs"],
                "raw_system_us": median(r["raw_system_s"]) * 1e6,
                "poll_over_raw_median": median(r["poll_over_raw"]),
                "warm_poll_us_median": median(r["warm_poll_s"]) * 1e6,
                "warm_raw_us_median": median(r["warm_raw_s"]) * 1e6,  # processes and system together
                "history_len": r["history_len"],
                "poll_full_history_us_median": f * 1e6,
                "poll_full_history_us_per_proc": f * 1e6 / r["procs"],
                "parts_us_per_proc": r["parts_us_per_proc"],
            }
            for size, r, f in zip(sizes, rows, full)
        ],
        "fit_us_per_proc": slope * 1e6,
        "fit_fixed_us": intercept * 1e6,
        "fit_r2": r2,
        "fit_full_history_us_per_proc": _slope(xs, full) * 1e6,
        "raw_fit_us_per_proc": raw_slope * 1e6,
        "raw_fit_fixed_us": raw_intercept * 1e6,
        # the smallest job's poll less its processes at the fitted per-process cost
        "fixed_us_smallest": (median(first["poll_s"]) - slope * first["procs"]) * 1e6,
        "raw_system_us_smallest": median(first["raw_system_s"]) * 1e6,
        "warm_fit_us_per_proc": warm_slope * 1e6,
        "warm_fixed_us_smallest": (median(first["warm_poll_s"]) - warm_slope * first["procs"]) * 1e6,
    }


def compare(
    sizes: tuple[int, ...], polls: int, trees: dict[str, str | None], rounds: int, workload: str = "idle"
) -> dict[str, Any]:
    """poll/raw of each tree (None: this checkout) on the same targets, the trees' helpers alternating
    round by round: a before/after in one run, under the same load."""
    got: dict[str, dict[int, list[float]]] = {name: {n: [] for n in sizes} for name in trees}
    with tempfile.TemporaryDirectory(prefix="dlwatch-bench-") as tmp:
        targets: list[Target] = []
        try:
            targets = [Target(workload, str(n)) for n in sizes]
            ready = [t.wait_ready(120) for t in targets]
            for r in range(rounds):
                for n, t, words in zip(sizes, targets, ready):
                    for name, code in trees.items():
                        run_dir = os.path.join(tmp, f"run-{n}-{r}-{name}")
                        _write_config(run_dir, t.pid, n, tmp, [int(w) for w in words[1:]])
                        out = subprocess.run(
                            [sys.executable, os.path.abspath(__file__), "--poll-helper", run_dir, str(polls)]
                            + ([code] if code else []),
                            capture_output=True,
                            text=True,
                            timeout=300,
                            check=True,
                            cwd=tmp,  # from outside the checkout: the dlwatch under test
                        )
                        got[name][n].append(median(json.loads(out.stdout)["poll_over_raw"]) or 0.0)
        finally:
            for t in targets:
                t.kill()
    return {name: {n: sorted(v) for n, v in rows.items()} for name, rows in got.items()}


def _fit(xs: list[int], ys: list[float]) -> tuple[float, float, float]:
    """(slope, intercept, R²) of the least-squares line."""
    slope = _slope(xs, ys)
    my = sum(ys) / len(ys)
    intercept = my - slope * sum(xs) / len(xs)
    ss_res = sum((y - (intercept + slope * x)) ** 2 for x, y in zip(xs, ys))
    ss_tot = sum((y - my) ** 2 for y in ys)
    return slope, intercept, 1 - ss_res / ss_tot if ss_tot else 1.0


def _slope(xs: list[int], ys: list[float]) -> float:
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0


def share(workers: int, window_s: float, code: str | None = None) -> dict[str, Any]:
    """The monitor's CPU share and memory under a healthy training loop at the default interval
    (``code``: the watch, and so its monitor, from another checkout)."""
    settle_s = 1.5
    env = dict(os.environ, PYTHONPATH=os.path.abspath(code)) if code else None
    with tempfile.TemporaryDirectory(prefix="dlwatch-bench-") as tmp:
        with target("train", str(workers), str(settle_s + window_s + 2.0), tmp, ready_timeout=120, env=env) as (
            t,
            words,
        ):
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
        "share32": share(SHARE_WORKERS, 10.0 if quick else SHARE_WINDOW_S),
    }


def share_line(s: dict[str, Any]) -> str:
    return (
        f"monitor CPU, 1+{s['workers']} workers (a healthy watched loop, default 1 s interval, {s['window_s']:.0f} s): "
        f"{s['monitor_share_of_core'] * 100:.2f}% of a core (target <= 0.5%: "
        f"{'met' if s['monitor_share_of_core'] <= 0.005 else 'NOT met'}); training process "
        f"{s['main_share_of_core'] * 100:.1f}%; monitor RSS {s['monitor_rss_mib']:.1f} MiB"
    )


def _poll_only(argv: list[str]) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="bench/monitor_cost.py --poll-only")
    ap.add_argument("--sizes", default="1,8,32", help="worker counts, comma-separated")
    ap.add_argument("--polls", type=int, default=STEADY_POLLS)
    ap.add_argument("--code", help="poll with this checkout's dlwatch (a tree exported from another commit)")
    ap.add_argument("--before", help="an older tree: poll/raw of both, alternating on the same targets (--rounds)")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--share", type=int, default=SHARE_WORKERS, help="workers of the CPU-share run (0: none)")
    ap.add_argument("--share-window", type=float, default=SHARE_WINDOW_S)
    ap.add_argument(
        "--workload",
        choices=("idle", "busy"),
        default="idle",
        help="the workers polled: idle after a batch (the target's case), or busy (changed at every poll)",
    )
    args = ap.parse_args(argv)
    sizes = tuple(int(x) for x in args.sizes.split(","))
    if args.before:
        c = compare(sizes, args.polls, {"before": args.before, "after": args.code}, args.rounds, args.workload)
        for n in sizes:
            b, a = c["before"][n], c["after"][n]
            print(
                f"1+{n} {args.workload} poll/raw, {args.rounds} rounds alternating on the same processes: before {median(b):.2f} "
                f"({' '.join(f'{x:.2f}' for x in b)}), after {median(a):.2f} ({' '.join(f'{x:.2f}' for x in a)})",
                file=sys.stderr,
            )
        if args.share:
            for name, code in (("before", args.before), ("after", args.code)):
                print(f"{name}: " + share_line(share(args.share, args.share_window, code)), file=sys.stderr)
        print(json.dumps(c, indent=1))
        return
    p = poll_cost(sizes, args.polls, args.code, args.workload)
    for row in p["rows"]:
        print(
            f"1+{row['workers']} {args.workload} ({row['procs']} of {row['expected_procs']} tracked): poll {row['poll_us_median']:.0f} us = {row['poll_us_per_proc']:.1f} us/proc "
            f"(IQR {row['poll_us_spread'][0]:.0f}-{row['poll_us_spread'][1]:.0f} us); raw /proc "
            f"{row['raw_proc_us_per_proc']:.1f} us/proc + system {row['raw_system_us']:.0f} us; "
            f"poll/raw {row['poll_over_raw_median']:.2f}; back to back {row['warm_poll_us_median']:.0f} us "
            f"(raw {row['warm_raw_us_median']:.0f} us)",
            file=sys.stderr,
        )
    print(
        f"fit: {p['fit_us_per_proc']:.1f} us/proc (raw {p['raw_fit_us_per_proc']:.1f}), fixed "
        f"{p['fixed_us_smallest']:.0f} us at 1+{p['rows'][0]['workers']} (raw system {p['raw_system_us_smallest']:.0f}),"
        f" R² {p['fit_r2']:.4f}; back to back {p['warm_fit_us_per_proc']:.1f} us/proc, fixed "
        f"{p['warm_fixed_us_smallest']:.0f} us",
        file=sys.stderr,
    )
    for row in p["rows"]:
        if row["workers"] == 8:
            ratio = row["poll_over_raw_median"]
            target = (
                f"target <= 2.0: {'met' if ratio <= 2.0 else 'NOT met'}" if args.workload == "idle" else "no target"
            )
            print(f"poll/raw at 1+8, {args.workload} workers: {ratio:.2f} ({target})", file=sys.stderr)
    if args.share:
        p["share"] = share(args.share, args.share_window, args.code)
        print(share_line(p["share"]), file=sys.stderr)
    print(json.dumps(p, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--poll-helper"]:
        _poll_helper(sys.argv[2], int(sys.argv[3]), sys.argv[4] if len(sys.argv) > 4 else None)
    elif sys.argv[1:2] == ["--poll-only"]:
        _poll_only(sys.argv[2:])
    else:
        print(json.dumps(run("--quick" in sys.argv), indent=1))
