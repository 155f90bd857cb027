"""The ``rng-duplication`` failure: a random stream the workers draw from that does not differ.

Each worker sends two ``rng_fingerprint`` events (see :mod:`dlwatch.inproc.worker_hook` and
:mod:`dlwatch.inproc.rngcheck`): ``stage="start"`` after the user's ``worker_init_fn``, and
``stage="after_first_batch"``, listing in ``drawn`` the paths whose state moved since and
in ``rebound`` those of them bound to a new generator (re-created, or created in the worker).
Events carry the worker's ``pid``, ``worker_id`` and the watch's ``epoch`` in which the
worker started.  Two failures, both judged only on streams the workers draw from:

- ``rng_duplicate``: in one generation of workers, a stream drawn from in two or more
  workers ends the first batch in the same state (an RNG made in ``Dataset.__init__``,
  a global re-seeded with a constant).  A generator used only in ``__init__`` never moves;
  one re-created per item from the index, or seeded from ``get_worker_info().seed``, ends
  in different states: neither is flagged.
- ``rng_epoch_repeat``: the same worker id in the next generation (non-persistent workers
  restart every epoch) starts a stream it drew from, not re-created, in the very state of
  the previous generation: the same augmentations every epoch (``np.random.seed(worker_id)``
  in ``worker_init_fn``).  torch re-seeds the globals each epoch; a re-seed to a constant
  or a generator held by the dataset does not change.

Generations are told apart by pid: the n-th process seen with a worker id is that id's
n-th generation (fingerprints may arrive before the iterator's ``loader_workers`` event).
Pure: :func:`judge` takes events and returns evidence (the matcher uses it too); the
detector keeps the events and hands a signal back once every worker of the generation
has reported, so the incident names them all.  The ``rng_fingerprint`` event's schema is
declared here (:func:`_fingerprint_event`), and the matcher judges a report's raw
fingerprints again (:func:`_from_fingerprints`) for a signal the report lacks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import Context
from dlwatch.detect.registry import Failure
from dlwatch.wire import contract
from dlwatch.wire.playbooks import Playbook

__all__ = ["RngDuplication", "fingerprints_of", "judge"]

MAX_WORKERS_KEPT = 512  # worker processes whose fingerprints the detector keeps (oldest dropped)
PLAYBOOK = "rng-duplication"
EVIDENCE_WAIT_S = 5.0  # how long a finding waits for the rest of its generation's workers


@dataclass
class _Worker:
    """One worker process's two fingerprints."""

    pid: int
    worker_id: int
    epoch: int | None = None
    start: Mapping[str, str] | None = None
    after: Mapping[str, str] | None = None
    drawn: frozenset[str] = frozenset()
    rebound: frozenset[str] = frozenset()
    generation: int = 0  # 1 for the first process seen with this worker id, 2 for the next, ...
    seq: int = field(default=0, repr=False)


def fingerprints_of(ev: Mapping[str, Any]) -> dict[str, str] | None:
    """An event's hashes by path: from ``states`` (``[[path, hash], ...]``, never redacted) when
    present, else from ``fingerprints`` (``{path: hash}``; redaction masks the hash of a path
    with a secret-looking name, e.g. ``tokenizer``, so such a path is left out)."""
    states = ev.get("states")
    if isinstance(states, (list, tuple)):
        return {str(p[0]): str(p[1]) for p in states if isinstance(p, (list, tuple)) and len(p) == 2}
    raw = ev.get("fingerprints")
    if isinstance(raw, Mapping):
        return {str(k): str(v) for k, v in raw.items() if v != "***"}
    return None


def _workers(events: Iterable[Mapping[str, Any]]) -> list[_Worker]:
    by_pid: dict[Any, _Worker] = {}
    for ev in events:
        if not isinstance(ev, Mapping) or ev.get("event") != "rng_fingerprint":
            continue
        prints = fingerprints_of(ev)
        worker_id = ev.get("worker_id")
        if not isinstance(prints, Mapping) or not isinstance(worker_id, int) or isinstance(worker_id, bool):
            continue
        pid = ev.get("pid")
        key = pid if isinstance(pid, int) else ("worker", worker_id)
        w = by_pid.get(key)
        if w is None:
            w = by_pid[key] = _Worker(pid=pid if isinstance(pid, int) else -1, worker_id=worker_id, seq=len(by_pid))
        epoch = ev.get("epoch")
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            w.epoch = epoch
        if ev.get("stage", "start") == "after_first_batch":
            w.after = prints
            w.drawn = frozenset(str(p) for p in ev.get("drawn") or () if isinstance(p, str))
            w.rebound = frozenset(str(p) for p in ev.get("rebound") or () if isinstance(p, str))
        else:
            w.start = prints
    out = sorted(by_pid.values(), key=lambda w: w.seq)
    seen: dict[int, int] = {}
    for w in out:
        seen[w.worker_id] = w.generation = seen.get(w.worker_id, 0) + 1
    return out


