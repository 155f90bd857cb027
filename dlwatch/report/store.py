"""Incident directories on disk: ids, atomic writes, listing and loading.

An incident directory appears complete or not at all: it is written in a fresh
private ``.tmp-<id>-XXXXXX`` directory (``mkdtemp``; listings ignore it) and
renamed into place.  The report directory itself is used only when no other user
can change it (``_fs.check_report_dir``); a sticky shared one such as /tmp gets a
private ``mkdtemp`` child, and the fallback is a ``mkdtemp`` directory too.  Run directories
(``.runs/``) hold a run in progress and are never listed as incidents; run summaries
(``runs/<run-id>/summary.json`` and ``summary.md``) are written the same way, read with
the same care as incidents, and listed apart (``dlwatch report --runs``).  After each summary is written, the oldest
beyond ``keep_runs`` are removed (:func:`prune_runs`: only summaries of ours, never through a
link, never an incident).
"""

from __future__ import annotations

import datetime as _dt
import errno
import json
import os
import re
import secrets
import shutil
import socket
import stat
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from dlwatch._version import __version__
from dlwatch._fs import (
    UnsafeDirError,
    check_report_dir,
    make_private_child,
    publish_private_dir,
    write_json,
    write_jsonl,
    write_private,
)
from dlwatch.errors import NotFoundError, ReportError
from dlwatch.redact import outbound
from dlwatch.report.schema import (  # noqa: F401  (the checks were here; their names stay importable)
    _ITEM_TYPES,
    _SUMMARY_TYPES,
    _TOP_TYPES,
    Incident,
    Rank,
    RunSummary,
    _type_problem,
    summary_type_problem,
)
from dlwatch.wire.reportdir import (  # noqa: F401  (part of the store's interface)
    RUN_ID,
    RUNS_DIR,
    fallback_dir,
    new_run_id,
    prepare_report_dir,
    run_id_time,
)

SCHEMA_VERSION = 1
TRIGGERS = ("exception", "stall", "threshold", "exit", "attach", "interrupt")
SUMMARIES_DIR = "runs"  # <report_dir>/runs/<run-id>/summary.json: run summaries, never listed as incidents
TMP_PREFIX = ".tmp-"
REQUIRED_KEYS = ("schema_version", "id", "created_at", "trigger", "pid")
SUMMARY_SCHEMA_VERSION = 1  # run summaries (dlwatch.report.summary builds them)
SUMMARY_KIND = "run_summary"
SUMMARY_REQUIRED_KEYS = ("schema_version", "kind", "id", "created_at", "pid")


def new_incident_id(trigger: str, pid: int, now: float | None = None, rank: int | None = None) -> str:
    """``<UTC time>-<trigger>[-r<rank>]-<pid>-<8 hex>``.  Ranks on many hosts may share one report
    directory: the random part makes a clash unlikely, and :func:`write_incident` makes it impossible
    (the final rename fails on an existing incident; it then takes a new id)."""
    when = _dt.datetime.fromtimestamp(now, _dt.timezone.utc) if now else _dt.datetime.now(_dt.timezone.utc)
    who = f"r{rank}-{pid}" if isinstance(rank, int) and not isinstance(rank, bool) else str(pid)
    return f"{when:%Y%m%dT%H%M%SZ}-{trigger}-{who}-{secrets.token_hex(4)}"


