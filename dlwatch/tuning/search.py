"""The search's bookkeeping: each candidate's runs, what they cost, and one run within the time budget.

The plan's steps (the loader's own configuration, the IterableDataset rule, the climb on
``num_workers``, bisection, ``persistent_workers``, ``prefetch_factor``, repeats, ``pin_memory``)
are in :mod:`dlwatch.tuning.phases`.  Each run's window is ``budget / WINDOW_DIVISOR`` seconds of
steady batches (``MIN_WINDOW_S`` to ``MAX_WINDOW_S``); a run whose projected cost does not fit the
time left is skipped, and the persistent measurement has its time kept aside.  Ctrl-C stops the
search at once (the running candidate is stopped and cleaned up) and the result holds what was
measured.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable

from dlwatch.collect.system import SystemProbe
from dlwatch.tuning import forkprobe, iterable, recommend as rec
from dlwatch.tuning.driver import Plan
from dlwatch.tuning.guard import CandidateRun, RunRecord
from dlwatch.tuning.limits import Machine, read_machine
from dlwatch.tuning.result import Row, TuneResult, pool
from dlwatch.tuning.space import DEFAULT_PREFETCH, Config, LoaderFacts, default_max_workers

WINDOW_DIVISOR = 40.0
MIN_WINDOW_S = 0.25
MAX_WINDOW_S = 2.0
FIRST_ALLOWANCE_S = 30.0  # the first batch of a configuration never measured before (start-up included)
STALL_S = 10.0  # between batches, at least (else 10x the slowest gap seen in the run)
RUN_OVERHEAD_S = 0.2  # fork, pipe, teardown of a candidate with no workers (measured here: 0.15-0.25 s)
PER_WORKER_OVERHEAD_S = 0.04  # each worker's start and join beyond its first batch


class Search:
    def __init__(
        self,
        loader: Any,
        facts: LoaderFacts,
        *,
        budget_s: float,
        step_s: float | None,
        max_workers: int | None,
        memory_budget: int | None,
        stall_s: float | None,
        iterable_ok: bool,
        progress: Callable[[str, float], None] | None,
        playbooks: Any,
    ) -> None:
        self.loader = loader
        self.facts = facts
        self.budget_s = budget_s
        self.step_s = step_s
        self.stall_s = stall_s
        self.iterable_ok = iterable_ok
        self.progress = progress
        self.playbooks = playbooks
        self.start = time.monotonic()
        self.deadline = self.start + budget_s
        self.window = min(MAX_WINDOW_S, max(MIN_WINDOW_S, budget_s / WINDOW_DIVISOR))
        # before any candidate: may a fork use torch's intra-op threads (forkprobe: else it may hang)?
        self.intra_op_threads = None if forkprobe.fork_can_use_intra_op_threads() else 1
        self.probe = SystemProbe(os.getpid())
        self.machine: Machine = read_machine(self.probe.sample(), memory_budget)
        self.max_workers = max_workers if max_workers is not None else default_max_workers(self.machine.usable_cpus)
        self.records: dict[Config, list[RunRecord]] = {}
        self.skipped: dict[Config, str] = {}
        self.order: list[Config] = []
        self.restricted: iterable.Verdict | None = None
        self.interrupted = False
        self.notes: list[str] = [forkprobe.NOTE] if self.intra_op_threads is not None else []
        # a temp directory too long for the socket a worker needs to send a batch: every candidate with
        # workers would wait for its first batch until stopped (af-unix-path-too-long); not run
        self.socket_blocked = _socket_blocked(facts)  # the result's first reason when set
        self.tmp = tempfile.mkdtemp(prefix="dlwatch-tune-")
        self.runs = 0
        self.base = Config.make(
            0, facts.current.prefetch_factor or DEFAULT_PREFETCH, False, facts.current.pin_memory
        )  # the climb's shape: the loader's prefetch_factor and pin_memory

    # ------------------------------------------------------------------ bookkeeping

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def row(self, cfg: Config) -> Row:
        return pool(cfg, self.records.get(cfg, []), self.machine, self.facts.batch_size, self.skipped.get(cfg))

    def rows(self) -> list[Row]:
        return [self.row(c) for c in self.order]

    def _note_cfg(self, cfg: Config) -> None:
        if cfg not in self.order:
            self.order.append(cfg)

    def skip(self, cfg: Config, why: str) -> None:
        self._note_cfg(cfg)
        if cfg not in self.records:
            self.skipped[cfg] = why

    def _measured(self) -> list[RunRecord]:
        return [r for runs in self.records.values() for r in runs]

    def est_first_s(self, n: int) -> float:
        """A fresh iterator's first batch with n workers, from those measured (start-up grows with workers)."""
        below: list[float] = []
        above: list[float] = []
        for r in self._measured():
            if r.first_batch_s is None:
                continue
            m = r.config.num_workers
            if m == 0:
                est = r.first_batch_s + 0.05 * n
            else:
                est = r.first_batch_s * max(1.0, n / m)
            (below if m <= n else above).append(est)
        if below:
            return max(below)
        return min(above) if above else 0.5

    def est_rate(self, n: int) -> float | None:
        """Batches per second expected with n workers: measured, else the nearest fewer workers' (a floor)."""
        rates: dict[int, float] = {}
        for c in self.records:
            r = self.row(c).batches_per_s
            if r:
                rates[c.num_workers] = max(rates.get(c.num_workers, 0.0), r)
        if n in rates:
            return rates[n]
        lower = [m for m in rates if m < n]
        if lower:
            return rates[max(lower)]
        higher = [m for m in rates if m > n]
        return rates[min(higher)] if higher else None

    def est_cost(self, cfg: Config, resets: int = 0) -> float:
        """Seconds one run of cfg should take: start-up, the first burst, the window, the re-iterations."""
        n = cfg.num_workers
        burst = max(1, n) / (self.est_rate(n) or 20.0)
        steady = min(3 * self.window, max(self.window, 3 * burst))
        return (
            RUN_OVERHEAD_S
            + PER_WORKER_OVERHEAD_S * n
            + self.est_first_s(n)
            + burst
            + steady
            + resets * (3 * burst + 0.1)
        )

    # ------------------------------------------------------------------ one run

    def measure(
        self,
        cfg: Config,
        phase: str,
        *,
        reserve: float | Callable[[], float] = 0.0,
        resets: int = 0,
        fingerprints: int = 0,
        same_seed: bool = False,
        device: str | None = None,
        force: bool = False,
    ) -> RunRecord | None:
        """One run of ``cfg``; None (and a skipped row) when it would not fit the time left."""
        self._note_cfg(cfg)
        cost = self.est_cost(cfg, resets)
        keep = reserve() if callable(reserve) else reserve
        if not force and cost > self.left() - keep:
            self.skip(cfg, f"not run: about {cost:.1f} s, {max(0.0, self.left()):.1f} s of the budget left")
            return None
        now = time.monotonic()
        stop_at = min(self.deadline, now + max(4 * cost, 3.0))
        plan = Plan(
            config=cfg,
            window_s=self.window,
            max_window_s=3 * self.window,
            stop_at=stop_at,
            budget_end=self.deadline,
            resets=resets,
            fingerprints=fingerprints,
            same_seed=same_seed,
            device=device,
            intra_op_threads=self.intra_op_threads,
        )
        est_first = self.est_first_s(cfg.num_workers)
        first_allowance = max(self.stall_s or FIRST_ALLOWANCE_S, 4 * est_first)
        if not self.records:  # the loader's own configuration: its start-up is what it is
            first_allowance = max(first_allowance, self.left())
        if self.progress is not None:
            self.progress(f"{cfg.label()} ({phase})", self.left())
        self.runs += 1
        run = CandidateRun(
            self.loader,
            plan,
            phase=phase,
            machine=self.machine,
            probe=self.probe,
            first_allowance_s=first_allowance,
            stall_s=self.stall_s or STALL_S,
            err_path=os.path.join(self.tmp, f"run{self.runs}.stderr"),
            playbooks=self.playbooks,
        )
        try:
            record = run.run()
        finally:
            if run.rec.leftovers:
                self.notes.extend(f"{cfg.label()}: left behind: {x}" for x in run.rec.leftovers)
        self.records.setdefault(cfg, []).append(record)
        self.skipped.pop(cfg, None)
        return record

    # ------------------------------------------------------------------ the plan

    def run(self) -> TuneResult:
        try:
            self._plan()
        except KeyboardInterrupt:
            self.interrupted = True
            self.notes.append("interrupted (Ctrl-C): the rows and the recommendation are what was measured by then")
        finally:
            self.probe.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
        return self.result()

    def allowed(self, n: int) -> bool:
        if self.socket_blocked is not None and n > 0:
            return False
        return n <= 1 if self.restricted is not None else True

    def _plan(self) -> None:
        from dlwatch.tuning import phases

        cur = self.facts.current
        if self.socket_blocked is not None and cur.num_workers > 0:
            self.skip(cur, "not run: " + self.socket_blocked)
        else:
            self.measure(cur, "current", resets=2 if cur.persistent_workers else 0, force=True)
        if self.facts.iterable and not self.iterable_ok:
            phases.iterable_rule(self)
        phases.climb(self, self.reserve)
        phases.bisect_down(self, self.reserve)
        phases.bisect_up(self, self.reserve)
        phases.prefetch(self, self.reserve)
        phases.repeats(self, self.reserve)
        phases.persistent(self)  # last: at what the repeats settled on (its time was kept aside)
        phases.pin_memory(self)

    def reserve(self) -> float:
        """Time kept for the persistent measurement of the configuration chosen so far."""
        chosen = self.chosen()
        if chosen is None or chosen.num_workers == 0:
            return 0.0
        return self.est_cost(Config.make(chosen.num_workers, chosen.prefetch_factor, True), resets=2)

    def allowed_rows(self) -> list[Row]:
        return [r for r in self.rows() if self.allowed(r.config.num_workers)]

    def chosen(self) -> Config | None:
        """What would be recommended from what is measured so far."""
        r = rec.recommend(
            self.allowed_rows(),
            self.facts.current,
            step_s=self.step_s,
            usable_cpus=self.machine.usable_cpus,
            memory_room=self.machine.memory_room[0],
        )
        return r.config

    # ------------------------------------------------------------------ the result

    def result(self) -> TuneResult:
        from dlwatch.tuning.assemble import assemble

        return assemble(self)


def _socket_blocked(facts: LoaderFacts) -> str | None:
    """Why workers cannot send a batch here (the socket they need is too long for Linux), or None."""
    try:
        import sys

        from dlwatch.inproc import sockpath

        tmp = sys.modules.get("torch.multiprocessing")
        strategy = tmp.get_sharing_strategy() if tmp is not None else None
        found = sockpath.check(2, strategy, facts.start_method)
    except Exception:
        return None
    if found is None:
        return None
    return (
        f"workers cannot send a batch here: the socket {found['socket']} binds under {found['base']!r} "
        f"has a {found['path_len']}-byte path, Linux allows {found['path_max']} "
        f"(`dlwatch playbooks {sockpath.PLAYBOOK}`); set TMPDIR to a short directory and tune again"
    )
