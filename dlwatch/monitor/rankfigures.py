"""The monitor's writer of each rank's loader figures (``<report_dir>/.jobs/<job>/...json``).

What the figures mean, and how the job view reads them: :mod:`dlwatch.report.rankfigures`.
"""

from __future__ import annotations

import json
import os
import socket
from typing import Any, Mapping

from dlwatch.wire import heartbeat as hbmod
from dlwatch._fs import make_private_dir, replace_private
from dlwatch.collect.syscalls import category as syscall_category
from dlwatch.wire.job import safe_name
from dlwatch.redact import outbound
from dlwatch.monitor.sinks import PollState, Sink
from dlwatch.report.rankfigures import JOBS_DIR, WRITE_EVERY_S, figures

__all__ = ["RankFiguresSink"]


class RankFiguresSink(Sink):
    name = "rank_figures"

    def __init__(self, report_dir: str, rank: Mapping[str, Any], *, pid: int) -> None:
        self.rank = dict(rank)
        job_dir = os.path.join(report_dir, JOBS_DIR, safe_name(str(rank["job_id"])))
        make_private_dir(job_dir)  # another rank may make a level first: it must pass the same checks
        host = safe_name(socket.gethostname())[:64]
        who = f"rank{rank['rank']}" if isinstance(rank.get("rank"), int) else "rank-unknown"
        self.path = os.path.join(job_dir, f"{who}-{host}-{pid}.json")
        self.host = socket.gethostname()
        self.pid = pid
        self.first_batch_s: float | None = None
        self.first_batch_exact = False
        self.past_first_batch = False
        self.worker_reads = 0
        self.worker_idle = 0
        self.last_write = 0.0

    def _track_first(self, hb: hbmod.Heartbeat | None) -> None:
        if hb is None or self.first_batch_s is not None or hb.batches < 1:
            return
        self.first_batch_s = round(hb.total_wait_s, 6)  # batches == 1: exactly the first wait
        self.first_batch_exact = hb.batches == 1
        self.past_first_batch = True

    def record(self, state: PollState, *, ended: bool) -> dict[str, Any]:
        return {
            "kind": "dlwatch-rank-figures",
            "version": 1,
            "job_id": self.rank.get("job_id"),
            "rank": self.rank.get("rank"),
            "local_rank": self.rank.get("local_rank"),
            "world_size": self.rank.get("world_size"),
            "launched_at": self.rank.get("launched_at"),
            "run_id": self.rank.get("run_id"),
            "host": self.host,
            "pid": self.pid,
            "started_at": state.started_at,
            "updated_at": round(state.now, 3),
            "ended": ended,
            **figures(state.heartbeat, steady=True),
            "first_batch_s": self.first_batch_s,
            "first_batch_exact": self.first_batch_exact,
            "worker_idle_share": round(self.worker_idle / self.worker_reads, 4) if self.worker_reads else None,
            "worker_reads": self.worker_reads,
            "stalls": state.stalls,
            "incidents": state.incidents,
            "stalled": state.stalled,
        }

    def _write(self, state: PollState, *, ended: bool) -> None:
        data = json.dumps(outbound(self.record(state, ended=ended)), indent=1).encode("utf-8", "surrogateescape")
        replace_private(self.path, data, fsync=False)
        self.last_write = state.monotonic

    def _track_workers(self, state: PollState) -> None:
        hb = state.heartbeat
        if hb is None or not self.past_first_batch or hb.state not in (hbmod.STATE_WAITING, hbmod.STATE_BODY):
            return  # before the first batch (workers start) or outside the loop (between epochs)
        for p in state.procs:
            if p.role != "worker" or p.sample.gone:
                continue
            self.worker_reads += 1
            if p.sample.state == "S" and syscall_category(p.sample.syscall) == "poll":
                self.worker_idle += 1

    def on_poll(self, state: PollState) -> None:
        self._track_first(state.heartbeat)
        self._track_workers(state)
        if state.monotonic - self.last_write >= WRITE_EVERY_S or not self.last_write:
            self._write(state, ended=False)

    def close(self, state: PollState | None, *, clean: bool) -> None:
        if state is not None:
            self._track_first(state.heartbeat)
            self._write(state, ended=True)
