"""The progress heartbeat: a small mmap'd file the training loop writes and the monitor reads.

The monitor must see progress (or its absence) while the training process holds
the GIL in a deadlock, so the heartbeat is shared memory, not a message.  The
writer updates it with one ``pack_into`` per batch edge; a reader takes a
consistent copy by comparing the sequence number at both ends of the record.
"""

from __future__ import annotations

import mmap
import os
import struct
import time
from dataclasses import dataclass

from dlwatch._fs import create_private

MAGIC = b"DLWHB001"
# magic, state (one byte, so the wait edge is a single-byte store), seq, batches, epoch_batches,
# epochs, pid, ts_last_batch, ts_wait_start, total_wait_s, total_step_s, last_interval_s, seq again.
# Times are time.monotonic(): CLOCK_MONOTONIC is system-wide, so comparable across processes.
_REC = struct.Struct("<8sB7xQQQQI4xdddddQ")
STATE_OFFSET = 8

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
    ts_wait_start: float  # monotonic; when the current wait for data began
    total_wait_s: float
    total_step_s: float
    last_interval_s: float  # time between the last two batches

    @property
    def state_name(self) -> str:
        return STATE_NAMES.get(self.state, "unknown")

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


class HeartbeatWriter:
    """Owned by the training process.  Not thread-safe: one loop writes it."""

    __slots__ = ("_mm", "_fd", "_pack", "mm", "seq", "batches", "epoch_batches", "epochs", "pid", "ts_last_batch",
                 "ts_wait_start", "total_wait_s", "total_step_s", "last_interval_s")

    def __init__(self, path: str) -> None:
        self._fd = create_private(path, os.O_RDWR)
        os.ftruncate(self._fd, SIZE)
        self._mm = mmap.mmap(self._fd, SIZE)
        self.mm = self._mm  # for the hot path's one-byte state store
        self._pack = _REC.pack_into
        self.seq = 0
        self.batches = 0
        self.epoch_batches = 0
        self.epochs = 0
        self.pid = os.getpid()
        self.ts_last_batch = 0.0
        self.ts_wait_start = 0.0
        self.total_wait_s = 0.0
        self.total_step_s = 0.0
        self.last_interval_s = 0.0
        self.write(STATE_OUTSIDE)

    def write(self, state: int) -> None:
        self.seq = seq = self.seq + 1
        self._pack(self._mm, 0, MAGIC, state, seq, self.batches, self.epoch_batches, self.epochs, self.pid,
                   self.ts_last_batch, self.ts_wait_start, self.total_wait_s,
                   self.total_step_s, self.last_interval_s, seq)

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
    """One record from bytes read elsewhere (attach reads them with the target's rights); None if torn."""
    if len(raw) < SIZE:
        return None
    (magic, state, seq, batches, epoch_batches, epochs, pid, ts_last, ts_wait, wait_s, step_s,
     interval_s, seq2) = _REC.unpack(raw[:SIZE])
    if magic != MAGIC or seq != seq2:
        return None
    return Heartbeat(batches, epoch_batches, epochs, state, pid, ts_last, ts_wait, wait_s, step_s, interval_s)


def read(path: str) -> Heartbeat | None:
    """A consistent snapshot, or None if the file is missing or torn on every try."""
    try:
        with open(path, "rb") as f:
            for _ in range(20):
                f.seek(0)
                raw = f.read(SIZE)
                if len(raw) != SIZE:
                    return None
                (magic, state, seq, batches, epoch_batches, epochs, pid, ts_last, ts_wait, wait_s, step_s,
                 interval_s, seq2) = _REC.unpack(raw)
                if magic != MAGIC:
                    return None
                if seq == seq2:
                    return Heartbeat(batches, epoch_batches, epochs, state, pid, ts_last, ts_wait, wait_s,
                                     step_s, interval_s)
                time.sleep(0.0005)
    except OSError:
        return None
    return None
