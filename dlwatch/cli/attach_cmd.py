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
import re
import sys
import time
from typing import Any

from dlwatch.wire import events as events_mod
from dlwatch.monitor import forensics
from dlwatch.wire import heartbeat
from dlwatch.collect import bounds, procfs, rundir, source
from dlwatch.collect.gpu import GpuProbe
from dlwatch.detect import registry
from dlwatch.collect.system import read_system
from dlwatch.wire.config import DEFAULT_REPORT_DIR
from dlwatch.errors import PTRACE_HELP, NotFoundError, PermissionDeniedError, TargetError, UsageError
from dlwatch.model import TrackedProcess
from dlwatch.redact import outbound
from dlwatch.report import build, store

WORKER_COMM = "pt_data_worker"
PF_KTHREAD = 0x00200000


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pid", help="the training process (the DataLoader's main process)")
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="report directory root; the incident goes to DIR/<id>/ (default: $DLWATCH_DIR or ./dlwatch-reports)",
    )
    parser.add_argument("--json", action="store_true", help="print the report JSON instead of a summary")
    parser.add_argument(
        "--duration",
        type=float,
        default=forensics.SECOND_READ_AFTER_S,
        metavar="SECONDS",
        help="observation window: /proc is read across it for CPU progress and signs of life (default %(default)s)",
    )
    parser.add_argument(
        "--no-native", action="store_true", help="Python frames only (faster: ~10 ms a process instead of ~110 ms)"
    )


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
    fields = text[text.rfind(")") + 2 :].split()
    if int(fields[6]) & PF_KTHREAD:
        raise TargetError(f"pid {pid} is a kernel thread ({stat['name']}), not a Python process")
    if stat["state"] == "Z":
        raise TargetError(
            f"pid {pid} is a zombie: it has exited and holds no stacks",
            help="its parent has not reaped it yet; look at the parent or at the exit incident",
        )
    try:
        os.listdir(f"/proc/{pid}/fd")
        with open(f"/proc/{pid}/syscall"):
            pass
    except PermissionError:
        raise PermissionDeniedError(
            f"permission denied: not allowed to inspect pid {pid} (another user's process?)", help=PTRACE_HELP
        ) from None
    except FileNotFoundError:
        raise NotFoundError(f"no process with pid {pid}") from None
    if not _is_python(pid):
        raise TargetError(
            f"pid {pid} ({stat['name']}) is not a Python process", help="pass the pid of the Python training process"
        )


def find_run_dir(pid: int) -> str | None:
    """A watched process maps its run's heartbeat file: that names the run directory.

    The path comes from the target: it is only a hint, read through rundir.RunDirReader.
    """
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(None, 5)[-1] if line.count(" ") >= 5 else ""
                if path.endswith("/heartbeat") and f"/{store.RUNS_DIR}/" in path and "\x00" not in path:
                    return os.path.dirname(path)
    except (OSError, UnicodeDecodeError):
        pass
    return None


# What attach reads from a run directory, and at most how much of each.
_CAPS = {
    "config.json": 1 << 20,
    "events.jsonl": 16 << 20,
    "heartbeat": heartbeat.SIZE,
    "timeline.jsonl": 8 << 20,
    "timeline.1.jsonl": 8 << 20,
}
_DUMP_CAP = bounds.MAX_DUMP_READ_BYTES  # a faulthandler dump file, per read (see collect/bounds.py)
_DUMP_NAME = re.compile(r"^[0-9]{1,10}\.txt$")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            text = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


class _Relation:
    """Whether a pid that the run names may be inspected: checked again at each use.

    The run's files are the target user's to write: a pid they name is used only if it
    is the target, one of its descendants, or shares the target's session and uid.
    """

    def __init__(self, target: int) -> None:
        self.target = target
        fields = _stat_fields(target)
        self.session = fields[3] if fields and len(fields) > 3 else None
        creds = rundir.target_creds(target)
        self.uid = creds.uid if creds else None

    def __call__(self, pid: int) -> bool:
        if pid == self.target:
            return True
        if pid <= 1:
            return False
        if pid in procfs.descendants(self.target):
            return True
        fields = _stat_fields(pid)
        creds = rundir.target_creds(pid)
        return (
            self.session is not None
            and self.uid is not None
            and fields is not None
            and len(fields) > 3
            and fields[3] == self.session
            and creds is not None
            and creds.uid == self.uid
        )


def _dump_name(run_dir: str, path: Any) -> str | None:
    """A dump path from the run as a name inside it (``dumps/<pid>.txt``), or None if it points elsewhere."""
    if not isinstance(path, str) or "\x00" in path:
        return None
    head, base = os.path.split(path)
    if not _DUMP_NAME.match(base) or os.path.normpath(head) != os.path.join(os.path.normpath(run_dir), "dumps"):
        return None
    return f"dumps/{base}"


