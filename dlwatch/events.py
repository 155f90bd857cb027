"""Events from the training process and its workers to the monitor: an append-only JSONL file.

Every writer (the training loop, each worker, however it was started) opens the
run's ``events.jsonl`` with O_APPEND and writes one line per event with a single
``write``, so lines from different processes never interleave and nothing
depends on the writer staying alive: the monitor reads what was written even
after the training process was killed.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Iterator

from dlwatch._fs import json_line, open_private


def emit(path: str, event: str, **fields: Any) -> bool:
    """Append one event; never raises (dlwatch must not break training). False on failure."""
    record = {"ts": time.time(), "event": event, "pid": os.getpid(), **fields}
    try:
        line = json_line(record)
        fd = open_private(path)  # O_APPEND; created O_EXCL, or ours and private, never through a link
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
        return True
    except Exception:
        return False


class EventReader:
    """Tails an events file: each call to ``new`` returns the complete lines added since."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._offset = 0
        self._partial = b""

    def new(self) -> Iterator[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except OSError:
            return
        self._offset += len(chunk)
        data = self._partial + chunk
        lines = data.split(b"\n")
        self._partial = lines.pop()
        for line in lines:
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                yield record
