"""Stall detection: no batch progress for longer than the stall timeout.  Pure; the monitor feeds it.

Explicit timeout (``stall_timeout=`` or DLWATCH_STALL_TIMEOUT): applies to every
batch, the first of an epoch included.  Adaptive (the default): the larger of
``ADAPTIVE_FLOOR_S`` and ``ADAPTIVE_MULTIPLE`` times the p99 of recent batch
intervals, so that a slow but healthy model is not flagged; the first batch of
an epoch (worker start-up, dataset warm-up) gets ``FIRST_BATCH_S`` instead.

One stall is reported once: after a stall fires, the detector stays quiet until
progress resumes (which it reports as ``resumed``), so a long stall never floods.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from dlwatch.heartbeat import STATE_BODY, STATE_WAITING, Heartbeat

ADAPTIVE_FLOOR_S = 60.0
ADAPTIVE_MULTIPLE = 10.0
FIRST_BATCH_S = 300.0
_WINDOW = 512


@dataclass(frozen=True)
class StallEvent:
    kind: str  # "stall" or "resumed"
    stall_s: float  # seconds without progress
    timeout_s: float  # the threshold that applied
    batches: int
    state: str  # heartbeat state name: waiting_for_data, in_loop_body
    first_batch: bool  # the stall is before the first batch of an epoch


def p99(values: "collections.deque[float] | list[float]") -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


class StallDetector:
    def __init__(self, stall_timeout: float | None) -> None:
        self.explicit = stall_timeout
        self.intervals: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self._last_batches = -1
        self._last_epochs = -1
        self._progress_at: float | None = None  # monotonic time of the last progress seen
        self._epoch_started_at: float | None = None
        self._stalled = False

    def timeout(self, first_batch: bool) -> float:
        if self.explicit is not None:
            return self.explicit
        if first_batch:
            return FIRST_BATCH_S
        return max(ADAPTIVE_FLOOR_S, ADAPTIVE_MULTIPLE * p99(self.intervals))

    def update(self, hb: Heartbeat | None, now: float) -> StallEvent | None:
        """Feed one heartbeat read at monotonic time ``now``; return a stall or a resume, or None."""
        if hb is None:
            return None
        if hb.batches != self._last_batches or hb.epochs != self._last_epochs:
            if hb.batches > self._last_batches >= 0 and hb.last_interval_s > 0:
                self.intervals.append(hb.last_interval_s)
            resumed = self._stalled
            stalled_for = (now - self._progress_at) if self._progress_at is not None else 0.0
            self._last_batches, self._last_epochs = hb.batches, hb.epochs
            self._progress_at = hb.ts_last_batch or now
            self._stalled = False
            if resumed:
                return StallEvent("resumed", stalled_for, self.timeout(False), hb.batches, hb.state_name, False)
            return None
        if hb.state not in (STATE_WAITING, STATE_BODY):
            return None  # outside the loop (between epochs, before the first batch, ended): not a stall
        first = hb.state == STATE_WAITING and hb.epoch_batches == 0
        since = hb.ts_wait_start if first else hb.ts_last_batch
        if since <= 0:
            return None
        stall_s = now - since
        timeout = self.timeout(first)
        if stall_s >= timeout and not self._stalled:
            self._stalled = True
            return StallEvent("stall", stall_s, timeout, hb.batches, hb.state_name, first)
        return None