def _kind(path: str) -> str:
    return "global" if path.startswith("global:") else "object"


def _order(d: Mapping[str, Any]) -> tuple[Any, ...]:
    return (d["kind"] == "global", d["attribute"], d["workers"])


def duplicated_streams(workers: Iterable[_Worker]) -> list[dict[str, Any]]:
    """Per generation and stream drawn from: the workers (two or more) that end their first batch alike."""
    groups: dict[tuple[Any, str, str], set[int]] = {}
    epochs: dict[Any, int | None] = {}
    for w in workers:
        if w.after is None:
            continue
        gen = ("epoch", w.epoch) if w.epoch is not None else ("generation", w.generation)
        epochs[gen] = w.epoch
        for path in w.drawn:
            h = w.after.get(path)
            if h is not None:
                groups.setdefault((gen, path, str(h)), set()).add(w.worker_id)
    out = []
    for (gen, path, _h), ids in groups.items():
        if len(ids) >= 2:
            d: dict[str, Any] = {"attribute": path, "workers": sorted(ids), "kind": _kind(path)}
            if epochs.get(gen) is not None:
                d["epoch"] = epochs[gen]
            if d not in out:
                out.append(d)
    out.sort(key=_order)
    return out


def repeated_streams(workers: Iterable[_Worker]) -> list[dict[str, Any]]:
    """Streams a worker drew from that the same worker id's next generation starts in the same state."""
    by_id: dict[int, list[_Worker]] = {}
    for w in workers:
        by_id.setdefault(w.worker_id, []).append(w)
    groups: dict[tuple[str, tuple[Any, ...], str], set[int]] = {}
    for worker_id, gens in by_id.items():
        for prev, cur in zip(gens, gens[1:]):
            if prev.start is None or cur.start is None or prev.after is None:
                continue
            for path in prev.drawn - prev.rebound:  # a stream that advanced, not one re-created per item
                if path in prev.start and prev.start.get(path) == cur.start.get(path):
                    if prev.epoch is not None and cur.epoch is not None:
                        span, unit = (prev.epoch, cur.epoch), "epochs"
                    else:
                        span, unit = (prev.generation, cur.generation), "generations"
                    groups.setdefault((path, span, unit), set()).add(worker_id)
    out = [
        {"attribute": path, "workers": sorted(ids), unit: list(span), "kind": _kind(path)}
        for (path, span, unit), ids in groups.items()
    ]
    out.sort(key=_order)
    return out


