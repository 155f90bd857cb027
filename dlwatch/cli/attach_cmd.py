"""Inspect a running (typically stuck) Python training process and write an incident report.

  dlwatch attach PID [--out DIR] [--json] [--duration SECONDS]

Finds the process's DataLoader workers (processes running torch's worker loop,
named pt_data_worker, including those started by spawn or forkserver), reads
/proc twice, dumps every stack with py-spy, classifies the hang (deadlock,
lost-batch, slow, main-blocked, dead-worker), matches the playbooks and writes
an incident with trigger `attach`.  If the target runs under dlwatch.watch,
that run's heartbeat, timeline and worker registrations are used too.
Attach never kills or stops the target (py-spy pauses each process for
milliseconds).  Exit 0 when the report was written, whatever it found.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Any

from dlwatch import forensics, heartbeat
from dlwatch.collect import procfs
from dlwatch.collect.gpu import GpuProbe
from dlwatch.collect.system import read_system
from dlwatch.config import DEFAULT_REPORT_DIR
from dlwatch.errors import PTRACE_HELP, NotFoundError, PermissionDeniedError, TargetError, UsageError
from dlwatch.events import EventReader
from dlwatch.report import build, store

WORKER_COMM = "pt_data_worker"
PF_KTHREAD = 0x00200000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pid", help="the training process (the DataLoader's main process)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="report directory root; the incident goes to DIR/<id>/ (default: $DLWATCH_DIR or ./dlwatch-reports)")
    parser.add_argument("--json", action="store_true", help="print the report JSON instead of a summary")
    parser.add_argument("--duration", type=float, default=forensics.SECOND_READ_AFTER_S, metavar="SECONDS",
                        help="observation window: /proc is read across it for CPU progress and signs of life (default %(default)s)")
    parser.add_argument("--no-native", action="store_true", help="Python frames only (faster: ~10 ms a process instead of ~110 ms)")


@dataclass
class _Proc:
    pid: int
    role: str
    worker_id: int | None = None
    dump_path: str | None = None
    start_method: str | None = None
    gone: bool = False


def _is_python(pid: int) -> bool:
    try:
        exe = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        exe = ""
    if exe.startswith(("python", "pypy")):
        return True
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            return b"libpython" in f.read()
    except OSError:
        return False


def check_target(pid: int) -> None:
    """One clear error for each kind of pid that cannot be a training process."""
    if pid <= 0:
        raise UsageError(f"invalid pid {pid}")
    if not os.path.exists(f"/proc/{pid}"):
        raise NotFoundError(f"no process with pid {pid}", help="check the pid with `ps` or `pgrep -f train`")
    if pid == 1:
        raise TargetError("pid 1 is the init process, not a training process", help="pass the training script's pid")
    try:
        with open(f"/proc/{pid}/stat") as f:
            text = f.read()
    except FileNotFoundError:
        raise NotFoundError(f"no process with pid {pid}") from None
    except PermissionError:
        raise PermissionDeniedError(f"cannot read /proc/{pid}: permission denied", help=PTRACE_HELP) from None
    stat = procfs.parse_stat(text)
    fields = text[text.rfind(")") + 2:].split()
    if int(fields[6]) & PF_KTHREAD:
        raise TargetError(f"pid {pid} is a kernel thread ({stat['name']}), not a Python process")
    if stat["state"] == "Z":
        raise TargetError(f"pid {pid} is a zombie: it has exited and holds no stacks",
                          help="its parent has not reaped it yet; look at the parent or at the exit incident")
    try:
        os.listdir(f"/proc/{pid}/fd")
        with open(f"/proc/{pid}/syscall"):
            pass
    except PermissionError:
        raise PermissionDeniedError(f"permission denied: not allowed to inspect pid {pid} (another user's process?)",
                                    help=PTRACE_HELP) from None
    except FileNotFoundError:
        raise NotFoundError(f"no process with pid {pid}") from None
    if not _is_python(pid):
        raise TargetError(f"pid {pid} ({stat['name']}) is not a Python process",
                          help="pass the pid of the Python training process")


def find_run_dir(pid: int) -> str | None:
    """A watched process maps its run's heartbeat file: that names the run directory."""
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if path.endswith("/heartbeat") and f"/{store.RUNS_DIR}/" in path:
                    return os.path.dirname(path)
    except OSError:
        pass
    return None


