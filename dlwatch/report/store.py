"""Incident directories on disk: ids, atomic writes, listing and loading.

An incident directory appears complete or not at all: it is written under
``.tmp-<id>`` (which listings ignore) and renamed into place.  Run directories
(``.runs/``) hold a run in progress and are never listed as incidents; run summaries
(``runs/<run-id>/summary.json`` and ``summary.md``) are written the same way and listed
apart (``dlwatch report --runs``).
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
SUMMARIES_DIR = "runs"  # <report_dir>/runs/<run-id>/summary.json: run summaries, never listed as incidents
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
    """``dlwatch report [TARGET]`` -> ("list", dir), ("show", incident path) or ("summary", run path)."""
    if target is None:
        return "list", default_dir
    if os.path.isdir(target):
        if os.path.exists(os.path.join(target, "report.json")):
            return "show", target
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
    raise NotFoundError(f"no incident or report directory named {target!r} (looked in {default_dir})",
                        help="run `dlwatch report` to list incident ids")


# --------------------------------------------------------------------------- run summaries


def write_summary(report_dir: str, summary: dict[str, Any], *,
                  render_markdown: Callable[[Mapping[str, Any]], str]) -> str:
    """Write ``<report_dir>/runs/<id>/`` (summary.json, summary.md) atomically; return its path."""
    summary = redact_obj(summary)
    base = os.path.join(report_dir, SUMMARIES_DIR)
    make_private_dir(base)
    final = os.path.join(base, summary["id"])
    tmp = os.path.join(base, TMP_PREFIX + summary["id"])
    try:
        make_private_dir(tmp)
        write_json(os.path.join(tmp, "summary.json"), summary)
        write_private(os.path.join(tmp, "summary.md"), render_markdown(summary))
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_summary(path: str) -> dict[str, Any]:
    """Load and check one summary.json (or the run directory holding it)."""
    from dlwatch.report.summary import KIND, REQUIRED_KEYS as SUMMARY_KEYS, SUMMARY_SCHEMA_VERSION

    if os.path.isdir(path):
        path = os.path.join(path, "summary.json")
    try:
        with open(path, "rb") as f:
            data = json.loads(f.read())
    except FileNotFoundError:
        raise NotFoundError(f"no run summary at {path}", help="run `dlwatch report --runs` to list the runs") from None
    except PermissionError:
        raise ReportError(f"cannot read {path}: permission denied") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReportError(f"{path} is damaged or truncated ({type(exc).__name__})",
                          help="it was not written by a complete dlwatch run; remove it") from None
    except OSError as exc:
        raise ReportError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not isinstance(data, dict) or data.get("kind") != KIND or any(k not in data for k in SUMMARY_KEYS):
        raise ReportError(f"{path} is not a dlwatch run summary (missing keys)")
    version = data.get("schema_version")
    if not isinstance(version, int):
        raise ReportError(f"{path} has no valid schema_version")
    if version > SUMMARY_SCHEMA_VERSION:
        raise ReportError(f"{path} has schema_version {version}, newer than this dlwatch understands "
                          f"({SUMMARY_SCHEMA_VERSION})", help="upgrade dlwatch (pip install -U dlwatch)")
    return data


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
        raise NotFoundError(f"no report directory {report_dir}",
                            help="pass the directory that watch(report_dir=...) or DLWATCH_DIR named")
    base = os.path.join(report_dir, SUMMARIES_DIR)
    found: list[RunInfo] = []
    warnings: list[str] = []
    try:
        names = os.listdir(base)
    except (FileNotFoundError, NotADirectoryError):
        names = []
    for name in names:
        path = os.path.join(base, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(path, "summary.json")):
            continue
        try:
            data = load_summary(path)
        except ReportError as exc:
            warnings.append(f"skipped run {name}: {exc.message}")
            continue
        loop = data.get("loop") if isinstance(data.get("loop"), dict) else {}
        share = loop.get("data_wait_share")
        found.append(RunInfo(
            id=str(data["id"]), path=path, created_at=str(data["created_at"]),
            batches=int(loop.get("batches") or 0), epochs=int(loop.get("epochs") or 0),
            data_wait_share=float(share) if isinstance(share, (int, float)) else None,
            advice=tuple(str(f.get("playbook")) for f in data.get("advice") or () if isinstance(f, dict)),
            incidents=len(data.get("incidents") or ())))
    found.sort(key=lambda r: (r.created_at, r.id), reverse=True)
    return found, warnings
