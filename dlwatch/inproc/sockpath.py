"""The AF_UNIX socket path a DataLoader worker will bind to send its first batch, and whether it fits.

Under torch's ``file_descriptor`` sharing strategy a worker sends each tensor's fd through
``multiprocessing.resource_sharer``, whose listener binds a Unix socket at
``<tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX`` (``multiprocessing.util.get_temp_dir``, under
``tempfile.gettempdir()``: ``$TMPDIR``).  Linux keeps at most 107 bytes of such a path
(``sun_path`` is 108 with its NUL).  A longer one fails in the worker's queue feeder thread with
``OSError: AF_UNIX path too long``, printed on stderr; the batch is never sent, the worker lives
on, and the training loop waits forever.  The ``forkserver`` start method binds its own listener
the same way, in the training process, and raises there.  A ``$TMPDIR`` of 76 bytes or more does it.
Under the ``file_system`` strategy torch's ``torch_shm_manager`` binds
``$TMPDIR/torch-shm-dir-XXXXXX/manager.sock`` instead (34 bytes more than the directory: 74 bytes or
more fail), and a worker raises ``torch_shm_manager at "...": Invalid argument``: that strategy is
no way around a long ``$TMPDIR``.

Read here, before the workers start, without side effects: ``tempfile.gettempdir()`` is never
called (it creates a file in each candidate and caches its answer for the program: a program that
sets ``TMPDIR`` later would then not get it); its choice is read as it would make it.  A Python whose
``multiprocessing`` picks a short base directory by itself (``util._get_base_temp_dir``) is left
alone.
"""

from __future__ import annotations

import os
import sys
from typing import Any

__all__ = ["PLAYBOOK", "SUN_PATH_MAX", "listener_path", "shm_manager_path", "check"]

# the failure judged (by the monitor, at the stall or exception that follows) from the ``af_unix_path`` event
PLAYBOOK = "af-unix-path-too-long"

SUN_PATH_MAX = 107  # bytes of a socket path on Linux (struct sockaddr_un's sun_path is 108, with its NUL)
_TEMP_NAME = 8  # tempfile's random names: 8 characters
_PYMP = len("pymp-") + _TEMP_NAME
_LISTENER = len("listener-") + _TEMP_NAME
_SHM_MANAGER = len("/torch-shm-dir-XXXXXX/manager.sock")


def _default_tempdir() -> str | None:
    """What ``tempfile.gettempdir()`` answers (or would, for its first call), read without calling it."""
    import tempfile

    if tempfile.tempdir is not None:  # already chosen (or set by the program)
        return os.fsdecode(tempfile.tempdir)
    try:
        candidates = tempfile._candidate_tempdir_list()  # type: ignore[attr-defined]
    except Exception:
        return None
    for d in candidates:
        if d != os.curdir:
            d = os.path.abspath(d)
        # gettempdir takes the first candidate it can create a file in
        if os.path.isdir(d) and os.access(d, os.W_OK | os.X_OK):
            return d
    return None


def listener_path() -> tuple[str, int] | None:
    """(the directory the listener's socket goes in, the socket path's length in bytes), or None
    where multiprocessing chooses a short one itself or the directory cannot be told."""
    util = sys.modules.get("multiprocessing.util")
    if util is not None and hasattr(util, "_get_base_temp_dir"):
        return None  # this Python shortens a base directory too long for a socket
    try:
        from multiprocessing import process

        current = process.current_process()._config.get("tempdir")
    except Exception:
        current = None
    if current:  # this process's pymp directory exists: a forked worker inherits it
        return current, len(os.fsencode(current)) + 1 + _LISTENER
    base = _default_tempdir()
    if base is None:
        return None
    return base, len(os.fsencode(base)) + 1 + _PYMP + 1 + _LISTENER


def shm_manager_path() -> tuple[str, int]:
    """(the directory torch's ``torch_shm_manager`` makes its socket in, the socket path's length):
    ``<dir>/torch-shm-dir-XXXXXX/manager.sock``, the directory from the first of TMPDIR, TMP, TEMP and
    TEMPDIR that is set, else /tmp (c10's ``try_make_tempdir``, read by the manager itself)."""
    base = next((v for v in (os.environ.get(k) for k in ("TMPDIR", "TMP", "TEMP", "TEMPDIR")) if v), "/tmp")
    return base, len(os.fsencode(base)) + _SHM_MANAGER


def check(num_workers: int, sharing_strategy: str | None, start_method: str | None) -> dict[str, Any] | None:
    """The fields of the ``af_unix_path`` event when this loader's workers need a socket whose path is
    too long for Linux, else None: under ``file_descriptor`` (and for ``forkserver``) multiprocessing's
    listener, under ``file_system`` torch's shared-memory manager."""
    if num_workers <= 0 or not sys.platform.startswith("linux"):
        return None
    got: tuple[str, int] | None = None
    socket = None
    if sharing_strategy == "file_descriptor" or start_method == "forkserver":
        got, socket = listener_path(), "multiprocessing"
    if (got is None or got[1] <= SUN_PATH_MAX) and sharing_strategy == "file_system":
        got, socket = shm_manager_path(), "torch_shm_manager"
    if got is None or got[1] <= SUN_PATH_MAX:
        return None
    base, length = got
    return {
        "socket": socket,
        "path_len": length,
        "path_max": SUN_PATH_MAX,
        "base": base,
        "sharing_strategy": sharing_strategy,
        "start_method": start_method,
    }
