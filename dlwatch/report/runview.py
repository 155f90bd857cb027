"""A run summary's loaders, iterations and workers in words and tables, for people.

Pure functions from a run summary (typed or as loaded) to strings and :class:`~dlwatch.report.display.Table` s;
summary.md, the terminal view and report.html lay them out (:mod:`dlwatch.report.summary`,
:mod:`dlwatch.report.html`).  A ``dlwatch run`` summary counts every iteration of every loader of the
program (``loaders[]``, ``iterations[]``): its epochs are said per loader, never as one total
("36 batches, 6 epochs" for two loaders of three epochs each), and each iteration names every worker
it started with its figures, or why a figure is missing (a worker no poll saw, or saw once).
Values are untrusted and of any type: every function here accepts anything.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dlwatch.report import display
from dlwatch.report.schema import RunSummary

_STATES = ("running", "waiting_for_work", "blocked_put", "io", "sleeping")


def _key(s: RunSummary | Mapping[str, Any], key: str) -> Any:
    """A ``dlwatch run`` key of the summary: the typed summary keeps it among the keys it does not name."""
    if isinstance(s, RunSummary):
        return s.extra.get(key)
    return s.get(key) if isinstance(s, Mapping) else None


def loaders(s: RunSummary | Mapping[str, Any]) -> list[Mapping[str, Any]]:
    found = _key(s, "loaders")
    return [e for e in found if isinstance(e, Mapping)] if isinstance(found, list) else []


def iterations(s: RunSummary | Mapping[str, Any]) -> list[Mapping[str, Any]]:
    found = _key(s, "iterations")
    return [r for r in found if isinstance(r, Mapping)] if isinstance(found, list) else []


def _name(e: Mapping[str, Any]) -> str:
    name = e.get("name")
    return (
        f"{display.one_line(e.get('loader'), 64)} ({display.one_line(name, 64)})"
        if name
        else display.one_line(e.get("loader"), 64)
    )


def loader_line(e: Mapping[str, Any]) -> str:
    """``loader1 (DS, 2 workers): 3 epochs, 24 batches``: one loader of the program (an epoch is one
    iteration of it)."""
    persistent = ", persistent" if e.get("persistent_workers") is True else ""
    return (
        f"{display.one_line(e.get('loader'), 64)} ({display.one_line(e.get('name') or '-', 64)}, "
        f"{display.count(e.get('num_workers'), 'worker')}{persistent}): "
        f"{display.count(e.get('iterations'), 'epoch')}, {display.count(e.get('batches'), 'batch')}"
    )


def loop_words(s: RunSummary | Mapping[str, Any]) -> str | None:
    """``36 batches in 6 iterations of 2 loaders (loader1 (DS): 3 epochs, 24 batches; ...)`` for a
    program of several loaders; None for one loader, or a watch's summary (its epochs are its own)."""
    found = loaders(s)
    if len(found) < 2:
        return None
    loop = _key(s, "loop") if not isinstance(s, RunSummary) else s.loop
    loop = loop if isinstance(loop, Mapping) else {}
    each = "; ".join(
        f"{_name(e)}: {display.count(e.get('iterations'), 'epoch')}, {display.count(e.get('batches'), 'batch')}"
        for e in found[:8]
    ) + ("; ..." if len(found) > 8 else "")
    total = loop.get("iterations") if loop.get("iterations") is not None else loop.get("epochs")
    return (
        f"{display.count(loop.get('batches', 0), 'batch')} in {display.count(total, 'iteration')} "
        f"of {len(found)} loaders ({each})"
    )


def unmeasured(w: Mapping[str, Any]) -> str | None:
    """Why a worker's CPU use and states are missing (None where they were measured): a worker's CPU
    use is the change of its CPU time between two polls."""
    if w.get("cpu_util") is not None:
        return None
    polls = w.get("polls")
    if polls == 0:
        return "not sampled: it started and ended between two polls"
    if polls == 1:
        return "sampled by one poll: cpu and states need two"
    return "cpu and states not measured"


def worker_words(w: Mapping[str, Any]) -> str:
    """What was measured of one worker, and why the rest was not:
    ``cpu 0.91 cores; running 80%, waiting for work 20%; RSS peak 166.9 MiB, USS peak 10.3 MiB``."""
    share = w.get("state_share") if isinstance(w.get("state_share"), Mapping) else {}
    states = ", ".join(
        f"{k.replace('_', ' ')} {display.percent(v)}" for k, v in share.items() if isinstance(v, (int, float)) and v
    )
    memory = f"RSS peak {display.human_bytes(w.get('rss_peak'))}, USS peak {display.human_bytes(w.get('uss_peak'))}"
    why = unmeasured(w)
    if why is None:
        return f"cpu {display.human_number(w.get('cpu_util'))} cores; {states or 'states not measured'}; {memory}"
    return why if w.get("polls") == 0 else f"{memory}; {why}"


