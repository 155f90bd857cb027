"""``dlwatch.watch``: the part of dlwatch that lives in the training process.

It does three cheap things and nothing else: it times each batch into the mmap'd
heartbeat, it chains a hook into every DataLoader worker, and it hands an
exception escaping the block to the monitor.  Everything that reads /proc,
dumps stacks or writes reports happens in the separate monitor process
(``dlwatch.monitor.loop``), which imports no torch.

Contract with the user's code: the same batches, the same exceptions (the very
same object, never wrapped or swallowed), the same worker_init_fn behaviour.
Whatever goes wrong inside dlwatch becomes one warning, never an exception in
the training loop.
"""

from __future__ import annotations

import copy
import os
import select
import shutil
import subprocess
import sys
import threading
import time
import traceback
import weakref
from typing import Any, Iterable, Iterator

from dlwatch.wire import config, events, interrupt
from dlwatch._fs import UnsafeDirError, create_private, make_private_child, make_private_dir, write_json
from dlwatch.wire.job import rank_info
from dlwatch.wire.heartbeat import HeartbeatWriter
from dlwatch.redact import redact_argv, warn
from dlwatch.inproc.frames import interrupted_frames
from dlwatch.wire import reportdir
from dlwatch.wire.reportdir import read_summary
from dlwatch.inproc.worker_hook import CollateHook, WorkerHook, allow_ptrace_from
from dlwatch.inproc.agent.loaderinfo import (
    _is_dataloader,
    _known_len,
    _qualname,
    _sharing_strategy,
    _start_method,
    loader_config,
)
from dlwatch.inproc.agent.sigchld import HeldSigchld, unhide as _unhide
from dlwatch.inproc.agent.timed import _TimedIterator
from dlwatch.inproc.agent.warning import DlwatchWarning, _user_stacklevel, _warn


MONITOR_STOP_TIMEOUT_S = 10.0
DROP_RECENT_S = 15.0  # an iterator dropped this recently before a Ctrl-C reached the block's end was dropped by it
FINISH_TIMEOUT_S = 30.0  # the finishing child (monitor gone): a summary and at most one incident
FINGERPRINT_GENERATIONS = 2  # worker generations whose RNG states are compared


# What of an exception is copied for its report: a 50 MB message must not make the block's exit
# (or the monitor's redaction of it) take seconds.  Both ends are kept: a traceback's last lines hold the error.
MAX_MESSAGE_CHARS = 64 * 1024
MAX_TRACEBACK_CHARS = 192 * 1024


