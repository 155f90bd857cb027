"""The run's figures for its summary: accumulated from what the monitor samples each poll.

Pure bookkeeping, no I/O: the monitor feeds every poll (heartbeat, the tracked
processes with their newest /proc sample, the system sample, the GPUs) to
:meth:`RunStats.update` and asks :meth:`RunStats.figures` once, when the block ends.
The advice detectors (:mod:`dlwatch.detect.advice`) judge these figures.

What a worker does between two polls is measured from what every poll already
reads, with no extra /proc read: its CPU time (``cpu_s``), its scheduler state and
the syscall its main thread is in.  Each interval is split so:

- ``running``: the share of the interval the worker spent on a CPU (its CPU time
  delta), or the whole interval when it is runnable (state R: it wants a CPU, and on
  an over-subscribed machine does not get one);
- the rest goes to the state seen at the poll: ``io`` (state D, or a read/write/
  open/recv syscall), ``blocked_put`` (idle while the training loop runs its body:
  torch hands a worker a new index only when one of its batches is consumed, so an
  idle worker whose batches are not being waited for has finished its share of
  ``prefetch_factor`` batches and they sit in the full queue), or
  ``waiting_for_work`` (idle while the loop waits for data or is between epochs), or
  ``sleeping`` (in a timed sleep inside its own work: a ``time.sleep`` in ``__getitem__``, a retry
  back-off; it is busy with a sample, never waiting for one, which an incident calls "blocked, sleep").

The main thread of a worker never blocks in ``Queue.put`` (torch's result queue is
unbounded; only its feeder thread blocks on a full pipe), so "blocked putting a finished
batch into a full queue" is read from the loop's state rather than from a
per-thread read (``/proc/<pid>/task/*/syscall``, one more read per thread per poll).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from dlwatch.collect.syscalls import category as syscall_category
from dlwatch.wire.heartbeat import STATE_BODY, STATE_WAITING, Heartbeat
from dlwatch.model import GpuSample, ProcSample, SystemSample

__all__ = ["RunStats", "Steady", "WORKER_STATES", "steady"]

WORKER_STATES = ("running", "waiting_for_work", "blocked_put", "io", "sleeping")
MAX_EPOCHS_KEPT = 1000  # first-batch latencies kept per epoch (the totals stay exact beyond)
MAX_ITERATION_WORKERS = 2000  # workers listed one by one in `dlwatch run`'s iteration rows (the rest counted)
# an isolated steady wait (see RunStats.pauses): at least this long, this many times the other batches'
# mean, and at most one such wait or this share of the steady batches
PAUSE_MIN_S = 1.0
PAUSE_FACTOR = 20.0
PAUSE_MAX_SHARE = 0.02


@dataclass
class _Proc:
    # Not the tracked process (model.TrackedProcess): figures that outlive it (a worker of an
    # earlier epoch stays in the summary after the monitor forgot it), keyed by pid.
    pid: int
    role: str
    worker_id: int | None = None
    first_ts: float | None = None
    first_cpu: float | None = None
    last_ts: float | None = None
    last_cpu: float | None = None
    rss_peak: int | None = None
    uss_peak: int | None = None
    polls: int = 0  # polls that sampled it (its CPU use needs two)
    private_dirty_peak: int | None = None  # the part of USS it wrote (a copy grows it; file cache does not)
    states_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(WORKER_STATES, 0.0))

    def cpu_util(self) -> float | None:
        if self.first_ts is None or self.last_ts is None or self.first_cpu is None or self.last_cpu is None:
            return None
        span = self.last_ts - self.first_ts
        return max(0.0, (self.last_cpu - self.first_cpu) / span) if span > 0 else None


@dataclass(frozen=True)
class Steady:
    """The loop in its steady state: every epoch without its first batch (worker start-up).

    The one definition of the steady data-wait share: the run summary's ``steady_*`` and the
    rank figures' ``data_wait_share``/``batch_rate_per_s`` (the job view) both come from here.
    """

    batches: int
    wait_s: float  # time inside next(loader), the epochs' first waits left out
    body_s: float  # time in the loop body (the first batches' bodies stay in: not start-up)

    @property
    def loop_s(self) -> float:
        return self.wait_s + self.body_s

    @property
    def data_wait_share(self) -> float | None:
        return round(self.wait_s / self.loop_s, 4) if self.loop_s > 0 else None

    @property
    def batch_s(self) -> float | None:
        return round(self.loop_s / self.batches, 6) if self.batches else None


def steady(hb: Heartbeat) -> Steady:
    """The steady part of a heartbeat's totals (exact: the heartbeat sums each epoch's first wait)."""
    return Steady(
        batches=max(0, hb.batches - hb.epochs),
        wait_s=max(0.0, hb.total_wait_s - hb.total_first_wait_s),
        body_s=hb.total_step_s,
    )


def _peak(old: int | None, new: int | None) -> int | None:
    if new is None:
        return old
    return new if old is None or new > old else old


def classify_interval(prev: ProcSample, cur: ProcSample, loop_in_body: bool) -> dict[str, float]:
    """Seconds of one worker interval by state (see the module docstring)."""
    out: dict[str, float] = {}
    _add_interval(out, prev, cur, loop_in_body)
    return out


def _add_interval(states: dict[str, float], prev: ProcSample, cur: ProcSample, loop_in_body: bool) -> None:
    """``classify_interval``'s seconds added to ``states`` (every poll, for every worker: no dict between)."""
    dt = cur.ts - prev.ts
    if dt <= 0:
        return
    if cur.state == "R":
        states["running"] = states.get("running", 0.0) + dt
        return
    cpu = 0.0
    if cur.cpu_s is not None and prev.cpu_s is not None:
        cpu = min(dt, max(0.0, cur.cpu_s - prev.cpu_s))
    rest = dt - cpu
    states["running"] = states.get("running", 0.0) + cpu
    if rest > 0:
        category = syscall_category(cur.syscall)
        if cur.state == "D" or category == "io":
            key = "io"
        elif category == "sleep":
            key = "sleeping"
        elif loop_in_body:
            key = "blocked_put"
        else:
            key = "waiting_for_work"
        states[key] = states.get(key, 0.0) + rest


