"""Incident directories on disk: ids, atomic writes, listing and loading.

An incident directory appears complete or not at all: it is written under
``.tmp-<id>`` (which listings ignore) and renamed into place.  Run directories
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
from dlwatch._fs import make_private_dir, write_json, write_jsonl, write_private
from dlwatch.errors import NotFoundError, ReportError
from dlwatch.redact import redact_obj

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


def write_incident(report_dir: str, report: dict[str, Any], *,
                   render_markdown: Callable[[Mapping[str, Any]], str],
                   extra_files: Mapping[str, bytes] | None = None) -> str:
    """Write ``<report_dir>/<id>/`` atomically; return its path.  Raises OSError, leaving nothing."""
    report = redact_obj(report)
    make_private_dir(report_dir)
    final = os.path.join(report_dir, report["id"])
    tmp = os.path.join(report_dir, TMP_PREFIX + report["id"])
    try:
        make_private_dir(tmp)
        write_json(os.path.join(tmp, "report.json"), report)
        write_private(os.path.join(tmp, "report.md"), render_markdown(report))
        write_jsonl(os.path.join(tmp, "timeline.jsonl"), report.get("timeline") or [])
        for rel, data in (extra_files or {}).items():
            path = os.path.join(tmp, rel)
            make_private_dir(os.path.dirname(path))
            write_private(path, data)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def fallback_dir() -> str:
    return os.path.join(tempfile.gettempdir(), f"dlwatch-reports-{os.getuid()}")


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
