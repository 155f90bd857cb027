"""Events from the training process and its workers to the monitor: an append-only JSONL file.

Every writer (the training loop, each worker, however it was started) opens the
run's ``events.jsonl`` with O_APPEND and writes one line per event with a single
``write``, so lines from different processes never interleave and nothing
depends on the writer staying alive: the monitor reads what was written even
after the training process was killed.
"""

from __future__ import annotations

import json
import math
import os
import stat
import time
from typing import Any, Callable, Iterable, Iterator, Mapping

from dlwatch._fs import json_line, open_private
from dlwatch.wire import contract, interrupt


# events files this process has opened through open_private (checked: a private regular file of
# ours, in a run directory of ours that nobody else can change): later opens need no second check
_checked: set[str] = set()
_APPEND = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC


def _open(path: str) -> int:
    """The events file for one append.  The first open in a process creates or checks it
    (``open_private``); later ones open it plainly (still never through a link): a training process
    whose workers have just forked pays a copy-on-write fault for every page it touches, and the
    check's exception and stat result were a third of an event's cost there."""
    if path in _checked:
        try:
            return os.open(path, _APPEND)
        except OSError:
            _checked.discard(path)
    fd = open_private(path)  # O_APPEND; created O_EXCL, or ours and private, never through a link
    _checked.add(path)
    return fd


def emit(path: str, event: str, **fields: Any) -> bool:
    """Append one event; never raises (dlwatch must not break training). False on failure."""
    record = {"ts": time.time(), "event": event, "pid": os.getpid(), **fields}
    try:
        line = json_line(record)
    except Exception:
        return False
    return append_line(path, line)


def append_line(path: str, line: bytes) -> bool:
    """Append a line already encoded (and redacted) as ``emit`` would have; never raises."""
    try:
        fd = _open(path)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return True
    except Exception:
        return False


INT, FLOAT, INTS = "%d", "%r", "[%s]"  # LineFormat's slots: an int, a finite float, a list of ints
_SLOTS = (INT, FLOAT, INTS)


class LineFormat:
    """One event whose varying fields are numbers, as a %-template of its JSON line.

    For the events the training process sends at every loader iteration, right after its workers
    forked: building, redacting and encoding a record there touched some fifty pages, each a
    copy-on-write fault.  ``fields`` are (name, slot) in the record's order, a slot being INT,
    FLOAT, INTS or a constant (encoded, and redacted, once here).  The template is used only once
    proven here to give ``emit``'s very bytes for a sample; else (and for a value that is not a
    finite number) :meth:`emit` takes ``emit``'s general path.
    """

    def __init__(self, event: str, fields: Iterable[tuple[str, Any]]) -> None:
        self.event = event
        self.fields = tuple(fields)
        self.slots = tuple((name, slot) for name, slot in self.fields if slot in _SLOTS)
        self.template: bytes | None = None
        try:
            parts = [b'{"ts": %r, "event": ', encoded(event).replace(b"%", b"%%"), b', "pid": %d']
            for name, slot in self.fields:
                value = slot.encode() if slot in _SLOTS else encoded(slot).replace(b"%", b"%%")
                parts += [b", ", encoded(name).replace(b"%", b"%%"), b": ", value]
            template = b"".join(parts) + b"}\n"
            sample = {name: 7 if slot == INT else 0.25 if slot == FLOAT else [3, 4] for name, slot in self.fields}
            ts, pid = 1.5, os.getpid()
            if self._format(template, ts, pid, sample) == json_line(self._record(ts, pid, sample)):
                self.template = template
        except Exception:
            self.template = None

    def _record(self, ts: float, pid: int, values: Mapping[str, Any]) -> dict[str, Any]:
        fields = {name: values[name] if slot in _SLOTS else slot for name, slot in self.fields}
        return {"ts": ts, "event": self.event, "pid": pid, **fields}

    def _format(self, template: bytes, ts: float, pid: int, values: Mapping[str, Any]) -> bytes:
        args: list[Any] = [ts, pid]
        for name, slot in self.slots:
            v = values[name]
            if slot is INTS and type(v) is list and all(type(x) is int for x in v):
                args.append(b", ".join(map(b"%d".__mod__, v)))
            elif type(v) is int or (slot is FLOAT and type(v) is float and math.isfinite(v)):
                args.append(v)
            else:  # what json would write otherwise (true, NaN, a float as an int slot) is the general path's
                raise ValueError(name)
        return template % tuple(args)

    def emit(self, path: str, **values: Any) -> bool:
        """``emit(path, event, **fields)``, its constants added; never raises."""
        ts, pid = time.time(), os.getpid()
        if self.template is not None:
            try:
                return append_line(path, self._format(self.template, ts, pid, values))
            except Exception:
                pass
        try:
            return append_line(path, json_line(self._record(ts, pid, values)))
        except Exception:
            return False


