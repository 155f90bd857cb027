"""What the monitor is told once, at its start: the run directory's ``config.json``, read and typed.

The training process writes ``config.json`` (``dlwatch.wire.config``); the monitor reads it here
and nowhere else, so that every room of the monitor (sampling, incidents, the program's segments,
the run summary) takes the same values from one frozen object.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any, Mapping

from dlwatch.report import store
from dlwatch.wire.config import DEFAULT_KEEP_RUNS

__all__ = ["Settings"]


@dataclass(frozen=True)
class Settings:
    run_dir: str
    cfg: Mapping[str, Any]  # config.json as written (keys the monitor does not type stay readable)
    main_pid: int  # the training process
    own_pid: int  # this monitor
    poll_interval: float
    stall_timeout: Any  # None: adaptive (dlwatch.detect.stall); checked by config.resolve
    body_timeout: Any
    playbook_dirs: tuple[str, ...]
    keep_runs: int
    report_dir: str
    ignore: tuple[str, ...]
    rank: Mapping[str, Any]  # which rank of which job (read by the training process: dlwatch.wire.job)
    started_at: float
    program: bool  # `dlwatch run`: one monitor for the whole program, each loader iteration a segment

    @classmethod
    def load(cls, run_dir: str) -> "Settings":
        with open(os.path.join(run_dir, "config.json"), "rb") as f:
            cfg: dict[str, Any] = json.loads(f.read())
        opts = cfg.get("options") or {}
        keep = opts.get("keep_runs")  # validated by config.resolve in the training process
        rank = cfg.get("rank")
        return cls(
            run_dir=run_dir,
            cfg=cfg,
            main_pid=int(cfg["pid"]),
            own_pid=os.getpid(),
            poll_interval=float(opts.get("poll_interval") or 1.0),
            stall_timeout=opts.get("stall_timeout"),
            body_timeout=opts.get("body_timeout"),
            playbook_dirs=tuple(opts.get("playbooks") or ()),
            keep_runs=keep if isinstance(keep, int) and not isinstance(keep, bool) and keep >= 0 else DEFAULT_KEEP_RUNS,
            report_dir=cfg.get("report_dir") or opts.get("report_dir") or "./dlwatch-reports",
            ignore=tuple(str(i) for i in opts.get("ignore") or () if isinstance(i, str)),
            rank=dict(rank) if isinstance(rank, dict) else store.rank_info(),
            started_at=float(cfg.get("started_at") or time.time()),
            program=cfg.get("program") is True,
        )

    @property
    def options(self) -> Mapping[str, Any]:
        return self.cfg.get("options") or {}

    @property
    def hb_path(self) -> str:
        return os.path.join(self.run_dir, "heartbeat")

    @property
    def dumps_dir(self) -> str:
        return os.path.join(self.run_dir, "dumps")

    @property
    def run_id(self) -> str:
        return os.path.basename(os.path.normpath(self.run_dir))

    def incident_config(self) -> dict[str, Any]:
        """The ``config`` object of every incident of this run."""
        config = {k: self.options.get(k) for k in ("poll_interval", "stall_timeout")}
        config["report_dir"] = self.report_dir
        if self.cfg.get("program_run"):  # every iteration of one `dlwatch run` shares it
            config["program_run"] = self.cfg["program_run"]
        return config