def rank_info(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """The report's ``rank`` object (see :mod:`dlwatch.wire.job`)."""
    from dlwatch.wire.job import rank_info as _rank_info

    return _rank_info(environ)


def new_incident(*, trigger: str, pid: int, now: float) -> Incident:
    """A new incident: every top-level key of schema 1, in documented order, with empty values
    (:func:`dlwatch.report.build.incident` fills it)."""
    if trigger not in TRIGGERS:
        raise ValueError(f"unknown trigger {trigger!r}")
    rank = rank_info()
    return Incident(
        schema_version=SCHEMA_VERSION,
        id=new_incident_id(trigger, pid, now, rank.get("rank")),
        created_at=_dt.datetime.fromtimestamp(now, _dt.timezone.utc).isoformat(timespec="seconds"),
        dlwatch_version=__version__,
        host=socket.gethostname(),
        pid=pid,
        rank=Rank.from_dict(rank),
        trigger=trigger,
        summary="",
        classification=None,
        loader=None,
        progress={},
        exception=None,
        findings=(),
        processes=(),
        system=None,
        gpus=[],
        events=[],
        timeline=[],
        notes=(),
        config={},
    )


def skeleton(*, trigger: str, pid: int, now: float) -> dict[str, Any]:
    """:func:`new_incident` as the JSON object (every top-level key, in documented order)."""
    return new_incident(trigger=trigger, pid=pid, now=now).to_dict()


def write_incident(
    report_dir: str,
    report: dict[str, Any],
    *,
    render_markdown: Callable[[Mapping[str, Any]], str],
    extra_files: Mapping[str, bytes] | None = None,
) -> str:
    """Write ``<report_dir>/<id>/`` atomically; return its path.  Raises OSError, leaving nothing."""
    report = outbound(report)
    report_dir = prepare_report_dir(report_dir)
    for attempt in range(ID_ATTEMPTS):
        try:
            return _write_incident_once(report_dir, report, render_markdown, extra_files)
        except OSError as exc:
            # another rank or host took this id first (a shared report directory): rename onto
            # a non-empty directory fails, so nothing was overwritten; take a fresh id
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY) or attempt == ID_ATTEMPTS - 1:
                raise
            head = report["id"].rsplit("-", 1)[0]
            report = dict(report, id=f"{head}-{secrets.token_hex(4)}")
    raise AssertionError("unreachable")


ID_ATTEMPTS = 8


def _write_incident_once(
    report_dir: str,
    report: dict[str, Any],
    render_markdown: Callable[[Mapping[str, Any]], str],
    extra_files: Mapping[str, bytes] | None,
) -> str:
    def fill(tmp: str) -> None:
        write_json(os.path.join(tmp, "report.json"), report)
        write_private(os.path.join(tmp, "report.md"), render_markdown(report))
        write_jsonl(os.path.join(tmp, "timeline.jsonl"), report.get("timeline") or [])
        for rel, data in (extra_files or {}).items():
            parts = os.path.normpath(rel).split(os.sep)
            if os.path.isabs(rel) or ".." in parts or not parts[-1]:
                raise UnsafeDirError(f"refusing to write {rel!r} outside the incident")
            head = tmp
            for part in parts[:-1]:
                head = (
                    os.path.join(head, part)
                    if os.path.isdir(os.path.join(head, part))
                    else make_private_child(head, part)
                )
            write_private(os.path.join(head, parts[-1]), data)

    return publish_private_dir(report_dir, report["id"], fill, tmp_prefix=TMP_PREFIX)


MAX_REPORT_BYTES = 64 << 20  # report.json: a timeline window and stacks, far below this
MAX_DEPTH = 64  # nesting of report.json; schema 1 uses about 10


def read_regular(path: str, cap: int, *, dir_fd: int | None = None) -> bytes:
    """The bytes of ``path`` if it is a regular file of at most ``cap`` bytes, else ReportError.

    Never follows a symbolic link at the last component, never blocks on a FIFO or a
    device (O_NONBLOCK, then fstat before the first read), never reads more than ``cap``.
    With ``dir_fd`` the file is ``path``'s last component in that open directory (``path``
    names it in messages).
    """
    return _read_open(_open_report_file(path, dir_fd), path, cap, head=False)[0]


def read_head(path: str, cap: int, *, dir_fd: int | None = None) -> tuple[bytes, bool]:
    """(the first ``cap`` bytes at most of ``path``, whether that is the whole file): the checks of
    :func:`read_regular` but for the size, and never more than ``cap`` read."""
    return _read_open(_open_report_file(path, dir_fd), path, cap, head=True)


def _open_report_file(path: str, dir_fd: int | None) -> int:
    name = os.path.basename(path) if dir_fd is not None else path
    try:
        return os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise NotFoundError(f"no report at {path}", help="run `dlwatch report` to list the incidents") from None
    except PermissionError:
        raise ReportError(f"cannot read {path}: permission denied") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ReportError(f"{path} is a symbolic link; dlwatch writes none and does not follow it") from None
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None


