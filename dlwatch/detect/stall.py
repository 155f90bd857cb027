"""Stall detection: no batch progress for longer than the allowance.  Pure; the monitor feeds it.

Two kinds of wait, two allowances:

- **Waiting for data** (the loop is inside ``next(loader)``): ``stall_timeout``.  Explicit
  (``stall_timeout=`` or DLWATCH_STALL_TIMEOUT): applies to every batch, the first of an
  epoch included.  Adaptive (the default): the larger of ``ADAPTIVE_FLOOR_S`` and
  ``ADAPTIVE_MULTIPLE`` times the p99 of recent batch intervals; the first batch of an
  epoch (worker start-up, dataset warm-up) gets ``FIRST_BATCH_S``.
- **In the loop body** (a batch was handed out and the loop has not asked for the next):
  ``body_timeout``.  Evaluation, checkpointing and compilation live here and are not
  stalls.  Explicit (``body_timeout=`` or DLWATCH_BODY_TIMEOUT): applies to any body
  pause.  Adaptive (the default): while the job is busy (CPU progress anywhere in it,
  the main process runnable, in I/O or asleep in a timed sleep) the larger of
  ``BODY_FLOOR_S`` (30 min) and ``BODY_MULTIPLE`` times the longest body pause the run
  has shown; while the whole job is *blocked* (every process asleep in a lock or poll,
  under ``BLOCKED_CPU_SHARE`` of a core, for ``BODY_BLOCKED_S``) it is a stall after
  ``BODY_BLOCKED_S`` (5 min): half of NCCL's default 10-minute collective timeout, so the
  evidence is taken before torch kills the process.  Progress of a watched loop nested
  in the body (a validation loader under its own ``watch``) is progress of this one.

One stall is reported once: after a stall fires, the detector stays quiet until
progress resumes (which it reports as ``resumed``), so a long stall never floods.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass

from dlwatch.wire.heartbeat import STATE_BODY, STATE_WAITING, Heartbeat

ADAPTIVE_FLOOR_S = 60.0
ADAPTIVE_MULTIPLE = 10.0
FIRST_BATCH_S = 300.0
BODY_FLOOR_S = 1800.0
BODY_MULTIPLE = 3.0
BODY_BLOCKED_S = 300.0
BLOCKED_CPU_SHARE = 0.01  # of one core, over BODY_BLOCKED_S: periodic wake-ups stay far below, real work far above
_WINDOW = 512
_ACTIVITY_POINTS = 4096  # bound on the body-pause CPU record (one point a poll)


@dataclass(frozen=True)
class StallEvent:
    kind: str  # "stall" or "resumed"
    stall_s: float  # seconds without progress
    timeout_s: float  # the threshold that applied
    batches: int
    state: str  # heartbeat state name: waiting_for_data, in_loop_body
    first_batch: bool  # the stall is before the first batch of an epoch
    allowance: str = "data"  # data | body | body-blocked: which allowance ran out


@dataclass(frozen=True)
class Activity:
    """What the monitor read of the job at one poll, for judging a loop-body pause."""

    cpu_s: float | None = None  # CPU seconds of every process of the job (main, workers, others), summed
    busy: bool = False  # the main process runnable (R), in disk I/O (D), or in an I/O or sleep syscall
    inner_progress: bool = False  # a watched loop nested in this one's body made progress since the last poll


def p99(values: "collections.deque[float] | list[float]") -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(0.99 * (len(ordered) - 1))))]


class StallDetector:
    def __init__(self, stall_timeout: float | None, body_timeout: float | None = None) -> None:
        self.explicit = stall_timeout
        self.body_explicit = body_timeout
        self.intervals: collections.deque[float] = collections.deque(maxlen=_WINDOW)
        self.longest_body_s = 0.0  # the longest loop-body pause seen that ended in progress
        self._last_batches = -1
        self._last_epochs = -1
        self._progress_at: float | None = None  # monotonic time of the last progress seen
        self._stalled = False
        self._body_seen_s = 0.0  # the current body pause, as last observed
        self._inner_at = 0.0  # monotonic time of the last progress of a nested watched loop
        self._active_at = 0.0  # monotonic time the job was last seen busy (not only by CPU)
        self._cpu: collections.deque[tuple[float, float]] = collections.deque(maxlen=_ACTIVITY_POINTS)
        self._body_until = 0.0  # monotonic time of the last poll that saw the loop body of this batch

    def timeout(self, first_batch: bool) -> float:
        """The allowance for waiting for data."""
        if self.explicit is not None:
            return self.explicit
        if first_batch:
            return FIRST_BATCH_S
        return max(ADAPTIVE_FLOOR_S, ADAPTIVE_MULTIPLE * p99(self.intervals))

    def body_timeout(self, blocked: bool = False) -> float:
        """The allowance for a loop-body pause (``blocked``: the whole job asleep, see the module doc)."""
        if self.body_explicit is not None:
            return self.body_explicit
        busy = max(BODY_FLOOR_S, BODY_MULTIPLE * self.longest_body_s)
        return min(busy, BODY_BLOCKED_S) if blocked else busy

    def allowance(self, kind: str, now: float) -> float:
        """The allowance that applies now to a wait of ``kind`` (``data``, ``first`` or ``body``)."""
        if kind == "body":
            return self.body_timeout(self.body_explicit is None and self._blocked(now))
        return self.timeout(kind == "first")

    @property
    def body_until(self) -> float:
        """Monotonic time of the last poll that saw the loop body of the current batch (0.0: none)."""
        return self._body_until

    @property
    def stalled(self) -> bool:
        """A stall was reported and no progress came since."""
        return self._stalled

    def hold(self) -> None:
        """The current wait is reported (a Ctrl-C's incident): no stall for it until progress resumes."""
        self._stalled = True

    def _blocked(self, now: float) -> bool:
        """No sign of life in the job for the last BODY_BLOCKED_S: not busy, CPU under the share."""
        if now - self._active_at < BODY_BLOCKED_S or not self._cpu:
            return False
        base = None
        for t, cpu in self._cpu:  # the newest point at least BODY_BLOCKED_S old is the baseline
            if now - t >= BODY_BLOCKED_S:
                base = (t, cpu)
            else:
                break
        if base is None:
            return False
        _t, last_cpu = self._cpu[-1]
        return last_cpu - base[1] < BLOCKED_CPU_SHARE * (now - base[0])

    def update(self, hb: Heartbeat | None, now: float, activity: Activity | None = None) -> StallEvent | None:
        """Feed one heartbeat read at monotonic time ``now``; return a stall or a resume, or None."""
        if hb is None:
            return None
        if hb.batches != self._last_batches or hb.epochs != self._last_epochs:
            if hb.batches > self._last_batches >= 0 and hb.last_interval_s > 0:
                self.intervals.append(hb.last_interval_s)
            self.longest_body_s = max(self.longest_body_s, self._body_seen_s)
            self._body_seen_s = 0.0
            self._body_until = 0.0
            self._cpu.clear()
            resumed = self._stalled
            stalled_for = (now - self._progress_at) if self._progress_at is not None else 0.0
            self._last_batches, self._last_epochs = hb.batches, hb.epochs
            self._progress_at = hb.ts_last_batch or now
            self._stalled = False
            if resumed:
                return StallEvent("resumed", stalled_for, self.timeout(False), hb.batches, hb.state_name, False)
            return None
        if hb.state == STATE_BODY:
            return self._body(hb, now, activity or Activity())
        if hb.state != STATE_WAITING:
            return None  # outside the loop (between epochs, before the first batch, ended): not a stall
        first = hb.epoch_batches == 0
        # the body pause before this wait is the body's, not the data's: the wait began after the
        # last poll that still saw the loop body (see Heartbeat.wait_started)
        since = hb.wait_started(self.body_until)
        if since <= 0:
            return None
        stall_s = now - since
        timeout = self.timeout(first)
        if stall_s >= timeout and not self._stalled:
            self._stalled = True
            return StallEvent("stall", stall_s, timeout, hb.batches, hb.state_name, first)
        return None

    def _body(self, hb: Heartbeat, now: float, activity: Activity) -> StallEvent | None:
        if hb.ts_last_batch <= 0:
            return None
        self._body_until = now
        if activity.inner_progress:
            self._inner_at = now
        if activity.busy or activity.inner_progress:
            self._active_at = now
        if activity.cpu_s is not None:
            self._cpu.append((now, activity.cpu_s))
        since = max(hb.ts_last_batch, self._inner_at)
        body_s = now - since
        self._body_seen_s = max(self._body_seen_s, now - hb.ts_last_batch)
        if self._stalled:
            return None
        blocked = self.body_explicit is None and self._blocked(now)
        timeout = self.body_timeout(blocked)
        if body_s >= timeout:
            self._stalled = True
            allowance = "body-blocked" if blocked and timeout == BODY_BLOCKED_S else "body"
            return StallEvent("stall", body_s, timeout, hb.batches, hb.state_name, False, allowance)
        return None


def stall_site(report: dict) -> tuple:
    """What makes two stalls of one run the same hang: the verdict and where each process waits.

    Processes that are busy (``running``) or idle in torch's own waits say little about the
    site; the blocked ones and the main process do.  Pids are left out: non-persistent
    workers come back with new pids every epoch and hang in the same place.
    """
    waits = set()
    for p in report.get("processes") or ():
        if not isinstance(p, dict):
            continue
        if p.get("role") == "main" or p.get("status") == "blocked":
            waits.add((str(p.get("role")), str(p.get("waiting_in")), str(p.get("where"))))
    return (report.get("classification"), tuple(sorted(waits)))
