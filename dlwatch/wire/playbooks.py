"""Playbooks as data: load and validate the TOML files of ``playbooks/`` and the user's own.

This module owns the file format (documented in ``playbooks/README.md``) and
turns each file into a frozen :class:`Playbook`.  It judges nothing: the
matcher in :mod:`dlwatch.detect.match` evaluates the signals against a report.
A malformed file is a :class:`~dlwatch.errors.PlaybookError` naming the file
and the field; a playbook directory that does not exist is a
:class:`~dlwatch.errors.NotFoundError` naming the directory; except in a directory
that ``DLWATCH_PLAYBOOKS`` names, which is skipped instead (see :func:`load_playbooks`).

Search order, later overriding earlier by ``id``: the shipped playbooks, the
directories in ``DLWATCH_PLAYBOOKS`` (``os.pathsep``-separated), then
``extra_dirs`` (for example ``watch(..., playbooks=[...])``).
"""

from __future__ import annotations

import os
import re
import stat
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

from dlwatch import _regex
from dlwatch.errors import NotFoundError, PlaybookError

__all__ = [
    "ENV_VAR",
    "Hint",
    "MAX_PLAYBOOK_BYTES",
    "MAX_PLAYBOOK_FILES",
    "Playbook",
    "Signal",
    "builtin_dir",
    "load_dir",
    "load_file",
    "load_playbooks",
    "parse_playbook",
]

ENV_VAR = "DLWATCH_PLAYBOOKS"
ROLES = ("main", "worker", "any")
_ID_RE = re.compile(r"^[a-z0-9]+(?:-[a-z0-9]+)*$")
_TOP_KEYS = {
    "id",
    "title",
    "summary",
    "signals",
    "thresholds",
    "evidence",
    "remediation",
    "hints",
    "references",
    "kind",
}
KINDS = ("failure", "advice")  # advice: tuning findings for the run summary and preflight, never an incident
_REMEDIATION_KEYS = {"text", "variants"}


@dataclass(frozen=True)
class Signal:
    """One way a playbook matches.  Every condition given must hold (AND); at least one is given.

    Conditions over the exception: ``exception_type`` (regex searched in the qualified
    type name), ``exception_text`` (regex searched in message + traceback), ``errno``
    (the exception's errno, or one torch prints as ``[Errno N]`` / ``... (N)``, is one of
    these), ``not_errno`` (it is none of these; an absent errno passes), ``from_loader``.
    Over stacks: ``frame`` (regex searched in a frame's function or filename),
    ``frame_function`` / ``frame_filename`` (all given = the same frame), restricted to
    processes of ``role``.  Over the incident: ``classification``
    (one of these stall classifications), ``signal`` (a detector event of that name, e.g.
    ``fd_pressure``), ``fd_at_limit`` (some process is at or near its fd limit; false =
    none is), ``facts`` / ``not_facts`` (named facts a failure's module provides, all true /
    all false; a name no failure provides is false).
    """

    name: str
    confidence: float
    description: str = ""
    exception_type: _regex.Pattern | None = None
    exception_text: _regex.Pattern | None = None
    errno: tuple[int, ...] = ()
    not_errno: tuple[int, ...] = ()
    from_loader: bool | None = None
    frame: _regex.Pattern | None = None
    frame_function: _regex.Pattern | None = None
    frame_filename: _regex.Pattern | None = None
    role: str = "any"
    classification: tuple[str, ...] = ()
    signal: str | None = None
    fd_at_limit: bool | None = None
    facts: tuple[str, ...] = ()
    not_facts: tuple[str, ...] = ()

    @property
    def has_frame_condition(self) -> bool:
        return self.frame is not None or self.frame_function is not None or self.frame_filename is not None


@dataclass(frozen=True)
class Hint:
    """A frame pattern that names a likely cause; its text is put first in the remediation.

    Frame conditions as in :class:`Signal`; ``waiting_in`` is a regex over the
    process's ``waiting_in`` (e.g. ``lock acquire``).  Hints sharing a name are
    alternatives: the first that matches is shown.
    """

    name: str
    text: str
    frame: _regex.Pattern | None = None
    waiting_in: _regex.Pattern | None = None
    frame_function: _regex.Pattern | None = None
    frame_filename: _regex.Pattern | None = None
    role: str = "any"
    native: bool | None = None  # None: any frame; True: only native frames; False: only Python


