"""What the monitor's per-poll sinks cost: the rank figures file and the Prometheus textfile.

    python bench/sink_cost.py [--workers 8] [--polls 500]

Feeds hand-built PollStates (a main process and N workers) to each sink and prints the
mean time per poll.  The monitor polls once a second by default.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

from dlwatch.wire.heartbeat import Heartbeat
from dlwatch.model import ProcSample, SystemSample
from dlwatch.monitor.rankfigures import RankFiguresSink
from dlwatch.monitor.sinks import PollState, ProcState

RANK = {"rank": 3, "local_rank": 3, "world_size": 8, "local_world_size": 8, "job_id": "bench"}


def state(i: int, workers: int) -> PollState:
    hb = Heartbeat(
        batches=i,
        epoch_batches=i,
        epochs=1,
        state=2,
        pid=1,
        ts_last_batch=float(i),
        ts_wait_start=float(i),
        total_wait_s=i * 0.01,
        total_step_s=i * 0.05,
        last_interval_s=0.06,
    )
    procs = [ProcState(1, "main", None, ProcSample(pid=1, ts=i, num_fds=80, fd_limit=65536, rss=2 << 30, uss=1 << 30))]
    procs += [
        ProcState(
            10 + w,
            "worker",
            w,
            ProcSample(
                pid=10 + w, ts=i, state="S", syscall=7, num_fds=30, fd_limit=65536, rss=1 << 30, shm_map_bytes=64 << 20
            ),
        )
        for w in range(workers)
    ]
    return PollState(
        now=time.time(),
        monotonic=time.monotonic(),
        pid=1,
        started_at=0.0,
        rank=RANK,
        heartbeat=hb,
        procs=tuple(procs),
        system=SystemSample(ts=i, shm_total=8 << 30, shm_free=7 << 30),
        stalls=0,
        incidents=0,
        stalled=False,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workers", type=int, default=8)
    ap.add_argument("--polls", type=int, default=500)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        sinks = [RankFiguresSink(d, RANK, pid=1)]
        try:
            from dlwatch.monitor.prom import PromSink

            sinks.append(PromSink({"file": os.path.join(d, "dlwatch.prom"), "port": None}, RANK, pid=1))
        except ImportError:
            print("prometheus_client not installed: Prometheus sink skipped")
        for sink in sinks:
            if isinstance(sink, RankFiguresSink):
                sink.last_write = -1e9  # write every poll, the worst case (it writes every 5 s)
            t0 = time.perf_counter()
            for i in range(args.polls):
                if isinstance(sink, RankFiguresSink):
                    sink.last_write = -1e9
                sink.on_poll(state(i + 1, args.workers))
            dt = (time.perf_counter() - t0) / args.polls
            print(f"{sink.name:<14} {dt * 1e3:.3f} ms per poll ({args.workers} workers)")
            sink.close(None, clean=True)


if __name__ == "__main__":
    main()