def _jsonl(data: bytes, limit: int) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for line in data.splitlines():
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and events_mod.depth_ok(record):
            out.append(record)
    return out[-limit:]


def gather(pid: int) -> tuple[dict[int, TrackedProcess], dict[str, Any]]:
    procs: dict[int, TrackedProcess] = {pid: TrackedProcess(pid, "main")}
    run: dict[str, Any] = {}
    notes: list[str] = []
    allowed = _Relation(pid)
    run["allowed"] = allowed
    run["notes"] = notes
    run_dir = find_run_dir(pid)
    run["found_run_dir"] = run_dir
    creds = rundir.target_creds(pid)
    run["sources"] = _source_reader(pid)
    if run_dir and creds is None:
        notes.append(f"the run directory {run_dir} was not read: the target's uid could not be read")
    elif run_dir:
        reader = rundir.RunDirReader(run_dir, creds, caps=_CAPS, default_cap=_DUMP_CAP)
        try:
            files = reader.read(list(_CAPS))
        except rundir.RefusedError as exc:
            files = {}
            notes.append(str(exc))
        if files:
            run["run_dir"] = run_dir
            run["reader"] = reader
        try:
            cfg = json.loads(files["config.json"]) if "config.json" in files else None
        except (ValueError, RecursionError):
            cfg = None
        if isinstance(cfg, dict):
            run["config"] = cfg
            name = _dump_name(run_dir, cfg.get("main_dump_path"))
            if name is None and cfg.get("main_dump_path") is not None:
                notes.append("the run's main_dump_path points outside its run directory: not used")
            procs[pid].dump_path = name
        hb = heartbeat.parse(files.get("heartbeat") or b"")
        for _ in range(3):  # caught mid-write (the two seq fields differ): read it again
            if hb is not None or "heartbeat" not in files:
                break
            hb = heartbeat.parse(reader.read_one("heartbeat") or b"")
        run["heartbeat"] = hb
        run["events"] = []
        refused_pids: list[int] = []
        for ev in events_mod.parse_lines(files.get("events.jsonl", b"").splitlines(), registry.event_schemas()):
            if ev.get("event") == "worker_registered":
                wpid = ev["pid"]
                if not allowed(wpid):
                    refused_pids.append(wpid)
                elif os.path.exists(f"/proc/{wpid}"):
                    name = _dump_name(run_dir, ev.get("dump_path"))
                    if name is None and ev.get("dump_path") is not None:
                        notes.append(f"worker {wpid}'s dump_path points outside the run directory: not used")
                    procs[wpid] = TrackedProcess(
                        wpid,
                        "worker",
                        worker_id=ev.get("worker_id"),
                        dump_path=name,
                        start_method=ev.get("start_method"),
                    )
            if ev.get("event") not in ("stop",):
                run["events"].append(ev)
        if refused_pids:
            shown = ", ".join(str(p) for p in sorted(set(refused_pids))[:8])
            notes.append(f"pids named by the run that are not the target's processes were not inspected: {shown}")
        timeline = files.get("timeline.1.jsonl", b"") + b"\n" + files.get("timeline.jsonl", b"")
        run["timeline"] = _jsonl(timeline, build.TIMELINE_WINDOW)
        dirs = ((cfg or {}).get("options") or {}).get("playbooks") if isinstance(cfg, dict) else None
        if dirs:
            notes.append(
                "playbook directories named by the run were not loaded (attach uses the shipped "
                "playbooks and your own $DLWATCH_PLAYBOOKS)"
            )
        notes.extend(f"run directory file refused: {r}" for r in reader.refusals)
    for child in procfs.descendants(pid):
        if child in procs:
            continue
        name = procfs.comm(child)
        procs[child] = TrackedProcess(child, "worker" if name == WORKER_COMM else "other")
    return procs, run


def _source_reader(pid: int) -> source.SourceReader:
    """The reader of the target's source files (the lock-owner judgement): the target's rights, taken
    now (before the stacks are read, while the pid is the target's), one budget for the whole attach."""
    creds = source.creds_of(pid)
    if creds is None:
        return source.SourceReader(
            disabled="not read: the target's uids differ (a setuid program) or could not be read"
        )
    return source.SourceReader(creds)


def _target_uid(watched: dict[str, Any]) -> int:
    """The uid whose processes may be signalled: the target's; -1 (none) when it could not be read."""
    allowed = watched.get("allowed")
    uid = allowed.uid if isinstance(allowed, _Relation) else None
    return -1 if uid is None else uid


def _no_dump(_name: str) -> bytes | None:
    return None  # no run directory was read: no dump file either


