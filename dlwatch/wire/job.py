"""Which rank of which job this process is: read once from the launcher's environment.

``torchrun`` (and most launchers) tell every rank who it is through the environment:
``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``.  The job id ties the
ranks' incidents together in ``dlwatch report --job``; it is, first found first:

1. ``DLWATCH_JOB_ID``: set it yourself (e.g. to ``$SLURM_JOB_ID``) to name the job;
2. ``TORCHELASTIC_RUN_ID``: torchrun's rendezvous id (a fresh uuid for a single-node
   ``torchrun``; the ``--rdzv-id`` you gave otherwise), unless it is torchrun's
   placeholder ``none``;
3. ``MASTER_ADDR:MASTER_PORT@<start>``: the rendezvous address plus the start time
   (UTC, to the second) of the rank's parent process, the launcher's agent, which all
   ranks of one node share.  Ranks on other nodes have other agents: on several nodes
   without a run id, set ``DLWATCH_JOB_ID``.

A process with none of these is not part of a job: ``job_id`` is None.

A job id names a job, not one run of it: ``DLWATCH_JOB_ID=$SLURM_JOB_ID`` stays the same for
every ``srun`` of an allocation, a fixed ``--rdzv-id`` for every launch.  So a rank of a job also
records its run: ``launched_at``, the start time (Unix seconds) of its launcher's agent (torchrun's
``TORCHELASTIC_*`` environment: the rank's parent, which restarts of the rank keep) or else of the
rank's own process, and ``run_id``, torchrun's ``TORCHELASTIC_RUN_ID`` when it is not the job id
itself.  The job view (:mod:`dlwatch.report.jobview`) keeps runs of one id apart with them.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
from typing import Any, Mapping

__all__ = ["rank_info", "job_id", "launched_at", "safe_name"]

_PLACEHOLDER_IDS = ("", "none")
_MAX_ID_CHARS = 128


def _num(env: Mapping[str, str], name: str) -> int | None:
    try:
        value = int(env[name])
    except (KeyError, ValueError):
        return None
    return value if value >= 0 else None


def _parent_started(ppid: int | None = None) -> float | None:
    try:
        import psutil

        return float(psutil.Process(os.getppid() if ppid is None else ppid).create_time())
    except Exception:
        return None


def _self_started() -> float | None:
    try:
        import psutil

        return float(psutil.Process().create_time())
    except Exception:
        return None


def launched_at(environ: Mapping[str, str] | None = None, *, parent_started: float | None = None) -> float | None:
    """When this rank's run was launched (see the module docstring), Unix seconds to the ms; None if unknown."""
    env = os.environ if environ is None else environ
    elastic = any(k in env for k in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"))
    started = (parent_started if parent_started is not None else _parent_started()) if elastic else _self_started()
    return round(started, 3) if started else None


def job_id(
    environ: Mapping[str, str] | None = None, *, parent_started: float | None = None
) -> tuple[str | None, str | None]:
    """(job id, where it came from); (None, None) outside a multi-process job."""
    env = os.environ if environ is None else environ
    own = (env.get("DLWATCH_JOB_ID") or "").strip()
    if own:
        return own[:_MAX_ID_CHARS], "DLWATCH_JOB_ID"
    run_id = (env.get("TORCHELASTIC_RUN_ID") or "").strip()
    if run_id.lower() not in _PLACEHOLDER_IDS:
        return run_id[:_MAX_ID_CHARS], "TORCHELASTIC_RUN_ID"
    addr, port = (env.get("MASTER_ADDR") or "").strip(), (env.get("MASTER_PORT") or "").strip()
    if addr and port:
        started = parent_started if parent_started is not None else _parent_started()
        when = (
            _dt.datetime.fromtimestamp(started, _dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") if started else "unknown"
        )
        return f"{addr}:{port}@{when}"[:_MAX_ID_CHARS], "MASTER_ADDR:MASTER_PORT"
    return None, None


def rank_info(environ: Mapping[str, str] | None = None, *, parent_started: float | None = None) -> dict[str, Any]:
    """The report's ``rank`` object: rank, local_rank, world_size, local_world_size, job_id, job_id_source."""
    env = os.environ if environ is None else environ
    jid, source = job_id(env, parent_started=parent_started)
    out: dict[str, Any] = {
        "rank": _num(env, "RANK"),
        "local_rank": _num(env, "LOCAL_RANK"),
        "world_size": _num(env, "WORLD_SIZE"),
        "local_world_size": _num(env, "LOCAL_WORLD_SIZE"),
        "job_id": jid,
        "job_id_source": source,
    }
    if jid is not None:  # which run of the job (keys of a rank of a job only)
        run_id = (env.get("TORCHELASTIC_RUN_ID") or "").strip()
        out["launched_at"] = launched_at(env, parent_started=parent_started)
        out["run_id"] = run_id[:_MAX_ID_CHARS] if run_id.lower() not in _PLACEHOLDER_IDS and run_id != jid else None
    return out


_UNSAFE = re.compile(r"[^A-Za-z0-9_.@:-]")


def safe_name(text: str) -> str:
    """A job id as one path component: no separators, no leading dot, bounded."""
    name = _UNSAFE.sub("_", text)[:_MAX_ID_CHARS].replace(":", "_")
    return name.lstrip(".") or "_"