def worker_label(w: Mapping[str, Any]) -> str:
    return f"worker {display.human_number(w.get('worker_id'))} (pid {display.human_number(w.get('pid'))})"


def iteration_label(r: Mapping[str, Any]) -> str:
    """``iteration 3: loader1 (DS) epoch 1``."""
    return (
        f"iteration {display.human_number(r.get('iteration'))}: {_name(r)} epoch {display.human_number(r.get('epoch'))}"
    )


def worker_lines(s: RunSummary | Mapping[str, Any]) -> list[str] | None:
    """Every worker of every iteration, a line each (``iteration 1: loader1 (DS) epoch 0, worker 0 (pid 7000):
    ...``); None where the summary lists none per iteration (a watch's, or an older dlwatch's)."""
    rows = [r for r in iterations(s) if isinstance(r.get("worker_processes"), list)]
    if not rows:
        return None
    configured = {e.get("loader"): e.get("num_workers") for e in loaders(s)}
    out = []
    for r in rows:
        workers = [w for w in r["worker_processes"] if isinstance(w, Mapping)]
        if not workers:
            why = " (num_workers=0)" if configured.get(r.get("loader")) == 0 else ""
            out.append(f"{iteration_label(r)}: no worker processes{why}")
        for w in workers:
            out.append(f"{iteration_label(r)}, {worker_label(w)}: {worker_words(w)}")
    return out


def worker_table(s: RunSummary | Mapping[str, Any]) -> display.Table | None:
    """:func:`worker_lines` as a table: a row per worker of each iteration."""
    rows = [r for r in iterations(s) if isinstance(r.get("worker_processes"), list)]
    if not rows:
        return None
    out = []
    for r in rows:
        for w in r["worker_processes"]:
            if not isinstance(w, Mapping):
                continue
            share = w.get("state_share") if isinstance(w.get("state_share"), Mapping) else {}
            measured = w.get("cpu_util") is not None
            out.append(
                (
                    display.human_number(r.get("iteration")),
                    display.one_line(r.get("loader"), 64),
                    display.human_number(r.get("epoch")),
                    f"worker {display.human_number(w.get('worker_id'))}",
                    display.human_number(w.get("pid")),
                    display.human_number(w.get("polls")),
                    display.human_number(w.get("cpu_util")) if measured else "-",
                    ", ".join(f"{k.replace('_', ' ')} {display.percent(share.get(k))}" for k in _STATES if share.get(k))
                    or "-",
                    display.human_bytes(w.get("rss_peak")),
                    display.human_bytes(w.get("uss_peak")),
                    unmeasured(w) or "",
                )
            )
    return display.Table(
        (
            "iteration",
            "loader",
            "epoch",
            "worker",
            "pid",
            "polls",
            "CPU (cores)",
            "states",
            "RSS peak",
            "USS peak",
            "why not measured",
        ),
        tuple(out),
    )


def loaders_table(s: RunSummary | Mapping[str, Any]) -> display.Table:
    """A row per loader of the program: its epochs (iterations) and batches."""
    return display.Table(
        ("loader", "dataset", "workers", "persistent", "epochs", "batches"),
        tuple(
            (
                display.one_line(e.get("loader"), 64),
                display.one_line(e.get("name") or "-", 64),
                display.human_number(e.get("num_workers")),
                display.human_number(e.get("persistent_workers")),
                display.human_number(e.get("iterations")),
                display.human_number(e.get("batches")),
            )
            for e in loaders(s)
        ),
    )


def iterations_table(s: RunSummary | Mapping[str, Any]) -> display.Table:
    """A row per loader iteration (epoch): its batches, data wait, first batch and workers together."""
    rows = []
    for r in iterations(s):
        w = r.get("workers") if isinstance(r.get("workers"), Mapping) else {}
        first = r.get("first_batch_s")
        rows.append(
            (
                display.human_number(r.get("iteration")),
                display.one_line(r.get("loader"), 64),
                display.human_number(r.get("epoch")),
                display.human_number(r.get("batches")),
                display.percent(r.get("data_wait_share")),
                display.human_seconds(first) if first is not None else "-",
                display.human_number(w.get("num_workers")),
                display.human_number(w.get("cpu_util_mean")),
                display.human_bytes(w.get("rss_peak")),
            )
        )
    return display.Table(
        (
            "#",
            "loader",
            "epoch",
            "batches",
            "data wait",
            "first batch",
            "workers",
            "worker cpu (cores)",
            "worker rss peak",
        ),
        tuple(rows),
    )


