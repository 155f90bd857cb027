"""Prototype: a leaner per-batch path for ``agent._TimedIterator``, measured against the current one.

``python bench/hotpath.py``: the fast loader (num_workers=0, batch_size=1) bare, under the
current watch, and under watch with ``_LeanTimedIterator`` patched in, alternating rounds.
The lean version changes three things and keeps the heartbeat format and semantics:

1. the loop body's start is ``t1`` (already read), not a third ``time.monotonic()``;
2. the shape probe is asked once per *checked* batch for the next index it wants
   (closed form of ``BatchShapeProbe.should_check``), not called on every batch;
3. the heartbeat record is packed inline (``pack_into`` on the mmap), not through
   a second Python call to ``HeartbeatWriter.write``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from typing import Any, Iterator

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import dlwatch  # noqa: E402
from dlwatch import agent  # noqa: E402
from dlwatch.heartbeat import MAGIC, STATE_BODY, STATE_OUTSIDE, STATE_WAITING  # noqa: E402

_monotonic = time.monotonic
NEVER = -1


def _next_check(probe: Any, index: int) -> int:
    """The next batch index > index for which probe.should_check is True (NEVER if none)."""
    if probe is None or probe.batch_size is None or probe.found:
        return NEVER
    nxt = index + 1
    if nxt < probe.check_first or probe._pending is not None:
        return nxt
    every = probe.sample_every
    candidates = [-(-nxt // every) * every]
    if probe.num_batches is not None and probe.num_batches - 1 >= nxt:
        candidates.append(probe.num_batches - 1)
    return min(candidates)


class _LeanTimedIterator:
    __slots__ = ("_it", "_next", "_hb", "_pack", "_mm", "_watch", "_probe", "_check_at", "_body_start",
                 "_index", "_done")

    def __init__(self, it: Iterator[Any], hb: Any, watch: Any) -> None:
        self._it = it
        self._next = it.__next__
        self._hb = hb
        self._pack = hb._pack
        self._mm = hb._mm
        self._watch = watch
        self._probe = watch._shape_probe
        self._check_at = 0 if self._probe is not None and self._probe.should_check(0) else _next_check(
            self._probe, 0)
        self._body_start = 0.0
        self._index = 0
        self._done = False

    def __iter__(self) -> "_LeanTimedIterator":
        return self

    def __len__(self) -> int:
        return len(self._it)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        return getattr(self._it, name)

    _WAIT_EDGE_EVERY_BATCH = True

    def __next__(self) -> Any:
        hb = self._hb
        t0 = _monotonic()
        if self._body_start:
            hb.total_step_s += t0 - self._body_start
        hb.ts_wait_start = t0
        seq = hb.seq
        if self._WAIT_EDGE_EVERY_BATCH or not self._index:
            hb.seq = seq = seq + 1
            self._pack(self._mm, 0, MAGIC, seq, hb.batches, hb.epoch_batches, hb.epochs, STATE_WAITING, hb.pid,
                       hb.ts_last_batch, t0, hb.total_wait_s, hb.total_step_s, hb.last_interval_s, seq)
        try:
            batch = self._next()
        except StopIteration:
            self._end()
            raise
        except BaseException as exc:
            self._watch._loader_error = exc
            self._end()
            raise
        t1 = _monotonic()
        hb.total_wait_s += t1 - t0
        if hb.ts_last_batch:
            hb.last_interval_s = t1 - hb.ts_last_batch
        hb.ts_last_batch = t1
        hb.batches = b = hb.batches + 1
        hb.epoch_batches = eb = hb.epoch_batches + 1
        hb.seq = seq = seq + 1
        self._pack(self._mm, 0, MAGIC, seq, b, eb, hb.epochs, STATE_BODY, hb.pid,
                   t1, t0, hb.total_wait_s, hb.total_step_s, hb.last_interval_s, seq)
        i = self._index
        if i == self._check_at:
            self._watch._check_shape(batch, i)
            self._check_at = _next_check(self._probe, i)
        self._index = i + 1
        self._body_start = t1
        return batch

    def _end(self) -> None:
        if not self._done:
            self._done = True
            if self._watch._hb is self._hb:
                self._hb.write(STATE_OUTSIDE)
                self._watch._check_monitor()

    def __del__(self) -> None:
        try:
            self._end()
        except Exception:
            pass


class _OneWriteTimedIterator(_LeanTimedIterator):
    """Lean, and the waiting edge is written only before an epoch's first batch (a semantic change:
    between batches the heartbeat then says in_loop_body while the loop waits for data)."""

    __slots__ = ()
    _WAIT_EDGE_EVERY_BATCH = False


def _check_equivalent() -> None:
    """_next_check agrees with should_check over a few epochs' worth of indices."""
    from dlwatch.shapes import BatchShapeProbe

    for n in (None, 1, 5, 64, 65, 1000):
        p = BatchShapeProbe(1, False, n)
        wanted = [i for i in range(1000) if p.should_check(i)]
        got, i = [], (0 if p.should_check(0) else _next_check(p, 0))
        while i != NEVER and i < 1000:
            got.append(i)
            i = _next_check(p, i)
        assert got == wanted, (n, got[:20], wanted[:20])


def main() -> None:
    from bench.overhead import _epoch, fast_loader

    _check_equivalent()
    n, rounds = 50_000, 15
    current = agent._TimedIterator
    variants = {"current": current, "lean": _LeanTimedIterator, "lean, 1 write": _OneWriteTimedIterator}
    times: dict[str, list[float]] = {"bare": [], **{k: [] for k in variants}}
    with tempfile.TemporaryDirectory() as tmp:
        bare, watched = fast_loader(n), fast_loader(n)
        with dlwatch.watch(watched, report_dir=tmp):
            for r in range(rounds + 1):
                arms = list(times)
                for arm in arms[r % len(arms):] + arms[:r % len(arms)]:
                    agent._TimedIterator = variants.get(arm, current)  # type: ignore[misc]
                    dt, _, _ = _epoch(bare if arm == "bare" else watched)
                    if r:  # round 0 is warm-up
                        times[arm].append(dt)
            agent._TimedIterator = current  # type: ignore[misc]
    b = times["bare"]
    for arm in variants:
        added = statistics.median([(t - x) / n * 1e6 for x, t in zip(b, times[arm])])
        ratio = statistics.median([x / t for x, t in zip(b, times[arm])])
        print(f"{arm:14s} added {added:.2f} µs/batch, throughput ratio {ratio:.3f}")
    print(f"bare           {n / statistics.median(b):,.0f} batches/s; load average {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
