"""Each rank's loader figures, for the job view: ``<report_dir>/.jobs/<job id>/<rank>-<host>-<pid>.json``.

A healthy rank writes no incident, yet the job view needs its figures to find a
straggler; so every rank of a job (a run with a job id, see :mod:`dlwatch.job`)
keeps one small file up to date: every ``WRITE_EVERY_S`` and when the run ends.
It is replaced atomically (a private temporary file renamed over it: a reader
never sees half a file, and a link planted at the name is replaced, not followed).

The figures (from the heartbeat, which the training loop writes):

- ``data_wait_share``: time inside ``next(loader)`` over the loop's time
  (waiting plus loop body); a rank whose data is slow waits more;
- ``batch_rate_per_s``: batches over the loop's time;

  both in the steady state: each epoch without its first batch (``runstats.steady``,
  the run summary's ``steady_data_wait_share``), so that worker start-up (seconds, and
  noisy on a loaded node) is left to ``first_batch_s`` and does not swamp a short run's
  figures; until the first steady batch, those of the whole run;
- ``first_batch_s``: the wait for the first batch of the run (worker start-up and
  the first samples).  Exact when the monitor saw the heartbeat with exactly one
  batch; otherwise an upper bound (the whole wait up to the batches first seen),
  and ``first_batch_exact`` is false.

- ``worker_idle_share``: of the polls (after the first batch, inside the loop) that
  read a DataLoader worker, the share that found it idle (asleep in a poll: torch's
  wait for the next index); a rank whose workers idle has data to spare.  This is
  what tells a real straggler from ranks in lock-step that are all data-bound (there
  one rank, a hair behind, always waits for data while the others wait in the
  collective, and nobody's workers idle).

Job directories are retained like run summaries: after a run summary is written, the
oldest beyond ``keep_runs`` go (``store.prune_jobs``: only this user's real directories,
never across a link or onto another filesystem, never the writer's own job).

(When the per-run summary of issue 10 lands, these figures can come from it; this
file stays the job view's input.)
"""

from __future__ import annotations

import json
import os
import socket
import stat
from typing import Any, Mapping

from dlwatch import heartbeat as hbmod
from dlwatch._fs import make_private_dir, replace_private
from dlwatch.collect.syscalls import category as syscall_category
from dlwatch.detect import runstats
from dlwatch.errors import ReportError
from dlwatch.job import safe_name
from dlwatch.redact import outbound
from dlwatch.report.sinks import PollState, Sink
from dlwatch.report.store import JOBS_DIR  # pruned there, by keep_runs (store.prune_jobs)

__all__ = ["JOBS_DIR", "RankFiguresSink", "figures", "read_job_figures"]

WRITE_EVERY_S = 5.0
MAX_FILE_BYTES = 64 << 10
MAX_FILES = 4096  # ranks of one job read by the job view


def figures(hb: hbmod.Heartbeat | None, *, steady: bool = False) -> dict[str, Any]:
    """batches, data_wait_share, batch_rate_per_s of a heartbeat (None where not measurable yet).

    ``steady``: the share and rate are those of the steady state (``runstats.steady``: each
    epoch without its first batch, as in the run summary) once there is a steady batch;
    otherwise, and before, those of the whole run.
    """
    if hb is None:
        return {
            "batches": 0,
            "epochs": 0,
            "data_wait_s": 0.0,
            "step_s": 0.0,
            "data_wait_share": None,
            "batch_rate_per_s": None,
        }
    batches, wait_s, step_s = hb.batches, hb.total_wait_s, hb.total_step_s
    st = runstats.steady(hb)
    if steady and st.batches:
        batches, wait_s, step_s = st.batches, st.wait_s, st.body_s
    loop_s = wait_s + step_s
    return {
        "batches": hb.batches,
        "epochs": hb.epochs,
        "data_wait_s": round(hb.total_wait_s, 6),
        "step_s": round(hb.total_step_s, 6),
        "data_wait_share": round(wait_s / loop_s, 4) if loop_s > 0 and batches else None,
        "batch_rate_per_s": round(batches / loop_s, 4) if loop_s > 0 and batches else None,
    }


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


_NUM = (int, float)
_FIELDS: dict[str, Any] = {
    "job_id": str,
    "rank": (int, type(None)),
    "host": (str, type(None)),
    "pid": int,
    "batches": int,
    "data_wait_share": (*_NUM, type(None)),
    "batch_rate_per_s": (*_NUM, type(None)),
    "first_batch_s": (*_NUM, type(None)),
    "updated_at": _NUM,
    "started_at": _NUM,
}


def _load(path: str) -> dict[str, Any]:
    from dlwatch.report.store import read_regular

    try:
        data = json.loads(read_regular(path, MAX_FILE_BYTES))
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise ReportError(f"{path} is damaged") from None
    if not isinstance(data, dict) or data.get("kind") != "dlwatch-rank-figures":
        raise ReportError(f"{path} is not a dlwatch rank figures file")
    for key, types in _FIELDS.items():
        if not isinstance(data.get(key), types) or isinstance(data.get(key), bool):
            raise ReportError(f"{path} is damaged: {key} is {type(data.get(key)).__name__}")
    return data


def read_job_figures(report_dir: str) -> tuple[list[dict[str, Any]], list[str]]:
    """Every rank figures file under ``<report_dir>/.jobs/`` (links, FIFOs and damaged files skipped)."""
    root = os.path.join(report_dir, JOBS_DIR)
    out: list[dict[str, Any]] = []
    warnings: list[str] = []
    try:
        jobs = sorted(os.listdir(root))
    except OSError:
        return out, warnings
    for job in jobs:
        jdir = os.path.join(root, job)
        try:
            if not stat.S_ISDIR(os.lstat(jdir).st_mode):
                continue
            names = sorted(n for n in os.listdir(jdir) if n.endswith(".json") and not n.startswith("."))
        except OSError:
            continue
        for name in names[:MAX_FILES]:
            try:
                out.append(_load(os.path.join(jdir, name)))
            except ReportError as exc:
                warnings.append(f"skipped {JOBS_DIR}/{job}/{name}: {exc.message}")
    return out, warnings
