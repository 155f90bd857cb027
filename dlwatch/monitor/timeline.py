"""The monitor's sample record (one a poll, for timeline.jsonl and the incident ring), built in one walk.

The general path for anything written (``to_dict`` -> ``build.compact`` -> ``redact.outbound`` ->
``json.dumps``) walks a record three times in Python; with one sample per watched process per
poll that was most of what a poll cost beyond reading /proc.  Here each sample's fields are
visited once, and each value gets what its type needs:

- ``None`` is left out (what ``build.compact`` does);
- ``bool``, ``int`` and ``float`` are kept as they are: numbers cannot carry user text;
- every ``str`` (a process name, a wchan, a GPU's name) goes through ``redact.outbound_text``;
- anything else (the fd breakdown with its file paths, a value of an unexpected type) and any key
  that redaction would touch take the general path, for that one value.

The record is the one the general path makes, key for key and byte for byte once encoded
(``tests/test_timeline_record.py`` compares the two on samples of a real watched job and on
hostile ones).  Its strings are already redacted, so the ring copied into an incident holds no
more than the file does (the report writer's own redaction leaves redacted text as it is).
"""

from __future__ import annotations

import dataclasses
import json
import operator
from typing import Any, Callable, Iterable, Mapping, Sequence

from dlwatch.model import GpuSample, ProcSample, SystemSample, plain
from dlwatch.redact import is_secret_name, outbound, outbound_text, redact
from dlwatch.report.build import compact

_NUMBERS = frozenset({bool, int, float})
_PLAIN_KEYS: dict[str, bool] = {}  # key -> written as it is (redaction leaves it, it names no secret)
_CLASSES: dict[type, tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]], bool]] = {}


def _key_is_plain(key: Any) -> bool:
    ok = _PLAIN_KEYS.get(key) if type(key) is str else False
    if ok is None:  # field names: a few dozen, each checked once
        ok = _PLAIN_KEYS[key] = redact(key) == key and not is_secret_name(key)
    return ok


def _value(v: Any) -> Any:
    """A value that is not a number (numbers need nothing): text redacted, anything else the general way."""
    return outbound_text(v) if type(v) is str else outbound(compact(plain(v)))


def _careful(items: Iterable[tuple[Any, Any]]) -> dict[str, Any]:
    """Pair by pair, for keys that redaction would change or that name a secret (none of ours do)."""
    out: dict[str, Any] = {}
    for k, v in items:
        if v is None:
            continue
        if _key_is_plain(k):
            out[k] = v if type(v) in _NUMBERS else _value(v)
        else:
            out.update(outbound(compact({k: plain(v)})))
    return out


def _class(cls: type) -> tuple[tuple[str, ...], Callable[[Any], tuple[Any, ...]], bool]:
    """(field names in order, a getter of all their values at once, whether every name is plain)."""
    got = _CLASSES.get(cls)
    if got is None:
        names = tuple(f.name for f in dataclasses.fields(cls))
        getter = operator.attrgetter(*names)
        got = _CLASSES[cls] = (
            names,
            getter if len(names) > 1 else (lambda o, g=getter: (g(o),)),
            all(map(_key_is_plain, names)),
        )
    return got


def _dataclass(obj: Any) -> dict[str, Any]:
    """A sample's fields in field order, as ``to_dict`` + ``compact`` + ``outbound`` leave them."""
    names, getter, plain_keys = _class(type(obj))
    if plain_keys:  # one comprehension; a call only for the few values that are not numbers
        return {k: v if type(v) in _NUMBERS else _value(v) for k, v in zip(names, getter(obj)) if v is not None}
    return _careful(zip(names, getter(obj)))


def sample_record(
    ts: float,
    heartbeat: Mapping[str, Any] | None,
    procs: Sequence[tuple[ProcSample, str]],
    system: SystemSample | None,
    gpus: Sequence[GpuSample],
) -> dict[str, Any]:
    """One poll as the timeline keeps it: compact (no None) and redacted.

    ``heartbeat`` is ``Heartbeat.to_dict()``; ``procs`` pairs each sample with its process's role.
    """
    record: dict[str, Any] = {"kind": "sample", "ts": ts}
    if heartbeat is not None:
        record["heartbeat"] = _careful(heartbeat.items())
    entries = []
    for s, role in procs:
        entry = _dataclass(s)
        if type(role) is str and _key_is_plain("role"):
            entry["role"] = outbound_text(role)
        else:
            entry.update(_careful((("role", role),)))
        entries.append(entry)
    record["procs"] = entries
    if system is not None:
        record["system"] = _dataclass(system)
    record["gpus"] = [_dataclass(g) for g in gpus]
    return record


def encode(record: Mapping[str, Any]) -> bytes:
    """The timeline line of a record from ``sample_record`` (redacted already): ``_fs.json_line``'s bytes."""
    return (json.dumps(record) + "\n").encode("utf-8", "surrogateescape")
