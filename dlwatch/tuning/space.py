"""What a tune varies and what it keeps: the candidate configuration and the loader's fixed parts.

Only ``num_workers``, ``prefetch_factor``, ``persistent_workers`` and ``pin_memory`` are ever
varied: none of them changes a batch's contents or the order of the batches.  Everything else
(dataset, sampler or batch sampler, batch size, collate_fn, worker_init_fn, drop_last,
generator, start method, timeout, in_order) is the loader's own.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

DEFAULT_PREFETCH = 2  # torch's prefetch_factor when num_workers > 0 and none is given


@dataclass(frozen=True, order=True)
class Config:
    """One candidate: the four DataLoader keywords a tune may change."""

    num_workers: int
    prefetch_factor: int | None = DEFAULT_PREFETCH  # None with num_workers=0 (torch refuses one then)
    persistent_workers: bool = False
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.num_workers == 0 and (self.prefetch_factor is not None or self.persistent_workers):
            object.__setattr__(self, "prefetch_factor", None)
            object.__setattr__(self, "persistent_workers", False)

    @classmethod
    def make(
        cls, num_workers: int, prefetch_factor: int | None = None, persistent: bool = False, pin: bool = False
    ) -> "Config":
        pf = None if num_workers == 0 else (prefetch_factor or DEFAULT_PREFETCH)
        return cls(num_workers, pf, bool(persistent and num_workers > 0), bool(pin))

    def with_workers(self, n: int) -> "Config":
        return Config.make(n, self.prefetch_factor, self.persistent_workers, self.pin_memory)

    def kwargs(self) -> dict[str, Any]:
        """The DataLoader keywords of this candidate (prefetch_factor only where torch takes one)."""
        out: dict[str, Any] = {"num_workers": self.num_workers}
        if self.num_workers > 0:
            out["prefetch_factor"] = self.prefetch_factor
            out["persistent_workers"] = self.persistent_workers
        out["pin_memory"] = self.pin_memory
        return out

    def label(self) -> str:
        if self.num_workers == 0:
            text = "num_workers=0"
        else:
            text = f"num_workers={self.num_workers} prefetch_factor={self.prefetch_factor}"
            if self.persistent_workers:
                text += " persistent_workers=True"
        if self.pin_memory:
            text += " pin_memory=True"
        return text

    def key(self) -> tuple[int, int | None, bool]:
        """Throughput's key: persistent_workers changes an epoch's start, not its steady batches."""
        return (self.num_workers, self.prefetch_factor, self.pin_memory)

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_workers": self.num_workers,
            "prefetch_factor": self.prefetch_factor,
            "persistent_workers": self.persistent_workers,
            "pin_memory": self.pin_memory,
        }


def changed_kwargs(current: Config, chosen: Config) -> dict[str, Any]:
    """The keywords to change in the user's DataLoader(...) call to get ``chosen``: only those that differ.

    Going to ``num_workers=0`` also drops ``prefetch_factor`` and ``persistent_workers`` where the
    loader set them (torch raises ValueError for either with no workers); going from 0 to workers
    compares against torch's defaults (prefetch_factor 2, not persistent)."""
    out: dict[str, Any] = {}
    if chosen.num_workers != current.num_workers:
        out["num_workers"] = chosen.num_workers
    if chosen.num_workers == 0:
        if current.num_workers > 0 and current.prefetch_factor not in (None, DEFAULT_PREFETCH):
            out["prefetch_factor"] = None
        if current.persistent_workers:
            out["persistent_workers"] = False
    else:
        have_pf = current.prefetch_factor if current.num_workers > 0 else DEFAULT_PREFETCH
        if chosen.prefetch_factor != have_pf:
            out["prefetch_factor"] = chosen.prefetch_factor
        have_persistent = current.persistent_workers if current.num_workers > 0 else False
        if chosen.persistent_workers != have_persistent:
            out["persistent_workers"] = chosen.persistent_workers
    if chosen.pin_memory != current.pin_memory:
        out["pin_memory"] = chosen.pin_memory
    return out


