"""The recommendation: pure, from the measured rows and the step time to a configuration and reasons.

The cheapest configuration that keeps the consumer fed: with a step time ``step_s``, the
fewest workers (then the least memory) whose measured throughput, less its spread, is
``FED_HEADROOM`` times what one step per batch needs (data-wait share near zero).  Without one,
or when none is fed: the highest throughput within ``TOL`` of the best, preferring fewer
workers.  Then ``prefetch_factor`` (deeper only for a measured gain, shallower only where it is
as fast and saves real memory), ``persistent_workers`` (on when it saves a measured epoch start
worth having) and ``pin_memory`` (only where CUDA rows were measured).  A failed row, one that
broke a limit, or one the IterableDataset rule excludes is never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from dlwatch.report.display import human_bytes
from dlwatch.tuning.result import Row
from dlwatch.tuning.space import DEFAULT_PREFETCH, Config

TOL = 0.03  # "within a few percent" of the best throughput
FED_HEADROOM = 1.1  # throughput (less its spread) over what the step needs, to call the consumer fed
CLIMB_GAIN = 1.05  # a rung that does not beat the best so far by this much is the plateau
FED_WAIT_SHARE = 0.02  # with no workers the loop loads each batch itself: fed only when that is tiny
PERSISTENT_MIN_S = 0.2  # an epoch start saved below this is not worth workers kept between epochs
PREFETCH_MIN_SAVED = 64 << 20  # a shallower prefetch must save this much /dev/shm to be worth a change
CPU_BUSY = 0.75  # workers and loop using this share of the usable cores: CPU bound
# workers runnable and waiting for a core this share of their time at least, and longer than they slept:
# CPU bound on CPUs shared with other work (they got less than CPU_BUSY of the cores because others had
# the rest); workers asleep this share of their time, throughput still rising past the cores: I/O latency.
# Between the two no cause is named: beside heavy load I/O-bound workers wait for a core longer than they
# run once woken (measured in CI: 8 workers waited 34%, ran 7%, slept 59%), and CPU-bound workers that
# outnumber what the loop takes sleep with their prefetch full (16 workers waited 31%, ran 20%, slept 49%)
WORKER_WAITING = 0.25
WORKER_ASLEEP = 0.5


@dataclass(frozen=True)
class Recommendation:
    config: Config | None
    why: tuple[str, ...]


def wait_share(row: Row, step_s: float | None) -> float | None:
    """The share of the loop's time it would wait for data at this row's throughput and the step."""
    rate = row.batches_per_s
    if rate is None or rate <= 0 or not step_s:
        return None
    load = 1.0 / rate
    if row.config.num_workers == 0:  # no workers: loading and the step take turns
        return load / (load + step_s)
    wait = max(0.0, load - step_s)
    return wait / (wait + step_s)


def is_fed(row: Row, step_s: float) -> bool:
    rate = row.batches_per_s
    if rate is None or rate <= 0:
        return False
    if row.config.num_workers == 0:
        share = wait_share(row, step_s)
        return share is not None and share <= FED_WAIT_SHARE
    low = rate - (row.batches_per_s_sd or 0.0)
    return low * step_s >= FED_HEADROOM


def _rate(r: Row) -> float:
    return r.batches_per_s or 0.0


def _fmt_rate(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:,.0f}" if x >= 100 else f"{x:.3g}"


def _pct(x: float) -> str:
    return f"{x:+.0%}"


def throughput_view(rows: Sequence[Row]) -> list[Row]:
    """One eligible row per (num_workers, prefetch_factor, pin_memory): the best-measured of each."""
    by_key: dict[tuple[int, int | None, bool], Row] = {}
    for r in rows:
        if not r.eligible:
            continue
        k = r.config.key()
        have = by_key.get(k)
        if have is None or (r.runs, _rate(r)) > (have.runs, _rate(have)):
            by_key[k] = r
    return sorted(by_key.values(), key=lambda r: r.config.key())


def _cheapest(rows: Sequence[Row], current: Config) -> Row:
    return min(
        rows,
        key=lambda r: (
            r.config.num_workers,
            0 if r.config.prefetch_factor == current.prefetch_factor else 1,
            r.mem_peak or 0,
            r.config.prefetch_factor or 0,
        ),
    )


def choose_workers(
    view: Sequence[Row], current: Config, step_s: float | None, usable: float | None = None
) -> tuple[Row | None, str]:
    """The row whose num_workers (and prefetch_factor) the recommendation starts from, and why ('fed', 'best')."""
    if not view:
        return None, "none"
    # num_workers is chosen on the climb's rows (the loader's own prefetch_factor); deeper or shallower
    # prefetching is judged after, at the chosen count, against its noise
    base_pf = current.prefetch_factor if current.num_workers > 0 else DEFAULT_PREFETCH
    climb = [r for r in view if r.config.num_workers == 0 or r.config.prefetch_factor == base_pf]
    view = climb or list(view)
    if step_s:
        fed = [r for r in view if is_fed(r, step_s)]
        if fed:
            return _cheapest(fed, current), "fed"
    top = max(view, key=_rate)
    near = [r for r in view if _rate(r) >= near_floor(top)]
    return _cheapest(near, current), "best"


def near_floor(top: Row) -> float:
    """The throughput that counts as as good as the best: within TOL, or within the best's own spread
    (a lead inside its noise is no lead), never more than 3 x TOL below it."""
    rate = _rate(top)
    floor = rate * (1 - TOL)
    if top.batches_per_s_sd:
        floor = min(floor, rate - top.batches_per_s_sd)
    return max(floor, rate * (1 - 3 * TOL))


def _bound(view: Sequence[Row], chosen: Row, usable: float | None) -> str:
    """What limits the pipeline, in the user's terms, from the throughput against num_workers."""
    same_pf = sorted(
        (
            r
            for r in view
            if chosen.config.num_workers == 0 or r.config.prefetch_factor in (chosen.config.prefetch_factor, None)
        ),
        key=lambda r: r.config.num_workers,
    )
    n = chosen.config.num_workers
    higher = [r for r in same_pf if r.config.num_workers > n]
    nxt = higher[0] if higher else None
    gain = (
        f"; {nxt.config.num_workers} workers: {_pct(_rate(nxt) / _rate(chosen) - 1)}" if nxt and _rate(chosen) else ""
    )
    cores = f"{usable:g} usable core{'s' if usable != 1 else ''}" if usable else "the usable cores"
    if n == 0:
        workers = [r for r in same_pf if r.config.num_workers > 0]
        if workers:
            w = max(workers, key=_rate)
            return (
                f"main-process bound: making a batch costs less than moving it between processes: "
                f"num_workers=0 gives {_fmt_rate(_rate(chosen))} batches/s, {w.config.num_workers} "
                f"worker{'s' if w.config.num_workers != 1 else ''} at most {_fmt_rate(_rate(w))}"
            )
        return f"num_workers=0 gives {_fmt_rate(_rate(chosen))} batches/s"
    cpu = chosen.cpu_cores
    if usable and cpu is not None and cpu >= CPU_BUSY * usable:
        if n > usable:  # measured: a few more workers than cores fill the gaps one leaves while it waits on IPC
            return (
                f"CPU bound: {n} workers keep the {cores} busy ({cpu:g} cores), more than the cores because "
                f"a worker waiting to hand over its batch leaves its core to another{gain}"
            )
        return f"CPU bound: {n} worker{'s' if n != 1 else ''} saturate the {cores} ({cpu:g} cores busy){gain}"
    busy, waiting = chosen.worker_busy_share, chosen.wait_cores
    wait_share = min(1.0, waiting / n) if waiting is not None else None
    asleep = max(0.0, 1 - busy) if busy is not None else None
    ran = max(0.0, busy - wait_share) if busy is not None and wait_share is not None else None
    if wait_share is not None and asleep is not None and wait_share >= max(WORKER_WAITING, asleep):
        got = f"{cpu:g} cores" if cpu is not None else "a part of them"
        return (
            f"CPU bound, on CPUs shared with other work: {n} worker{'s' if n != 1 else ''} waited for a core "
            f"{wait_share:.0%} of the time, ran {ran:.0%} and slept {asleep:.0%}, and got {got} of the {cores}"
            + (
                "; more workers than cores only win a larger share of them from the other work"
                if usable and n > usable
                else ""
            )
            + gain
        )
    if usable and n > usable:
        if asleep is None or asleep >= WORKER_ASLEEP:
            slept = f"; the workers slept {asleep:.0%} of the time" if asleep is not None else ""
            return f"I/O-latency bound: throughput still rises at {n} workers on {cores}{slept}{gain}"
        return (
            f"throughput still rises at {n} workers on {cores}: the workers waited for a core {wait_share:.0%} of "
            f"the time, ran {ran:.0%} and slept {asleep:.0%}{gain}"
        )
    return f"throughput levels off at {n} worker{'s' if n != 1 else ''} ({_fmt_rate(_rate(chosen))} batches/s){gain}"


