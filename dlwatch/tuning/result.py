"""The tune's result: one row per candidate (its runs pooled), the recommendation and its reasons.

``TuneResult.best`` is the dict of DataLoader keywords to change (only those that differ from
the loader's); ``rows`` one :class:`Row` per candidate; ``why`` the reasons in words.  It prints
as a table (``str(result)``), and ``to_dict()`` is the JSON document ``dlwatch tune --json``
writes (docs/tune.md, "JSON").
"""

from __future__ import annotations

import datetime as _dt
import socket
import statistics
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from dlwatch._version import __version__
from dlwatch.tuning import limits
from dlwatch.tuning.guard import RunRecord
from dlwatch.tuning.limits import Machine
from dlwatch.tuning.space import Config, LoaderFacts

KIND = "dlwatch-tune"
SCHEMA_VERSION = 1


@dataclass(frozen=True)
class Row:
    """One candidate, measured (its runs pooled) or why it was not."""

    config: Config
    status: str  # ok, failed, stopped (time, Ctrl-C), skipped (never run: why says), restricted, empty
    reason: str | None = None
    playbook: str | None = None  # the failure's playbook, matched on its exception as an incident's
    runs: int = 0
    batches_per_s: float | None = None
    batches_per_s_sd: float | None = None  # over the chunks of whole bursts of every run
    samples_per_s: float | None = None
    first_batch_s: float | None = None  # a fresh iterator's: worker start-up plus the first batch
    epoch_start_s: float | None = None  # a re-iterated persistent one's (else first_batch_s)
    cpu_cores: float | None = None
    worker_busy_share: float | None = None  # of the workers' time: on a CPU or runnable and waiting for one
    wait_cores: float | None = None  # the workers' waiting for a CPU, in cores' worth
    workers: int = 0
    worker_rss_total: int | None = None
    worker_rss_max: int | None = None
    worker_uss_total: int | None = None
    worker_uss_max: int | None = None
    mem_peak: int | None = None
    shm_peak: int | None = None
    fds_peak: int | None = None
    fd_limit: int | None = None
    limits: tuple[str, ...] = ()  # the rooms its peaks did not fit in (or the one that stopped it)
    data_wait_share: float | None = None  # estimated for the given step time
    partial: bool = False  # a window cut short (few batches, or the budget's end)
    current: bool = False
    recommended: bool = False
    phase: str = ""

    @property
    def fits(self) -> bool | None:
        if self.status != "ok":
            return None if not self.limits else False
        return not self.limits

    @property
    def eligible(self) -> bool:
        return self.status == "ok" and not self.limits and self.batches_per_s is not None

    def to_dict(self) -> dict[str, Any]:
        return {
            **self.config.to_dict(),
            "status": self.status,
            "reason": self.reason,
            "playbook": self.playbook,
            "runs": self.runs,
            "batches_per_s": _r(self.batches_per_s, 3),
            "batches_per_s_sd": _r(self.batches_per_s_sd, 3),
            "samples_per_s": _r(self.samples_per_s, 2),
            "first_batch_s": _r(self.first_batch_s, 4),
            "epoch_start_s": _r(self.epoch_start_s, 4),
            "cpu_cores": self.cpu_cores,
            "worker_busy_share": self.worker_busy_share,
            "wait_cores": self.wait_cores,
            "workers": self.workers,
            "worker_rss_total": self.worker_rss_total,
            "worker_rss_max": self.worker_rss_max,
            "worker_uss_total": self.worker_uss_total,
            "worker_uss_max": self.worker_uss_max,
            "mem_peak": self.mem_peak,
            "shm_peak": self.shm_peak,
            "fds_peak": self.fds_peak,
            "fd_limit": self.fd_limit,
            "fits": self.fits,
            "limits": list(self.limits),
            "data_wait_share": _r(self.data_wait_share, 3),
            "partial": self.partial,
            "current": self.current,
            "recommended": self.recommended,
            "phase": self.phase,
        }


def _r(x: float | None, digits: int) -> float | None:
    return round(x, digits) if isinstance(x, (int, float)) else None


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def _peak(values: Iterable[int | None]) -> int | None:
    vals = [v for v in values if isinstance(v, int)]
    return max(vals) if vals else None