def _cut(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters: its head and tail, and between them where and how much was cut."""
    if len(text) <= limit:
        return text
    head = limit // 4
    tail = limit - head
    return f"{text[:head]}\n[dlwatch: {len(text) - head - tail:,} characters cut here]\n{text[len(text) - tail :]}"


def _fork_record() -> list[list[dict[str, Any]]]:
    fork_mod = sys.modules.get("dlwatch.inproc.forkthreads")
    if fork_mod is None:
        return []
    try:
        return fork_mod.take()
    except Exception:
        return []


_WATCHED_CLASSES: dict[type, type] = {}
# The watches whose blocks are running in this process, outermost first.  A watch nested in
# another's loop body tells the outer monitor where its heartbeat is (its progress is the
# outer loop's progress), and one exception escaping both blocks makes one incident.
_ACTIVE: list["Watch"] = []
_REPORTED: dict[int, BaseException] = {}  # exceptions already recorded by an inner watch (held while blocks run)


def _with_binds_target(frame: Any) -> bool | None:
    """Whether the ``with`` statement that is entering binds ``as NAME``; None if unknown.

    Read from the caller's bytecode (CPython 3.11+): the instruction after BEFORE_WITH
    stores the value (``as`` form) or pops it (no target).
    """
    try:
        import dis

        code, lasti = frame.f_code, frame.f_lasti
        seen = False
        for ins in dis.get_instructions(code):
            if ins.offset == lasti:
                seen = ins.opname in ("BEFORE_WITH", "SETUP_WITH")
                continue
            if seen and ins.offset > lasti:
                if ins.opname in ("CACHE", "NOP", "EXTENDED_ARG"):
                    continue
                return ins.opname != "POP_TOP"
        return None
    except Exception:
        return None


def _watched_class(cls: type) -> type:
    """A subclass whose __iter__ instruments each epoch's iterator (dunder lookup is on the type)."""
    sub = _WATCHED_CLASSES.get(cls)
    if sub is None:

        def __iter__(self: Any) -> Iterator[Any]:
            w = self.__dict__.get("_dlwatch_watch")
            if w is not None:
                try:
                    w._before_iter()
                except BaseException as exc:  # torch's exception for a worker that died meanwhile
                    _unhide(exc)
                    raise
            it = cls.__iter__(self)
            return it if w is None else w._instrument(it)

        sub = type(
            cls.__name__,
            (cls,),
            {
                "__iter__": __iter__,
                "__module__": cls.__module__,
                "__qualname__": cls.__qualname__,
                "_dlwatch_original": cls,
            },
        )
        _WATCHED_CLASSES[cls] = sub
    return sub


# loader_iter_end's fields after its loader (events.LineFormat: a template, the iteration's figures its slots)
_ITER_END_FIELDS = (
    ("batches", events.INT),
    ("data_wait_s", events.FLOAT),
    ("first_batch_s", events.FLOAT),
    ("active_s", events.FLOAT),
    ("wall_s", events.FLOAT),
    ("worker_pids", events.INTS),
)


class Watch:
    """Context manager returned by :func:`watch`; iterate it (once per epoch) or the loader itself."""

    def __init__(
        self,
        loader: Any,
        *,
        report_dir: Any = None,
        poll_interval: Any = None,
        stall_timeout: Any = None,
        enabled: Any = None,
        playbooks: Any = None,
        body_timeout: Any = None,
        ignore: Any = None,
        keep_runs: Any = None,
    ) -> None:
        if not hasattr(type(loader), "__iter__"):
            raise TypeError(f"dlwatch.watch: expected a DataLoader or another iterable, got {type(loader).__name__}")
        self.options = config.resolve(
            report_dir=report_dir,
            poll_interval=poll_interval,
            stall_timeout=stall_timeout,
            enabled=enabled,
            playbooks=playbooks,
            body_timeout=body_timeout,
            ignore=ignore,
            keep_runs=keep_runs,
        )
        self.thresholds: dict[str, float] = {}
        self._ignored = frozenset(self.options.ignored_playbooks)
        self._advice_pbs: dict[str, Any] = {}  # preflight playbooks by id (titles and thresholds)
        if self.options.enabled:
            from dlwatch.wire.playbooks import load_playbooks

            loaded = load_playbooks(self.options.playbooks)  # a malformed file: PlaybookError now
            unknown = sorted(self._ignored - {pb.id for pb in loaded})
            if unknown:
                raise ValueError(
                    f"dlwatch.watch: ignore names no known playbook: {', '.join(unknown)} "
                    f"(see `dlwatch playbooks` for the ids)"
                )
            self._advice_pbs = {pb.id: pb for pb in loaded if pb.is_advice}
            for pb in loaded:
                if pb.id == "batch-dim-mismatch":
                    self.thresholds["check_first"] = pb.threshold("check_first", 8)
                    self.thresholds["sample_every"] = pb.threshold("sample_every", 64)
                    self.thresholds["confirm_batches"] = pb.threshold("confirm_batches", 8)
                elif pb.id == "rng-duplication":
                    self.thresholds["attribute_depth"] = pb.threshold("attribute_depth", 2)
        self._prometheus: dict[str, Any] = {}
        if self.options.enabled:
            from dlwatch.wire.config import prom_options

            self._prometheus = prom_options()  # a bad DLWATCH_PROM_* value: ValueError now, naming the fix
        self._loader: Any = loader
        self._active = False
        self.run_dir: str | None = None
        self.report_dir: str = self.options.report_dir
        self._hb: HeartbeatWriter | None = None
        self._events_path: str | None = None
        self._monitor: subprocess.Popen[bytes] | None = None
        self._monitor_warned = False
        self._swapped = False
        self._hook: WorkerHook | None = None
        self._collate_hook: CollateHook | None = None
        self._loader_error: BaseException | None = None
        self._shape_probe: Any = None
        self._worker_pids: tuple[int, ...] = ()
        self._shape_reported = False
        self._batch_bytes_sent = False
        self._generations = 0  # sets of worker processes seen (a new one per epoch unless persistent)
        self._entered_at = 0.0
        self._pending_exception: dict[str, Any] | None = None
        self._iterated = False  # the watch object itself was iterated (the `as` form)
        self._interrupted = False  # a KeyboardInterrupt (Ctrl-C) left the block
        self._interrupt_seq = 0  # interrupt events sent (see note_interrupt)
        self._interrupt_told = 0  # id() of the KeyboardInterrupt last told: one incident per Ctrl-C
        self._dropped: tuple[float, float] | None = None  # an iterator dropped in the loop body: (when, body began)
        self.summary: dict[str, Any] | None = None  # the run summary, after the block (see dlwatch.report.summary)
        self._preflight_sent: set[str] = set()
        self._preflight_signals: list[dict[str, Any]] = []  # for a summary written here if the monitor is gone
        self._cpus: dict[str, Any] | None = None
        self._in_place_warning = False  # the loader could not be instrumented in place: warn if used so
        # `dlwatch run`: the watch covers one iteration whose iterator it builds itself (iterate_with);
        # the loader object is left as it is (no class swap, its hooks set only while torch builds it)
        self.iteration_only = False
        self._hooked_own: dict[str, bool] = {}  # whether the loader held worker_init_fn/collate_fn itself
        # `dlwatch run`: one watch for the whole program (see iterate_segment); each loader iteration is a
        # segment of it, a copy of this watch that holds that loader's hooks and probes (_parent: this one)
        self.program = False
        self._parent: Watch | None = None
        self._program_ended = "clean"  # what the stop event says ended the program
        self._segments: list[Watch] = []  # the segments whose iterators are alive, oldest first
        self._segment_lock = threading.RLock()  # an iterator's __del__ may end a segment inside another's start
        self._iterations = 0
        self._loader_ids: Any = weakref.WeakKeyDictionary()  # loader -> its key, while the loader lives
        self._loaders_seen = 0
        # loader key -> (worker generations started, its batch-shape probe, its batch size sent): what a
        # loader's iterations carry over, as one watch's epochs do
        self._generations_of: dict[str, tuple[int, Any, bool]] = {}
        self._mark: tuple[int, float, float, float] | None = None  # heartbeat figures when last credited
        self._iteration = 0  # a segment's number in the program (1, 2, ...)
        self._loader_key = ""
        self._row: dict[str, Any] | None = None  # a segment's figures, sent when it ends

    @property
    def monitor_pid(self) -> int | None:
        """The monitor process's pid while the block runs (None when disabled or stopped)."""
        return self._monitor.pid if self._monitor is not None else None

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Watch":
        if not self.options.enabled:
            return self
        try:
            with HeldSigchld():
                self._enter()
        except BaseException as err:  # torch's exception for a worker that died meanwhile
            _unhide(err)
            raise
        return self

    def _enter(self) -> None:
        outer = self._loader.__dict__.get("_dlwatch_watch") if hasattr(self._loader, "__dict__") else None
        if isinstance(outer, Watch) and outer._active:
            # the same loader watched twice (a library's watch inside the user's): the outer one
            # keeps watching; this one does nothing, so nothing is instrumented twice
            _warn(
                "this loader is already watched by an enclosing dlwatch.watch block; "
                "the inner watch does nothing and the outer one keeps watching"
            )
            return
        try:
            self._start()
        except Exception as exc:  # dlwatch failing must not stop training
            _warn(f"could not start monitoring ({type(exc).__name__}: {exc}); training continues unwatched")
            loader = self._loader
            try:
                self._teardown(clean=False)
            except Exception:
                pass
            self._loader = loader  # the `as` form still iterates it, unwatched, until the block ends
            return
        if self._in_place_warning:
            try:
                binds = _with_binds_target(sys._getframe(1))
            except Exception:
                binds = None
            if binds is False:
                self._in_place_warning = False
                _warn(
                    f"a {type(self._loader).__name__} cannot be watched in place: iterate the watched "
                    "object instead (`with dlwatch.watch(x) as batches: for b in batches: ...`)"
                )
        for w in _ACTIVE:
            if w._events_path and w._active:
                events.emit(w._events_path, "nested_watch", run_dir=self.run_dir, monitor_pid=self.monitor_pid)
        _ACTIVE.append(self)
        return

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
                _warn(f"{refused}; writing reports to {base_dir!r} instead")
            self.report_dir = base_dir
            return path
        raise OSError("no writable report directory")  # not reached: the fallback returns or raises

    def _start(self) -> None:
        self._entered_at = time.time()
        self.run_dir = run_dir = self._make_run_dir()
        self._events_path = os.path.join(run_dir, "events.jsonl")
        self._hb = HeartbeatWriter(os.path.join(run_dir, "heartbeat"))
        loader = self._loader
        is_dl = _is_dataloader(loader)
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
                "started_at": self._entered_at,
                "report_dir": os.path.abspath(self.report_dir),
                "options": self.options.to_dict(),
                "loader": loader_config(loader),
                "iterable": _qualname(type(loader)),
                "main_dump_path": dump_path,
                "cpus": self._usable_cpus(),
                "argv": redact_argv(list(sys.argv)),
                "python": sys.executable,
                "rank": rank_info(),  # here, not in the monitor: the job id may come from this process's parent
                "prometheus": self._prometheus,
                "program_run": os.environ.get("DLWATCH_PROGRAM_RUN") or None,  # set by `dlwatch run`
                "program": self.program,  # one watch for every loader iteration of the process
            },
        )
        self._monitor = self._spawn_monitor(run_dir)
        allow_ptrace_from(self._monitor.pid)
        from dlwatch.inproc import threaddeath  # a producer thread that dies is told to the monitor

        threaddeath.install(self._events_path)
        if self.program:
            pass  # each iteration's segment prepares its own loader's (iterate_segment)
        elif self.iteration_only:
            self._prepare_probes(loader)  # set on the loader by iterate_with, while torch builds the iterator
        elif is_dl:
            self._instrument_loader(loader)
        elif self._can_swap(loader):
            self._swap_class(loader)
        self._in_place_warning = not (self._swapped or self.iteration_only)
        self._active = True

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

    def _instrument_loader(self, loader: Any) -> None:
        self._prepare_probes(loader)
        self._set_hooks(loader)
        existing = getattr(loader, "_iterator", None)
        if existing is not None:  # persistent workers already running: the hook won't run in them
            self._note_workers(existing)
        self._swap_class(loader)

    def _prepare_probes(self, loader: Any) -> None:
        """The worker hook and the batch-shape probe for a DataLoader (set on the loader by _set_hooks)."""
        self._hook = WorkerHook(
            loader.worker_init_fn,
            self._events_path or "",
            self.run_dir or "",
            _start_method(loader),
            self._monitor.pid if self._monitor else None,
            rng_depth=int(self.thresholds.get("attribute_depth", 2)),
        )
        self._hook.fingerprint = "rng-duplication" not in self._ignored
        try:
            from dlwatch.inproc.shapes import BatchShapeProbe, marks_time_major

            # batches per epoch follow the sampler, which may subsample the dataset; unknown where only
            # the program's own __len__ could say (the probe then judges a short batch by the next one)
            samples = _known_len(getattr(loader, "sampler", None))
            if loader.batch_size is not None and "batch-dim-mismatch" not in self._ignored:
                self._shape_probe = BatchShapeProbe(
                    loader.batch_size,
                    loader.drop_last,
                    samples,
                    _qualname(loader.collate_fn) or "",
                    check_first=int(self.thresholds.get("check_first", 8)),
                    sample_every=int(self.thresholds.get("sample_every", 64)),
                    confirm_batches=int(self.thresholds.get("confirm_batches", 8)),
                    ignore_keys=self.options.ignored_batch_keys,
                    time_major=marks_time_major(loader.collate_fn),
                )
        except Exception:
            self._shape_probe = None
        if self._hook.fingerprint and loader.num_workers > 0:
            from dlwatch.inproc import rngcheck  # noqa: F401  (imported once here, forked workers inherit it)

            # the second RNG fingerprint, after each worker's first batch (see worker_hook)
            self._collate_hook = CollateHook(loader.collate_fn, self._events_path or "", rng_depth=self._hook.rng_depth)

    def _set_hooks(self, loader: Any) -> None:
        # which attributes the loader held itself: one that only read through to a wrapped loader
        # (accelerate's adapter) must not stay behind as an attribute of its own after the block
        own = getattr(loader, "__dict__", {})
        self._hooked_own = {name: name in own for name in ("worker_init_fn", "collate_fn")}
        if self._hook is not None:
            loader.worker_init_fn = self._hook
        if self._collate_hook is not None:
            loader.collate_fn = self._collate_hook

    def _unset_hooks(self, loader: Any) -> None:
        for name, hook in (("worker_init_fn", self._hook), ("collate_fn", self._collate_hook)):
            if hook is None or getattr(loader, name, None) is not hook:
                continue
            try:
                if self._hooked_own.get(name, True):
                    setattr(loader, name, hook.user_fn)
                else:
                    del loader.__dict__[name]
            except Exception:
                pass

    def iterate_with(self, original: Any) -> Iterator[Any]:
        """``dlwatch run``: this iteration's iterator, built by ``original`` (the DataLoader's own
        ``__iter__``) with dlwatch's hooks on the loader only while torch builds it (torch reads
        ``worker_init_fn`` and ``collate_fn`` then), and instrumented.  Never re-enters the loader's
        class: a subclass's ``__iter__`` that called ``super().__iter__()`` runs once, as bare."""
        loader = self._loader
        if not self._active or loader is None:
            return original(loader)
        self._before_iter()
        hooked = False
        try:
            if _is_dataloader(loader) and not (loader.persistent_workers and loader._iterator is not None):
                self._set_hooks(loader)
                hooked = True
        except Exception:
            pass
        try:
            it = original(loader)
        finally:
            if hooked:
                self._unset_hooks(loader)
        try:
            return self._instrument(it)
        except Exception:
            return it

    # ------------------------------------------------------------------ `dlwatch run`: the whole program

    def iterate_segment(self, loader: Any, original: Any) -> tuple[Iterator[Any], "Watch"]:
        """The program watch (``dlwatch run``): one iteration of any loader of this process, as a segment.

        The segment is a shallow copy of this watch for that iteration: it shares the monitor, the
        heartbeat, the events file and what is said once per run (preflight, advice), and holds the
        loader's own hooks and probes.  The monitor hears of it (``loader_iter``: its number and its
        loader) before torch starts the workers; :meth:`end_segment` sends its figures.
        """
        with self._segment_lock:
            seg = copy.copy(self)
            seg._parent = self
            seg._loader = loader
            seg._loader_error = None
            seg._pending_exception = None
            seg._hook = seg._collate_hook = seg._shape_probe = None
            seg._shape_reported = seg._batch_bytes_sent = False
            seg._worker_pids = ()  # each iteration registers its workers
            seg._hooked_own = {}
            self._iterations += 1
            seg._iteration = self._iterations
            seg._loader_key, name = self._key_of(loader)
            # RNG fingerprints: the first FINGERPRINT_GENERATIONS worker generations of each loader, as
            # for a watch over its epochs (later ones would cost each worker start ~3 ms and tell nothing new)
            seg._generations, probe, seg._batch_bytes_sent = self._generations_of.get(seg._loader_key, (0, None, False))
            if _is_dataloader(loader):
                seg._prepare_probes(loader)
                if probe is not None:  # the loader's probe goes on through its epochs, as under a watch
                    seg._shape_probe = probe
                if seg._generations >= FINGERPRINT_GENERATIONS and seg._hook is not None:
                    seg._hook.fingerprint = False
                    seg._collate_hook = None
            if self._events_path:
                events.emit(
                    self._events_path,
                    "loader_iter",
                    iteration=seg._iteration,
                    loader=seg._loader_key,
                    name=name,
                    config=loader_config(loader),
                )
            self._credit()
            # an older iterator ending no longer marks the loop as outside (see _TimedIterator._end)
            for older in self._segments:
                older._hb = None
            seg._row = {
                "started_at": time.time(),
                "batches": 0,
                "data_wait_s": 0.0,
                "first_batch_s": 0.0,
                "active_s": 0.0,
            }
            self._segments.append(seg)
        try:
            it = seg.iterate_with(original)
        except BaseException as exc:  # the loader's own __iter__ raised (a worker that could not start)
            self.end_segment(seg, exc)
            raise
        if len(self._generations_of) >= 1024:  # a program that makes a loader per step: bounded
            self._generations_of.clear()
        self._generations_of[seg._loader_key] = (seg._generations, seg._shape_probe, True)
        return it, seg

    def _key_of(self, loader: Any) -> tuple[str, str]:
        """A short key for the loader (``loader1``, ``loader2``... in order of first iteration) and a name."""
        try:
            key = self._loader_ids.get(loader)
        except TypeError:  # unhashable or not weakly referable: a key per iteration
            key = None
        dataset = getattr(loader, "dataset", None)
        name = type(dataset).__name__ if dataset is not None else type(loader).__name__
        if key is None:
            self._loaders_seen += 1
            key = f"loader{self._loaders_seen}"
            try:
                self._loader_ids[loader] = key
            except TypeError:
                pass
        return key, name

    def _credit(self) -> None:
        """The heartbeat's progress since the last call goes to the newest live segment.

        One loop advances one iterator at a time, nearly always the newest: a validation loop inside
        a training epoch, or a training iterator kept alive (Lightning) while the next one starts.
        """
        hb = self._hb
        if hb is None:
            return
        hb._sync_hot()
        now = (hb.batches, hb.total_wait_s, hb.total_first_wait_s, time.monotonic())
        last, self._mark = self._mark, now
        if last is None or not self._segments:
            return
        row = self._segments[-1]._row
        if row is not None:
            row["batches"] += now[0] - last[0]
            row["data_wait_s"] += now[1] - last[1]
            row["first_batch_s"] += now[2] - last[2]
            row["active_s"] += now[3] - last[3]

    def end_segment(self, seg: "Watch", exc: BaseException | None) -> None:
        """A segment's iterator ended (exhausted, raised, or dropped): its row goes to the monitor."""
        with self._segment_lock:
            if not any(s is seg for s in self._segments):
                return
            if exc is not None:
                clean = isinstance(exc, (GeneratorExit, KeyboardInterrupt)) or (
                    isinstance(exc, SystemExit) and exc.code in (0, None)
                )
                if not clean and id(exc) not in _REPORTED:
                    seg._record_exception(exc)
                    self._pending_exception = seg._pending_exception  # for a summary written here (monitor gone)
            self._credit()
            self._segments = [s for s in self._segments if s is not seg]
            row, seg._row = seg._row or {}, None
            if self._events_path and self._active:
                fields = (("iteration", events.INT), ("loader", seg._loader_key), *_ITER_END_FIELDS)
                events.line_format("loader_iter_end", fields).emit(
                    self._events_path,
                    iteration=seg._iteration,
                    batches=row.get("batches", 0),
                    data_wait_s=round(row.get("data_wait_s", 0.0), 6),
                    first_batch_s=round(row.get("first_batch_s", 0.0), 6),
                    active_s=round(row.get("active_s", 0.0), 6),
                    wall_s=round(time.time() - row.get("started_at", time.time()), 6),
                    worker_pids=list(seg._worker_pids),
                )
            if self._segments and self._segments[-1]._hb is None:
                self._segments[-1]._hb = self._hb  # the newest live iterator marks the loop's state again
            seg._loader = seg._shape_probe = seg._hook = seg._collate_hook = seg._loader_error = None

    def close_program(self, ended: str) -> None:
        """The program ends (atexit): the live segments' rows, then the monitor's stop and the summary."""
        with self._segment_lock:
            for seg in list(reversed(self._segments)):
                self.end_segment(seg, None)
        self._program_ended = ended
        with HeldSigchld(quiet=True):
            self._interrupted = ended == "interrupted"
            if self in _ACTIVE:
                _ACTIVE.remove(self)
            if self._active:
                try:
                    self._teardown(clean=True)
                except Exception as err:
                    _warn(f"error while stopping the monitor: {type(err).__name__}: {err}")

    @staticmethod
    def _can_swap(obj: Any) -> bool:
        return hasattr(obj, "__dict__") and type(obj).__flags__ & (1 << 9) != 0  # Py_TPFLAGS_HEAPTYPE

    def _swap_class(self, obj: Any) -> None:
        try:
            obj.__dict__["_dlwatch_watch"] = self
            obj.__class__ = _watched_class(type(obj))
            self._swapped = True
        except (TypeError, AttributeError):
            obj.__dict__.pop("_dlwatch_watch", None)

    def _restore_loader(self) -> None:
        loader = self._loader
        if loader is None:
            return
        if self._swapped:
            try:
                loader.__class__ = type(loader)._dlwatch_original
            except Exception:
                pass
            loader.__dict__.pop("_dlwatch_watch", None)
            self._swapped = False
        self._unset_hooks(loader)
        self._hook = None
        self._collate_hook = None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if not self._active:
            self._loader = None
            return False
        # torch's SIGCHLD handler raises "DataLoader worker ... killed by signal" in whatever Python code
        # runs when a worker dies, here too: it would cut the exception report and the monitor's stop
        # short and replace the user's exception. Its handler is set aside while leaving, then restored:
        # a worker that died meanwhile raises torch's exception from the with statement.
        try:
            with HeldSigchld():
                return self._exit(exc)
        except BaseException as err:
            _unhide(err)
            raise

    def _exit(self, exc: BaseException | None) -> bool:
        if self in _ACTIVE:
            _ACTIVE.remove(self)
        if self._in_place_warning and not self._iterated:
            _warn(
                f"nothing was watched: a {type(self._loader).__name__} cannot be watched in place; iterate "
                "the watched object instead (`with dlwatch.watch(x) as batches: for b in batches: ...`)"
            )
        try:
            clean_exit = isinstance(exc, GeneratorExit) or (isinstance(exc, SystemExit) and exc.code in (0, None))
            self._interrupted = isinstance(exc, KeyboardInterrupt)  # the user stopped the job: no failure
            if self._interrupted:
                self.note_interrupt_in_body(exc)  # type: ignore[arg-type]
            if exc is not None and not clean_exit and not self._interrupted and id(exc) not in _REPORTED:
                self._record_exception(exc)
                if _ACTIVE:
                    _REPORTED[id(exc)] = exc  # an enclosing watch sees the same exception: one incident
        except Exception:
            pass
        if not _ACTIVE:
            _REPORTED.clear()
        try:
            self._teardown(clean=True, exc=exc)
        except Exception as err:
            _warn(f"error while stopping the monitor: {type(err).__name__}: {err}")
        return False  # never swallow

    def _record_exception(self, exc: BaseException) -> None:
        err = getattr(exc, "errno", None)
        info = {
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": _cut(str(exc), MAX_MESSAGE_CHARS),
            "errno": err if isinstance(err, int) else None,
            "traceback": _cut(
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), MAX_TRACEBACK_CHARS
            ),
            "from_loader": exc is self._loader_error,
        }
        if self._events_path:
            from dlwatch.inproc.loader_exit import worker_exitcodes

            codes = worker_exitcodes(exc)  # how the workers behind the error ended (worker-killed)
            if codes:
                events.emit(self._events_path, "worker_exits", exitcodes=codes)
            events.emit(self._events_path, "exception", exception=info)
        self._pending_exception = info

    def _teardown(self, *, clean: bool, exc: BaseException | None = None) -> None:
        self._restore_loader()
        self._loader = None  # after the block dlwatch holds no reference to the loader
        self._loader_error = None
        self._shape_probe = None
        monitor, self._monitor = self._monitor, None
        pending = self._pending_exception
        if self._events_path:
            ended = {"ended": self._program_ended} if self.program else {}
            events.emit(self._events_path, "stop", clean=clean, interrupted=self._interrupted, **ended)
            threaddeath_mod = sys.modules.get("dlwatch.inproc.threaddeath")
            if threaddeath_mod is not None:
                threaddeath_mod.uninstall(self._events_path)
        self._stop_monitor(monitor, pending)
        if self._hb is not None:
            self._hb.close()
            self._hb = None
        try:  # the process is as it was before the block: no handler left on the dump signal
            from dlwatch.wire import dumps

            dumps.uninstall()
        except Exception:
            pass
        self._active = False
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
                monitor.wait(MONITOR_STOP_TIMEOUT_S if alive else 0.1)
            except subprocess.TimeoutExpired:
                _warn("monitor did not stop in time; killed it")
                monitor.kill()
                monitor.wait()
                alive = False
            if not alive or monitor.returncode not in (0, None):
                self._monitor_lost(monitor.returncode, pending)
        # Watch.summary: read while the private run directory (which names the summary) is still there
        self._read_summary()

    def _monitor_lost(self, code: int | None, pending: dict[str, Any] | None) -> None:
        if not self._monitor_warned:
            self._monitor_warned = True
            _warn(f"the monitor process exited early (exit code {code}); this run was not fully watched")
        try:
            written = self._fallback_summary(pending)
        except Exception as err:
            written, why = False, f"{type(err).__name__}: {err}"
        else:
            why = "the finishing process failed (see above)"
        if not written and pending is not None:  # nothing is lost silently
            _warn(f"could not write the exception report: {why}")

    # ------------------------------------------------------------------ Ctrl-C after a long wait

    def note_interrupt(self, exc: BaseException, where: str, waited_s: float, first_batch: bool = False) -> None:
        """A KeyboardInterrupt after the loop waited ``waited_s``: maybe an ``interrupt`` incident.

        When the wait could be long enough (see dlwatch.wire.interrupt), the monitor hears of it and
        this thread waits, ``ACK_TIMEOUT_S`` at most, until it has judged the wait and taken every
        process's stacks; the DataLoader's workers are still there (torch makes them ignore SIGINT).
        A second Ctrl-C ends the wait.  Never raises: the KeyboardInterrupt goes on unchanged.
        """
        root = self._parent or self
        try:
            if id(exc) == root._interrupt_told or not root._active or not root._events_path or not root.run_dir:
                return
            root._interrupt_told = id(exc)
            explicit = self.options.body_timeout if where == interrupt.BODY else self.options.stall_timeout
            monitor = root._monitor
            if not interrupt.worth_telling(where, first_batch, waited_s, explicit) or monitor is None:
                return
            if monitor.poll() is not None:
                return
            with HeldSigchld(quiet=True):  # a worker's death meanwhile is torch's to report, after this
                root._interrupt_seq += 1
                seq = root._interrupt_seq
                frames, omitted = interrupted_frames(exc)
                ack = interrupt.ack_path(root.run_dir, seq)
                fifo = _open_ack(ack)
                try:
                    events.emit(
                        root._events_path,
                        "interrupt",
                        seq=seq,
                        where=where,
                        first_batch=first_batch,
                        waited_s=round(waited_s, 3),
                        thread=threading.current_thread().name,
                        frames=frames,
                        frames_omitted=omitted,
                    )
                    monitor.stdin.write(b"interrupt\n")  # type: ignore[union-attr]
                    monitor.stdin.flush()  # type: ignore[union-attr]
                    deadline = time.monotonic() + interrupt.ACK_TIMEOUT_S
                    while monitor.poll() is None and (left := deadline - time.monotonic()) > 0:
                        # a blocking wait on the FIFO: no wake-ups the monitor would read as this process's life
                        if fifo is not None:
                            if select.select([fifo], [], [], min(left, 5.0))[0]:
                                break
                        elif os.path.lexists(ack):
                            break
                        else:
                            time.sleep(0.05)
                finally:
                    if fifo is not None:
                        os.close(fifo)
        except KeyboardInterrupt:
            pass  # a second Ctrl-C: the user does not wait for the evidence; the first goes on
        except Exception:
            pass

    def note_interrupt_in_body(self, exc: BaseException) -> None:
        """A KeyboardInterrupt leaving the block or the program: if it dropped an iterator whose loop
        body had run long (see _TimedIterator.__del__), the body's wait is judged as in note_interrupt."""
        root = self._parent or self
        dropped, root._dropped = root._dropped, None
        if dropped is None or id(exc) == root._interrupt_told:
            return
        when, began = dropped
        # dropped by this interrupt: torch's shutdown of stuck workers takes up to 5 s a worker, then this
        if time.monotonic() - when <= DROP_RECENT_S:
            self.note_interrupt(exc, interrupt.BODY, when - began)

    def _check_monitor(self) -> None:
        if self._parent is not None:  # a segment: the program watch's monitor (none once it closed)
            self._parent._check_monitor()
            return
        m = self._monitor
        if m is not None and not self._monitor_warned and m.poll() is not None:
            self._monitor_warned = True
            _warn(f"the monitor process exited early (exit code {m.returncode}); training continues unwatched")

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        loader = self._loader
        if loader is None:
            raise RuntimeError("dlwatch.watch: iterate the watched object inside its `with` block")
        self._iterated = True
        try:
            if not self._active or self._swapped:
                return iter(loader)  # the loader's own (instrumented) __iter__
            return self._instrument(iter(loader))
        except BaseException as exc:  # raised by the loader's __iter__: as bare, without this frame
            _unhide(exc)
            raise

    def __len__(self) -> int:
        # the `as` form stands in for the loader: a progress bar (tqdm) asks len() of what it wraps
        loader = self._loader
        if loader is None:
            raise TypeError("dlwatch.watch: the watched object has a length only inside its `with` block")
        return len(loader)

    def __bool__(self) -> bool:
        # with __len__ defined, truth would be len(): keep the loader's own (a generator is true, has no len)
        return bool(self._loader) if self._loader is not None else True

    def _before_iter(self) -> None:
        with HeldSigchld():
            self._before_iter_checks()

    def _before_iter_checks(self) -> None:
        if self._hook is not None:
            if self._generations >= FINGERPRINT_GENERATIONS:
                self._hook.fingerprint = False
            # workers started by this iterator stamp their RNG fingerprints with its epoch
            self._hook.epoch = self._hb.epochs + 1 if self._hb is not None else None
        try:
            self._preflight_start()
        except Exception:
            pass  # a check failing must not stop the epoch
        try:
            self._arm_fork_record()
        except Exception:
            pass

    def _arm_fork_record(self) -> None:
        """Where the other threads are at each worker fork of the iterator about to be built
        (:mod:`dlwatch.inproc.forkthreads`); only fork workers inherit a held lock."""
        loader = self._loader
        if loader is None or not _is_dataloader(loader) or not loader.num_workers or not self._events_path:
            return
        if loader.persistent_workers and getattr(loader, "_iterator", None) is not None:
            return  # the workers are already running: nothing forks now
        if _start_method(loader) == "fork":
            from dlwatch.inproc import forkthreads

            forkthreads.arm()

    # ------------------------------------------------------------------ preflight and the summary

    def _usable_cpus(self) -> dict[str, Any] | None:
        if self._cpus is None:
            try:
                from dlwatch.collect.system import usable_cpus

                self._cpus = usable_cpus(0)
            except Exception:
                self._cpus = {}
        return self._cpus

    def _preflight_start(self) -> None:
        """Checks made as an epoch's iterator is created, before torch starts its workers."""
        loader = self._loader
        if loader is None or not _is_dataloader(loader) or not self._events_path:
            return
        from dlwatch.inproc import preflight

        state = preflight.sampler_state(loader)
        if state is not None and "sampler-epoch-not-set" not in self._ignored:
            events.emit(self._events_path, "sampler_epoch", **state)
        if getattr(loader, "persistent_workers", False) and getattr(loader, "_iterator", None) is not None:
            return  # the workers are already running: nothing starts now
        cfg = {
            "num_workers": loader.num_workers,
            "pin_memory": loader.pin_memory,
            "multiprocessing_context": _start_method(loader) if loader.num_workers > 0 else None,
        }
        signals = preflight.start_checks(preflight.start_facts(cfg, self._usable_cpus()))
        self._send_preflight(signals)
        for sig in signals:  # pin_memory without CUDA is also advice: a fact of the run, not of its start
            if (
                sig["playbook"] == "pin-memory-without-cuda"
                and "advice:pin-memory-without-cuda" not in self._preflight_sent
            ):
                self._preflight_sent.add("advice:pin-memory-without-cuda")
                events.emit(
                    self._events_path, "advice", **{k: v for k, v in sig.items() if k not in ("event", "stage")}
                )

    def _preflight_first_batch(self, batch: Any, batch_bytes: int | None) -> None:
        loader = self._loader
        if loader is None or not _is_dataloader(loader) or not loader.num_workers:
            return
        from dlwatch.inproc import preflight

        cfg = {
            "num_workers": loader.num_workers,
            "prefetch_factor": loader.prefetch_factor,
            "sharing_strategy": _sharing_strategy(),
        }
        thresholds = {pid: dict(pb.thresholds) for pid, pb in self._advice_pbs.items()}
        self._send_preflight(
            preflight.first_batch_checks(preflight.first_batch_facts(cfg, batch, batch_bytes), thresholds)
        )

    def _send_preflight(self, signals: list[dict[str, Any]]) -> None:
        from dlwatch.inproc.preflight import warning_text

        for sig in signals:
            pid = sig["playbook"]
            if pid in self._ignored or pid in self._preflight_sent:
                continue
            self._preflight_sent.add(pid)
            self._preflight_signals.append(sig)
            if self._events_path:
                events.emit(self._events_path, "advice", **{k: v for k, v in sig.items() if k != "event"})
            if sig.get("torch_warns"):
                continue  # torch prints this one itself: the finding goes to the summary, not a second warning
            pb = self._advice_pbs.get(pid)
            warn(
                f"dlwatch: {warning_text(sig, pb.title if pb is not None else pid)}",
                DlwatchWarning,
                stacklevel=_user_stacklevel(),
            )

    def _fallback_summary(self, pending: dict[str, Any] | None) -> bool:
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
            "started_at": self._entered_at,
            "ended": "exception" if pending is not None else "interrupted" if self._interrupted else "clean",
            "cpus": self._cpus,
            "preflight": self._preflight_signals,
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
            return child.wait(FINISH_TIMEOUT_S) == 0
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

    def _note_workers(self, it: Any) -> None:
        workers = getattr(it, "_workers", None)
        if not workers:
            return
        pids = tuple(w.pid for w in workers if getattr(w, "pid", None))
        forks = _fork_record()
        if pids and pids != self._worker_pids and self._events_path:
            self._worker_pids = pids
            self._generations += 1
            if self._parent is not None:
                fields = (("pids", events.INTS), ("iteration", events.INT), ("loader", self._loader_key))
            else:
                fields = (("pids", events.INTS),)
            events.line_format("loader_workers", fields).emit(
                self._events_path, pids=list(pids), iteration=self._iteration
            )
            if any(forks):  # the other threads at each worker's fork, in fork order (worker i: the i-th)
                events.emit(self._events_path, "fork_threads", pids=list(pids), forks=forks)

    def _instrument(self, it: Iterator[Any]) -> Iterator[Any]:
        self._note_workers(it)
        hb = self._hb
        if hb is None:
            return it
        return self._timed(it, hb)

    def _timed(self, it: Iterator[Any], hb: HeartbeatWriter) -> Iterator[Any]:
        hb.begin_epoch()
        return _TimedIterator(it, hb, self)

    def _check_shape(self, batch: Any, index: int) -> None:
        if not self._batch_bytes_sent and self._events_path:
            self._batch_bytes_sent = True
            try:
                from dlwatch.inproc.shapes import batch_nbytes

                nbytes = batch_nbytes(batch)
                events.emit(self._events_path, "batch_bytes", batch_bytes=nbytes)
                self._preflight_first_batch(batch, nbytes)
            except Exception:
                pass
        if self._shape_probe is None:
            return
        try:
            evidence = self._shape_probe.check(batch, index)
            if evidence and not self._shape_reported and self._events_path:
                self._shape_reported = True
                # evidence keys never collide with emit's own arguments (path, event)
                events.emit(
                    self._events_path,
                    "batch_shape",
                    **{k: v for k, v in evidence.items() if k not in ("path", "event")},
                )
        except Exception:
            return