def settings_table(s: RunSummary | Mapping[str, Any]) -> display.Table | None:
    """Each loader's settings side by side (a column per loader, as at its first iteration); None for
    fewer than two loaders with settings (the summary's ``loader`` then says it all)."""
    found = [e for e in loaders(s) if isinstance(e.get("config"), Mapping) and e.get("config")]
    if len(found) < 2:
        return None
    keys: list[str] = []
    for e in found:
        keys.extend(str(k) for k in e["config"] if str(k) not in keys)
    rows = tuple(
        (k, *(display.scalar(k, e["config"].get(k)) if k in e["config"] else "" for e in found)) for k in keys[:64]
    )
    return display.Table(("setting", *(_name(e) for e in found)), rows)


NO_ADVICE = "nothing in this run's figures called for a change"
# the minimums an advisor needs (``advice_not_judged[].unmet[].figure``), as words
_MINIMUMS = {
    "steady_batches": "steady batches",
    "steady_loop_s": "steady loop time",  # waiting for data and loop body, each epoch's first batch left out
    "steady_loop_without_pauses_s": "steady loop time besides its long pauses",  # loop.steady_pauses
    "epochs": "epochs",
    "worker_observed_s": "worker time seen by the polls",
}


def _minimum(u: Mapping[str, Any]) -> str:
    figure = str(u.get("figure") or "")
    noun = _MINIMUMS.get(figure, display.label(figure))
    if figure.endswith("_s"):
        need, had = display.human_seconds(u.get("needs")), display.human_seconds(u.get("value"))
        return f"at least {need} of {noun}, this run {had}"
    return f"at least {display.human_number(u.get('needs'))} {noun}, this run {display.human_number(u.get('value'))}"


def not_judged_words(s: RunSummary | Mapping[str, Any]) -> str | None:
    """``input-bound (needs at least 5.00 s of steady loop time, this run 0.76 s)``: the advisors that
    could not judge this run and the minimum each missed; None where every advisor could."""
    found = _key(s, "advice_not_judged")
    parts = []
    for entry in found if isinstance(found, list) else ():
        if not isinstance(entry, Mapping) or not isinstance(entry.get("unmet"), list):
            continue
        unmet = [_minimum(u) for u in entry["unmet"] if isinstance(u, Mapping)]
        if unmet:
            parts.append(f"{display.one_line(entry.get('playbook'), 64)} (needs {'; '.join(unmet)})")
    return ", ".join(parts) or None


def no_advice_line(s: RunSummary | Mapping[str, Any]) -> str:
    """What a summary without advice says: that nothing called for a change, or, where the run was too
    short for an advisor, which minimum it did not reach (a run that waited for data all the time but
    for under 5 s is not judged input-bound, and says so)."""
    unjudged = not_judged_words(s)
    if unjudged is None:
        return f"No advice: {NO_ADVICE}."
    return f"No advice: too short to judge {unjudged}; nothing else in this run's figures called for a change."


def markers(s: RunSummary | Mapping[str, Any], t0: float, limit: int) -> list[dict[str, Any]] | None:
    """The chart markers of a program's iterations (``loader1 epoch 1`` where it started; x in seconds
    from ``t0``); none past ``limit`` iterations (a line per epoch would hide the data).  None where the
    summary has no iteration rows (a watch's: its epochs are marked from the heartbeat)."""
    rows = iterations(s)
    if not rows:
        return None
    out = []
    for r in rows[: limit + 1]:
        ts = r.get("started_at")
        if isinstance(ts, (int, float)) and not isinstance(ts, bool):
            label = f"{display.one_line(r.get('loader'), 32)} epoch {display.human_number(r.get('epoch'))}"
            out.append({"x": round(float(ts) - t0, 3), "label": label, "color": "#7f7f7f"})
    return out if len(rows) <= limit else []


__all__: Sequence[str] = (
    "iteration_label",
    "iterations",
    "iterations_table",
    "loaders_table",
    "loader_line",
    "loaders",
    "loop_words",
    "markers",
    "no_advice_line",
    "not_judged_words",
    "settings_table",
    "unmeasured",
    "worker_label",
    "worker_lines",
    "worker_table",
    "worker_words",
)
