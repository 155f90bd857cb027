"""The sinks a run asked for, built once by the monitor (see :mod:`dlwatch.monitor.sinks`)."""

from __future__ import annotations

from typing import Any, Callable, Mapping

from dlwatch.monitor.sinks import Sink


def build(
    cfg: Mapping[str, Any], report_dir: str, rank: Mapping[str, Any], warn: Callable[[str, str], None]
) -> list[Sink]:
    """The sinks this run asked for: the rank figures in a multi-rank job, Prometheus when enabled."""
    sinks: list[Sink] = []
    if rank.get("job_id"):
        try:
            from dlwatch.monitor.rankfigures import RankFiguresSink

            sinks.append(RankFiguresSink(report_dir, rank, pid=int(cfg["pid"])))
        except Exception as exc:
            warn("rank_figures_unavailable", f"{type(exc).__name__}: {exc}")
    prom = cfg.get("prometheus") or {}
    if prom.get("file") or prom.get("port") is not None:
        try:
            from dlwatch.monitor.prom import PromSink

            sinks.append(PromSink(prom, rank, pid=int(cfg["pid"])))
        except Exception as exc:
            warn("prometheus_unavailable", f"{type(exc).__name__}: {exc}")
    return sinks
