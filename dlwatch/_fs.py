"""Private, atomic files: every directory dlwatch creates is 0700, every file 0600.

Reports leave the machine on tickets; run directories hold stack dumps.  Both
are private to the user by construction, not by umask luck.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable

DIR_MODE = 0o700
FILE_MODE = 0o600


def make_private_dir(path: str) -> str:
    """Create ``path`` and any missing parents, each 0700; existing directories are left as they are.

    (os.makedirs gives only the leaf its mode: the parents it creates would be 0777 & ~umask.)
    """
    missing = []
    head = os.path.abspath(path)
    while head and not os.path.isdir(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            if not os.path.isdir(d):
                raise
            continue
        os.chmod(d, DIR_MODE)  # whatever the umask
    return path


def open_private(path: str, flags: int = os.O_WRONLY | os.O_CREAT | os.O_TRUNC) -> int:
    fd = os.open(path, flags | os.O_CLOEXEC, FILE_MODE)
    try:
        os.fchmod(fd, FILE_MODE)  # a file that existed keeps its old mode otherwise
    except OSError:
        pass
    return fd


def write_private(path: str, data: bytes | str) -> None:
    if isinstance(data, str):
        data = data.encode("utf-8")
    fd = open_private(path)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    write_private(path, json.dumps(obj, indent=2, sort_keys=False, default=str) + "\n")


def write_jsonl(path: str, records: Iterable[Any]) -> None:
    write_private(path, "".join(json.dumps(r, default=str) + "\n" for r in records))
