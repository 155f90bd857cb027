"""The detector interface: what the monitor's loop feeds, and what a detector hands back.

A detector owns one failure.  It lives in the failure's module of ``dlwatch/detect/`` next
to its pure judgement functions, is configured by its playbook's ``[thresholds]`` (the file
in ``playbooks/`` with the same id), and is listed once, in that module's ``FAILURE``
(:mod:`dlwatch.detect.registry`).
The monitor never branches on a detector: each poll it calls ``on_poll`` of every
detector, for each event from the training process and its workers ``on_event``, and
turns every signal handed back into a ``threshold`` incident (one per run and playbook).

A signal is a plain dict ``{"event": "threshold", "signal": NAME, ...evidence}`` (or
``{"event": NAME, ...}``); the matcher (``dlwatch.detect.match``) finds it again by
that name when it judges the report.  An advice signal ``{"event": "advice", "playbook":
ID, "confidence": C, ...evidence}`` is never an incident: the monitor keeps it for the
run summary (see :mod:`dlwatch.detect.advice`), from any of the three calls; advisors
judge in ``on_finish``, when the block ends, over ``View.run`` (the run's figures).  Detectors never read the system, never write,
and never raise into the monitor (the monitor contains a failing detector).

A signal whose ``event`` is in :data:`NOTE_EVENTS` is not an incident: the monitor writes
it to the timeline and keeps it among the events every later report carries.
``{"event": "advice", "playbook": ID, ...}`` is a finding too slow to act on now (e.g.
memory that would reach its limit in hours): a run summary picks it up;
``{"event": "observation", ...}`` is evidence for a report that may come later (a
worker that vanished, with its memory and the limits at that moment).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Protocol

from dlwatch.wire.heartbeat import Heartbeat
from dlwatch.model import ProcSample, SystemSample

__all__ = ["Detector", "NOTE_EVENTS", "Observer", "TrackedView", "View"]

NOTE_EVENTS = frozenset({"advice", "observation"})


class TrackedView(Protocol):
    """One process as the monitor tracks it (read-only for detectors).

    A read-only view of ``monitor.Tracked`` (a ``model.TrackedProcess``), not another model:
    detect/ does not import the monitor, and a detector must not change what it is shown.
    """

    pid: int
    role: str  # main, worker, other
    worker_id: int | None
    gone: bool
    history: Any  # deque of ProcSample, oldest first
    last_fds: Any  # the latest fd breakdown (FdSummary) or None
    crash: Any  # after a fatal signal: {"signal", "fatal_error", "stack"} from its crash file, else None

    @property
    def last(self) -> ProcSample | None: ...


@dataclass(frozen=True)
class View:
    """What the monitor knows at one moment; the same object is handed to every detector."""

    now: float  # wall clock (time.time())
    procs: Mapping[int, TrackedView]
    loader: Mapping[str, Any] | None  # the report's ``loader`` dict (with ``batch_bytes`` once known)
    loader_pids: frozenset[int]  # the workers the watched iterator reported
    system: SystemSample | None
    heartbeat: Heartbeat | None
    run: Mapping[str, Any] | None = None  # the run summary's figures; only for ``on_finish``


class Detector:
    """Base class: override ``on_event`` and/or ``on_poll``; both return signals (maybe none)."""

    playbook: str = ""  # the playbook id whose thresholds configure this detector
    defaults: Mapping[str, float] = {}  # threshold name -> default when the playbook has none

    def __init__(self, thresholds: Mapping[str, float] | None = None) -> None:
        t = dict(self.defaults)
        t.update({k: v for k, v in (thresholds or {}).items() if k in self.defaults})
        self.thresholds: dict[str, float] = t

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        return ()

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        return ()

    def on_finish(self, view: View) -> Iterable[dict[str, Any]]:
        """Once, when the block ends; ``view.run`` holds the run's figures (the summary)."""
        return ()


class Observer(Detector):
    """Keeps each of one event from the training process as an observation (the evidence a later
    incident is judged on), its ``keys`` only, the first ``max_kept`` of a run."""

    event: str = ""  # the event's name (its declaration in wire/contract.py)
    keys: tuple[str, ...] = ()  # what of it is kept, beside ``ts`` and ``pid``
    max_kept: int = 32

    def __init__(self, thresholds: Mapping[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.kept = 0

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        if ev.get("event") != self.event or self.kept >= self.max_kept:
            return ()
        self.kept += 1
        keep = {k: ev.get(k) for k in ("ts", "pid", *self.keys)}
        return ({"event": "observation", "signal": self.event, **keep},)
