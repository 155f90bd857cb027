"""What the monitor keeps of the run for the reports it may write: the timeline and its own notes.

``Timeline`` is ``timeline.jsonl`` with a size cap.  ``Journal`` holds the events worth showing in
a report (``notable``), the last ``RING`` timeline records an incident copies (events as dicts,
samples as their encoded line), and the timeline file they are also written to.  ``Notes`` are the
monitor's own troubles (a playbook that did not load, a failing probe or detector), said once,
carried by every report and the run summary.
"""

from __future__ import annotations

import collections
import json
import os
from typing import Any

from dlwatch._fs import create_private, json_line, open_private
from dlwatch._log import get_logger
from dlwatch.report import build

__all__ = ["Journal", "Notes", "RING", "TIMELINE_CAP_BYTES", "Timeline"]

log = get_logger("dlwatch.monitor")

RING = build.TIMELINE_WINDOW
TIMELINE_CAP_BYTES = 8 << 20  # then rotate to timeline.1.jsonl: at most twice this on disk
NOTABLE = 200  # events kept for reports


class Timeline:
    """timeline.jsonl with a size cap: rotate once, so disk use is bounded for any run length."""

    def __init__(self, path: str, cap: int = TIMELINE_CAP_BYTES) -> None:
        self.path = path
        self.cap = cap
        self.size = 0
        self.failed: str | None = None
        self._fd: int | None = None

    def append(self, record: dict[str, Any]) -> None:
        if not self.failed:
            self.append_line(json_line(record))

    def append_line(self, line: bytes) -> None:
        """A line already encoded and redacted (``timeline_record.encode``)."""
        if self.failed:
            return
        try:
            if self._fd is None:
                self._fd = open_private(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            if self.size + len(line) > self.cap:
                os.close(self._fd)
                os.replace(self.path, self.path.replace(".jsonl", ".1.jsonl"))
                self._fd = create_private(self.path, os.O_WRONLY | os.O_APPEND)
                self.size = 0
            os.write(self._fd, line)
            self.size += len(line)
        except OSError as exc:  # a full disk stops the timeline file, not the monitor
            self.failed = f"timeline.jsonl could not be written: {exc.strerror or exc}"
            log.warning("timeline_write_failed", error=str(exc))

    def close(self) -> None:
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None


class Journal:
    """The events worth a report and the timeline's last records, both also in ``timeline.jsonl``."""

    def __init__(self, run_dir: str) -> None:
        self.timeline = Timeline(os.path.join(run_dir, "timeline.jsonl"))
        # the last RING timeline records for an incident: events as dicts, samples as their line (bytes)
        self.ring: collections.deque[dict[str, Any] | bytes] = collections.deque(maxlen=RING)
        self.notable: collections.deque[dict[str, Any]] = collections.deque(maxlen=NOTABLE)

    def note(self, ev: dict[str, Any]) -> None:
        """An event every later report carries: in the timeline and among the report's events."""
        self.notable.append(ev)
        self.timeline.append({"kind": "event", **ev})
        self.ring.append({"kind": "event", **ev})

    def sample(self, line: bytes) -> None:
        """A poll's sample line (``timeline.sample_line``): kept as written, an incident decodes it."""
        self.ring.append(line)
        self.timeline.append_line(line)

    def timeline_only(self, ev: dict[str, Any]) -> None:
        """An event for the timeline file alone (a repeated stall: one report is enough)."""
        self.timeline.append({"kind": "event", **ev})

    def events(self) -> list[dict[str, Any]]:
        return list(self.notable)

    def records(self) -> list[Any]:
        """The ring as an incident's ``timeline``."""
        return [json.loads(r) if type(r) is bytes else r for r in self.ring]

    def close(self) -> None:
        self.timeline.close()


class Notes:
    """The monitor's own troubles, each said once (a warning in its log, a note in every report)."""

    def __init__(self) -> None:
        self.items: list[str] = []
        self._said: set[str] = set()

    def add(self, note: str) -> None:
        self.items.append(note)

    def warn_once(self, event: str, error: str) -> None:
        key = f"{event}: {error}"
        if key not in self._said:
            self._said.add(key)
            self.items.append(key)
            log.warning(event, error=error)

    def __iter__(self) -> Any:
        return iter(self.items)

    def __bool__(self) -> bool:
        return bool(self.items)
