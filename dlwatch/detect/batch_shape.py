"""The ``batch-dim-mismatch`` failure: the training process's shape probe already judged.

The probe (:class:`dlwatch.inproc.shapes.BatchShapeProbe`) runs in the training process, on
sampled batches, because only it sees the batches; it sends a ``batch_shape`` event
with the evidence of the first wrong batch, which this detector hands on as a signal;
the finding shows that evidence with the loader's collate_fn, batch size and drop_last.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import Context, strip_event
from dlwatch.detect.registry import Failure
from dlwatch.wire import contract
from dlwatch.wire.playbooks import Playbook

PLAYBOOK = "batch-dim-mismatch"


class BatchShape(Detector):
    playbook = PLAYBOOK

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        if ev.get("event") != contract.BATCH_SHAPE.name:
            return ()
        return [dict(ev)]


def _enrich(pb: Playbook, ctx: Context, ev: dict[str, Any]) -> str | None:
    events = ctx.signal_events("batch_shape")
    if events:
        first = strip_event(events[0])
        ev.update({k: v for k, v in first.items() if k not in ev})
        if len(events) > 1:
            ev["batch_shape_events"] = len(events)
    if not ev.get("collate_fn") and ctx.loader.get("collate_fn"):
        ev["collate_fn"] = ctx.loader.get("collate_fn")
    for key in ("batch_size", "drop_last"):
        if key not in ev and ctx.loader.get(key) is not None:
            ev[key] = ctx.loader.get(key)
    return None


FAILURE = Failure(
    playbook=PLAYBOOK,
    detectors=(BatchShape,),
    enrich=_enrich,
    evidence_forms={
        "batch_index": "count",
        "expected_batch_size": "count",
        "shapes": "text",
        "leading_dims": "text",
        "collate_fn": "text",
        "reason": "text",
        "leaf": "text",
        "multiple": "count",
        "sample_count": "count",
        "confirmed_batches": "count",
        "confirmed_at_index": "count",
        "ignored_keys": "text",
    },
    examples=("cat_collate",),
)
