"""The options of ``watch`` and their environment variables, resolved and validated once.

Precedence: an explicit keyword wins over the environment variable, which wins
over the default; except ``DLWATCH_DISABLE=1``, which always turns watch into a
no-op (an operator's kill switch that needs no code change).

Fail open on the environment: a bad keyword argument (or ``dlwatch run`` option) is an error
at the call, as a bad DataLoader argument is; a bad *environment* value is not the program's
doing (it may be set for a whole cluster), so it must never stop the program.  The variable,
or the one bad entry of a list (``DLWATCH_IGNORE``, ``DLWATCH_PLAYBOOKS``), is dropped for the
default and the reason goes into ``Options.problems``, which the training process warns about,
once each (``dlwatch.inproc.agent``).  The same holds for ``DLWATCH_PROM_*``
(:func:`prom_options` with ``problems``), for an unknown playbook id in ``DLWATCH_IGNORE``
(:func:`known_ignored`) and for a playbook directory of ``DLWATCH_PLAYBOOKS`` that cannot be
loaded (``dlwatch.wire.playbooks.load_playbooks``).  Every other ``DLWATCH_*`` variable takes
any value (``DLWATCH_DIR``: a directory that cannot be used falls back to a private one, with a
warning; ``DLWATCH_DISABLE``, ``DLWATCH_QUIET``, ``DLWATCH_HTML``: anything but the words they
name means no; ``DLWATCH_JOB_ID``, ``DLWATCH_PROGRAM_RUN``: text; ``DLWATCH_PY_SPY``: a py-spy
that is not there is a note in the report).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

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
    # the options whose value came from the environment, and the bad environment values dropped
    # for the default (one line each, for a warning): neither is an option, neither is in to_dict
    from_env: frozenset[str] = field(default=frozenset(), compare=False)
    problems: tuple[str, ...] = field(default=(), compare=False)

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


def _ignore_list(value: Any, *, source: str, dropped: list[str] | None = None) -> tuple[str, ...]:
    """The ignore entries; with ``dropped`` (an environment value) a bad entry is left out and said there."""
    if value is None:
        return ()
    if isinstance(value, str):
        items = [i.strip() for i in re.split(r"[,\s]+", value) if i.strip()]
    elif isinstance(value, (list, tuple, set, frozenset)) and all(isinstance(i, str) for i in value):
        items = [i.strip() for i in value]
    else:
        raise TypeError(f"dlwatch.watch: ignore must be a list of playbook ids, e.g. ['batch-dim-mismatch'] ({source})")
    kept = []
    for item in items:
        try:
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
        except ValueError as exc:
            if dropped is None:
                raise
            dropped.append(_reason(exc, source))
            continue
        kept.append(item)
    return tuple(dict.fromkeys(kept))


def _playbook_dirs(value: Any, *, source: str, dropped: list[str] | None = None) -> tuple[str, ...]:
    """The extra playbook directories; with ``dropped`` (an environment value) a missing one is left out."""
    dirs: tuple[str, ...] = ()
    if isinstance(value, str):
        dirs = tuple(d for d in value.split(os.pathsep) if d)
    elif isinstance(value, os.PathLike):
        dirs = (os.fspath(value),)
    elif isinstance(value, Sequence):
        dirs = tuple(os.fspath(d) for d in value)
    elif value is not None:
        raise TypeError(f"dlwatch.watch: playbooks must be a directory or a list of them ({source})")
    kept = []
    for d in dirs:
        if not os.path.isdir(d):
            if dropped is None:
                raise ValueError(
                    f"dlwatch.watch: playbook directory {d!r} does not exist ({source}); create it or drop the option"
                )
            dropped.append(f"playbook directory {d!r} does not exist")
            continue
        kept.append(d)
    return tuple(kept)


def _report_dir(value: Any, *, source: str) -> str:
    if not isinstance(value, (str, os.PathLike)):
        raise TypeError(f"dlwatch.watch: report_dir must be a path, got {type(value).__name__} ({source})")
    rdir = os.fspath(value)
    if not rdir or "\0" in rdir:
        raise ValueError(f"dlwatch.watch: report_dir must be a non-empty path ({source})")
    return rdir


def _reason(exc: BaseException, source: str) -> str:
    """An error's text as one line of a warning: without the "dlwatch.watch: " and the source it names."""
    text = str(exc).removeprefix("dlwatch.watch: ")
    return text.replace(f" ({source})", "")


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
    labels: Mapping[str, str] | None = None,
) -> Options:
    """Validate every option before anything starts.

    A bad keyword argument raises ValueError/TypeError naming it (``labels`` names an option
    the way the caller's user gave it, e.g. ``--poll-interval``); a bad environment value is
    dropped for the default and said in ``Options.problems`` (see the module's docstring).
    """
    env = os.environ if environ is None else environ
    problems: list[str] = []
    from_env: set[str] = set()

    def take(name: str, explicit: Any, convert: Callable[[Any, str, Any], Any], default: Any, shown: str) -> Any:
        """The option's value: ``convert(value, source, dropped)`` of the keyword (an error raises) or of
        the variable (an error, or a bad entry it reports in ``dropped``, becomes a problem)."""
        if explicit is not None:
            return convert(explicit, (labels or {}).get(name, "keyword argument"), None)
        var = ENV[name]
        raw = env.get(var)
        if raw in (None, ""):
            return default
        source = f"environment variable {var}"
        dropped: list[str] = []
        try:
            value = convert(raw, source, dropped)
        except (ValueError, TypeError) as exc:
            problems.append(f"{var}={raw!r} is ignored: {_reason(exc, source)}; the default ({shown}) applies")
            return default
        problems.extend(f"{var}: {why}; that entry is ignored" for why in dropped)
        from_env.add(name)
        return value

    def seconds(name: str, minimum: float) -> Callable[[Any, str, Any], float]:
        return lambda value, source, _dropped: _seconds(name, value, source=source, minimum=minimum)

    rdir = take("report_dir", report_dir, lambda v, src, _d: _report_dir(v, source=src), DEFAULT_REPORT_DIR, "")
    interval = take("poll_interval", poll_interval, seconds("poll_interval", 0.01), DEFAULT_POLL_INTERVAL, "1.0 s")
    stall = take("stall_timeout", stall_timeout, seconds("stall_timeout", 0.1), None, "adaptive")
    body = take("body_timeout", body_timeout, seconds("body_timeout", 0.1), None, "adaptive")
    ignored = take("ignore", ignore, lambda v, src, d: _ignore_list(v, source=src, dropped=d), (), "none")
    keep = take("keep_runs", keep_runs, lambda v, src, _d: _count("keep_runs", v, source=src), DEFAULT_KEEP_RUNS, "200")
    on = take("enabled", enabled, lambda v, src, _d: _flag("enabled", v, source=src), True, "enabled")
    if env.get("DLWATCH_DISABLE", "").strip().lower() in _TRUE:
        on = False
    dirs = take("playbooks", playbooks, lambda v, src, d: _playbook_dirs(v, source=src, dropped=d), (), "none")
    return Options(
        report_dir=rdir,
        poll_interval=interval,
        stall_timeout=stall,
        enabled=on,
        playbooks=dirs,
        body_timeout=body,
        ignore=ignored,
        keep_runs=keep,
        from_env=frozenset(from_env),
        problems=tuple(problems),
    )


