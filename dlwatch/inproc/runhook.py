"""``dlwatch run``'s hook in the program's processes: every DataLoader iteration gets its own watch.

Installed by the bootstrap that ``dlwatch run`` puts on PYTHONPATH (dlwatch/inproc/_boot).
It adds one import hook; when ``torch.utils.data.dataloader`` is imported it wraps
``DataLoader.__iter__`` so that each iteration (each epoch of each loader, train and
validation alike) runs under ``dlwatch.watch`` with the options that ``dlwatch run``
put in the environment.  The watch starts when the iteration starts and stops when
the iterator is exhausted, raises, or is dropped (``break``).  An exception raised by
the loader is recorded as the watch's exception incident and re-raised unchanged.

What it leaves alone: a loader already under the user's own ``dlwatch.watch`` (that
watch keeps watching), iterations inside DataLoader workers, and everything when
DLWATCH_DISABLE=1.  Whatever fails in here becomes one warning; the iteration goes on
unwatched.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
from typing import Any, Iterator

from dlwatch.inproc.frames import _hidden_files, strip_own_frames
from dlwatch.inproc.proxy import IteratorProxy

PROGRAM_RUN_ENV = "DLWATCH_PROGRAM_RUN"  # one id for every process and iteration of one `dlwatch run`
TARGET_MODULE = "torch.utils.data.dataloader"
_installed = False


def disabled() -> bool:
    return os.environ.get("DLWATCH_DISABLE", "").strip().lower() in ("1", "true", "yes", "on")


class _Finder:
    """A meta-path finder that only notices torch's dataloader module being imported."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != TARGET_MODULE:
            return None
        try:
            sys.meta_path.remove(self)  # once is enough
        except ValueError:
            pass
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader = spec.loader
        original = loader.exec_module

        def exec_module(module: Any) -> None:
            original(module)
            try:
                patch(module.DataLoader)
            except Exception as exc:
                _warn(f"could not hook DataLoader ({type(exc).__name__}: {exc}); the program runs unwatched")

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Hook DataLoader now if torch's is imported, else when it is."""
    global _installed
    if _installed or disabled():
        return
    _installed = True
    sys.excepthook = _ExceptHook(sys.excepthook)
    mod = sys.modules.get(TARGET_MODULE)
    if mod is not None and hasattr(mod, "DataLoader"):
        patch(mod.DataLoader)
    else:
        sys.meta_path.insert(0, _Finder())


class _ExceptHook:
    """sys.excepthook that strips dlwatch's frames (and those of chained exceptions), then chains."""

    def __init__(self, previous: Any) -> None:
        self.previous = previous

    def __call__(self, tp: Any, value: Any, tb: Any) -> Any:
        try:
            hidden = _hidden_files()
            tb = strip_own_frames(tb, hidden)
            seen: set[int] = set()
            stack = [value]
            while stack:
                exc = stack.pop()
                if exc is None or id(exc) in seen or not isinstance(exc, BaseException):
                    continue
                seen.add(id(exc))
                if exc.__traceback__ is not None:
                    exc.__traceback__ = strip_own_frames(exc.__traceback__, hidden)
                stack.extend((exc.__cause__, exc.__context__))
        except Exception:
            pass
        return self.previous(tp, value, tb)


def _warn(message: str) -> None:
    from dlwatch.inproc.agent import DlwatchWarning
    from dlwatch.redact import warn

    warn(f"dlwatch: {message}", DlwatchWarning, stacklevel=3)


def patch(cls: type) -> None:
    original = cls.__dict__["__iter__"]
    if getattr(original, "_dlwatch_run", False):
        return

    def __iter__(self: Any) -> Iterator[Any]:
        if "_dlwatch_watch" in getattr(self, "__dict__", {}) or disabled() or _in_worker():
            return original(self)  # the user's own watch, or nothing to do
        try:
            return _watched_iteration(self, original)
        except BaseException as exc:
            # raised by the loader's own __iter__ (a worker that could not start): its traceback as bare,
            # without this hook's frames (this frame's entry goes too; a bare raise adds none for it)
            try:
                exc.__traceback__ = strip_own_frames(exc.__traceback__)
            except Exception:
                pass
            raise

    __iter__._dlwatch_run = True  # type: ignore[attr-defined]
    __iter__.__wrapped__ = original  # type: ignore[attr-defined]
    __iter__.__doc__ = original.__doc__
    cls.__iter__ = __iter__  # type: ignore[method-assign]


