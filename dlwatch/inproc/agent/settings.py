"""What a watch was asked for: its options, the thresholds its checks read, what it leaves out.

A check that runs in the training process declares the playbook it serves and the thresholds it
reads from that playbook (``PLAYBOOK`` and ``THRESHOLDS`` in its module: the batch-shape probe,
the RNG check); nothing here names a failure.  Bad input given as an argument (a malformed playbook,
an unknown id to ignore) raises here, when the watch is made, naming the fix; a bad ``DLWATCH_*``
environment value is left for its default with one warning per value and process (fail open: an
environment set for a whole cluster must not stop every job).
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from dlwatch.inproc.agent.warning import warn_env
from dlwatch.wire import config


def _checks() -> tuple[ModuleType, ...]:
    """The checks made in the training process that read thresholds from their playbook."""
    from dlwatch.inproc import rngcheck, shapes

    return (shapes, rngcheck)


class Settings:
    """The resolved options (keywords, then the environment), the playbooks' thresholds and advice."""

    __slots__ = ("options", "ignored", "advice_pbs", "prometheus", "_thresholds")

    def __init__(self, **options: Any) -> None:
        # a bad argument raises; a bad DLWATCH_* value is dropped for the default (options.problems)
        self.options = config.resolve(**options)
        self.ignored = frozenset(self.options.ignored_playbooks)
        self.advice_pbs: dict[str, Any] = {}  # preflight playbooks by id (titles and thresholds)
        self._thresholds: dict[str, dict[str, float]] = {}  # a check's playbook id -> its thresholds
        self.prometheus: dict[str, Any] = {}
        if not self.options.enabled:
            return
        from dlwatch.wire.playbooks import load_playbooks

        env_problems: list[str] = []  # more bad DLWATCH_* values, left out: one warning each (warn_env)
        # the watch's own playbooks= argument strictly; the variable's directories leniently, by the loader
        explicit = () if "playbooks" in self.options.from_env else self.options.playbooks
        loaded = load_playbooks(explicit, problems=env_problems, extra_strict=True)  # malformed: PlaybookError
        self.options = config.known_ignored(self.options, (pb.id for pb in loaded))  # an unknown id: ValueError
        self.ignored = frozenset(self.options.ignored_playbooks)
        self.advice_pbs = {pb.id: pb for pb in loaded if pb.is_advice}
        by_id = {pb.id: pb for pb in loaded}
        for check in _checks():
            pb = by_id.get(check.PLAYBOOK)
            if pb is not None:
                self._thresholds[check.PLAYBOOK] = {
                    name: pb.threshold(name, default) for name, default in check.THRESHOLDS.items()
                }
        from dlwatch.wire.config import prom_options

        self.prometheus = prom_options(problems=env_problems)  # a bad DLWATCH_PROM_* value: left off
        warn_env((*self.options.problems, *env_problems))

    def threshold(self, check: ModuleType, name: str) -> float:
        """One of the thresholds ``check`` declares, as its playbook sets it (the check's default without one)."""
        return self._thresholds.get(check.PLAYBOOK, check.THRESHOLDS)[name]

    def runs(self, check: ModuleType) -> bool:
        """Whether ``check`` runs: its playbook is not ignored."""
        return check.PLAYBOOK not in self.ignored
