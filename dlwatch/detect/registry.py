"""The failure registry: every failure dlwatch knows, each declared once by its own module.

A failure is one module of ``dlwatch/detect/`` with a module-level ``FAILURE =
Failure(...)``, one playbook file of the same id in ``playbooks/`` and (where a real
run can show it) one example in ``examples/``.  The module declares everything that
is particular to its failure; the generic machinery finds it here and never names a
playbook:

- the monitor runs its ``detectors`` (``dlwatch.detect.build``) and reads its
  ``events`` with their schemas (``wire.events.normalize`` takes them as a table), each
  keyed by the event's declaration in ``dlwatch.wire.contract`` (the one list of what the
  training process and its workers send);
- the matcher (``detect/match.py``) calls its ``enrich`` on the finding's evidence,
  adds the events its ``derive`` judges again from a report, and answers a playbook
  condition from its ``facts`` (``fd_at_limit``);
- the renderers show its evidence keys by its ``evidence_forms``
  (``report/display.py``);
- ``dlwatch demo`` runs its ``examples`` and expects its playbook as top finding.

Discovery imports every module of this package once and keeps those that declare a
``FAILURE``, in the order of their module names.  Adding a failure: docs/design.md,
"Adding a failure".
"""

from __future__ import annotations

import functools
import importlib
import os
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Mapping

from dlwatch.wire.contract import Event

if TYPE_CHECKING:
    from dlwatch.detect.base import Detector
    from dlwatch.detect.evidence import Context
    from dlwatch.wire.playbooks import Playbook

__all__ = [
    "FORM_NAMES",
    "Failure",
    "detector_classes",
    "discover",
    "event_schemas",
    "evidence_forms",
    "examples",
    "failures",
    "fact_providers",
    "find",
    "reset",
]

# An enricher adds what was measured for its failure to a finding's evidence (a dict it may
# change) and returns the variant of the playbook's remediation it measured, or several (a
# tuple, shown in that order: each measured one side of the cause), or None for all.
Enricher = Callable[["Playbook", "Context", dict[str, Any]], "str | tuple[str, ...] | None"]
# A derivation returns events the report's raw data implies (judged again, the same rule as
# the detector's), for signals the report does not already hold.
Derivation = Callable[["Context"], list[dict[str, Any]]]
# An event schema takes an event (common fields already type-checked, a fresh dict it may
# change) and returns it with the fields the monitor acts on made well-typed, or None to skip it.
EventSchema = Callable[[dict[str, Any]], "dict[str, Any] | None"]

# How an evidence key is shown to people (report/display.py owns the functions behind the names).
FORM_NAMES = frozenset(
    {
        "bytes",
        "seconds",
        "count",
        "text",
        "table",
        "lines",
        # display functions: a process, fd kinds, a growth fit, RSS/USS history, a stack excerpt, signals
        "process",
        "fds",
        "growth",
        "memory_history",
        "stack",
        "signals",
    }
)


@dataclass(frozen=True)
class Failure:
    """What belongs to one failure, declared by its module (``FAILURE = Failure(...)``)."""

    playbook: str  # the playbook id (playbooks/<id>.toml)
    detectors: tuple[type["Detector"], ...] = ()  # watched between incidents, configured by the playbook
    enrich: Enricher | None = None  # the finding's evidence beyond what matched
    derive: Derivation | None = None  # events a report implies, for the matcher
    facts: Mapping[str, Callable[["Context"], Any]] = field(default_factory=dict)  # named facts for conditions
    evidence_forms: Mapping[str, str] = field(default_factory=dict)  # evidence key -> a name in FORM_NAMES
    # event -> its schema, keyed by the event's declaration (dlwatch.wire.contract; a name is read as one)
    events: Mapping[Event | str, EventSchema] = field(default_factory=dict)
    examples: tuple[str, ...] = ()  # examples/<name>.py whose top finding is this playbook
    module: str = ""  # filled in by discovery


@functools.lru_cache(maxsize=1)
def failures() -> tuple[Failure, ...]:
    """Every declared failure, in the order of their module names (imports each module once)."""
    # this package, by name: this module imports no failure
    return discover(os.path.dirname(os.path.abspath(__file__)), __name__.rpartition(".")[0])


def discover(directory: str, package: str) -> tuple[Failure, ...]:
    """The failures declared by the modules of one package (its directory and dotted name)."""
    found: list[Failure] = []
    for info in sorted(pkgutil.iter_modules([directory]), key=lambda m: m.name):
        if info.ispkg or info.name == "registry":
            continue
        module = importlib.import_module(f"{package}.{info.name}")
        declared = getattr(module, "FAILURE", None)
        if isinstance(declared, Failure):
            found.append(_with_module(declared, module.__name__))
    return tuple(found)


def reset() -> None:
    """Forget what was discovered and merged (tests that add a failure)."""
    for cached in (failures, event_schemas, fact_providers, evidence_forms):
        cached.cache_clear()


def _with_module(f: Failure, name: str) -> Failure:
    from dataclasses import replace

    return replace(f, module=name)


def find(playbook: str) -> Failure | None:
    return next((f for f in failures() if f.playbook == playbook), None)


def detector_classes() -> tuple[type["Detector"], ...]:
    return tuple(cls for f in failures() for cls in f.detectors)


@functools.lru_cache(maxsize=1)
def event_schemas() -> Mapping[str, EventSchema]:
    """Event name -> its schema, over every failure."""
    out: dict[str, EventSchema] = {}
    for f in failures():
        out.update((key.name if isinstance(key, Event) else key, schema) for key, schema in f.events.items())
    return out


@functools.lru_cache(maxsize=1)
def fact_providers() -> Mapping[str, Callable[["Context"], Any]]:
    out: dict[str, Callable[["Context"], Any]] = {}
    for f in failures():
        out.update(f.facts)
    return out


@functools.lru_cache(maxsize=1)
def evidence_forms() -> Mapping[str, str]:
    """Evidence key -> form name, over every failure (a key two failures share has one form: tests check)."""
    out: dict[str, str] = {}
    for f in failures():
        out.update(f.evidence_forms)
    return out


def examples() -> dict[str, str]:
    """Example name -> the playbook it must yield as top finding, in registry order."""
    return {name: f.playbook for f in failures() for name in f.examples}
