"""What runs inside every DataLoader worker: registration, then the user's worker_init_fn, then RNG fingerprints.

The hook is a small picklable object (spawn and forkserver pickle worker_init_fn),
importing nothing heavy.  The user's function runs exactly as before: same
argument, same order relative to torch's own seeding, and its exceptions
propagate untouched.  dlwatch's own steps never raise.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Callable

from dlwatch import events

PR_SET_PTRACER = 0x59616D61  # Yama: allow this pid (and its descendants) to ptrace us


def allow_ptrace_from(tracer_pid: int | None) -> None:
    """Under Yama ptrace_scope=1 only ancestors may attach: name the monitor explicitly."""
    if not tracer_pid or not os.path.exists("/proc/sys/kernel/yama/ptrace_scope"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PTRACER, ctypes.c_ulong(tracer_pid), 0, 0, 0)
    except Exception:
        pass


class WorkerHook:
    def __init__(self, user_fn: Callable[[int], Any] | None, events_path: str, run_dir: str,
                 start_method: str | None, monitor_pid: int | None, rng_depth: int = 2) -> None:
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

    def __call__(self, worker_id: int) -> None:
        self._register(worker_id)
        if self.user_fn is not None:
            self.user_fn(worker_id)
        if self.fingerprint:
            self._fingerprint(worker_id)

    def _register(self, worker_id: int) -> None:
        try:
            allow_ptrace_from(self.monitor_pid)
            dump_path = None
            try:
                from dlwatch.collect import faultdump

                dump_path = faultdump.install(os.path.join(self.run_dir, "dumps"))
            except Exception:
                pass
            self._crash_dump()
            events.emit(self.events_path, "worker_registered", worker_id=worker_id,
                        start_method=self.start_method, ppid=os.getppid(), dump_path=dump_path)
        except Exception:
            pass

    def _crash_dump(self) -> None:
        """faulthandler on the fatal signals, into ``dumps/<pid>.crash.txt`` that the monitor reads
        when this worker is gone: a native crash in ``__getitem__`` then leaves its Python line.
        A program that enabled faulthandler itself keeps its own setting."""
        try:
            from dlwatch.collect import faultdump

            faultdump.install_crash(os.path.join(self.run_dir, "dumps"))
        except Exception:
            pass

    def _fingerprint(self, worker_id: int) -> None:
        try:
            from dlwatch import rngcheck
            from torch.utils.data import get_worker_info

            info = get_worker_info()
            dataset = info.dataset if info is not None else None
            events.emit(self.events_path, "rng_fingerprint", worker_id=worker_id,
                        fingerprints=rngcheck.fingerprint(dataset, depth=self.rng_depth))
        except Exception:
            pass
