"""``dlwatch run``'s hook in the program's processes: one watch per process, every DataLoader iteration in it.

Installed by the bootstrap that ``dlwatch run`` puts on PYTHONPATH (dlwatch/inproc/_boot).
It adds one import hook; when ``torch.utils.data.dataloader`` is imported it wraps
``DataLoader.__iter__``.  The first iteration in a process starts that process's one
watch (one monitor for the program's life: a program that never iterates a loader pays
nothing); each iteration (each epoch of each loader, train and validation alike,
overlapping or kept alive until the next ``iter()`` as Lightning does) is a segment of it
(``Program.iterate_segment`` in ``agent/program.py``) that ends when its iterator is exhausted,
raises, or is dropped.  The watch closes at interpreter exit (atexit), where the monitor writes the one
run summary of the program.  An exception raised by the loader is recorded for its
incident and re-raised unchanged.

What it leaves alone: a loader already under the user's own ``dlwatch.watch`` (that
watch keeps watching), iterations inside DataLoader workers, and everything when
DLWATCH_DISABLE=1.  Whatever fails in here becomes one warning; the program goes on
unwatched.
"""

from __future__ import annotations

import importlib.machinery
import os
import sys
import threading
from typing import Any, Iterator

from dlwatch.inproc import ownimports
from dlwatch.inproc.frames import _hidden_files, strip_own_frames, user_stacklevel
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
    ownimports.install()  # now, before Python puts the program's directory first on sys.path
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

    warn(f"dlwatch: {message}", DlwatchWarning, stacklevel=user_stacklevel())  # at the program's line


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
    _patch_len(cls)


def _patch_len(cls: type) -> None:
    """``len(loader)`` answers as bare; the length the program got is kept (dlwatch.inproc.lengths)."""
    original = cls.__dict__.get("__len__")
    if original is None or getattr(original, "_dlwatch_run", False):
        return
    from dlwatch.inproc import lengths

    def __len__(self: Any) -> int:
        try:
            n = original(self)
        except BaseException as exc:  # an IterableDataset without __len__: its TypeError as bare
            try:
                exc.__traceback__ = strip_own_frames(exc.__traceback__)
            except Exception:
                pass
            raise
        lengths.note(self, n)
        return n  # type: ignore[no-any-return]

    __len__._dlwatch_run = True  # type: ignore[attr-defined]
    __len__.__wrapped__ = original  # type: ignore[attr-defined]
    __len__.__doc__ = original.__doc__
    cls.__len__ = __len__  # type: ignore[method-assign]


def _in_worker() -> bool:
    data = sys.modules.get("torch.utils.data")
    try:
        return data is not None and data.get_worker_info() is not None
    except Exception:
        return False


def _watched_iteration(loader: Any, original: Any) -> Iterator[Any]:
    w = _program_watch(loader)
    if w is None:
        return original(loader)
    # torch's SIGCHLD handler waits while the segment starts (see agent.sigchld): a worker of another
    # live iterator dying now raises torch's own exception after, never "could not watch" here
    try:
        from dlwatch.inproc.agent.sigchld import HeldSigchld
    except Exception:
        return original(loader)
    with HeldSigchld():
        it, seg = w.iterate_segment(loader, original)  # the loader's own __iter__, once, instrumented
    return RunIterator(it, seg)


# The one watch of this process (``dlwatch run``): made at the first loader iteration, closed at exit.
# Keyed by pid: a child forked from a watched process (not a DataLoader worker) makes its own.
_PROGRAM: Any = None
_PROGRAM_PID = 0
_PROGRAM_FAILED = 0  # the pid where starting it failed: one warning, then the program runs unwatched
_PROGRAM_LOCK = threading.Lock()


def _program_watch(loader: Any) -> Any:
    global _PROGRAM, _PROGRAM_PID, _PROGRAM_FAILED
    pid = os.getpid()
    w = _PROGRAM
    if w is not None and _PROGRAM_PID == pid:
        return w if w.active else None
    if _PROGRAM_FAILED == pid:
        return None
    with _PROGRAM_LOCK:
        if _PROGRAM is not None and _PROGRAM_PID == pid:
            return _PROGRAM if _PROGRAM.active else None
        try:
            from dlwatch.inproc.agent.program import Program
            from dlwatch.inproc.agent.sigchld import HeldSigchld
        except Exception as exc:
            _PROGRAM_FAILED = pid
            _warn(f"could not watch this program ({type(exc).__name__}: {exc}); it runs unwatched")
            return None
        w = None
        with HeldSigchld():
            try:
                w = Program()  # options from the environment that `dlwatch run` set
                w.start(loader)  # the monitor; dlwatch keeps no loader alive
            except Exception as exc:
                _warn(f"could not watch this program ({type(exc).__name__}: {exc}); it runs unwatched")
                w = None
        if w is None or not w.active:
            _PROGRAM_FAILED = pid
            return None
        _PROGRAM, _PROGRAM_PID = w, pid
        import atexit

        # registered after multiprocessing's own exit handler (imported with torch), so it runs before
        # it: the monitor stops while the workers of iterators the program still holds are alive
        atexit.register(_close_program)
        try:  # a multiprocessing child (fork) ends with os._exit: no atexit, but its finalizers run
            mp = sys.modules.get("multiprocessing")
            if mp is not None and mp.parent_process() is not None:
                from multiprocessing import util

                util.Finalize(None, _close_program, exitpriority=100)  # before the child's queues close
        except Exception:
            pass
        return w


def _close_program() -> None:
    """At interpreter exit: every live iteration's row, the monitor's summary of the whole program."""
    global _PROGRAM
    w = _PROGRAM
    if w is None or _PROGRAM_PID != os.getpid():
        return
    _PROGRAM = None
    last = getattr(sys, "last_value", None)
    if isinstance(last, KeyboardInterrupt):
        ended = "interrupted"  # a Ctrl-C ended the program
    elif last is not None and not (isinstance(last, SystemExit) and last.code in (0, None)):
        ended = "exception"
    else:
        ended = "clean"
    try:
        if isinstance(last, KeyboardInterrupt):
            w.note_interrupt_in_body(last)  # a Ctrl-C in a long loop body: its stacks first
        w.close_program(ended)
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
        seg, self._watch = self._watch, None
        if seg is None:
            return
        try:
            seg.program.end_segment(seg, exc)
        except Exception:
            pass

    def __del__(self) -> None:  # `break`, or an exception in the loop body, drops the iterator
        try:
            self._close(None)
        except Exception:
            pass
