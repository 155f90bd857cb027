"""Straggler ranks: one rank's data path far slower than the others'.  Pure; the job view feeds it.

In a synchronous job (DDP, FSDP) every rank waits for the slowest at each step, so
the job runs at the straggler's pace and the *other* ranks look fine: their loop
body (the collective) simply takes longer.  What tells the straggler apart is
where its time goes, measured per rank (see ``dlwatch.report.rankfigures``):

- ``data_wait_share``: it waits inside ``next(loader)`` far more than the others
  (the others wait in the collective instead, which counts as loop body), *and* the
  others' DataLoader workers sit idle far more than its own (``worker_idle_share``:
  they have data to spare).  The second half is needed: ranks in lock-step whose data
  is equally slow are not symmetric, one rank a hair behind waits for data at every
  step while the others wait in the collective (measured: 68% against 8% with both
  datasets alike), but there nobody's workers idle.  A rank without workers
  (``num_workers=0``) loads in its own loop, where its wait share is its loading cost;
- ``batch_rate_per_s``: without a collective between ranks (independent ranks,
  ensembles), the straggler gets far fewer batches a second, *and* it is data-bound
  (a rank that is slow in its own loop body, e.g. rank 0 logging and checkpointing,
  is not a data straggler);
- ``first_batch_s``: its first batch takes far longer (a cold cache, a remote shard).

A verdict needs at least two ranks that each handed out ``min_batches`` batches, and
compares each rank with the median of the *others* (so one straggler among two ranks
is still found).  Thresholds are those of playbooks/straggler-rank.toml.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable, Mapping, Sequence

from dlwatch.detect.registry import Failure

__all__ = ["DEFAULTS", "PLAYBOOK", "judge", "thresholds"]

PLAYBOOK = "straggler-rank"
DEFAULTS: dict[str, float] = {
    "min_batches": 20,  # each rank: fewer batches say nothing about its pace
    "wait_share_gap": 0.25,  # its data-wait share exceeds the others' median by this much (absolute) ...
    "wait_share_min": 0.4,  # ... and is at least this (a data-bound rank) ...
    "idle_gap": 0.4,  # ... and the others' workers idle this much more of the time than its own
    "min_worker_reads": 20,  # polls x workers behind an idle share: fewer say nothing (a 1 s poll, a short run)
    "rate_ratio": 2.0,  # without a collective: others' median rate / its rate
    "rate_wait_gap": 0.1,  # ... and its wait share exceeds the others' by this much (data, not its loop body)
    "first_batch_ratio": 3.0,  # its first batch over the others' median ...
    "first_batch_gap_s": 5.0,  # ... and this many seconds longer (worker start-up jitter is seconds)
}


def thresholds(playbooks: Iterable[Any] | None = None) -> dict[str, float]:
    """DEFAULTS, overridden by the straggler-rank playbook's [thresholds] (loaded if not given)."""
    t = dict(DEFAULTS)
    try:
        if playbooks is None:
            from dlwatch.wire.playbooks import load_playbooks

            playbooks = load_playbooks()
        for pb in playbooks:
            if pb.id == PLAYBOOK:
                t.update({k: float(v) for k, v in pb.thresholds.items() if k in DEFAULTS})
    except Exception:
        pass
    return t


def _num(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def judge(ranks: Sequence[Mapping[str, Any]], t: Mapping[str, float] | None = None) -> list[dict[str, Any]]:
    """One ``straggler-rank`` finding per straggling rank, with every rank's figures as evidence."""
    th = dict(DEFAULTS, **(t or {}))
    usable = [
        r
        for r in ranks
        if (_num(r.get("batches")) or 0) >= th["min_batches"]
        and _num(r.get("data_wait_share")) is not None
        and _num(r.get("batch_rate_per_s"))
    ]
    if len(usable) < 2:
        return []
    table = [
        {
            "rank": r.get("rank"),
            "host": r.get("host"),
            "batches": r.get("batches"),
            "data_wait_share": r.get("data_wait_share"),
            "batch_rate_per_s": r.get("batch_rate_per_s"),
            "first_batch_s": r.get("first_batch_s"),
            "worker_idle_share": r.get("worker_idle_share"),
        }
        for r in usable
    ]
    out = []
    for i, r in enumerate(usable):
        others = [o for j, o in enumerate(usable) if j != i]
        share = float(r["data_wait_share"])
        rate = float(r["batch_rate_per_s"])
        o_share = _median([float(o["data_wait_share"]) for o in others]) or 0.0
        o_rate = _median([float(o["batch_rate_per_s"]) for o in others]) or 0.0
        reasons = []

        def idle_of(x: Mapping[str, Any]) -> float | None:
            enough = (_num(x.get("worker_reads")) or 0) >= th["min_worker_reads"]
            return _num(x.get("worker_idle_share")) if enough else None

        idle = idle_of(r)
        o_idle = _median([i for i in (idle_of(o) for o in others) if i is not None])
        spare = (idle is None and not r.get("worker_reads")) or (
            idle is not None and o_idle is not None and o_idle - idle >= th["idle_gap"]
        )
        if share - o_share >= th["wait_share_gap"] and share >= th["wait_share_min"] and spare:
            why = f"waits for data {share:.0%} of its loop time, the others {o_share:.0%}"
            if idle is not None and o_idle is not None:
                why += f" (their workers idle {o_idle:.0%} of the time, its own {idle:.0%})"
            reasons.append(why)
        if rate > 0 and o_rate / rate >= th["rate_ratio"] and share - o_share >= th["rate_wait_gap"]:
            reasons.append(f"{rate:.2f} batches/s, the others {o_rate:.2f}")
        first = _num(r.get("first_batch_s"))
        o_first = _median([f for f in (_num(o.get("first_batch_s")) for o in others) if f is not None])
        if (
            first is not None
            and o_first is not None
            and o_first > 0
            and first / o_first >= th["first_batch_ratio"]
            and first - o_first >= th["first_batch_gap_s"]
        ):
            reasons.append(f"first batch after {first:.1f} s, the others {o_first:.1f} s")
        if reasons:
            out.append(
                {
                    "playbook": PLAYBOOK,
                    "rank": r.get("rank"),
                    "host": r.get("host"),
                    "reason": "; ".join(reasons),
                    "evidence": {
                        "data_wait_share": share,
                        "others_data_wait_share": o_share,
                        "worker_idle_share": idle,
                        "others_worker_idle_share": o_idle,
                        "batch_rate_per_s": rate,
                        "others_batch_rate_per_s": o_rate,
                        "first_batch_s": first,
                        "others_first_batch_s": o_first,
                        "ranks": table,
                    },
                }
            )
    return out


# judged on the job view (report/jobview.py), never by the matcher: what belongs to it is how its evidence reads
FAILURE = Failure(
    playbook=PLAYBOOK,
    evidence_forms={
        "rank": "text",
        "data_wait_share": "text",
        "batch_rate_per_s": "text",
        "first_batch_s": "text",
        "ranks": "table",
    },
    examples=("ddp_straggler",),
)
