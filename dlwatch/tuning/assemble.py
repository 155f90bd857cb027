"""The result from what a search measured: the rows marked, the recommendation, its reasons, the advice."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from dlwatch.tuning import recommend as rec
from dlwatch.tuning.result import TuneResult

if TYPE_CHECKING:
    from dlwatch.tuning.search import Search


def _start_method_advice(search: Search, num_workers: int) -> list[str]:
    """fork beside threads or CUDA: advice only (the tune does not measure start methods)."""
    if num_workers <= 0:
        return []
    try:
        from dlwatch.inproc import preflight

        facts = preflight.start_facts(
            {"num_workers": num_workers, "multiprocessing_context": search.facts.start_method, "pin_memory": False},
            search.machine.cpus,
        )
        found = preflight.start_checks(facts)
    except Exception:
        return []
    out = []
    for f in found:
        if f.get("playbook") == "fork-with-threads":
            names = ", ".join(str(t.get("name")) for t in f.get("threads") or ())
            out.append(
                f"start method (advice, not measured): fork with {f.get('num_threads')} other thread(s) running "
                f"({names}): a forked worker can inherit a lock one of them holds; prefer "
                "multiprocessing_context='forkserver' (or 'spawn')"
            )
        elif f.get("playbook") == "fork-after-cuda":
            out.append(
                "start method (advice, not measured): CUDA is initialised in this process and workers fork: "
                "use multiprocessing_context='spawn' or 'forkserver' if a worker touches CUDA"
            )
    return out


def assemble(search: Search) -> TuneResult:
    """The result from what the search measured: rows, the recommendation, its reasons."""
    from dlwatch.tuning.space import changed_kwargs

    rows = search.rows()
    if search.restricted is not None:
        rows = [
            replace(r, status="restricted", reason="the IterableDataset rule: these workers would duplicate samples")
            if r.config.num_workers > 1 and r.status == "ok"
            else r
            for r in rows
        ]
    room = search.machine.memory_room[0]
    recommendation = rec.recommend(
        rows, search.facts.current, step_s=search.step_s, usable_cpus=search.machine.usable_cpus, memory_room=room
    )
    chosen = recommendation.config
    cur = search.facts.current
    marked = []
    for r in rows:
        marked.append(
            replace(
                r,
                current=r.config == cur,
                recommended=chosen is not None and r.config == chosen,
                data_wait_share=rec.wait_share(r, search.step_s) if r.status == "ok" else None,
            )
        )
    why = list(recommendation.why)
    if chosen is not None and chosen == cur:
        why.insert(0, "the loader's own configuration is already the one to keep")
    if search.restricted is not None:
        why.insert(0, search.restricted.reason + ": the search kept to num_workers 0 and 1")
    if search.socket_blocked is not None:
        why.insert(0, search.socket_blocked + "; the search kept to num_workers=0")
    best = changed_kwargs(cur, chosen) if chosen is not None else {}
    return TuneResult(
        best=best,
        rows=tuple(marked),
        why=tuple(why),
        current=cur,
        recommended=chosen,
        loader=search.facts,
        machine=search.machine,
        budget_s=search.budget_s,
        step_s=search.step_s,
        elapsed_s=time.monotonic() - search.start,
        interrupted=search.interrupted,
        restricted=search.restricted.to_dict() if search.restricted is not None else None,
        advice=tuple(_start_method_advice(search, chosen.num_workers if chosen else 0)),
        notes=tuple(search.notes),
        created_at=time.time(),
        extra={"runs": search.runs, "window_s": round(search.window, 3)},
    )
