"""Every stall verdict's one line must agree with the evidence of the same report (#21 item 4).

``check(report)`` reads the claims ``classify_stall`` makes in ``classification_reason`` and
checks each against the report's own ``processes`` table: the counts ("2 of 3 workers"), the
status each process is said to have, "alive" only with signs of life (``alive_by``), "no sign of
life" only without, an I/O wait only where ``io_wait`` says one.  ``conftest.load`` runs it on
every stall report any test loads, so every stall test checks it.
"""

from __future__ import annotations

import re

_COUNT = re.compile(r"^(\d+) of (\d+) workers (.*?):")
_PROC = re.compile(
    r"(?:worker (\d+)|main|other) \(pid (\d+)\) (running|blocked|idle|gone)( in [^()]*?)?(?= at | \d|$|;| alive| \(\+)"
)
_ALIVE = re.compile(r"\(pid (\d+)\)[^;()]*? alive: ([a-z, -]+)")


def check(report: dict) -> None:
    reason = report.get("classification_reason") or ""
    procs = {p.get("pid"): p for p in report.get("processes") or () if isinstance(p, dict)}
    workers = [p for p in procs.values() if p.get("role") == "worker"]
    live = [w for w in workers if w.get("status") != "gone"]
    for m in _PROC.finditer(reason):  # each process named with its status: the table agrees
        p = procs.get(int(m.group(2)))
        if p is None:
            continue  # a process the table left out (it holds at most so many)
        assert p.get("status") == m.group(3), (reason, p.get("status"))
    for m in _ALIVE.finditer(reason):  # "alive: cpu, wakes" is the table's alive_by
        p = procs.get(int(m.group(1)))
        if p is not None:
            assert {a.strip() for a in m.group(2).split(",")} == set(p.get("alive_by") or ()), (
                reason,
                p.get("alive_by"),
            )
    m = _COUNT.match(reason)
    if m is None:
        return
    n, total, claim = int(m.group(1)), int(m.group(2)), m.group(3)
    assert total == len(live), (reason, [(w.get("pid"), w.get("status")) for w in workers])
    if claim.startswith("still working"):
        assert n == sum(w.get("status") == "running" for w in live), reason
    elif claim.startswith("blocked with no CPU progress and no sign of life"):
        hard = [w for w in live if w.get("status") == "blocked" and not w.get("io_wait")]
        assert n <= len(hard) and all(not w.get("alive_by") for w in hard[:n]), reason
    elif claim.startswith("wait on"):
        assert n == sum(bool(w.get("io_wait")) for w in live), reason
    elif claim.startswith("waiting but alive"):
        blocked = [w for w in live if w.get("status") == "blocked" and not w.get("io_wait")]
        assert n == len(blocked) and all(w.get("alive_by") for w in blocked), (reason, blocked)
    elif claim.startswith("in a wait that ends by itself"):
        blocked = [w for w in live if w.get("status") == "blocked" and not w.get("io_wait")]
        assert n == len(blocked) and not any(w.get("alive_by") for w in blocked), reason
