"""Detector for ``batch-dim-mismatch``: the training process's shape probe already judged.

The probe (:class:`dlwatch.inproc.shapes.BatchShapeProbe`) runs in the training process, on
sampled batches, because only it sees the batches; it sends a ``batch_shape`` event
with the evidence of the first wrong batch, which this detector hands on as a signal.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from dlwatch.detect.base import Detector, View


class BatchShape(Detector):
    playbook = "batch-dim-mismatch"

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        if ev.get("event") != "batch_shape":
            return ()
        return [dict(ev)]