def _open_ack(path: str) -> int | None:
    """The read end of a new FIFO for the monitor's answer (see dlwatch.wire.interrupt), or None."""
    try:
        os.mkfifo(path, 0o600)  # in the private run directory
        return os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None


def watch(
    loader: Iterable[Any],
    *,
    report_dir: Any = None,
    poll_interval: Any = None,
    stall_timeout: Any = None,
    enabled: Any = None,
    playbooks: Any = None,
    body_timeout: Any = None,
    ignore: Any = None,
    keep_runs: Any = None,
) -> Watch:
    """Watch a DataLoader (or any iterable) for the duration of a ``with`` block.

    Both forms yield the very same batches as the bare loader::

        with dlwatch.watch(loader) as batches:
            for batch in batches: ...

        with dlwatch.watch(loader):
            for batch in loader: ...

    Options (each has an environment variable that replaces the default; an explicit
    keyword wins, except DLWATCH_DISABLE=1, which always turns watch into a no-op):

    - ``report_dir``: where incidents go (DLWATCH_DIR, default ./dlwatch-reports)
    - ``poll_interval``: seconds between monitor polls (DLWATCH_POLL_INTERVAL, default 1.0)
    - ``stall_timeout``: seconds without a batch that count as a stall
      (DLWATCH_STALL_TIMEOUT, default adaptive: max(60 s, 10 x p99 batch interval),
      300 s for the first batch of an epoch)
    - ``enabled``: False makes watch a no-op (DLWATCH_ENABLED)
    - ``playbooks``: extra playbook directories (DLWATCH_PLAYBOOKS, os.pathsep-separated)
    - ``body_timeout``: seconds the loop body may run between two batches before it counts
      as a stall (DLWATCH_BODY_TIMEOUT, default adaptive: see the README)
    - ``ignore``: playbook ids to silence for this run, and ``"batch-dim-mismatch:KEY"`` to
      leave one key of the batch out of the shape check (DLWATCH_IGNORE, comma-separated)
    - ``keep_runs``: how many run summaries (``runs/<run-id>/``) to keep in the report
      directory; after each summary is written the oldest beyond this many are removed,
      only ones this user wrote (DLWATCH_KEEP_RUNS, default 200; 0 keeps all).  Incidents
      are never removed.
    """
    return Watch(
        loader,
        report_dir=report_dir,
        poll_interval=poll_interval,
        stall_timeout=stall_timeout,
        enabled=enabled,
        playbooks=playbooks,
        body_timeout=body_timeout,
        ignore=ignore,
        keep_runs=keep_runs,
    )
