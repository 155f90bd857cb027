"""Detectors: pure judgement over what the monitor collected.

Each failure the monitor watches for between incidents is one module here with a
:class:`~dlwatch.detect.base.Detector` and one playbook file of the same id in
``playbooks/``.  Adding one: write the module, add its class to ``_classes``.
Stall detection (``stall``) and its classification (``classify``) are not in the list:
a stall is its own trigger, with stack forensics.  The advisors of ``advice`` (tuning
findings for the run summary, never incidents) are detectors too, one playbook each.

Runs in the monitor and the CLI.  May import: the shared helpers, ``wire``, ``collect``.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from dlwatch.detect.base import Detector

__all__ = ["Detector", "build"]


def _classes() -> tuple[type[Detector], ...]:
    from dlwatch.detect.batch_shape import BatchShape
    from dlwatch.detect.fd import FdPressure
    from dlwatch.detect.rng import RngDuplication
    from dlwatch.detect.memory_growth import WorkerMemoryGrowth
    from dlwatch.detect.pinned_memory import PinnedMemoryGrowth
    from dlwatch.detect.shm import ShmPressure
    from dlwatch.detect.worker_killed import WorkerKilled
    from dlwatch.detect.advice import ADVISORS

    return (
        FdPressure,
        ShmPressure,
        BatchShape,
        RngDuplication,
        WorkerKilled,
        WorkerMemoryGrowth,
        PinnedMemoryGrowth,
        *ADVISORS,
    )


def build(thresholds_by_playbook: Mapping[str, Mapping[str, float]], ignore: Iterable[str] = ()) -> list[Detector]:
    """One detector per playbook, configured by its thresholds; none for an ignored playbook."""
    skip = set(ignore)
    return [cls(thresholds_by_playbook.get(cls.playbook)) for cls in _classes() if cls.playbook not in skip]
