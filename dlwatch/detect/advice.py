"""Advice: tuning findings earned by the run's measured figures.  Never an incident.

Each advisor is a :class:`~dlwatch.detect.base.Detector` configured by its playbook's
``[thresholds]`` (``playbooks/<id>.toml``, ``kind = "advice"``).  It judges the run's
figures when the block ends (``on_finish``: the summary's ``loop``, ``workers``,
``peaks``, ``cpus``, ``loader``, see :mod:`dlwatch.collect.runstats`) and hands back
advice signals ``{"event": "advice", "playbook": ID, "confidence": C, ...evidence}``.
The monitor keeps every signal whose ``event`` is ``advice`` (from any detector, at
any time: ``on_event``, ``on_poll`` or ``on_finish``) for the run summary and makes no
incident of it; :func:`to_finding` turns one into a finding with the playbook's title
and remediation (``cause`` picks a remediation variant).  ``pin-memory-without-cuda`` is
a fact of the training process (no CUDA device), not a figure: the agent sends it as
an advice event with its preflight finding (see :mod:`dlwatch.inproc.preflight`).

A balanced run earns nothing: every advisor needs a steady part long enough to judge
(a 3-batch smoke test is all cold start) and a figure well past its threshold.
"""

from __future__ import annotations

import math
from typing import Any, Iterable, Mapping, Sequence

from dlwatch.detect.base import Detector, View
from dlwatch.collect.runstats import worker_totals
from dlwatch.wire import contract

__all__ = ["ADVISORS", "advice_signal", "not_judged", "to_finding"]

MIB = 1 << 20
_PLUMBING = ("event", "playbook", "confidence", "ts", "kind")


def advice_signal(playbook: str, confidence: float, **evidence: Any) -> dict[str, Any]:
    return {"event": "advice", "playbook": playbook, "confidence": round(float(confidence), 3), **evidence}


def _num(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) else None


def _usable(run: Mapping[str, Any]) -> float | None:
    return _num((run.get("cpus") or {}).get("usable"))


