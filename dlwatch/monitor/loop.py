"""The monitor process: ``python -m dlwatch.monitor.loop RUN_DIR``.  Imports no torch.

Started by ``watch`` as a child of the training process.  Every poll it reads the
heartbeat and new events, samples the training process, its workers and the
system, appends to the timeline, and runs the detectors.  It writes incidents
for exceptions, stalls, crossed thresholds, and for a training process that
vanished without leaving the watch block; it exits when the block ends, or by
itself when the training process is gone (it is reparented then), so it is
never left behind.

``Monitor`` is the loop and what it hands where; the work is done in its rooms:
``sampling`` (what is read), ``incidents`` (what is reported), ``program`` (`dlwatch run`'s
segments), ``runsummary`` (the run summary), ``journal`` (timeline and notes), ``settings``.
"""

from __future__ import annotations

import functools
import os
import select
import shutil
import signal
import sys
import time
from typing import Any, Callable, ClassVar, Mapping

from dlwatch._log import configure_own_process
from dlwatch.detect import registry
from dlwatch.detect.base import NOTE_EVENTS, Detector
from dlwatch.detect.process_exit import judge_exit
from dlwatch.detect.stall import StallDetector
from dlwatch.monitor import timeline as timeline_record
from dlwatch.monitor.incidents import Incidents
from dlwatch.monitor.journal import Journal, Notes
from dlwatch.monitor.program import Program
from dlwatch.monitor.runsummary import Summary
from dlwatch.monitor.sampling import Sampler
from dlwatch.monitor.settings import Settings
from dlwatch.redact import outbound
from dlwatch.wire import contract
from dlwatch.wire.events import EventReader


