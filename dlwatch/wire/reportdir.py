"""The report directory and the run ids, as the training process, the monitor and the CLI all use them.

``prepare_report_dir`` is the one door into a report directory: an existing one must be
ours and private, a missing one is made 0700, and a sticky shared one (``/tmp``) gets a
private ``mkdtemp`` child per process.  ``fallback_dir`` is a private ``mkdtemp`` directory
when the asked-for one cannot be used.  The incident and summary files inside are the
report side's (:mod:`dlwatch.report.store`); the run directory of a block in progress is
``<report dir>/.runs/<run id>/``.
"""

from __future__ import annotations

import calendar
import datetime as _dt
import json
import os
import re
import secrets
import stat
import tempfile
import time
from typing import Any

from dlwatch._fs import check_links, make_private_dir, sticky_parent, verify_created

RUNS_DIR = ".runs"  # <report_dir>/.runs/<run-id>/: a run in progress, never listed as an incident


_private_children: dict[tuple[int, str], str] = {}  # (pid, sticky dir) -> our private child in it
_fallback: tuple[int, str] | None = None  # (pid, directory): one per process


def prepare_report_dir(report_dir: str) -> str:
    """The directory incidents for ``report_dir`` really go to; raises OSError (UnsafeDirError) if none.

    An existing directory must be ours and not writable by group or others; a
    missing one is created 0700, level by level.  A sticky world-writable
    directory (``/tmp``) is never written into directly: dlwatch makes a private
    ``mkdtemp`` child there once per process and uses that.
    """
    if os.path.isdir(report_dir) and sticky_parent(report_dir):
        check_links(report_dir)
        key = (os.getpid(), os.path.abspath(report_dir))
        child = _private_children.get(key)
        if child is None or not os.path.isdir(child):
            child = tempfile.mkdtemp(prefix=f"dlwatch-reports-{os.geteuid()}-", dir=os.path.realpath(report_dir))
            verify_created(child)
            _private_children[key] = child
        return child
    try:
        make_private_dir(report_dir)
    except FileExistsError:
        # another rank (or process) of ours made it between our look and our mkdir: it must pass
        # the same check as any existing report directory (ours, private, no link)
        make_private_dir(report_dir)
    return report_dir


def fallback_dir() -> str:
    """A private directory of this process, made by ``tempfile.mkdtemp`` the first time it is asked for.

    Never a predictable name: another user could have prepared that one.
    """
    global _fallback
    if _fallback is None or _fallback[0] != os.getpid() or not os.path.isdir(_fallback[1]):
        path = tempfile.mkdtemp(prefix=f"dlwatch-reports-{os.geteuid()}-")
        verify_created(path)
        _fallback = (os.getpid(), path)
    return _fallback[1]


RUN_ID = re.compile(r"(?P<when>[0-9]{8}T[0-9]{6})(?P<utc>Z?)-(?P<pid>[0-9]{1,10})-(?P<tag>[0-9a-f]{6})")


def new_run_id(pid: int | None = None, now: float | None = None) -> str:
    """``<UTC yyyymmddTHHMMSS>Z-<pid>-<6 hex>``: the id of a watched block (and of a ``dlwatch run``).

    UTC, so that ids order by time across a DST change and across ranks in other time zones.
    """
    when = _dt.datetime.fromtimestamp(time.time() if now is None else now, _dt.timezone.utc)
    return f"{when:%Y%m%dT%H%M%SZ}-{os.getpid() if pid is None else pid}-{secrets.token_hex(3)}"


def run_id_time(run_id: str) -> float | None:
    """When the block of ``run_id`` started, in seconds since the epoch; None if it is no run id.

    An old id without ``Z`` said local time: it is read in this process's time zone, the best
    guess there is (right unless the zone changed since, or within a repeated DST hour).
    """
    m = RUN_ID.fullmatch(run_id)
    if m is None:
        return None
    try:
        parsed = _dt.datetime.strptime(m.group("when"), "%Y%m%dT%H%M%S")
    except ValueError:  # 20261399T... matches the pattern but is no date
        return None
    if m.group("utc"):
        return calendar.timegm(parsed.timetuple())
    try:
        return time.mktime(parsed.timetuple()[:8] + (-1,))  # -1: let the zone say whether DST applied
    except (OverflowError, ValueError):
        return None


SUMMARY_COPY_CAP = 16 << 20  # summary.json: figures per worker and a few findings, far below this


def read_summary(path: str) -> dict[str, Any]:
    """The run summary the monitor just wrote at ``path`` (a run directory, or its summary.json), for
    ``Watch.summary``: a regular file only (never through a link, never a FIFO), at most
    SUMMARY_COPY_CAP bytes, a JSON object; OSError or ValueError otherwise.

    The training process reads only this: the report side's full checks (``store.load_summary``)
    are for files that anyone could have put in a report directory, and they stay there.
    """
    if os.path.isdir(path):
        path = os.path.join(path, "summary.json")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise ValueError(f"{path} is not a regular file")
        chunks, size = [], 0
        while size <= SUMMARY_COPY_CAP:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > SUMMARY_COPY_CAP:
            raise ValueError(f"{path} is larger than {SUMMARY_COPY_CAP} bytes")
    finally:
        os.close(fd)
    data = json.loads(b"".join(chunks))
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data