def ladder(usable_cpus: float | None, max_workers: int) -> list[int]:
    """The worker counts a climb visits, in order: 0, 1, 2, 4, 8, ..., ``max_workers``, and the usable CPUs.

    Doubling reaches well past the CPUs in a few steps (an I/O-latency-bound dataset wants more
    workers than cores); bisection later finds the knee between two rungs."""
    rungs = {0, 1, max_workers}  # the most it may try is a rung too (16 is not on a climb to 12)
    n = 2
    while n <= max_workers:
        rungs.add(n)
        n *= 2
    if usable_cpus:
        cpus = int(usable_cpus)
        for extra in (cpus, cpus - 1):
            if 1 <= extra <= max_workers:
                rungs.add(extra)
    return sorted(r for r in rungs if r <= max_workers)


def default_max_workers(usable_cpus: float | None) -> int:
    """Far enough past the CPUs for an I/O-bound dataset (8x, at least 16), never more than 64."""
    cpus = int(usable_cpus or 1)
    return max(16, min(64, 8 * cpus))


@dataclass(frozen=True)
class LoaderFacts:
    """What the tune reads of the user's loader (attributes only: none of the user's code runs)."""

    current: Config
    batch_size: int | None
    dataset: str  # qualified class name
    sampler: str | None
    iterable: bool  # an IterableDataset: num_workers changes what it yields unless it shards
    start_method: str | None  # the loader's multiprocessing context, or the process default
    loader_class: str
    timeout: float

    def to_dict(self) -> dict[str, Any]:
        return {
            "class": self.loader_class,
            "dataset": self.dataset,
            "sampler": self.sampler,
            "batch_size": self.batch_size,
            "iterable": self.iterable,
            "multiprocessing_context": self.start_method,
            "timeout": self.timeout,
            **self.current.to_dict(),
        }


def _qualname(obj: Any) -> str:
    t = obj if isinstance(obj, type) else type(obj)
    return f"{getattr(t, '__module__', '?')}.{getattr(t, '__qualname__', t.__name__)}"


def start_method_of(loader: Any) -> str | None:
    ctx = getattr(loader, "multiprocessing_context", None)
    if isinstance(ctx, str):
        return ctx
    if ctx is not None:
        try:
            return str(ctx.get_start_method())
        except Exception:
            return None
    import multiprocessing

    method = multiprocessing.get_start_method(allow_none=True)  # never fixes the process's default
    if method:
        return method
    if sys.platform == "linux":
        return "forkserver" if sys.version_info >= (3, 14) else "fork"
    return "spawn"


def read_loader(loader: Any) -> LoaderFacts:
    """The loader's facts; TypeError for something that is not a torch DataLoader."""
    data = sys.modules.get("torch.utils.data")
    if data is None or not isinstance(loader, data.DataLoader):
        raise TypeError(f"dlwatch.tune: expected a torch.utils.data.DataLoader, got {type(loader).__name__}")
    nw = int(loader.num_workers)
    current = Config.make(
        nw,
        loader.prefetch_factor if nw > 0 else None,
        bool(loader.persistent_workers),
        bool(loader.pin_memory),
    )
    # prefetch_factor exactly as the loader holds it (Config.make would turn an explicit value into itself)
    current = replace(current, prefetch_factor=loader.prefetch_factor if nw > 0 else None)
    return LoaderFacts(
        current=current,
        batch_size=loader.batch_size,
        dataset=_qualname(loader.dataset),
        sampler=_qualname(loader.sampler) if getattr(loader, "sampler", None) is not None else None,
        iterable=isinstance(loader.dataset, data.IterableDataset),
        start_method=start_method_of(loader),
        loader_class=_qualname(loader),
        timeout=float(loader.timeout or 0),
    )
