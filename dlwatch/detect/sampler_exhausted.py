"""The ``sampler-exhausted-early`` failure: an epoch ends before the batches the program asked for.

A program that asks ``len(loader)`` (a progress bar's total, Lightning's batches per epoch, an LR
schedule sized from it) expects that many batches an epoch.  A buggy bucketing batch sampler, or a
distributed sampler whose ``__len__`` disagrees with what it yields, ends the epoch early: nothing
raises, the schedule and the progress bar are off, and with several ranks one rank reaches its
collective while the others still train.  The training process keeps what the program's own
``len(loader)`` returned (dlwatch never calls a program's ``__len__``) and, at each epoch's
StopIteration, sends ``epoch_ended`` with the batches it gave; fewer than asked is a ``threshold``
incident naming the epoch, the batches and the length.  An IterableDataset (its length is the
program's estimate) is never judged; ``drop_last`` and a short last batch are already in torch's
``len``; a loop left with ``break`` or an exception ends no epoch.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import last_signal_evidence
from dlwatch.detect.registry import Failure
from dlwatch.wire import contract

PLAYBOOK = "sampler-exhausted-early"
SIGNAL = "sampler_exhausted_early"


class SamplerExhaustedEarly(Detector):
    playbook = PLAYBOOK

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        if ev.get("event") != contract.EPOCH_ENDED.name or ev.get("iterable"):
            return ()
        batches, asked = ev.get("batches"), ev.get("asked_len")
        if not isinstance(batches, int) or not isinstance(asked, int) or batches >= asked:
            return ()
        epoch = ev.get("epoch")
        return [
            {
                "ts": ev.get("ts", view.now),
                "event": "threshold",
                "signal": SIGNAL,
                "epoch": epoch - 1 if isinstance(epoch, int) and epoch > 0 else None,  # counted from 0
                "batches": batches,
                "asked_len": asked,
                "missing_batches": asked - batches,
                "drop_last": ev.get("drop_last"),
            }
        ]


FAILURE = Failure(
    playbook=PLAYBOOK,
    detectors=(SamplerExhaustedEarly,),
    enrich=last_signal_evidence(SIGNAL),  # the epoch, the batches it gave and the length asked
    evidence_forms={"epoch": "count", "batches": "count", "asked_len": "count", "missing_batches": "count"},
    examples=("sampler_exhausted_early",),
)
