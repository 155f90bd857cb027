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

``sample_line`` goes one step further for the monitor's every poll: the line's bytes straight
from the samples, no record in between.  A sample whose fields are all None, numbers, bools or
text is written through a %-template made once per shape (which fields are None, each one's
type) and kept; its text fields are JSON-escaped once per distinct string (redacted first,
cached).  Any other shape (an fd breakdown, an unexpected type, a field name redaction would
touch) is written the ``sample_record`` way for that one sample.  The line is
``encode(sample_record(...))`` byte for byte (the same tests compare the two), and
``json.loads`` of it is the record, which is what the monitor's ring keeps until an incident
needs it.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
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


def _plain_role(role: Any) -> bool:
    """A role written as it is (redacted text), not through the careful path."""
    return type(role) is str and _key_is_plain("role")


def _proc_entry(s: ProcSample, role: Any) -> dict[str, Any]:
    """One process's entry of a record: its sample's fields, then its role."""
    entry = _dataclass(s)
    if _plain_role(role):
        entry["role"] = outbound_text(role)
    else:
        entry.update(_careful((("role", role),)))
    return entry


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
    record["procs"] = [_proc_entry(s, role) for s, role in procs]
    if system is not None:
        record["system"] = _dataclass(system)
    record["gpus"] = [_dataclass(g) for g in gpus]
    return record


def encode(record: Mapping[str, Any]) -> bytes:
    """The timeline line of a record from ``sample_record`` (redacted already): ``_fs.json_line``'s bytes."""
    return (json.dumps(record) + "\n").encode("utf-8", "surrogateescape")


# --------------------------------------------------------------------------- the line, written directly

_NONE = type(None)
_BOOL_TEXT = {True: "true", False: "false"}
_ESCAPED: dict[str, str] = {}  # raw text -> its redacted JSON string (names, states, wchans: the same every poll)
_SHAPES: dict[tuple[type, tuple[type, ...]], Any] = {}  # (class, field types) -> _Shape, or False (general path)
_MAX_SHAPES = 512


def _text(v: str) -> str:
    hit = _ESCAPED.get(v)
    if hit is None:
        hit = json.dumps(outbound_text(v))
        if len(v) <= 256:
            if len(_ESCAPED) >= 4096:
                _ESCAPED.clear()
            _ESCAPED[v] = hit
    return hit


def _float(v: float) -> str:
    """json's text of a float: repr, and NaN / Infinity / -Infinity as ``json.dumps`` writes them."""
    if v - v == 0.0:
        return float.__repr__(v)
    return "NaN" if v != v else ("Infinity" if v > 0 else "-Infinity")


def _bool(v: bool) -> str:
    return _BOOL_TEXT[v]


_CONVERT: dict[type, Callable[[Any], str] | None] = {int: None, float: _float, bool: _bool, str: _text}


class _Shape:
    """One dataclass's fields with one pattern of None and types: a template and what each value needs."""

    __slots__ = ("template", "convert", "keep")

    def __init__(self, names: Sequence[str], types: Sequence[type]) -> None:
        parts = [f"{json.dumps(n)}: %s" for n, t in zip(names, types) if t is not _NONE]
        self.template = "{" + ", ".join(parts)  # the caller closes it (a role may follow)
        self.convert = tuple((i, c) for i, t in enumerate(types) if t is not _NONE and (c := _CONVERT[t]) is not None)
        self.keep = tuple(t is not _NONE for t in types)


def _shape(obj: Any) -> tuple[_Shape | None, tuple[Any, ...]]:
    names, getter, plain_keys = _class(type(obj))
    values = getter(obj)
    key = (type(obj), tuple(map(type, values)))
    shape = _SHAPES.get(key)
    if shape is None:
        ok = plain_keys and all(t is _NONE or t in _CONVERT for t in key[1])
        shape = _Shape(names, key[1]) if ok else False
        if len(_SHAPES) >= _MAX_SHAPES:
            _SHAPES.clear()
        _SHAPES[key] = shape
    return (shape or None), values


def _object_text(obj: Any, role: Any = None) -> str:
    """The JSON text of ``_dataclass(obj)``, and ``"role"`` after its fields when one is given."""
    shape, values = _shape(obj)
    if shape is None or not (role is None or _plain_role(role)):  # the record's way, for this one
        return json.dumps(_dataclass(obj) if role is None else _proc_entry(obj, role))
    if shape.convert:
        values = list(values)  # type: ignore[assignment]
        for i, c in shape.convert:
            values[i] = c(values[i])  # type: ignore[index]
    text = shape.template % tuple(itertools.compress(values, shape.keep))
    if role is None:
        return text + "}"
    return f'{text}{", " if len(text) > 1 else ""}"role": {_text(role)}}}'


_MAP_SHAPES: dict[tuple[tuple[Any, ...], tuple[type, ...]], Any] = {}  # (keys, value types) -> _Shape, or False


