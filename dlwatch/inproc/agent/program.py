"""``dlwatch run``'s watch: one per process for the program's life, each loader iteration a segment of it.

The first loader iteration in a process starts the :class:`Program` (``runhook._program_watch``):
one monitor, one heartbeat, one events file.  Each iteration is a :class:`Segment`: that loader's
hooks and probes for that iteration, sharing the program's session, advisor and Ctrl-C state by
reference.  A loader's iterations carry its RNG-fingerprint generations, batch-shape probe and
batch size over, as a watch's epochs do (keyed by a short loader key, ``loader1``, ``loader2``... in
order of first iteration, kept in a weak dictionary: dlwatch keeps no loader alive).  The monitor
hears ``loader_iter`` before torch starts the workers and ``loader_iter_end`` with the segment's
figures.  atexit closes the program (:meth:`Program.close_program`): the monitor writes one summary.
"""

from __future__ import annotations

import threading
import time
import weakref
from typing import Any, Iterator

from dlwatch.inproc.agent.advisor import Advisor
from dlwatch.inproc.agent.ctrlc import CtrlC
from dlwatch.inproc.agent.loaderinfo import is_dataloader, loader_config
from dlwatch.inproc.agent.probes import FINGERPRINT_GENERATIONS, LoaderProbes
from dlwatch.inproc.agent.session import REPORTED, Session
from dlwatch.inproc.agent.settings import Settings
from dlwatch.inproc.agent.sigchld import HeldSigchld
from dlwatch.inproc.agent.warning import warn_program
from dlwatch.wire import events

# loader_iter_end's fields after its loader (events.LineFormat: a template, the iteration's figures its slots)
_ITER_END_FIELDS = (
    ("batches", events.INT),
    ("data_wait_s", events.FLOAT),
    ("first_batch_s", events.FLOAT),
    ("active_s", events.FLOAT),
    ("wall_s", events.FLOAT),
    ("worker_pids", events.INTS),
)


class Segment(LoaderProbes):
    """One loader iteration of the program: its loader's hooks and probes, its number, its figures."""

    def __init__(self, program: "Program", loader: Any, iteration: int, loader_key: str) -> None:
        super().__init__(loader, program.session, program.settings, program.advisor, program.ctrlc)
        self.program = program
        self.iteration = iteration  # the segment's number in the program (1, 2, ...)
        self.loader_key = loader_key
        self.row: dict[str, Any] | None = None  # the segment's figures, sent when it ends

    def _send_workers(self, path: str, pids: tuple[int, ...]) -> None:
        fields = (("pids", events.INTS), ("iteration", events.INT), ("loader", self.loader_key))
        events.line_format("loader_workers", fields).emit(path, pids=list(pids), iteration=self.iteration)

    def iterate_with(self, original: Any) -> Iterator[Any]:
        """This iteration's iterator, built by ``original`` (the DataLoader's own ``__iter__``) with
        dlwatch's hooks on the loader only while torch builds it (torch reads ``worker_init_fn`` and
        ``collate_fn`` then), and instrumented.  Never re-enters the loader's class: a subclass's
        ``__iter__`` that called ``super().__iter__()`` runs once, as bare."""
        loader = self.loader
        if not self.session.active or loader is None:
            return original(loader)
        self.before_iter()
        hooked = False
        try:
            if is_dataloader(loader) and not (loader.persistent_workers and loader._iterator is not None):
                self.set_hooks()
                hooked = True
        except Exception:
            pass
        try:
            it = original(loader)
        finally:
            if hooked:
                self.unset_hooks()
        try:
            return self.instrument(it)
        except Exception:
            return it