def pool(
    cfg: Config, runs: Sequence[RunRecord], machine: Machine, batch_size: int | None, skipped: str | None = None
) -> Row:
    """One row from every run of ``cfg`` (a failure in any run makes the row failed)."""
    if not runs:
        return Row(config=cfg, status="skipped", reason=skipped)
    failed = [r for r in runs if r.status == "failed"]
    ok = [r for r in runs if r.status == "ok" and r.rate is not None]
    stopped = [r for r in runs if r.status == "stopped"]
    empty = [r for r in runs if r.status == "empty"]
    intervals = sum(float((r.steady or {}).get("intervals") or 0) for r in ok)
    seconds = sum(float((r.steady or {}).get("seconds") or 0) for r in ok)
    rate = intervals / seconds if seconds > 0 else None
    chunks = [c for r in ok for c in (r.steady or {}).get("chunks") or ()]
    sd = statistics.stdev(chunks) if len(chunks) >= 2 else None
    firsts = [r.first_batch_s for r in runs if r.first_batch_s is not None]
    resets = [x for r in runs for x in r.resets]
    mem = _peak(r.mem_peak for r in runs)
    shm = _peak(r.shm_peak for r in runs)
    fd_run = max((r for r in runs if r.fds_peak is not None), key=lambda r: r.fds_peak or 0, default=None)
    fds = fd_run.fds_peak if fd_run else None
    fd_limit = fd_run.fd_limit if fd_run else None
    broken = limits.broken_limits(machine, mem=mem, shm=shm, fds=fds, fd_limit=fd_limit)
    stop_limits = tuple(r.limit for r in failed if r.limit)
    if failed:
        status, reason, playbook = "failed", failed[0].reason, failed[0].playbook
    elif ok:
        status, reason, playbook = "ok", None, None
    elif empty:
        status, reason, playbook = "empty", empty[0].reason, None
    else:
        status = "stopped"
        reason = stopped[0].reason if stopped else "no steady batches measured"
        playbook = None
    first = _median(firsts)
    cores = [r.cpu_cores for r in ok if r.cpu_cores is not None]
    busy = [r.worker_busy_share for r in ok if r.worker_busy_share is not None]
    waits = [r.wait_cores for r in ok if r.wait_cores is not None]
    return Row(
        config=cfg,
        status=status,
        reason=reason,
        playbook=playbook,
        runs=len(ok),
        batches_per_s=rate,
        batches_per_s_sd=sd,
        samples_per_s=rate * batch_size if rate is not None and batch_size else None,
        first_batch_s=first,
        epoch_start_s=_median(resets) if cfg.persistent_workers and resets else first,
        cpu_cores=_median(cores),
        worker_busy_share=_median(busy),
        wait_cores=_median(waits),
        workers=max((r.workers for r in runs), default=0),
        worker_rss_total=_peak(r.worker_rss_total for r in runs),
        worker_rss_max=_peak(r.worker_rss_max for r in runs),
        worker_uss_total=_peak(r.worker_uss_total for r in runs),
        worker_uss_max=_peak(r.worker_uss_max for r in runs),
        mem_peak=mem,
        shm_peak=shm,
        fds_peak=fds,
        fd_limit=fd_limit,
        limits=tuple(dict.fromkeys(stop_limits + broken)),
        partial=bool(ok) and all((r.steady or {}).get("partial") for r in ok),
        phase=runs[0].phase,
    )


@dataclass(frozen=True)
class TuneResult:
    """What ``dlwatch.tune`` found.  ``str(result)`` is its table."""

    best: dict[str, Any]
    rows: tuple[Row, ...]
    why: tuple[str, ...]
    current: Config
    recommended: Config | None
    loader: LoaderFacts
    machine: Machine
    budget_s: float
    step_s: float | None
    elapsed_s: float
    interrupted: bool = False
    restricted: Mapping[str, Any] | None = None  # the IterableDataset rule's finding, when it limited the search
    advice: tuple[str, ...] = ()  # not measured: the start method
    notes: tuple[str, ...] = ()
    created_at: float = 0.0
    extra: Mapping[str, Any] = field(default_factory=dict)

    def dataloader_kwargs(self) -> dict[str, Any]:
        """Every keyword of the recommended configuration (``best`` is only the ones to change)."""
        return dict(self.recommended.kwargs()) if self.recommended else {}

    def to_dict(self) -> dict[str, Any]:
        ts = self.created_at or None
        return {
            "schema_version": SCHEMA_VERSION,
            "kind": KIND,
            "dlwatch_version": __version__,
            "created_at": _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).isoformat(timespec="seconds")
            if ts
            else None,
            "host": socket.gethostname(),
            "loader": self.loader.to_dict(),
            "machine": self.machine.to_dict(),
            "budget_s": self.budget_s,
            "step_s": self.step_s,
            "elapsed_s": round(self.elapsed_s, 2),
            "interrupted": self.interrupted,
            "best": dict(self.best),
            "current": self.current.to_dict(),
            "recommended": self.recommended.to_dict() if self.recommended else None,
            "why": list(self.why),
            "advice": list(self.advice),
            "restricted": dict(self.restricted) if self.restricted else None,
            "rows": [r.to_dict() for r in self.rows],
            "notes": list(self.notes),
            **dict(self.extra),
        }

    def table(self, width: int = 100) -> str:
        from dlwatch.tuning.render import result_lines

        return "\n".join(result_lines(self, width=width))

    def __str__(self) -> str:
        return self.table()

    def html(self) -> str:
        """The tune report: a self-contained page (charts of throughput and memory against num_workers)."""
        from dlwatch.tuning.page import render_page

        return render_page(self.to_dict())
