"""The monitor's incidents: assembled from what it sampled and noted, judged, and written.

One room for every incident the monitor writes (``report.build`` makes and writes each one):

- ``threshold``: a detector's signal, one incident per run and playbook, as soon as it is seen;
- ``stall``: the loop made no progress within its allowance (``detect.stall``): the stall
  procedure (``monitor.forensics``) takes every process's stacks, one incident per stall site;
- ``interrupt``: a Ctrl-C after a long wait (``wire.interrupt``), then the training process's
  wait is answered;
- ``exception``: an exception the training process sent;
- ``exit``: the training process vanished without leaving the block (the judgement of OOM kill
  against vanished is ``detect.process_exit``'s).

A later incident whose top finding a threshold incident already reported names it (``related``).
One event is one incident: a threshold incident is held ``THRESHOLD_HOLD_S`` before it is written,
and an exception or stall of the same failure in that time (fds at the limit, then "Too many open
files" a moment later) is written alone, the threshold noted in it.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

from dlwatch._fs import open_private
from dlwatch._log import get_logger
from dlwatch.collect import procfs
from dlwatch.collect.gpu import gpu_notes
from dlwatch.detect.process_exit import ExitVerdict
from dlwatch.detect.stall import StallDetector, StallEvent, stall_site
from dlwatch.model import ProcSample, StackDump
from dlwatch.monitor.journal import Journal, Notes
from dlwatch.monitor.sampling import Sampler, Tracked
from dlwatch.monitor.settings import Settings
from dlwatch.redact import outbound
from dlwatch.report import build
from dlwatch.report.schema import Incident, ProcessEntry
from dlwatch.wire import heartbeat as hbmod
from dlwatch.wire import interrupt

__all__ = ["Incidents", "interrupt_site"]

log = get_logger("dlwatch.monitor")


THRESHOLD_HOLD_S = 2.0  # a threshold incident waits this long for the exception or stall it may turn into


class Incidents:
    def __init__(
        self,
        settings: Settings,
        notes: Notes,
        sampler: Sampler,
        journal: Journal,
        stall: StallDetector,
        playbooks: tuple[Any, ...] | None,
    ) -> None:
        self.settings = settings
        self.notes = notes
        self.sampler = sampler
        self.journal = journal
        self.stall_detector = stall
        self.playbooks = playbooks  # loaded once; None: reports load them
        self.exception: dict[str, Any] | None = None  # sent by the training process, not yet reported
        self.paths: list[str] = []  # every incident written, in order
        self.reported_playbooks: set[str] = set()
        self.warned_in: dict[str, str] = {}  # playbook -> the threshold incident that reported it first
        self.fired: set[str] = set()  # threshold signals already turned into an incident attempt
        self.stall_sites: set[tuple[Any, ...]] = set()  # one incident per stall site and run
        # threshold incidents held for THRESHOLD_HOLD_S: (when to write, the report, its playbook, when seen)
        self.held: list[tuple[float, Incident, str, float]] = []

    # ------------------------------------------------------------------ the triggers

    def threshold(self, ev: dict[str, Any]) -> None:
        """A failure that raises nothing: one incident per run and playbook, as soon as it is seen."""
        key = str(ev.get("signal") or ev.get("event"))
        if key in self.fired:
            return
        self.fired.add(key)
        if ev not in self.journal.notable:
            self.journal.note(ev)
        report = self.report("threshold")
        findings = report.findings or ()
        fresh = [f for f in findings if f.playbook not in self.reported_playbooks]
        if not fresh:
            return  # a signal no (new) playbook claims stays in the timeline, not in a report
        self.reported_playbooks.add(str(fresh[0].playbook))
        report = report.replace(
            findings=tuple(fresh + [f for f in findings if f not in fresh]),
            summary=f"{fresh[0].title} (seen before any error)",
        )
        # held a moment: an exception or stall of the same failure right after it is the same event
        self.held.append((time.monotonic() + THRESHOLD_HOLD_S, report, str(fresh[0].playbook), time.time()))

    def flush(self, *, all_held: bool = False) -> None:
        """Write the threshold incidents whose hold is over (every one with ``all_held``: the run ends)."""
        now = time.monotonic()
        due = [h for h in self.held if all_held or h[0] <= now]
        if not due:
            return
        self.held = [h for h in self.held if h not in due]
        for _, report, playbook, _ in due:
            path = self._write(report)
            if path is not None:
                self.warned_in[playbook] = os.path.basename(path)

    def _absorb(self, report: Incident) -> Incident:
        """An exception or stall whose top finding a held threshold incident names: that incident is not
        written; this one says the threshold was crossed first.  Other held ones are written first, in order."""
        if not self.held or report.trigger == "threshold":
            return report
        findings = report.findings or ()
        top = str(findings[0].playbook) if findings else None
        same = [h for h in self.held if h[2] == top]
        self.held = [h for h in self.held if h[2] != top]
        self.flush(all_held=True)
        if not same:
            return report
        _, _, playbook, seen = same[0]
        ago = max(0.0, time.time() - seen)
        when = time.strftime("%H:%M:%S", time.localtime(seen))
        return report.with_notes(
            f"{playbook} crossed its threshold at {when}, {ago:.1f} s before this {report.trigger}: "
            "one event, one incident (no threshold incident was written for it)"
        )

    def stall(self, ev: StallEvent, segment: tuple[Any, ...] = ()) -> None:
        """The stall procedure and its incident; ``segment`` (`dlwatch run`: the iteration) is part
        of the stall site: one incident per site and iteration (each was a run of its own)."""
        self.sampler.discover()  # every process of the tree, not only those seen at the last scan
        report = self.report("stall", findings=False)
        report = report.replace(
            progress={
                **(report.progress or {}),
                "stall_s": round(ev.stall_s, 3),
                "stall_timeout_s": ev.timeout_s,
                "stall_allowance": ev.allowance,
            }
        )
        stall_note = {
            "ts": time.time(),
            "event": "stall",
            "stall_s": round(ev.stall_s, 3),
            "timeout_s": ev.timeout_s,
            "state": ev.state,
            "allowance": ev.allowance,
        }
        self.journal.note(stall_note)
        extra: dict[str, bytes] = {}
        try:
            from dlwatch.monitor import forensics

            report, extra = forensics.investigate(
                report,
                self.sampler.procs,
                main_waiting_for_data=(ev.state == "waiting_for_data"),
                expected_workers=self.sampler.expected_workers(),
            )
        except ImportError:
            report = report.with_notes("stack forensics unavailable in this build")
        except Exception as exc:
            report = report.with_notes(f"stack forensics failed: {type(exc).__name__}: {exc}")
        report = self.add_findings(report.replace(events=self.journal.events()))
        site = (*segment, *stall_site(report.to_dict()))
        stall_note["classification"] = report.classification
        if site in self.stall_sites:
            # the same hang again (same verdict, same waiting frames): the timeline has it, one report is enough
            self.journal.timeline_only(
                {"ts": time.time(), "event": "stall_repeated", "classification": report.classification}
            )
            return
        self.stall_sites.add(site)
        self.write(report, extra)

    def exception_incident(self) -> None:
        """The exception the training process sent, reported (one incident per exception)."""
        if self.exception is None:
            return
        self.write(self.report("exception"))
        self.exception = None

    def interrupt(self, ev: dict[str, Any]) -> None:
        """A Ctrl-C after a long wait (dlwatch.wire.interrupt): an incident when the wait reached
        ``SHARE`` of its stall allowance and no stall incident covers it; then the training process's
        wait ends (the ack), whatever happened here."""
        try:
            self._interrupt_incident(ev)
        except Exception as exc:
            self.notes.warn_once("interrupt_failed", f"{type(exc).__name__}: {exc}")
        finally:
            interrupt.answer(interrupt.ack_path(self.settings.run_dir, int(ev["seq"])))

    def exit(self, verdict: ExitVerdict) -> None:
        """The training process ended without leaving the block: the ``exit`` incident."""
        main_pid = self.settings.main_pid
        report = self.report("exit", findings=False).replace(
            exit_cause=verdict.cause, summary=f"the training process (pid {main_pid}) {verdict.text}"
        )
        alive = self.sampler.live_workers()
        if alive:
            report = report.with_notes(f"worker processes still alive after the training process ended: {alive}")
        self.write(self.add_findings(report.replace(events=self.journal.events())))

    # ------------------------------------------------------------------ interrupt

    def _interrupt_incident(self, ev: dict[str, Any]) -> None:
        where, waited = str(ev["where"]), float(ev["waited_s"])
        kind = interrupt.kind(where, ev.get("first_batch") is True)
        allowance = self.stall_detector.allowance(kind, time.monotonic())
        note = {
            "ts": time.time(),
            "event": "interrupted",
            "state": where,
            "waited_s": round(waited, 3),
            "allowance_s": allowance,
        }
        if self.stall_detector.stalled:  # one hang, one incident: the stall's is written
            self.journal.note({**note, "incident": "the stall's"})
            return
        if waited < interrupt.SHARE * allowance:
            self.journal.note({**note, "incident": None})
            return
        self.journal.note({**note, "incident": "interrupt"})
        self.stall_detector.hold()  # the incident covers this wait: no stall incident for it afterwards
        self.sampler.discover()
        report = self.report("interrupt", findings=False)
        report = report.replace(
            progress={
                **(report.progress or {}),
                "interrupted_after_s": round(waited, 3),
                "interrupted_in": where,
                "stall_timeout_s": allowance,
                "stall_allowance": "body" if kind == "body" else "data",
            }
        )
        extra: dict[str, bytes] = {}
        frames = ev.get("frames") or []
        main_pid = self.settings.main_pid
        try:
            from dlwatch.monitor import forensics

            report, extra = forensics.investigate(
                report,
                self.sampler.procs,
                main_waiting_for_data=where == interrupt.WAITING,
                expected_workers=self.sampler.expected_workers(),
                main_thread=(main_pid, frames, int(ev.get("frames_omitted") or 0)) if frames else None,
                exited=self._before_interrupt(ev),
                at_signal=self._sigint_stacks,
            )
        except ImportError:
            report = report.with_notes("stack forensics unavailable in this build")
        except Exception as exc:
            report = report.with_notes(f"stack forensics failed: {type(exc).__name__}: {exc}")
        report = self._interrupt_verdict(report, where, waited, frames)
        self.write(self.add_findings(report.replace(events=self.journal.events())), extra)

    def _before_interrupt(self, ev: dict[str, Any]) -> dict[int, tuple[ProcSample, ProcSample]]:
        """Each process but the main: its last two reads before the Ctrl-C (at least a second apart
        where the history allows), for the ones that the interrupt ended (a terminal signals the
        whole process group; torch's workers exit)."""
        from dlwatch.monitor.forensics import SECOND_READ_AFTER_S

        cut = float(ev.get("ts") or time.time()) - 0.02  # reads after the signal may show the exit itself
        out: dict[int, tuple[ProcSample, ProcSample]] = {}
        for pid, t in self.sampler.procs.items():
            if pid == self.settings.main_pid:
                continue
            seen = [s for s in t.history if not s.gone and s.ts <= cut]
            if len(seen) < 2:
                continue
            last = seen[-1]
            first = next((s for s in reversed(seen[:-1]) if last.ts - s.ts >= SECOND_READ_AFTER_S), seen[0])
            out[pid] = (first, last)
        return out

    def _sigint_stacks(self, pid: int) -> StackDump | None:
        """The stacks worker ``pid`` wrote as SIGINT reached it (dlwatch.wire.dumps.install_interrupt), or None."""
        from dlwatch.collect.faultdump import read_interrupt
        from dlwatch.wire.dumps import interrupt_path

        return read_interrupt(interrupt_path(self.settings.dumps_dir, pid), pid)

    def _interrupt_verdict(self, report: Incident, where: str, waited: float, frames: list[dict[str, Any]]) -> Incident:
        """What the main process did is in its traceback, not in /proc: it waits for this report now."""
        at = interrupt_site(frames)
        workers = [p for p in report.processes or () if p.role == "worker" and p.status not in (None, "gone")]
        if where == interrupt.BODY:
            states = ", ".join(sorted({str(p.status) for p in workers}))
            return report.replace(
                classification="main-blocked",
                classification_reason=(
                    f"the loop body ran {waited:.0f} s without asking for a batch when Ctrl-C stopped it{at}"
                    + (f"; workers: {states}" if workers else "; no live workers")
                ),
            )
        if not workers and not self.sampler.expected_workers():
            return report.replace(
                classification=None,
                classification_reason=(
                    f"no workers: the main process had loaded data itself for {waited:.0f} s when Ctrl-C "
                    f"stopped it{at}; that wait ended with the interrupt, its state cannot be observed"
                ),
            )
        return report

    # ------------------------------------------------------------------ assembly

    def add_findings(self, report: Incident) -> Incident:
        return build.add_findings(
            report, self.settings.playbook_dirs, playbooks=self.playbooks, ignore=self.settings.ignore
        )

    def report(self, trigger: str, *, findings: bool = True) -> Incident:
        s = self.sampler
        notes = list(self.notes)
        ended = self._earlier_workers()
        if ended:
            notes.append(
                f"{len(ended)} worker(s) of earlier epochs or iterations ended with them (no signal, no crash): "
                "not listed among the processes"
            )
        gpu_said, quiet = gpu_notes(s.gpu)
        notes.extend(gpu_said)
        if self.journal.timeline.failed:
            notes.append(self.journal.timeline.failed)
        report = build.incident(
            trigger,
            self.settings.main_pid,
            now=time.time(),
            rank=self.settings.rank,
            loader=s.loader,
            config=self.settings.incident_config(),
            progress=self._progress(s.last_hb, self.stall_detector.body_until),
            exception=self.exception if trigger == "exception" else None,
            processes=[self._proc_entry(t) for t in s.procs.values() if t.pid not in ended],
            system=s.last_system.to_dict() if s.last_system else None,
            gpus=[g.to_dict() for g in s.last_gpus],
            events=self.journal.notable,
            timeline=self.journal.records(),
            notes=notes,
            quiet_notes=quiet,
        )
        return self.add_findings(report) if findings else report

    def _earlier_workers(self) -> set[int]:
        """Workers gone with an earlier epoch or iteration: not the current iterator's, ended without a
        signal or a crash (torch shut them down as their epoch ended).  An epoch-1 incident listed epoch
        0's workers as "gone", as if they had died."""
        s = self.sampler
        if not s.loader_pids:
            return set()
        out = set()
        for t in s.procs.values():
            if t.role != "worker" or not t.gone or t.pid in s.loader_pids or t.crash is not None:
                continue
            status = next((x.exit_code for x in reversed(t.history) if x.exit_code is not None), None)
            if status in (None, 0):
                out.add(t.pid)
        return out

    @staticmethod
    def _progress(hb: hbmod.Heartbeat | None, body_until: float) -> dict[str, Any]:
        if hb is None:
            return {"batches": 0, "epochs": 0}
        out: dict[str, Any] = hb.progress(time.monotonic(), body_until)  # the wait going on counted
        if hb.ts_last_batch:
            out["last_batch_age_s"] = round(time.monotonic() - hb.ts_last_batch, 3)
            out["last_batch_ts"] = round(time.time() - (time.monotonic() - hb.ts_last_batch), 3)
        return out

    @staticmethod
    def _proc_entry(t: Tracked) -> ProcessEntry:
        last = t.last
        sample = build.compact(last.to_dict()) if last else None
        if sample and "fds" not in sample and t.last_fds is not None:
            sample["fds"] = t.last_fds.to_dict()
        if sample and t.gone:
            sample["gone"] = True
        crash = {k: t.crash.get(k) for k in ("signal", "fatal_error")} if t.crash is not None else None
        return build.process(
            t.pid,
            t.role,
            worker_id=t.worker_id,
            start_method=t.start_method,
            name=last.name if last else None,
            cmdline=procfs.cmdline(t.pid) if not t.gone else None,
            sample=sample,
            crash=crash,
            stack=t.crash.get("stack") if t.crash is not None else None,
            status="gone" if t.gone else None,
        )

    def _link_earlier(self, report: Incident) -> Incident:
        """One failure, one incident: a later incident whose top finding a threshold incident of this
        run already reported names that incident (``related``; its summary line and notes say so)."""
        findings = report.findings or ()
        first = self.warned_in.get(str(findings[0].playbook)) if findings and report.trigger != "threshold" else None
        if first is None:
            return report
        playbook = str(findings[0].playbook)
        return report.replace(
            related=[{"id": first, "trigger": "threshold", "playbook": playbook, "relation": "seen-before"}],
            notes=(
                *(report.notes or ()),
                f"{playbook} was first reported by the threshold incident {first}: the same failure",
            ),
        )

    def write(self, report: Incident, extra: dict[str, bytes] | None = None) -> str | None:
        return self._write(self._absorb(report), extra)

    def _write(self, report: Incident, extra: dict[str, bytes] | None = None) -> str | None:
        report = self._link_earlier(report)
        try:
            path = build.write(report, self.settings.report_dir, extra_files=extra)
        except Exception as exc:
            log.warning("report_write_failed", error=f"{type(exc).__name__}: {exc}")
            print(outbound(f"dlwatch: could not write the {report.trigger} report: {exc}"), file=sys.stderr)
            return None
        self.paths.append(path)
        top = report.findings[0].playbook if report.findings else "no playbook matched"
        related = report.extra.get("related")
        if related:
            top = f"{top}, first seen in {related[0]['id']}"
        job = report.job
        if job is not None and job.role == "waiting":  # the cause is another rank's: say where to look
            top = f"this rank waits in {job.waiting_in}; the whole job: {job.view}"
        print(outbound(f"dlwatch: {report.trigger} incident ({top}): {path}"), file=sys.stderr, flush=True)
        try:
            fd = open_private(os.path.join(self.settings.run_dir, "incidents"))  # 0600, like every file
            try:
                os.write(fd, (path + "\n").encode("utf-8", "surrogateescape"))
            finally:
                os.close(fd)
        except OSError:
            pass
        return path


def _library(filename: str) -> bool:
    return (
        filename.startswith("<")
        or any(part in filename for part in ("/site-packages/", "/dist-packages/"))
        or ("/lib/python3" in filename and "/site-packages/" not in filename)
    )


def interrupt_site(frames: list[dict[str, Any]]) -> str:
    """Where a Ctrl-C landed, for a reason line: the program's innermost frame and, when the
    interrupt landed deeper (in torch or the standard library), that frame too."""
    if not frames:
        return ""

    def at(f: dict[str, Any]) -> str:
        return f"{os.path.basename(str(f.get('filename') or '?'))}:{f.get('line') or '?'} in {f.get('function')}()"

    own = next((f for f in frames if not _library(str(f.get("filename") or ""))), None)
    if own is None or own is frames[0]:
        return f", at {at(own or frames[0])}"
    return f", at {at(own)} (inside {at(frames[0])})"
