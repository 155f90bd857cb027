"""The options of ``watch`` and their environment variables, resolved and validated once.

Precedence: an explicit keyword wins over the environment variable, which wins
over the default; except ``DLWATCH_DISABLE=1``, which always turns watch into a
no-op (an operator's kill switch that needs no code change).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

DEFAULT_REPORT_DIR = "./dlwatch-reports"
DEFAULT_POLL_INTERVAL = 1.0
DEFAULT_KEEP_RUNS = 200  # run summaries kept per report directory (runs/<run-id>/); 0 keeps all
ENV = {
    "report_dir": "DLWATCH_DIR",
    "poll_interval": "DLWATCH_POLL_INTERVAL",
    "stall_timeout": "DLWATCH_STALL_TIMEOUT",
    "body_timeout": "DLWATCH_BODY_TIMEOUT",
    "enabled": "DLWATCH_ENABLED",
    "playbooks": "DLWATCH_PLAYBOOKS",
    "ignore": "DLWATCH_IGNORE",
    "keep_runs": "DLWATCH_KEEP_RUNS",
}
# a playbook id, or "batch-dim-mismatch:KEY" to leave one key of the batch out of the shape check
_IGNORE_ITEM = re.compile(r"[a-z0-9][a-z0-9-]*(:[^\x00-\x1f]+)?")
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


@dataclass(frozen=True)
class Options:
    report_dir: str
    poll_interval: float
    stall_timeout: float | None  # None: adaptive (see detect/stall.py)
    enabled: bool
    playbooks: tuple[str, ...]  # extra playbook directories
    body_timeout: float | None = None  # None: adaptive (see detect/stall.py)
    ignore: tuple[str, ...] = ()  # playbook ids, and "batch-dim-mismatch:KEY" entries
    keep_runs: int = DEFAULT_KEEP_RUNS  # run summaries kept per report directory; 0 keeps all

    @property
    def ignored_playbooks(self) -> tuple[str, ...]:
        return tuple(i for i in self.ignore if ":" not in i)

    @property
    def ignored_batch_keys(self) -> tuple[str, ...]:
        prefix = "batch-dim-mismatch:"
        return tuple(i[len(prefix) :] for i in self.ignore if i.startswith(prefix))

    def to_dict(self) -> dict[str, Any]:
        return {
            "report_dir": self.report_dir,
            "poll_interval": self.poll_interval,
            "stall_timeout": self.stall_timeout,
            "body_timeout": self.body_timeout,
            "enabled": self.enabled,
            "playbooks": list(self.playbooks),
            "ignore": list(self.ignored_playbooks),
            "ignore_batch_keys": list(self.ignored_batch_keys),
            "keep_runs": self.keep_runs,
        }


def _seconds(name: str, value: Any, *, source: str, minimum: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"dlwatch.watch: {name} must be a number of seconds, got {type(value).__name__} ({source})")
    try:
        seconds = float(value)
    except ValueError:
        raise ValueError(f"dlwatch.watch: {name} must be a number of seconds, got {value!r} ({source})") from None
    if not math.isfinite(seconds) or seconds < minimum:
        raise ValueError(
            f"dlwatch.watch: {name} must be a finite number >= {minimum} seconds, got {value!r} ({source})"
        )
    return seconds


def _count(name: str, value: Any, *, source: str) -> int:
    """A whole number >= 0, from an int or a string of digits (an environment variable)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise TypeError(
            f"dlwatch.watch: {name} must be a whole number >= 0 (0 keeps all), got {type(value).__name__} ({source})"
        )
    if isinstance(value, str):
        text = value.strip()
        if not re.fullmatch(r"[0-9]+", text):
            raise ValueError(
                f"dlwatch.watch: {name} must be a whole number >= 0 (0 keeps all), got {value!r} ({source})"
            )
        count = int(text)
    else:
        count = value  # an int: bools and other types were refused above
    if count < 0:
        raise ValueError(f"dlwatch.watch: {name} must be a whole number >= 0 (0 keeps all), got {value!r} ({source})")
    return count


def _flag(name: str, value: Any, *, source: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise TypeError(f"dlwatch.watch: {name} must be True or False, got {value!r} ({source})")


def _ignore_list(value: Any, *, source: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):
        items = [i.strip() for i in re.split(r"[,\s]+", value) if i.strip()]
    elif isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(i, str) for i in value):
        items = [i.strip() for i in value]
    else:
        raise TypeError(f"dlwatch.watch: ignore must be a list of playbook ids, e.g. ['batch-dim-mismatch'] ({source})")
    for item in items:
        if not _IGNORE_ITEM.fullmatch(item):
            raise ValueError(
                f"dlwatch.watch: ignore entry {item!r} is not a playbook id (e.g. 'rng-duplication') "
                f"or 'batch-dim-mismatch:KEY' ({source})"
            )
        if ":" in item and not item.startswith("batch-dim-mismatch:"):
            raise ValueError(
                f"dlwatch.watch: ignore entry {item!r}: only batch-dim-mismatch takes a key "
                f"('batch-dim-mismatch:KEY') ({source})"
            )
    return tuple(dict.fromkeys(items))


