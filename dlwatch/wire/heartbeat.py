"""The progress heartbeat: a small mmap'd file the training loop writes and the monitor reads.

The monitor must see progress (or its absence) while the training process holds
the GIL in a deadlock, so the heartbeat is shared memory, not a message.  Per batch
the writer stores one byte (waiting for data) and packs the small hot part of the
record (batch delivered); a reader takes a consistent copy by comparing the
sequence numbers at both ends of each part.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
import time
from dataclasses import dataclass

from dlwatch._fs import create_private

MAGIC = b"DLWHB002"
# Two parts, each guarded by its own sequence number at both ends, so that the hot path packs
# only what changes per batch (the "hot" part, right after the magic) and the rest is written
# only at epoch edges (the "cold" part).  Times are time.monotonic(): CLOCK_MONOTONIC is
# system-wide, so comparable across processes.
#   hot:  state (one byte, so the wait edge is a single-byte store), seq, batches, ts_last_batch,
#         total_wait_s, last_interval_s, seq again.  The hot seq is the batch count: every write
#         that changes a hot field (other than the state byte, which cannot tear) adds a batch.
#   cold: cseq, epochs, epoch_start_batches (batches before this epoch), pid, ts_wait_start (when
#         the epoch's first wait began), ts_first_batch (the epoch's first batch; 0 = none yet),
#         epoch_wait_base_s (total_wait_s right after that batch), closed_step_s (loop-body time of
#         the finished epochs), total_first_wait_s (the first waits of every epoch), cseq again
_HOT = struct.Struct("<B7xQQdddQ")
_COLD = struct.Struct("<QQQI4xdddddQ")
_REC = struct.Struct("<8s" + _HOT.format[1:] + _COLD.format[1:])
STATE_OFFSET = 8
HOT_OFFSET = 8

SIZE = _REC.size

STATE_OUTSIDE = 0  # not iterating (before the first batch, between epochs, after the block)
STATE_WAITING = 1  # inside next(loader): waiting for data
STATE_BODY = 2  # a batch was handed out; the loop body runs
STATE_ENDED = 3  # the watch block ended cleanly
STATE_NAMES = {0: "outside", 1: "waiting_for_data", 2: "in_loop_body", 3: "ended"}


@dataclass(frozen=True)
class Heartbeat:
    batches: int
    epoch_batches: int  # batches handed out in the current epoch
    epochs: int  # epochs started
    state: int
    pid: int
    ts_last_batch: float  # monotonic; 0.0 = no batch yet
    ts_wait_start: float  # monotonic; when the current epoch's first wait for data began
    total_wait_s: float
    total_step_s: float  # time in the loop body between two batches, every epoch so far
    last_interval_s: float  # time between the last two batches
    ts_first_batch: float = 0.0  # monotonic; the current epoch's first batch (0.0 = none yet)
    total_first_wait_s: float = 0.0  # waits for the first batch of each epoch (worker start-up)

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, "unknown")

    @property
    def first_wait_s(self) -> float | None:
        """The current epoch's wait for its first batch; None before it arrived."""
        if self.ts_first_batch <= 0 or self.ts_wait_start <= 0:
            return None
        return max(0.0, self.ts_first_batch - self.ts_wait_start)

    def wait_started(self, body_until: float = 0.0) -> float:
        """When the wait for data going on began (monotonic; 0.0 outside a wait).  The epoch's first
        wait is in the record; a later one began after the last batch and after ``body_until``, the
        last time the loop body was seen (its start is one byte, not a time, to keep the hot path short)."""
        if self.state != STATE_WAITING:
            return 0.0
        if self.epoch_batches == 0:
            return self.ts_wait_start if self.ts_wait_start > 0 else 0.0
        return max(self.ts_last_batch, body_until) if self.ts_last_batch > 0 else 0.0

    def in_progress_s(self, now: float, body_until: float = 0.0) -> tuple[float, float]:
        """(the wait for data, the loop body) going on at monotonic ``now``: seconds the totals
        ``total_wait_s`` and ``total_step_s`` do not hold yet (they count what ended)."""
        if self.state == STATE_BODY and self.ts_last_batch > 0:
            return 0.0, max(0.0, now - self.ts_last_batch)
        since = self.wait_started(body_until)
        return (max(0.0, now - since) if since > 0 else 0.0), 0.0

    def to_dict(self) -> dict[str, object]:
        return {
            "batches": self.batches,
            "epoch_batches": self.epoch_batches,
            "epochs": self.epochs,
            "state": self.state_name,
            "data_wait_s": round(self.total_wait_s, 6),
            "step_s": round(self.total_step_s, 6),
            "last_interval_s": round(self.last_interval_s, 6),
        }

    def progress(self, now: float, body_until: float = 0.0) -> dict[str, object]:
        """An incident's ``progress`` at monotonic ``now``: :meth:`to_dict` with the wait or the loop
        body going on counted in ``data_wait_s`` / ``step_s``, and said apart (``*_in_progress_s``)."""
        wait, body = self.in_progress_s(now, body_until)
        out = self.to_dict()
        out["data_wait_s"] = round(self.total_wait_s + wait, 6)
        out["step_s"] = round(self.total_step_s + body, 6)
        out["data_wait_in_progress_s"] = round(wait, 6)
        out["step_in_progress_s"] = round(body, 6)
        return out


