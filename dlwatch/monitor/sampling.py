"""The monitor's reads: which processes it watches, and what each poll reads of them and the system.

``Sampler`` keeps the table of tracked processes (the training process, the workers its watch
names or that register, other descendants found by a scan) and, each poll, reads the heartbeat,
every live process's /proc (the fd breakdown and USS at their own cadences, a process's files
kept open while the fd budget allows: ``procfs.ProcFiles``), the system and the GPUs.  It judges
nothing: what it read goes to the timeline, the run's figures, the detectors and the sinks.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import resource
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, NamedTuple

from dlwatch._log import get_logger
from dlwatch.collect import faultdump, procfs
from dlwatch.collect.gpu import GpuProbe
from dlwatch.collect.growth import moved_since
from dlwatch.collect.syscalls import category as syscall_category
from dlwatch.collect.system import SystemProbe, read_system
from dlwatch.detect.base import View
from dlwatch.detect.stall import Activity
from dlwatch.model import ProcSample, SystemSample, TrackedProcess
from dlwatch.monitor.journal import Notes
from dlwatch.monitor.settings import Settings
from dlwatch.wire import heartbeat as hbmod

__all__ = ["HISTORY", "Sampler", "Tracked"]

log = get_logger("dlwatch.monitor")

HISTORY = 120  # samples kept per process (2 min at the default interval): memory is bounded by workers x this
FD_DETAIL_EVERY = 30  # polls between fd breakdowns when the count does not move (a readlink per fd)
DISCOVER_EVERY = 5  # polls between scans for new child processes (workers also announce themselves)
MEM_DETAIL_EVERY_S = 10.0  # smaps_rollup costs ~2.4 ms a process
# ... read at that cadence only for a process whose memory moved by this much since its last read (pages
# faulted in, RSS): a leak the detector judges (>= 1 MiB/s) moves more than twice that between two reads,
# while a healthy worker's churn (a shared-memory page or two per batch, freed once sent) takes a minute
# or more to add up to it; else every:
MEM_MOVED_BYTES = 4 << 20
MEM_DETAIL_MAX_AGE_S = 60.0
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


@dataclass
class Tracked(TrackedProcess):
    """A tracked process with what the monitor keeps about it between polls."""

    history: collections.deque = field(default_factory=lambda: collections.deque(maxlen=HISTORY))
    fds_at_detail: int | None = None  # num_fds when the fd breakdown was last read
    last_fds: Any = None  # that breakdown (FdSummary): reports show it with the latest sample
    detail_poll: int = -(10**9)
    crash: dict[str, Any] | None = None  # the stack a crashed process left in its crash file (faultdump)
    minflt_at_detail: int | None = None  # minor faults when USS was last read (see Sampler._faulting)
    rss_at_detail: int | None = None  # RSS then (see growth.moved_since)
    files: procfs.ProcFiles | None = None  # its /proc files kept open while it is polled

    @property
    def last(self) -> ProcSample | None:
        history = self.history
        if history and not history[-1].gone:  # nearly always (read several times a poll): no iterator
            return history[-1]
        for s in reversed(history):
            if not s.gone:
                return s
        return None


class Reading(NamedTuple):
    """What one poll read: the heartbeat (None when unreadable) and a sample per live process."""

    now: float
    heartbeat: hbmod.Heartbeat | None
    samples: list[ProcSample]


class Sampler:
    def __init__(self, settings: Settings, notes: Notes) -> None:
        self.settings = settings
        self.notes = notes
        self.main_pid = settings.main_pid
        self.hb_reader = hbmod.HeartbeatReader(settings.hb_path)  # opened once: read every poll
        self.procs: dict[int, Tracked] = {
            self.main_pid: Tracked(self.main_pid, "main", dump_path=settings.cfg.get("main_dump_path"))
        }
        self.loader: Any = settings.cfg.get("loader")  # the watched loader's configuration (the report's)
        self.loader_pids: frozenset[int] = frozenset()
        # watches nested in this one's loop body (same training process): run dir -> last progress seen
        self.nested: dict[str, tuple[int, int] | None] = {}
        self.nested_monitors: set[int] = set()
        self.gpu: GpuProbe | None = None
        self.polls = 0
        self.last_mem_detail = 0.0
        self.last_hb: hbmod.Heartbeat | None = None
        self.last_system: SystemSample | None = None
        self.first_system: SystemSample | None = None
        self.last_gpus: tuple = ()
        self.system_probe = SystemProbe(self.main_pid)  # its cgroup found once, the limit read every 10 s
        try:  # how many processes may keep their /proc files open (see procfs.ProcFiles)
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
            soft = KEPT_FDS_MAX + FDS_SPARE if soft == resource.RLIM_INFINITY else soft
        except (OSError, ValueError):
            soft = 0
        self.files_budget = max(0, min(KEPT_FDS_MAX, soft - FDS_SPARE)) // procfs.ProcFiles.FDS

    # ------------------------------------------------------------------ what the events tell

    def track_worker(self, pid: int, worker_id: Any, start_method: Any, dump_path: Any) -> None:
        """A worker registered (its hook ran): a worker, with where its stacks go."""
        t = self.procs.get(pid) or Tracked(pid, "worker")
        t.role, t.worker_id = "worker", worker_id
        t.start_method, t.dump_path = start_method, dump_path
        self.procs[pid] = t

    def track_loader_workers(self, pids: Iterable[int]) -> None:
        """The watched iterator's workers, as it started them: the ones the loop waits for."""
        self.loader_pids = frozenset(pids)
        for pid in self.loader_pids:
            t = self.procs.get(pid) or Tracked(pid, "worker")
            t.role = "worker"
            self.procs[pid] = t

    def add_nested(self, run_dir: Any, monitor_pid: Any) -> None:
        """A watch started in this loop's body: its progress is ours, its monitor is not the job."""
        if isinstance(run_dir, str) and os.path.isabs(run_dir) and len(self.nested) < MAX_OTHER:
            self.nested.setdefault(run_dir, None)
        if isinstance(monitor_pid, int):
            self.nested_monitors.add(monitor_pid)

    def expected_workers(self) -> int | None:
        n = (self.loader or {}).get("num_workers")
        return int(n) if isinstance(n, int) and n > 0 else None

    # ------------------------------------------------------------------ the poll's reads

    def forget_old(self) -> None:
        gone = [pid for pid, t in self.procs.items() if t.gone and t.role != "main"]
        for pid in gone[:-MAX_GONE] if len(gone) > MAX_GONE else ():
            self.drop_files(self.procs.pop(pid))

    def drop_files(self, t: Tracked) -> None:
        if t.files is not None:
            t.files.close()
            t.files = None
            self.files_budget += 1

    def discover(self) -> None:
        try:
            kids = procfs.descendants(self.main_pid)
        except Exception:
            kids = []
        own = self.settings.own_pid
        mine = {own, *procfs.descendants(own)}
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

    def activity(self, samples: list[ProcSample]) -> Activity:
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

    def read(self) -> Reading:
        """One poll's reads: the heartbeat, each live tracked process, the system, the GPUs."""
        self.polls += 1
        now = time.time()
        hb = self.hb_reader.read()
        self.last_hb = hb or self.last_hb
        if self.polls % DISCOVER_EVERY == 1:
            self.discover()
            self.forget_old()
        mem_detail = now - self.last_mem_detail >= MEM_DETAIL_EVERY_S
        if mem_detail:
            self.last_mem_detail = now
        fast = 0
        samples = []
        for t in list(self.procs.values()):
            if t.gone:
                continue
            prev = t.last
            detail = mem_detail and self._memory_moved(t, prev, now)
            if not detail and fast < MEM_FAST_MAX and self._faulting(t, prev, now):
                detail, fast = True, fast + 1
            if t.files is None and self.files_budget > 0:
                t.files = procfs.ProcFiles(t.pid)
                self.files_budget -= 1
            # USS & co. kept from prev between reads
            s = procfs.read_proc(t.pid, mem_detail=detail, carry=prev, files=t.files)
            if detail and s.uss_ts == s.ts:  # read now, not carried from prev
                t.minflt_at_detail, t.rss_at_detail = s.minflt, s.rss
            if not s.gone and self._wants_fd_detail(t, s):
                s = dataclasses.replace(s, fds=procfs.fd_summary(t.pid))
                t.fds_at_detail, t.detail_poll, t.last_fds = s.num_fds, self.polls, s.fds
            if s.gone or s.state == "Z":
                t.gone = s.gone or t.role != "main"
                if t.gone:
                    self.drop_files(t)
                if t.gone and t.crash is None:  # its last words, if it died of a fatal signal
                    t.crash = faultdump.read_crash(faultdump.crash_path(self.settings.dumps_dir, t.pid))
            t.history.append(s)
            samples.append(s)
        try:
            self.last_system = self.system_probe.sample()
            self.first_system = self.first_system or self.last_system
        except Exception as exc:
            self.notes.warn_once("system_probe_failed", str(exc))
        if self.gpu is None:
            self.gpu = GpuProbe()
            if self.gpu.unavailable:
                log.debug("gpu_unavailable", reason=self.gpu.unavailable)
        self.last_gpus = self.gpu.sample()
        return Reading(now, hb, samples)

    @staticmethod
    def _memory_moved(t: Tracked, last: ProcSample | None, now: float) -> bool:
        """The slow-cadence USS read of a process whose memory did not move is skipped, up to MEM_DETAIL_MAX_AGE_S."""
        if last is None or last.uss_ts is None or now - last.uss_ts >= MEM_DETAIL_MAX_AGE_S:
            return True
        return moved_since(
            last.rss,
            last.minflt,
            t.rss_at_detail,
            t.minflt_at_detail,
            page_size=procfs.PAGE_SIZE,
            min_bytes=MEM_MOVED_BYTES,
        )

    @staticmethod
    def _faulting(t: Tracked, last: ProcSample | None, now: float) -> bool:
        """Pages faulted in since the last USS read (``last``: ``t.last``): read it again sooner than the slow cadence."""
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
        if s.num_fds is None or s.num_fds == t.fds_at_detail:  # unmoved: the common case, no sum to make
            return False
        moved = abs(s.num_fds - t.fds_at_detail)
        limit = s.fd_limit or 0
        return moved >= max(8, t.fds_at_detail // 20) or (limit and s.num_fds >= 0.8 * limit and moved > 0)

    # ------------------------------------------------------------------ after the training process

    def reread_heartbeat(self) -> hbmod.Heartbeat | None:
        """The heartbeat as the training process left it (the file outlives its writer)."""
        self.last_hb = hbmod.read(self.settings.hb_path) or self.last_hb
        return self.last_hb

    def system_now(self) -> SystemSample | None:
        """The system read afresh after the training process died (its /proc/<pid>/cgroup is gone;
        the monitor, its child, shares its cgroup); the last poll's when that fails."""
        try:
            return read_system(self.settings.own_pid)
        except Exception:
            return self.last_system

    def live_workers(self) -> list[int]:
        """Workers still alive, read now (after the training process ended)."""
        return [
            t.pid for t in self.procs.values() if t.role == "worker" and not t.gone and not procfs.read_proc(t.pid).gone
        ]

    def view(self, run: dict[str, Any] | None = None) -> View:
        return View(
            now=time.time(),
            procs=self.procs,
            loader=self.loader,
            loader_pids=self.loader_pids,
            system=self.last_system,
            heartbeat=self.last_hb,
            run=run,
        )

    def close(self) -> None:
        self.hb_reader.close()
        for t in self.procs.values():
            self.drop_files(t)
        if self.gpu is not None:
            self.gpu.close()
