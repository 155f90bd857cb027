"""The tune report: one self-contained page with throughput and memory against ``num_workers``.

Drawn from the result's JSON document (``TuneResult.to_dict()``, what ``--json`` writes) under
report.html's page rules (``dlwatch.report.html.page``: everything inline, a Content-Security-
Policy that fetches nothing and runs only the page's own scripts, every string escaped).
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from dlwatch.report import display, html
from dlwatch.report.html import escape as _e

_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b")


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def chart_data(doc: Mapping[str, Any]) -> dict[str, Any]:
    """Throughput (one series per prefetch_factor) and memory against num_workers; the current and
    recommended worker counts marked."""
    rows = [r for r in doc.get("rows") or () if isinstance(r, Mapping)]
    ok = [r for r in rows if r.get("status") == "ok" and not r.get("pin_memory")]
    xs = sorted({int(r["num_workers"]) for r in ok if isinstance(r.get("num_workers"), int)})

    def best(pick: Sequence[Mapping[str, Any]], n: int, key: str) -> float | None:
        vals = [_num(r.get(key)) for r in pick if r.get("num_workers") == n]
        vals = [v for v in vals if v is not None]
        return max(vals) if vals else None

    zero = [r for r in ok if r.get("num_workers") == 0]
    prefetches = sorted({int(r["prefetch_factor"]) for r in ok if isinstance(r.get("prefetch_factor"), int)})
    rate_series = []
    for i, pf in enumerate(prefetches):
        pick = [r for r in ok if r.get("prefetch_factor") == pf] + zero
        ys = [best(pick, n, "batches_per_s") for n in xs]
        if sum(y is not None for y in ys) >= 1:
            rate_series.append(
                {"label": f"prefetch_factor={pf}", "y": ys, "color": _COLORS[i % len(_COLORS)], "dash": False}
            )
    if not rate_series and zero:
        rate_series.append({"label": "num_workers=0", "y": [best(zero, n, "batches_per_s") for n in xs]})
        rate_series[0].update(color=_COLORS[0], dash=False)
    mem_series = []
    for i, (key, label, dash) in enumerate(
        (
            ("worker_uss_total", "workers' USS (private memory)", False),
            ("shm_peak", "/dev/shm above the start", False),
        )
    ):
        ys = [best(ok, n, key) for n in xs]
        if any(y is not None for y in ys):
            mem_series.append({"label": label, "y": ys, "color": _COLORS[(i + 2) % len(_COLORS)], "dash": dash})
    charts = []
    if rate_series:
        charts.append(
            {
                "id": "throughput",
                "title": "Steady throughput (batches/s) against num_workers",
                "unit": "rate",
                "series": rate_series,
            }
        )
    if mem_series:
        charts.append(
            {"id": "memory", "title": "Memory at its peak against num_workers", "unit": "bytes", "series": mem_series}
        )
    markers = []
    cur = (doc.get("current") or {}).get("num_workers")
    recd = (doc.get("recommended") or {}).get("num_workers") if doc.get("recommended") else None
    if isinstance(cur, int):
        markers.append({"x": cur, "label": "current", "color": "#7f7f7f"})
    if isinstance(recd, int):
        markers.append({"x": recd, "label": "recommended", "color": "#2ca02c"})
    return {
        "x": xs,
        "charts": charts,
        "markers": markers,
        "pin": None,
        "points": True,
        "xlabel": "num_workers",
        "xname": "num_workers",
    }


_COLUMNS = (
    ("num_workers", "workers", str),
    ("prefetch_factor", "prefetch", str),
    ("persistent_workers", "persistent", str),
    ("pin_memory", "pin", str),
    ("batches_per_s", "batches/s", lambda v: display.human_number(v)),
    ("batches_per_s_sd", "±", lambda v: display.human_number(v)),
    ("runs", "runs", str),
    ("first_batch_s", "first batch", display.human_seconds),
    ("epoch_start_s", "epoch start", display.human_seconds),
    ("cpu_cores", "cores", lambda v: display.human_number(v)),
    ("worker_rss_total", "worker RSS", display.human_bytes),
    ("worker_uss_total", "worker USS", display.human_bytes),
    ("worker_uss_max", "USS per worker (max)", display.human_bytes),
    ("shm_peak", "/dev/shm peak", display.human_bytes),
    ("fds_peak", "fds", str),
    ("fits", "fits", str),
    ("data_wait_share", "data wait", display.percent),
    ("status", "status", str),
    ("reason", "why", str),
)


def _rows_table(rows: Sequence[Mapping[str, Any]]) -> display.Table:
    out = []
    for r in rows:
        mark = ("recommended " if r.get("recommended") else "") + ("current" if r.get("current") else "")
        cells = [mark.strip()]
        for key, _, fmt in _COLUMNS:
            v = r.get(key)
            cells.append("-" if v is None else str(fmt(v)))  # type: ignore[operator]
        out.append(tuple(cells))
    return display.Table(("",) + tuple(h for _, h, _ in _COLUMNS), tuple(out))


def render_page(doc: Mapping[str, Any]) -> str:
    loader = doc.get("loader") or {}
    best = doc.get("best") or {}
    title = f"dlwatch tune: {loader.get('dataset', '?')}"
    parts = ['<div class="headline calm">']
    if doc.get("recommended") is None:
        parts.append("<div><b>No recommendation</b></div>")
    elif best:
        kw = ", ".join(f"{k}={v!r}" for k, v in best.items())
        parts.append(f"<div><b>Recommended</b>: <code>DataLoader(..., {_e(kw)})</code></div>")
    else:
        parts.append("<div><b>Recommended</b>: keep the loader as it is</div>")
    parts.append("<ul>" + "".join(f"<li>{_e(w)}</li>" for w in doc.get("why") or ()) + "</ul>")
    interrupted = " (interrupted: the best so far)" if doc.get("interrupted") else ""
    step = f"; step {doc['step_s'] * 1000:g} ms" if isinstance(doc.get("step_s"), (int, float)) else ""
    parts.append(
        f'<div class="muted">{_e(doc.get("elapsed_s"))} s of a {_e(doc.get("budget_s"))} s budget{_e(step)}'
        f"{_e(interrupted)}; written {_e(doc.get('created_at'))} on {_e(doc.get('host'))}</div></div>"
    )
    data = chart_data(doc)
    parts.append("<h2>Throughput and memory against num_workers</h2>")
    if data["charts"]:
        for c in data["charts"]:
            parts.append(f'<div class="chart" id="chart-{_e(c["id"])}"></div>')
    else:
        parts.append("<p>No candidate finished a steady window.</p>")
    parts.append("<h2>Candidates</h2>")
    parts.append(html.table_html(_rows_table([r for r in doc.get("rows") or () if isinstance(r, Mapping)])))
    if doc.get("advice"):
        parts.append("<h2>Advice (not measured)</h2>")
        parts.append("<ul>" + "".join(f"<li>{_e(a)}</li>" for a in doc["advice"]) + "</ul>")
    if doc.get("restricted"):
        parts.append("<h2>IterableDataset</h2>")
        parts.append(f"<p>{_e((doc['restricted'] or {}).get('reason'))}</p>")
    machine = doc.get("machine") or {}
    parts.append("<h2>Machine and loader</h2>")
    parts.append(
        html.kv_table_html(
            [(str(k), display.scalar(str(k), v)) for k, v in {**loader, **machine}.items() if not isinstance(v, dict)]
        )
    )
    return html.page(title, parts, list(doc.get("notes") or ()), data)