@dataclass(frozen=True)
class Playbook:
    id: str
    title: str
    summary: str
    signals: tuple[Signal, ...]
    thresholds: Mapping[str, float]  # read-only mapping
    evidence: Mapping[str, str]  # evidence key -> what it shows, in display order
    remediation: str  # markdown shown for every match
    variants: Mapping[str, str]  # cause -> markdown shown first when that cause is measured
    hints: tuple[Hint, ...]
    references: tuple[str, ...]
    source: str  # the file it came from
    builtin: bool = False
    kind: str = "failure"  # "advice": found by code (detect/advice.py, preflight), never matched into incidents

    @property
    def is_advice(self) -> bool:
        return self.kind == "advice"

    def __hash__(self) -> int:  # the read-only mappings are not hashable; id and file identify it
        return hash((self.id, self.source))

    def threshold(self, name: str, default: float) -> float:
        value = self.thresholds.get(name)
        return default if value is None else value


# --------------------------------------------------------------------------- discovery


def builtin_dir() -> Any:
    """The shipped playbooks: the ``dlwatch._playbooks`` resource (a Traversable), or the repo's folder."""
    try:
        from importlib.resources import files

        root = files("dlwatch._playbooks")
        if any(entry.name.endswith(".toml") for entry in root.iterdir()):
            return root
    except Exception:  # an editable install or a plain checkout: the folder is not a package there
        pass
    package = Path(__file__).resolve().parent.parent  # dlwatch/ (this file is dlwatch/wire/playbooks.py)
    for candidate in (package / "_playbooks", package.parent / "playbooks"):
        if candidate.is_dir():
            return candidate
    return package.parent / "playbooks"


def _env_dirs() -> list[str]:
    raw = os.environ.get(ENV_VAR, "")
    return [d for d in raw.split(os.pathsep) if d.strip()]


# A user's playbook directory is read in the training process itself when the monitor is gone:
# what it costs is bounded.  The shipped files are a few KiB each; a pattern-only playbook is
# far below 1 MiB.  About 4 ms a file to parse and compile: 256 files stay near one second.
MAX_PLAYBOOK_BYTES = 1 << 20
MAX_PLAYBOOK_FILES = 256  # user playbook files in all the directories of one load


def load_playbooks(
    extra_dirs: Sequence[str] = (),
    *,
    problems: list[str] | None = None,
    strict_env: bool = False,
    extra_strict: bool = False,
) -> tuple[Playbook, ...]:
    """Shipped playbooks, then ``$DLWATCH_PLAYBOOKS``, then ``extra_dirs``; a later id overrides.

    At most MAX_PLAYBOOK_FILES user files in all, each at most MAX_PLAYBOOK_BYTES: more is a
    PlaybookError before anything is parsed.  A directory of ``extra_dirs`` (an argument) that
    does not exist or holds a malformed file is an error; a directory of ``$DLWATCH_PLAYBOOKS``
    is skipped instead, and why goes into ``problems`` (a missing one silently: ``config.resolve``
    says so), unless ``strict_env`` (``dlwatch playbooks``, where the user checks them): the
    environment never stops a program.  A directory of ``extra_dirs`` that the variable names too
    came from it (a run's options, resolved from the environment) and is read as the variable's,
    once, unless ``extra_strict`` says ``extra_dirs`` are the caller's arguments."""
    by_id: dict[str, Playbook] = {}
    for pb in load_dir(builtin_dir(), builtin=True):
        by_id[pb.id] = pb
    left = MAX_PLAYBOOK_FILES
    env_dirs = _env_dirs()
    extra = [(d, False) for d in extra_dirs if extra_strict or strict_env or str(d) not in env_dirs]
    for directory, from_env in [*((d, True) for d in env_dirs), *extra]:
        path = Path(os.path.expanduser(str(directory)))
        try:
            if not path.is_dir():
                where = f" (from ${ENV_VAR})" if from_env else ""
                raise NotFoundError(
                    f"playbook directory {str(directory)!r} does not exist{where}",
                    help="create it or remove it from the playbook search path",
                )
            loaded = load_dir(path, max_files=left)
        except (PlaybookError, NotFoundError, OSError) as exc:
            if strict_env or not from_env:
                raise
            if problems is not None and not isinstance(exc, NotFoundError):
                problems.append(f"{ENV_VAR}: playbook directory {str(directory)!r} is ignored: {exc}")
            continue
        left -= len(loaded)
        for pb in loaded:
            by_id[pb.id] = pb  # dict keeps the first position of an overridden id
    return tuple(by_id.values())


