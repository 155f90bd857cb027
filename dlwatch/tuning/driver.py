"""What runs inside a candidate's process: build the candidate loader, time it, report over a pipe.

The process is a fork of the tuning process (see ``guard``), so the loader's dataset, sampler,
generator, collate_fn and worker_init_fn here are copies: iterating them draws from and
advances only the copies.  The candidate is a plain ``torch.utils.data.DataLoader`` over them
with the loader's own batch size, drop_last, start method, timeout and in_order; only the four
keywords of :class:`~dlwatch.tuning.space.Config` differ.  It is iterated with torch's own
``DataLoader.__iter__`` (never a hook a ``dlwatch run`` or ``dlwatch tune`` bootstrap put there).

Messages (tuples, in this order): ``("workers", pids)``, ``("first", seconds)``,
``("fingerprints", rows)`` when asked, ``("beat", batches)`` at most every ``BEAT_S`` while
batches come, ``("steady", figures)``, ``("reset", seconds)`` per re-iteration of a persistent
candidate, then ``("done",)``; or ``("error", type, message, traceback)`` at the first exception.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, Iterator

from dlwatch.tuning.space import Config

BEAT_S = 0.1


@dataclass(frozen=True)
class Plan:
    """What one run of a candidate measures, and until when."""

    config: Config
    window_s: float  # steady seconds wanted
    max_window_s: float  # the steady window ends here even with few batches
    stop_at: float  # time.monotonic() (system-wide): hand back what was measured by then
    budget_end: float = float("inf")  # time.monotonic() when the whole tune's budget ends (stop_at at most)
    resets: int = 0  # re-iterations of a persistent candidate to time (the epoch start it saves)
    fingerprints: int = 0  # batches whose sample fingerprints are sent (the IterableDataset rule)
    same_seed: bool = False  # every worker's random, numpy and torch generators seeded alike
    device: str | None = None  # copy each batch there (pin_memory rows on a CUDA host)
    intra_op_threads: int | None = None  # torch.set_num_threads first (a fork that cannot use them: forkprobe)

    @property
    def warmup(self) -> int:
        """Batches after the first that are not steady: the first burst of every worker's first batch."""
        return max(1, self.config.num_workers)

    @property
    def min_intervals(self) -> int:
        """Four whole bursts at least (eight batches with fewer than two workers)."""
        return max(8, 4 * self.config.num_workers)


class SameSeed:
    """A worker_init_fn that runs the loader's own, then seeds random, numpy and torch alike in every worker.

    Used only by the IterableDataset probe: two workers of an unsharded dataset then yield the
    same samples even where random augmentation would tell their copies apart."""

    def __init__(self, user_fn: Callable[[int], Any] | None) -> None:
        self.user_fn = user_fn

    def __call__(self, worker_id: int) -> None:
        if self.user_fn is not None:
            self.user_fn(worker_id)
        import random

        import torch

        random.seed(0)
        torch.manual_seed(0)
        np = sys.modules.get("numpy")
        if np is not None:
            np.random.seed(0)


def _user_fn(fn: Any) -> Any:
    """The loader's own worker_init_fn or collate_fn, where a ``dlwatch.watch`` block wraps it now."""
    from dlwatch.inproc.worker_hook import CollateHook, WorkerHook

    return fn.user_fn if isinstance(fn, (WorkerHook, CollateHook)) else fn


def build(loader: Any, cfg: Config, *, same_seed: bool = False) -> Any:
    """The candidate: a plain DataLoader over the loader's parts with ``cfg``'s four keywords."""
    from torch.utils.data import DataLoader, IterableDataset

    init = _user_fn(loader.worker_init_fn)
    if same_seed:
        init = SameSeed(init)
    kw: dict[str, Any] = {
        "num_workers": cfg.num_workers,
        "collate_fn": _user_fn(loader.collate_fn),
        "pin_memory": cfg.pin_memory,
        "worker_init_fn": init,
        "generator": loader.generator,
    }
    if cfg.num_workers > 0:
        kw.update(
            prefetch_factor=cfg.prefetch_factor,
            persistent_workers=cfg.persistent_workers,
            multiprocessing_context=loader.multiprocessing_context,
            timeout=loader.timeout,
        )
    if getattr(loader, "pin_memory_device", ""):
        kw["pin_memory_device"] = loader.pin_memory_device
    if hasattr(loader, "in_order"):
        kw["in_order"] = loader.in_order
    if loader.batch_size is None and loader.batch_sampler is not None and loader._auto_collation:
        kw["batch_sampler"] = loader.batch_sampler  # the loader's own batch sampler (a copy, in this process)
    else:
        kw["batch_size"] = loader.batch_size
        kw["drop_last"] = loader.drop_last
        if not isinstance(loader.dataset, IterableDataset):
            kw["sampler"] = loader.sampler
    return DataLoader(loader.dataset, **kw)