def known_ignored(options: Options, known: Iterable[str]) -> Options:
    """``options`` checked against the playbook ids ``known``: an unknown id given as an argument is a
    ValueError; one from ``DLWATCH_IGNORE`` is dropped and said in ``problems``."""
    unknown = sorted(set(options.ignored_playbooks) - set(known))
    if not unknown:
        return options
    if "ignore" not in options.from_env:
        raise ValueError(
            f"dlwatch.watch: ignore names no known playbook: {', '.join(unknown)} (see `dlwatch playbooks` for the ids)"
        )
    why = f"{ENV['ignore']} names no known playbook: {', '.join(unknown)} (see `dlwatch playbooks`); those are ignored"
    return replace(
        options, ignore=tuple(i for i in options.ignore if i not in unknown), problems=(*options.problems, why)
    )


# Prometheus (opt-in; the monitor exports, see dlwatch.monitor.prom): read and checked in the training
# process, where a bad value is one warning and no export of that kind (fail open, see above).
PROM_ENV_FILE = "DLWATCH_PROM_FILE"
PROM_ENV_PORT = "DLWATCH_PROM_PORT"


def prom_options(environ: Mapping[str, str] | None = None, *, problems: list[str] | None = None) -> dict[str, Any]:
    """``{"file": path or None, "port": int or None}`` from the environment.

    A bad value raises ValueError naming the fix; with ``problems`` (the training process) that
    variable is left off instead, and the same line goes into ``problems``.
    """
    env = os.environ if environ is None else environ
    out: dict[str, Any] = {"file": None, "port": None}

    def bad(key: str, message: str, hint: str) -> None:
        if problems is None:
            raise ValueError(f"dlwatch.watch: {message}; {hint}")
        problems.append(
            f"{message}; it is ignored: {'no textfile is written' if key == 'file' else 'no endpoint is served'}"
        )
        out[key] = None

    raw_path = (env.get(PROM_ENV_FILE) or "").strip() or None
    raw_port = (env.get(PROM_ENV_PORT) or "").strip()
    if raw_port:
        try:
            port = int(raw_port)
        except ValueError:
            port = -1
        if 1 <= port <= 65535:
            out["port"] = port
        else:
            bad(
                "port",
                f"{PROM_ENV_PORT} must be a TCP port number (1-65535), got {raw_port!r}",
                "unset it to expose no metrics",
            )
    if raw_path is not None:
        try:
            path = os.path.abspath(raw_path)
        except (OSError, ValueError):  # a relative path in a working directory that is gone
            path = None
        if not raw_path.endswith(".prom"):
            bad(
                "file",
                f"{PROM_ENV_FILE} must be a path ending in .prom (node_exporter reads only those), got {raw_path!r}",
                "unset it to write no textfile",
            )
        elif path is None or not os.path.isdir(os.path.dirname(path)):
            where = repr(os.path.dirname(path)) if path else f"of {raw_path!r}"
            bad(
                "file",
                f"{PROM_ENV_FILE}: directory {where} does not exist",
                "create it (node_exporter's --collector.textfile.directory)",
            )
        else:
            out["file"] = path
    if (out["file"] or out["port"]) and not _have_client():
        if problems is None:
            raise ValueError(
                f"dlwatch.watch: {PROM_ENV_FILE}/{PROM_ENV_PORT} need prometheus_client: "
                "pip install 'dlwatch[prometheus]' (or unset them)"
            )
        problems.append(
            f"{PROM_ENV_FILE}/{PROM_ENV_PORT} need prometheus_client: pip install 'dlwatch[prometheus]' "
            "(or unset them); no metrics are exported"
        )
        out = {"file": None, "port": None}
    return out


def _have_client() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("prometheus_client") is not None
    except (ImportError, ValueError):
        return False
