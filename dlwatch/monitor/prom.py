"""Prometheus metrics of a watched run: opt-in, nothing listens or is written by default.

Two ways, either or both, chosen by environment variables of the training process:

- ``DLWATCH_PROM_FILE=/path/to/textfile_dir/dlwatch.prom``: a node_exporter textfile,
  rewritten atomically every poll.  Several ranks (and jobs) on one host never
  overwrite each other: each training process writes its own file next to the path,
  ``dlwatch.rank<RANK>.<pid>.prom`` (``dlwatch.<pid>.prom`` outside a job), and removes
  it when its run ends.  The file is private (0600), like every file dlwatch makes:
  node_exporter must run as the same user or root to read it.  The directory must pass
  the report-directory rules (``_fs.check_shared_dir``: yours or root's, not writable by
  group or others unless sticky, not a link); otherwise one warning and no textfile.
- ``DLWATCH_PROM_PORT=9400``: an HTTP endpoint on 127.0.0.1 only, at that port plus
  ``LOCAL_RANK`` (so the ranks of one host do not collide).

The exposition format is ``prometheus_client``'s (an optional dependency:
``pip install 'dlwatch[prometheus]'``), imported only when one of these is set.
Labels: ``job_id`` and ``rank`` on every metric (``job_id`` rather than ``job``: Prometheus
sets ``job`` itself on every scraped series), ``role``, ``worker`` and ``pid`` on the
per-process ones.  See docs/prometheus.md for the metric list and a Grafana query.
"""

from __future__ import annotations

import os
import threading
from typing import Any, Iterator, Mapping

from dlwatch._fs import check_shared_dir, replace_private
from dlwatch.report.rankfigures import figures
from dlwatch.monitor.sinks import PollState, Sink
from dlwatch.wire.config import PROM_ENV_FILE as ENV_FILE, PROM_ENV_PORT as ENV_PORT, prom_options

__all__ = ["ENV_FILE", "ENV_PORT", "PromSink", "prom_options", "textfile_path"]

BIND_ADDR = "127.0.0.1"


def textfile_path(path: str, rank: Mapping[str, Any], pid: int) -> str:
    """This process's own file next to ``path``: ``<stem>.rank<R>.<pid>.prom`` or ``<stem>.<pid>.prom``."""
    stem = path[: -len(".prom")]
    r = rank.get("rank")
    return f"{stem}.rank{r}.{pid}.prom" if isinstance(r, int) else f"{stem}.{pid}.prom"


def _label(value: Any) -> str:
    return "" if value is None else str(value)[:128]


class _Collector:
    """Yields the metric families of the latest PollState (swapped in whole, read whole)."""

    def __init__(self, rank: Mapping[str, Any]) -> None:
        self.rank = rank
        self.state: PollState | None = None

    def describe(self) -> list[Any]:
        return []  # no up-front description: the registry then never calls collect() at register time

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        st = self.state
        if st is None:
            return
        base_names = ["job_id", "rank"]
        base = [_label(self.rank.get("job_id")), _label(self.rank.get("rank"))]
        info = GaugeMetricFamily(
            "dlwatch_rank_info",
            "one per watched training process",
            labels=[*base_names, "local_rank", "world_size", "pid"],
        )
        info.add_metric(
            [*base, _label(self.rank.get("local_rank")), _label(self.rank.get("world_size")), str(st.pid)], 1
        )
        yield info
        fig = figures(st.heartbeat)
        counters = (
            ("dlwatch_batches", "batches handed out by the watched loader", fig["batches"]),
            ("dlwatch_epochs", "epochs started", fig["epochs"]),
            ("dlwatch_data_wait_seconds", "time spent inside next(loader)", fig["data_wait_s"]),
            ("dlwatch_step_seconds", "time spent in the loop body", fig["step_s"]),
            ("dlwatch_stalls", "stalls detected in this run", st.stalls),
            ("dlwatch_incidents", "incidents written by this run", st.incidents),
        )
        for name, doc, value in counters:
            c = CounterMetricFamily(name, doc, labels=base_names)
            c.add_metric(base, float(value))
            yield c
        gauges: list[tuple[str, str, Any]] = [
            ("dlwatch_data_wait_share", "share of the loop's time spent waiting for data", fig["data_wait_share"]),
            ("dlwatch_stalled", "1 while a detected stall lasts", 1 if st.stalled else 0),
        ]
        if st.system is not None:
            gauges += [
                ("dlwatch_shm_free_bytes", "free bytes in /dev/shm", st.system.shm_free),
                ("dlwatch_shm_size_bytes", "size of /dev/shm", st.system.shm_total),
            ]
        for name, doc, value in gauges:
            if value is None:
                continue
            g = GaugeMetricFamily(name, doc, labels=base_names)
            g.add_metric(base, float(value))
            yield g
        per_proc = (
            ("dlwatch_process_open_fds", "open file descriptors", "num_fds"),
            ("dlwatch_process_max_fds", "soft limit on open file descriptors", "fd_limit"),
            ("dlwatch_process_resident_memory_bytes", "resident set size (RSS)", "rss"),
            ("dlwatch_process_unique_memory_bytes", "unique set size (USS), slow cadence", "uss"),
            ("dlwatch_process_shm_bytes", "bytes of /dev/shm mapped, slow cadence", "shm_map_bytes"),
        )
        labels = [*base_names, "role", "worker", "pid"]
        for name, doc, attr in per_proc:
            g = GaugeMetricFamily(name, doc, labels=labels)
            for p in st.procs:
                value = getattr(p.sample, attr, None)
                if value is None:
                    continue
                worker = "main" if p.role == "main" else _label(p.worker_id) if p.role == "worker" else p.role
                g.add_metric([*base, p.role, worker, str(p.pid)], float(value))
            yield g


class PromSink(Sink):
    name = "prometheus"

    def __init__(self, options: Mapping[str, Any], rank: Mapping[str, Any], *, pid: int) -> None:
        from prometheus_client import CollectorRegistry

        self.registry = CollectorRegistry(auto_describe=False)
        self.collector = _Collector(dict(rank))
        self.registry.register(self.collector)  # type: ignore[arg-type]
        self.path: str | None = None
        self.server: Any = None
        self._lock = threading.Lock()
        if options.get("file"):
            path = textfile_path(str(options["file"]), rank, pid)
            # the report-directory rules: a directory another user can change could be swapped for a link
            check_shared_dir(os.path.dirname(path))
            self.path = path
        port = options.get("port")
        if port is not None:
            from prometheus_client import start_http_server

            local = rank.get("local_rank")
            bound = int(port) + (local if isinstance(local, int) else 0)
            started = start_http_server(bound, addr=BIND_ADDR, registry=self.registry)
            self.server = started[0] if isinstance(started, tuple) else None
            self.port = bound

    def on_poll(self, state: PollState) -> None:
        self.collector.state = state
        if self.path is not None:
            from prometheus_client import generate_latest

            replace_private(self.path, generate_latest(self.registry), fsync=False)

    def close(self, state: PollState | None, *, clean: bool) -> None:
        if self.path is not None:
            try:
                os.unlink(self.path)  # a finished run's figures are not current: no stale series
            except OSError:
                pass
        if self.server is not None:
            try:
                self.server.shutdown()
                self.server.server_close()
            except Exception:
                pass
