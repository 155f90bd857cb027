"""The lifecycle of one watched run: its run directory, heartbeat and events file, the monitor, its end.

A :class:`Session` is what a ``with dlwatch.watch(...)`` block and ``dlwatch run``'s program watch
share: :meth:`Session.start` makes the private run directory (falling back to one in TMPDIR, with
one warning), the heartbeat, ``config.json`` and the monitor process; :meth:`Session.stop` tells the
monitor how the run ended, waits for it, reads the summary it wrote (``Watch.summary``) and removes
the run directory.  When the monitor is gone, a short-lived child (:mod:`dlwatch.monitor.finish`)
writes the summary and the pending exception's incident instead: no judging or rendering code runs
in the training process.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from typing import Any

from dlwatch._fs import UnsafeDirError, create_private, make_private_child, make_private_dir, write_json
from dlwatch.inproc.agent.loaderinfo import loader_config, qualname
from dlwatch.inproc.agent.warning import warn_program
from dlwatch.inproc.worker_hook import allow_ptrace_from
from dlwatch.redact import redact_argv
from dlwatch.wire import events, interrupt, reportdir
from dlwatch.wire.heartbeat import HeartbeatWriter
from dlwatch.wire.job import rank_info
from dlwatch.wire.reportdir import read_summary

MONITOR_STOP_TIMEOUT_S = 10.0
FINISH_TIMEOUT_S = 30.0  # the finishing child (monitor gone): a summary and at most one incident


class Session:
    """One run of one monitor: from the run directory and the monitor's start to the summary."""

    def __init__(self, settings: Any) -> None:
        self.options = settings.options
        self.prometheus: dict[str, Any] = settings.prometheus
        self.report_dir: str = self.options.report_dir  # the one used (a fallback, when this one was refused)
        self.run_dir: str | None = None  # private, removed at the end
        self.events_path: str | None = None
        self.hb: HeartbeatWriter | None = None
        self.monitor: subprocess.Popen[bytes] | None = None
        self.exit_budget: interrupt.ExitBudget | None = None  # what the last told Ctrl-C may still cost
        self.monitor_warned = False
        self.started_at = 0.0
        self.cpus: dict[str, Any] | None = None
        self.active = False  # started and not stopped: the monitor is watching
        self.program = False  # `dlwatch run`: one watch for every loader iteration of the process
        self.interrupted = False  # a KeyboardInterrupt (Ctrl-C) ended the run
        self.ended = "clean"  # what the stop event says ended the program (`dlwatch run`)
        self.pending: dict[str, Any] | None = None  # the exception that ended the run, for its report
        self.preflight: list[dict[str, Any]] = []  # the preflight findings, for a summary written here
        self.summary: dict[str, Any] | None = None  # the run summary, after the stop

    # ------------------------------------------------------------------ start

    def start(self, loader: Any, *, program: bool = False) -> None:
        """The run directory, the heartbeat, ``config.json`` and the monitor; raises what stops it."""
        self.started_at = time.time()
        self.program = program
        self.run_dir = run_dir = self._make_run_dir()
        self.events_path = os.path.join(run_dir, "events.jsonl")
        self.hb = HeartbeatWriter(os.path.join(run_dir, "heartbeat"))
        dump_path = None
        try:
            from dlwatch.wire import dumps

            dump_path = dumps.install(os.path.join(run_dir, "dumps"))
        except Exception:
            pass
        write_json(
            os.path.join(run_dir, "config.json"),
            {
                "pid": os.getpid(),
                "started_at": self.started_at,
                "report_dir": os.path.abspath(self.report_dir),
                "options": self.options.to_dict(),
                "loader": loader_config(loader),
                "iterable": qualname(type(loader)),
                "main_dump_path": dump_path,
                "cpus": self.usable_cpus(),
                "argv": redact_argv(list(sys.argv)),
                "python": sys.executable,
                "rank": rank_info(),  # here, not in the monitor: the job id may come from this process's parent
                "prometheus": self.prometheus,
                "program_run": os.environ.get("DLWATCH_PROGRAM_RUN") or None,  # set by `dlwatch run`
                "program": program,  # one watch for every loader iteration of the process
            },
        )
        self.monitor = self._spawn_monitor(run_dir)
        allow_ptrace_from(self.monitor.pid)
        from dlwatch.inproc import threaddeath  # a producer thread that dies is told to the monitor

        threaddeath.install(self.events_path)

    def _make_run_dir(self) -> str:
        run_id = reportdir.new_run_id()
        refused: str | None = None  # why the report directory was not used (said once the fallback works)
        for base in (self.options.report_dir, None):
            path = None
            try:
                # an existing report directory must be ours and private; /tmp-like ones get a private child
                base_dir = reportdir.prepare_report_dir(base) if base is not None else reportdir.fallback_dir()
                runs = os.path.join(base_dir, reportdir.RUNS_DIR)
                make_private_dir(runs)
                path = make_private_child(runs, run_id)
                make_private_child(path, "dumps")
                probe = os.path.join(path, ".write-test")
                fd = create_private(probe)
                try:
                    os.write(fd, b"x")
                finally:
                    os.close(fd)
                os.unlink(probe)
            except OSError as exc:
                if path is not None:  # nothing half-made is left in a report directory
                    shutil.rmtree(path, ignore_errors=True)
                if base is not None:
                    why = (
                        f"is not safe: {exc}"
                        if isinstance(exc, UnsafeDirError)
                        else f"is not writable ({exc.strerror or exc})"
                    )
                    refused = f"report directory {base!r} {why}"
                    continue
                raise OSError(
                    f"{refused}, nor is a private directory in TMPDIR ({exc.strerror or exc})"
                    if refused
                    else f"no private directory in TMPDIR for the run ({exc.strerror or exc})"
                ) from None
            if refused is not None:
                warn_program(f"{refused}; writing reports to {base_dir!r} instead")
            self.report_dir = base_dir
            return path
        raise OSError("no writable report directory")  # not reached: the fallback returns or raises

    def _spawn_monitor(self, run_dir: str) -> "subprocess.Popen[bytes]":
        from dlwatch._spawn import python_argv, sigint_blocked

        # Isolated (-I): nothing in the training program's working directory or PYTHONPATH is
        # imported by the monitor; it loads this very dlwatch by location (see dlwatch/_spawn.py).
        # No pipe ends of ours reach forked workers through this Popen except stdin's write end,
        # which is only a wake-up: the monitor never relies on its EOF.
        with sigint_blocked():  # a Ctrl-C while the monitor starts is the program's, never the monitor's
            return subprocess.Popen(
                python_argv(module="dlwatch.monitor.loop", args=[os.path.abspath(run_dir)], ignore_sigint=True),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=None,
                close_fds=True,
            )

    def usable_cpus(self) -> dict[str, Any] | None:
        if self.cpus is None:
            try:
                from dlwatch.collect.system import usable_cpus

                self.cpus = usable_cpus(0)
            except Exception:
                self.cpus = {}
        return self.cpus

    def announce_nested(self) -> None:
        """Tell the monitors of the blocks this run started inside of where its heartbeat is."""
        monitor_pid = self.monitor.pid if self.monitor is not None else None
        for outer in OPEN_BLOCKS:
            if outer.events_path and outer.active:
                events.emit(outer.events_path, "nested_watch", run_dir=self.run_dir, monitor_pid=monitor_pid)

    def check_monitor(self) -> None:
        m = self.monitor
        if m is not None and not self.monitor_warned and m.poll() is not None:
            self.monitor_warned = True
            warn_program(f"the monitor process exited early (exit code {m.returncode}); training continues unwatched")

    # ------------------------------------------------------------------ the end

    def stop(self, *, clean: bool) -> None:
        """Tell the monitor the run ended (how: ``clean``, ``interrupted``, ``ended``), wait for its summary."""
        monitor, self.monitor = self.monitor, None
        pending = self.pending
        if self.events_path:
            ended = {"ended": self.ended} if self.program else {}
            events.emit(self.events_path, "stop", clean=clean, interrupted=self.interrupted, **ended)
            threaddeath_mod = sys.modules.get("dlwatch.inproc.threaddeath")
            if threaddeath_mod is not None:
                threaddeath_mod.uninstall(self.events_path)
        self._stop_monitor(monitor, pending)
        if self.hb is not None:
            self.hb.close()
            self.hb = None
        try:  # the process is as it was before the block: no handler left on the dump signal
            from dlwatch.wire import dumps

            dumps.uninstall()
        except Exception:
            pass
        self.active = False
        if self.run_dir and os.path.isdir(self.run_dir):
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def _stop_monitor(self, monitor: "subprocess.Popen[bytes] | None", pending: dict[str, Any] | None) -> None:
        if monitor is not None:
            alive = monitor.poll() is None
            if alive:
                try:
                    monitor.stdin.write(b"stop\n")  # type: ignore[union-attr]
                    monitor.stdin.flush()  # type: ignore[union-attr]
                except (OSError, ValueError):  # ValueError: the pipe's file object is already closed
                    pass
            try:
                monitor.stdin.close()  # type: ignore[union-attr]
            except (OSError, ValueError):
                pass
            try:
                monitor.wait(self._stop_wait_s(monitor) if alive else 0.1)
            except subprocess.TimeoutExpired:
                warn_program(
                    "monitor is stopped (SIGSTOP) and cannot stop; killed it"
                    if interrupt.is_stopped(monitor.pid)
                    else "monitor did not stop in time; killed it"
                )
                monitor.kill()
                monitor.wait()
                alive = False
            if not alive or monitor.returncode not in (0, None):
                self._monitor_lost(monitor.returncode, pending)
        # Watch.summary: read while the private run directory (which names the summary) is still there
        self._read_summary()

    def _stop_wait_s(self, monitor: "subprocess.Popen[bytes]") -> float:
        """How long to wait for the monitor to stop: none when it is stopped (it cannot exit until
        continued), the rest of a Ctrl-C's budget after one (see dlwatch.wire.interrupt)."""
        if interrupt.is_stopped(monitor.pid):
            return 0.0
        budget = self.exit_budget
        return budget.for_step(MONITOR_STOP_TIMEOUT_S) if budget is not None else MONITOR_STOP_TIMEOUT_S

    def _monitor_lost(self, code: int | None, pending: dict[str, Any] | None) -> None:
        if not self.monitor_warned:
            self.monitor_warned = True
            warn_program(f"the monitor process exited early (exit code {code}); this run was not fully watched")
        try:
            written = self.fallback_summary(pending)
        except Exception as err:
            written, why = False, f"{type(err).__name__}: {err}"
        else:
            why = "the finishing process failed (see above)"
        if not written and pending is not None:  # nothing is lost silently
            warn_program(f"could not write the exception report: {why}")

    def fallback_summary(self, pending: dict[str, Any] | None) -> bool:
        """The monitor is gone: the summary (and the pending exception's incident) written as it would.

        Not here: a short-lived child (:mod:`dlwatch.monitor.finish`) builds them from the run
        directory and ``finish.json`` (what only this process knows), so that no judging or
        rendering code runs in the training process.  True when all of it was written.
        """
        if not self.run_dir:
            return False
        from dlwatch._spawn import python_argv, sigint_blocked

        state = {
            "pid": os.getpid(),
            "report_dir": self.report_dir,
            "keep_runs": self.options.keep_runs,
            "started_at": self.started_at,
            "ended": "exception" if pending is not None else "interrupted" if self.interrupted else "clean",
            "cpus": self.cpus,
            "preflight": self.preflight,
            "pending": pending,
        }
        write_json(os.path.join(self.run_dir, "finish.json"), state)
        with sigint_blocked():
            child = subprocess.Popen(
                python_argv(module="dlwatch.monitor.finish", args=[os.path.abspath(self.run_dir)], ignore_sigint=True),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=None,
                close_fds=True,
            )
        try:
            budget = self.exit_budget  # after a Ctrl-C: what is left of its budget
            return child.wait(budget.for_step(FINISH_TIMEOUT_S) if budget is not None else FINISH_TIMEOUT_S) == 0
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
            return False

    def _read_summary(self) -> None:
        """Watch.summary: the run summary the monitor wrote (its path is in our private run dir)."""
        run_dir = self.run_dir
        if not run_dir or self.summary is not None:
            return
        try:
            with open(os.path.join(run_dir, "summary"), encoding="utf-8") as f:
                path = f.read().strip()
            self.summary = read_summary(path)
        except Exception:
            self.summary = None


# The sessions of the `with` blocks running in this process, outermost first.  A watch nested in
# another's loop body tells the outer monitor where its heartbeat is (its progress is the outer
# loop's progress: announce_nested), and one exception escaping both blocks makes one incident.
OPEN_BLOCKS: list[Session] = []
REPORTED: dict[int, BaseException] = {}  # exceptions already recorded by an inner watch (held while blocks run)
