"""The plan's steps, in the order the search takes them, each within the time the budget leaves.

1. The loader's own configuration (``Search._plan``: the reference every row is compared with).
2. ``iterable_rule``: an IterableDataset with no workers and two, its samples fingerprinted.
3. ``climb``: ``num_workers`` up the ladder 0, 1, 2, 4, 8, ... ``max_workers`` (``space.ladder``),
   stopped after ``PATIENCE`` rungs in a row from 2 on that do not beat the best with fewer
   workers by ``CLIMB_GAIN`` (one noisy window does not end it), at a failure, where the next
   rung's projected memory, /dev/shm or descriptors would not fit (then the most workers that
   would is tried instead), or where its projected time does not fit what is left; with a step
   time, at the first rung that keeps the consumer fed.
4. ``bisect_down``: between the rungs around the knee, the fewest workers within ``TOL`` of the
   best (or the fewest that keep the consumer fed).
5. ``bisect_up``: where the best is the most workers that finished, between it and the first
   count that failed, broke a limit or was projected not to fit.
6. ``prefetch``: ``prefetch_factor`` twice and half as deep at the chosen count.
7. ``repeats``: the leading candidates again (one lucky window is not trusted; the machine may be
   shared), a third round (``REPEATS``) only where the second moved the choice.
8. ``persistent``: the epoch start that ``persistent_workers`` saves at the configuration chosen
   after the repeats (its time is kept aside by every step before).
9. ``pin_memory``: on a CUDA host both settings with every batch copied to the GPU; elsewhere a
   row that says why it is skipped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from dlwatch.report.display import human_bytes
from dlwatch.tuning import iterable, recommend as rec
from dlwatch.tuning.limits import FIT_SHARE
from dlwatch.tuning.space import DEFAULT_PREFETCH, Config, ladder

if TYPE_CHECKING:
    from dlwatch.tuning.result import Row
    from dlwatch.tuning.search import Search

PATIENCE = 2  # rungs in a row without a gain that end the climb
REPEATS = 3  # runs of each leading candidate, at most


def iterable_rule(s: Search) -> None:
    one_cfg = s.base.with_workers(0)
    two_cfg = s.base.with_workers(2)
    one = s.measure(one_cfg, "iterable probe", fingerprints=iterable.PROBE_BATCHES, force=True)
    two = s.measure(two_cfg, "iterable probe", fingerprints=iterable.PROBE_BATCHES, force=True)
    current = s.facts.current.num_workers
    if one is None or two is None or not one.fingerprints or not two.fingerprints:
        s.restricted = iterable.Verdict(
            True,
            f"{s.facts.dataset}: the IterableDataset could not be fingerprinted with 0 and 2 workers "
            "(a probe failed): the search keeps to num_workers 0 and 1",
            None,
            None,
            False,
        )
        return
    verdict = iterable.judge(s.facts.dataset, one.fingerprints, two.fingerprints, seeded=False, current_workers=current)
    if verdict is None:
        seeded = s.measure(two_cfg, "iterable probe", fingerprints=iterable.PROBE_BATCHES, same_seed=True, force=True)
        if seeded is not None and seeded.fingerprints:
            verdict = iterable.judge(
                s.facts.dataset, one.fingerprints, seeded.fingerprints, seeded=True, current_workers=current
            )
    s.restricted = verdict


def fits_projection(s: Search, n: int) -> str | None:
    """Why n workers would not fit the machine, projected from the most workers measured; else None."""
    done = [(c.num_workers, s.row(c)) for c in s.records if c.num_workers > 0]
    done = [(m, r) for m, r in done if r.status == "ok" and not r.limits]
    if not done:
        return None
    m, r = max(done, key=lambda t: t[0])
    if n <= m:
        return None
    scale = n / m
    room, source = s.machine.memory_room
    if room and r.mem_peak and r.mem_peak * scale > FIT_SHARE * room:
        return (
            f"would not fit: {n} workers would hold about {human_bytes(r.mem_peak * scale)} "
            f"({m} held {human_bytes(r.mem_peak)}) of the {human_bytes(room)} {source} allows"
        )
    free = s.machine.shm_free
    if free and r.shm_peak and r.shm_peak * scale > FIT_SHARE * free:
        return f"would not fit: about {human_bytes(r.shm_peak * scale)} of /dev/shm ({human_bytes(free)} free)"
    limit = r.fd_limit or s.machine.fd_limit
    if limit and r.fds_peak and r.fds_peak * scale > FIT_SHARE * limit:
        return f"would not fit: about {int(r.fds_peak * scale)} open descriptors (limit {limit})"
    return None


def _best_rate(s: Search, below: int) -> float:
    """The best throughput measured with fewer than ``below`` workers (the climb's own progress)."""
    view = rec.throughput_view(s.allowed_rows())
    return max((r.batches_per_s or 0.0 for r in view if r.config.num_workers < below), default=0.0)


def _rung(s: Search, n: int) -> Config:
    cfg = s.base.with_workers(n)
    if cfg.key() == s.facts.current.key() and s.row(s.facts.current).status == "ok":
        return s.facts.current
    return cfg


def climb(s: Search, reserve: Callable[[], float]) -> None:
    rungs = [n for n in ladder(s.machine.usable_cpus, s.max_workers) if s.allowed(n)]
    flat = 0
    for n in rungs:
        cfg = _rung(s, n)
        before = _best_rate(s, below=n)
        if cfg not in s.records:
            why = fits_projection(s, n)
            if why is not None:
                s.skip(cfg, why)
                _most_that_fit(s, n, reserve)
                return
            if s.measure(cfg, "climb", reserve=reserve) is None:
                return
        row = s.row(cfg)
        if row.status != "ok" or row.limits:
            return  # a failure or a broken limit only gets worse with more workers (bisect_up looks between)
        if s.step_s and rec.is_fed(row, s.step_s):
            return
        if n >= 2 and (row.batches_per_s or 0.0) < before * rec.CLIMB_GAIN:
            flat += 1
            if flat >= PATIENCE:
                return
        else:
            flat = 0


def _most_that_fit(s: Search, n: int, reserve: Callable[[], float]) -> None:
    """The most workers below n that the projection lets through, measured (once)."""
    measured = max((c.num_workers for c in s.records), default=0)
    for m in range(n - 1, measured, -1):
        if s.allowed(m) and fits_projection(s, m) is None:
            cfg = _rung(s, m)
            if cfg not in s.records:
                s.measure(cfg, "climb", reserve=reserve)
            return


def _target(s: Search) -> set[int]:
    """Worker counts that are good enough: fed (with a step time) or within TOL of the best."""
    view = rec.throughput_view(s.allowed_rows())
    if not view:
        return set()
    if s.step_s:
        fed = {r.config.num_workers for r in view if rec.is_fed(r, s.step_s)}
        if fed:
            return fed
    floor = rec.near_floor(max(view, key=lambda r: r.batches_per_s or 0.0))
    return {r.config.num_workers for r in view if (r.batches_per_s or 0.0) >= floor}


def _ok_counts(s: Search) -> set[int]:
    return {c.num_workers for c in s.records if s.row(c).eligible}


def bisect_down(s: Search, reserve: Callable[[], float]) -> None:
    while True:
        good = _target(s)
        if not good:
            return
        c = min(good)
        lower = [m for m in _ok_counts(s) if m < c]
        if not lower:
            return
        low = max(lower)
        if c - low < 2:
            return
        mid = (low + c) // 2
        cfg = s.base.with_workers(mid)
        if cfg in s.records or not s.allowed(mid) or s.measure(cfg, "bisect", reserve=reserve) is None:
            return


def _ceiling(s: Search) -> int | None:
    """The fewest workers measured (or projected) not to work: failed, over a limit, or not fitting."""
    bad = [c.num_workers for c in s.records if not s.row(c).eligible and s.row(c).status != "stopped"]
    bad += [c.num_workers for c, why in s.skipped.items() if why.startswith("would not fit")]
    return min(bad) if bad else None


def bisect_up(s: Search, reserve: Callable[[], float]) -> None:
    """Where the best is the most workers that worked, look between it and the first count that did not."""
    while True:
        top = _ceiling(s)
        ok = _ok_counts(s)
        good = _target(s)
        if top is None or not ok or not good or max(good) != max(ok):
            return
        low = max(ok)
        if top - low < 2:
            return
        mid = (low + top) // 2
        cfg = s.base.with_workers(mid)
        if cfg in s.records or not s.allowed(mid):
            return
        why = fits_projection(s, mid)
        if why is not None:
            s.skip(cfg, why)
            return
        if s.measure(cfg, "bisect", reserve=reserve) is None:
            return


def persistent(s: Search) -> None:
    chosen = s.chosen()
    if chosen is None or chosen.num_workers == 0:
        return
    cfg = Config.make(chosen.num_workers, chosen.prefetch_factor, True, chosen.pin_memory)
    if cfg not in s.records:
        s.measure(cfg, "persistent", resets=2)


def prefetch(s: Search, reserve: Callable[[], float]) -> None:
    chosen = s.chosen()
    if chosen is None or chosen.num_workers == 0:
        return
    pf = chosen.prefetch_factor or DEFAULT_PREFETCH
    base = s.row(Config.make(chosen.num_workers, pf, False, chosen.pin_memory))
    for alt in (pf * 2, max(1, pf // 2)):
        if alt == pf:
            continue
        cfg = Config.make(chosen.num_workers, alt, False, chosen.pin_memory)
        if cfg in s.records:
            continue
        free = s.machine.shm_free
        if alt > pf and free and base.shm_peak and base.shm_peak * alt / pf > FIT_SHARE * free:
            s.skip(
                cfg,
                f"would not fit: about {human_bytes(base.shm_peak * alt / pf)} of /dev/shm ({human_bytes(free)} free)",
            )
            continue
        s.measure(cfg, "prefetch", reserve=reserve)


def repeats(s: Search, reserve: Callable[[], float]) -> None:
    """The three leading candidates (and the chosen one) again, round by round, up to REPEATS runs each.
    A second run of each always (one lucky window is not trusted); a further round only while the last
    one moved the choice (a choice that two windows of each leader agree on is settled: more rounds
    would spend the budget confirming it)."""
    chosen = s.chosen()
    for runs in range(2, REPEATS + 1):
        view = rec.throughput_view(s.allowed_rows())
        lead: list[Row] = sorted(view, key=lambda r: -(r.batches_per_s or 0.0))[:3]
        want = [r.config for r in lead]
        if chosen is not None:
            want += [c for c in s.records if c.key() == chosen.key() and not c.persistent_workers]
        for cfg in dict.fromkeys(want):
            if len(s.records.get(cfg, [])) < runs and s.measure(cfg, "repeat", reserve=reserve) is None:
                return
        settled = s.chosen()
        if settled == chosen:
            return
        chosen = settled


def pin_memory(s: Search) -> None:
    chosen = s.chosen() or s.facts.current
    if not s.machine.cuda_available:
        s.skip(
            Config.make(chosen.num_workers, chosen.prefetch_factor, False, True),
            "no CUDA device here (torch.cuda.is_available() is False): pin_memory only speeds up copies to a GPU",
        )
        return
    same = Config.make(chosen.num_workers, chosen.prefetch_factor, False, chosen.pin_memory)
    flip = Config.make(chosen.num_workers, chosen.prefetch_factor, False, not chosen.pin_memory)
    for cfg in (same, flip):
        if s.measure(cfg, "pin_memory", device="cuda") is None:
            return
