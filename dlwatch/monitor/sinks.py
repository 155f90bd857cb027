"""Outputs the monitor feeds every poll, besides incidents: the rank's figures for the job
view (``.jobs/`` in the report directory) and, opt-in, Prometheus metrics.

A sink gets a :class:`PollState` (what the monitor read at this poll, frozen) and
writes it somewhere; it never judges and never raises into the monitor (the monitor
contains a failing sink and warns once).  The monitor does not know what a sink does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from dlwatch.wire.heartbeat import Heartbeat
from dlwatch.model import ProcSample, SystemSample

__all__ = ["PollState", "ProcState", "Sink"]


@dataclass(frozen=True)
class ProcState:
    # A frozen snapshot of a tracked process for one poll, not the monitor's live (mutable)
    # Tracked: sinks keep nothing of the monitor's and cannot change it.
    pid: int
    role: str  # main, worker, other
    worker_id: int | None
    sample: ProcSample


@dataclass(frozen=True)
class PollState:
    now: float  # time.time()
    monotonic: float  # time.monotonic(), the heartbeat's clock
    pid: int  # the training process
    started_at: float  # when the watch block was entered (time.time())
    rank: Mapping[str, Any]  # the report's rank object
    heartbeat: Heartbeat | None
    procs: tuple[ProcState, ...]  # live processes, latest sample each
    system: SystemSample | None
    stalls: int  # stalls detected in this run
    incidents: int  # incidents written by this run
    stalled: bool  # a stall is in progress (no progress since it was detected)


class Sink:
    name = "sink"

    def on_poll(self, state: PollState) -> None:
        """Called after every poll."""

    def close(self, state: PollState | None, *, clean: bool) -> None:
        """Called once when the monitor ends (``clean``: the watch block ended)."""
