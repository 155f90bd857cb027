"""The run summary the monitor writes when the block (or the program) ends: never an incident.

Its figures are fed every poll (``collect.runstats.RunStats``); advice (a detector's, or an
event the training process sent) and the preflight findings are kept here by playbook id, the
first of each.  ``write`` makes ``runs/<run-id>/summary.json`` and its renderings
(``report.build.write_run_summary``) and leaves the path where the training process finds it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any, Callable, Iterable

from dlwatch.collect.gpu import GpuProbe, gpu_notes
from dlwatch.collect.runstats import RunStats
from dlwatch.monitor.journal import Journal, Notes
from dlwatch.monitor.program import Program
from dlwatch.monitor.settings import Settings
from dlwatch.redact import outbound
from dlwatch.report import build
from dlwatch.report.schema import Finding
from dlwatch.wire import heartbeat as hbmod

__all__ = ["Summary"]

MAX_KEPT = 64  # advice (and preflight) findings kept, by playbook id


class Summary:
    def __init__(self, settings: Settings, notes: Notes, journal: Journal) -> None:
        self.settings = settings
        self.notes = notes
        self.journal = journal
        self.runstats = RunStats(started_at=settings.started_at)
        self.advice: dict[str, dict[str, Any]] = {}
        self.preflight: dict[str, dict[str, Any]] = {}

    def keep_advice(self, sig: dict[str, Any]) -> None:
        """An advice signal (a detector's, or an event from the training process): for the summary only.

        ``stage: "preflight"`` marks the training process's checks made before the workers started.
        The first signal of a playbook id is kept, noted like any event (timeline, later reports).
        """
        pid = sig.get("playbook")
        if not isinstance(pid, str) or not pid or pid in self.settings.ignore:
            return
        kept = self.preflight if sig.get("stage") == "preflight" else self.advice
        if pid in kept or len(kept) >= MAX_KEPT:
            return
        kept[pid] = dict(sig)
        # in the timeline and in every later report's events: a stall after fork-with-threads shows both
        self.journal.note({"ts": time.time(), **{k: v for k, v in sig.items() if k != "kind"}})

    def write(
        self,
        ended: str,
        *,
        heartbeat: hbmod.Heartbeat | None,
        loader: Any,
        playbooks: Iterable[Any],
        incidents: Iterable[str],
        gpu: GpuProbe | None,
        detectors: Iterable[Any],
        program: Program | None,
        on_finish: Callable[[dict[str, Any]], None],
    ) -> str | None:
        """The run summary (figures, advice, preflight) next to the incidents; None when not written.

        ``on_finish`` runs the detectors' ``on_finish`` over the summary's figures (advice comes back
        through ``keep_advice``)."""
        cfg = self.settings.cfg
        try:
            from dlwatch.detect.advice import not_judged, to_finding
            from dlwatch.report import summary as sm

            now = time.time()
            figures = self.runstats.figures(heartbeat, now)
            s = sm.new_summary(
                run_id=self.settings.run_id,
                pid=self.settings.main_pid,
                now=now,
                started_at=cfg.get("started_at"),
            ).replace(
                ended=ended,
                rank=self.settings.rank,  # the rank the training process read (see dlwatch.wire.job)
                loader=loader,
                cpus=cfg.get("cpus"),
                accelerator=cfg.get("accelerator"),
                **{key: figures[key] for key in ("loop", "workers", "main", "peaks")},
            )
            on_finish(s.to_dict())
            pbs = tuple(playbooks)
            advice = sorted((to_finding(a, pbs) for a in self.advice.values()), key=lambda f: -f["confidence"])
            gpu_said, quiet = gpu_notes(gpu)
            unjudged = [
                u for u in not_judged(detectors, s.to_dict(), loader or {}) if u["playbook"] not in self.settings.ignore
            ]
            s = s.replace(
                advice=tuple(Finding.from_dict(f) for f in advice),
                preflight=tuple(Finding.from_dict(to_finding(a, pbs)) for a in self.preflight.values()),
                incidents=[os.path.basename(p) for p in incidents],
                notes=list(self.notes) + gpu_said,
                **({"quiet_notes": quiet} if quiet else {}),  # shown to people with -v only
                # the advisors a run too short could not feed, and the minimum each missed
                **({"advice_not_judged": unjudged} if unjudged else {}),
            )
            if program is not None:  # `dlwatch run`: the whole program, a row per loader iteration
                s = program.summary(s, self.runstats)
        except Exception as exc:
            self.notes.warn_once("summary_failed", f"{type(exc).__name__}: {exc}")
            return None
        # runs/<id>/ with its report.html (drawn in a short-lived child from our timeline files, handed
        # to it open: our run directory goes when the block ends); the oldest beyond keep_runs go
        run_dir = self.settings.run_dir
        path = build.write_run_summary(
            s, self.settings.report_dir, keep_runs=self.settings.keep_runs, timeline_dir=run_dir
        )
        if path is None:
            return None
        try:  # where the training process finds it for Watch.summary (its own private run dir)
            from dlwatch._fs import write_private

            write_private(os.path.join(run_dir, "summary"), path + "\n")
        except OSError:
            pass
        line = sm.pointer_line(s, path)
        if line and os.environ.get("DLWATCH_QUIET", "").strip().lower() not in ("1", "true", "yes", "on"):
            print(outbound(line), file=sys.stderr, flush=True)
        return path