def _allocate(fd: int, size: int) -> None:
    """Give ``fd`` ``size`` bytes of real blocks (posix_fallocate; written zeros where it is unsupported)."""
    try:
        os.posix_fallocate(fd, 0, size)
        return
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
            raise
    except AttributeError:
        pass
    os.ftruncate(fd, 0)
    view = memoryview(bytes(size))
    while view:
        view = view[os.pwrite(fd, view, size - len(view)) :]
    os.fsync(fd)


class HeartbeatWriter:
    """Owned by the training process.  Not thread-safe: one loop writes it.

    The per-batch path (``_TimedIterator.__next__``) packs only the hot part with
    ``HOT.pack_into(mm, HOT_OFFSET, ...)``; everything else goes through :meth:`write`.
    """

    __slots__ = (
        "_mm",
        "_fd",
        "_pack",
        "mm",
        "cseq",
        "batches",
        "epochs",
        "pid",
        "ts_last_batch",
        "ts_wait_start",
        "total_wait_s",
        "last_interval_s",
        "epoch_start_batches",
        "ts_first_batch",
        "epoch_wait_base_s",
        "closed_step_s",
        "total_first_wait_s",
    )

    HOT = _HOT

    def __init__(self, path: str) -> None:
        self._fd = create_private(path, os.O_RDWR)
        try:
            # The file's blocks are allocated now, not at the first store into the mapping: a sparse
            # page that the filesystem cannot back later (another writer took the last free block)
            # kills the training process with SIGBUS.  No space now: OSError, and the run goes unwatched.
            _allocate(self._fd, SIZE)
            self._mm = mmap.mmap(self._fd, SIZE)
        except BaseException:
            os.close(self._fd)
            raise
        self.mm = self._mm  # for the hot path's one-byte state store and hot-part pack
        self._pack = _REC.pack_into
        self.cseq = 0
        self.batches = 0
        self.epochs = 0
        self.pid = os.getpid()
        self.ts_last_batch = 0.0
        self.ts_wait_start = 0.0
        self.total_wait_s = 0.0
        self.last_interval_s = 0.0
        self.epoch_start_batches = 0
        self.ts_first_batch = 0.0
        self.epoch_wait_base_s = 0.0
        self.closed_step_s = 0.0
        self.total_first_wait_s = 0.0
        self.write(STATE_OUTSIDE)

    @property
    def epoch_batches(self) -> int:
        return self.batches - self.epoch_start_batches

    def epoch_step_s(self) -> float:
        """Loop-body time of the current epoch, derived: its span minus its waits after the first batch."""
        if self.ts_first_batch <= 0:
            return 0.0
        return max(0.0, (self.ts_last_batch - self.ts_first_batch) - (self.total_wait_s - self.epoch_wait_base_s))

    def _sync_hot(self) -> None:
        """Take the hot fields back from the mapping: the per-batch path packs them there only."""
        try:
            _state, _seq, batches, ts_last, wait, interval, _seq2 = _HOT.unpack_from(self._mm, HOT_OFFSET)
        except (ValueError, struct.error):
            return
        self.batches, self.ts_last_batch, self.total_wait_s, self.last_interval_s = batches, ts_last, wait, interval

    def batches_now(self) -> int:
        """The run's batches so far (the hot path keeps the count in the mapping only)."""
        self._sync_hot()
        return self.batches

    def begin_epoch(self) -> None:
        """A new epoch's iterator: close the previous epoch's body time (cold path, once per epoch)."""
        self._sync_hot()
        self.closed_step_s += self.epoch_step_s()
        self.epochs += 1
        self.epoch_start_batches = self.batches
        self.ts_first_batch = 0.0

    def first_batch(self, t0: float, t1: float) -> None:
        """The epoch's first batch arrived (waited from t0 to t1): the cold fields change too."""
        self._sync_hot()
        self.batches += 1
        self.total_wait_s += t1 - t0
        self.total_first_wait_s += t1 - t0
        self.ts_last_batch = self.ts_first_batch = t1
        self.epoch_wait_base_s = self.total_wait_s
        self._write(STATE_BODY)

    def write(self, state: int) -> None:
        self._sync_hot()
        self._write(state)

    def _write(self, state: int) -> None:
        seq = self.batches
        self.cseq = cseq = self.cseq + 1
        self._pack(
            self._mm,
            0,
            MAGIC,
            state,
            seq,
            self.batches,
            self.ts_last_batch,
            self.total_wait_s,
            self.last_interval_s,
            seq,
            cseq,
            self.epochs,
            self.epoch_start_batches,
            self.pid,
            self.ts_wait_start,
            self.ts_first_batch,
            self.epoch_wait_base_s,
            self.closed_step_s,
            self.total_first_wait_s,
            cseq,
        )

    def mark(self, state: int) -> None:
        """Only the state byte: one store, no sequence bump (a byte cannot tear)."""
        self._mm[STATE_OFFSET] = state

    def close(self, state: int = STATE_ENDED) -> None:
        # The mapping itself is not closed: an epoch iterator the user still holds after the
        # block may write to it, and must not fail for it.  It goes with its last reference.
        try:
            self.write(state)
        except (ValueError, OSError):
            pass
        try:
            os.close(self._fd)
        except OSError:
            pass