def plain_iter(loader: Any) -> Iterator[Any]:
    """``iter(loader)`` through torch's own ``DataLoader.__iter__``, under any hook put on it."""
    from torch.utils.data import DataLoader

    fn = DataLoader.__dict__["__iter__"]
    while hasattr(fn, "__wrapped__"):
        fn = fn.__wrapped__
    return fn(loader)  # type: ignore[no-any-return]


def worker_pids(it: Any) -> list[int]:
    return [w.pid for w in getattr(it, "_workers", ()) or () if getattr(w, "pid", None)]


def _to_device(batch: Any, device: str) -> Any:
    if hasattr(batch, "to") and hasattr(batch, "is_pinned"):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return [_to_device(v, device) for v in batch]
    return batch


class _Runner:
    """One run of the plan; every figure it sends is measured here, in this process."""

    def __init__(self, send: Callable[[Any], None], loader: Any, plan: Plan) -> None:
        self.send = send
        self.plan = plan
        if plan.intra_op_threads is not None:
            import torch

            torch.set_num_threads(plan.intra_op_threads)
        self.candidate = build(loader, plan.config, same_seed=plan.same_seed)
        self._warm_imports()
        self.it: Any = None
        self.batches = 0
        self.last_beat = 0.0
        self.segments: list[list[float]] = []  # steady arrival times, one list per epoch

    def _next(self) -> Any:
        batch = next(self.it)
        if self.plan.device:
            import torch

            _to_device(batch, self.plan.device)
            torch.cuda.synchronize()
        self.batches += 1
        now = time.monotonic()
        if now - self.last_beat >= BEAT_S:
            self.send(("beat", self.batches))
            self.last_beat = now
        return batch

    @staticmethod
    def _warm_imports() -> None:
        """torch imports a profiler module lazily at the first ``next()``: a worker's death signalled during
        that import raises torch's error inside it, where torch's import guard swallows it.  Import it now."""
        try:
            import torch

            with torch.autograd.profiler.record_function("dlwatch-tune-warm-up"):
                pass
        except Exception:
            pass

    def _start_epoch(self) -> tuple[Any, float]:
        t0 = time.monotonic()
        self.it = plain_iter(self.candidate)
        self.send(("workers", worker_pids(self.it)))
        batch = self._next()
        return batch, time.monotonic() - t0

    def run(self) -> None:
        plan = self.plan
        try:
            first, first_s = self._start_epoch()
        except StopIteration:
            self.send(("empty",))
            return
        self.send(("first", first_s))
        if plan.fingerprints:
            self._fingerprints(first)
        self._steady()
        if plan.resets and plan.config.persistent_workers:
            self._resets()

    def _fingerprints(self, first: Any) -> None:
        from dlwatch.tuning.iterable import fingerprint_rows

        rows = [fingerprint_rows(first)]
        while len(rows) < self.plan.fingerprints and time.monotonic() < self.plan.stop_at:
            try:
                rows.append(fingerprint_rows(self._next()))
            except StopIteration:
                break
        self.send(("fingerprints", rows))

    def _steady(self) -> None:
        plan = self.plan
        nw = max(1, plan.config.num_workers)
        seen = 1  # batches of this epoch so far
        seg: list[float] = []
        epochs = 1
        partial = False
        while True:
            try:
                self._next()
            except StopIteration:  # the epoch ended: a new one (its start is not steady time)
                if seg:
                    self.segments.append(seg)
                seg = []
                if self._enough() or time.monotonic() >= plan.stop_at:
                    break
                try:
                    self._start_epoch()
                except StopIteration:
                    break
                epochs += 1
                seen = 1
                continue
            seen += 1
            now = time.monotonic()
            if seen > plan.warmup:  # the last warm-up batch's arrival opens the window
                seg.append(now)
            if now >= plan.stop_at:
                partial = True
                break
            if seg and self._enough(seg, nw):
                break
        if seg:
            self.segments.append(seg)
        intervals = sum(len(s) - 1 for s in self.segments)
        seconds = sum(s[-1] - s[0] for s in self.segments if len(s) > 1)
        begin = self.segments[0][0] if self.segments and self.segments[0] else None
        end = self.segments[-1][-1] if self.segments and self.segments[-1] else None
        self.send(
            (
                "steady",
                {
                    "intervals": intervals,
                    "seconds": seconds,
                    "chunks": _chunk_rates(self.segments, nw),
                    "begin": begin,
                    "end": end,
                    "epochs": epochs,
                    "partial": partial or not self._enough(),
                    "batches": self.batches,
                },
            )
        )

    def _enough(self, current: list[float] | None = None, nw: int = 1) -> bool:
        plan = self.plan
        segs = self.segments + ([current] if current else [])
        intervals = sum(len(s) - 1 for s in segs)
        seconds = sum(s[-1] - s[0] for s in segs if len(s) > 1)
        if intervals < 1:
            return False
        if seconds >= plan.max_window_s:
            return True
        # whole bursts only: with N workers batches come N at a time, and a window cut inside a
        # burst would count up to N-1 batches too many or too few
        return seconds >= plan.window_s and intervals >= plan.min_intervals and intervals % nw == 0

    def _resets(self) -> None:
        """Re-iterate the persistent candidate as an epoch ends: its workers are drained, then reset."""
        plan = self.plan
        seconds = sum(s[-1] - s[0] for s in self.segments if len(s) > 1)
        intervals = sum(len(s) - 1 for s in self.segments)
        per_batch = seconds / intervals if intervals else 0.05
        cfg = plan.config
        drain = min(2.0, per_batch * (cfg.prefetch_factor or 2) * max(1, cfg.num_workers) * 1.5 + 0.05)
        for _ in range(plan.resets):
            if time.monotonic() + drain >= plan.stop_at:
                break
            time.sleep(drain)  # what an epoch's end leaves: every prefetched batch already made
            t0 = time.monotonic()
            self.it = plain_iter(self.candidate)  # torch's persistent path: _reset, no new workers
            try:
                self._next()
            except StopIteration:
                break
            self.send(("reset", time.monotonic() - t0))
            for _ in range(max(1, cfg.num_workers)):
                try:
                    self._next()
                except StopIteration:
                    break

    def close(self) -> None:
        it, self.it = self.it, None
        for obj in (it, getattr(self.candidate, "_iterator", None)):
            shutdown = getattr(obj, "_shutdown_workers", None)
            if shutdown is not None:
                try:
                    shutdown()
                except Exception:
                    pass


