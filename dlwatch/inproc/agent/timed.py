"""The timed iterator: the one piece of dlwatch on the per-batch path (see bench/)."""

from __future__ import annotations

import time
from typing import Any, Iterator

from dlwatch.inproc.agent.sigchld import HeldSigchld, unhide as _unhide
from dlwatch.inproc.proxy import IteratorProxy
from dlwatch.wire import interrupt
from dlwatch.wire.heartbeat import (
    HOT_OFFSET as _HOT_OFFSET,
    STATE_BODY,
    STATE_OFFSET as _STATE_OFFSET,
    STATE_OUTSIDE,
    STATE_WAITING,
    HeartbeatWriter,
)


class _EpochState:
    """The per-epoch state of a _TimedIterator, in an object of its own.

    _TimedIterator defines ``__getattr__`` (attribute fall-through), which makes every
    ``self.x`` in its ``__next__`` take CPython's slow attribute path (~135 ns a batch);
    attributes of this plain slotted object stay on the fast path.
    """

    __slots__ = ("next", "hb", "pack", "mm", "probes", "probe", "check_at", "prev", "base", "done")


class _TimedIterator(IteratorProxy):
    """Wraps one epoch's iterator: times each batch into the heartbeat, and is otherwise the iterator.

    Per batch: two clock reads, a one-byte store (waiting for data) and one pack of the
    heartbeat's small hot part (batch delivered).  The loop-body time is not summed here: the
    monitor derives it from the epoch's span and its waits.  The first batch of an epoch takes
    the cold path (the full record).  Everything else is kept off this path (see bench/).
    """

    __slots__ = ("_s",)

    def __init__(self, it: Iterator[Any], hb: HeartbeatWriter, probes: Any) -> None:
        self._it = it
        s = self._s = _EpochState()
        s.next = it.__next__
        s.hb = hb
        s.pack = hb.HOT.pack_into
        s.mm = hb.mm
        s.probes = probes
        s.probe = probes.shape_probe
        s.base = hb.batches  # batches before this epoch: a batch's index in the epoch is the difference
        # the shape probe's next batch, as a count of batches of the whole run (one comparison per batch)
        # batch 0 is always looked at once (its size in bytes is the shm need, probe or not); after it
        # the shape probe's next batch, as a count of batches of the whole run (one comparison per batch)
        s.check_at = (
            s.base + (s.probe.next_check(0) if s.probe is not None else -1 if probes.batch_bytes_sent else 0) + 1
        )
        s.prev = 0.0  # when the previous batch was handed out: the loop body started
        s.done = False

    def __next__(self) -> Any:
        t0 = _monotonic()
        s = self._s
        prev = s.prev
        if prev:
            s.mm[_STATE_OFFSET] = STATE_WAITING
        else:  # the first wait of an epoch has its own, longer allowance: say when it began
            s.hb.ts_wait_start = t0
            s.hb.write(STATE_WAITING)
        try:
            batch = s.next()
        except StopIteration:
            self._end()
            s.probes.epoch_ended(s.hb.batches - s.base)
            raise
        except BaseException as exc:
            s.probes.loader_error = exc  # so the exception report can say "raised by the DataLoader"
            if isinstance(exc, KeyboardInterrupt):  # before _end: the loop still waits, the workers are there
                s.probes.ctrlc.note(exc, interrupt.WAITING, _monotonic() - t0, not prev)
            self._end()
            _drop_own_entry(exc)
            raise
        t1 = _monotonic()
        s.prev = t1
        hb = s.hb
        if prev:
            hb.batches = n = hb.batches + 1
            hb.total_wait_s = wait = hb.total_wait_s + (t1 - t0)
            s.pack(s.mm, _HOT_OFFSET, STATE_BODY, n, n, t1, wait, t1 - prev, n)  # seq = batches
        else:
            hb.first_batch(t0, t1)
            n = hb.batches
        if n == s.check_at:
            try:
                self._shape_check(batch, n)
            except BaseException as exc:  # torch's exception for a worker that died meanwhile
                _unhide(exc)
                raise
        return batch

    def _shape_check(self, batch: Any, n: int) -> None:
        s = self._s
        index = n - 1 - s.base
        with HeldSigchld():
            s.probes.check_shape(batch, index)
            s.check_at = s.base + (s.probe.next_check(index + 1) if s.probe is not None else -1) + 1

    def _end(self) -> None:
        s = self._s
        if not s.done:
            s.done = True
            if s.probes.hb is s.hb:
                s.hb.write(STATE_OUTSIDE)
                s.probes.session.check_monitor()

    def __del__(self) -> None:
        # A loop left with `break` drops its iterator: the loop is no longer running.  A Ctrl-C in
        # the body drops it too, before the interrupt reaches the block's end: when the body began
        try:
            s = self._s
            if not s.done and s.prev:
                s.probes.ctrlc.dropped = (_monotonic(), s.prev)
            self._end()
        except Exception:
            pass


_monotonic = time.monotonic
_NEXT_CODE = _TimedIterator.__next__.__code__


def _drop_own_entry(exc: BaseException) -> None:
    """Take this wrapper's frame off the traceback of an exception the loader raised.

    The frame is only there because the loop is watched; without it, ``traceback.format_exc()``
    in the program's own ``except`` prints what it prints for the bare loader.  A bare ``raise``
    re-raises with the traceback as set here and adds no entry for this frame again.
    """
    try:
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame.f_code is _NEXT_CODE:
            exc.__traceback__ = tb.tb_next
    except Exception:
        pass
