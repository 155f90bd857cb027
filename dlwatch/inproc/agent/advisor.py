"""Preflight glue: the checks of :mod:`dlwatch.inproc.preflight`, run where the data is, said once a run.

At an iteration's start (before torch starts its workers) and on its first batch, the checks get
their facts from the loader and this process; each finding goes to the monitor once per run (an
``advice`` event), to the run summary's preflight list, and to the program as one warning (none
when torch prints its own for it).
"""

from __future__ import annotations

from typing import Any

from dlwatch.inproc.agent.loaderinfo import is_dataloader, sharing_strategy, start_method
from dlwatch.inproc.agent.warning import DlwatchWarning
from dlwatch.inproc.frames import user_stacklevel
from dlwatch.redact import warn
from dlwatch.wire import events


class Advisor:
    """Runs the preflight checks of one run's iterations and says each finding once."""

    __slots__ = ("session", "ignored", "playbooks", "sent")

    def __init__(self, session: Any, settings: Any) -> None:
        self.session = session  # its events file, usable CPUs and preflight list
        self.ignored: frozenset[str] = settings.ignored
        self.playbooks: dict[str, Any] = settings.advice_pbs  # titles and thresholds, by id
        self.sent: set[str] = set()

    def at_start(self, loader: Any, batches: int | None = None) -> None:
        """Checks made as an epoch's iterator is created, before torch starts its workers
        (``batches``: the run's batches so far)."""
        path = self.session.events_path
        if loader is None or not is_dataloader(loader) or not path:
            return
        from dlwatch.inproc import preflight

        state = preflight.sampler_state(loader)
        if state is not None and preflight.SAMPLER_EPOCH_PLAYBOOK not in self.ignored:
            events.emit(path, "sampler_epoch", **state)
        if getattr(loader, "persistent_workers", False) and getattr(loader, "_iterator", None) is not None:
            return  # the workers are already running: nothing starts now
        cfg = {
            "num_workers": loader.num_workers,
            "pin_memory": loader.pin_memory,
            "multiprocessing_context": start_method(loader) if loader.num_workers > 0 else None,
        }
        signals = preflight.start_checks(preflight.start_facts(cfg, self.session.usable_cpus()))
        self.send(signals)
        if loader.num_workers > 0:
            self.socket_path(loader.num_workers, cfg["multiprocessing_context"], batches)
        for sig in signals:  # a fact of the run, not only of its start: also plain advice, once
            fact = sig["playbook"]
            if fact in preflight.RUN_FACTS and f"advice:{fact}" not in self.sent:
                self.sent.add(f"advice:{fact}")
                events.emit(path, "advice", **{k: v for k, v in sig.items() if k not in ("event", "stage")})

    def at_first_batch(self, loader: Any, batch: Any, batch_bytes: int | None) -> None:
        if loader is None or not is_dataloader(loader) or not loader.num_workers:
            return
        from dlwatch.inproc import preflight

        cfg = {
            "num_workers": loader.num_workers,
            "prefetch_factor": loader.prefetch_factor,
            "sharing_strategy": sharing_strategy(),
        }
        thresholds = {pid: dict(pb.thresholds) for pid, pb in self.playbooks.items()}
        self.send(preflight.first_batch_checks(preflight.first_batch_facts(cfg, batch, batch_bytes), thresholds))

    def socket_path(self, num_workers: int, method: str | None, batches: int | None) -> None:
        """A temp directory too long for the socket the workers bind to send a batch: told to the monitor,
        with the batches so far, as each iterator starts its workers.  Nothing is said to the program
        here: a loader whose batches hold no tensor sends no fd and runs; the stall that follows in
        any other is where the monitor names it."""
        from dlwatch.inproc import sockpath

        if sockpath.PLAYBOOK in self.ignored or not self.session.events_path:
            return
        found = sockpath.check(num_workers, sharing_strategy(), method)
        if found is not None:
            events.emit(self.session.events_path, "af_unix_path", batches=batches, **found)

    def send(self, signals: list[dict[str, Any]]) -> None:
        from dlwatch.inproc.preflight import warning_text

        for sig in signals:
            pid = sig["playbook"]
            if pid in self.ignored or pid in self.sent:
                continue
            self.sent.add(pid)
            self.session.preflight.append(sig)
            if self.session.events_path:
                events.emit(self.session.events_path, "advice", **{k: v for k, v in sig.items() if k != "event"})
            if sig.get("torch_warns"):
                continue  # torch prints this one itself: the finding goes to the summary, not a second warning
            pb = self.playbooks.get(pid)
            warn(
                f"dlwatch: {warning_text(sig, pb.title if pb is not None else pid)}",
                DlwatchWarning,
                stacklevel=user_stacklevel(),
            )