_formats: dict[tuple[str, tuple[tuple[str, Any], ...]], LineFormat] = {}


def line_format(event: str, fields: Iterable[tuple[str, Any]]) -> LineFormat:
    """The LineFormat of these fields, made once (a few per loader of a program)."""
    key = (event, tuple(fields))
    got = _formats.get(key)
    if got is None:
        if len(_formats) >= 256:  # a program that makes a loader per step: bounded
            _formats.clear()
        got = _formats[key] = LineFormat(event, key[1])
    return got


def encoded(value: Any) -> bytes:
    """One value as it stands in an event's line (redacted, JSON): for the templates made before a fork."""
    return json_line(value)[:-1]


MAX_LINE_BYTES = 1 << 20  # a longer line is skipped whole: no event of ours comes near it
MAX_READ_BYTES = 4 << 20  # read per call: a writer flooding the file cannot balloon the reader
MAX_DEPTH = 32  # nesting of lists and objects in one event; ours use 4 at most
MAX_TEXT = 1 << 18  # characters kept of one exception text field


def depth_ok(obj: Any, limit: int = MAX_DEPTH) -> bool:
    """Whether ``obj`` nests no deeper than ``limit`` (iterative: deep input cannot recurse here)."""
    stack = [(obj, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, dict):
            children: Any = value.values()
        elif isinstance(value, list):
            children = value
        else:
            continue
        if depth > limit:
            return False
        stack.extend((child, depth + 1) for child in children)
    return True


def _int(value: Any, minimum: int = 0) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= minimum else None


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _text(value: Any) -> str | None:
    if value is None or isinstance(value, (dict, list)):
        return None
    text = value if isinstance(value, str) else str(value)
    if len(text) > MAX_TEXT:  # keep both ends: a traceback's last lines hold the error itself
        text = f"{text[: MAX_TEXT // 4]}\n...\n{text[len(text) - MAX_TEXT * 3 // 4 :]}"
    return text


def _exception(value: Any) -> dict[str, Any] | None:
    if not isinstance(value, dict):
        return None
    return {
        "type": _text(value.get("type")) or "exception",
        "message": _text(value.get("message")) or "",
        "errno": _int(value.get("errno"), minimum=-(2**31)),
        "traceback": _text(value.get("traceback")),
        "from_loader": value.get("from_loader") is True,
    }


def _exception_event(ev: dict[str, Any]) -> dict[str, Any] | None:
    exc = _exception(ev.get("exception"))
    if exc is None:
        return None
    ev["exception"] = exc
    return ev


def _worker_registered(ev: dict[str, Any]) -> dict[str, Any] | None:
    if "pid" not in ev:
        return None
    ev["worker_id"] = ev.get("worker_id")
    ev["start_method"] = _str(ev.get("start_method"))
    ev["dump_path"] = _str(ev.get("dump_path"))
    out = ev.get("crash_output")  # where a fatal signal's stack goes: dlwatch's crash file or not
    ev["crash_output"] = out if out in ("dlwatch", "program", "none") else None
    return ev


def _loader_workers(ev: dict[str, Any]) -> dict[str, Any] | None:
    pids = ev.get("pids")
    if not isinstance(pids, list):
        return None
    ev["pids"] = [p for p in pids if _int(p, 1) is not None]
    return ev


def _batch_bytes(ev: dict[str, Any]) -> dict[str, Any] | None:
    return None if _int(ev.get("batch_bytes")) is None else ev


# An event's schema: takes the event (common fields checked, a fresh dict) and returns it
# well-typed, or None to skip it.  The watch's own events that the monitor acts on are checked
# here, keyed by their declarations (dlwatch.wire.contract); a failure's own events are checked
# by the schema its module declares (dlwatch.detect.registry: ``events``): the monitor passes
# their table in.
Schema = Callable[[dict[str, Any]], "dict[str, Any] | None"]
Schemas = Mapping[str, Schema]

_OWN: Schemas = {
    contract.EXCEPTION.name: _exception_event,
    contract.WORKER_REGISTERED.name: _worker_registered,
    contract.LOADER_WORKERS.name: _loader_workers,
    contract.BATCH_BYTES.name: _batch_bytes,
    contract.INTERRUPT.name: interrupt.normalize,
}


def normalize(record: Any, schemas: Schemas | None = None) -> dict[str, Any] | None:
    """One parsed line -> an event whose fields have the types the monitor relies on, or None.

    Every process of the run can append to the events file, and a file can be damaged:
    a line is only data.  Common fields of the wrong type are dropped (``ts`` must be a
    number, ``pid`` a positive int, ``worker_id`` a non-negative int); the fields an event
    is acted on are checked per event (the events of the watch here, a failure's own by
    its schema in ``schemas``), and an event whose essential field is unusable is
    skipped.  Unknown events pass through (bounded in depth) for the timeline.
    """
    if not isinstance(record, dict) or not isinstance(record.get("event"), str) or not depth_ok(record):
        return None
    ev = dict(record)
    ts = ev.get("ts")
    if not (isinstance(ts, (int, float)) and not isinstance(ts, bool) and ts == ts and abs(ts) < 1e12):
        ev.pop("ts", None)
    for key, minimum in (("pid", 1), ("ppid", 0), ("worker_id", 0)):
        if key in ev and _int(ev[key], minimum) is None:
            ev.pop(key)
    name = ev["event"]
    check = _OWN.get(name)
    if check is not None:
        return check(ev)
    if schemas is not None and name in schemas:
        return schemas[name](ev)
    return ev


class EventReader:
    """Tails an events file: each call to ``new`` returns the complete, well-typed events added since.

    Lines that are not JSON, too long, too deep, or of the wrong shape are skipped
    (see :func:`normalize`): no line can stop the reader or the monitor behind it.
    """

    def __init__(self, path: str, schemas: Schemas | None = None) -> None:
        self.path = path
        self.schemas = schemas
        self._offset = 0
        self._partial = b""
        self._skipping = False  # inside a line longer than MAX_LINE_BYTES: drop up to its newline

    def new(self) -> Iterator[dict[str, Any]]:
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return
            chunk = os.pread(fd, MAX_READ_BYTES, self._offset)
        except OSError:
            return
        finally:
            os.close(fd)
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if self._skipping and lines:
            lines.pop(0)  # the tail of the over-long line
            self._skipping = False
        if len(self._partial) > MAX_LINE_BYTES:
            self._partial, self._skipping = b"", True
        yield from parse_lines(lines, self.schemas)


def parse_lines(lines: Iterable[bytes], schemas: Schemas | None = None) -> Iterator[dict[str, Any]]:
    """Complete lines -> the well-typed events among them (see :func:`normalize`)."""
    for line in lines:
        if not line.strip() or len(line) > MAX_LINE_BYTES:
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the parser's stack
            continue
        event = normalize(record, schemas)
        if event is not None:
            yield event
