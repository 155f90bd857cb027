"""The monitor process: ``python -m dlwatch.monitor.loop RUN_DIR``.  Imports no torch.

Started by ``watch`` as a child of the training process.  Every poll it reads the
heartbeat and new events, samples the training process, its workers and the
system, appends to the timeline, and runs the detectors.  It writes incidents
for exceptions, stalls, crossed thresholds, and for a training process that
vanished without leaving the watch block; it exits when the block ends, or by
itself when the training process is gone (it is reparented then), so it is
never left behind.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import resource
import select
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from dlwatch.wire import heartbeat as hbmod
from dlwatch._fs import create_private, json_line, open_private
from dlwatch._log import configure_own_process, get_logger
from dlwatch.wire.config import DEFAULT_KEEP_RUNS
from dlwatch.collect import faultdump, procfs
from dlwatch.collect.gpu import GpuProbe, gpu_notes
from dlwatch.collect.system import SystemProbe, read_system
from dlwatch.detect import registry
from dlwatch.detect.base import NOTE_EVENTS, Detector, View
from dlwatch.collect.syscalls import category as syscall_category
from dlwatch.collect.runstats import RunStats
from dlwatch.detect.stall import Activity, StallDetector, StallEvent, stall_site
from dlwatch.wire import interrupt
from dlwatch.wire.events import EventReader
from dlwatch.model import ProcSample, StackDump, SystemSample, TrackedProcess
from dlwatch.redact import outbound
from dlwatch.report import build, store
from dlwatch.report.schema import Finding, Incident, ProcessEntry, RunSummary
from dlwatch.monitor import timeline as timeline_record

log = get_logger("dlwatch.monitor")

HISTORY = 120  # samples kept per process (2 min at the default interval): memory is bounded by workers x this
RING = build.TIMELINE_WINDOW
TIMELINE_CAP_BYTES = 8 << 20  # then rotate to timeline.1.jsonl: at most twice this on disk
FD_DETAIL_EVERY = 30  # polls between fd breakdowns when the count does not move (a readlink per fd)
DISCOVER_EVERY = 5  # polls between scans for new child processes (workers also announce themselves)
MEM_DETAIL_EVERY_S = 10.0  # smaps_rollup costs ~2.4 ms a process
# A process faulting in pages (copy-on-write copies, mlock, a growing heap) gets its USS read this
# often instead, so that growth is seen in seconds; at most MEM_FAST_MAX processes a poll.
MEM_FAST_EVERY_S = 2.0
MEM_FAST_FAULT_BYTES = 16 << 20  # minor faults x page size since the last read that make a process "faulting"
MEM_FAST_MAX = 8
MAX_OTHER = 16  # descendants that are not workers (shm manager, forkserver) we keep an eye on
MAX_GONE = 64  # exited workers remembered for reports; older ones are forgotten (1,000 epochs stay bounded)
# Descriptors the monitor keeps for its own work (py-spy pipes, report files, the timeline): the
# rest of its soft RLIMIT_NOFILE, up to KEPT_FDS_MAX, may hold processes' /proc files open
FDS_SPARE = 256
KEPT_FDS_MAX = 1024
MAX_ITERATION_ROWS = 5000  # `dlwatch run`: rows of the summary's iterations table; later ones are counted only
MAX_LOADERS = 256  # `dlwatch run`: loaders named in the summary (a program that makes one per step: the first)


@dataclass
class Tracked(TrackedProcess):
    """A tracked process with what the monitor keeps about it between polls."""

    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=HISTORY))
    fds_at_detail: int | None = None  # num_fds when the fd breakdown was last read
    last_fds: Any = None  # that breakdown (FdSummary): reports show it with the latest sample
    detail_poll: int = -(10**9)
    crash: dict[str, Any] | None = None  # the stack a crashed process left in its crash file (faultdump)
    minflt_at_detail: int | None = None  # minor faults when USS was last read (see Monitor._faulting)
    files: procfs.ProcFiles | None = None  # its /proc files kept open while it is polled

    @property
    def last(self) -> ProcSample | None:
        for s in reversed(self.history):
            if not s.gone:
                return s
        return None


class Timeline:
    """timeline.jsonl with a size cap: rotate once, so disk use is bounded for any run length."""

    def __init__(self, path: str, cap: int = TIMELINE_CAP_BYTES) -> None:
        self.path = path
        self.cap = cap
        self.size = 0
        self.failed: str | None = None
        self._fd: int | None = None

    def append(self, record: dict[str, Any]) -> None:
        if not self.failed:
            self.append_line(json_line(record))

    def append_line(self, line: bytes) -> None:
        """A line already encoded and redacted (``timeline_record.encode``)."""
        if self.failed:
            return
        try:
            if self._fd is None:
                self._fd = open_private(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            if self.size + len(line) > self.cap:
                os.close(self._fd)
                os.replace(self.path, self.path.replace(".jsonl", ".1.jsonl"))
                self._fd = create_private(self.path, os.O_WRONLY | os.O_APPEND)
                self.size = 0
            os.write(self._fd, line)
            self.size += len(line)
        except OSError as exc:  # a full disk stops the timeline file, not the monitor
            self.failed = f"timeline.jsonl could not be written: {exc.strerror or exc}"
            log.warning("timeline_write_failed", error=str(exc))

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


class Monitor:
    def __init__(self, run_dir: str) -> None:
        self.run_dir = run_dir
        with open(os.path.join(run_dir, "config.json"), "rb") as f:
            self.cfg: dict[str, Any] = json.loads(f.read())
        self.main_pid: int = int(self.cfg["pid"])
        opts = self.cfg.get("options") or {}
        self.poll_interval = float(opts.get("poll_interval") or 1.0)
        self.stall_timeout = opts.get("stall_timeout")
        self.body_timeout = opts.get("body_timeout")
        self.playbook_dirs = tuple(opts.get("playbooks") or ())
        keep = opts.get("keep_runs")  # validated by config.resolve in the training process
        self.keep_runs = (
            keep if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 0 else DEFAULT_KEEP_RUNS
        )
        self.report_dir: str = self.cfg.get("report_dir") or opts.get("report_dir") or "./dlwatch-reports"
        self.loader = self.cfg.get("loader")
        self.hb_path = os.path.join(run_dir, "heartbeat")
        self.hb_reader = hbmod.HeartbeatReader(self.hb_path)  # opened once: read every poll
        # a failure's own events are type-checked by the schema its module declares
        self.events = EventReader(os.path.join(run_dir, "events.jsonl"), registry.event_schemas())
        self.timeline = Timeline(os.path.join(run_dir, "timeline.jsonl"))
        # the last RING timeline records for an incident: events as dicts, samples as their line (bytes)
        self.ring: collections.deque[dict[str, Any] | bytes] = collections.deque(maxlen=RING)
        self.notable: collections.deque[dict[str, Any]] = collections.deque(maxlen=200)
        self.procs: dict[int, Tracked] = {
            self.main_pid: Tracked(self.main_pid, "main", dump_path=self.cfg.get("main_dump_path"))
        }
        self.loader_pids: set[int] = set()
        self.stall = StallDetector(self.stall_timeout, self.body_timeout)
        self.stall_sites: set[tuple[Any, ...]] = set()  # one incident per stall site and run
        # watches nested in this one's loop body (same training process): run dir -> last progress seen
        self.nested: dict[str, tuple[int, int] | None] = {}
        self.nested_monitors: set[int] = set()
        self.gpu: GpuProbe | None = None
        self.notes: list[str] = []
        self.exception: dict[str, Any] | None = None
        self.stop_seen = False
        self.interrupted = False  # the block was left by a KeyboardInterrupt (the stop event says so)
        self.reported_playbooks: set[str] = set()
        self.warned_in: dict[str, str] = {}  # playbook -> the threshold incident that reported it first
        self.incidents: list[str] = []
        self.polls = 0
        self.last_mem_detail = 0.0
        self.last_hb: hbmod.Heartbeat | None = None
        self.last_system: SystemSample | None = None
        self.first_system: SystemSample | None = None
        self.last_gpus: tuple = ()
        self.own_pid = os.getpid()
        self.fired: set[str] = set()  # threshold signals already turned into an incident attempt
        self.ignore: tuple[str, ...] = tuple(str(i) for i in opts.get("ignore") or () if isinstance(i, str))
        self.playbooks: tuple[Any, ...] | None = None  # loaded once; None: reports load them
        try:
            from dlwatch.wire.playbooks import load_playbooks

            self.playbooks = load_playbooks(self.playbook_dirs)
        except Exception as exc:
            self.notes.append(f"playbooks could not be loaded: {exc}")
        from dlwatch import detect

        self.detectors: list[Detector] = detect.build(
            {pb.id: pb.thresholds for pb in self.playbooks or ()}, ignore=self.ignore
        )
        self.warned: set[str] = set()
        self.system_probe = SystemProbe(self.main_pid)  # its cgroup found once, the limit read every 10 s
        try:  # how many processes may keep their /proc files open (see procfs.ProcFiles)
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            soft = KEPT_FDS_MAX + FDS_SPARE if soft == resource.RLIM_INFINITY else soft
        except (OSError, ValueError):
            soft = 0
        self.files_budget = max(0, min(KEPT_FDS_MAX, soft - FDS_SPARE)) // procfs.ProcFiles.FDS
        # which rank of which job (read by the training process: see dlwatch.wire.job)
        rank = self.cfg.get("rank")
        self.rank: dict[str, Any] = dict(rank) if isinstance(rank, dict) else store.rank_info()
        self.started_at = float(self.cfg.get("started_at") or time.time())
        self.stalls = 0
        self.stalled = False
        from dlwatch.monitor import outputs

        self.sinks = outputs.build(self.cfg, self.report_dir, self.rank, self._warn_once)
        # the run summary: figures fed each poll; advice and preflight findings kept by playbook id
        self.runstats = RunStats(started_at=self.started_at)
        self.advice: dict[str, dict[str, Any]] = {}
        self.preflight: dict[str, dict[str, Any]] = {}
        # `dlwatch run`: one monitor for the whole program; each loader iteration is a segment of the run
        self.program = self.cfg.get("program") is True
        self.segments: dict[int, dict[str, Any]] = {}  # live iterations: number -> loader key, name, config
        self.iteration_rows: list[dict[str, Any]] = []
        self.rows_dropped = 0
        self.loaders: dict[str, dict[str, Any]] = {}
        self.ended: str | None = None  # what the stop event says ended the program

    # ------------------------------------------------------------------ loop

    def run(self) -> int:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training loop; we stop with it
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop_seen", True))
        stdin_open = True
        next_poll = time.monotonic()
        while True:
            timeout = max(0.0, next_poll - time.monotonic())
            if stdin_open:
                try:
                    ready, _, _ = select.select([sys.stdin.buffer], [], [], min(timeout, 0.25))
                    if ready and not os.read(sys.stdin.fileno(), 4096):
                        stdin_open = False  # EOF: not proof of anything (forked workers hold the pipe)
                except (OSError, ValueError):
                    stdin_open = False
            else:
                time.sleep(min(timeout, 0.25))
            self._drain_events()
            if self.stop_seen:
                self._finish_clean()
                return 0
            if os.getppid() != self.main_pid:
                self._finish_vanished()
                return 0
            if time.monotonic() >= next_poll:
                try:
                    self.poll()
                except Exception as exc:  # one bad poll must not end the watch, nor flood stderr
                    self._warn_once("poll_failed", f"{type(exc).__name__}: {exc}")
                next_poll = time.monotonic() + self.poll_interval

    def _warn_once(self, event: str, error: str) -> None:
        key = f"{event}: {error}"
        if key not in self.warned:
            self.warned.add(key)
            self.notes.append(key)
            log.warning(event, error=error)

    # ------------------------------------------------------------------ events

    def _drain_events(self) -> None:
        for ev in self.events.new():
            name = ev.get("event")
            if name == "stop":
                self.stop_seen = True
                self.interrupted = ev.get("interrupted") is True
                if ev.get("ended") in ("clean", "exception", "interrupted"):
                    self.ended = ev["ended"]
            elif name == "exception":
                self.exception = ev.get("exception")
            elif name == "loader_iter" and self.program:
                self._flush_exception()  # the program went on after it: the incident now, not at the end
                self._segment_begins(ev)
            elif name == "loader_iter_end" and self.program:
                self._segment_ends(ev)
            elif name == "worker_registered":
                pid = int(ev.get("pid", 0))
                t = self.procs.get(pid) or Tracked(pid, "worker")
                t.role, t.worker_id = "worker", ev.get("worker_id")
                t.start_method, t.dump_path = ev.get("start_method"), ev.get("dump_path")
                self.procs[pid] = t
                self._note(ev)
            elif name == "loader_workers":
                pids = {int(p) for p in ev.get("pids") or ()}
                self.loader_pids = pids
                for pid in pids:
                    t = self.procs.get(pid) or Tracked(pid, "worker")
                    t.role = "worker"
                    self.procs[pid] = t
                self._note(ev)
            elif name == "nested_watch":
                run_dir, mpid = ev.get("run_dir"), ev.get("monitor_pid")
                if isinstance(run_dir, str) and os.path.isabs(run_dir) and len(self.nested) < MAX_OTHER:
                    self.nested.setdefault(run_dir, None)
                if isinstance(mpid, int):
                    self.nested_monitors.add(mpid)
            elif name == "batch_bytes":
                if isinstance(self.loader, dict) and isinstance(ev.get("batch_bytes"), int):
                    self.loader["batch_bytes"] = ev["batch_bytes"]
            elif name == "advice":
                self._keep_advice(ev)
            elif name == "interrupt":
                self._on_interrupt(ev)
            self._run_detectors("on_event", ev)

    # ------------------------------------------------------------------ `dlwatch run`: segments

    @property
    def iteration(self) -> int | None:
        """The live iteration (segment) started last: the one the loop advances (see Watch._credit)."""
        return max(self.segments) if self.segments else None

    def _segment_begins(self, ev: dict[str, Any]) -> None:
        n, key = ev.get("iteration"), ev.get("loader")
        if not isinstance(n, int) or isinstance(n, bool) or not isinstance(key, str) or len(self.segments) >= 1024:
            return
        config = ev.get("config") if isinstance(ev.get("config"), dict) else None
        name = ev.get("name") if isinstance(ev.get("name"), str) else None
        self.segments[n] = {"loader": key[:64], "name": (name or "")[:128], "config": config}
        if config is not None:
            self.loader = config  # forensics judge the workers the loop waits for now
        entry = self.loaders.get(key[:64])
        if entry is None and len(self.loaders) < MAX_LOADERS:
            entry = self.loaders[key[:64]] = {
                "loader": key[:64],
                "name": (name or "")[:128],
                "class": (config or {}).get("class"),
                "num_workers": (config or {}).get("num_workers"),
                "persistent_workers": (config or {}).get("persistent_workers"),
                "iterations": 0,
                "batches": 0,
                "config": config,  # its settings, as at its first iteration (the summary's `loader` is the last's)
            }
        if entry is not None:
            entry["iterations"] += 1
        self._note({k: v for k, v in ev.items() if k != "config"})

    def _segment_ends(self, ev: dict[str, Any]) -> None:
        n = ev.get("iteration")
        seg = self.segments.pop(n, None) if isinstance(n, int) and not isinstance(n, bool) else None
        if seg is None:
            return

        def num(key: str) -> float:
            v = ev.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v >= 0 else 0.0

        batches = int(num("batches"))
        active, wait = num("active_s"), num("data_wait_s")
        pids = [p for p in ev.get("worker_pids") or () if isinstance(p, int) and not isinstance(p, bool)][:256]
        workers, each = self.runstats.iteration_workers(pids)
        row = {
            "iteration": n,
            "loader": seg["loader"],
            "name": seg["name"],
            "epoch": 0,  # this loader's iterations before this one
            "started_at": ev.get("ts"),
            "batches": batches,
            "active_s": round(active, 4),
            "wall_s": round(num("wall_s"), 4),
            "data_wait_s": round(wait, 4),
            "data_wait_share": round(min(1.0, wait / active), 4) if active > 0 else None,
            "first_batch_s": round(num("first_batch_s"), 4) if batches else None,
            "workers": workers,
        }
        if each is not None:
            row["worker_processes"] = each  # every worker it started, named, with its figures
        entry = self.loaders.get(seg["loader"])
        if entry is not None:
            row["epoch"] = entry.get("rows", 0)
            entry["rows"] = entry.get("rows", 0) + 1
            entry["batches"] += batches
        if len(self.iteration_rows) < MAX_ITERATION_ROWS:
            self.iteration_rows.append(row)
        else:
            self.rows_dropped += 1

    def _flush_exception(self) -> None:
        """An exception the program caught and lived on after: its incident now (one per exception)."""
        if self.exception is None:
            return
        try:
            self.poll()  # the state right after the exception
        except Exception:
            pass
        self._write(self._report("exception"))
        self.exception = None

    def _note(self, ev: dict[str, Any]) -> None:
        self.notable.append(ev)
        self.timeline.append({"kind": "event", **ev})
        self.ring.append({"kind": "event", **ev})

    def _view(self, run: dict[str, Any] | None = None) -> View:
        return View(
            now=time.time(),
            procs=self.procs,
            loader=self.loader,
            loader_pids=frozenset(self.loader_pids),
            system=self.last_system,
            heartbeat=self.last_hb,
            run=run,
        )

    def _run_detectors(self, method: str, *args: Any, run: dict[str, Any] | None = None) -> None:
        """Feed every detector; each signal it hands back becomes a threshold incident, advice is kept."""
        view = self._view(run)
        for det in self.detectors:
            try:
                signals = list(getattr(det, method)(*args, view))
            except Exception as exc:  # one broken detector must not stop the others or the monitor
                self._warn_once("detector_failed", f"{type(det).__name__}.{method}: {type(exc).__name__}: {exc}")
                continue
            for sig in signals:
                event = sig.get("event") if isinstance(sig, dict) else None
                if event == "advice":
                    self._keep_advice(sig)  # kept for the run summary, and noted there (once)
                elif event in NOTE_EVENTS:
                    self._note(sig)  # observations: in the timeline and every later report
                else:
                    self._threshold_incident(sig)

    def _keep_advice(self, sig: dict[str, Any]) -> None:
        """An advice signal (a detector's, or an event from the training process): for the summary only.

        ``stage: "preflight"`` marks the training process's checks made before the workers started.
        The first signal of a playbook id is kept, noted like any event (timeline, later reports).
        """
        pid = sig.get("playbook")
        if not isinstance(pid, str) or not pid or pid in self.ignore:
            return
        kept = self.preflight if sig.get("stage") == "preflight" else self.advice
        if pid in kept or len(kept) >= 64:
            return
        kept[pid] = dict(sig)
        # in the timeline and in every later report's events: a stall after fork-with-threads shows both
        self._note({"ts": time.time(), **{k: v for k, v in sig.items() if k != "kind"}})

    # ------------------------------------------------------------------ sampling

    def _forget_old(self) -> None:
        gone = [pid for pid, t in self.procs.items() if t.gone and t.role != "main"]
        for pid in gone[:-MAX_GONE] if len(gone) > MAX_GONE else ():
            self._drop_files(self.procs.pop(pid))

    def _drop_files(self, t: Tracked) -> None:
        if t.files is not None:
            t.files.close()
            t.files = None
            self.files_budget += 1

    def _discover(self) -> None:
        try:
            kids = procfs.descendants(self.main_pid)
        except Exception:
            kids = []
        mine = {self.own_pid, *procfs.descendants(self.own_pid)}
        for m in self.nested_monitors:  # another watch's monitor (and its py-spy) is not part of the job
            mine.update((m, *procfs.descendants(m)))
        others = sum(1 for t in self.procs.values() if t.role == "other" and not t.gone)
        for pid in kids:
            if pid in mine or pid in self.procs:
                continue
            # Workers belong to the watch whose iterator started them: they are named by its
            # loader_workers event or register through its hook.  A pt_data_worker found here
            # belongs to another loader (a validation loader, a nested watch): kept as "other".
            if others < MAX_OTHER:
                self.procs[pid] = Tracked(pid, "other")
                others += 1

    def _activity(self, samples: list[ProcSample]) -> Activity:
        """What a loop-body pause is judged on: the job's CPU, the main process's wait, nested progress."""
        cpu = [s.cpu_s for s in samples if not s.gone and s.cpu_s is not None]
        main = next((s for s in samples if s.pid == self.main_pid and not s.gone), None)
        busy = main is not None and (main.state in ("R", "D") or syscall_category(main.syscall) in ("io", "sleep"))
        inner = False
        for run_dir, seen in list(self.nested.items()):
            hb = hbmod.read(os.path.join(run_dir, "heartbeat"))
            if hb is None:
                continue
            now_seen = (hb.batches, hb.epochs)
            if seen is not None and now_seen != seen:
                inner = True
            self.nested[run_dir] = now_seen
        return Activity(cpu_s=sum(cpu) if cpu else None, busy=busy, inner_progress=inner)

    def poll(self) -> None:
        self.polls += 1
        now = time.time()
        hb = self.hb_reader.read()
        self.last_hb = hb or self.last_hb
        if self.polls % DISCOVER_EVERY == 1:
            self._discover()
            self._forget_old()
        mem_detail = now - self.last_mem_detail >= MEM_DETAIL_EVERY_S
        if mem_detail:
            self.last_mem_detail = now
        fast = 0
        samples = []
        for t in list(self.procs.values()):
            if t.gone:
                continue
            prev = t.last
            detail = mem_detail
            if not detail and fast < MEM_FAST_MAX and self._faulting(t, now):
                detail, fast = True, fast + 1
            if t.files is None and self.files_budget > 0:
                t.files = procfs.ProcFiles(t.pid)
                self.files_budget -= 1
            # USS & co. kept from prev between reads
            s = procfs.read_proc(t.pid, mem_detail=detail, carry=prev, files=t.files)
            if detail and s.uss_ts == s.ts:  # read now, not carried from prev
                t.minflt_at_detail = s.minflt
            if not s.gone and self._wants_fd_detail(t, s):
                s = dataclasses.replace(s, fds=procfs.fd_summary(t.pid))
                t.fds_at_detail, t.detail_poll, t.last_fds = s.num_fds, self.polls, s.fds
            if s.gone or s.state == "Z":
                t.gone = s.gone or t.role != "main"
                if t.gone:
                    self._drop_files(t)
                if t.gone and t.crash is None:  # its last words, if it died of a fatal signal
                    t.crash = faultdump.read_crash(faultdump.crash_path(os.path.join(self.run_dir, "dumps"), t.pid))
            t.history.append(s)
            samples.append(s)
        try:
            self.last_system = self.system_probe.sample()
            self.first_system = self.first_system or self.last_system
        except Exception as exc:
            self._warn_once("system_probe_failed", str(exc))
        if self.gpu is None:
            self.gpu = GpuProbe()
            if self.gpu.unavailable:
                log.debug("gpu_unavailable", reason=self.gpu.unavailable)
        self.last_gpus = self.gpu.sample()
        self.runstats.update(hb, self.procs.values(), samples, self.last_system, self.last_gpus)
        # the line straight from the samples, redacted on the way (not to_dict + compact + outbound +
        # json.dumps: 3x the cost of /proc); the ring keeps it as written, an incident decodes it
        line = timeline_record.sample_line(
            now,
            hb.to_dict() if hb else None,
            [(s, self.procs[s.pid].role) for s in samples],
            self.last_system,
            self.last_gpus,
        )
        self.ring.append(line)
        self.timeline.append_line(line)
        self._detect(hb, self._activity(samples))
        self._feed_sinks()

    def _poll_state(self) -> Any:
        from dlwatch.monitor.sinks import PollState, ProcState

        procs = tuple(
            ProcState(t.pid, t.role, t.worker_id, t.last)
            for t in self.procs.values()
            if not t.gone and t.last is not None
        )
        return PollState(
            now=time.time(),
            monotonic=time.monotonic(),
            pid=self.main_pid,
            started_at=self.started_at,
            rank=self.rank,
            heartbeat=self.last_hb,
            procs=procs,
            system=self.last_system,
            stalls=self.stalls,
            incidents=len(self.incidents),
            stalled=self.stalled,
        )

    def _feed_sinks(self) -> None:
        if not self.sinks:
            return
        state = self._poll_state()
        for sink in self.sinks:
            try:
                sink.on_poll(state)
            except Exception as exc:  # metrics that cannot be written never stop the watch
                self._warn_once(f"{sink.name}_failed", f"{type(exc).__name__}: {exc}")

    @staticmethod
    def _faulting(t: Tracked, now: float) -> bool:
        """Pages faulted in since the last USS read: read it again sooner than the slow cadence."""
        last = t.last
        if last is None or last.uss_ts is None or now - last.uss_ts < MEM_FAST_EVERY_S or last.minflt is None:
            return False
        base = t.minflt_at_detail
        return base is not None and (last.minflt - base) * procfs.PAGE_SIZE >= MEM_FAST_FAULT_BYTES

    def _wants_fd_detail(self, t: Tracked, s: ProcSample) -> bool:
        """The fd breakdown costs a readlink per fd: read it when the count really moved.

        Under the file_descriptor strategy the main process's count jitters with every
        batch in flight, so a move of a few fds waits for the periodic refresh.
        """
        if t.fds_at_detail is None or self.polls - t.detail_poll >= FD_DETAIL_EVERY:
            return True
        if s.num_fds is None:
            return False
        moved = abs(s.num_fds - t.fds_at_detail)
        limit = s.fd_limit or 0
        return moved >= max(8, t.fds_at_detail // 20) or (limit and s.num_fds >= 0.8 * limit and moved > 0)

    # ------------------------------------------------------------------ detection

    def _detect(self, hb: hbmod.Heartbeat | None, activity: Activity | None = None) -> None:
        ev = self.stall.update(hb, time.monotonic(), activity)
        if ev is not None:
            self.stalled = ev.kind == "stall"
            if ev.kind == "stall":
                self.stalls += 1
                self._on_stall(ev, hb)
            else:
                self._note(
                    {
                        "ts": time.time(),
                        "event": "progress_resumed",
                        "stall_s": round(ev.stall_s, 3),
                        "batches": ev.batches,
                    }
                )
        self._run_detectors("on_poll")

    def _threshold_incident(self, ev: dict[str, Any]) -> None:
        """A failure that raises nothing: one incident per run and playbook, as soon as it is seen."""
        key = str(ev.get("signal") or ev.get("event"))
        if key in self.fired:
            return
        self.fired.add(key)
        if ev not in self.notable:
            self._note(ev)
        report = self._report("threshold")
        findings = report.findings or ()
        fresh = [f for f in findings if f.playbook not in self.reported_playbooks]
        if not fresh:
            return  # a signal no (new) playbook claims stays in the timeline, not in a report
        self.reported_playbooks.add(str(fresh[0].playbook))
        report = report.replace(
            findings=tuple(fresh + [f for f in findings if f not in fresh]),
            summary=f"{fresh[0].title} (seen before any error)",
        )
        path = self._write(report)
        if path is not None:
            self.warned_in[str(fresh[0].playbook)] = os.path.basename(path)

    def _on_stall(self, ev: StallEvent, hb: hbmod.Heartbeat | None) -> None:
        self._discover()  # every process of the tree, not only those seen at the last scan
        report = self._report("stall", findings=False)
        report = report.replace(
            progress={
                **(report.progress or {}),
                "stall_s": round(ev.stall_s, 3),
                "stall_timeout_s": ev.timeout_s,
                "stall_allowance": ev.allowance,
            }
        )
        stall_note = {
            "ts": time.time(),
            "event": "stall",
            "stall_s": round(ev.stall_s, 3),
            "timeout_s": ev.timeout_s,
            "state": ev.state,
            "allowance": ev.allowance,
        }
        self._note(stall_note)
        extra: dict[str, bytes] = {}
        try:
            from dlwatch.monitor import forensics

            report, extra = forensics.investigate(
                report,
                self.procs,
                main_waiting_for_data=(ev.state == "waiting_for_data"),
                expected_workers=self._expected_workers(),
            )
        except ImportError:
            report = report.with_notes("stack forensics unavailable in this build")
        except Exception as exc:
            report = report.with_notes(f"stack forensics failed: {type(exc).__name__}: {exc}")
        report = self._add_findings(report.replace(events=list(self.notable)))
        site = stall_site(report.to_dict())
        if self.program:  # `dlwatch run`: one incident per stall site and iteration (each was a run of its own)
            site = (self.iteration, *site)
        stall_note["classification"] = report.classification
        if site in self.stall_sites:
            # the same hang again (same verdict, same waiting frames): the timeline has it, one report is enough
            self.timeline.append(
                {
                    "kind": "event",
                    "ts": time.time(),
                    "event": "stall_repeated",
                    "classification": report.classification,
                }
            )
            return
        self.stall_sites.add(site)
        self._write(report, extra)

    def _on_interrupt(self, ev: dict[str, Any]) -> None:
        """A Ctrl-C after a long wait (dlwatch.wire.interrupt): an incident when the wait reached
        ``SHARE`` of its stall allowance and no stall incident covers it; then the training process's
        wait ends (the ack), whatever happened here."""
        try:
            self._interrupt_incident(ev)
        except Exception as exc:
            self._warn_once("interrupt_failed", f"{type(exc).__name__}: {exc}")
        finally:
            interrupt.answer(interrupt.ack_path(self.run_dir, int(ev["seq"])))

    def _interrupt_incident(self, ev: dict[str, Any]) -> None:
        where, waited = str(ev["where"]), float(ev["waited_s"])
        kind = interrupt.kind(where, ev.get("first_batch") is True)
        allowance = self.stall.allowance(kind, time.monotonic())
        note = {
            "ts": time.time(),
            "event": "interrupted",
            "state": where,
            "waited_s": round(waited, 3),
            "allowance_s": allowance,
        }
        if self.stall.stalled:  # one hang, one incident: the stall's is written
            self._note({**note, "incident": "the stall's"})
            return
        if waited < interrupt.SHARE * allowance:
            self._note({**note, "incident": None})
            return
        self._note({**note, "incident": "interrupt"})
        self.stall.hold()  # the incident covers this wait: no stall incident for it afterwards
        self._discover()
        report = self._report("interrupt", findings=False)
        report = report.replace(
            progress={
                **(report.progress or {}),
                "interrupted_after_s": round(waited, 3),
                "interrupted_in": where,
                "stall_timeout_s": allowance,
                "stall_allowance": "body" if kind == "body" else "data",
            }
        )
        extra: dict[str, bytes] = {}
        frames = ev.get("frames") or []
        try:
            from dlwatch.monitor import forensics

            report, extra = forensics.investigate(
                report,
                self.procs,
                main_waiting_for_data=where == interrupt.WAITING,
                expected_workers=self._expected_workers(),
                main_thread=(self.main_pid, frames, int(ev.get("frames_omitted") or 0)) if frames else None,
                exited=self._before_interrupt(ev),
                at_signal=self._sigint_stacks,
            )
        except ImportError:
            report = report.with_notes("stack forensics unavailable in this build")
        except Exception as exc:
            report = report.with_notes(f"stack forensics failed: {type(exc).__name__}: {exc}")
        report = self._interrupt_verdict(report, where, waited, frames)
        self._write(self._add_findings(report.replace(events=list(self.notable))), extra)

    def _before_interrupt(self, ev: dict[str, Any]) -> dict[int, tuple[ProcSample, ProcSample]]:
        """Each process but the main: its last two reads before the Ctrl-C (at least a second apart
        where the history allows), for the ones that the interrupt ended (a terminal signals the
        whole process group; torch's workers exit)."""
        from dlwatch.monitor.forensics import SECOND_READ_AFTER_S

        cut = float(ev.get("ts") or time.time()) - 0.02  # reads after the signal may show the exit itself
        out: dict[int, tuple[ProcSample, ProcSample]] = {}
        for pid, t in self.procs.items():
            if pid == self.main_pid:
                continue
            seen = [s for s in t.history if not s.gone and s.ts <= cut]
            if len(seen) < 2:
                continue
            last = seen[-1]
            first = next((s for s in reversed(seen[:-1]) if last.ts - s.ts >= SECOND_READ_AFTER_S), seen[0])
            out[pid] = (first, last)
        return out

    def _sigint_stacks(self, pid: int) -> StackDump | None:
        """The stacks worker ``pid`` wrote as SIGINT reached it (dlwatch.wire.dumps.install_interrupt), or None."""
        from dlwatch.collect.faultdump import read_interrupt
        from dlwatch.wire.dumps import interrupt_path

        return read_interrupt(interrupt_path(os.path.join(self.run_dir, "dumps"), pid), pid)

    def _interrupt_verdict(self, report: Incident, where: str, waited: float, frames: list[dict[str, Any]]) -> Incident:
        """What the main process did is in its traceback, not in /proc: it waits for this report now."""
        at = interrupt_site(frames)
        workers = [p for p in report.processes or () if p.role == "worker" and p.status not in (None, "gone")]
        if where == interrupt.BODY:
            states = ", ".join(sorted({str(p.status) for p in workers}))
            return report.replace(
                classification="main-blocked",
                classification_reason=(
                    f"the loop body ran {waited:.0f} s without asking for a batch when Ctrl-C stopped it{at}"
                    + (f"; workers: {states}" if workers else "; no live workers")
                ),
            )
        if not workers and not self._expected_workers():
            return report.replace(
                classification=None,
                classification_reason=(
                    f"no workers: the main process had loaded data itself for {waited:.0f} s when Ctrl-C "
                    f"stopped it{at}; that wait ended with the interrupt, its state cannot be observed"
                ),
            )
        return report

    def _add_findings(self, report: Incident) -> Incident:
        return build.add_findings(report, self.playbook_dirs, playbooks=self.playbooks, ignore=self.ignore)

    def _expected_workers(self) -> int | None:
        n = (self.loader or {}).get("num_workers")
        return int(n) if isinstance(n, int) and n > 0 else None

    # ------------------------------------------------------------------ reports

    def _report(self, trigger: str, *, findings: bool = True) -> Incident:
        config = {k: (self.cfg.get("options") or {}).get(k) for k in ("poll_interval", "stall_timeout")}
        config["report_dir"] = self.report_dir
        if self.cfg.get("program_run"):  # every iteration of one `dlwatch run` shares it
            config["program_run"] = self.cfg["program_run"]
        notes = list(self.notes)
        gpu_said, quiet = gpu_notes(self.gpu)
        notes.extend(gpu_said)
        if self.timeline.failed:
            notes.append(self.timeline.failed)
        report = build.incident(
            trigger,
            self.main_pid,
            now=time.time(),
            rank=self.rank,
            loader=self.loader,
            config=config,
            progress=self._progress(self.last_hb),
            exception=self.exception if trigger == "exception" else None,
            processes=[self._proc_entry(t) for t in self.procs.values()],
            system=self.last_system.to_dict() if self.last_system else None,
            gpus=[g.to_dict() for g in self.last_gpus],
            events=self.notable,
            timeline=[json.loads(r) if type(r) is bytes else r for r in self.ring],
            notes=notes,
            quiet_notes=quiet,
        )
        return self._add_findings(report) if findings else report

    def _progress(self, hb: hbmod.Heartbeat | None) -> dict[str, Any]:
        if hb is None:
            return {"batches": 0, "epochs": 0}
        out: dict[str, Any] = hb.progress(time.monotonic(), self.stall.body_until)  # the wait going on counted
        if hb.ts_last_batch:
            out["last_batch_age_s"] = round(time.monotonic() - hb.ts_last_batch, 3)
            out["last_batch_ts"] = round(time.time() - (time.monotonic() - hb.ts_last_batch), 3)
        return out

    def _proc_entry(self, t: Tracked) -> ProcessEntry:
        last = t.last
        sample = build.compact(last.to_dict()) if last else None
        if sample and "fds" not in sample and t.last_fds is not None:
            sample["fds"] = t.last_fds.to_dict()
        if sample and t.gone:
            sample["gone"] = True
        crash = {k: t.crash.get(k) for k in ("signal", "fatal_error")} if t.crash is not None else None
        return build.process(
            t.pid,
            t.role,
            worker_id=t.worker_id,
            start_method=t.start_method,
            name=last.name if last else None,
            cmdline=procfs.cmdline(t.pid) if not t.gone else None,
            sample=sample,
            crash=crash,
            stack=t.crash.get("stack") if t.crash is not None else None,
            status="gone" if t.gone else None,
        )

    def _link_earlier(self, report: Incident) -> Incident:
        """One failure, one incident: a later incident whose top finding a threshold incident of this
        run already reported names that incident (``related``; its summary line and notes say so)."""
        findings = report.findings or ()
        first = self.warned_in.get(str(findings[0].playbook)) if findings and report.trigger != "threshold" else None
        if first is None:
            return report
        playbook = str(findings[0].playbook)
        return report.replace(
            related=[{"id": first, "trigger": "threshold", "playbook": playbook, "relation": "seen-before"}],
            notes=(
                *(report.notes or ()),
                f"{playbook} was first reported by the threshold incident {first}: the same failure",
            ),
        )

    def _write(self, report: Incident, extra: dict[str, bytes] | None = None) -> str | None:
        report = self._link_earlier(report)
        try:
            path = build.write(report, self.report_dir, extra_files=extra)
        except Exception as exc:
            log.warning("report_write_failed", error=f"{type(exc).__name__}: {exc}")
            print(outbound(f"dlwatch: could not write the {report.trigger} report: {exc}"), file=sys.stderr)
            return None
        self.incidents.append(path)
        top = report.findings[0].playbook if report.findings else "no playbook matched"
        related = report.extra.get("related")
        if related:
            top = f"{top}, first seen in {related[0]['id']}"
        job = report.job
        if job is not None and job.role == "waiting":  # the cause is another rank's: say where to look
            top = f"this rank waits in {job.waiting_in}; the whole job: {job.view}"
        print(outbound(f"dlwatch: {report.trigger} incident ({top}): {path}"), file=sys.stderr, flush=True)
        try:
            fd = open_private(os.path.join(self.run_dir, "incidents"))  # 0600, like every file
            try:
                os.write(fd, (path + "\n").encode("utf-8", "surrogateescape"))
            finally:
                os.close(fd)
        except OSError:
            pass
        return path

    def _finish_clean(self) -> None:
        pending = self.exception is not None
        if self.exception is not None:
            try:
                self.poll()  # the state right after the exception
            except Exception:
                pass
            self._write(self._report("exception"))
        if self.ended is not None:  # `dlwatch run`: how the program ended, from its atexit
            ended = self.ended
        else:
            ended = "exception" if pending else "interrupted" if self.interrupted else "clean"
        self._write_summary(ended)
        self._close(clean=True)

    def _finish_vanished(self) -> None:
        self.procs[self.main_pid].gone = True
        self.last_hb = hbmod.read(self.hb_path) or self.last_hb  # the file outlives the writer
        report = self._report("exit", findings=False)
        first = self.first_system.cgroup_oom_kills if self.first_system else None
        try:
            # the dead process's /proc/<pid>/cgroup is gone; the monitor, its child, shares its cgroup
            now_sys = read_system(self.own_pid)
        except Exception:
            now_sys = self.last_system
        last = now_sys.cgroup_oom_kills if now_sys else None
        if first is not None and last is not None and last > first:
            cause = f"killed by the OOM killer (the cgroup's oom_kill count rose from {first} to {last})"
            report = report.replace(exit_cause="oom-kill")
        else:
            cause = (
                "ended without leaving the watch block: killed by a signal (e.g. SIGKILL) "
                "or os._exit; the monitor cannot read its exit status"
            )
            report = report.replace(exit_cause="vanished")
        alive = [
            t.pid for t in self.procs.values() if t.role == "worker" and not t.gone and not procfs.read_proc(t.pid).gone
        ]
        report = report.replace(summary=f"the training process (pid {self.main_pid}) {cause}")
        if alive:
            report = report.with_notes(f"worker processes still alive after the training process ended: {alive}")
        self._write(self._add_findings(report.replace(events=list(self.notable))))
        self._write_summary("vanished")
        self._close(clean=False)
        # nobody else will: the training process is gone. What mattered is in the incident.
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _write_summary(self, ended: str) -> str | None:
        """The run summary (figures, advice, preflight) next to the incidents; never an incident."""
        try:
            from dlwatch.detect.advice import not_judged, to_finding
            from dlwatch.report import summary as sm

            now = time.time()
            hb = hbmod.read(self.hb_path) or self.last_hb
            figures = self.runstats.figures(hb, now)
            s = sm.new_summary(
                run_id=os.path.basename(os.path.normpath(self.run_dir)),
                pid=self.main_pid,
                now=now,
                started_at=self.cfg.get("started_at"),
            ).replace(
                ended=ended,
                rank=self.rank,  # the rank the training process read (see dlwatch.wire.job)
                loader=self.loader,
                cpus=self.cfg.get("cpus"),
                accelerator=self.cfg.get("accelerator"),
                **{key: figures[key] for key in ("loop", "workers", "main", "peaks")},
            )
            self._run_detectors("on_finish", run=s.to_dict())
            pbs = self.playbooks or ()
            advice = sorted((to_finding(a, pbs) for a in self.advice.values()), key=lambda f: -f["confidence"])
            gpu_said, quiet = gpu_notes(self.gpu)
            unjudged = [
                u
                for u in not_judged(self.detectors, s.to_dict(), self.loader or {})
                if u["playbook"] not in self.ignore
            ]
            s = s.replace(
                advice=tuple(Finding.from_dict(f) for f in advice),
                preflight=tuple(Finding.from_dict(to_finding(a, pbs)) for a in self.preflight.values()),
                incidents=[os.path.basename(p) for p in self.incidents],
                notes=list(self.notes) + gpu_said,
                **({"quiet_notes": quiet} if quiet else {}),  # shown to people with -v only
                # the advisors a run too short could not feed, and the minimum each missed
                **({"advice_not_judged": unjudged} if unjudged else {}),
            )
            if self.program:  # `dlwatch run`: the whole program, a row per loader iteration
                s = self._program_summary(s)
        except Exception as exc:
            self._warn_once("summary_failed", f"{type(exc).__name__}: {exc}")
            return None
        # runs/<id>/ with its report.html (drawn in a short-lived child from our timeline files, handed
        # to it open: our run directory goes when the block ends); the oldest beyond keep_runs go
        path = build.write_run_summary(s, self.report_dir, keep_runs=self.keep_runs, timeline_dir=self.run_dir)
        if path is None:
            return None
        try:  # where the training process finds it for Watch.summary (its own private run dir)
            from dlwatch._fs import write_private

            write_private(os.path.join(self.run_dir, "summary"), path + "\n")
        except OSError:
            pass
        line = sm.pointer_line(s, path)
        if line and os.environ.get("DLWATCH_QUIET", "").strip().lower() not in ("1", "true", "yes", "on"):
            print(outbound(line), file=sys.stderr, flush=True)
        return path

    def _program_summary(self, s: RunSummary) -> RunSummary:
        """The program's keys of the summary: its loaders and a row per iteration (new keys only)."""
        for n in sorted(self.segments):  # iterations whose end never came (the process was killed)
            self._segment_ends({"iteration": n})
        notes = list(s.notes or ())
        if self.rows_dropped:
            notes.append(f"{self.rows_dropped} later iterations are counted, not listed")
        if self.runstats.workers_unlisted:
            notes.append(f"{self.runstats.workers_unlisted} workers of later iterations are counted, not listed")
        loop = dict(s.loop or {})
        loop["iterations"] = sum(e["iterations"] for e in self.loaders.values())
        return s.replace(
            program=True,
            program_run=self.cfg.get("program_run") if isinstance(self.cfg.get("program_run"), str) else None,
            loaders=[{k: v for k, v in e.items() if k != "rows"} for e in self.loaders.values()],
            # in the order the iterations began (a kept iterator ends only at the next iter() or at exit)
            iterations=sorted(self.iteration_rows, key=lambda r: r.get("iteration") or 0),
            notes=notes,
            loop=loop,
        )

    def _close(self, *, clean: bool = True) -> None:
        if self.sinks:  # the batches since the last poll count too
            self.last_hb = hbmod.read(self.hb_path) or self.last_hb
        state = self._poll_state() if self.sinks else None
        for sink in self.sinks:
            try:
                sink.close(state, clean=clean)
            except Exception as exc:
                self._warn_once(f"{sink.name}_failed", f"{type(exc).__name__}: {exc}")
        self.timeline.close()
        self.hb_reader.close()
        for t in self.procs.values():
            self._drop_files(t)
        if self.gpu is not None:
            self.gpu.close()


def _library(filename: str) -> bool:
    return (
        filename.startswith("<")
        or any(part in filename for part in ("/site-packages/", "/dist-packages/"))
        or ("/lib/python3" in filename and "/site-packages/" not in filename)
    )


def interrupt_site(frames: list[dict[str, Any]]) -> str:
    """Where a Ctrl-C landed, for a reason line: the program's innermost frame and, when the
    interrupt landed deeper (in torch or the standard library), that frame too."""
    if not frames:
        return ""

    def at(f: dict[str, Any]) -> str:
        return f"{os.path.basename(str(f.get('filename') or '?'))}:{f.get('line') or '?'} in {f.get('function')}()"

    own = next((f for f in frames if not _library(str(f.get("filename") or ""))), None)
    if own is None or own is frames[0]:
        return f", at {at(own or frames[0])}"
    return f", at {at(own)} (inside {at(frames[0])})"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_own_process()
    if len(argv) != 1:
        print("usage: python -m dlwatch.monitor.loop RUN_DIR (started by dlwatch.watch)", file=sys.stderr)
        return 2
    try:
        monitor = Monitor(argv[0])
    except (OSError, ValueError, KeyError) as exc:
        print(outbound(f"dlwatch: monitor cannot start: {exc}"), file=sys.stderr)
        return 1
    return monitor.run()


if __name__ == "__main__":
    sys.exit(main())