class RunStats:
    """Figures of one watched block, fed once per poll."""

    def __init__(self, started_at: float) -> None:
        self.started_at = started_at
        self.procs: dict[int, _Proc] = {}
        self._prev: dict[int, ProcSample] = {}
        self.first_waits: dict[int, float] = {}  # epoch number -> wait for its first batch
        self.hb: Heartbeat | None = None
        self.polls = 0
        self.fds_peak: dict[str, Any] | None = None
        self.shm_used_peak: int | None = None
        self.shm_total: int | None = None
        self.mlocked_first: int | None = None
        self.mlocked_last: int | None = None
        self.mlocked_peak: int | None = None
        self.mem_available_first: int | None = None
        self.mem_available_low: int | None = None
        self.cgroup_usage_peak: int | None = None
        self.cgroup_limit: int | None = None
        self.gpus: dict[int, dict[str, Any]] = {}
        self.workers_listed = 0  # workers named in `dlwatch run`'s iteration rows
        self.workers_unlisted = 0  # and those past MAX_ITERATION_WORKERS, counted only
        # a steady wait for data seen by two polls or more: (batch before it, total wait before it, batches
        # then, polls that saw it), and the lengths of those that ended (a pause, or the pattern: loop())
        self._wait: tuple[float, float, int, int] | None = None
        self.long_waits: list[float] = []

    # ------------------------------------------------------------------ feeding

    def heartbeat(self, hb: Heartbeat | None) -> None:
        if hb is None or hb is self.hb:  # the same read again (loop() passes the last one): nothing new
            return
        self.hb = hb
        first = hb.first_wait_s
        if (
            first is not None
            and hb.epochs
            and (hb.epochs in self.first_waits or len(self.first_waits) < MAX_EPOCHS_KEPT)
        ):
            self.first_waits[hb.epochs] = first

    def _note_wait(self, hb: Heartbeat) -> None:
        """Follow a steady wait across polls; when one that two polls saw ends, keep its length.

        A wait is one ``next(loader)`` after an epoch's first batch, known by the batch before
        it (``ts_last_batch``).  Its length is what ``total_wait_s`` grew by when it ended (the
        heartbeat adds a wait when its batch arrives): exact when one batch came since, else
        that wait plus the short ones after it.
        """
        w = self._wait
        if w is not None and hb.ts_last_batch != w[0]:
            if w[3] >= 2 and hb.batches > w[2] and len(self.long_waits) < MAX_EPOCHS_KEPT:
                self.long_waits.append(max(0.0, hb.total_wait_s - w[1]))
            w = self._wait = None
        if hb.state == STATE_WAITING and hb.epoch_batches > 0 and hb.ts_last_batch > 0:
            if w is None:
                self._wait = (hb.ts_last_batch, hb.total_wait_s, hb.batches, 1)
            else:
                self._wait = (w[0], w[1], w[2], w[3] + 1)

    def pauses(self, st: Steady) -> dict[str, Any] | None:
        """The steady waits that were isolated pauses, not the pipeline's pattern (None: none).

        A wait is a pause when it lasted at least ``PAUSE_MIN_S`` and ``PAUSE_FACTOR`` times the
        mean of the other steady batches, and such waits are few (at most one, or
        ``PAUSE_MAX_SHARE`` of the steady batches): one 30 s sleep among 47 ready batches is
        a pause; a shard download every tenth batch is how the pipeline runs.
        """
        if not self.long_waits or st.batches <= 0:
            return None
        rest_n = st.batches - len(self.long_waits)
        rest_s = st.loop_s - sum(self.long_waits)
        mean = rest_s / rest_n if rest_n > 0 and rest_s > 0 else 0.0
        long = [w for w in self.long_waits if w >= max(PAUSE_MIN_S, PAUSE_FACTOR * mean)]
        if not long or len(long) > max(1, int(PAUSE_MAX_SHARE * st.batches)):
            return None
        paused = sum(long)
        left = st.loop_s - paused
        return {
            "count": len(long),
            "total_s": round(paused, 3),
            "longest_s": round(max(long), 3),
            "steady_data_wait_share_without": round(max(0.0, st.wait_s - paused) / left, 4) if left > 0 else None,
            "steady_loop_s_without": round(max(0.0, left), 3),
        }

    def update(
        self,
        hb: Heartbeat | None,
        tracked: Iterable[Any],
        samples: Iterable[ProcSample],
        system: SystemSample | None,
        gpus: Iterable[GpuSample] = (),
    ) -> None:
        """One poll.  ``tracked``: the monitor's Tracked processes (pid, role, worker_id)."""
        self.polls += 1
        self.heartbeat(hb)
        if hb is not None:  # every poll (an unchanged heartbeat is handed over as the same object)
            self._note_wait(hb)
        in_body = hb is not None and hb.state == STATE_BODY
        roles = {t.pid: t for t in tracked}
        procs, prevs = self.procs, self._prev
        for s in samples:  # every poll, for every process: the peaks written out (_peak), no call each
            pid = s.pid
            t = roles.get(pid)
            if t is None or s.gone:
                continue
            role = t.role
            if role != "main" and role != "worker":
                continue
            p = procs.get(pid)
            if p is None:
                p = procs[pid] = _Proc(pid, role)
            p.role = role
            worker_id = getattr(t, "worker_id", None)
            if worker_id is not None:  # its registration may come after a first sample
                p.worker_id = worker_id
            p.polls += 1
            cpu = s.cpu_s
            if cpu is not None:
                if p.first_ts is None:
                    p.first_ts, p.first_cpu = s.ts, cpu
                p.last_ts, p.last_cpu = s.ts, cpu
            v = s.rss
            if v is not None and (p.rss_peak is None or v > p.rss_peak):
                p.rss_peak = v
            v = s.uss
            if v is not None and (p.uss_peak is None or v > p.uss_peak):
                p.uss_peak = v
            v = s.private_dirty
            if v is not None and (p.private_dirty_peak is None or v > p.private_dirty_peak):
                p.private_dirty_peak = v
            prev = prevs.get(pid)
            if prev is not None and role == "worker":
                _add_interval(p.states_s, prev, s, in_body)
            prevs[pid] = s
            if s.num_fds is not None and s.fd_limit:
                share = s.num_fds / s.fd_limit
                if self.fds_peak is None or share > self.fds_peak["share"]:
                    self.fds_peak = {
                        "num_fds": s.num_fds,
                        "fd_limit": s.fd_limit,
                        "share": round(share, 4),
                        "pid": s.pid,
                        "role": t.role,
                    }
        for pid in [pid for pid in self._prev if pid not in roles]:
            del self._prev[pid]
        if system is not None:
            if system.shm_total is not None and system.shm_free is not None:
                self.shm_total = system.shm_total
                self.shm_used_peak = _peak(self.shm_used_peak, system.shm_total - system.shm_free)
            if system.mlocked is not None:
                if self.mlocked_first is None:
                    self.mlocked_first = system.mlocked
                self.mlocked_last = system.mlocked
                self.mlocked_peak = _peak(self.mlocked_peak, system.mlocked)
            if system.mem_available is not None:
                if self.mem_available_first is None:
                    self.mem_available_first = system.mem_available
                if self.mem_available_low is None or system.mem_available < self.mem_available_low:
                    self.mem_available_low = system.mem_available
            self.cgroup_usage_peak = _peak(self.cgroup_usage_peak, system.cgroup_memory_usage)
            if system.cgroup_memory_limit is not None:
                self.cgroup_limit = system.cgroup_memory_limit
        for g in gpus:
            if g.util_percent is None:
                continue
            acc = self.gpus.setdefault(g.index, {"index": g.index, "name": g.name, "sum": 0.0, "n": 0, "low": None})
            acc["sum"] += g.util_percent
            acc["n"] += 1
            acc["low"] = g.util_percent if acc["low"] is None else min(acc["low"], g.util_percent)

    # ------------------------------------------------------------------ figures

    def loop(self, hb: Heartbeat | None, ended_at: float) -> dict[str, Any]:
        hb = hb or self.hb
        wall = max(0.0, ended_at - self.started_at)
        if hb is None:
            return {"batches": 0, "epochs": 0, "wall_s": round(wall, 3)}
        self.heartbeat(hb)
        wait, body = hb.total_wait_s, hb.total_step_s
        loop_s = wait + body
        first_total = hb.total_first_wait_s
        st = steady(hb)
        per_epoch = [round(self.first_waits[e], 4) for e in sorted(self.first_waits)]
        out: dict[str, Any] = {
            "batches": hb.batches,
            "epochs": hb.epochs,
            "wall_s": round(wall, 3),
            "loop_s": round(loop_s, 4),
            "data_wait_s": round(wait, 4),
            "body_s": round(body, 4),
            "data_wait_share": round(wait / loop_s, 4) if loop_s > 0 else None,
            "body_share": round(body / loop_s, 4) if loop_s > 0 else None,
            "steady_batches": st.batches,
            "steady_data_wait_s": round(st.wait_s, 4),
            "steady_data_wait_share": st.data_wait_share,
            "steady_batch_s": st.batch_s,
            **({"steady_pauses": pauses} if (pauses := self.pauses(st)) else {}),
            "first_batch_s": {
                "per_epoch": per_epoch,  # as seen by the polls; epochs shorter than a poll may be missing
                "epochs_seen": len(per_epoch),
                "total_s": round(first_total, 4),
                "mean_s": round(first_total / hb.epochs, 4) if hb.epochs else None,
            },
        }
        return out

    def workers(self) -> list[dict[str, Any]]:
        out = []
        for p in sorted(self.procs.values(), key=lambda p: (p.worker_id is None, p.worker_id or 0, p.pid)):
            if p.role == "worker":
                out.append(self._worker_entry(p))
        return out

    def name_worker(self, pid: int, worker_id: int) -> None:
        """``pid`` is worker ``worker_id`` (its place in its iterator's workers), where no sample said so."""
        p = self.procs.get(pid)
        if p is not None and p.worker_id is None:
            p.worker_id = worker_id

    def worker(self, pid: int, worker_id: int | None = None) -> dict[str, Any]:
        """One worker's figures (:meth:`workers`' shape), named even if no poll ever sampled it: then
        ``polls`` is 0 and every figure null (it started and ended between two polls)."""
        p = self.procs.get(pid)
        if p is None:
            p = _Proc(pid, "worker", worker_id)
        entry = self._worker_entry(p)
        if entry["worker_id"] is None:
            entry["worker_id"] = worker_id
        return entry

    def iteration_workers(self, pids: list[int]) -> tuple[dict[str, Any], list[dict[str, Any]] | None]:
        """The workers one loader iteration started (``pids`` in its iterator's order, which is their
        worker ids): their figures together (``num_workers``, ``cpu_util_mean``, ``rss_peak``) and each
        worker's (:meth:`worker`, without the seconds by state), or None for the second once
        ``MAX_ITERATION_WORKERS`` are listed in the run (``workers_unlisted`` counts the rest)."""
        for i, pid in enumerate(pids):
            self.name_worker(pid, i)
        stats = [self.procs[p] for p in pids if p in self.procs]
        utils = [u for u in (st.cpu_util() for st in stats) if u is not None]
        rss = [st.rss_peak for st in stats if st.rss_peak is not None]
        together = {
            "num_workers": len(pids),
            "cpu_util_mean": round(sum(utils) / len(utils), 3) if utils else None,
            "rss_peak": max(rss) if rss else None,
        }
        if self.workers_listed + len(pids) > MAX_ITERATION_WORKERS:
            self.workers_unlisted += len(pids)
            return together, None
        self.workers_listed += len(pids)
        each = []
        for i, pid in enumerate(pids):
            entry = self.worker(pid, i)
            del entry["state_s"]
            each.append(entry)
        return together, each

    @staticmethod
    def _worker_entry(p: _Proc) -> dict[str, Any]:
        total = sum(p.states_s.values())
        util = p.cpu_util()
        return {
            "pid": p.pid,
            "worker_id": p.worker_id,
            "cpu_util": round(util, 3) if util is not None else None,
            "observed_s": round(total, 3),
            "state_s": {k: round(v, 3) for k, v in p.states_s.items()},
            "state_share": {k: round(v / total, 3) for k, v in p.states_s.items()} if total > 0 else None,
            "rss_peak": p.rss_peak,
            "uss_peak": p.uss_peak,
            "polls": p.polls,
            **({"private_dirty_peak": p.private_dirty_peak} if p.private_dirty_peak is not None else {}),
        }

    def main(self) -> dict[str, Any] | None:
        p = next((p for p in self.procs.values() if p.role == "main"), None)
        if p is None:
            return None
        util = p.cpu_util()
        return {
            "pid": p.pid,
            "cpu_util": round(util, 3) if util is not None else None,
            "rss_peak": p.rss_peak,
            "uss_peak": p.uss_peak,
        }

    def peaks(self) -> dict[str, Any]:
        mlocked_change = (
            self.mlocked_last - self.mlocked_first
            if self.mlocked_first is not None and self.mlocked_last is not None
            else None
        )
        return {
            "fds": self.fds_peak,
            "shm": {
                "used_peak": self.shm_used_peak,
                "total": self.shm_total,
                "share": round(self.shm_used_peak / self.shm_total, 4)
                if self.shm_used_peak is not None and self.shm_total
                else None,
            },
            "mlocked": {
                "first": self.mlocked_first,
                "last": self.mlocked_last,
                "peak": self.mlocked_peak,
                "change": mlocked_change,
            },
            "mem_available": {"first": self.mem_available_first, "low": self.mem_available_low},
            "cgroup_memory": {"usage_peak": self.cgroup_usage_peak, "limit": self.cgroup_limit},
            "gpus": [
                {
                    "index": g["index"],
                    "name": g["name"],
                    "util_mean": round(g["sum"] / g["n"], 1),
                    "util_low": g["low"],
                    "samples": g["n"],
                }
                for g in self.gpus.values()
                if g["n"]
            ],
        }

    def iteration_row(
        self, iteration: int, loader: str, name: str, epoch: int, end: Mapping[str, Any]
    ) -> dict[str, Any]:
        """One loader iteration of `dlwatch run`, a row of the summary's ``iterations``: the figures
        of its end event (``loader_iter_end``; a figure that is not a non-negative number counts 0),
        and its workers' figures as polled (:meth:`iteration_workers`).  ``epoch``: this loader's
        iterations before this one."""

        def num(key: str) -> float:
            v = end.get(key)
            return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and v == v and v >= 0 else 0.0

        batches = int(num("batches"))
        active, wait = num("active_s"), num("data_wait_s")
        pids = [p for p in end.get("worker_pids") or () if isinstance(p, int) and not isinstance(p, bool)][:256]
        workers, each = self.iteration_workers(pids)
        row = {
            "iteration": iteration,
            "loader": loader,
            "name": name,
            "epoch": epoch,
            "started_at": end.get("ts"),
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
        return row

    def figures(self, hb: Heartbeat | None, ended_at: float) -> dict[str, Any]:
        """The measured part of the summary: ``loop``, ``workers``, ``main``, ``peaks``."""
        return {
            "loop": self.loop(hb, ended_at),
            "workers": self.workers(),
            "main": self.main(),
            "peaks": self.peaks(),
            "polls": self.polls,
        }


def worker_totals(workers: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The workers together: mean CPU utilisation (cores) and time shares by state."""
    ws = [w for w in workers if w.get("observed_s")]
    total = sum(float(w["observed_s"]) for w in ws)
    shares = {
        k: round(sum(float((w.get("state_s") or {}).get(k, 0.0)) for w in ws) / total, 3) if total else None
        for k in WORKER_STATES
    }
    utils = [float(w["cpu_util"]) for w in ws if w.get("cpu_util") is not None]
    return {
        "workers": len(ws),
        "observed_s": round(total, 3),
        "state_share": shares,
        "cpu_util_mean": round(sum(utils) / len(utils), 3) if utils else None,
        "cpu_util_max": round(max(utils), 3) if utils else None,
    }
