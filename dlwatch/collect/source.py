"""Read a program's own source file, named by a stack, without trusting the name.

A stack frame's filename is whatever the target's code object says.  The monitor (and
``dlwatch attach``, which may run as root) reads it only as a regular file owned by the
target's user (or root: a system library), opened without following a link and without
blocking on a FIFO, at most ``MAX_SOURCE_BYTES``; nothing else is done with it than parsing
(:mod:`dlwatch.detect.lockowner` looks for the ``with`` block a line sits in).
"""

from __future__ import annotations

import os
import stat

__all__ = ["MAX_SOURCE_BYTES", "read_source"]

MAX_SOURCE_BYTES = 1 << 20


def read_source(path: str, uid: int | None = None) -> str | None:
    """The text of ``path``, or None when it is no regular file of ``uid`` or root, too big, or unreadable."""
    if not path or not os.path.isabs(path) or "\0" in path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_SOURCE_BYTES:
            return None
        if uid is not None and st.st_uid not in (uid, 0):
            return None
        data = os.read(fd, MAX_SOURCE_BYTES + 1)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(data) > MAX_SOURCE_BYTES:
        return None
    return data.decode("utf-8", "replace")
