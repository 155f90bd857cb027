"""The ``shm-exhaustion`` failure: /dev/shm too small or too full for this loader's batches in flight.

The judgement is :func:`dlwatch.detect.thresholds.shm_pressure` (pure): this job's need
(batch bytes × prefetch_factor × num_workers, 0 with no workers) against free space
plus what this job's processes already hold in /dev/shm
(:func:`~dlwatch.detect.thresholds.held_shm_bytes`).  Another tenant's files only count
as the space they take: a nearly full /dev/shm is no signal while this job's need fits.
The evidence adds /dev/shm's size and free space, the loader's settings and the need.
"""

from __future__ import annotations

from typing import Any, Iterable

from dlwatch.detect import thresholds as th
from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import Context, MAX_EVENTS, strip_event
from dlwatch.detect.registry import Failure
from dlwatch.wire.playbooks import Playbook

PLAYBOOK = "shm-exhaustion"


class ShmPressure(Detector):
    playbook = PLAYBOOK
    defaults = {"need_factor": th.SHM_NEED_FACTOR}

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        if view.system is None or not view.loader:
            return ()
        procs = view.procs

        def held() -> int:  # summed over every process only when free space is below the need
            return th.held_shm_bytes((t.last, t.last_fds) for t in procs.values() if not t.gone)

        evidence = th.shm_pressure(view.system, view.loader, held_bytes=held, **self.thresholds)
        if not evidence:
            return ()
        return [{"ts": view.now, "event": "threshold", **evidence}]


def _enrich(pb: Playbook, ctx: Context, ev: dict[str, Any]) -> str | None:
    for key in ("shm_total", "shm_free", "shm_torch_files"):
        if ctx.system.get(key) is not None:
            ev[key] = ctx.system.get(key)
    loader = {
        k: ctx.loader.get(k)
        for k in ("batch_size", "num_workers", "prefetch_factor", "sharing_strategy")
        if ctx.loader.get(k) is not None
    }
    if loader:
        ev["loader"] = loader
    if ctx.errnos:
        ev["errno"] = ctx.errnos[0]
    pressure = ctx.signal_events("shm_pressure")
    if pressure:
        ev["pressure"] = [strip_event(e) for e in pressure[-MAX_EVENTS:]]
        need = next((e.get("need_bytes") for e in reversed(pressure) if e.get("need_bytes")), None)
        if need:
            ev["need_bytes"] = need
    return None


FAILURE = Failure(
    playbook=PLAYBOOK,
    detectors=(ShmPressure,),
    enrich=_enrich,
    evidence_forms={
        "shm_free": "bytes",
        "shm_total": "bytes",
        "need_bytes": "bytes",
        "held_bytes": "bytes",
        "available_bytes": "bytes",
        "shm_torch_files": "count",
    },
    examples=("shm_exhaustion",),
)
