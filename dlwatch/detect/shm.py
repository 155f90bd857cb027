"""Detector for ``shm-exhaustion``: /dev/shm too small or too full for this loader's batches in flight.

The judgement is :func:`dlwatch.detect.thresholds.shm_pressure` (pure): this job's need
(batch bytes × prefetch_factor × num_workers, 0 with no workers) against free space
plus what this job's processes already hold in /dev/shm
(:func:`~dlwatch.detect.thresholds.held_shm_bytes`).  Another tenant's files only count
as the space they take: a nearly full /dev/shm is no signal while this job's need fits.
"""

from __future__ import annotations

from typing import Any, Iterable

from dlwatch.detect import thresholds as th
from dlwatch.detect.base import Detector, View


class ShmPressure(Detector):
    playbook = "shm-exhaustion"
    defaults = {"need_factor": th.SHM_NEED_FACTOR}

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        if view.system is None or not view.loader:
            return ()
        held = th.held_shm_bytes((t.last, t.last_fds) for t in view.procs.values() if not t.gone)
        evidence = th.shm_pressure(view.system, view.loader, held_bytes=held, **self.thresholds)
        if not evidence:
            return ()
        return [{"ts": view.now, "event": "threshold", **evidence}]
