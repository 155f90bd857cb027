"""The search: which candidates run, in what order, each for how long, within the time budget.

1. The loader's own configuration (the reference every row is compared with).
2. An IterableDataset's rule (``iterable``): no workers and two workers, their samples fingerprinted.
3. A hill climb on ``num_workers`` up the ladder 0, 1, 2, 4, 8, ... (``space.ladder``), stopped
   at the first rung from 2 on that does not beat the best so far by ``CLIMB_GAIN``, at a
   failure, where the next rung's projected memory, /dev/shm or descriptors would not fit,
   or where its projected start-up would not fit the time left; with a step time, at the first
   rung that keeps the consumer fed.
4. Bisection between the rungs around the knee: the fewest workers within ``TOL`` of the best
   (or the fewest that keep the consumer fed).
5. ``prefetch_factor`` deeper and shallower at the chosen worker count.
6. Repeats of the leading candidates (their spread; a lucky single window is not trusted).
7. ``persistent_workers`` at the chosen configuration: the epoch start it saves, measured by
   re-iterating drained persistent workers against a fresh iterator's first batch.
8. ``pin_memory``: on a CUDA host, both settings with every batch copied to the GPU; elsewhere
   a row that says why it is skipped.

Each run's window is ``budget / WINDOW_DIVISOR`` seconds of steady batches (``MIN_WINDOW_S`` to
``MAX_WINDOW_S``); a run whose projected cost does not fit the time left is skipped, and the
persistent measurement has its time kept aside.  Ctrl-C stops the search at once (the running
candidate is stopped and cleaned up) and the result holds what was measured.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from typing import Any, Callable

from dlwatch.collect.system import SystemProbe
from dlwatch.tuning import iterable, recommend as rec
from dlwatch.tuning.driver import Plan
from dlwatch.tuning.guard import CandidateRun, RunRecord
from dlwatch.tuning.limits import FIT_SHARE, Machine, read_machine
from dlwatch.tuning.result import Row, TuneResult, pool
from dlwatch.tuning.space import DEFAULT_PREFETCH, Config, LoaderFacts, default_max_workers, ladder

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
        self.probe = SystemProbe(os.getpid())
        self.machine: Machine = read_machine(self.probe.sample(), memory_budget)
        self.max_workers = max_workers if max_workers is not None else default_max_workers(self.machine.usable_cpus)
        self.records: dict[Config, list[RunRecord]] = {}
        self.skipped: dict[Config, str] = {}
        self.order: list[Config] = []
        self.restricted: iterable.Verdict | None = None
        self.interrupted = False
        self.notes: list[str] = []
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
            resets=resets,
            fingerprints=fingerprints,
            same_seed=same_seed,
            device=device,
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
        return n <= 1 if self.restricted is not None else True

    def _plan(self) -> None:
        cur = self.facts.current
        self.measure(cur, "current", resets=2 if cur.persistent_workers else 0, force=True)
        if self.facts.iterable and not self.iterable_ok:
            self._iterable_rule()
        self._climb(self._reserve)
        self._bisect(self._reserve)
        self._persistent()
        self._prefetch(lambda: 0.0)
        self._repeats(lambda: 0.0)
        self._pin_memory()

    def _reserve(self) -> float:
        """Time kept for the persistent measurement of the configuration chosen so far."""
        chosen = self._chosen()
        if chosen is None or chosen.num_workers == 0:
            return 0.0
        return self.est_cost(Config.make(chosen.num_workers, chosen.prefetch_factor, True), resets=2)

    def _iterable_rule(self) -> None:
        one_cfg = self.base.with_workers(0)
        two_cfg = self.base.with_workers(2)
        one = self.measure(one_cfg, "iterable probe", fingerprints=iterable.PROBE_BATCHES, force=True)
        two = self.measure(two_cfg, "iterable probe", fingerprints=iterable.PROBE_BATCHES, force=True)
        if one is None or two is None or not one.fingerprints or not two.fingerprints:
            self.restricted = iterable.Verdict(
                True,
                f"{self.facts.dataset}: the IterableDataset could not be fingerprinted with 0 and 2 workers "
                "(a probe failed): the search keeps to num_workers 0 and 1",
                None,
                None,
                False,
            )
            return
        verdict = iterable.judge(
            self.facts.dataset, one.fingerprints, two.fingerprints, seeded=False, current_workers=cur_nw(self)
        )
        if verdict is None:
            seeded = self.measure(
                two_cfg, "iterable probe", fingerprints=iterable.PROBE_BATCHES, same_seed=True, force=True
            )
            if seeded is not None and seeded.fingerprints:
                verdict = iterable.judge(
                    self.facts.dataset, one.fingerprints, seeded.fingerprints, seeded=True, current_workers=cur_nw(self)
                )
        self.restricted = verdict

    def _fits_projection(self, n: int) -> str | None:
        """Why n workers would not fit the machine, projected from the most workers measured; else None."""
        done = [(c.num_workers, self.row(c)) for c in self.records if c.num_workers > 0]
        done = [(m, r) for m, r in done if r.status == "ok"]
        if not done:
            return None
        m, r = max(done, key=lambda t: t[0])
        if n <= m:
            return None
        scale = n / m
        room, source = self.machine.memory_room
        if room and r.mem_peak and r.mem_peak * scale > FIT_SHARE * room:
            return (
                f"would not fit: {n} workers would hold about {_gib(r.mem_peak * scale)} "
                f"({m} held {_gib(r.mem_peak)}) of the {_gib(room)} {source} allows"
            )
        if self.machine.shm_free and r.shm_peak and r.shm_peak * scale > FIT_SHARE * self.machine.shm_free:
            return f"would not fit: about {_gib(r.shm_peak * scale)} of /dev/shm ({_gib(self.machine.shm_free)} free)"
        limit = r.fd_limit or self.machine.fd_limit
        if limit and r.fds_peak and r.fds_peak * scale > FIT_SHARE * limit:
            return f"would not fit: about {int(r.fds_peak * scale)} open descriptors (limit {limit})"
        return None

    def _best_rate(self, below: int) -> float:
        """The best throughput measured with fewer than ``below`` workers (the climb's own progress)."""
        view = rec.throughput_view(self._allowed_rows())
        return max((r.batches_per_s or 0.0 for r in view if r.config.num_workers < below), default=0.0)

    def _allowed_rows(self) -> list[Row]:
        return [r for r in self.rows() if self.allowed(r.config.num_workers)]

    def _climb(self, reserve: Callable[[], float]) -> None:
        rungs = [n for n in ladder(self.machine.usable_cpus, self.max_workers) if self.allowed(n)]
        for n in rungs:
            cfg = self.base.with_workers(n)
            if cfg.key() == self.facts.current.key() and self.row(self.facts.current).status == "ok":
                cfg = self.facts.current
            before = self._best_rate(below=n)
            if cfg not in self.records:
                why = self._fits_projection(n)
                if why is not None:
                    self.skip(cfg, why)
                    break
                if self.measure(cfg, "climb", reserve=reserve) is None:
                    break
            row = self.row(cfg)
            if row.status != "ok":
                break  # a failure here (killed, stalled, a limit) only gets worse with more workers
            if self.step_s and rec.is_fed(row, self.step_s):
                break
            if n >= 2 and (row.batches_per_s or 0.0) < before * rec.CLIMB_GAIN:
                break

    def _target(self) -> set[int]:
        """Worker counts that are good enough: fed (with a step time) or within TOL of the best."""
        view = rec.throughput_view(self._allowed_rows())
        if not view:
            return set()
        if self.step_s:
            fed = {r.config.num_workers for r in view if rec.is_fed(r, self.step_s)}
            if fed:
                return fed
        floor = rec.near_floor(max(view, key=lambda r: r.batches_per_s or 0.0))
        return {r.config.num_workers for r in view if (r.batches_per_s or 0.0) >= floor}

    def _bisect(self, reserve: Callable[[], float]) -> None:
        while True:
            good = self._target()
            if not good:
                return
            c = min(good)
            measured = {cfg.num_workers for cfg in self.records if self.row(cfg).status == "ok"}
            lower = [m for m in measured if m < c]
            if not lower:
                return
            low = max(lower)
            if c - low < 2:
                return
            mid = (low + c) // 2
            cfg = self.base.with_workers(mid)
            if cfg in self.records or not self.allowed(mid):
                return
            if self.measure(cfg, "bisect", reserve=reserve) is None:
                return

    def _chosen(self) -> Config | None:
        r = rec.recommend(
            self._allowed_rows(),
            self.facts.current,
            step_s=self.step_s,
            usable_cpus=self.machine.usable_cpus,
            memory_room=self.machine.memory_room[0],
        )
        return r.config

    def _prefetch(self, reserve: Callable[[], float]) -> None:
        chosen = self._chosen()
        if chosen is None or chosen.num_workers == 0:
            return
        pf = chosen.prefetch_factor or DEFAULT_PREFETCH
        for alt in (pf * 2, max(1, pf // 2)):
            if alt == pf:
                continue
            cfg = Config.make(chosen.num_workers, alt, False, chosen.pin_memory)
            if cfg in self.records:
                continue
            if alt > pf and self._fits_projection_prefetch(chosen, alt) is not None:
                self.skip(cfg, self._fits_projection_prefetch(chosen, alt) or "")
                continue
            self.measure(cfg, "prefetch", reserve=reserve)

    def _fits_projection_prefetch(self, chosen: Config, alt: int) -> str | None:
        r = self.row(Config.make(chosen.num_workers, chosen.prefetch_factor, False, chosen.pin_memory))
        free = self.machine.shm_free
        pf = chosen.prefetch_factor or DEFAULT_PREFETCH
        if free and r.shm_peak and r.shm_peak * alt / pf > FIT_SHARE * free:
            return f"would not fit: about {_gib(r.shm_peak * alt / pf)} of /dev/shm ({_gib(free)} free)"
        return None

    def _repeats(self, reserve: Callable[[], float]) -> None:
        view = rec.throughput_view(self._allowed_rows())
        lead = sorted(view, key=lambda r: -(r.batches_per_s or 0.0))[:3]
        chosen = self._chosen()
        want = [r.config for r in lead]
        if chosen is not None:
            want += [c for c in self.records if c.key() == chosen.key() and not c.persistent_workers]
        seen: set[Config] = set()
        for cfg in want:
            if cfg in seen or len(self.records.get(cfg, [])) >= 2:
                continue
            seen.add(cfg)
            if self.measure(cfg, "repeat", reserve=reserve) is None:
                return

    def _persistent(self) -> None:
        chosen = self._chosen()
        if chosen is None or chosen.num_workers == 0:
            return
        cfg = Config.make(chosen.num_workers, chosen.prefetch_factor, True, chosen.pin_memory)
        if cfg in self.records:
            return
        self.measure(cfg, "persistent", resets=2)

    def _pin_memory(self) -> None:
        chosen = self._chosen() or self.facts.current
        flip = Config.make(chosen.num_workers, chosen.prefetch_factor, False, not chosen.pin_memory)
        if not self.machine.cuda_available:
            self.skip(
                Config.make(chosen.num_workers, chosen.prefetch_factor, False, True),
                "no CUDA device here (torch.cuda.is_available() is False): pin_memory only speeds up copies to a GPU",
            )
            return
        same = Config.make(chosen.num_workers, chosen.prefetch_factor, False, chosen.pin_memory)
        for cfg in (same, flip):
            if self.measure(cfg, "pin_memory", device="cuda") is None:
                return

    # ------------------------------------------------------------------ the result

    def result(self) -> TuneResult:
        from dlwatch.tuning.assemble import assemble

        return assemble(self)


def cur_nw(s: Search) -> int:
    return s.facts.current.num_workers


def _gib(n: float) -> str:
    from dlwatch.report.display import human_bytes

    return human_bytes(n)