def gather(pid: int) -> tuple[dict[int, _Proc], dict[str, Any]]:
    procs: dict[int, _Proc] = {pid: _Proc(pid, "main")}
    run: dict[str, Any] = {}
    run_dir = find_run_dir(pid)
    if run_dir:
        run["run_dir"] = run_dir
        try:
            with open(os.path.join(run_dir, "config.json"), "rb") as f:
                run["config"] = json.loads(f.read())
            procs[pid].dump_path = run["config"].get("main_dump_path")
        except (OSError, ValueError):
            pass
        run["heartbeat"] = heartbeat.read(os.path.join(run_dir, "heartbeat"))
        run["events"] = []
        for ev in EventReader(os.path.join(run_dir, "events.jsonl")).new():
            if ev.get("event") == "worker_registered" and isinstance(ev.get("pid"), int):
                wpid = ev["pid"]
                if os.path.exists(f"/proc/{wpid}"):
                    procs[wpid] = _Proc(wpid, "worker", ev.get("worker_id"), ev.get("dump_path"), ev.get("start_method"))
            if ev.get("event") not in ("stop",):
                run["events"].append(ev)
        run["timeline"] = build.read_timeline(run_dir)
    for child in procfs.descendants(pid):
        if child in procs:
            continue
        name = procfs.comm(child)
        procs[child] = _Proc(child, "worker" if name == WORKER_COMM else "other")
    return procs, run


def run(args: argparse.Namespace) -> int:
    try:
        pid = int(args.pid)
    except ValueError:
        raise UsageError(f"PID must be a number, got {args.pid!r}") from None
    if not (0.05 <= args.duration <= 60):
        raise UsageError("--duration must be between 0.05 and 60 seconds")
    check_target(pid)
    out_dir = args.out or os.environ.get("DLWATCH_DIR") or DEFAULT_REPORT_DIR
    procs, watched = gather(pid)
    now = time.time()
    report = store.skeleton(trigger="attach", pid=pid, now=now)
    cfg = watched.get("config") or {}
    report["loader"] = cfg.get("loader")
    report["config"] = {"duration_s": args.duration, "report_dir": out_dir, "watched": bool(watched)}
    hb = watched.get("heartbeat")
    if hb is not None:
        report["progress"] = hb.to_dict()
        if hb.ts_last_batch:
            report["progress"]["stall_s"] = round(time.monotonic() - hb.ts_last_batch, 3)
    report["events"] = watched.get("events") or []
    report["timeline"] = watched.get("timeline") or []
    for p in procs.values():
        sample = procfs.read_proc(p.pid, fd_detail=True, mem_detail=True)
        report["processes"].append(build.process_entry(
            p.pid, p.role, worker_id=p.worker_id, start_method=p.start_method, name=sample.name,
            cmdline=procfs.cmdline(p.pid), sample=build.compact(sample.to_dict())))
    try:
        report["system"] = read_system(pid).to_dict()
    except Exception as exc:
        report["notes"].append(f"system probe failed: {exc}")
    gpu = GpuProbe()
    report["gpus"] = [g.to_dict() for g in gpu.sample()]
    gpu.close()
    if not watched:
        report["notes"].append("the target does not run under dlwatch.watch: no heartbeat or timeline")
    waiting = None
    if hb is not None and hb.state in (heartbeat.STATE_WAITING, heartbeat.STATE_BODY):
        waiting = hb.state == heartbeat.STATE_WAITING
    workers = sum(1 for p in procs.values() if p.role == "worker")
    expected = (report["loader"] or {}).get("num_workers") if report["loader"] else None
    extra = forensics.investigate(report, procs, main_waiting_for_data=waiting,
                                  expected_workers=expected if isinstance(expected, int) and expected > 0 else (workers or None),
                                  native=not args.no_native, interval_s=args.duration)
    build.add_findings(report, tuple((cfg.get("options") or {}).get("playbooks") or ()))
    path = build.write(report, out_dir, extra_files=extra)
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
    else:
        print_summary(report, path, sys.stdout)
    return 0


def print_summary(report: dict[str, Any], path: str, file: Any) -> None:
    print(f"pid {report['pid']}: {report.get('classification')} - {report.get('classification_reason') or ''}", file=file)
    for p in report["processes"]:
        who = p["role"] + (f" {p['worker_id']}" if p.get("worker_id") is not None else "")
        where = f" at {p['where']}" if p.get("where") else ""
        wait = f" in {p['waiting_in']}" if p.get("waiting_in") else ""
        print(f"  pid {p['pid']} ({who}): {p.get('status') or '?'}{wait}{where}", file=file)
    for f in report.get("findings") or ():
        print(f"  finding: {f['playbook']} ({f['confidence']:.2f}) {f['title']}", file=file)
    for n in report.get("notes") or ():
        print(f"  note: {n}", file=file)
    print(f"report: {os.path.join(path, 'report.md')}", file=file)