def _mapping_text(mapping: Mapping[str, Any]) -> str:
    """``json.dumps(_careful(mapping.items()))`` (the heartbeat's dict, every poll) through a template per
    shape: its keys in order and each value's type, when every key is a plain identifier and every value
    None, a number, a bool or text; any other mapping the record's way."""
    keys = tuple(mapping)
    values = tuple(mapping.values())
    key = (keys, tuple(map(type, values)))
    shape = _MAP_SHAPES.get(key)
    if shape is None:
        ok = all(type(k) is str and k.isidentifier() and _key_is_plain(k) for k in keys) and all(
            t is _NONE or t in _CONVERT for t in key[1]
        )
        shape = _Shape(keys, key[1]) if ok else False
        if len(_MAP_SHAPES) >= _MAX_SHAPES:
            _MAP_SHAPES.clear()
        _MAP_SHAPES[key] = shape
    if not shape:
        return json.dumps(_careful(mapping.items()))
    if shape.convert:
        values = list(values)  # type: ignore[assignment]
        for i, c in shape.convert:
            values[i] = c(values[i])  # type: ignore[index]
    return shape.template % tuple(itertools.compress(values, shape.keep)) + "}"


# pid -> its last line's parts: (its values after ts, its role, its text after ts)
_SAME: dict[int, tuple[tuple[Any, ...], str, str]] = {}
_MAX_SAME = 4096


def _zeros(values: tuple[Any, ...]) -> tuple[tuple[int, float], ...]:
    """Where the float zeros are, and each one's sign (``0.0 == -0.0``, but they print apart)."""
    return tuple((i, math.copysign(1.0, v)) for i, v in enumerate(values) if type(v) is float and v == 0.0)


def _print_alike(a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
    """Equal values that print alike: the same types (``1 == 1.0 == True`` print apart) and float zeros
    of the same signs.  Asked only of values found equal (rarely: an unchanged process's are the same
    objects), so a process that changed pays nothing for it."""
    return tuple(map(type, a)) == tuple(map(type, b)) and _zeros(a) == _zeros(b)


def _proc_text(s: ProcSample, role: Any) -> str:
    """``_object_text(s, role)``; for a process whose every field but ``ts`` is what it was at the last
    poll (an idle worker: the same state, CPU, memory, wait), its last text after ``ts`` is kept.

    Kept only where that is exact: the same values *and* types (``1 == 1.0 == True`` print apart), each
    float zero of the same sign (``0.0 == -0.0``; an idle worker's CPU time is often ``0.0``), the same
    role, and a text that begins with the ``pid`` and ``ts`` it was made from.  Text fields are redacted
    the same way every time (as ``_text`` keeps).  The same objects as at the last poll (what the
    monitor's kept /proc files hand back for a process whose files read the same) are all of that at once."""
    if type(s) is not ProcSample or type(role) is not str:
        return _object_text(s, role)
    values = _class(ProcSample)[1](s)
    pid, ts = values[0], values[1]
    if type(pid) is not int or type(ts) is not float:
        return _object_text(s, role)
    rest = values[2:]
    head = f'{{"pid": {pid}, "ts": {_float(ts)}'
    hit = _SAME.get(pid)
    if (
        hit is not None
        and hit[1] == role
        and (
            all(map(operator.is_, hit[0], rest))  # the very values (procfs.read_proc, kept files): nothing to compare
            or (hit[0] == rest and _print_alike(hit[0], rest))
        )
    ):
        return head + hit[2]
    text = _object_text(s, role)
    if text.startswith(head):
        if len(_SAME) >= _MAX_SAME:
            _SAME.clear()
        _SAME[pid] = (rest, role, text[len(head) :])
    return text


def heartbeat_text(heartbeat: Mapping[str, Any]) -> str:
    """The JSON text ``sample_line`` writes for ``heartbeat`` (``Heartbeat.to_dict()``): a caller that
    polls an unchanged heartbeat again may keep it and hand it back (``sample_line(heartbeat_text=)``)."""
    return _mapping_text(heartbeat)


def sample_line(
    ts: float,
    heartbeat: Mapping[str, Any] | None,
    procs: Sequence[tuple[ProcSample, str]],
    system: SystemSample | None,
    gpus: Sequence[GpuSample],
    *,
    heartbeat_text: str | None = None,
) -> bytes:
    """``encode(sample_record(ts, heartbeat, procs, system, gpus))``, written without the record.

    ``heartbeat_text``: ``heartbeat_text(heartbeat)``, made earlier for this same heartbeat (the monitor keeps
    it while the heartbeat does not change): written as it is."""
    out = ['{"kind": "sample", "ts": ', _float(ts) if type(ts) is float else json.dumps(ts)]
    if heartbeat_text is not None:
        out += [', "heartbeat": ', heartbeat_text]
    elif heartbeat is not None:
        out += [', "heartbeat": ', _mapping_text(heartbeat)]
    out.append(', "procs": [')
    out.append(", ".join([_proc_text(s, role) for s, role in procs]))
    out.append("]")
    if system is not None:
        out += [', "system": ', _object_text(system)]
    out += [', "gpus": [', ", ".join([_object_text(g) for g in gpus]), "]}\n"]
    return "".join(out).encode("utf-8", "surrogateescape")
