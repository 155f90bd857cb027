"""What runs inside every DataLoader worker: registration, then the user's worker_init_fn, then RNG fingerprints.

Two small picklable objects (spawn and forkserver pickle worker_init_fn and
collate_fn), importing nothing heavy.  :class:`WorkerHook` is the loader's
worker_init_fn: it registers the worker, runs the user's function, and takes the
first RNG fingerprint.  :class:`CollateHook` is the loader's collate_fn: after a
worker's first batch it takes the second fingerprint, so the monitor can tell a
generator the worker draws from (its state moved) from one used only in
``Dataset.__init__``.  The user's functions run exactly as before: same
arguments, same order relative to torch's own seeding, the very same return
value, and their exceptions propagate untouched.  dlwatch's own steps never raise.
"""

from __future__ import annotations

import ctypes
import json
import os
import time
from typing import Any, Callable

from dlwatch.wire import contract, events

# In a worker whose start fingerprint was taken: events path -> (worker_id, epoch, snapshot)
# until its first batch is collated (keyed by run, should two watches share a worker).  Filled
# only inside worker processes (by WorkerHook), empty everywhere else, so CollateHook costs one
# global lookup per batch.
_start: dict[str, tuple[int, int | None, Any]] = {}

PR_SET_PTRACER = 0x59616D61  # Yama: allow this pid (and its descendants) to ptrace us


_prctl: Any = None  # libc's prctl once looked up (False: no Yama, or no libc): forked workers inherit it


def _lookup_prctl() -> Any:
    global _prctl
    if _prctl is None:
        try:
            yama = os.path.exists("/proc/sys/kernel/yama/ptrace_scope")
            _prctl = ctypes.CDLL(None, use_errno=True).prctl if yama else False
        except Exception:
            _prctl = False
    return _prctl


def allow_ptrace_from(tracer_pid: int | None) -> None:
    """Under Yama ptrace_scope=1 only ancestors may attach: name the monitor explicitly."""
    if not tracer_pid:
        return
    try:
        prctl = _lookup_prctl()
        if prctl:
            prctl(PR_SET_PTRACER, ctypes.c_ulong(tracer_pid), 0, 0, 0)
    except Exception:
        pass


def _drop_own_entry(exc: BaseException) -> None:
    """Take this module's frame off the traceback of an exception the user's function raised.

    The frame is there only because the worker is watched; torch formats the worker's traceback into
    the message the program sees ("Caught ValueError in DataLoader worker process 0. Original
    Traceback ..."), which must read as bare.  A bare ``raise`` adds no entry for this frame again.
    """
    try:
        tb = exc.__traceback__
        if tb is not None and tb.tb_frame.f_code.co_filename == __file__:
            exc.__traceback__ = tb.tb_next
    except Exception:
        pass


class WorkerHook:
    def __init__(
        self,
        user_fn: Callable[[int], Any] | None,
        events_path: str,
        run_dir: str,
        start_method: str | None,
        monitor_pid: int | None,
        rng_depth: int = 2,
    ) -> None:
        self.user_fn = user_fn
        self.events_path = events_path
        self.run_dir = run_dir
        self.start_method = start_method
        self.monitor_pid = monitor_pid
        self.rng_depth = rng_depth
        # RNG states are compared across the workers of one generation; two generations are
        # enough to see a duplicate, and after that the ~1 ms per worker start is saved
        # (set in the parent before each new iterator forks or pickles its workers).
        self.fingerprint = True
        self.epoch: int | None = None  # the watch's epoch in which these workers start (set likewise)
        self._line = _registered_template(start_method, os.path.join(run_dir, "dumps"))

    def __call__(self, worker_id: int) -> None:
        self._register(worker_id)
        if self.user_fn is not None:
            try:
                self.user_fn(worker_id)
            except BaseException as exc:
                _drop_own_entry(exc)
                raise
        if self.fingerprint:
            self._fingerprint(worker_id)

    def _register(self, worker_id: int) -> None:
        try:
            allow_ptrace_from(self.monitor_pid)
            dump_path = None
            try:
                from dlwatch.wire import dumps

                dump_path = dumps.install(os.path.join(self.run_dir, "dumps"))
                dumps.install_interrupt(os.path.join(self.run_dir, "dumps"))  # its stacks at a Ctrl-C
            except Exception:
                pass
            crash_output = self._crash_dump()
            line = getattr(self, "_line", None)  # (a hook pickled by an older dlwatch has none)
            if line is not None and (dump_path is None or dump_path.endswith(f"{os.sep}{os.getpid()}.txt")):
                events.append_line(self.events_path, line.format(worker_id, os.getppid(), dump_path, crash_output))
                return
            events.emit(
                self.events_path,
                contract.WORKER_REGISTERED.name,
                worker_id=worker_id,
                start_method=self.start_method,
                ppid=os.getppid(),
                dump_path=dump_path,
                crash_output=crash_output,
            )
        except Exception:
            pass

    def _crash_dump(self) -> str | None:
        """faulthandler on the fatal signals, into ``dumps/<pid>.crash.txt`` that the monitor reads
        when this worker is gone: a native crash in ``__getitem__`` then leaves its Python line.
        A program that enabled faulthandler itself keeps its own setting.  Returns where a crash's
        stack goes: ``dlwatch`` (the crash file), ``program`` (the program's own faulthandler: its
        file, the worker's stderr unless it chose another), ``none``, or None when unknown."""
        try:
            import faulthandler

            from dlwatch.wire import dumps

            if dumps.install_crash(os.path.join(self.run_dir, "dumps")) is not None:
                return "dlwatch"
            return "program" if faulthandler.is_enabled() else "none"
        except Exception:
            return None

    def _fingerprint(self, worker_id: int) -> None:
        try:
            from dlwatch.inproc import rngcheck
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            dataset = info.dataset if info is not None else None
            snap = rngcheck.snapshot(dataset, depth=self.rng_depth)
            if events.emit(
                self.events_path,
                contract.RNG_FINGERPRINT.name,
                worker_id=worker_id,
                epoch=self.epoch,
                stage="start",
                fingerprints=snap.prints,
                states=_pairs(snap.prints),
            ):
                _start[self.events_path] = (worker_id, self.epoch, snap)
        except Exception:
            pass


