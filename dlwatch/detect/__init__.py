"""Detectors: pure judgement over what the monitor collected.

Each failure is one module here that declares what belongs to it (``FAILURE``, see
:mod:`dlwatch.detect.registry`): its detectors, its enricher, its evidence forms, its
events, its examples; and one playbook file of the same id in ``playbooks/``.  Adding
one: docs/design.md, "Adding a failure"; nothing here changes.  Stall detection
(``stall``) and its classification (``classify``) are generic: a stall is its own
trigger, with stack forensics.  The advisors of ``advice`` (tuning findings for the run
summary, never incidents) are detectors too, one playbook each.

Runs in the monitor and the CLI.  May import: the shared helpers, ``wire``, ``collect``.
"""

from __future__ import annotations

from typing import Iterable, Mapping

from dlwatch.detect.base import Detector

__all__ = ["Detector", "build"]


def _classes() -> tuple[type[Detector], ...]:
    from dlwatch.detect import registry
    from dlwatch.detect.advice import ADVISORS

    return (*registry.detector_classes(), *ADVISORS)


def build(thresholds_by_playbook: Mapping[str, Mapping[str, float]], ignore: Iterable[str] = ()) -> list[Detector]:
    """One detector per playbook, configured by its thresholds; none for an ignored playbook."""
    skip = set(ignore)
    return [cls(thresholds_by_playbook.get(cls.playbook)) for cls in _classes() if cls.playbook not in skip]