class Monitor:
    def __init__(self, run_dir: str) -> None:
        self.settings = settings = Settings.load(run_dir)
        self.run_dir = run_dir
        self.main_pid = settings.main_pid
        self.notes = Notes()
        self.sampler = Sampler(settings, self.notes)
        self.procs = self.sampler.procs  # the same table (read by the benchmarks and tests)
        # a failure's own events are type-checked by the schema its module declares
        self.events = EventReader(os.path.join(run_dir, "events.jsonl"), registry.event_schemas())
        self.journal = Journal(run_dir)
        self.stall = StallDetector(settings.stall_timeout, settings.body_timeout)
        self.playbooks: tuple[Any, ...] | None = None  # loaded once; None: reports load them
        try:
            from dlwatch.wire.playbooks import load_playbooks

            self.playbooks = load_playbooks(settings.playbook_dirs)
        except Exception as exc:
            self.notes.add(f"playbooks could not be loaded: {exc}")
        from dlwatch import detect

        self.detectors = detect.build({pb.id: pb.thresholds for pb in self.playbooks or ()}, ignore=settings.ignore)
        self.incidents = Incidents(settings, self.notes, self.sampler, self.journal, self.stall, self.playbooks)
        self.summary = Summary(settings, self.notes, self.journal)
        self.program = Program(settings.cfg.get("program_run")) if settings.program else None
        self._hb_text: tuple[Any, Any, str | None] = (None, None, None)  # (the heartbeat, to_dict, its text)
        self.stop_seen = False
        self.interrupted = False  # the block was left by a KeyboardInterrupt (the stop event says so)
        self.ended: str | None = None  # what the stop event says ended the program
        self.stalls = 0
        self.stalled = False
        from dlwatch.monitor import outputs

        self.sinks = outputs.build(settings.cfg, settings.report_dir, settings.rank, self.notes.warn_once)

    # ------------------------------------------------------------------ loop

    def run(self) -> int:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the training loop; we stop with it
        signal.signal(signal.SIGTERM, lambda *_: setattr(self, "stop_seen", True))
        stdin_open = True
        next_poll = time.monotonic()
        while True:
            timeout = max(0.0, next_poll - time.monotonic())
            if stdin_open:
                try:
                    ready, _, _ = select.select([sys.stdin.buffer], [], [], min(timeout, 0.25))
                    if ready and not os.read(sys.stdin.fileno(), 4096):
                        stdin_open = False  # EOF: not proof of anything (forked workers hold the pipe)
                except (OSError, ValueError):
                    stdin_open = False
            else:
                time.sleep(min(timeout, 0.25))
            self._drain_events()
            self.incidents.flush()  # threshold incidents whose hold is over
            if self.stop_seen:
                self._finish_clean()
                return 0
            if os.getppid() != self.main_pid:
                self._finish_vanished()
                return 0
            if time.monotonic() >= next_poll:
                try:
                    self.poll()
                except Exception as exc:  # one bad poll must not end the watch, nor flood stderr
                    self.notes.warn_once("poll_failed", f"{type(exc).__name__}: {exc}")
                next_poll = time.monotonic() + self.settings.poll_interval

    def poll(self) -> None:
        reading = self.sampler.read()
        s = self.sampler
        hb = reading.heartbeat
        self.summary.runstats.update(hb, s.procs.values(), reading.samples, s.last_system, s.last_gpus)
        # the line straight from the samples, redacted on the way (not to_dict + compact + outbound +
        # json.dumps: 3x the cost of /proc); the ring keeps it as written, an incident decodes it.  An
        # unchanged heartbeat is the same (frozen) object as at the last poll: its text is kept.
        if hb is not None and hb is not self._hb_text[0]:
            hb_dict = hb.to_dict()
            self._hb_text = (hb, hb_dict, timeline_record.heartbeat_text(hb_dict))
        procs = s.procs
        line = timeline_record.sample_line(
            reading.now,
            self._hb_text[1] if hb is not None else None,
            [(x, procs[x.pid].role) for x in reading.samples],
            s.last_system,
            s.last_gpus,
            heartbeat_text=self._hb_text[2] if hb is not None else None,
        )
        self.journal.sample(line)
        self._detect(hb, s.activity(reading.samples))
        self._feed_sinks()

    # ------------------------------------------------------------------ events
    # One handler per event of the watch, keyed by its declaration (dlwatch.wire.contract: what the
    # training process and its workers send); every event then goes to the detectors, which is all
    # that happens to a failure's own events (their module's detector acts on them).

    def _drain_events(self) -> None:
        handlers = _HANDLERS
        for ev in self.events.new():
            handler = handlers.get(ev["event"])
            if handler is not None:
                handler(self, ev)
            self._run_detectors("on_event", ev)

    def _on_stop(self, ev: dict[str, Any]) -> None:
        self.stop_seen = True
        self.interrupted = ev.get("interrupted") is True
        if ev.get("ended") in ("clean", "exception", "interrupted"):
            self.ended = ev["ended"]

    def _on_exception(self, ev: dict[str, Any]) -> None:
        self.incidents.exception = ev.get("exception")

    def _on_loader_iter(self, ev: dict[str, Any]) -> None:
        if self.program is None:
            return
        self._flush_exception()  # the program went on after it: the incident now, not at the end
        seg = self.program.begins(ev)
        if seg is not None:
            if seg["config"] is not None:
                self.sampler.loader = seg["config"]  # forensics judge the workers the loop waits for now
            self.journal.note({k: v for k, v in ev.items() if k != "config"})

    def _on_loader_iter_end(self, ev: dict[str, Any]) -> None:
        if self.program is not None:
            self.program.ends(ev, self.summary.runstats)

    def _on_worker_registered(self, ev: dict[str, Any]) -> None:
        self.sampler.track_worker(
            int(ev.get("pid", 0)), ev.get("worker_id"), ev.get("start_method"), ev.get("dump_path")
        )
        self.journal.note(ev)

    def _on_loader_workers(self, ev: dict[str, Any]) -> None:
        self.sampler.track_loader_workers(int(p) for p in ev.get("pids") or ())
        self.journal.note(ev)

    def _on_nested_watch(self, ev: dict[str, Any]) -> None:
        self.sampler.add_nested(ev.get("run_dir"), ev.get("monitor_pid"))

    def _on_batch_bytes(self, ev: dict[str, Any]) -> None:
        loader = self.sampler.loader
        if isinstance(loader, dict) and isinstance(ev.get("batch_bytes"), int):
            loader["batch_bytes"] = ev["batch_bytes"]

    def _on_advice(self, ev: dict[str, Any]) -> None:
        self.summary.keep_advice(ev)

    def _on_interrupt(self, ev: dict[str, Any]) -> None:
        self.incidents.interrupt(ev)

    HANDLERS: ClassVar[Mapping[contract.Event, Callable[["Monitor", dict[str, Any]], None]]] = {
        contract.STOP: _on_stop,
        contract.EXCEPTION: _on_exception,
        contract.LOADER_ITER: _on_loader_iter,
        contract.LOADER_ITER_END: _on_loader_iter_end,
        contract.WORKER_REGISTERED: _on_worker_registered,
        contract.LOADER_WORKERS: _on_loader_workers,
        contract.NESTED_WATCH: _on_nested_watch,
        contract.BATCH_BYTES: _on_batch_bytes,
        contract.ADVICE: _on_advice,
        contract.INTERRUPT: _on_interrupt,
    }

    def _flush_exception(self) -> None:
        """An exception the program caught and lived on after: its incident now (one per exception)."""
        if self.incidents.exception is None:
            return
        try:
            self.poll()  # the state right after the exception
        except Exception:
            pass
        self.incidents.exception_incident()

    # ------------------------------------------------------------------ detection

    @property
    def detectors(self) -> list[Detector]:
        return self._detectors

    @detectors.setter
    def detectors(self, detectors: list[Detector]) -> None:
        self._detectors = detectors
        self._acting: dict[str, list[tuple[Detector, Callable[..., Any]]]] = {}

    def _acting_on(self, method: str) -> list[tuple[Detector, Callable[..., Any]]]:
        """The detectors that do something on ``method``, each with that method: the base class's
        answers nothing, and a poll would call it for most of them (a dozen of twenty on ``on_poll``)."""
        got = self._acting.get(method)
        if got is None:
            base = getattr(Detector, method)
            got = []
            for d in self._detectors:
                fn = getattr(d, method, None)
                if fn is None:  # not a Detector: its AttributeError is said at each call, as any detector's error
                    fn = functools.partial(lambda d, *a: getattr(d, method)(*a), d)
                if getattr(fn, "__func__", None) is not base:
                    got.append((d, fn))
            self._acting[method] = got
        return got

    def _run_detectors(self, method: str, *args: Any, run: dict[str, Any] | None = None) -> None:
        """Feed every detector; each signal it hands back becomes a threshold incident, advice is kept."""
        view = self.sampler.view(run)
        for det, fn in self._acting_on(method):
            try:
                signals = list(fn(*args, view))
            except Exception as exc:  # one broken detector must not stop the others or the monitor
                self.notes.warn_once("detector_failed", f"{type(det).__name__}.{method}: {type(exc).__name__}: {exc}")
                continue
            for sig in signals:
                event = sig.get("event") if isinstance(sig, dict) else None
                if event == "advice":
                    self.summary.keep_advice(sig)  # kept for the run summary, and noted there (once)
                elif event in NOTE_EVENTS:
                    self.journal.note(sig)  # observations: in the timeline and every later report
                else:
                    self.incidents.threshold(sig)

    def _detect(self, hb: Any, activity: Any = None) -> None:
        ev = self.stall.update(hb, time.monotonic(), activity)
        if ev is not None:
            self.stalled = ev.kind == "stall"
            if ev.kind == "stall":
                self.stalls += 1
                segment = (self.program.iteration,) if self.program is not None else ()
                self.incidents.stall(ev, segment)
            else:
                self.journal.note(
                    {
                        "ts": time.time(),
                        "event": "progress_resumed",
                        "stall_s": round(ev.stall_s, 3),
                        "batches": ev.batches,
                    }
                )
        self._run_detectors("on_poll")

    # ------------------------------------------------------------------ sinks

    def _poll_state(self) -> Any:
        from dlwatch.monitor.sinks import PollState, ProcState

        s = self.sampler
        procs = tuple(
            ProcState(t.pid, t.role, t.worker_id, t.last) for t in s.procs.values() if not t.gone and t.last is not None
        )
        return PollState(
            now=time.time(),
            monotonic=time.monotonic(),
            pid=self.main_pid,
            started_at=self.settings.started_at,
            rank=self.settings.rank,
            heartbeat=s.last_hb,
            procs=procs,
            system=s.last_system,
            stalls=self.stalls,
            incidents=len(self.incidents.paths),
            stalled=self.stalled,
        )

    def _feed_sinks(self) -> None:
        if not self.sinks:
            return
        state = self._poll_state()
        for sink in self.sinks:
            try:
                sink.on_poll(state)
            except Exception as exc:  # metrics that cannot be written never stop the watch
                self.notes.warn_once(f"{sink.name}_failed", f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ the end

    def _write_summary(self, ended: str) -> str | None:
        return self.summary.write(
            ended,
            heartbeat=self.sampler.reread_heartbeat(),
            loader=self.sampler.loader,
            playbooks=self.playbooks or (),
            incidents=self.incidents.paths,
            gpu=self.sampler.gpu,
            detectors=self.detectors,
            program=self.program,
            on_finish=lambda run: self._run_detectors("on_finish", run=run),
        )

    def _finish_clean(self) -> None:
        pending = self.incidents.exception is not None
        if pending:
            try:
                self.poll()  # the state right after the exception
            except Exception:
                pass
            self.incidents.write(self.incidents.report("exception"))
        self.incidents.flush(all_held=True)
        if self.ended is not None:  # `dlwatch run`: how the program ended, from its atexit
            ended = self.ended
        else:
            ended = "exception" if pending else "interrupted" if self.interrupted else "clean"
        self._write_summary(ended)
        self._close(clean=True)

    def _finish_vanished(self) -> None:
        self.procs[self.main_pid].gone = True
        self.sampler.reread_heartbeat()  # the file outlives the writer
        # judged on the cgroup's OOM-kill count at the first poll and now (detect.process_exit)
        self.incidents.flush(all_held=True)  # the exit is another event: what was held is written first
        self.incidents.exit(judge_exit(self.sampler.first_system, self.sampler.system_now()))
        self._write_summary("vanished")
        self._close(clean=False)
        # nobody else will: the training process is gone. What mattered is in the incident.
        shutil.rmtree(self.run_dir, ignore_errors=True)

    def _close(self, *, clean: bool = True) -> None:
        if self.sinks:  # the batches since the last poll count too
            self.sampler.reread_heartbeat()
        state = self._poll_state() if self.sinks else None
        for sink in self.sinks:
            try:
                sink.close(state, clean=clean)
            except Exception as exc:
                self.notes.warn_once(f"{sink.name}_failed", f"{type(exc).__name__}: {exc}")
        self.journal.close()
        self.sampler.close()


_HANDLERS = {event.name: handler for event, handler in Monitor.HANDLERS.items()}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    configure_own_process()
    if len(argv) != 1:
        print("usage: python -m dlwatch.monitor.loop RUN_DIR (started by dlwatch.watch)", file=sys.stderr)
        return 2
    try:
        monitor = Monitor(argv[0])
    except (OSError, ValueError, KeyError) as exc:
        print(outbound(f"dlwatch: monitor cannot start: {exc}"), file=sys.stderr)
        return 1
    return monitor.run()


if __name__ == "__main__":
    sys.exit(main())