_CRASH_OUTPUTS = (None, "dlwatch", "program", "none")  # what _crash_dump answers


class _RegisteredLine:
    """``worker_registered``'s JSON line as a template, made in the training process.

    A worker formats it with four values instead of building, redacting and encoding a record:
    that walk, in a process that has just forked, touched a hundred pages (each a copy-on-write
    fault) and was a third of what dlwatch added to a worker's start.  Made only where it was
    proven here to give the very bytes ``events.emit`` writes (redaction included), for a
    sample of every shape; else None, and the worker emits the general way.
    """

    def __init__(self, head: bytes, dump_prefix: bytes, crash: dict[str | None, bytes]) -> None:
        self.head, self.dump_prefix, self.crash = head, dump_prefix, crash

    def format(self, worker_id: int, ppid: int, dump_path: str | None, crash_output: str | None) -> bytes:
        pid = os.getpid()
        dump = b"null" if dump_path is None else b'%s%d.txt"' % (self.dump_prefix, pid)
        return b"%s%r%s%d%s%d%s%d%s%s%s%s}\n" % (
            b'{"ts": ',
            time.time(),
            b', "event": "worker_registered", "pid": ',
            pid,
            b', "worker_id": ',
            int(worker_id),
            self.head,
            int(ppid),
            b', "dump_path": ',
            dump,
            b', "crash_output": ',
            self.crash[crash_output],
        )


_templates: dict[tuple[str | None, str], _RegisteredLine | None] = {}  # made once per start method and run


def _registered_template(start_method: str | None, dump_dir: str) -> _RegisteredLine | None:
    key = (start_method, dump_dir)
    if key not in _templates:
        if len(_templates) >= 64:  # watches one after another in a long program: bounded
            _templates.clear()
        _templates[key] = _make_template(start_method, dump_dir)
    return _templates[key]


def _make_template(start_method: str | None, dump_dir: str) -> _RegisteredLine | None:
    try:
        from dlwatch._fs import json_line

        enc = events.encoded
        path = enc(os.path.join(dump_dir, "1.txt"))
        if not path.endswith(b'1.txt"'):
            return None
        tmpl = _RegisteredLine(
            b', "start_method": ' + enc(start_method) + b', "ppid": ',
            path[: -len(b'1.txt"')],
            {c: enc(c) for c in _CRASH_OUTPUTS},
        )
        for dump_path in (None, os.path.join(dump_dir, f"{os.getpid()}.txt")):
            for crash in _CRASH_OUTPUTS:
                line = tmpl.format(3, 4242, dump_path, crash)
                ts = json.loads(line)["ts"]
                record = {
                    "ts": ts,
                    "event": contract.WORKER_REGISTERED.name,
                    "pid": os.getpid(),
                    "worker_id": 3,
                    "start_method": start_method,
                    "ppid": 4242,
                    "dump_path": dump_path,
                    "crash_output": crash,
                }
                if line != json_line(record):
                    return None
        return tmpl
    except Exception:
        return None


def _pairs(prints: dict[str, str]) -> list[list[str]]:
    """The event's ``states``, [[path, hash], ...]: the hashes as the detector reads them.

    ``fingerprints`` ({path: hash}, the form every reader of the events accepts) goes through
    redaction, which masks the value of a secret-looking key such as ``dataset.tokenizer.rng``
    to '***' in every worker, which would read as identical state.  In pairs no path is a key.
    """
    return [[path, h] for path, h in sorted(prints.items())]


class CollateHook:
    """The loader's collate_fn during the block: the user's, then (once per worker) the second fingerprint.

    Returns the very batch the user's collate_fn returned and lets its exceptions through
    untouched.  Only in a worker whose start fingerprint was taken, and only after its first
    batch, does it fingerprint again (the generators' objects from the start are kept until
    then, so a generator bound anew is told from one that advanced).
    """

    def __init__(self, user_fn: Callable[[Any], Any], events_path: str, rng_depth: int = 2) -> None:
        self.user_fn = user_fn
        self.events_path = events_path
        self.rng_depth = rng_depth

    def __call__(self, batch: Any) -> Any:
        try:
            out = self.user_fn(batch)
        except BaseException as exc:
            _drop_own_entry(exc)
            raise
        if _start:
            self._after_first_batch()
        return out

    def _after_first_batch(self) -> None:
        start = _start.pop(self.events_path, None)
        try:
            from dlwatch.inproc import rngcheck
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            if info is None or start is None:
                return
            worker_id, epoch, first = start
            snap = rngcheck.snapshot(info.dataset, depth=self.rng_depth)
            drew, rebound = rngcheck.drawn(first, snap)
            events.emit(
                self.events_path,
                contract.RNG_FINGERPRINT.name,
                worker_id=worker_id,
                epoch=epoch,
                stage="after_first_batch",
                fingerprints=snap.prints,
                states=_pairs(snap.prints),
                drawn=drew,
                rebound=rebound,
            )
        except Exception:
            pass
