"""The incident report and the run summary as typed, frozen values (schema_version 1 on disk).

What report.json and summary.json hold is documented in docs/report-schema.md; that layout is the
contract (keys are only ever added).  These classes are the same documents with the structure the
renderers walk typed: an :class:`Incident` has :class:`Finding`, :class:`ProcessEntry`,
:class:`Stack`, :class:`Thread` and :class:`Frame` values, not dicts to check at every step.

Byte compatibility is by construction: every document remembers its keys in order (``keys``) and
whatever it holds that this version does not name (``extra``), so ``from_dict(d).to_dict() == d``
with the same key order for every document the loaders accept (tests/test_schema.py), and a
report built here is laid out exactly as the dict-based assembly laid it out
(tests/test_schema_golden.py).  Measured values (a process's sample, the system, the timeline,
a finding's evidence, a loader's settings) stay plain JSON values: they are the collectors' and
detectors' records, passed through.

``from_dict`` takes a document already checked by :mod:`dlwatch.report.store` (its
``_TOP_TYPES``/``_ITEM_TYPES``/``_SUMMARY_TYPES``): the typed fields hold what those checks allow
(a field the checks leave open is typed ``Any``).  :func:`incident` and :func:`run_summary` check
and convert in one step, for a document that did not come through a loader.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping, Sequence, TypeVar

D = TypeVar("D", bound="Doc")

_NESTED = "nested"  # field metadata: the value is one document of this class (or None)
_ITEMS = "items"  # field metadata: the value is a list of documents of this class (or None)
_TUPLE = "tuple"  # field metadata: a list of plain values, held as a tuple
_OPTIONAL = "optional"  # field metadata: a key present only when set (added after the first layout)


def nested(cls: type, *, is_optional: bool = False) -> Any:
    return field(default=None, metadata={_NESTED: cls, _OPTIONAL: is_optional})


def items(cls: type) -> Any:
    return field(default=None, metadata={_ITEMS: cls})


def plain_tuple() -> Any:
    return field(default=None, metadata={_TUPLE: True})


def optional(default: Any = None) -> Any:
    return field(default=default, metadata={_OPTIONAL: True})


@dataclass(frozen=True, kw_only=True)
class Doc:
    """A JSON object with typed fields, its key order and the keys this version does not name.

    ``keys``: the keys present, in document order (a built document: every field but the
    optional ones left unset, in declaration order, then those set later, in the order set,
    as a dict's insertion order would have them).  ``extra``: keys no field names, kept as
    they were (a newer writer's additions within the schema version).
    """

    keys: tuple[str, ...] = field(default=None, repr=False)  # type: ignore[arg-type]  # None: set in __post_init__
    extra: Mapping[str, Any] = field(default_factory=dict, repr=False)

    _fields: ClassVar[dict[type, dict[str, dataclasses.Field[Any]]]] = {}

    def __post_init__(self) -> None:
        if self.keys is None:  # built, not read: an empty object read stays empty
            keys = tuple(
                f.name
                for f in _doc_fields(type(self)).values()
                if not f.metadata.get(_OPTIONAL) or getattr(self, f.name) is not None
            )
            object.__setattr__(self, "keys", keys + tuple(k for k in self.extra if k not in keys))

    @classmethod
    def from_dict(cls: type[D], data: Mapping[str, Any]) -> D:
        """The typed view of ``data`` (checked by the loader's type checks)."""
        fields = _doc_fields(cls)
        kw: dict[str, Any] = {}
        extra: dict[str, Any] = {}
        for key, value in data.items():
            f = fields.get(key)
            if f is None:
                extra[key] = value
            else:
                kw[key] = _load(f, value)
        return cls(keys=tuple(data), extra=extra, **kw)

    def to_dict(self) -> dict[str, Any]:
        """The JSON object: the same keys in the same order as it was read or built."""
        fields = _doc_fields(type(self))
        return {k: _dump(getattr(self, k)) if k in fields else self.extra[k] for k in self.keys}

    def replace(self: D, **changes: Any) -> D:
        """A copy with ``changes``; a key it did not have comes last, as a dict assignment would put it."""
        fields = _doc_fields(type(self))
        extra = dict(self.extra)
        known = {}
        for k, v in changes.items():
            if k in fields:
                known[k] = v
            else:
                extra[k] = v
        keys = self.keys + tuple(k for k in changes if k not in self.keys)
        return dataclasses.replace(self, keys=keys, extra=extra, **known)

    def __bool__(self) -> bool:
        """False for an empty object, as for the dict it stands for (``if report.exception:``)."""
        return bool(self.keys)

    def has(self, key: str) -> bool:
        """Whether the document holds ``key`` (a null value counts; an absent optional key does not)."""
        return key in self.keys


def _doc_fields(cls: type) -> dict[str, dataclasses.Field[Any]]:
    cached = Doc._fields.get(cls)
    if cached is None:
        cached = {f.name: f for f in dataclasses.fields(cls) if f.name not in ("keys", "extra")}
        Doc._fields[cls] = cached
    return cached


def _load(f: dataclasses.Field[Any], value: Any) -> Any:
    meta = f.metadata
    if value is None:
        return None
    if _NESTED in meta and isinstance(value, Mapping):
        return meta[_NESTED].from_dict(value)
    if _ITEMS in meta and isinstance(value, list) and all(isinstance(v, Mapping) for v in value):
        return tuple(meta[_ITEMS].from_dict(v) for v in value)
    if _TUPLE in meta and isinstance(value, list):
        return tuple(value)
    return value  # a value the checks leave open stays as it was read


def _dump(value: Any) -> Any:
    if isinstance(value, Doc):
        return value.to_dict()
    if isinstance(value, tuple):
        return [_dump(v) for v in value]
    return value


# --------------------------------------------------------------------------- report.json


@dataclass(frozen=True, kw_only=True)
class Frame(Doc):
    function: str | None = None
    filename: str | None = None
    line: int | None = None
    native: Any = None


@dataclass(frozen=True, kw_only=True)
class Thread(Doc):
    thread_id: Any = None
    name: str | None = None
    native_tid: Any = None
    active: Any = None
    owns_gil: Any = None
    frames: tuple[Frame, ...] | None = items(Frame)
    frames_omitted: Any = None  # frames left out of the middle (an int in what dlwatch writes)
    frames_omitted_after: Any = None


@dataclass(frozen=True, kw_only=True)
class Stack(Doc):
    """A process's StackDump (dlwatch/collect/stacks.py) as report.json holds it."""

    pid: Any = None
    source: str | None = None
    threads: tuple[Thread, ...] | None = items(Thread)
    error: str | None = None
    duration_s: Any = None
    threads_omitted: Any = None
    cut_at_bytes: Any = None
    memory_cut_bytes: Any = optional()  # py-spy reached its memory limit (collect.bounds) and was stopped
    not_run: Any = optional()  # true: py-spy never ran for it (the dumps' time was spent first)

    def main_first(self) -> list[Thread]:
        return sorted(self.threads or (), key=lambda t: t.name != "MainThread")


@dataclass(frozen=True, kw_only=True)
class ProcessEntry(Doc):
    """One of ``processes[]``: who the process is, its last sample, and on a stall its verdict and stack."""

    pid: int | None = None
    role: str | None = None
    worker_id: int | None = None
    start_method: Any = None
    name: Any = None
    cmdline: Any = None
    sample: Mapping[str, Any] | None = None  # the last ProcSample, compacted (collect/procfs.py)
    status: str | None = None
    waiting_in: str | None = None
    cpu_progress_s: Any = None
    stack: Stack | None = nested(Stack)
    where: str | None = optional()
    alive_by: Any = optional()
    io_wait: Any = optional()
    crash: Any = optional()

    @property
    def fds(self) -> Mapping[str, Any] | None:
        """The sample's open descriptors by kind (checked an object or null by the loader)."""
        fds = self.sample.get("fds") if isinstance(self.sample, Mapping) else None
        return fds if isinstance(fds, Mapping) else None


@dataclass(frozen=True, kw_only=True)
class Finding(Doc):
    """A matched playbook: one of an incident's ``findings[]``, a summary's ``advice[]`` or ``preflight[]``."""

    playbook: str | None = None
    title: str | None = None
    confidence: float | int | None = None
    evidence: Mapping[str, Any] | None = None
    remediation: str | None = None


@dataclass(frozen=True, kw_only=True)
class ExceptionInfo(Doc):
    """The exception that left the watched block (``exception``)."""

    type: str | None = None
    message: str | None = None
    errno: int | None = None
    traceback: str | None = None
    from_loader: Any = None


@dataclass(frozen=True, kw_only=True)
class Rank(Doc):
    """``rank``: where the process sits in a multi-rank job (dlwatch/wire/job.py)."""

    rank: int | None = None
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: Any = None
    job_id: str | None = None
    job_id_source: Any = None
    launched_at: Any = optional()  # a rank of a job: when its run was launched (dlwatch/wire/job.py)
    run_id: Any = optional()  # a rank of a job: torchrun's run id, when it is not the job id


@dataclass(frozen=True, kw_only=True)
class Job(Doc):
    """``job``, present only in a rank of a multi-rank job (dlwatch/report/jobview.py)."""

    role: str | None = None
    waiting_in: str | None = None
    job_id: str | None = None
    view: str | None = None


@dataclass(frozen=True, kw_only=True)
class Incident(Doc):
    """report.json.  Fields in documented order; the optional ones are written only when set."""

    schema_version: int = 1
    id: str = ""
    created_at: str = ""
    dlwatch_version: Any = None
    host: str | None = None
    pid: int = 0
    rank: Rank | None = nested(Rank)
    trigger: str = ""
    summary: str | None = ""
    classification: str | None = None
    loader: Mapping[str, Any] | None = None
    progress: Mapping[str, Any] | None = None
    exception: ExceptionInfo | None = nested(ExceptionInfo)
    findings: tuple[Finding, ...] | None = items(Finding)
    processes: tuple[ProcessEntry, ...] | None = items(ProcessEntry)
    system: Mapping[str, Any] | None = None
    gpus: Sequence[Mapping[str, Any]] | None = None
    events: Sequence[Any] | None = None
    timeline: Sequence[Any] | None = None
    notes: tuple[str, ...] | None = plain_tuple()
    config: Mapping[str, Any] | None = None
    classification_reason: str | None = optional()
    exit_cause: Any = optional()
    job: Job | None = nested(Job, is_optional=True)
    truncated: Any = optional()

    def with_notes(self, *notes: str) -> Incident:
        """A copy with ``notes`` added at the end."""
        return self.replace(notes=tuple(self.notes or ()) + notes)

    def top_finding(self) -> Finding | None:
        return self.findings[0] if self.findings else None


# --------------------------------------------------------------------------- summary.json


@dataclass(frozen=True, kw_only=True)
class RunSummary(Doc):
    """runs/<run-id>/summary.json (summary schema_version 1).

    ``loop``, ``workers``, ``peaks``, ``cpus`` and ``main`` are the run's figures as
    dlwatch/collect/runstats.py computes them; the loader checks only that they are objects and
    lists, so they stay plain values (the renderers read them with defaults).
    """

    schema_version: int = 1
    kind: str = "run_summary"
    id: str = ""
    created_at: str | None = None
    started_at: Any = None
    dlwatch_version: Any = None
    host: Any = None
    pid: Any = None
    rank: Any = None
    ended: Any = "clean"  # clean, exception, interrupted, vanished
    loader: Any = None
    cpus: Any = None
    accelerator: Any = None
    loop: Mapping[str, Any] | None = None
    workers: Sequence[Any] | None = None
    main: Any = None
    peaks: Mapping[str, Any] | None = None
    advice: tuple[Finding, ...] | None = items(Finding)
    preflight: tuple[Finding, ...] | None = items(Finding)
    incidents: Sequence[Any] | None = None
    notes: Sequence[Any] | None = None


# --------------------------------------------------------------------------- checked conversion

# What a loader accepts (load_report, load_summary in dlwatch/report/store.py): the types the
# renderers index into, by key.  A document whose fields have other types is damaged.  These
# checks decide what the typed fields above may hold; they are as old as schema 1 and never
# tightened (reports of older dlwatch, and damaged ones, load as they always did).

_OPT_STR = (str, type(None))
_OPT_DICT = (dict, type(None))
_OPT_INT = (int, type(None))
_OPT_NUM = (int, float, type(None))
# What the renderers index into, by key: a report whose fields have other types is damaged.
_TOP_TYPES: dict[str, Any] = {
    "id": str,
    "created_at": str,
    "trigger": str,
    "pid": int,
    "summary": _OPT_STR,
    "host": _OPT_STR,
    "classification": _OPT_STR,
    "classification_reason": _OPT_STR,
    "rank": _OPT_DICT,
    "progress": _OPT_DICT,
    "exception": _OPT_DICT,
    "findings": (list, type(None)),
    "processes": (list, type(None)),
    "system": _OPT_DICT,
    "gpus": (list, type(None)),
    "loader": _OPT_DICT,
    "notes": (list, type(None)),
    "timeline": (list, type(None)),
    "events": (list, type(None)),
    "config": _OPT_DICT,
    "job": _OPT_DICT,
    "related": (list, type(None)),  # earlier incidents of the same failure in the run (see docs/report-schema.md)
}
_ITEM_TYPES: dict[str, dict[str, Any]] = {
    "exception": {"type": _OPT_STR, "message": _OPT_STR, "traceback": _OPT_STR, "errno": _OPT_INT},
    "findings[]": {
        "playbook": _OPT_STR,
        "title": _OPT_STR,
        "confidence": _OPT_NUM,
        "evidence": _OPT_DICT,
        "remediation": _OPT_STR,
    },
    "processes[]": {
        "pid": _OPT_INT,
        "role": _OPT_STR,
        "worker_id": _OPT_INT,
        "status": _OPT_STR,
        "waiting_in": _OPT_STR,
        "where": _OPT_STR,
        "sample": _OPT_DICT,
        "stack": _OPT_DICT,
    },
    "processes[].sample": {"fds": _OPT_DICT},
    "processes[].stack": {"threads": (list, type(None)), "error": _OPT_STR, "source": _OPT_STR},
    "processes[].stack.threads[]": {"frames": (list, type(None)), "name": _OPT_STR},
    "processes[].stack.threads[].frames[]": {"function": _OPT_STR, "filename": _OPT_STR, "line": _OPT_INT},
    "gpus[]": {},
    "progress": {},
    "system": {},
    "loader": {},
    "rank": {"rank": _OPT_INT, "local_rank": _OPT_INT, "world_size": _OPT_INT, "job_id": _OPT_STR},
    "job": {"role": _OPT_STR, "waiting_in": _OPT_STR, "job_id": _OPT_STR, "view": _OPT_STR},
}


def _type_problem(data: dict[str, Any]) -> str | None:
    """The first field of ``data`` whose type the renderers cannot take, or None."""
    for key, types in _TOP_TYPES.items():
        if key in data and not isinstance(data[key], types) or isinstance(data.get(key), bool) and key == "pid":
            return f"{key} is {type(data[key]).__name__}"
    # (where, value, may it be None): an object field may be null, a list item may not
    todo: list[tuple[str, Any, bool]] = [
        (k, data.get(k), True) for k in ("exception", "rank", "progress", "system", "loader", "job")
    ]
    todo += [(f"{k}[]", item, False) for k in ("findings", "processes", "gpus") for item in data.get(k) or ()]
    if any(not isinstance(n, str) for n in data.get("notes") or ()):
        return "notes[] holds a non-string"
    while todo:
        where, value, optional = todo.pop()
        if value is None and optional:
            continue
        if not isinstance(value, dict):
            return f"{where} is {type(value).__name__}, not an object"
        for key, types in _ITEM_TYPES.get(where, {}).items():
            if key in value and not isinstance(value[key], types):
                return f"{where}.{key} is {type(value[key]).__name__}"
            child = f"{where}.{key}"
            if child in _ITEM_TYPES:
                todo.append((child, value.get(key), True))
            elif f"{child}[]" in _ITEM_TYPES:
                todo += [(f"{child}[]", item, False) for item in value.get(key) or ()]
    return None


_SUMMARY_TYPES: dict[str, Any] = {
    "id": str,
    "created_at": str,
    "loop": _OPT_DICT,
    "peaks": _OPT_DICT,
    "advice": (list, type(None)),
    "preflight": (list, type(None)),
    "incidents": (list, type(None)),
    "notes": (list, type(None)),
    "workers": (list, type(None)),
}


def summary_type_problem(data: Mapping[str, Any]) -> str | None:
    """The first field of a run summary whose type the renderers cannot take, or None."""
    for key, types in _SUMMARY_TYPES.items():
        if key in data and not isinstance(data[key], types):
            return f"{key} is {type(data[key]).__name__}"
    for key in ("advice", "preflight"):
        if any(not isinstance(f, dict) for f in data.get(key) or ()):
            return f"{key}[] holds a non-object"
    return None


def incident(data: Incident | Mapping[str, Any]) -> Incident:
    """``data`` as an :class:`Incident`: checked with the loader's type checks when it is a dict
    (ReportError naming the first bad field otherwise)."""
    if isinstance(data, Incident):
        return data
    from dlwatch.errors import ReportError

    problem = _type_problem(dict(data))
    if problem:
        raise ReportError(f"the report is damaged: {problem}")
    return Incident.from_dict(data)


def run_summary(data: RunSummary | Mapping[str, Any]) -> RunSummary:
    """``data`` as a :class:`RunSummary`, checked like :func:`incident`."""
    if isinstance(data, RunSummary):
        return data
    from dlwatch.errors import ReportError

    problem = summary_type_problem(data)
    if problem:
        raise ReportError(f"the run summary is damaged: {problem}")
    return RunSummary.from_dict(data)