def recommend(
    rows: Sequence[Row],
    current: Config,
    *,
    step_s: float | None,
    usable_cpus: float | None,
    memory_room: int | None = None,
) -> Recommendation:
    view = throughput_view(rows)
    base, mode = choose_workers(view, current, step_s, usable_cpus)
    why: list[str] = []
    if base is None:
        failed = [r for r in rows if r.status == "failed"]
        why.append("no candidate finished a steady window: nothing to recommend")
        if failed:
            why.append(f"{failed[0].config.label()} failed: {failed[0].reason}")
        return Recommendation(None, tuple(why))
    nw = base.config.num_workers
    if mode == "fed" and step_s:
        need = 1.0 / step_s
        share = wait_share(base, step_s) or 0.0
        why.append(
            f"a {step_s * 1000:g} ms step needs {_fmt_rate(need)} batches/s: {nw} worker{'s' if nw != 1 else ''} "
            f"give {_fmt_rate(base.batches_per_s)} (data wait ~{share:.0%}); the cheapest configuration measured "
            "that keeps the loop fed"
        )
        fewer = [r for r in view if r.config.num_workers < nw]
        if fewer:
            f = max(fewer, key=lambda r: r.config.num_workers)
            fshare = wait_share(f, step_s)
            if fshare is not None:
                why.append(
                    f"{f.config.num_workers} worker{'s' if f.config.num_workers != 1 else ''} would leave the loop "
                    f"waiting for data ~{fshare:.0%} of its time"
                )
    else:
        if step_s:
            top = max(view, key=_rate)
            share = wait_share(top, step_s) or 0.0
            why.append(
                f"no configuration measured keeps a {step_s * 1000:g} ms step fed (it needs "
                f"{_fmt_rate(1.0 / step_s)} batches/s; the best gives {_fmt_rate(top.batches_per_s)}, data wait "
                f"~{share:.0%}): the highest throughput, with the fewest workers within {TOL:.0%}"
            )
        why.append(_bound(view, base, usable_cpus))
    chosen = base
    # prefetch_factor at the chosen num_workers
    if nw > 0:
        same_n = [r for r in view if r.config.num_workers == nw and r.config.pin_memory == base.config.pin_memory]
        deeper = [r for r in same_n if (r.config.prefetch_factor or 0) > (chosen.config.prefetch_factor or 0)]
        # a gain beyond the noise: more than TOL, and still above the base with its spread taken off
        gainful = [
            r
            for r in deeper
            if _rate(r) > _rate(chosen) * (1 + TOL) and _rate(r) - (r.batches_per_s_sd or 0.0) > _rate(chosen)
        ]
        if gainful:
            up = max(gainful, key=_rate)
            why.append(
                f"prefetch_factor={up.config.prefetch_factor} adds {_pct(_rate(up) / _rate(chosen) - 1)} "
                f"over {chosen.config.prefetch_factor}"
            )
            chosen = up
        else:
            shallower = [
                r
                for r in same_n
                if (r.config.prefetch_factor or 0) < (chosen.config.prefetch_factor or 0)
                and _rate(r) >= _rate(chosen) * (1 - TOL)
            ]
            floor = max(PREFETCH_MIN_SAVED, int(0.1 * memory_room) if memory_room else 0)
            for r in sorted(shallower, key=lambda r: r.config.prefetch_factor or 0):
                saved = (chosen.shm_peak or 0) - (r.shm_peak or 0)
                if saved >= floor:
                    why.append(
                        f"prefetch_factor={r.config.prefetch_factor} is as fast and holds {human_bytes(saved)} "
                        "less in /dev/shm"
                    )
                    chosen = r
                    break
    persistent = current.persistent_workers if nw > 0 else False
    if nw > 0:
        persistent, line = _persistent(rows, chosen, current)
        if line:
            why.append(line)
    config = Config.make(nw, chosen.config.prefetch_factor, persistent, chosen.config.pin_memory)
    same = [r for r in rows if r.config == config]
    if same and not all(r.eligible for r in same):  # measured as such and failed or broke a limit: never that
        bad = next(r for r in same if not r.eligible)
        why.append(f"{config.label()} itself {bad.status}{' (' + ', '.join(bad.limits) + ')' if bad.limits else ''}")
        config = chosen.config
    mem = [x for x in (chosen.worker_uss_total, chosen.shm_peak) if x]
    if nw > 0 and mem and memory_room:
        why.append(
            f"{nw} worker{'s' if nw != 1 else ''} hold {human_bytes(chosen.worker_uss_total or 0)} private memory (USS) "
            f"and {human_bytes(chosen.shm_peak or 0)} of /dev/shm at most: within the machine's limits"
        )
    cur = next((r for r in view if r.config.key() == current.key()), None)
    if cur is not None and cur.config.key() != config.key() and _rate(cur) > 0:
        why.append(
            f"{_fmt_rate(_rate(chosen))} batches/s against the current configuration's {_fmt_rate(_rate(cur))} "
            f"({_rate(chosen) / _rate(cur):.2f}x)"
        )
    for r in rows:
        if r.status == "failed":
            why.append(f"{r.config.label()} failed ({r.reason}): never recommended")
    return Recommendation(config, tuple(why))


