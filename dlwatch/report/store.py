"""Incident directories on disk: ids, atomic writes, listing and loading.

An incident directory appears complete or not at all: it is written in a fresh
private ``.tmp-<id>-XXXXXX`` directory (``mkdtemp``; listings ignore it) and
renamed into place.  The report directory itself is used only when no other user
can change it (``_fs.check_report_dir``); a sticky shared one such as /tmp gets a
private ``mkdtemp`` child, and the fallback is a ``mkdtemp`` directory too.  Run directories
(``.runs/``) hold a run in progress and are never listed as incidents.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import secrets
import shutil
import socket
import tempfile
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from dlwatch import __version__
from dlwatch._fs import (UnsafeDirError, check_links, make_private_child, make_private_dir, sticky_parent,
                         verify_created, write_json, write_jsonl, write_private)
from dlwatch.errors import NotFoundError, ReportError
from dlwatch.redact import outbound

SCHEMA_VERSION = 1
TRIGGERS = ("exception", "stall", "threshold", "exit", "attach")
RUNS_DIR = ".runs"
TMP_PREFIX = ".tmp-"
REQUIRED_KEYS = ("schema_version", "id", "created_at", "trigger", "pid")


def new_incident_id(trigger: str, pid: int, now: float | None = None) -> str:
    when = _dt.datetime.fromtimestamp(now, _dt.timezone.utc) if now else _dt.datetime.now(_dt.timezone.utc)
    return f"{when:%Y%m%dT%H%M%SZ}-{trigger}-{pid}-{secrets.token_hex(2)}"


def rank_info(environ: Mapping[str, str] | None = None) -> dict[str, int | None]:
    env = os.environ if environ is None else environ

    def num(name: str) -> int | None:
        try:
            return int(env[name])
        except (KeyError, ValueError):
            return None

    return {"rank": num("RANK"), "local_rank": num("LOCAL_RANK"), "world_size": num("WORLD_SIZE")}


def skeleton(*, trigger: str, pid: int, now: float) -> dict[str, Any]:
    """Every top-level key of schema 1, in documented order, with empty values."""
    if trigger not in TRIGGERS:
        raise ValueError(f"unknown trigger {trigger!r}")
    return {
        "schema_version": SCHEMA_VERSION,
        "id": new_incident_id(trigger, pid, now),
        "created_at": _dt.datetime.fromtimestamp(now, _dt.timezone.utc).isoformat(timespec="seconds"),
        "dlwatch_version": __version__,
        "host": socket.gethostname(),
        "pid": pid,
        "rank": rank_info(),
        "trigger": trigger,
        "summary": "",
        "classification": None,
        "loader": None,
        "progress": {},
        "exception": None,
        "findings": [],
        "processes": [],
        "system": None,
        "gpus": [],
        "events": [],
        "timeline": [],
        "notes": [],
        "config": {},
    }


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
    make_private_dir(report_dir)
    return report_dir


def write_incident(report_dir: str, report: dict[str, Any], *,
                   render_markdown: Callable[[Mapping[str, Any]], str],
                   extra_files: Mapping[str, bytes] | None = None) -> str:
    """Write ``<report_dir>/<id>/`` atomically; return its path.  Raises OSError, leaving nothing."""
    report = outbound(report)
    report_dir = prepare_report_dir(report_dir)
    final = os.path.join(report_dir, report["id"])
    tmp = tempfile.mkdtemp(prefix=TMP_PREFIX + report["id"] + "-", dir=report_dir)
    try:
        verify_created(tmp)
        write_json(os.path.join(tmp, "report.json"), report)
        write_private(os.path.join(tmp, "report.md"), render_markdown(report))
        write_jsonl(os.path.join(tmp, "timeline.jsonl"), report.get("timeline") or [])
        for rel, data in (extra_files or {}).items():
            parts = os.path.normpath(rel).split(os.sep)
            if os.path.isabs(rel) or ".." in parts or not parts[-1]:
                raise UnsafeDirError(f"refusing to write {rel!r} outside the incident")
            head = tmp
            for part in parts[:-1]:
                head = os.path.join(head, part) if os.path.isdir(os.path.join(head, part)) \
                    else make_private_child(head, part)
            write_private(os.path.join(head, parts[-1]), data)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


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


def load_report(path: str) -> dict[str, Any]:
    """Load and check one report.json (or the directory holding it)."""
    if os.path.isdir(path):
        path = os.path.join(path, "report.json")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        raise NotFoundError(f"no report at {path}", help="run `dlwatch report` to list the incidents") from None
    except PermissionError:
        raise ReportError(f"cannot read {path}: permission denied") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path} is damaged or truncated ({type(exc).__name__})",
                          help="it was not written by a complete dlwatch run; remove it") from None
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(data, dict) or any(k not in data for k in REQUIRED_KEYS):
        raise ReportError(f"{path} is not a dlwatch report (missing keys)")
    version = data.get("schema_version")
    if not isinstance(version, int):
        raise ReportError(f"{path} has no valid schema_version")
    if version > SCHEMA_VERSION:
        raise ReportError(f"{path} has schema_version {version}, newer than this dlwatch understands ({SCHEMA_VERSION})",
                          help="upgrade dlwatch (pip install -U dlwatch)")
    return data


@dataclass(frozen=True)
class IncidentSummary:
    id: str
    path: str
    created_at: str
    trigger: str
    top_finding: str | None
    summary: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def list_incidents(report_dir: str) -> tuple[list[IncidentSummary], list[str]]:
    """Incidents newest first, and one warning per damaged entry (skipped, not fatal)."""
    if not os.path.isdir(report_dir):
        raise NotFoundError(f"no report directory {report_dir}",
                            help="pass the directory that watch(report_dir=...) or DLWATCH_DIR named")
    found: list[IncidentSummary] = []
    warnings: list[str] = []
    for name in os.listdir(report_dir):
        if name.startswith("."):
            continue  # runs in progress and incidents being written
        path = os.path.join(report_dir, name)
        if not os.path.isdir(path) or not os.path.exists(os.path.join(path, "report.json")):
            continue
        try:
            data = load_report(path)
        except ReportError as exc:
            warnings.append(f"skipped {name}: {exc.message}")
            continue
        findings = data.get("findings") or []
        top = findings[0].get("playbook") if findings and isinstance(findings[0], dict) else None
        found.append(IncidentSummary(id=str(data["id"]), path=path, created_at=str(data["created_at"]),
                                     trigger=str(data["trigger"]), top_finding=top,
                                     summary=str(data.get("summary") or "")))
    found.sort(key=lambda s: (s.created_at, s.id), reverse=True)
    return found, warnings


def resolve_report(target: str | None, default_dir: str) -> tuple[str, str]:
    """``dlwatch report [TARGET]`` -> ("list", dir) or ("show", incident path)."""
    if target is None:
        return "list", default_dir
    if os.path.isdir(target):
        if os.path.exists(os.path.join(target, "report.json")):
            return "show", target
        return "list", target
    if os.path.isfile(target) and os.path.basename(target) == "report.json":
        return "show", os.path.dirname(target) or "."
    candidate = os.path.join(default_dir, target)
    if os.sep not in target and os.path.isdir(candidate):
        return "show", candidate
    raise NotFoundError(f"no incident or report directory named {target!r} (looked in {default_dir})",
                        help="run `dlwatch report` to list incident ids")
