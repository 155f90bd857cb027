"""One run of one candidate: fork it, sample it with dlwatch's collectors, stop it, leave nothing behind.

The candidate runs in a fork of this process (``driver.main``), in a process group of its own
(a terminal's Ctrl-C reaches this process only, and one ``killpg`` reaches the candidate's
every process), with SIGINT ignored, its stdout discarded and its stderr kept in a private
file (a worker's last words go into the failure's reason).  This process watches it, about
every ``SAMPLE_S``: each of its processes with ``collect.procfs.read_proc`` (RSS, CPU time,
descriptors; a worker's schedstat too, into ``usage.CpuUsage``; USS from smaps_rollup every ``USS_EVERY_S``) and the machine with
``collect.system.SystemProbe`` (/dev/shm, MemAvailable, the cgroup).  It stops the candidate

- on a stall: no batch (no message) for the allowance of the moment;
- at a limit: memory, /dev/shm or descriptors at ``limits.STOP_SHARE`` of their room;
- at the end of the time the search gives it;

and a candidate that raised (a worker killed, /dev/shm full, an error in the dataset) ends by
itself with the exception's text, whose playbook the matcher names (``detect.match``, the
same as an incident's).  Stopping is SIGTERM (the candidate's process kills and reaps its
workers) and, half a second later, SIGKILL to the whole group.  Afterwards every process the
candidate had is confirmed gone (through a pidfd: never a recycled pid), and named torch
segments it left in /dev/shm (the ``file_system`` sharing strategy, ``torch_<pid>_...``) are
removed; whatever could not be is reported in ``leftovers``.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field, replace
from typing import Any

from dlwatch.collect import procfs
from dlwatch.collect.pidhandle import ProcessHandle
from dlwatch.collect.system import SHM_DIR, SystemProbe
from dlwatch.model import ProcSample, SystemSample
from dlwatch.tuning import driver, limits
from dlwatch.tuning.driver import Plan
from dlwatch.tuning.limits import Machine
from dlwatch.tuning.space import Config
from dlwatch.tuning.usage import SAMPLE_S, CpuUsage

USS_EVERY_S = 1.0
DISCOVER_EVERY_S = 0.5
TERM_GRACE_S = 0.5
# a worker of the running iterator that died: the candidate's own process should raise torch's error
# at once (its SIGCHLD handler); where that error is lost (raised inside code that swallows it, as
# torch's lazy profiler import does) torch only notices at its 5 s status check: stop it ourselves
WORKER_DEATH_GRACE_S = 1.0
GONE_WAIT_S = 3.0


@dataclass
class RunRecord:
    """What one run of a candidate measured (raw units), or why it ended early."""

    config: Config
    phase: str
    status: str = "ok"  # ok, failed (raised, stalled, stopped at a limit), stopped (time, Ctrl-C), empty
    reason: str | None = None
    playbook: str | None = None
    limit: str | None = None  # memory, shm or fds: the limit that stopped it
    first_batch_s: float | None = None
    steady: dict[str, Any] | None = None
    resets: list[float] = field(default_factory=list)
    fingerprints: list[Any] = field(default_factory=list)
    cpu_cores: float | None = None
    # the workers' schedstat over the steady window: the share of their time on a CPU or runnable and
    # waiting for one, and the cores' worth of that waiting (CPU-bound workers on a shared machine
    # wait; I/O-bound ones sleep)
    worker_busy_share: float | None = None
    wait_cores: float | None = None
    workers: int = 0
    worker_rss_total: int | None = None
    worker_rss_max: int | None = None
    worker_uss_total: int | None = None
    worker_uss_max: int | None = None
    mem_peak: int | None = None  # the candidate's private memory (its processes' USS), at its highest
    shm_peak: int | None = None  # /dev/shm used above the tune's start
    fds_peak: int | None = None  # the most descriptors one of its processes held
    fd_limit: int | None = None  # that process's limit
    wall_s: float = 0.0
    leftovers: list[str] = field(default_factory=list)

    @property
    def rate(self) -> float | None:
        s = self.steady or {}
        if s.get("intervals") and s.get("seconds"):
            return float(s["intervals"]) / float(s["seconds"])
        return None


class _Proc:
    __slots__ = ("pid", "role", "handle", "sample", "uss", "uss_at", "rss_at_uss", "cpu_s")

    def __init__(self, pid: int, role: str) -> None:
        self.pid = pid
        self.role = role
        self.handle = ProcessHandle.open(pid)
        self.sample: ProcSample | None = None
        self.uss: int | None = None
        self.uss_at = -1e9
        self.rss_at_uss = 0
        self.cpu_s = 0.0

    def uss_now(self) -> int | None:
        """USS as last read, plus the RSS grown since (USS is read every USS_EVERY_S only)."""
        if self.uss is None:
            return None
        rss = self.sample.rss if self.sample is not None and self.sample.rss is not None else self.rss_at_uss
        return self.uss + max(0, rss - self.rss_at_uss)


def _set_pdeathsig() -> None:
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: the candidate never outlives the tune
    except Exception:
        pass


def _on_term(signum: int, frame: Any) -> None:
    """In the candidate: kill and reap its own processes (its workers), then end."""
    me = os.getpid()
    kids = procfs.children(me)
    for pid in kids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    for pid in kids:
        try:
            os.waitpid(pid, 0)
        except OSError:
            pass
    os._exit(143)


def _child(write_fd: int, read_fd: int, loader: Any, plan: Plan, err_fd: int) -> None:
    try:
        os.close(read_fd)
        os.setpgid(0, 0)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the terminal's Ctrl-C is the tune's to handle
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        signal.signal(signal.SIGTERM, _on_term)
        _set_pdeathsig()
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, 1)
        os.dup2(err_fd, 2)
        os.close(null)
        os.close(err_fd)
        sys.stdout = open(1, "w", closefd=False)  # a stream object a host (a test runner) put there is not ours
        sys.stderr = open(2, "w", closefd=False)
        warnings.filterwarnings("ignore", message="This DataLoader will create")  # torch's, for every candidate
    except BaseException:
        os._exit(2)
    driver.main(write_fd, loader, plan)  # never returns


class CandidateRun:
    """Runs one plan under watch; ``run()`` returns its :class:`RunRecord`."""

    def __init__(
        self,
        loader: Any,
        plan: Plan,
        *,
        phase: str,
        machine: Machine,
        probe: SystemProbe,
        first_allowance_s: float,
        stall_s: float,
        err_path: str,
        playbooks: Any = (),
    ) -> None:
        self.loader = loader
        self.plan = plan
        self.machine = machine
        self.probe = probe
        self.first_allowance_s = first_allowance_s
        self.stall_s = stall_s
        self.err_path = err_path
        self.playbooks = playbooks
        self.rec = RunRecord(config=plan.config, phase=phase)
        self.procs: dict[int, _Proc] = {}
        self.worker_pids: set[int] = set()
        self.usage = CpuUsage()
        self.pid = 0
        self.exit_status: int | None = None
        self.error: tuple[str, str, str] | None = None
        self.done = False
        self.epoch_workers: set[int] = set()  # the workers of the iterator running now
        self.dead: tuple[float, int, int | None] | None = None  # (when seen, pid, wait status) of a dead one

    # ------------------------------------------------------------------ lifecycle

    def run(self) -> RunRecord:
        start = time.monotonic()
        read_fd, write_fd = os.pipe()
        err_fd = os.open(self.err_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        for stream in (sys.stdout, sys.stderr):  # a fork must not write this process's buffered text again
            try:
                stream.flush()
            except Exception:
                pass
        # SIGINT is blocked across the fork (a Ctrl-C that arrived while fork() ran was lost now and then):
        # it stays pending until the candidate is registered and its cleanup armed below; the candidate
        # ignores it before it unblocks it (its process group is its own: the terminal's Ctrl-C is ours)
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            with warnings.catch_warnings():  # Python 3.12+ warns of fork() beside threads: the candidate uses none
                warnings.simplefilter("ignore", DeprecationWarning)
                pid = os.fork()
        except BaseException:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            for fd in (read_fd, write_fd, err_fd):
                os.close(fd)
            raise
        if pid == 0:
            _child(write_fd, read_fd, self.loader, self.plan, err_fd)
        self.pid = pid
        try:
            os.setpgid(pid, pid)
        except OSError:
            pass  # the child set it first
        self.procs[pid] = _Proc(pid, "main")
        os.close(write_fd)
        os.close(err_fd)
        from multiprocessing.connection import Connection

        conn = Connection(read_fd, writable=False)
        try:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # a Ctrl-C pending since the fork lands here
            self._watch(conn, start)
        except KeyboardInterrupt:
            self._stop("stopped", "interrupted (Ctrl-C)")
            raise
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
            self._cleanup()
            conn.close()
            self.rec.wall_s = time.monotonic() - start
            self._finish()
        return self.rec

    def _watch(self, conn: Any, start: float) -> None:
        from multiprocessing.connection import wait

        last_msg = start
        max_gap = 0.0
        first_seen = False
        next_sample = start
        next_discover = start + DISCOVER_EVERY_S
        hard_stop = self.plan.stop_at + 2.0
        while True:
            for _ in wait([conn], timeout=SAMPLE_S):
                try:
                    msg = conn.recv()
                except (EOFError, OSError):
                    break
                now = time.monotonic()
                if first_seen:
                    max_gap = max(max_gap, now - last_msg)
                last_msg = now
                first_seen = self._message(msg) or first_seen
            now = time.monotonic()
            if self._exited():
                while conn.poll(0):  # what it sent before it ended
                    try:
                        self._message(conn.recv())
                    except (EOFError, OSError):
                        break
                return
            if now >= next_discover:
                self._discover()
                next_discover = now + DISCOVER_EVERY_S
            if now >= next_sample:
                if self._sample(now):
                    return
                next_sample = now + SAMPLE_S
            if self.dead is not None and now - self.dead[0] > WORKER_DEATH_GRACE_S and self.error is None:
                self._stop("failed", _death_reason(self.dead[1], self.dead[2]), playbook="worker-killed")
                return
            allowance = max(self.stall_s, 10 * max_gap) if first_seen else self.first_allowance_s
            if now - last_msg > allowance:
                what = "the next batch" if first_seen else "the first batch"
                self._stop("failed", f"stalled: waited {now - last_msg:.1f} s for {what}")
                return
            if now > hard_stop:
                self._stop("stopped", self._out_of_time(start, first_seen))
                return

    def _out_of_time(self, start: float, first_seen: bool) -> str:
        """Whose time ended, and, before the first batch, how far the candidate had got (its workers
        started or not, where its main thread was): a stop for time is never the loader's fault unproven."""
        whose = (
            "the tune's budget ended"
            if self.plan.stop_at >= self.plan.budget_end
            else f"its {self.plan.stop_at - start:.0f} s share of the budget ended"
        )
        if first_seen:
            return f"out of time ({whose})"
        children = sum(1 for p in self.procs.values() if p.role != "main")  # told of, or found under it
        if self.rec.workers:
            started = f"{self.rec.workers} worker{'s' if self.rec.workers != 1 else ''} had started"
        elif children:
            started = f"its iterator had not started: {children} process{'es' if children != 1 else ''} under it"
        else:
            started = "no worker had started"
        return f"out of time before its first batch ({whose}; {started}{_main_thread_at(self.pid)})"

    def _message(self, msg: Any) -> bool:
        kind = msg[0]
        if kind == "workers":
            self.epoch_workers = set(msg[1])
            self.dead = None
            for pid in msg[1]:
                self.worker_pids.add(pid)
                if pid not in self.procs:
                    self.procs[pid] = _Proc(pid, "worker")
                else:
                    self.procs[pid].role = "worker"
            self.rec.workers = max(self.rec.workers, len(msg[1]))
        elif kind == "first":
            self.rec.first_batch_s = float(msg[1])
            return True
        elif kind == "steady":
            self.rec.steady = dict(msg[1])
            self.epoch_workers = set()  # from here workers end on purpose (the candidate's own teardown)
        elif kind == "reset":
            self.rec.resets.append(float(msg[1]))
        elif kind == "fingerprints":
            self.rec.fingerprints = list(msg[1])
        elif kind == "empty":
            self.rec.status, self.rec.reason = "empty", "the loader yielded no batch"
        elif kind == "error":
            self.error = (str(msg[1]), str(msg[2]), str(msg[3]))
        elif kind == "done":
            self.done = True
        return False

    def _exited(self) -> bool:
        try:
            info = os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return True
        if info is None:
            return False
        self.exit_status = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
        return True

    # ------------------------------------------------------------------ sampling

    def _discover(self) -> None:
        for pid in procfs.descendants(self.pid, limit=512):
            if pid not in self.procs:
                self.procs[pid] = _Proc(pid, "worker" if pid in self.worker_pids else "other")

    def _sample(self, now: float) -> bool:
        """Read every process and the machine; stop the candidate at a limit (True then)."""
        rss_total = 0
        rss_max = 0
        fds_top: tuple[int, int | None] | None = None
        cpu = 0.0
        for p in self.procs.values():
            if p.sample is not None and p.sample.gone:
                cpu += p.cpu_s
                continue
            due = now - p.uss_at >= USS_EVERY_S and (self.rec.first_batch_s is not None or p.role == "main")
            s = procfs.read_proc(p.pid, mem_detail=due, carry=p.sample)
            if (s.gone or s.state == "Z") and p.pid in self.epoch_workers and self.dead is None:
                self.dead = (now, p.pid, s.exit_code)
            if s.gone:
                p.sample = s if p.sample is None else replace(p.sample, gone=True)
                cpu += p.cpu_s
                continue
            p.sample = s
            if s.cpu_s is not None:
                p.cpu_s = s.cpu_s
            if p.role == "worker":
                sched = procfs.schedstat(p.pid)
                if sched is not None:
                    self.usage.worker(p.pid, now, sched[0], sched[1])
            cpu += p.cpu_s
            if due and s.uss is not None:
                p.uss, p.uss_at, p.rss_at_uss = s.uss, now, s.rss or 0
            if p.role == "worker" and s.rss is not None:
                rss_total += s.rss
                rss_max = max(rss_max, s.rss)
            if s.num_fds is not None and (fds_top is None or s.num_fds > fds_top[0]):
                fds_top = (s.num_fds, s.fd_limit)
        self.usage.point(now, cpu)
        workers = [p for p in self.procs.values() if p.role == "worker" and p.uss is not None]
        if workers:
            uss = [p.uss_now() or 0 for p in workers]
            r = self.rec
            r.worker_uss_total = max(r.worker_uss_total or 0, sum(uss))
            r.worker_uss_max = max(r.worker_uss_max or 0, max(uss))
        if rss_total:
            self.rec.worker_rss_total = max(self.rec.worker_rss_total or 0, rss_total)
            self.rec.worker_rss_max = max(self.rec.worker_rss_max or 0, rss_max)
        mem = sum(p.uss_now() or 0 for p in self.procs.values() if not (p.sample and p.sample.gone)) or None
        if mem is not None:
            self.rec.mem_peak = max(self.rec.mem_peak or 0, mem)
        if fds_top is not None and (self.rec.fds_peak is None or fds_top[0] > self.rec.fds_peak):
            self.rec.fds_peak, self.rec.fd_limit = fds_top
        sysnow: SystemSample | None
        try:
            sysnow = self.probe.sample()
        except Exception:
            sysnow = None
        shm = None
        if sysnow is not None and sysnow.shm_total is not None and sysnow.shm_free is not None:
            shm = max(0, sysnow.shm_total - sysnow.shm_free - (self.machine.shm_used or 0))
            self.rec.shm_peak = max(self.rec.shm_peak or 0, shm)
        stop = limits.stop_reason(
            self.machine,
            mem=mem,
            shm=shm,
            fds=fds_top[0] if fds_top else None,
            fd_limit=fds_top[1] if fds_top else None,
            now=sysnow,
        )
        if stop is not None:
            self.rec.limit = stop[0]
            self._stop("failed", f"stopped by dlwatch: {stop[1]}")
            return True
        return False

    # ------------------------------------------------------------------ ending

    def _stop(self, status: str, reason: str, playbook: str | None = None) -> None:
        if self.rec.status in ("ok", "empty") or status == "failed":
            self.rec.status, self.rec.reason = status, reason
            if playbook:
                self.rec.playbook = playbook
        self._kill()

    def _kill(self) -> None:
        """SIGTERM (the candidate reaps its workers), then SIGKILL to its whole group."""
        if self.pid <= 0:
            return
        if not self._exited():
            try:
                os.kill(self.pid, signal.SIGTERM)  # our child, not reaped yet: its pid cannot be anyone else's
            except OSError:
                pass
            deadline = time.monotonic() + TERM_GRACE_S
            while time.monotonic() < deadline and not self._exited():
                time.sleep(0.01)
        try:
            os.killpg(self.pid, signal.SIGKILL)  # the group is ours while its leader is unreaped
        except OSError:
            pass

    def _alive(self, p: _Proc) -> bool:
        if p.handle is None:
            return False
        s = procfs.read_proc(p.pid)
        if s.gone or s.state in ("Z", "X"):
            return False
        try:
            p.handle.send(0)
        except (ProcessLookupError, Exception):
            return False
        return True

    def _cleanup(self) -> None:
        if self.pid <= 0:
            return
        if not self._exited():
            self._discover()
            self._kill()
        else:
            try:
                os.killpg(self.pid, signal.SIGKILL)  # a worker the candidate left (it is a zombie: the group holds)
            except OSError:
                pass
        try:
            os.waitpid(self.pid, 0)
        except ChildProcessError:
            pass
        deadline = time.monotonic() + GONE_WAIT_S
        alive = [p for p in self.procs.values() if p.pid != self.pid]
        while alive and time.monotonic() < deadline:
            for p in alive:
                if p.handle is not None:
                    try:
                        p.handle.send(signal.SIGKILL, uid=os.geteuid())
                    except Exception:
                        pass
            alive = [p for p in alive if self._alive(p)]
            if alive:
                time.sleep(0.02)
        for p in alive:
            self.rec.leftovers.append(f"process {p.pid} ({p.role}) still alive")
        for p in self.procs.values():
            if p.handle is not None:
                p.handle.close()
        self._remove_named_segments()

    def _remove_named_segments(self) -> None:
        pids = {str(p) for p in self.procs}
        try:
            names = os.listdir(SHM_DIR)
        except OSError:
            return
        me = os.geteuid()
        for name in names:
            parts = name.split("_")
            if len(parts) < 3 or parts[0] != "torch" or parts[1] not in pids:
                continue
            path = os.path.join(SHM_DIR, name)
            try:
                st = os.lstat(path)
                if st.st_uid == me:
                    os.unlink(path)
            except OSError:
                self.rec.leftovers.append(f"/dev/shm/{name}")

    def _finish(self) -> None:
        r = self.rec
        if self.error is not None and r.status in ("ok", "empty"):
            etype, message, text = self.error
            r.status = "failed"
            r.reason = _error_line(etype, message)
            r.playbook = _playbook_of(etype, message, text, self.playbooks)
        elif r.status == "ok" and not self.done:
            code = self.exit_status
            what = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited with {code}"
            r.status, r.reason = "failed", f"the candidate's main process {what} before it finished"
            tail = _tail(self.err_path)
            if tail:
                r.reason += f" (its last words: {tail})"
        steady = r.steady or {}
        r.cpu_cores, r.worker_busy_share, r.wait_cores = self.usage.in_window(steady.get("begin"), steady.get("end"))