class _Advisor(Detector):
    """An advisor judges once, at the end of the block (``on_finish``)."""

    def on_finish(self, view: View) -> Iterable[dict[str, Any]]:
        run = view.run or {}
        loader = view.loader or {}
        try:
            sig = self.judge(run, loader)
        except (TypeError, ValueError, ZeroDivisionError, KeyError):
            return ()
        return [sig] if sig else ()

    def judge(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> dict[str, Any] | None:
        raise NotImplementedError

    def unmet(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> list[dict[str, Any]]:
        """The minimums of the run this advisor needs to judge at all that it did not reach (a run too
        short to say anything), each ``{"figure", "needs", "value"}``; none where it applies and could
        judge, or does not apply to this loader."""
        return []


def _short_of(figure: str, needs: float, value: Any) -> list[dict[str, Any]]:
    v = _num(value)
    return [{"figure": figure, "needs": needs, "value": value}] if v is None or v < needs else []


def not_judged(detectors: Iterable[Any], run: Mapping[str, Any], loader: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The advisors among ``detectors`` that could not judge this run, and which minimum each missed
    (the run summary's ``advice_not_judged``: a summary without advice says why, where that is why)."""
    out = []
    for det in detectors:
        if not isinstance(det, _Advisor):
            continue
        try:
            unmet = det.unmet(run, loader)
        except (TypeError, ValueError, ZeroDivisionError, KeyError):
            continue
        if unmet:
            out.append({"playbook": det.playbook, "unmet": unmet})
    return out


# --------------------------------------------------------------------------- input-bound


class InputBound(_Advisor):
    """The loop waits for data a large share of its steady time; the workers' figures say why."""

    playbook = "input-bound"
    defaults = {
        "wait_share": 0.2,
        "min_steady_batches": 20,
        "min_loop_s": 5.0,
        "gpu_busy_percent": 90.0,
        "saturated_util": 0.75,
        "io_share": 0.3,
        "confidence": 0.8,
    }

    def judge(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> dict[str, Any] | None:
        t = self.thresholds
        loop = run.get("loop") or {}
        share = _num(loop.get("steady_data_wait_share"))
        steady_batches = loop.get("steady_batches") or 0
        steady_wait = _num(loop.get("steady_data_wait_s")) or 0.0
        body = _num(loop.get("body_s")) or 0.0
        if share is None or share < t["wait_share"] or steady_batches < t["min_steady_batches"]:
            return None
        if steady_wait + body < t["min_loop_s"]:
            return None
        # an isolated long wait among ready batches is a pause (a stall's business), not the pipeline's
        # pattern: what is left without it must earn the advice on its own
        pauses = loop.get("steady_pauses") or {}
        if pauses:
            without = _num(pauses.get("steady_data_wait_share_without"))
            left_s = _num(pauses.get("steady_loop_s_without")) or 0.0
            if without is None or without < t["wait_share"] or left_s < t["min_loop_s"]:
                return None
        gpus = (run.get("peaks") or {}).get("gpus") or []
        busy = [g for g in gpus if (_num(g.get("util_mean")) or 0.0) >= t["gpu_busy_percent"]]
        if gpus and len(busy) == len(gpus):
            return None  # the GPU is busy: with CUDA's asynchronous launches the wait overlaps GPU work
        workers = run.get("workers") or []
        num_workers = loader.get("num_workers")
        usable = _usable(run)
        ev: dict[str, Any] = {
            "steady_data_wait_share": share,
            "steady_data_wait_s": round(steady_wait, 3),
            "steady_batch_s": loop.get("steady_batch_s"),
            "steady_batches": steady_batches,
            "num_workers": num_workers,
            "usable_cpus": usable,
        }
        if not num_workers:
            main = run.get("main") or {}
            ev = {"cause": "main-process-loading", **ev, "main_cpu_util": main.get("cpu_util")}
            return advice_signal(self.playbook, t["confidence"], **ev)
        tot = worker_totals(workers)
        shares = tot["state_share"] or {}
        util = tot["cpu_util_mean"]
        ev.update(worker_cpu_util_mean=util, worker_state_share=shares)
        io = shares.get("io") or 0.0
        running = shares.get("running") or 0.0
        if io >= t["io_share"] and io >= running:
            cause = "io-bound"
        elif (util is not None and util >= t["saturated_util"]) or running >= t["saturated_util"]:
            spare = int(usable - 1 - num_workers) if usable is not None else 0  # one CPU for the training loop
            if spare >= 1:
                cause = "too-few-workers"
                ev["suggested_num_workers"] = int(usable - 1)  # type: ignore[operator]
            else:
                cause = "cpu-saturated"
        else:
            cause = "unknown"
        ev = {"cause": cause, **ev}  # first: the terminal view shows the first few keys
        return advice_signal(self.playbook, t["confidence"] if cause != "unknown" else 0.6, **ev)

    def unmet(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> list[dict[str, Any]]:
        t = self.thresholds
        loop = run.get("loop") or {}
        steady_loop = (_num(loop.get("steady_data_wait_s")) or 0.0) + (_num(loop.get("body_s")) or 0.0)
        short = _short_of("steady_batches", t["min_steady_batches"], loop.get("steady_batches") or 0) + _short_of(
            "steady_loop_s", t["min_loop_s"], round(steady_loop, 3)
        )
        pauses = loop.get("steady_pauses") or {}
        if not short and pauses:  # long enough only with its pause: what is left is judged, and is short
            short = _short_of("steady_loop_without_pauses_s", t["min_loop_s"], pauses.get("steady_loop_s_without"))
        return short


# --------------------------------------------------------------------------- slow-epoch-start


class SlowEpochStart(_Advisor):
    """Each epoch's first batch costs many steady batches and over a second, workers not persistent."""

    playbook = "slow-epoch-start"
    defaults = {"min_first_s": 1.0, "min_factor": 10.0, "min_epochs": 2, "confidence": 0.85}

    def judge(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> dict[str, Any] | None:
        t = self.thresholds
        if not loader.get("num_workers") or loader.get("persistent_workers"):
            return None
        loop = run.get("loop") or {}
        epochs = loop.get("epochs") or 0
        first = loop.get("first_batch_s") or {}
        mean_first = _num(first.get("mean_s"))
        steady = _num(loop.get("steady_batch_s"))
        if epochs < t["min_epochs"] or mean_first is None or steady is None or steady <= 0:
            return None
        factor = mean_first / steady
        if mean_first < t["min_first_s"] or factor < t["min_factor"]:
            return None
        cost = mean_first - steady
        return advice_signal(
            self.playbook,
            t["confidence"],
            epochs=epochs,
            first_batch_mean_s=round(mean_first, 3),
            first_batch_per_epoch_s=first.get("per_epoch"),
            steady_batch_s=round(steady, 4),
            first_batch_factor=round(factor, 1),
            cost_per_epoch_s=round(cost, 3),
            cost_total_s=round(cost * (epochs - 1), 3),  # the first epoch starts its workers anyway
            num_workers=loader.get("num_workers"),
            persistent_workers=False,
        )

    def unmet(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> list[dict[str, Any]]:
        if not loader.get("num_workers") or loader.get("persistent_workers"):
            return []  # workers started once: no epoch start to judge
        return _short_of("epochs", self.thresholds["min_epochs"], (run.get("loop") or {}).get("epochs") or 0)


# --------------------------------------------------------------------------- prefetch-too-deep


class PrefetchTooDeep(_Advisor):
    """Workers mostly idle with their batches in the full queue, and that queue holds a lot of memory."""

    playbook = "prefetch-too-deep"
    defaults = {
        "min_prefetch": 3,
        "blocked_share": 0.5,
        "min_inflight_bytes": 64 * MIB,
        "keep_prefetch": 2,
        "measured_share": 0.5,
        "confidence": 0.75,
    }

    def judge(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> dict[str, Any] | None:
        t = self.thresholds
        pf, nw, bb = loader.get("prefetch_factor"), loader.get("num_workers"), loader.get("batch_bytes")
        if not isinstance(pf, int) or not isinstance(nw, int) or not isinstance(bb, int) or nw <= 0:
            return None
        if pf < t["min_prefetch"]:
            return None
        inflight = bb * nw * pf
        if inflight < t["min_inflight_bytes"]:
            return None
        tot = worker_totals(run.get("workers") or [])
        blocked = (tot["state_share"] or {}).get("blocked_put")
        if blocked is None or blocked < t["blocked_share"]:
            return None
        shm_peak = ((run.get("peaks") or {}).get("shm") or {}).get("used_peak")
        if isinstance(shm_peak, int) and shm_peak < t["measured_share"] * inflight:
            return None  # /dev/shm never held that much: the batches were not in flight (measured, not assumed)
        keep = int(t["keep_prefetch"])
        return advice_signal(
            self.playbook,
            t["confidence"],
            prefetch_factor=pf,
            num_workers=nw,
            batch_bytes=bb,
            inflight_bytes=inflight,
            blocked_put_share=blocked,
            steady_data_wait_share=(run.get("loop") or {}).get("steady_data_wait_share"),
            suggested_prefetch_factor=keep,
            saves_bytes=bb * nw * (pf - keep),
            shm_used_peak=shm_peak,
        )


# --------------------------------------------------------------------------- too-many-workers


class TooManyWorkers(_Advisor):
    """More workers than usable CPUs, CPU-bound, each far from a full core."""

    playbook = "too-many-workers"
    defaults = {"running_share": 0.6, "max_util": 0.6, "min_observed_s": 3.0, "confidence": 0.8}

    def judge(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> dict[str, Any] | None:
        t = self.thresholds
        nw = loader.get("num_workers")
        usable = _usable(run)
        if not isinstance(nw, int) or usable is None or nw <= usable:
            return None
        tot = worker_totals(run.get("workers") or [])
        running = (tot["state_share"] or {}).get("running")
        util = tot["cpu_util_mean"]
        if running is None or util is None or tot["observed_s"] < t["min_observed_s"] * max(1, tot["workers"]):
            return None
        if running < t["running_share"] or util > t["max_util"]:
            return None
        cpus = run.get("cpus") or {}
        return advice_signal(
            self.playbook,
            t["confidence"],
            num_workers=nw,
            usable_cpus=usable,
            affinity_cpus=cpus.get("affinity"),
            cgroup_cpu_quota=cpus.get("cgroup_quota"),
            worker_cpu_util_mean=util,
            worker_running_share=running,
            suggested_num_workers=max(1, int(usable)),
        )

    def unmet(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> list[dict[str, Any]]:
        nw, usable = loader.get("num_workers"), _usable(run)
        if not isinstance(nw, int) or usable is None or nw <= usable:
            return []  # not more workers than CPUs: nothing to judge
        tot = worker_totals(run.get("workers") or [])
        return _short_of(
            "worker_observed_s", self.thresholds["min_observed_s"] * max(1, tot["workers"]), tot["observed_s"]
        )


# --------------------------------------------------------------------------- sampler-epoch-not-set


class SamplerEpochNotSet(_Advisor):
    """A shuffling sampler with ``set_epoch`` whose epoch never changed across epochs over the same data.

    The training process reports the sampler's ``epoch`` attribute at each epoch start
    (``sampler_epoch`` events), with a number for the loader's dataset object (``dataset_ref``;
    not named a "token": redaction masks a field of that name); DistributedSampler seeds its
    shuffle with seed + epoch, so the same value over the same dataset means the same
    permutation.  Epoch starts are judged per dataset: eight loaders over eight datasets, each
    iterated once, repeat nothing (a validation pass per task); one dataset ordered again at the
    same sampler epoch does, whether through one loader or a new loader (and sampler) per epoch.
    """

    playbook = "sampler-epoch-not-set"
    defaults = {"min_epochs": 2, "confidence": 0.9}

    def __init__(self, thresholds: Mapping[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.seen: list[Mapping[str, Any]] = []

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        if ev.get("event") == contract.SAMPLER_EPOCH.name and len(self.seen) < 1000:
            self.seen.append(ev)
        return ()

    def judge(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> dict[str, Any] | None:
        groups: dict[Any, list[Mapping[str, Any]]] = {}
        for e in self.seen:  # an event without the ref (an older training process): one dataset, as before
            ref = e.get("dataset_ref")
            groups.setdefault(ref if isinstance(ref, (int, str)) else None, []).append(e)
        for seen in groups.values():
            found = self._judge_one(seen, len(groups))
            if found is not None:
                return found
        return None

    def _judge_one(self, group: list[Mapping[str, Any]], datasets: int) -> dict[str, Any] | None:
        seen = [e for e in group if e.get("shuffle") is not False]
        if len(seen) < self.thresholds["min_epochs"] or len(seen) != len(group):
            return None
        values = [e.get("sampler_epoch") for e in seen]
        if not all(isinstance(v, int) for v in values) or len(set(values)) != 1:
            return None
        first = seen[0]
        return advice_signal(
            self.playbook,
            self.thresholds["confidence"],
            sampler=first.get("sampler"),
            epochs_started=len(seen),
            sampler_epoch_each_epoch=values[:20],
            shuffle=first.get("shuffle"),
            seed=first.get("seed"),
            num_replicas=first.get("num_replicas"),
            datasets_ordered=datasets,
        )

    def unmet(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> list[dict[str, Any]]:
        seen = [e for e in self.seen if e.get("shuffle") is not False]
        if not seen or len(seen) != len(self.seen):
            return []  # no shuffling sampler with set_epoch: nothing to judge
        return _short_of("epochs", self.thresholds["min_epochs"], len(seen))


# --------------------------------------------------------------------------- dataset-memory-per-worker


class DatasetMemoryPerWorker(_Advisor):
    """The workers' private memory (copy-on-read of the dataset) is a large share of the limit.

    Judged on the part of each worker's USS it wrote (``private_dirty_peak``, where it was read):
    pages of a memory-mapped file that one worker alone touched are private too, but clean page
    cache the kernel reclaims, not a copy (the remedy itself recommends ``np.load(mmap_mode="r")``).
    """

    playbook = "dataset-memory-per-worker"
    defaults = {"share": 0.3, "min_worker_uss": 64 * MIB, "confidence": 0.75}

    def judge(self, run: Mapping[str, Any], loader: Mapping[str, Any]) -> dict[str, Any] | None:
        t = self.thresholds
        workers = list(run.get("workers") or ())
        key = "private_dirty_peak" if any(isinstance(w.get("private_dirty_peak"), int) for w in workers) else "uss_peak"
        uss = [w.get(key) for w in workers]
        uss = [int(u) for u in uss if isinstance(u, int)]
        nw = loader.get("num_workers")
        if not uss or not isinstance(nw, int) or nw <= 0:
            return None
        per_worker = sorted(uss)[len(uss) // 2]  # the median worker: one outlier is not "the dataset"
        if per_worker < t["min_worker_uss"]:
            return None
        peaks = run.get("peaks") or {}
        limit = (peaks.get("cgroup_memory") or {}).get("limit")
        source = "cgroup memory limit"
        if not isinstance(limit, int):
            limit = (peaks.get("mem_available") or {}).get("first")
            source = "MemAvailable when the run began"
        if not isinstance(limit, int) or limit <= 0:
            return None
        total = per_worker * nw
        share = total / limit
        if share < t["share"]:
            return None
        return advice_signal(
            self.playbook,
            t["confidence"],
            num_workers=nw,
            worker_uss_peak_median=per_worker,
            worker_uss_peaks=uss[:32],
            judged=key,
            workers_private_bytes=total,
            memory_limit=limit,
            memory_limit_source=source,
            share_of_limit=round(share, 3),
            dataset=loader.get("dataset"),
        )


ADVISORS: tuple[type[Detector], ...] = (
    InputBound,
    SlowEpochStart,
    PrefetchTooDeep,
    TooManyWorkers,
    SamplerEpochNotSet,
    DatasetMemoryPerWorker,
)


# --------------------------------------------------------------------------- findings


def to_finding(signal: Mapping[str, Any], playbooks: Sequence[Any] | Mapping[str, Any] = ()) -> dict[str, Any]:
    """An advice (or preflight) signal as a finding: playbook id, title, confidence, evidence, remediation.

    The same shape as an incident's findings (``dlwatch.model.Finding``).  The playbook
    gives title and remediation; ``cause`` in the evidence puts that variant first.
    """
    from dlwatch.model import Finding

    pid = str(signal.get("playbook") or "")
    by_id = playbooks if isinstance(playbooks, Mapping) else {pb.id: pb for pb in playbooks}
    pb = by_id.get(pid)
    evidence = {k: v for k, v in signal.items() if k not in _PLUMBING}
    confidence = _num(signal.get("confidence"))
    title = str(signal.get("title") or (pb.title if pb is not None else pid))
    remediation = str(signal.get("remediation") or "")
    if pb is not None and not remediation:
        cause = evidence.get("cause")
        parts = []
        if isinstance(cause, str) and cause in pb.variants:
            parts.append(pb.variants[cause])
        if pb.remediation:
            parts.append(pb.remediation)
        remediation = "\n\n".join(p.strip() for p in parts if p.strip())
    return Finding(
        playbook=pid,
        title=title,
        confidence=round(confidence if confidence is not None else 0.5, 3),
        evidence=evidence,
        remediation=remediation,
    ).to_dict()
