"""Each rank's loader figures, for the job view: ``<report_dir>/.jobs/<job id>/<rank>-<host>-<pid>.json``.

A healthy rank writes no incident, yet the job view needs its figures to find a
straggler; so every rank of a job (a run with a job id, see :mod:`dlwatch.wire.job`)
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
import stat
from typing import Any

from dlwatch.wire import heartbeat as hbmod
from dlwatch.collect import runstats
from dlwatch.errors import ReportError
from dlwatch.report.store import JOBS_DIR  # pruned there, by keep_runs (store.prune_jobs)

__all__ = ["JOBS_DIR", "figures", "read_job_figures"]

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