def parse(raw: bytes) -> Heartbeat | None:
    """One record from bytes read elsewhere (e.g. by attach with the target's rights); None if torn."""
    if len(raw) < SIZE:
        return None
    (
        magic,
        state,
        seq,
        batches,
        ts_last,
        wait_s,
        interval_s,
        seq2,
        cseq,
        epochs,
        epoch_start,
        pid,
        ts_wait,
        ts_first,
        wait_base,
        closed_step,
        first_wait_s,
        cseq2,
    ) = _REC.unpack(raw[:SIZE])
    if magic != MAGIC or seq != seq2 or cseq != cseq2:
        return None
    step = closed_step
    if ts_first > 0:
        step += max(0.0, (ts_last - ts_first) - (wait_s - wait_base))
    return Heartbeat(
        batches,
        max(0, batches - epoch_start),
        epochs,
        state,
        pid,
        ts_last,
        ts_wait,
        wait_s,
        step,
        interval_s,
        ts_first,
        first_wait_s,
    )


def _snapshot(fd: int) -> Heartbeat | None:
    """A consistent record read from ``fd`` at offset 0; None if short, foreign or torn on every try."""
    got = _record(fd, None)
    return got[1] if got is not None else None


def _record(fd: int, last: tuple[bytes, Heartbeat] | None) -> tuple[bytes, Heartbeat] | None:
    """:func:`_snapshot` with the bytes it parsed.  ``last``: bytes read before and what they parsed
    to, given back as they are for the same bytes (a loop that made no progress since, as in a
    stall, wrote nothing)."""
    for _ in range(20):
        raw = os.pread(fd, SIZE, 0)
        if last is not None and raw == last[0]:
            return last
        if len(raw) != SIZE or raw[:8] != MAGIC:
            return None
        hb = parse(raw)
        if hb is not None:
            return raw, hb
        time.sleep(0.0005)
    return None


def read(path: str) -> Heartbeat | None:
    """A consistent snapshot, or None if the file is missing or torn on every try."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        return _snapshot(fd)
    except OSError:
        return None
    finally:
        os.close(fd)


class HeartbeatReader:
    """``read(path)`` for a reader that asks every poll: the file is opened once and kept.

    The writer creates the file once (``create_private``, O_EXCL) and never replaces it, so the
    descriptor keeps naming it; an open and a buffered file object per poll cost more than the
    read.  A file not there yet is looked for again at the next read.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd: int | None = None
        self._last: tuple[bytes, Heartbeat] | None = None  # the last record's bytes and what they parsed to

    def read(self) -> Heartbeat | None:
        if self._fd is None:
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                return None
        try:
            got = _record(self._fd, self._last)
        except OSError:
            return None
        if got is None:
            return None
        self._last = got
        return got[1]

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None

    def __del__(self) -> None:  # a reader dropped without close() must not leak its descriptor
        try:
            self.close()
        except Exception:  # at interpreter exit the os module may be torn down: the kernel closes them then
            pass