def judge(events: Iterable[Mapping[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(duplicates, repeats) from ``rng_fingerprint`` events, in any order."""
    workers = _workers(events)
    return duplicated_streams(workers), repeated_streams(workers)


def generation_complete(workers: Iterable[_Worker], num_workers: int) -> bool:
    """Every worker id of the newest generation sent both fingerprints (so evidence names them all)."""
    workers = list(workers)
    if not workers:
        return False
    newest = max(w.generation for w in workers)
    done = {w.worker_id for w in workers if w.generation == newest and w.start is not None and w.after is not None}
    return done >= set(range(num_workers))


class RngDuplication(Detector):
    playbook = PLAYBOOK

    def __init__(self, thresholds: Mapping[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.fingerprints: list[Mapping[str, Any]] = []  # rng_fingerprint events, in arrival order
        self.pids: dict[Any, None] = {}  # worker processes kept, oldest first
        self.sent: dict[str, list[dict[str, Any]]] = {}  # signal -> evidence last handed back
        self.pending: dict[str, tuple[float, str, list[dict[str, Any]]]] = {}  # signal -> (first seen, key, evidence)

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        if ev.get("event") == contract.STOP.name:  # the block ends: what was seen is all there will be
            return self._flush(view, wait_s=0.0)
        if ev.get("event") != contract.RNG_FINGERPRINT.name or fingerprints_of(ev) is None:
            return ()
        pid = ev.get("pid")
        self.pids[pid] = None
        if len(self.pids) > MAX_WORKERS_KEPT:  # bounded: drop the oldest worker's events
            oldest = next(iter(self.pids))
            del self.pids[oldest]
            self.fingerprints = [e for e in self.fingerprints if e.get("pid") != oldest]
        self.fingerprints.append(ev)
        workers = _workers(self.fingerprints)
        for name, key, found in (
            ("rng_duplicate", "duplicates", duplicated_streams(workers)),
            ("rng_epoch_repeat", "repeats", repeated_streams(workers)),
        ):
            if found and self.sent.get(name) != found:
                since = self.pending[name][0] if name in self.pending else view.now
                self.pending[name] = (since, key, found)
        # Hand a signal back once every worker of the generation has reported (the incident then
        # names them all), or after EVIDENCE_WAIT_S (a worker that never gets a batch), or at stop.
        num_workers = (view.loader or {}).get("num_workers")
        if not isinstance(num_workers, int) or num_workers <= 0 or generation_complete(workers, num_workers):
            return self._flush(view, wait_s=0.0)
        return ()

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        return self._flush(view, wait_s=EVIDENCE_WAIT_S) if self.pending else ()

    def _flush(self, view: View, wait_s: float) -> list[dict[str, Any]]:
        out = []
        for name, (since, key, found) in list(self.pending.items()):
            if view.now - since >= wait_s:
                del self.pending[name]
                self.sent[name] = found
                out.append({"ts": view.now, "event": name, key: found})
        return out


# --------------------------------------------------------------------------- events and the matcher's side


def _fingerprint_event(ev: dict[str, Any]) -> dict[str, Any] | None:
    """The schema of ``rng_fingerprint`` (see :func:`dlwatch.wire.events.normalize`): a worker id and
    fingerprints by path; hashes that are not strings are dropped."""
    fps = ev.get("fingerprints")
    if "worker_id" not in ev or not isinstance(fps, dict):
        return None
    ev["fingerprints"] = {k: v for k, v in fps.items() if isinstance(v, str)}
    return ev


def _from_fingerprints(ctx: Context) -> list[dict[str, Any]]:
    """The detector's signals, judged again from raw fingerprint events (the same rule),
    for each signal the report does not already hold."""
    events = ctx.events
    prints = [ev for ev in events if ev.get("event") == "rng_fingerprint"]
    if not prints:
        return []
    dups, repeats = judge(prints)
    checked = len({(ev.get("pid"), ev.get("worker_id")) for ev in prints})
    out = []
    for name, key, found in (("rng_duplicate", "duplicates", dups), ("rng_epoch_repeat", "repeats", repeats)):
        if found and not ctx.signal_events(name):
            out.append(
                {
                    "event": "threshold",
                    "signal": name,
                    key: found,
                    "num_workers_checked": checked,
                    "derived": "rng_fingerprint events",
                }
            )
    return out


def _enrich(pb: Playbook, ctx: Context, ev: dict[str, Any]) -> str | None:
    for signal, key in (("rng_duplicate", "duplicates"), ("rng_epoch_repeat", "repeats")):
        found: list[Any] = []
        for e in ctx.signal_events(signal):
            for d in e.get(key) or ():
                if d not in found:
                    found.append(d)
        if found:
            ev[key] = found
    if ev.get("repeats"):
        # workers restart each epoch; a sequential sampler means the very same samples get the
        # very same draws (on purpose only for a validation loader seeded alike every epoch)
        for key in ("persistent_workers", "sampler"):
            if ctx.loader.get(key) is not None:
                ev[key] = ctx.loader.get(key)
    if ctx.loader.get("worker_init_fn") is not None:
        ev["worker_init_fn"] = ctx.loader.get("worker_init_fn")
    if ev.get("duplicates") and not ev.get("repeats"):
        return "worker-copies"
    if ev.get("repeats") and not ev.get("duplicates"):
        return "epoch-repeat"
    return None  # both (or neither measured): every variant is shown


FAILURE = Failure(
    playbook=PLAYBOOK,
    detectors=(RngDuplication,),
    enrich=_enrich,
    derive=_from_fingerprints,
    evidence_forms={
        "duplicates": "table",
        "repeats": "table",
        "persistent_workers": "text",
        "sampler": "text",
        "worker_init_fn": "text",
    },
    events={contract.RNG_FINGERPRINT: _fingerprint_event},
    examples=("rng_duplication", "rng_epoch_repeat"),
)