def _persistent(rows: Sequence[Row], chosen: Row, current: Config) -> tuple[bool, str | None]:
    nw = chosen.config.num_workers
    kept = [
        r
        for r in rows
        if r.config.persistent_workers
        and r.config.num_workers == nw
        and r.config.prefetch_factor == chosen.config.prefetch_factor
        and r.eligible  # kept workers that broke a limit (or failed) are no saving to recommend
        and r.epoch_start_s is not None
        and r.epoch_start_s != r.first_batch_s
    ]
    fresh = [
        r.first_batch_s
        for r in rows
        if r.config.num_workers == nw and not r.config.persistent_workers and r.first_batch_s is not None
    ]
    if not kept or not fresh:
        return current.persistent_workers, None
    start = min(r.epoch_start_s or 0.0 for r in kept)
    fresh_s = sorted(fresh)[len(fresh) // 2]
    saved = fresh_s - start
    per_batch = 1.0 / _rate(chosen) if _rate(chosen) else 0.0
    if saved >= max(PERSISTENT_MIN_S, 3 * per_batch):
        return True, (
            f"persistent_workers saves {saved:.2g} s at each epoch start (a fresh epoch's first batch "
            f"{fresh_s:.2g} s, a persistent one's {start:.2g} s)"
        )
    if current.persistent_workers:
        return True, None
    return False, f"persistent_workers would save only {max(0.0, saved):.2g} s at an epoch start: left off"