def run(args: argparse.Namespace) -> int:
    try:
        pid = int(args.pid)
    except ValueError:
        raise UsageError(f"PID must be a number, got {args.pid!r}") from None
    if not (0.05 <= args.duration <= 60):
        raise UsageError("--duration must be between 0.05 and 60 seconds")
    check_target(pid)
    out_dir = args.out or os.environ.get("DLWATCH_DIR") or DEFAULT_REPORT_DIR
    report, path = write_attach_incident(pid, out_dir, duration=args.duration, native=not args.no_native)
    shown = outbound(report)  # what is printed is redacted like what is written (one redaction point)
    if args.json:
        json.dump(shown, sys.stdout, indent=2)
        print()
    else:
        print_summary(shown, outbound(path), sys.stdout)
    return 0


def write_attach_incident(
    pid: int, out_dir: str, *, duration: float = forensics.SECOND_READ_AFTER_S, native: bool = True
) -> tuple[dict[str, Any], str]:
    """Inspect ``pid`` (checked by check_target) and write its attach incident; return (report, path).

    Shared by ``dlwatch attach`` and the ``s`` key of ``dlwatch top``.
    """
    procs, watched = gather(pid)
    now = time.time()
    cfg = watched.get("config") or {}
    loader = cfg.get("loader") if isinstance(cfg.get("loader"), dict) else None
    notes = list(watched.get("notes") or ())
    hb = watched.get("heartbeat")
    progress = None
    if hb is not None:
        progress = hb.progress(time.monotonic())  # the wait (or loop body) going on counted
        if hb.ts_last_batch:
            progress["stall_s"] = round(time.monotonic() - hb.ts_last_batch, 3)
    entries = []
    for p in procs.values():
        sample = procfs.read_proc(p.pid, fd_detail=True, mem_detail=True)
        entries.append(
            build.process(
                p.pid,
                p.role,
                worker_id=p.worker_id,
                start_method=p.start_method,
                name=sample.name,
                cmdline=procfs.cmdline(p.pid),
                sample=build.compact(sample.to_dict()),
            )
        )
    system = None
    try:
        system = read_system(pid).to_dict()
    except Exception as exc:
        notes.append(f"system probe failed: {exc}")
    gpu = GpuProbe()
    gpus = [g.to_dict() for g in gpu.sample()]
    gpu.close()
    if not watched.get("found_run_dir"):
        notes.append("the target does not run under dlwatch.watch: no heartbeat or timeline")
    report = build.incident(
        "attach",
        pid,
        now=now,
        loader=loader,
        config={"duration_s": duration, "report_dir": out_dir, "watched": "run_dir" in watched},
        progress=progress,
        processes=entries,
        system=system,
        gpus=gpus,
        events=watched.get("events") or [],
        timeline=watched.get("timeline") or [],
        notes=notes,
    )
    waiting = None
    if hb is not None and hb.state in (heartbeat.STATE_WAITING, heartbeat.STATE_BODY):
        waiting = hb.state == heartbeat.STATE_WAITING
    reader = watched.get("reader")
    workers = sum(1 for p in procs.values() if p.role == "worker")
    expected = (loader or {}).get("num_workers") if loader else None
    report, extra = forensics.investigate(
        report,
        procs,
        main_waiting_for_data=waiting,
        expected_workers=expected if isinstance(expected, int) and expected > 0 else (workers or None),
        native=native,
        interval_s=duration,
        read_dump=reader.read_one if reader is not None else _no_dump,
        allow=watched.get("allowed"),
        uid=_target_uid(watched),
    )
    if reader is not None:  # dump files refused while the stacks were taken
        have = report.notes or ()
        report = report.with_notes(
            *(n for n in dict.fromkeys(f"run directory file refused: {r}" for r in reader.refusals) if n not in have)
        )
    # never the run's own playbook directories: code-free, but the target's user wrote them
    report = build.add_findings(report, (), sources=watched.get("sources") or _source_reader(pid))
    written, path = build.write_report(report, out_dir, extra_files=extra)
    return written, path


def print_summary(report: dict[str, Any], path: str, file: Any) -> None:
    from dlwatch.report.render import terminal_line  # names and frames come from the target

    def out(line: str) -> None:
        print(terminal_line(line), file=file)  # one line each: a newline in a name cannot forge another

    out(f"pid {report['pid']}: {report.get('classification')} - {report.get('classification_reason') or ''}")
    for p in report["processes"]:
        who = p["role"] + (f" {p['worker_id']}" if p.get("worker_id") is not None else "")
        where = f" at {p['where']}" if p.get("where") else ""
        wait = f" in {p['waiting_in']}" if p.get("waiting_in") else ""
        out(f"  pid {p['pid']} ({who}): {p.get('status') or '?'}{wait}{where}")
    for f in report.get("findings") or ():
        out(f"  finding: {f['playbook']} ({f['confidence']:.2f}) {f['title']}")
    for n in report.get("notes") or ():
        out(f"  note: {n}")
    out(f"report: {os.path.join(path, 'report.md')}")