def _main_thread_at(pid: int) -> str:
    """'; its main thread was in FUNC (FILE:LINE)' from a py-spy dump of the stopped-for-time candidate,
    or its kernel wait channel where py-spy is missing or fails; empty where neither says anything."""
    from dlwatch.collect.stacks import dump_stack
    from dlwatch.detect.classify import main_thread

    main = main_thread(dump_stack(pid, native=False, timeout_s=3.0), pid)  # dump_stack never raises
    if main is not None and main.frames:
        f = main.frames[0]
        where = f" ({os.path.basename(f.filename)}:{f.line})" if f.filename else ""
        return f"; its main thread was in {f.function}{where}"
    s = procfs.read_proc(pid)
    if s.gone or not s.wchan:
        return ""
    return f"; its main thread was asleep in the kernel's {s.wchan}"


def _error_line(etype: str, message: str) -> str:
    """A candidate's error in one line.  torch re-raises a worker's error as ``Caught X in DataLoader
    worker process N.`` followed by the worker's traceback: the worker's own last line (``RuntimeError:
    unable to write to file </torch_...>: No space left on device``) is the one that says what
    happened, so it is kept beside the wrapper's."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    first = lines[0] if lines else ""
    if first.startswith("Caught ") and "in DataLoader worker process" in first and len(lines) > 1:
        return f"{etype}: {first} {lines[-1]}"[:300]
    return f"{etype}: {first}"[:300]


def _death_reason(pid: int, status: int | None) -> str:
    """A dead worker in torch's words (so that the matcher names it as it would torch's own message)."""
    if status is not None and status & 0x7F:
        try:
            name = signal.Signals(status & 0x7F).name
        except ValueError:
            name = f"signal {status & 0x7F}"
        return f"stopped by dlwatch: DataLoader worker (pid {pid}) is killed by signal: {name}"
    if status is not None:
        return f"stopped by dlwatch: DataLoader worker (pid {pid}) exited with {status >> 8}"
    return f"stopped by dlwatch: DataLoader worker (pid(s) {pid}) exited unexpectedly"


def _tail(path: str, limit: int = 2048) -> str:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, limit, max(0, size - limit))
    finally:
        os.close(fd)
    lines = [ln.strip() for ln in data.decode("utf-8", "replace").replace("\x00", "").splitlines() if ln.strip()]
    return lines[-1][:200] if lines else ""


def _playbook_of(etype: str, message: str, text: str, playbooks: Any) -> str | None:
    """The failure's playbook, matched on the exception as an incident's would be."""
    if not playbooks:
        return None
    try:
        from dlwatch.detect.match import match

        found = match({"exception": {"type": etype, "message": message, "traceback": text}}, playbooks)
    except Exception:
        return None
    return found[0].playbook if found else None