def _read_open(fd: int, path: str, cap: int, *, head: bool) -> tuple[bytes, bool]:
    """Read the open ``fd`` (closed here): a regular file, up to ``cap`` bytes (past it: ReportError,
    or with ``head`` the first ``cap`` bytes and False for "not the whole file")."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ReportError(f"{path} is not a regular file (a FIFO, device or directory); dlwatch writes none")
        if st.st_size > cap and not head:
            raise ReportError(f"{path} is {st.st_size} bytes, more than the {cap} a report can be")
        chunks, total = [], 0
        while total <= cap:
            chunk = os.read(fd, min(1 << 20, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > cap:
            if head:
                return b"".join(chunks)[:cap], False
            raise ReportError(f"{path} grew past the {cap} bytes a report can be")
        return b"".join(chunks), True
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def _too_deep(obj: Any, limit: int = MAX_DEPTH) -> bool:
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children)
    return False


def _load_json_document(
    path: str, raw: bytes, noun: str, what: str, has_keys: Callable[[dict[str, Any]], bool], schema_version: int
) -> dict[str, Any]:
    """``raw`` (read from ``path`` with :func:`read_regular`) parsed and checked as a JSON object with
    the keys ``has_keys`` wants, a schema_version this dlwatch understands, nested at most MAX_DEPTH
    deep; ReportError naming ``path`` otherwise.  The checks load_report and load_summary share."""
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(
            f"{path} is damaged or truncated ({type(exc).__name__})",
            help="it was not written by a complete dlwatch run; remove it",
        ) from None
    except RecursionError:
        raise ReportError(
            f"{path} is damaged (nested deeper than any {noun})", help="it was not written by dlwatch; remove it"
        ) from None
    if not isinstance(data, dict) or not has_keys(data):
        raise ReportError(f"{path} is not {what} (missing keys)")
    version = data.get("schema_version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise ReportError(f"{path} has no valid schema_version")
    if version > schema_version:
        raise ReportError(
            f"{path} has schema_version {version}, newer than this dlwatch understands ({schema_version})",
            help="upgrade dlwatch (pip install -U dlwatch)",
        )
    if _too_deep(data):
        raise ReportError(
            f"{path} is damaged (nested deeper than {MAX_DEPTH} levels)",
            help="it was not written by dlwatch; remove it",
        )
    return data


def load_report(path: str, *, dir_fd: int | None = None) -> dict[str, Any]:
    """Load and check one report.json (or the directory holding it); ReportError if damaged.

    The file may have been written by anyone who can write the report directory: it is
    read only if it is a regular file (no FIFO, no link) within MAX_REPORT_BYTES, nested
    at most MAX_DEPTH deep, and with the types the renderers rely on.  ``dir_fd``: the
    incident directory ``path`` names, already open; report.json is read in it.
    """
    if dir_fd is not None or os.path.isdir(path):
        path = os.path.join(path, "report.json")
    data = _load_json_document(
        path,
        read_regular(path, MAX_REPORT_BYTES, dir_fd=dir_fd),
        "report",
        "a dlwatch report",
        lambda d: all(k in d for k in REQUIRED_KEYS),
        SCHEMA_VERSION,
    )
    problem = _type_problem(data)
    if problem:
        raise ReportError(f"{path} is damaged: {problem}", help="it was not written by dlwatch; remove it")
    return data


LIST_READ_BYTES = 1 << 20  # of each report.json, to list it: its first keys (id ... findings) fit far below


def _head_members(raw: bytes) -> dict[str, Any]:
    """The complete top-level members at the start of a JSON object cut short (``raw`` is its first
    bytes): parsed one by one, up to the first one the cut reaches.  Nothing after it is looked at."""
    text = raw.decode("utf-8", "replace")
    decoder = json.JSONDecoder()
    out: dict[str, Any] = {}
    ws = " \t\r\n"
    i = len(text) - len(text.lstrip(ws))
    if not text.startswith("{", i):
        raise ValueError("not a JSON object")
    i += 1
    while True:
        while i < len(text) and text[i] in ws:
            i += 1
        if i >= len(text) or text[i] == "}":
            return out
        key, i = decoder.raw_decode(text, i)
        while i < len(text) and text[i] in ws:
            i += 1
        if not isinstance(key, str) or not text.startswith(":", i):
            return out
        i += 1
        while i < len(text) and text[i] in ws:
            i += 1
        try:
            value, end = decoder.raw_decode(text, i)
        except ValueError:
            return out  # the cut is inside this member: it and the rest are not known
        if end >= len(text):
            return out  # a number or a name may go on past the cut
        out.setdefault(key, value)
        i = end
        while i < len(text) and text[i] in ws:
            i += 1
        if not text.startswith(",", i):
            return out
        i += 1


def load_report_head(path: str, cap: int = LIST_READ_BYTES, *, dir_fd: int | None = None) -> dict[str, Any]:
    """:func:`load_report`, reading at most ``cap`` bytes: a report.json longer than that gives the
    members that fit before the cut (report.json's keys are in schema order: ``id``, ``created_at``,
    ``trigger``, ``summary`` ... ``findings`` come first), with ``"_head_only": True``.  Listing a
    64 MiB report.json costs what listing its first ``cap`` bytes does.  ReportError if damaged."""
    if dir_fd is not None or os.path.isdir(path):
        path = os.path.join(path, "report.json")
    raw, whole = read_head(path, cap, dir_fd=dir_fd)
    if whole:
        data = _load_json_document(
            path, raw, "report", "a dlwatch report", lambda d: all(k in d for k in REQUIRED_KEYS), SCHEMA_VERSION
        )
    else:
        try:
            head = _head_members(raw)
        except (ValueError, RecursionError):
            raise ReportError(
                f"{path} is damaged (its start is no JSON object)", help="it was not written by dlwatch; remove it"
            ) from None
        data = _load_json_document(
            path,
            json.dumps(head).encode(),
            "report",
            "a dlwatch report",
            lambda d: all(k in d for k in REQUIRED_KEYS),
            SCHEMA_VERSION,
        )
        data["_head_only"] = True
    problem = _type_problem(data)
    if problem:
        raise ReportError(f"{path} is damaged: {problem}", help="it was not written by dlwatch; remove it")
    return data


def load_incident(path: str, *, dir_fd: int | None = None) -> Incident:
    """:func:`load_report`, as the typed :class:`~dlwatch.report.schema.Incident`."""
    return Incident.from_dict(load_report(path, dir_fd=dir_fd))


@dataclass(frozen=True)
class IncidentSummary:
    id: str
    path: str
    created_at: str
    trigger: str
    top_finding: str | None
    summary: str
    damaged: str | None = None  # why the entry cannot be shown; the other fields are then placeholders

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def list_incidents(report_dir: str) -> tuple[list[IncidentSummary], list[str]]:
    """Incidents newest first, damaged ones last (listed as such), and one warning per damaged entry."""
    if not os.path.isdir(report_dir):
        raise NotFoundError(
            f"no report directory {report_dir}",
            help="pass the directory that watch(report_dir=...) or DLWATCH_DIR named",
        )
    found: list[IncidentSummary] = []
    damaged: list[IncidentSummary] = []
    warnings: list[str] = []
    for name in sorted(os.listdir(report_dir)):
        if name.startswith(".") or name == SUMMARIES_DIR:
            continue  # runs in progress, incidents being written, and the run summaries (--runs)
        path = os.path.join(report_dir, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                if stat.S_ISLNK(st.st_mode) and os.path.isdir(path):
                    raise ReportError("a symbolic link to a directory; dlwatch writes none and does not follow it")
                continue
            os.lstat(os.path.join(path, "report.json"))
        except FileNotFoundError:
            continue
        except ReportError as exc:
            warnings.append(f"skipped {name}: {exc.message}")
            damaged.append(
                IncidentSummary(
                    id=name, path=path, created_at="-", trigger="-", top_finding=None, summary="", damaged=exc.message
                )
            )
            continue
        except OSError:
            continue
        try:
            data = load_report_head(path)  # what the listing shows is at its start: a bounded read
        except (ReportError, NotFoundError) as exc:
            warnings.append(f"skipped {name}: {exc.message}")
            damaged.append(
                IncidentSummary(
                    id=name, path=path, created_at="-", trigger="-", top_finding=None, summary="", damaged=exc.message
                )
            )
            continue
        findings = data.get("findings") or []
        top = findings[0].get("playbook") if findings and isinstance(findings[0], dict) else None
        found.append(
            IncidentSummary(
                id=str(data["id"]),
                path=path,
                created_at=str(data["created_at"]),
                trigger=str(data["trigger"]),
                top_finding=top,
                summary=str(data.get("summary") or ""),
            )
        )
    found.sort(key=lambda s: (s.created_at, s.id), reverse=True)
    return found + damaged, warnings


def resolve_report(target: str | None, default_dir: str) -> tuple[str, str]:
    """``dlwatch report [TARGET]`` -> ("list", dir), ("show", incident path) or ("summary", run path)."""
    if target is None:
        return "list", default_dir
    if os.path.isdir(target):
        if os.path.exists(os.path.join(target, "report.json")):
            return "show", target
        if os.path.isfile(os.path.join(target, "summary.json")):
            return "summary", target  # a run summary's directory (runs/<run-id>)
        return "list", target
    if os.path.isfile(target) and os.path.basename(target) == "report.json":
        return "show", os.path.dirname(target) or "."
    candidate = os.path.join(default_dir, target)
    if os.sep not in target and os.path.isdir(candidate) and os.path.exists(os.path.join(candidate, "report.json")):
        return "show", candidate
    run = os.path.join(default_dir, SUMMARIES_DIR, target)
    if os.sep not in target and os.path.isfile(os.path.join(run, "summary.json")):
        return "summary", run
    if os.path.isfile(os.path.join(target, "summary.json")):
        return "summary", target
    if os.path.isfile(target) and os.path.basename(target) == "summary.json":
        return "summary", os.path.dirname(target) or "."
    if os.sep not in target and os.path.isdir(candidate):
        return "show", candidate
    raise NotFoundError(
        f"no incident or report directory named {target!r} (looked in {default_dir})",
        help="run `dlwatch report` to list incident ids",
    )


# --------------------------------------------------------------------------- run summaries


def write_summary(
    report_dir: str, summary: dict[str, Any], *, render_markdown: Callable[[Mapping[str, Any]], str]
) -> str:
    """Write ``<report_dir>/runs/<id>/`` (summary.json, summary.md) atomically; return its path.

    Created like an incident: redacted (``outbound``), in the directory ``prepare_report_dir``
    gives, through a fresh ``mkdtemp`` directory renamed into place.  ``runs/`` is made
    exclusively by us, or an existing one must pass the report-directory check.  Raises
    OSError, leaving nothing.
    """
    summary = outbound(summary)
    report_dir = prepare_report_dir(report_dir)
    base = os.path.join(report_dir, SUMMARIES_DIR)
    try:
        make_private_child(report_dir, SUMMARIES_DIR)
    except FileExistsError:
        check_report_dir(base)  # ours, a real directory, not writable by anyone else
    run_id = str(summary["id"])
    if not run_id or run_id.startswith(".") or os.sep in run_id or run_id in ("..",):
        raise UnsafeDirError(f"refusing to write a run summary named {run_id!r}")

    def fill(tmp: str) -> None:
        write_json(os.path.join(tmp, "summary.json"), summary)
        write_private(os.path.join(tmp, "summary.md"), render_markdown(summary))

    return publish_private_dir(base, run_id, fill, tmp_prefix=TMP_PREFIX)


# A run id, as new_run_id makes it: <UTC yyyymmddTHHMMSS>Z-<pid>-<6 hex>.  Older ids said local
# time and had no Z: they are still read, listed and pruned (as local time, see run_id_time).
@dataclass(frozen=True)
class _Kept:
    name: str
    key: tuple[float, int, str]


def prune_runs(report_dir: str, keep: int, *, spare: str | None = None) -> list[str]:
    """Remove the oldest run summaries in ``<report_dir>/runs/`` beyond ``keep``; return the names removed.

    Never raises: a failure is one log line, and nothing else happens.  ``keep`` <= 0 keeps
    all.  Only entries that are certainly summaries this user wrote count and may go: a name
    that is exactly a run id, a real directory (not a link) owned by the effective uid, with a
    regular summary.json in it.  Anything else in ``runs/`` (summaries being written,
    ``.tmp-*``; links; other users' directories; foreign files) is left alone and not counted.
    ``spare`` (the summary just written) counts but is never removed.

    Oldest first: by the run id's timestamp (when the block started, whole seconds), then by
    when summary.json was written (its mtime, in ns), then by name.  Removal is by directory
    file descriptor (``_remove_tree``: never follows a link, never enters another mount, so a
    bind mount inside an old summary keeps its files); where the platform cannot remove by file
    descriptor (shutil's ``avoids_symlink_attacks`` says so), nothing is pruned.  Another process pruning the same
    directory at the same time is fine: what it removed first is skipped.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep <= 0:
        return []
    try:
        return _prune_runs(report_dir, keep, spare)
    except Exception as exc:  # pruning is housekeeping: it never fails the run
        _log().warning("prune_runs_failed", report_dir=report_dir, error=f"{type(exc).__name__}: {exc}")
        return []


def _log() -> Any:
    from dlwatch._log import get_logger

    return get_logger("dlwatch.store")


def _prune_runs(
    report_dir: str,
    keep: int,
    spare: str | None,
    subdir: str = SUMMARIES_DIR,
    entry: Callable[[int, str, int], _Kept | None] | None = None,
    event: str = "prune_runs",
) -> list[str]:
    """The remover behind prune_runs (and prune_jobs: ``subdir`` ".jobs", its own ``entry`` test)."""
    entry = entry or _summary_entry
    if not getattr(shutil.rmtree, "avoids_symlink_attacks", False):
        _log().warning(
            f"{event}_skipped",
            report_dir=report_dir,
            reason="shutil.rmtree cannot avoid symlink attacks on this platform",
        )
        return []
    check_report_dir(report_dir)  # ours and private, as when the summary was written
    try:
        fd = os.open(os.path.join(report_dir, subdir), os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return []
    try:
        st = os.fstat(fd)
        euid = os.geteuid()
        if st.st_uid != euid or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise UnsafeDirError(
                f"{subdir}/ is not ours or is writable by others (uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):o})"
            )
        runs = [k for k in (entry(fd, name, euid) for name in os.listdir(fd)) if k is not None]
        excess = len(runs) - keep
        if excess <= 0:
            return []
        runs.sort(key=lambda k: k.key)
        victims = [k.name for k in runs if k.name != spare][:excess]
        removed: list[str] = []
        failures: list[str] = []
        for name in victims:
            for attempt in range(3):
                errors: list[OSError] = []
                _remove_tree(fd, name, _Fs(st.st_dev, _mount_id(fd)), errors)
                # a late file (that summary's report.html child still writing) makes rmdir fail: again
                if not any(getattr(e, "errno", None) == errno.ENOTEMPTY for e in errors) or attempt == 2:
                    break
            if errors:
                failures += [f"{name}: {e}" for e in errors]
            else:
                removed.append(name)
        if failures:
            _log().warning(f"{event}_incomplete", report_dir=report_dir, errors=failures[:3], num_errors=len(failures))
        return removed
    finally:
        os.close(fd)


@dataclass(frozen=True)
class _Fs:
    """The mount ``runs/`` is on: removal never leaves it."""

    dev: int
    mount_id: int | None  # None where /proc/self/fdinfo does not say (then st_dev alone decides)


def _mount_id(fd: int) -> int | None:
    """The mount an open file is on (``mnt_id`` in /proc/self/fdinfo): tells a bind mount of the same
    filesystem, which st_dev cannot."""
    try:
        with open(f"/proc/self/fdinfo/{fd}", "rb") as f:
            for line in f:
                if line.startswith(b"mnt_id:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _remove_tree(dir_fd: int, name: str, fs: _Fs, errors: list[OSError]) -> None:
    """Remove the directory ``name`` in ``dir_fd`` and what it holds, by file descriptor, never following
    a link and never crossing into another mount (a bind mount inside an old summary keeps its files:
    it is left, and the directories above it with it).  Errors go to ``errors``; an entry already gone
    (another pruner was first) is not one."""
    _remove_entry(dir_fd, name, fs, errors)


def _remove_entry(dir_fd: int, name: str, fs: _Fs, errors: list[OSError]) -> None:
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            os.unlink(name, dir_fd=dir_fd)  # a link is removed, its target untouched
            return
        if st.st_dev != fs.dev:
            raise OSError(errno.EXDEV, f"{name} is on another filesystem (a mount point): left alone")
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return
    except OSError as exc:
        errors.append(exc)
        return
    try:
        mid = _mount_id(fd) if fs.mount_id is not None else None
        if not os.path.samestat(st, os.fstat(fd)) or mid != fs.mount_id:
            errors.append(OSError(errno.EXDEV, f"{name} is a mount point or was replaced: left alone"))
            return
        for entry in list(os.scandir(fd)):
            _remove_entry(fd, entry.name, fs, errors)
    except FileNotFoundError:
        pass
    except OSError as exc:
        errors.append(exc)
    finally:
        os.close(fd)
    try:
        os.rmdir(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        errors.append(exc)


def _summary_entry(dir_fd: int, name: str, euid: int) -> _Kept | None:
    """The sort key of ``runs/<name>`` if it is a summary this user wrote, else None."""
    started = run_id_time(name)
    if started is None:
        return None
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != euid:
            return None
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if not os.path.samestat(st, os.fstat(sub)):
                return None  # replaced between the two looks
            js = os.stat("summary.json", dir_fd=sub, follow_symlinks=False)
        finally:
            os.close(sub)
    except OSError:  # gone (another pruner), no summary.json, or unreadable: not ours to count
        return None
    if not stat.S_ISREG(js.st_mode):
        return None
    return _Kept(name=name, key=(started, js.st_mtime_ns, name))


# --------------------------------------------------------------------------- .jobs retention

JOBS_DIR = ".jobs"  # <report_dir>/.jobs/<job>/rank<R>-<host>-<pid>.json (dlwatch.report.rankfigures)
_JOB_NAME = re.compile(r"[A-Za-z0-9_@-][A-Za-z0-9_.@-]{0,127}")  # what job.safe_name gives
_FIGURES_NAME = re.compile(r"rank(?:[0-9]{1,10}|-unknown)-[A-Za-z0-9_.@:-]{0,64}-[0-9]{1,10}\.json")


def prune_jobs(report_dir: str, keep: int, *, spare: str | None = None) -> list[str]:
    """Remove the oldest job directories in ``<report_dir>/.jobs/`` beyond ``keep``; return the names removed.

    The rank figures of multi-rank jobs, retained like run summaries (:func:`prune_runs`, whose
    remover this is, with the same rules and the same cap, ``keep_runs``): never raises, ``keep``
    <= 0 keeps all, ``spare`` (the job of the run that prunes) counts and is never removed.  A job counts,
    and may go, only if its name is one ``job.safe_name`` gives, it is a real directory (not a
    link) owned by the effective uid on the same filesystem as ``.jobs/`` (itself on the report
    directory's), and it holds only regular files, at least one of them a rank figures file of
    ours.  Oldest first by the newest figures file's mtime (the job's last write), then by name.
    """
    if isinstance(keep, bool) or not isinstance(keep, int) or keep <= 0:
        return []
    try:
        try:
            jobs_st = os.stat(os.path.join(report_dir, JOBS_DIR), follow_symlinks=False)
        except FileNotFoundError:
            return []
        if jobs_st.st_dev != os.stat(report_dir).st_dev:
            raise UnsafeDirError(f"{JOBS_DIR}/ is on another filesystem than the report directory")
        return _prune_runs(
            report_dir, keep, spare, JOBS_DIR, lambda fd, name, euid: _job_entry(fd, name, euid, spare), "prune_jobs"
        )
    except Exception as exc:  # housekeeping: it never fails the run
        _log().warning("prune_jobs_failed", report_dir=report_dir, error=f"{type(exc).__name__}: {exc}")
        return []


def _job_entry(dir_fd: int, name: str, euid: int, spare: str | None = None) -> _Kept | None:
    """The sort key of ``.jobs/<name>`` if it is a job directory this user wrote, else None.

    ``spare``, the pruning run's own job, counts even before its first figures file (the monitor
    writes the summary, and so prunes, before its last figures)."""
    if _JOB_NAME.fullmatch(name) is None:
        return None
    newest = None
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != euid or st.st_dev != os.fstat(dir_fd).st_dev:
            return None  # a link, another user's, or a mount point: never ours to remove
        sub = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            if not os.path.samestat(st, os.fstat(sub)):
                return None  # replaced between the two looks
            for child in os.listdir(sub):
                cst = os.stat(child, dir_fd=sub, follow_symlinks=False)
                if stat.S_ISLNK(cst.st_mode):
                    continue  # rmtree unlinks a link, never follows it
                if not stat.S_ISREG(cst.st_mode) or cst.st_dev != st.st_dev:
                    return None  # a directory, FIFO or mount point: rank figures are flat files
                if (
                    cst.st_uid == euid
                    and _FIGURES_NAME.fullmatch(child)
                    and (newest is None or cst.st_mtime_ns > newest)
                ):
                    newest = cst.st_mtime_ns
        finally:
            os.close(sub)
    except OSError:  # gone (another pruner) or unreadable: not ours to count
        return None
    if newest is None and name == spare:
        newest = st.st_mtime_ns
    if newest is None:
        return None
    return _Kept(name=name, key=(newest / 1e9, newest, name))


MAX_SUMMARY_BYTES = 16 << 20  # summary.json: figures per worker and a few findings, far below this


def load_summary(path: str, *, dir_fd: int | None = None) -> dict[str, Any]:
    """Load and check one summary.json (or the run directory holding it); ReportError if damaged.

    Read with the care of :func:`load_report`: a regular file only (no link, no FIFO), at
    most MAX_SUMMARY_BYTES, nested at most MAX_DEPTH deep, with the types the renderers use.
    ``dir_fd``: the run directory ``path`` names, already open; summary.json is read in it.
    """
    if dir_fd is not None or os.path.isdir(path):
        path = os.path.join(path, "summary.json")
    try:
        raw = read_regular(path, MAX_SUMMARY_BYTES, dir_fd=dir_fd)
    except NotFoundError:
        raise NotFoundError(f"no run summary at {path}", help="run `dlwatch report --runs` to list the runs") from None
    data = _load_json_document(
        path,
        raw,
        "summary",
        "a dlwatch run summary",
        lambda d: d.get("kind") == SUMMARY_KIND and all(k in d for k in SUMMARY_REQUIRED_KEYS),
        SUMMARY_SCHEMA_VERSION,
    )
    problem = summary_type_problem(data)
    if problem:
        raise ReportError(f"{path} is damaged: {problem}", help="it was not written by dlwatch; remove it")
    return data


def load_run_summary(path: str, *, dir_fd: int | None = None) -> RunSummary:
    """:func:`load_summary`, as the typed :class:`~dlwatch.report.schema.RunSummary`."""
    return RunSummary.from_dict(load_summary(path, dir_fd=dir_fd))


@dataclass(frozen=True)
class RunInfo:
    id: str
    path: str
    created_at: str
    batches: int
    epochs: int
    data_wait_share: float | None
    advice: tuple[str, ...]
    incidents: int

    def to_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["advice"] = list(self.advice)
        return d


def list_runs(report_dir: str) -> tuple[list[RunInfo], list[str]]:
    """Run summaries newest first, and one warning per damaged entry (skipped, not fatal)."""
    if not os.path.isdir(report_dir):
        raise NotFoundError(
            f"no report directory {report_dir}",
            help="pass the directory that watch(report_dir=...) or DLWATCH_DIR named",
        )
    base = os.path.join(report_dir, SUMMARIES_DIR)
    found: list[RunInfo] = []
    warnings: list[str] = []
    try:
        names = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        names = []
    for name in sorted(names):
        path = os.path.join(base, name)
        if name.startswith("."):
            continue  # summaries being written
        try:
            st = os.lstat(path)
            if not stat.S_ISDIR(st.st_mode):
                if stat.S_ISLNK(st.st_mode) and os.path.isdir(path):
                    warnings.append(
                        f"skipped run {name}: a symbolic link to a directory; "
                        "dlwatch writes none and does not follow it"
                    )
                continue
            os.lstat(os.path.join(path, "summary.json"))
        except OSError:
            continue
        try:
            data = load_summary(path)
        except (ReportError, NotFoundError) as exc:
            warnings.append(f"skipped run {name}: {exc.message}")
            continue
        loop = data.get("loop") if isinstance(data.get("loop"), dict) else {}
        share = loop.get("data_wait_share")
        try:
            found.append(
                RunInfo(
                    id=str(data["id"]),
                    path=path,
                    created_at=str(data["created_at"]),
                    batches=int(loop.get("batches") or 0),
                    epochs=int(loop.get("epochs") or 0),
                    data_wait_share=float(share) if isinstance(share, (int, float)) else None,
                    advice=tuple(str(f.get("playbook")) for f in data.get("advice") or () if isinstance(f, dict)),
                    incidents=len(data.get("incidents") or ()),
                )
            )
        except (TypeError, ValueError, OverflowError) as exc:
            warnings.append(f"skipped run {name}: damaged loop figures ({type(exc).__name__})")
    found.sort(key=lambda r: (r.created_at, r.id), reverse=True)
    return found, warnings