def _in_worker() -> bool:
    data = sys.modules.get("torch.utils.data")
    try:
        return data is not None and data.get_worker_info() is not None
    except Exception:
        return False


def _watched_iteration(loader: Any, original: Any) -> Iterator[Any]:
    try:
        from dlwatch.inproc import agent
    except Exception as exc:
        _warn(f"could not watch this iteration ({type(exc).__name__}: {exc}); it runs unwatched")
        return original(loader)
    # torch's SIGCHLD handler waits while the watch starts (see agent._HeldSigchld): a worker of another
    # live iterator dying now raises torch's own exception after, never "could not watch" here
    held = agent._hold_sigchld()
    w = None
    try:
        w = agent.Watch(loader)  # options from the environment that `dlwatch run` set
        w.stop_in_background = True  # the next iteration need not wait for this one's monitor to exit
        w.iteration_only = True  # the loader's class is left alone: its own __iter__ is not re-entered
        w.__enter__()
    except Exception as exc:
        _warn(f"could not watch this iteration ({type(exc).__name__}: {exc}); it runs unwatched")
        w = None
    finally:
        try:
            agent._release_sigchld(held)
        except BaseException as exc:
            if w is not None:
                w.__exit__(type(exc), exc, exc.__traceback__)
            raise
    if w is None or not w._active:
        return original(loader)
    try:
        it = w.iterate_with(original)  # the loader's own __iter__, once, instrumented
    except BaseException as exc:
        w.__exit__(type(exc), exc, exc.__traceback__)
        raise
    _open_watch(w)
    return RunIterator(it, w)


# The watches of iterations still open.  An iterator the program keeps to its end (an infinite loader's,
# a persistent one held by a global) would otherwise be closed during interpreter finalization, when
# threads cannot start and file objects are being torn down: these are closed at exit instead, first.
_OPEN: dict[int, Any] = {}
_atexit_registered = False


def _open_watch(w: Any) -> None:
    global _atexit_registered
    _OPEN[id(w)] = w
    if not _atexit_registered:
        import atexit

        atexit.register(_close_open_watches)
        _atexit_registered = True


def _close_watch(w: Any, exc: BaseException | None) -> None:
    _OPEN.pop(id(w), None)
    w.__exit__(type(exc) if exc is not None else None, exc, exc.__traceback__ if exc is not None else None)


def _close_open_watches() -> None:
    # A Ctrl-C that ended the program (uncaught, so sys.last_value) ended these iterations too: their
    # summaries say "interrupted".  Any other uncaught exception came from the program's own code.
    last = getattr(sys, "last_value", None)
    stopped_by = last if isinstance(last, KeyboardInterrupt) else None
    for w in list(_OPEN.values()):
        try:
            w.stop_in_background = False  # nothing would wait for a thread started now
            _close_watch(w, stopped_by)
        except Exception:
            pass


class RunIterator(IteratorProxy):
    """One watched iteration: the loader's iterator, with the watch closed when it ends.

    Attribute access falls through to the loader's iterator, as for the watch's own wrapper.
    """

    __slots__ = ("_watch",)

    def __init__(self, it: Iterator[Any], w: Any) -> None:
        self._it = it
        self._watch = w

    def __next__(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._close(None)
            raise
        except BaseException as exc:
            # this wrapper's frame (and the watch's) only exist because the iteration is watched: the
            # program's own `except` formats the traceback plain python gives (a bare raise adds none)
            try:
                exc.__traceback__ = strip_own_frames(exc.__traceback__)
            except Exception:
                pass
            self._close(exc)
            raise

    def _close(self, exc: BaseException | None) -> None:
        w, self._watch = self._watch, None
        if w is None:
            return
        try:
            _close_watch(w, exc)
        except Exception:
            pass

    def __del__(self) -> None:  # `break`, or an exception in the loop body, drops the iterator
        try:
            self._close(None)
        except Exception:
            pass