class Program:
    """The program watch of one process (``dlwatch run``): its session and its live segments."""

    def __init__(self) -> None:
        self.settings = Settings()  # options from the environment that `dlwatch run` set
        self.session = Session(self.settings)
        self.advisor = Advisor(self.session, self.settings)
        self.ctrlc = CtrlC(self.session)
        self._segments: list[Segment] = []  # the segments whose iterators are alive, oldest first
        self._lock = threading.RLock()  # an iterator's __del__ may end a segment inside another's start
        self._iterations = 0
        self._loader_ids: Any = weakref.WeakKeyDictionary()  # loader -> its key, while the loader lives
        self._loaders_seen = 0
        # loader key -> (worker generations started, its batch-shape probe, its batch size sent): what a
        # loader's iterations carry over, as one watch's epochs do
        self._generations_of: dict[str, tuple[int, Any, bool]] = {}
        self._mark: tuple[int, float, float, float] | None = None  # heartbeat figures when last credited

    @property
    def active(self) -> bool:
        return self.session.active

    def start(self, loader: Any) -> None:
        """The monitor, at the first loader iteration (that loader is the run's config); unwatched, with
        one warning, where it cannot start.  Loaders are left alone: their own ``__iter__`` is never
        re-entered (see :meth:`Segment.iterate_with`)."""
        if not self.settings.options.enabled:
            return
        session = self.session
        try:
            session.start(loader, program=True)
        except Exception as exc:  # dlwatch failing must not stop training
            warn_program(f"could not start monitoring ({type(exc).__name__}: {exc}); training continues unwatched")
            try:
                session.stop(clean=False)
            except Exception:
                pass
            return
        session.active = True
        session.announce_nested()  # the program is no `with` block: a user's own watch is not nested in it

    def iterate_segment(self, loader: Any, original: Any) -> tuple[Iterator[Any], Segment]:
        """One iteration of any loader of this process, as a segment.

        The monitor hears of it (``loader_iter``: its number and its loader) before torch starts the
        workers; :meth:`end_segment` sends its figures.
        """
        with self._lock:
            self._iterations += 1
            key, name = self._key_of(loader)
            seg = Segment(self, loader, self._iterations, key)
            seg.hb = self.session.hb
            # RNG fingerprints: the first FINGERPRINT_GENERATIONS worker generations of each loader, as
            # for a watch over its epochs (later ones would cost each worker start ~3 ms and tell nothing new)
            seg.generations, probe, seg.batch_bytes_sent = self._generations_of.get(key, (0, None, False))
            if is_dataloader(loader):
                seg.prepare()
                if probe is not None:  # the loader's probe goes on through its epochs, as under a watch
                    seg.shape_probe = probe
                if seg.generations >= FINGERPRINT_GENERATIONS and seg.hook is not None:
                    seg.hook.fingerprint = False
                    seg.collate_hook = None
            if self.session.events_path:
                events.emit(
                    self.session.events_path,
                    "loader_iter",
                    iteration=seg.iteration,
                    loader=key,
                    name=name,
                    config=loader_config(loader),
                )
            self._credit()
            # an older iterator ending no longer marks the loop as outside (see _TimedIterator._end)
            for older in self._segments:
                older.hb = None
            seg.row = {
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
        self._generations_of[key] = (seg.generations, seg.shape_probe, True)
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
        hb = self.session.hb
        if hb is None:
            return
        hb._sync_hot()
        now = (hb.batches, hb.total_wait_s, hb.total_first_wait_s, time.monotonic())
        last, self._mark = self._mark, now
        if last is None or not self._segments:
            return
        row = self._segments[-1].row
        if row is not None:
            row["batches"] += now[0] - last[0]
            row["data_wait_s"] += now[1] - last[1]
            row["first_batch_s"] += now[2] - last[2]
            row["active_s"] += now[3] - last[3]

    def end_segment(self, seg: Segment, exc: BaseException | None) -> None:
        """A segment's iterator ended (exhausted, raised, or dropped): its row goes to the monitor."""
        session = self.session
        with self._lock:
            if not any(s is seg for s in self._segments):
                return
            if exc is not None:
                clean = isinstance(exc, (GeneratorExit, KeyboardInterrupt)) or (
                    isinstance(exc, SystemExit) and exc.code in (0, None)
                )
                if not clean and id(exc) not in REPORTED:
                    seg.record_exception(exc)  # also for a summary written here (monitor gone)
            self._credit()
            self._segments = [s for s in self._segments if s is not seg]
            row, seg.row = seg.row or {}, None
            if session.events_path and session.active:
                fields = (("iteration", events.INT), ("loader", seg.loader_key), *_ITER_END_FIELDS)
                events.line_format("loader_iter_end", fields).emit(
                    session.events_path,
                    iteration=seg.iteration,
                    batches=row.get("batches", 0),
                    data_wait_s=round(row.get("data_wait_s", 0.0), 6),
                    first_batch_s=round(row.get("first_batch_s", 0.0), 6),
                    active_s=round(row.get("active_s", 0.0), 6),
                    wall_s=round(time.time() - row.get("started_at", time.time()), 6),
                    worker_pids=list(seg.worker_pids),
                )
            if self._segments and self._segments[-1].hb is None:
                self._segments[-1].hb = session.hb  # the newest live iterator marks the loop's state again
            seg.loader = seg.shape_probe = seg.hook = seg.collate_hook = seg.loader_error = None

    def note_interrupt_in_body(self, exc: BaseException) -> None:
        """At exit: a Ctrl-C that dropped an iterator in a long loop body (see CtrlC.note_in_body)."""
        self.ctrlc.note_in_body(exc)

    def close_program(self, ended: str) -> None:
        """The program ends (atexit): the live segments' rows, then the monitor's stop and the summary."""
        with self._lock:
            for seg in list(reversed(self._segments)):
                self.end_segment(seg, None)
        session = self.session
        session.ended = ended
        with HeldSigchld(quiet=True):
            session.interrupted = ended == "interrupted"
            if session.active:
                try:
                    session.stop(clean=True)
                except Exception as err:
                    warn_program(f"error while stopping the monitor: {type(err).__name__}: {err}")