def _read_capped(path: str) -> bytes:
    """One user playbook file, at most MAX_PLAYBOOK_BYTES, through one fd: a link to a file is followed
    as the loader always has (the directory is the user's own), but only a regular file is read
    (O_NONBLOCK, then fstat: a FIFO or device cannot block or feed it), and its size is checked
    before the first byte is read (a 3 GB sparse file fails at once)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        raise PlaybookError(path, "(file)", f"cannot read: {exc.strerror or exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise PlaybookError(path, "(file)", "not a regular file (a FIFO, device or directory)")
        too_big = (
            f"larger than the {MAX_PLAYBOOK_BYTES // 1024} KiB a playbook file may be; "
            "split it or remove it from the directory"
        )
        if st.st_size > MAX_PLAYBOOK_BYTES:
            raise PlaybookError(path, "(file)", f"{st.st_size} bytes, {too_big}")
        chunks, total = [], 0
        while total <= MAX_PLAYBOOK_BYTES:
            chunk = os.read(fd, MAX_PLAYBOOK_BYTES + 1 - total)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > MAX_PLAYBOOK_BYTES:
            raise PlaybookError(path, "(file)", f"grew while read: {too_big}")
        return b"".join(chunks)
    except OSError as exc:
        raise PlaybookError(path, "(file)", f"cannot read: {exc.strerror or exc}") from None
    finally:
        os.close(fd)


def load_dir(directory: Any, builtin: bool = False, *, max_files: int = MAX_PLAYBOOK_FILES) -> list[Playbook]:
    """Every ``*.toml`` in one directory (not recursive), by file name; duplicate ids are an error.

    A user directory (not ``builtin``) may hold at most ``max_files`` of them, each read with
    :func:`_read_capped`; more files is a PlaybookError before any is parsed."""
    entries = sorted((e for e in directory.iterdir() if e.name.endswith(".toml") and e.is_file()), key=lambda e: e.name)
    if not builtin and len(entries) > max_files:
        raise PlaybookError(
            str(directory),
            "(directory)",
            f"{len(entries)} playbook files; dlwatch reads at most {MAX_PLAYBOOK_FILES} user playbook "
            f"files in all its playbook directories ({max_files} left for this one): merge or "
            "remove some",
        )
    seen: dict[str, str] = {}
    out = []
    for entry in entries:
        path = str(entry)
        if builtin:
            try:
                data = entry.read_bytes()
            except OSError as exc:
                raise PlaybookError(path, "(file)", f"cannot read: {exc.strerror or exc}") from None
        else:
            data = _read_capped(path)
        pb = parse_playbook(data, path, builtin=builtin)
        if pb.id in seen:
            raise PlaybookError(path, "id", f"{pb.id!r} is also defined in {seen[pb.id]}")
        seen[pb.id] = path
        out.append(pb)
    return out


def load_file(path: str | os.PathLike[str]) -> Playbook:
    p = Path(path)
    if not p.exists():
        raise NotFoundError(f"playbook file {str(p)!r} does not exist")
    return parse_playbook(_read_capped(str(p)), str(p))


# --------------------------------------------------------------------------- validation


def parse_playbook(data: bytes | str, path: str, builtin: bool = False) -> Playbook:
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PlaybookError(path, "(toml)", f"not valid TOML: {exc}") from None
    v = _Validator(path)
    v.unknown_keys(doc, _TOP_KEYS, "")
    pid = v.string(doc, "id", required=True)
    if not _ID_RE.match(pid):
        raise PlaybookError(path, "id", f"{pid!r} is not kebab-case (a-z, 0-9 and single dashes)")
    title = v.string(doc, "title", required=True)
    summary = v.string(doc, "summary", default="")
    kind = v.string(doc, "kind", default="failure")
    if kind not in KINDS:
        raise PlaybookError(path, "kind", f"{kind!r} is not one of: {', '.join(KINDS)}")

    raw_signals = doc.get("signals", [])
    if not isinstance(raw_signals, list) or not all(isinstance(s, dict) for s in raw_signals):
        raise PlaybookError(path, "signals", "must be an array of tables ([[signals]])")
    if not raw_signals and kind == "failure":
        raise PlaybookError(path, "signals", "at least one [[signals]] table is required")
    if raw_signals and kind == "advice":
        raise PlaybookError(path, "signals", "an advice playbook is found by code, not matched: no [[signals]]")
    signals = tuple(v.signal(s, i) for i, s in enumerate(raw_signals))

    thresholds = v.thresholds(doc.get("thresholds", {}))
    evidence = v.str_table(doc.get("evidence", {}), "evidence")
    remediation, variants = v.remediation(doc.get("remediation", ""))

    raw_hints = doc.get("hints", [])
    if not isinstance(raw_hints, list) or not all(isinstance(h, dict) for h in raw_hints):
        raise PlaybookError(path, "hints", "must be an array of tables ([[hints]])")
    hints = tuple(v.hint(h, i) for i, h in enumerate(raw_hints))

    refs = doc.get("references", [])
    if not isinstance(refs, list) or not all(isinstance(r, str) for r in refs):
        raise PlaybookError(path, "references", "must be an array of strings (URLs)")

    return Playbook(
        id=pid,
        title=title,
        summary=summary.strip(),
        signals=signals,
        thresholds=types.MappingProxyType(thresholds),
        evidence=types.MappingProxyType(evidence),
        remediation=remediation.strip(),
        variants=types.MappingProxyType({k: t.strip() for k, t in variants.items()}),
        hints=hints,
        references=tuple(refs),
        source=path,
        builtin=builtin,
        kind=kind,
    )


_SIGNAL_KEYS = {
    "name",
    "confidence",
    "description",
    "exception_type",
    "exception_text",
    "errno",
    "not_errno",
    "from_loader",
    "frame",
    "frame_function",
    "frame_filename",
    "role",
    "classification",
    "signal",
    "fd_at_limit",
    "facts",
    "not_facts",
}
_SIGNAL_CONDITIONS = _SIGNAL_KEYS - {"name", "confidence", "description", "role"}
_HINT_KEYS = {"name", "text", "frame", "waiting_in", "frame_function", "frame_filename", "role", "native"}
_FACT_NAME = re.compile(r"[a-z][a-z0-9_]{0,63}")  # a fact a failure module names (registry.Failure.facts)


class _Validator:
    def __init__(self, path: str) -> None:
        self.path = path

    def fail(self, field: str, problem: str) -> PlaybookError:
        return PlaybookError(self.path, field, problem)

    def unknown_keys(self, table: Mapping[str, Any], allowed: Iterable[str], prefix: str) -> None:
        allowed = set(allowed)
        for key in table:
            if key not in allowed:
                raise self.fail(f"{prefix}{key}", f"unknown key (expected one of: {', '.join(sorted(allowed))})")

    def string(
        self, table: Mapping[str, Any], key: str, prefix: str = "", required: bool = False, default: str = ""
    ) -> str:
        if key not in table:
            if required:
                raise self.fail(f"{prefix}{key}", "missing (required)")
            return default
        value = table[key]
        if not isinstance(value, str):
            raise self.fail(f"{prefix}{key}", f"must be a string, not {type(value).__name__}")
        if required and not value.strip():
            raise self.fail(f"{prefix}{key}", "must not be empty")
        return value

    def regex(self, table: Mapping[str, Any], key: str, prefix: str) -> _regex.Pattern | None:
        if key not in table:
            return None
        value = self.string(table, key, prefix)
        try:
            return _regex.compile(value)  # RE2: linear time on any text (see dlwatch._regex)
        except _regex.RegexError as exc:
            raise self.fail(f"{prefix}{key}", f"bad regular expression {value!r}: {exc}") from None

    def ints(self, table: Mapping[str, Any], key: str, prefix: str) -> tuple[int, ...]:
        if key not in table:
            return ()
        value = table[key]
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(x, int) and not isinstance(x, bool) for x in items):
            raise self.fail(f"{prefix}{key}", "must be an integer or an array of integers")
        return tuple(items)

    def strings(self, table: Mapping[str, Any], key: str, prefix: str) -> tuple[str, ...]:
        if key not in table:
            return ()
        value = table[key]
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(x, str) for x in items):
            raise self.fail(f"{prefix}{key}", "must be a string or an array of strings")
        return tuple(items)

    def fact_names(self, table: Mapping[str, Any], key: str, prefix: str) -> tuple[str, ...]:
        names = self.strings(table, key, prefix)
        for name in names:
            if not _FACT_NAME.fullmatch(name):
                raise self.fail(f"{prefix}{key}", f"{name!r} is not a fact name (lower case, digits and _)")
        return names

    def boolean(self, table: Mapping[str, Any], key: str, prefix: str) -> bool | None:
        if key not in table:
            return None
        value = table[key]
        if not isinstance(value, bool):
            raise self.fail(f"{prefix}{key}", f"must be true or false, not {type(value).__name__}")
        return value

    def role(self, table: Mapping[str, Any], prefix: str) -> str:
        role = self.string(table, "role", prefix, default="any")
        if role not in ROLES:
            raise self.fail(f"{prefix}role", f"{role!r} is not one of {', '.join(ROLES)}")
        return role

    def signal(self, table: Mapping[str, Any], index: int) -> Signal:
        prefix = f"signals[{index}]."
        self.unknown_keys(table, _SIGNAL_KEYS, prefix)
        positive = [
            k
            for k in _SIGNAL_CONDITIONS
            if k in table and k not in ("not_errno", "not_facts") and not (k == "fd_at_limit" and table[k] is False)
        ]
        if not positive:  # a signal made only of negations would match every healthy run
            raise self.fail(
                f"signals[{index}]",
                "has no positive condition (give at least one of: "
                + ", ".join(sorted(_SIGNAL_CONDITIONS - {"not_errno", "not_facts"}))
                + ")",
            )
        if "confidence" not in table:
            raise self.fail(f"{prefix}confidence", "missing (required, a number in 0..1)")
        conf = table["confidence"]
        if isinstance(conf, bool) or not isinstance(conf, (int, float)):
            raise self.fail(f"{prefix}confidence", f"must be a number, not {type(conf).__name__}")
        if not 0.0 <= float(conf) <= 1.0:
            raise self.fail(f"{prefix}confidence", f"{conf} is outside 0..1")
        name = self.string(table, "name", prefix, default=f"signal-{index}")
        sig = self.string(table, "signal", prefix) if "signal" in table else None
        return Signal(
            name=name,
            confidence=float(conf),
            description=self.string(table, "description", prefix),
            exception_type=self.regex(table, "exception_type", prefix),
            exception_text=self.regex(table, "exception_text", prefix),
            errno=self.ints(table, "errno", prefix),
            not_errno=self.ints(table, "not_errno", prefix),
            from_loader=self.boolean(table, "from_loader", prefix),
            frame=self.regex(table, "frame", prefix),
            frame_function=self.regex(table, "frame_function", prefix),
            frame_filename=self.regex(table, "frame_filename", prefix),
            role=self.role(table, prefix),
            classification=self.strings(table, "classification", prefix),
            signal=sig,
            fd_at_limit=self.boolean(table, "fd_at_limit", prefix),
            facts=self.fact_names(table, "facts", prefix),
            not_facts=self.fact_names(table, "not_facts", prefix),
        )

    def hint(self, table: Mapping[str, Any], index: int) -> Hint:
        prefix = f"hints[{index}]."
        self.unknown_keys(table, _HINT_KEYS, prefix)
        hint = Hint(
            name=self.string(table, "name", prefix, required=True),
            text=self.string(table, "text", prefix, default="").strip(),
            frame=self.regex(table, "frame", prefix),
            waiting_in=self.regex(table, "waiting_in", prefix),
            frame_function=self.regex(table, "frame_function", prefix),
            frame_filename=self.regex(table, "frame_filename", prefix),
            role=self.role(table, prefix),
            native=self.boolean(table, "native", prefix),
        )
        if (
            hint.frame is None
            and hint.frame_function is None
            and hint.frame_filename is None
            and hint.waiting_in is None
        ):
            raise self.fail(f"hints[{index}]", "needs frame, frame_function, frame_filename or waiting_in")
        return hint

    def thresholds(self, table: Any) -> dict[str, float]:
        if not isinstance(table, dict):
            raise self.fail("thresholds", "must be a table of numbers")
        out = {}
        for key, value in table.items():
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise self.fail(f"thresholds.{key}", f"must be a number, not {type(value).__name__}")
            out[key] = value
        return out

    def str_table(self, table: Any, field: str) -> dict[str, str]:
        if not isinstance(table, dict):
            raise self.fail(field, "must be a table of strings")
        for key, value in table.items():
            if not isinstance(value, str):
                raise self.fail(f"{field}.{key}", f"must be a string, not {type(value).__name__}")
        return dict(table)

    def remediation(self, value: Any) -> tuple[str, dict[str, str]]:
        if isinstance(value, str):
            return value, {}
        if not isinstance(value, dict):
            raise self.fail("remediation", "must be a string or a table with text and variants")
        self.unknown_keys(value, _REMEDIATION_KEYS, "remediation.")
        text = self.string(value, "text", "remediation.")
        variants = self.str_table(value.get("variants", {}), "remediation.variants")
        return text, variants