CHUNKS = 3  # a run's steady window is cut into this many chunks for its spread
MIN_CHUNK_BURSTS = 2  # each of at least this many whole bursts (N batches with N workers), else none


def _chunk_rates(segments: list[list[float]], nw: int) -> list[float]:
    """Batches per second over consecutive chunks of whole bursts: the spread within one run.

    A chunk shorter than two bursts measures where a burst's batches fell, not the rate (two
    batches a few microseconds apart are "thousands per second"): a window too short for
    CHUNKS such chunks gives one chunk per epoch, and the spread then comes from the repeats."""
    rates: list[float] = []
    smallest = MIN_CHUNK_BURSTS * nw
    for seg in segments:
        n = len(seg) - 1
        if n < smallest:
            continue
        chunks = max(1, min(CHUNKS, n // smallest))
        size = n // chunks // nw * nw
        for start in range(0, size * chunks, size):
            dt = seg[start + size] - seg[start]
            if dt > 0:
                rates.append(size / dt)
    return rates


def main(write_fd: int, loader: Any, plan: Plan) -> None:
    """The candidate process's whole life (after the fork); never returns."""
    from multiprocessing.connection import Connection

    conn = Connection(write_fd, readable=False)
    code = 0
    runner: _Runner | None = None
    try:
        runner = _Runner(conn.send, loader, plan)
        runner.run()
        runner.close()
        conn.send(("done",))
    except BaseException as exc:
        code = 1
        try:
            text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
            conn.send(("error", type(exc).__name__, str(exc)[:4000], text[-8000:]))
        except Exception:
            pass
        if runner is not None:
            runner.close()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except Exception:
            pass
        os._exit(code)
