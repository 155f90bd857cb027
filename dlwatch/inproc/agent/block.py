"""``dlwatch.watch``: the ``with`` block, in the training process.

It does three cheap things and nothing else: it times each batch into the mmap'd
heartbeat, it chains a hook into every DataLoader worker, and it hands an
exception escaping the block to the monitor.  Everything that reads /proc,
dumps stacks or writes reports happens in the separate monitor process
(``dlwatch.monitor.loop``), which imports no torch.

Contract with the user's code: the same batches, the same exceptions (the very
same object, never wrapped or swallowed), the same worker_init_fn behaviour.
Whatever goes wrong inside dlwatch becomes one warning, never an exception in
the training loop.

:class:`Watch` is the block: the loader it is given (its class swapped for the block, or
iterated through the ``as`` form), its entry and exit.  It composes the rooms of this
package: the settings, the session (run dir, monitor, summary), the loader's probes (hooks,
batch probe, the timed iterator), the preflight advisor and the Ctrl-C protocol.
"""

from __future__ import annotations

import sys
from typing import Any, Iterable, Iterator

from dlwatch.inproc.agent.advisor import Advisor
from dlwatch.inproc.agent.ctrlc import CtrlC
from dlwatch.inproc import lengths
from dlwatch.inproc.agent.loaderinfo import adapted_loader, is_dataloader
from dlwatch.inproc.agent.probes import LoaderProbes
from dlwatch.inproc.agent.session import OPEN_BLOCKS, REPORTED, Session
from dlwatch.inproc.agent.settings import Settings
from dlwatch.inproc.agent.sigchld import HeldSigchld, unhide
from dlwatch.inproc.agent.warning import warn_program

