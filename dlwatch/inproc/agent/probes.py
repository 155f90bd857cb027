"""What dlwatch attaches to a loader's iterations, and what it reads from them.

A :class:`LoaderProbes` holds one loader's hooks (the worker hook and, for the RNG check, the
collate hook, on the loader only while torch builds an iterator or for a block), its batch-shape
probe, the workers each iteration started, and the exception its iterator raised.  A ``with`` block
has one for its loader over all its epochs; under ``dlwatch run`` each loader iteration is a
segment (:class:`dlwatch.inproc.agent.program.Segment`, a subclass) that carries its loader's
probe and worker generations over from the loader's previous iteration.
"""

from __future__ import annotations

import sys
import traceback
from typing import Any, Iterator

from dlwatch.inproc.agent.loaderinfo import is_dataloader, known_len, qualname, start_method
from dlwatch.inproc.agent.sigchld import HeldSigchld
from dlwatch.inproc.agent.timed import _TimedIterator
from dlwatch.inproc.worker_hook import CollateHook, WorkerHook
from dlwatch.inproc import lengths
from dlwatch.wire import contract, events

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


class LoaderProbes:
    """One loader's hooks, batch probe and workers, for the iterations of one run (shared: its session)."""

    def __init__(self, loader: Any, session: Any, settings: Any, advisor: Any, ctrlc: Any) -> None:
        self.loader = loader
        self.session = session
        self.settings = settings
        self.advisor = advisor
        self.ctrlc = ctrlc
        # the heartbeat in which this loader's iterators mark the loop's state (waiting, in the body,
        # outside); None where a newer iteration marks it (dlwatch run) or after the run
        self.hb: Any = None
        self.hook: WorkerHook | None = None
        self.collate_hook: CollateHook | None = None
        self.hooked_own: dict[str, bool] = {}  # whether the loader held worker_init_fn/collate_fn itself
        self.shape_probe: Any = None
        self.shape_reported = False
        self.batch_bytes_sent = False
        self.worker_pids: tuple[int, ...] = ()
        self.generations = 0  # sets of worker processes seen (a new one per epoch unless persistent)
        self.loader_error: BaseException | None = None  # what the loader's iterator raised

    # ------------------------------------------------------------------ hooks and probes

    def prepare(self) -> None:
        """The worker hook and the batch-shape probe for a DataLoader (set on the loader by set_hooks)."""
        from dlwatch.inproc import rngcheck, shapes  # rngcheck imported once here: forked workers inherit it

        loader, session, settings = self.loader, self.session, self.settings
        self.hook = WorkerHook(
            loader.worker_init_fn,
            session.events_path or "",
            session.run_dir or "",
            start_method(loader),
            session.monitor.pid if session.monitor else None,
            rng_depth=int(settings.threshold(rngcheck, "attribute_depth")),
        )
        self.hook.fingerprint = settings.runs(rngcheck)
        try:
            # batches per epoch follow the sampler, which may subsample the dataset; unknown where only
            # the program's own __len__ could say (the probe then judges a short batch by the next one)
            samples = known_len(getattr(loader, "sampler", None))
            if loader.batch_size is not None and settings.runs(shapes):
                self.shape_probe = shapes.BatchShapeProbe(
                    loader.batch_size,
                    loader.drop_last,
                    samples,
                    qualname(loader.collate_fn) or "",
                    check_first=int(settings.threshold(shapes, "check_first")),
                    sample_every=int(settings.threshold(shapes, "sample_every")),
                    confirm_batches=int(settings.threshold(shapes, "confirm_batches")),
                    ignore_keys=settings.options.ignored_batch_keys,
                    time_major=shapes.marks_time_major(loader.collate_fn),
                )
        except Exception:
            self.shape_probe = None
        if self.hook.fingerprint and loader.num_workers > 0:
            # the second RNG fingerprint, after each worker's first batch (see worker_hook)
            self.collate_hook = CollateHook(loader.collate_fn, session.events_path or "", rng_depth=self.hook.rng_depth)

    def set_hooks(self) -> None:
        loader = self.loader
        # which attributes the loader held itself: one that only read through to a wrapped loader
        # (accelerate's adapter) must not stay behind as an attribute of its own after the block
        own = getattr(loader, "__dict__", {})
        self.hooked_own = {name: name in own for name in ("worker_init_fn", "collate_fn")}
        if self.hook is not None:
            loader.worker_init_fn = self.hook
        if self.collate_hook is not None:
            loader.collate_fn = self.collate_hook

    def unset_hooks(self) -> None:
        loader = self.loader
        for name, hook in (("worker_init_fn", self.hook), ("collate_fn", self.collate_hook)):
            if hook is None or getattr(loader, name, None) is not hook:
                continue
            try:
                if self.hooked_own.get(name, True):
                    setattr(loader, name, hook.user_fn)
                else:
                    del loader.__dict__[name]
            except Exception:
                pass

    # ------------------------------------------------------------------ an iteration

    def before_iter(self) -> None:
        """As an iterator is about to be built: the epoch's checks, with torch's SIGCHLD handler waiting."""
        with HeldSigchld():
            self._before_iter_checks()

    def _before_iter_checks(self) -> None:
        if self.hook is not None:
            if self.generations >= FINGERPRINT_GENERATIONS:
                self.hook.fingerprint = False
            # workers started by this iterator stamp their RNG fingerprints with its epoch
            self.hook.epoch = self.hb.epochs + 1 if self.hb is not None else None
        try:
            self.advisor.at_start(self.loader, self.hb.batches_now() if self.hb is not None else None)
        except Exception:
            pass  # a check failing must not stop the epoch
        try:
            self._arm_fork_record()
        except Exception:
            pass

    def _arm_fork_record(self) -> None:
        """Where the other threads are at each worker fork of the iterator about to be built
        (:mod:`dlwatch.inproc.forkthreads`); only fork workers inherit a held lock."""
        loader = self.loader
        if loader is None or not is_dataloader(loader) or not loader.num_workers or not self.session.events_path:
            return
        if loader.persistent_workers and getattr(loader, "_iterator", None) is not None:
            return  # the workers are already running: nothing forks now
        if start_method(loader) == "fork":
            from dlwatch.inproc import forkthreads

            forkthreads.arm()

    def epoch_ended(self, batches: int) -> None:
        """An epoch's iterator ended (StopIteration) after ``batches``: with the length the program asked
        of the loader, if it asked (dlwatch.inproc.lengths), told to the monitor.  Never raises."""
        try:
            loader = self.loader
            n = lengths.asked(loader) if loader is not None else None
            path = self.session.events_path
            if n is None or not path:
                return
            iterable = getattr(loader, "_dataset_kind", None) == 1  # torch's _DatasetKind.Iterable
            events.emit(
                path,
                contract.EPOCH_ENDED.name,
                batches=batches,
                asked_len=n,
                iterable=iterable,
                drop_last=bool(getattr(loader, "drop_last", False)),
                epoch=self.hb.epochs if self.hb is not None else None,
            )
        except Exception:
            pass

    def instrument(self, it: Iterator[Any]) -> Iterator[Any]:
        """The iterator torch built, timed into the heartbeat (as it is where this one marks no loop state)."""
        self.note_workers(it)
        hb = self.hb
        if hb is None:
            return it
        hb.begin_epoch()
        return _TimedIterator(it, hb, self)

    def _send_workers(self, path: str, pids: tuple[int, ...]) -> None:
        events.line_format("loader_workers", (("pids", events.INTS),)).emit(path, pids=list(pids))

    def note_workers(self, it: Any) -> None:
        workers = getattr(it, "_workers", None)
        if not workers:
            return
        pids = tuple(w.pid for w in workers if getattr(w, "pid", None))
        forks = _fork_record()
        path = self.session.events_path
        if pids and pids != self.worker_pids and path:
            self.worker_pids = pids
            self.generations += 1
            self._send_workers(path, pids)
            if any(forks):  # the other threads at each worker's fork, in fork order (worker i: the i-th)
                events.emit(path, "fork_threads", pids=list(pids), forks=forks)

    def check_shape(self, batch: Any, index: int) -> None:
        """A sampled batch (see _TimedIterator): its size once (the shm need), then the shape probe."""
        path = self.session.events_path
        if not self.batch_bytes_sent and path:
            self.batch_bytes_sent = True
            try:
                from dlwatch.inproc.shapes import batch_nbytes

                nbytes = batch_nbytes(batch)
                events.emit(path, "batch_bytes", batch_bytes=nbytes)
                self.advisor.at_first_batch(self.loader, batch, nbytes)
            except Exception:
                pass
        if self.shape_probe is None:
            return
        try:
            evidence = self.shape_probe.check(batch, index)
            if evidence and not self.shape_reported and path:
                self.shape_reported = True
                # evidence keys never collide with emit's own arguments (path, event)
                events.emit(path, "batch_shape", **{k: v for k, v in evidence.items() if k not in ("path", "event")})
        except Exception:
            return

    def record_exception(self, exc: BaseException) -> None:
        """An exception that ends the run: to the monitor for its incident, and kept for the finisher."""
        err = getattr(exc, "errno", None)
        info = {
            "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "message": _cut(str(exc), MAX_MESSAGE_CHARS),
            "errno": err if isinstance(err, int) else None,
            "traceback": _cut(
                "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), MAX_TRACEBACK_CHARS
            ),
            "from_loader": exc is self.loader_error,
        }
        path = self.session.events_path
        if path:
            from dlwatch.inproc.loader_exit import worker_exitcodes

            codes = worker_exitcodes(exc)  # how the workers behind the error ended (worker-killed)
            if codes:
                events.emit(path, "worker_exits", exitcodes=codes)
            events.emit(path, "exception", exception=info)
        self.session.pending = info
