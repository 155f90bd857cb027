"""Detector for ``shm-exhaustion``: /dev/shm too small or too full for this loader's batches.

The judgement is :func:`dlwatch.detect.thresholds.shm_pressure` (pure, shared with the matcher).
"""

from __future__ import annotations

from typing import Any, Iterable

from dlwatch.detect import thresholds as th
from dlwatch.detect.base import Detector, View


class ShmPressure(Detector):
    playbook = "shm-exhaustion"
    defaults = {"free_share": th.SHM_FREE_SHARE, "need_factor": th.SHM_NEED_FACTOR}

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        if view.system is None:
            return ()
        evidence = th.shm_pressure(view.system, view.loader, **self.thresholds)
        if not evidence:
            return ()
        return [{"ts": view.now, "event": "threshold", **evidence}]