_WATCHED_CLASSES: dict[type, type] = {}


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
                    w._probes.before_iter()
                except BaseException as exc:  # torch's exception for a worker that died meanwhile
                    unhide(exc)
                    raise
            it = cls.__iter__(self)
            return it if w is None else w._probes.instrument(it)

        attrs: dict[str, Any] = {
            "__iter__": __iter__,
            "__module__": cls.__module__,
            "__qualname__": cls.__qualname__,
            "_dlwatch_original": cls,
        }
        if hasattr(cls, "__len__"):

            def __len__(self: Any) -> int:
                n = cls.__len__(self)  # the program's own call, once, as bare; dlwatch keeps the answer
                lengths.note(self, n)
                return n

            attrs["__len__"] = __len__
        sub = type(cls.__name__, (cls,), attrs)
        _WATCHED_CLASSES[cls] = sub
    return sub


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
        self._settings = settings = Settings(
            report_dir=report_dir,
            poll_interval=poll_interval,
            stall_timeout=stall_timeout,
            enabled=enabled,
            playbooks=playbooks,
            body_timeout=body_timeout,
            ignore=ignore,
            keep_runs=keep_runs,
        )
        self.options = settings.options
        self._session = session = Session(settings)
        advisor = Advisor(session, settings)
        self._ctrlc = ctrlc = CtrlC(session)
        # the object the program iterates, and the DataLoader dlwatch instruments: the same, except for a
        # wrapper that delegates to a DataLoader it holds (accelerate's DataLoaderShard: its `__class__`
        # answers the DataLoader's, so it cannot be swapped itself); the wrapper is iterated as it is
        self._outer: Any = loader
        self._probes = LoaderProbes(adapted_loader(loader), session, settings, advisor, ctrlc)
        self._swapped = False
        self._iterated = False  # the watch object itself was iterated (the `as` form)
        self._in_place_warning = False  # the loader could not be instrumented in place: warn if used so

    @property
    def _loader(self) -> Any:
        return self._probes.loader

    @_loader.setter
    def _loader(self, loader: Any) -> None:
        self._probes.loader = loader

    @property
    def monitor_pid(self) -> int | None:
        """The monitor process's pid while the block runs (None when disabled or stopped)."""
        monitor = self._session.monitor
        return monitor.pid if monitor is not None else None

    @property
    def run_dir(self) -> str | None:
        """The block's private run directory (events, heartbeat) while it runs."""
        return self._session.run_dir

    @property
    def report_dir(self) -> str:
        """Where this block's reports go (a private directory in TMPDIR when the one asked for was refused)."""
        return self._session.report_dir

    @property
    def summary(self) -> dict[str, Any] | None:
        """The run summary, after the block (see dlwatch.report.summary)."""
        return self._session.summary

    @summary.setter
    def summary(self, value: dict[str, Any] | None) -> None:
        self._session.summary = value

    # ------------------------------------------------------------------ lifecycle

    def __enter__(self) -> "Watch":
        if not self.options.enabled:
            return self
        try:
            with HeldSigchld():
                self._enter()
        except BaseException as err:  # torch's exception for a worker that died meanwhile
            unhide(err)
            raise
        return self

    def _enter(self) -> None:
        outer = self._loader.__dict__.get("_dlwatch_watch") if hasattr(self._loader, "__dict__") else None
        if isinstance(outer, Watch) and outer._session.active:
            # the same loader watched twice (a library's watch inside the user's): the outer one
            # keeps watching; this one does nothing, so nothing is instrumented twice
            warn_program(
                "this loader is already watched by an enclosing dlwatch.watch block; "
                "the inner watch does nothing and the outer one keeps watching"
            )
            return
        try:
            self._start()
        except Exception as exc:  # dlwatch failing must not stop training
            warn_program(f"could not start monitoring ({type(exc).__name__}: {exc}); training continues unwatched")
            loader, outer = self._loader, self._outer
            try:
                self._teardown(clean=False)
            except Exception:
                pass
            self._loader, self._outer = loader, outer  # the `as` form still iterates it, unwatched, until the end
            return
        if self._in_place_warning:
            try:
                binds = _with_binds_target(sys._getframe(1))
            except Exception:
                binds = None
            if binds is False:
                self._in_place_warning = False
                warn_program(
                    f"a {type(self._loader).__name__} cannot be watched in place: iterate the watched "
                    "object instead (`with dlwatch.watch(x) as batches: for b in batches: ...`)"
                )
        self._session.announce_nested()
        OPEN_BLOCKS.append(self._session)

    def _start(self) -> None:
        session, loader = self._session, self._loader
        session.start(loader)
        self._probes.hb = session.hb
        if is_dataloader(loader):
            self._instrument_loader(loader)
        elif _can_swap(loader):
            self._swap_class(loader)
        self._in_place_warning = not self._swapped
        session.active = True

    def _instrument_loader(self, loader: Any) -> None:
        probes = self._probes
        probes.prepare()
        probes.set_hooks()
        existing = getattr(loader, "_iterator", None)
        if existing is not None:  # persistent workers already running: the hook won't run in them
            probes.note_workers(existing)
        self._swap_class(loader)

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
        probes = self._probes
        probes.unset_hooks()
        probes.hook = None
        probes.collate_hook = None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> bool:
        if not self._session.active:
            self._loader = self._outer = None
            return False
        # torch's SIGCHLD handler raises "DataLoader worker ... killed by signal" in whatever Python code
        # runs when a worker dies, here too: it would cut the exception report and the monitor's stop
        # short and replace the user's exception. Its handler is set aside while leaving, then restored:
        # a worker that died meanwhile raises torch's exception from the with statement.
        try:
            with HeldSigchld():
                return self._exit(exc)
        except BaseException as err:
            unhide(err)
            raise

    def _exit(self, exc: BaseException | None) -> bool:
        session = self._session
        if session in OPEN_BLOCKS:
            OPEN_BLOCKS.remove(session)
        if self._in_place_warning and not self._iterated:
            warn_program(
                f"nothing was watched: a {type(self._loader).__name__} cannot be watched in place; iterate "
                "the watched object instead (`with dlwatch.watch(x) as batches: for b in batches: ...`)"
            )
        try:
            clean_exit = isinstance(exc, GeneratorExit) or (isinstance(exc, SystemExit) and exc.code in (0, None))
            session.interrupted = isinstance(exc, KeyboardInterrupt)  # the user stopped the job: no failure
            if session.interrupted:
                self._ctrlc.note_in_body(exc)  # type: ignore[arg-type]
            if exc is not None and not clean_exit and not session.interrupted and id(exc) not in REPORTED:
                self._probes.record_exception(exc)
                if OPEN_BLOCKS:
                    REPORTED[id(exc)] = exc  # an enclosing watch sees the same exception: one incident
        except Exception:
            pass
        if not OPEN_BLOCKS:
            REPORTED.clear()
        try:
            self._teardown(clean=True)
        except Exception as err:
            warn_program(f"error while stopping the monitor: {type(err).__name__}: {err}")
        return False  # never swallow

    def _teardown(self, *, clean: bool) -> None:
        self._restore_loader()
        probes = self._probes
        probes.loader = self._outer = None  # after the block dlwatch holds no reference to the loader
        probes.loader_error = None
        probes.shape_probe = None
        probes.hb = None  # an iterator ending after the block marks nothing in the closed heartbeat
        self._session.stop(clean=clean)

    # ------------------------------------------------------------------ iteration

    def __iter__(self) -> Iterator[Any]:
        loader = self._outer
        if loader is None:
            raise RuntimeError("dlwatch.watch: iterate the watched object inside its `with` block")
        self._iterated = True
        try:
            if not self._session.active or self._swapped:
                return iter(loader)  # the loader's own (instrumented) __iter__
            return self._probes.instrument(iter(loader))
        except BaseException as exc:  # raised by the loader's __iter__: as bare, without this frame
            unhide(exc)
            raise

    def __len__(self) -> int:
        # the `as` form stands in for the loader: a progress bar (tqdm) asks len() of what it wraps
        loader = self._outer
        if loader is None:
            raise TypeError("dlwatch.watch: the watched object has a length only inside its `with` block")
        n = len(loader)
        lengths.note(self._loader, n)  # what the program asked for (the loader dlwatch instruments)
        return n

    def __bool__(self) -> bool:
        # with __len__ defined, truth would be len(): keep the loader's own (a generator is true, has no len)
        return bool(self._outer) if self._outer is not None else True


def _can_swap(obj: Any) -> bool:
    return hasattr(obj, "__dict__") and type(obj).__flags__ & (1 << 9) != 0  # Py_TPFLAGS_HEAPTYPE


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
    keyword wins, except DLWATCH_DISABLE=1, which always turns watch into a no-op; a bad
    keyword raises ValueError or TypeError here, a bad variable is one warning and its
    default, as the environment may be set for a whole cluster):

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
