"""How fast dlwatch sees a real hang and captures its evidence.

- Detection: a watched DataLoader whose second epoch hangs on a lock held across
  fork; from the moment that epoch's loop starts to the incident directory on disk.
- Stack dumps of a hung 1+N job: ``dump_stacks`` (parallel) against what a user
  would run, ``py-spy dump --pid P`` once per process, one after the other.
- ``dlwatch attach PID`` end to end on the same hung job.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from bench._common import median, target
from dlwatch.collect.stacks import dump_stacks, find_py_spy


def _new_incident(report_dir: str, timeout: float) -> str | None:
    """Wait for a complete incident directory (written under .tmp-*, then renamed)."""
    deadline = time.monotonic() + timeout
    while True:
        for name in os.listdir(report_dir):
            if not name.startswith(".") and os.path.exists(os.path.join(report_dir, name, "report.json")):
                return os.path.join(report_dir, name)
        if time.monotonic() >= deadline:
            return None
        time.sleep(0.01)


def detection(workers: int, stall_timeout: float, poll_interval: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="dlwatch-bench-") as tmp:
        with target("watched-hang", str(workers), tmp, str(stall_timeout), str(poll_interval)) as (_, words):
            hang_started = float(words[0])
            incident = _new_incident(tmp, stall_timeout + 30)
            seen = time.time()
            if incident is None:
                return {"stall_timeout_s": stall_timeout, "latency_s": None, "error": "no incident within 30 s"}
            with open(os.path.join(incident, "report.json")) as f:
                report = json.load(f)
    procs = report.get("processes") or []
    return {
        "stall_timeout_s": stall_timeout,
        "poll_interval_s": poll_interval,
        "latency_s": seen - hang_started,
        "over_timeout_s": seen - hang_started - stall_timeout,
        # stall_s: how long the stall had lasted when the poll saw it (timeout + the poll's phase);
        # the rest of the latency is worker start-up, /proc reads, stack dumps and writing
        "stall_s_at_detection": (report.get("progress") or {}).get("stall_s"),
        "trigger": report.get("trigger"),
        "processes": len(procs),
        "processes_with_stack": sum(1 for p in procs if p.get("stack")),
        "findings": [f.get("playbook") for f in report.get("findings") or []],
        "notes": report.get("notes") or [],
    }


def _sequential_py_spy(exe: str, pids: list[int], native: bool) -> float:
    t0 = time.perf_counter()
    for pid in pids:
        subprocess.run(
            [exe, "dump", *(["--native"] if native else []), "--pid", str(pid)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=30,
        )
    return time.perf_counter() - t0


def attach_available() -> bool:
    out = subprocess.run(
        [sys.executable, "-m", "dlwatch", "attach", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tempfile.gettempdir(),  # not the checkout: `-m` would import its dlwatch before the installed one
    )
    return out.returncode == 0


def dumps_and_attach(workers: int, reps: int) -> dict[str, Any]:
    exe = find_py_spy()
    if exe is None:
        return {"error": "py-spy not found"}
    res: dict[str, Any] = {"workers": workers, "reps": reps}
    with target("hang", str(workers)) as (t, words):
        pids = [int(w) for w in words]
        time.sleep(0.5)  # let every worker reach the lock
        timings: dict[str, list[float]] = {
            k: [] for k in ("parallel", "sequential", "parallel_native", "sequential_native")
        }
        per_dump: dict[str, list[float]] = {"plain": [], "native": []}
        ok = {"plain": 0, "native": 0}
        for _ in range(reps):
            for native in (False, True):
                key = "_native" if native else ""
                t0 = time.perf_counter()
                dumps = dump_stacks(pids, native=native)
                timings["parallel" + key].append(time.perf_counter() - t0)
                timings["sequential" + key].append(_sequential_py_spy(exe, pids, native))
                kind = "native" if native else "plain"
                per_dump[kind] += [d.duration_s for d in dumps.values() if d.duration_s is not None]
                ok[kind] = sum(1 for d in dumps.values() if d.threads)
        for k, v in timings.items():
            res[f"{k}_s"] = median(v)
        res["one_dump_s"] = median(per_dump["plain"])
        res["one_dump_native_s"] = median(per_dump["native"])
        res["processes_dumped"] = ok["plain"]
        res["processes_dumped_native"] = ok["native"]
        res["processes"] = len(pids)

        res["attach_available"] = attach_available()
        if res["attach_available"]:
            with tempfile.TemporaryDirectory(prefix="dlwatch-bench-") as tmp:
                env = dict(os.environ, DLWATCH_DIR=tmp)
                t0 = time.perf_counter()
                out = subprocess.run(
                    [sys.executable, "-m", "dlwatch", "attach", str(t.pid), "--out", tmp],
                    cwd=tmp,
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=60,
                )
                res["attach_s"] = time.perf_counter() - t0
                res["attach_rc"] = out.returncode
                res["attach_stderr_tail"] = out.stderr[-500:]
                incident = _new_incident(tmp, 0)
                if incident is not None:
                    with open(os.path.join(incident, "report.json")) as f:
                        procs = json.load(f).get("processes") or []
                    res["attach_processes_with_stack"] = sum(1 for p in procs if p.get("stack"))
    return res


def run(quick: bool) -> dict[str, Any]:
    cases = [(2.0, 1.0)] if quick else [(2.0, 1.0)] * 3 + [(4.0, 1.0)] * 2
    from dlwatch.monitor.forensics import SECOND_READ_AFTER_S

    return {
        "observation_window_s": SECOND_READ_AFTER_S,  # part of every detection, by design
        "detection": [detection(8, stall, poll) for stall, poll in cases],
        "dumps": dumps_and_attach(8, 2 if quick else 5),
    }


if __name__ == "__main__":
    print(json.dumps(run("--quick" in sys.argv), indent=1))
