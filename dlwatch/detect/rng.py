"""Detector for ``rng-duplication``: RNG state identical in two or more workers of one generation.

Workers send ``rng_fingerprint`` events (hashes of each generator's state, see
:mod:`dlwatch.rngcheck`); the iterator sends ``loader_workers`` with the pids of each
new generation of workers.  Fingerprints are kept by worker id for the current
generation only: they may arrive before the iterator reports its workers.
"""

from __future__ import annotations

import time
from typing import Any, Iterable, Mapping

from dlwatch.detect.base import Detector, View
from dlwatch.rngcheck import duplicates


class RngDuplication(Detector):
    playbook = "rng-duplication"

    def __init__(self, thresholds: Mapping[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.loader_pids: set[int] = set()
        self.rng: dict[int, tuple[int, Mapping[str, str]]] = {}  # worker_id -> (pid, fingerprints)

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        name = ev.get("event")
        if name == "loader_workers":
            pids = {int(p) for p in ev.get("pids") or () if isinstance(p, int)}
            if pids != self.loader_pids:  # a new generation: keep only its fingerprints
                self.rng = {w: v for w, v in self.rng.items() if v[0] in pids}
            self.loader_pids = pids
            return ()
        if name != "rng_fingerprint" or not isinstance(ev.get("fingerprints"), Mapping):
            return ()
        worker_id, pid = ev.get("worker_id"), ev.get("pid")
        if not isinstance(worker_id, int) or not isinstance(pid, int):
            return ()
        self.rng[worker_id] = (pid, ev["fingerprints"])
        if len(self.rng) < 2:
            return ()
        dups = duplicates({w: fp for w, (_pid, fp) in self.rng.items()})
        if not dups:
            return ()
        return [{"ts": time.time(), "event": "rng_duplicate", "duplicates": dups}]
