"""``dlwatch.tune(loader, budget_s=60, step_s=None, ...)``: the entry point, its arguments checked."""

from __future__ import annotations

import math
import sys
from typing import Any

from dlwatch.tuning.result import TuneResult
from dlwatch.tuning.space import read_loader


def _seconds(name: str, value: Any, *, minimum: float, allow_none: bool) -> float | None:
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"dlwatch.tune: {name} must be a number of seconds, got {type(value).__name__}")
    if not math.isfinite(value) or value < minimum:
        raise ValueError(f"dlwatch.tune: {name} must be a finite number >= {minimum:g} seconds, got {value!r}")
    return float(value)


def _count(name: str, value: Any, *, minimum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"dlwatch.tune: {name} must be a whole number >= {minimum}, got {value!r}")
    return value


def tune(
    loader: Any,
    budget_s: float = 60.0,
    step_s: float | None = None,
    *,
    max_workers: int | None = None,
    memory_budget: int | None = None,
    stall_s: float | None = None,
    iterable_ok: bool = False,
    progress: bool | None = None,
) -> TuneResult:
    """Measure DataLoader settings on this loader's own dataset and recommend the cheapest that keeps up.

    Candidates are new DataLoaders over the same dataset, sampler (or batch sampler), batch
    size, collate_fn, worker_init_fn, drop_last, generator and start method; only
    ``num_workers``, ``prefetch_factor``, ``persistent_workers`` and ``pin_memory`` (on a CUDA
    host) differ.  Each runs in a forked copy of this process: the loader, its sampler and
    generator, and this process's RNG streams are left exactly as they were, and nothing of a
    candidate (worker, /dev/shm segment) outlives it.

    - ``budget_s``: seconds for the whole tune (at least 2).
    - ``step_s``: the training step's time per batch, if known: the recommendation is then the
      cheapest configuration that keeps such a loop fed.  Without it, the highest throughput
      within a few percent, preferring fewer workers.
    - ``max_workers``: the most workers tried (default 8x the usable CPUs, at least 16, at most 64).
    - ``memory_budget``: bytes the candidates' memory (their processes' USS and /dev/shm) must
      stay within, besides MemAvailable and the cgroup's limit.
    - ``stall_s``: seconds without a batch after which a candidate counts as stalled (default
      adaptive: 10 s or 10x the slowest gap between batches; a first batch 30 s or 4x the start-up
      measured with fewer workers).
    - ``iterable_ok``: an IterableDataset whose workers only generate random data: do not
      restrict ``num_workers`` when its workers' samples differ only by their random seeds.
    - ``progress``: one line on stderr per candidate with the time left (default: when stderr is
      a terminal).

    Returns a :class:`~dlwatch.tuning.result.TuneResult`: ``best`` (the keywords to change),
    ``rows``, ``why``; ``print(result)`` shows the table.  Ctrl-C stops the search: the result
    then holds what was measured (``interrupted`` is True).
    """
    facts = read_loader(loader)
    budget = _seconds("budget_s", budget_s, minimum=2.0, allow_none=False)
    step = _seconds("step_s", step_s, minimum=0.0, allow_none=True) or None
    stall = _seconds("stall_s", stall_s, minimum=0.1, allow_none=True)
    workers = _count("max_workers", max_workers, minimum=1)
    mem = _count("memory_budget", memory_budget, minimum=1)
    if not isinstance(iterable_ok, bool):
        raise TypeError("dlwatch.tune: iterable_ok must be True or False")
    from dlwatch.tuning.render import Progress
    from dlwatch.tuning.search import Search
    from dlwatch.wire.playbooks import load_playbooks

    show = progress if progress is not None else sys.stderr.isatty()
    reporter = Progress(sys.stderr) if show else None
    search = Search(
        loader,
        facts,
        budget_s=budget,  # type: ignore[arg-type]
        step_s=step,
        max_workers=workers,
        memory_budget=mem,
        stall_s=stall,
        iterable_ok=iterable_ok,
        progress=reporter,
        playbooks=load_playbooks(()),
    )
    try:
        return search.run()
    finally:
        if reporter is not None:
            reporter.close()