def resolve(
    report_dir: Any = None,
    poll_interval: Any = None,
    stall_timeout: Any = None,
    enabled: Any = None,
    playbooks: Any = None,
    body_timeout: Any = None,
    ignore: Any = None,
    keep_runs: Any = None,
    environ: Mapping[str, str] | None = None,
) -> Options:
    """Validate every option before anything starts; raise ValueError/TypeError naming it."""
    env = os.environ if environ is None else environ

    def pick(name: str, explicit: Any) -> tuple[Any, str]:
        if explicit is not None:
            return explicit, "keyword argument"
        var = ENV[name]
        if env.get(var) not in (None, ""):
            return env[var], f"environment variable {var}"
        return None, "default"

    value, src = pick("report_dir", report_dir)
    if value is None:
        value = DEFAULT_REPORT_DIR
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"dlwatch.watch: report_dir must be a path, got {type(value).__name__} ({src})")
    rdir = os.fspath(value)
    if not rdir or "\0" in rdir:
        raise ValueError(f"dlwatch.watch: report_dir must be a non-empty path ({src})")

    value, src = pick("poll_interval", poll_interval)
    interval = DEFAULT_POLL_INTERVAL if value is None else _seconds("poll_interval", value, source=src, minimum=0.01)

    value, src = pick("stall_timeout", stall_timeout)
    stall = None if value is None else _seconds("stall_timeout", value, source=src, minimum=0.1)

    value, src = pick("body_timeout", body_timeout)
    body = None if value is None else _seconds("body_timeout", value, source=src, minimum=0.1)

    value, src = pick("ignore", ignore)
    ignored = _ignore_list(value, source=src)

    value, src = pick("keep_runs", keep_runs)
    keep = DEFAULT_KEEP_RUNS if value is None else _count("keep_runs", value, source=src)

    value, src = pick("enabled", enabled)
    on = True if value is None else _flag("enabled", value, source=src)
    if env.get("DLWATCH_DISABLE", "").strip().lower() in _TRUE:
        on = False

    value, src = pick("playbooks", playbooks)
    dirs: tuple[str, ...] = ()
    if isinstance(value, str):
        dirs = tuple(d for d in value.split(os.pathsep) if d)
    elif isinstance(value, os.PathLike):
        dirs = (os.fspath(value),)
    elif isinstance(value, Sequence):
        dirs = tuple(os.fspath(d) for d in value)
    elif value is not None:
        raise TypeError(f"dlwatch.watch: playbooks must be a directory or a list of them ({src})")
    for d in dirs:
        if not os.path.isdir(d):
            raise ValueError(
                f"dlwatch.watch: playbook directory {d!r} does not exist ({src}); create it or drop the option"
            )
    return Options(
        report_dir=rdir,
        poll_interval=interval,
        stall_timeout=stall,
        enabled=on,
        playbooks=dirs,
        body_timeout=body,
        ignore=ignored,
        keep_runs=keep,
    )


# Prometheus (opt-in; the monitor exports, see dlwatch.monitor.prom): read and checked in the training
# process so that a bad value is a ValueError at watch(), naming the fix.
PROM_ENV_FILE = "DLWATCH_PROM_FILE"
PROM_ENV_PORT = "DLWATCH_PROM_PORT"


def prom_options(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``{"file": path or None, "port": int or None}`` from the environment; ValueError names the fix."""
    env = os.environ if environ is None else environ
    path = (env.get(PROM_ENV_FILE) or "").strip() or None
    raw_port = (env.get(PROM_ENV_PORT) or "").strip()
    port = None
    if raw_port:
        try:
            port = int(raw_port)
        except ValueError:
            port = -1
        if not 1 <= port <= 65535:
            raise ValueError(
                f"dlwatch.watch: {PROM_ENV_PORT} must be a TCP port number (1-65535), got {raw_port!r}; "
                "unset it to expose no metrics"
            )
    if path is not None:
        if "\0" in path or not path.endswith(".prom"):
            raise ValueError(
                f"dlwatch.watch: {PROM_ENV_FILE} must be a path ending in .prom (node_exporter reads "
                f"only those), got {path!r}"
            )
        if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise ValueError(
                f"dlwatch.watch: {PROM_ENV_FILE}: directory {os.path.dirname(os.path.abspath(path))!r} "
                "does not exist; create it (node_exporter's --collector.textfile.directory)"
            )
        path = os.path.abspath(path)
    if (path or port) and not _have_client():
        raise ValueError(
            f"dlwatch.watch: {PROM_ENV_FILE}/{PROM_ENV_PORT} need prometheus_client: "
            "pip install 'dlwatch[prometheus]' (or unset them)"
        )
    return {"file": path, "port": port}


def _have_client() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("prometheus_client") is not None
    except (ImportError, ValueError):
        return False
