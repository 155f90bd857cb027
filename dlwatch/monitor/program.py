"""`dlwatch run`: one monitor for the whole program, each loader iteration a segment of the run.

The training process sends ``loader_iter`` when an iteration begins (before torch starts its
workers) and ``loader_iter_end`` with the segment's figures.  ``Program`` keeps the live
segments (the newest is the one the loop advances: see ``Watch._credit``), a row per iteration
and a line per loader for the run summary.
"""

from __future__ import annotations

from typing import Any

from dlwatch.collect.runstats import RunStats
from dlwatch.report.schema import RunSummary

__all__ = ["MAX_ITERATION_ROWS", "MAX_LOADERS", "Program"]

MAX_ITERATION_ROWS = 5000  # rows of the summary's iterations table; later ones are counted only
MAX_LOADERS = 256  # loaders named in the summary (a program that makes one per step: the first)
MAX_LIVE = 1024  # iterations open at once


class Program:
    def __init__(self, program_run: Any = None) -> None:
        self.program_run = program_run if isinstance(program_run, str) else None
        self.segments: dict[int, dict[str, Any]] = {}  # live iterations: number -> loader key, name, config
        self.iteration_rows: list[dict[str, Any]] = []
        self.rows_dropped = 0
        self.loaders: dict[str, dict[str, Any]] = {}

    @property
    def iteration(self) -> int | None:
        """The live iteration (segment) started last: the one the loop advances (see Watch._credit)."""
        return max(self.segments) if self.segments else None

    def begins(self, ev: dict[str, Any]) -> dict[str, Any] | None:
        """A ``loader_iter`` event: the segment is live.  Returns it (its loader key, name and the
        loader's configuration), or None for an event it cannot use."""
        n, key = ev.get("iteration"), ev.get("loader")
        if not isinstance(n, int) or isinstance(n, bool) or not isinstance(key, str) or len(self.segments) >= MAX_LIVE:
            return None
        config = ev.get("config") if isinstance(ev.get("config"), dict) else None
        name = ev.get("name") if isinstance(ev.get("name"), str) else None
        seg = self.segments[n] = {"loader": key[:64], "name": (name or "")[:128], "config": config}
        entry = self.loaders.get(key[:64])
        if entry is None and len(self.loaders) < MAX_LOADERS:
            entry = self.loaders[key[:64]] = {
                "loader": key[:64],
                "name": (name or "")[:128],
                "class": (config or {}).get("class"),
                "num_workers": (config or {}).get("num_workers"),
                "persistent_workers": (config or {}).get("persistent_workers"),
                "iterations": 0,
                "batches": 0,
                "config": config,  # its settings, as at its first iteration (the summary's `loader` is the last's)
            }
        if entry is not None:
            entry["iterations"] += 1
        return seg

    def ends(self, ev: dict[str, Any], runstats: RunStats) -> None:
        """A ``loader_iter_end`` event: the segment's row (its figures: ``RunStats.iteration_row``)."""
        n = ev.get("iteration")
        seg = self.segments.pop(n, None) if isinstance(n, int) and not isinstance(n, bool) else None
        if seg is None:
            return
        entry = self.loaders.get(seg["loader"])
        epoch = entry.get("rows", 0) if entry is not None else 0
        row = runstats.iteration_row(n, seg["loader"], seg["name"], epoch, ev)
        if entry is not None:
            entry["rows"] = epoch + 1
            entry["batches"] += row["batches"]
        if len(self.iteration_rows) < MAX_ITERATION_ROWS:
            self.iteration_rows.append(row)
        else:
            self.rows_dropped += 1

    def summary(self, s: RunSummary, runstats: RunStats) -> RunSummary:
        """The program's keys of the summary: its loaders and a row per iteration (new keys only)."""
        for n in sorted(self.segments):  # iterations whose end never came (the process was killed)
            self.ends({"iteration": n}, runstats)
        notes = list(s.notes or ())
        if self.rows_dropped:
            notes.append(f"{self.rows_dropped} later iterations are counted, not listed")
        if runstats.workers_unlisted:
            notes.append(f"{runstats.workers_unlisted} workers of later iterations are counted, not listed")
        loop = dict(s.loop or {})
        loop["iterations"] = sum(e["iterations"] for e in self.loaders.values())
        return s.replace(
            program=True,
            program_run=self.program_run,
            loaders=[{k: v for k, v in e.items() if k != "rows"} for e in self.loaders.values()],
            # in the order the iterations began (a kept iterator ends only at the next iter() or at exit)
            iterations=sorted(self.iteration_rows, key=lambda r: r.get("iteration") or 0),
            notes=notes,
            loop=loop,
        )
