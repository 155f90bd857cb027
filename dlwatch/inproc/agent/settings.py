"""What a watch was asked for: its options, the thresholds its checks read, what it leaves out.

A check that runs in the training process declares the playbook it serves and the thresholds it
reads from that playbook (``PLAYBOOK`` and ``THRESHOLDS`` in its module: the batch-shape probe,
the RNG check); nothing here names a failure.  Bad input (a malformed playbook, an unknown id to
ignore, a bad Prometheus setting) raises here, when the watch is made, naming the fix.
"""

from __future__ import annotations

from types import ModuleType
from typing import Any

from dlwatch.wire import config


def _checks() -> tuple[ModuleType, ...]:
    """The checks made in the training process that read thresholds from their playbook."""
    from dlwatch.inproc import rngcheck, shapes

    return (shapes, rngcheck)


class Settings:
    """The resolved options (keywords, then the environment), the playbooks' thresholds and advice."""

    __slots__ = ("options", "ignored", "advice_pbs", "prometheus", "_thresholds")

    def __init__(self, **options: Any) -> None:
        self.options = config.resolve(**options)
        self.ignored = frozenset(self.options.ignored_playbooks)
        self.advice_pbs: dict[str, Any] = {}  # preflight playbooks by id (titles and thresholds)
        self._thresholds: dict[str, dict[str, float]] = {}  # a check's playbook id -> its thresholds
        self.prometheus: dict[str, Any] = {}
        if not self.options.enabled:
            return
        from dlwatch.wire.playbooks import load_playbooks

        loaded = load_playbooks(self.options.playbooks)  # a malformed file: PlaybookError now
        unknown = sorted(self.ignored - {pb.id for pb in loaded})
        if unknown:
            raise ValueError(
                f"dlwatch.watch: ignore names no known playbook: {', '.join(unknown)} "
                f"(see `dlwatch playbooks` for the ids)"
            )
        self.advice_pbs = {pb.id: pb for pb in loaded if pb.is_advice}
        by_id = {pb.id: pb for pb in loaded}
        for check in _checks():
            pb = by_id.get(check.PLAYBOOK)
            if pb is not None:
                self._thresholds[check.PLAYBOOK] = {
                    name: pb.threshold(name, default) for name, default in check.THRESHOLDS.items()
                }
        from dlwatch.wire.config import prom_options

        self.prometheus = prom_options()  # a bad DLWATCH_PROM_* value: ValueError now, naming the fix

    def threshold(self, check: ModuleType, name: str) -> float:
        """One of the thresholds ``check`` declares, as its playbook sets it (the check's default without one)."""
        return self._thresholds.get(check.PLAYBOOK, check.THRESHOLDS)[name]

    def runs(self, check: ModuleType) -> bool:
        """Whether ``check`` runs: its playbook is not ignored."""
        return check.PLAYBOOK not in self.ignored
