"""report.html: one self-contained page per incident and per run summary, with charts over the timeline.

The page carries everything it needs inline: uPlot (a small, maintained canvas chart
library, MIT, vendored in report/vendor with its licence), its stylesheet, and the
data.  A Content-Security-Policy of ``default-src 'none'`` lets it fetch nothing, so
it works from a cluster's scratch disk or as a CI artifact and cannot call out.

Charts, over the samples before the incident (x: seconds relative to it, the incident
moment marked): open fds against the limit per process; RSS and USS per process;
/dev/shm used against its size; Mlocked; batch interval and data-wait share; GPU
utilisation where present.  Below: the findings with their evidence and remediation,
the processes and their stacks.

It is rendered outside the monitor: ``spawn_render`` starts a short-lived isolated
child (``python -I -m dlwatch.report.html DIR``) after an incident is written, and
``dlwatch report ID --html`` renders it when it is missing (bench/html_cost.py
measures both).  Every string from the report is escaped; the file is created
privately and replaces nothing it did not make.  The directory is opened once
(O_NOFOLLOW) and read, written and renamed in through that descriptor; a directory
of another user (root on a user's incident) gets nothing: the page goes to a
private temporary directory instead.

A run summary (``runs/<id>/``) gets the same page over the whole run (``render_summary_html``):
the same charts (``_charts``) with x from the block's start, one series per worker slot, epoch
starts and incidents marked; then the figures, workers, peaks, advice and preflight.  The watch's
run directory goes when the block ends, so ``spawn_render(dir, timeline_dir=...)`` hands the
child its timeline files open (``--timeline-fd``); the child thins them (``thin_samples``) into
``runs/<id>/timeline.jsonl``, which ``dlwatch report RUN-ID --html`` draws from later.
"""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import subprocess
import sys
import threading
from typing import Any, Callable, Iterable, Mapping, Sequence

from dlwatch.report import display, runview, schema
from dlwatch.report.render import shown_notes
from dlwatch.report.schema import Finding, Incident, RunSummary

HTML_NAME = "report.html"
RENDER_TIMEOUT_S = 60.0
# Scripts: only the page's own two (uPlot and the drawing code), allowed by their sha256, so that
# markup that got past the escaping (a class name, a frame, a message) still could not run a script.
_CSP = "default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; img-src data:"
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def _vendor(name: str) -> str:
    from importlib import resources

    return resources.files("dlwatch.report").joinpath("vendor", name).read_text(encoding="utf-8")


def incident_ts(report: Incident) -> float | None:
    try:
        return _dt.datetime.fromisoformat(str(report.created_at)).timestamp()
    except (TypeError, ValueError):
        return None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _samples(records: Any) -> list[Mapping[str, Any]]:
    out = [r for r in records if isinstance(r, Mapping) and r.get("kind") == "sample" and _num(r.get("ts")) is not None]
    out.sort(key=lambda r: r["ts"])
    return out


# A limit (the fd limit, /dev/shm's size) is drawn as a dashed reference only when the figure comes
# within this share of it: below, one scale for both would press the figure into a flat line at zero
# (20 fds under a limit of 20,000), so the figure gets its own scale and the title names the limit.
LIMIT_IN_REACH = 0.25


def _peak_share(pairs: Iterable[tuple[float | None, float | None]]) -> tuple[float, float] | None:
    """(highest value / its limit, that limit) over (value, limit) pairs; None without any limit."""
    best: tuple[float, float] | None = None
    for value, limit in pairs:
        if value is not None and limit is not None and limit > 0 and (best is None or value / limit > best[0]):
            best = (value / limit, limit)
    return best


def _share_text(share: float) -> str:
    return f"{share:.0%}" if share >= 0.01 else "under 1%"


def _charts(
    samples: Sequence[Mapping[str, Any]],
    slot_of: Callable[[Mapping[str, Any]], Any],
    label_of: Callable[[Any, Mapping[str, Any]], str],
) -> list[dict[str, Any]]:
    """The charts over ``samples`` (both pages): one series per process slot (``slot_of`` a sample's proc)."""
    slots: list[Any] = []
    labels: dict[Any, str] = {}
    per: list[dict[Any, Mapping[str, Any]]] = []
    for r in samples:
        row: dict[Any, Mapping[str, Any]] = {}
        procs = r.get("procs")
        for p in procs if isinstance(procs, list) else ():
            if isinstance(p, Mapping) and isinstance(p.get("pid"), int) and not p.get("gone"):
                slot = slot_of(p)
                if slot in row:
                    continue  # a worker being replaced: its successor shows from the next sample
                row[slot] = p
                if slot not in slots:
                    slots.append(slot)
                if slot not in labels:
                    labels[slot] = label_of(slot, p)
        per.append(row)
    slots = slots[:16]  # a legend people can read; the table below has every process

    def series(
        values: Callable[[int, Any], float | None], dash: bool = False, suffix: str = ""
    ) -> list[dict[str, Any]]:
        out = []
        for i, slot in enumerate(slots):
            ys = [values(j, slot) for j in range(len(per))]
            if any(y is not None for y in ys):
                out.append({"label": labels[slot] + suffix, "y": ys, "color": _COLORS[i % len(_COLORS)], "dash": dash})
        return out

    def field(key: str) -> Callable[[int, Any], float | None]:
        return lambda j, slot: _num(per[j][slot].get(key)) if slot in per[j] else None

    def cpu(j: int, slot: Any) -> float | None:  # cores: CPU seconds per second since the sample before
        if j == 0 or slot not in per[j] or slot not in per[j - 1]:
            return None
        a, b = per[j - 1][slot], per[j][slot]
        ca, cb, dt = _num(a.get("cpu_s")), _num(b.get("cpu_s")), samples[j]["ts"] - samples[j - 1]["ts"]
        if a.get("pid") != b.get("pid") or ca is None or cb is None or dt <= 0 or cb < ca:
            return None
        return round((cb - ca) / dt, 3)

    charts: list[dict[str, Any]] = []
    fds = series(field("num_fds"))
    if fds:
        limits = [
            max((v for v in (_num(p.get("fd_limit")) for p in row.values()) if v is not None), default=None)
            for row in per
        ]
        title = "Open file descriptors against the limit, per process"
        peak = _peak_share(((_num(p.get("num_fds")), _num(p.get("fd_limit"))) for row in per for p in row.values()))
        if peak is not None and peak[0] >= LIMIT_IN_REACH:
            fds.append({"label": "fd limit", "y": limits, "color": "#000000", "dash": True})
        elif peak is not None:  # drawn, the limit would flatten the fds into a line at zero
            title = f"Open file descriptors per process (limit {peak[1]:,.0f}, not drawn: peak {_share_text(peak[0])})"
        charts.append({"id": "fds", "title": title, "unit": "count", "series": fds})
    mem = series(field("rss"), suffix=" RSS") + series(field("uss"), dash=True, suffix=" USS")
    if mem:
        charts.append(
            {
                "id": "memory",
                "title": "Memory per process: RSS (solid) and USS (dashed)",
                "unit": "bytes",
                "series": mem,
            }
        )
    cpus = series(cpu)
    if cpus:
        charts.append(
            {"id": "cpu", "title": "CPU per process (cores: CPU seconds per second)", "unit": "cores", "series": cpus}
        )
    systems = [r.get("system") if isinstance(r.get("system"), Mapping) else {} for r in samples]
    total = [_num(s.get("shm_total")) for s in systems]
    free = [_num(s.get("shm_free")) for s in systems]
    used = [t - f if t is not None and f is not None else None for t, f in zip(total, free)]
    if any(v is not None for v in used):
        shm = [{"label": "/dev/shm used", "y": used, "color": _COLORS[1], "dash": False}]
        title = "/dev/shm used against its size"
        peak = _peak_share(zip(used, total))
        if peak is not None and peak[0] >= LIMIT_IN_REACH:
            shm.append({"label": "/dev/shm size", "y": total, "color": "#000000", "dash": True})
        elif peak is not None:
            title = f"/dev/shm used (size {display.human_bytes(peak[1])}, not drawn: peak {_share_text(peak[0])})"
        charts.append({"id": "shm", "title": title, "unit": "bytes", "series": shm})
    locked = [_num(s.get("mlocked")) for s in systems]
    if any(v is not None for v in locked):
        charts.append(
            {
                "id": "mlocked",
                "title": "Mlocked (pinned memory)",
                "unit": "bytes",
                "series": [{"label": "Mlocked", "y": locked, "color": _COLORS[4], "dash": False}],
            }
        )
    available = [_num(s.get("mem_available")) for s in systems]
    if any(v is not None for v in available):
        charts.append(
            {
                "id": "mem_available",
                "title": "MemAvailable (the machine's)",
                "unit": "bytes",
                "series": [{"label": "MemAvailable", "y": available, "color": _COLORS[2], "dash": False}],
            }
        )
    beats = [r.get("heartbeat") if isinstance(r.get("heartbeat"), Mapping) else {} for r in samples]
    if any(_num(b.get("batches")) is not None for b in beats):
        interval = [_num(b.get("last_interval_s")) or None for b in beats]
        share: list[float | None] = []
        prev: Mapping[str, Any] | None = None
        for b in beats:
            value = None
            if prev is not None:
                dw = (_num(b.get("data_wait_s")) or 0.0) - (_num(prev.get("data_wait_s")) or 0.0)
                ds = (_num(b.get("step_s")) or 0.0) - (_num(prev.get("step_s")) or 0.0)
                if dw + ds > 0:
                    value = round(100.0 * max(0.0, dw) / (max(0.0, dw) + max(0.0, ds)), 1)
            share.append(value)
            prev = b
        charts.append(
            {
                "id": "batches",
                "title": "Batch interval (left) and share of time waiting for data (right)",
                "unit": "seconds",
                "unit2": "percent",
                "series": [
                    {"label": "batch interval", "y": interval, "color": _COLORS[0], "dash": False},
                    {"label": "data-wait share", "y": share, "color": _COLORS[3], "dash": False, "scale": "pct"},
                ],
            }
        )

    def gpus_of(r: Mapping[str, Any]) -> list[Any]:
        g = r.get("gpus")
        return g if isinstance(g, list) else []

    gpu_idx: list[Any] = []
    for r in samples:
        for g in gpus_of(r):
            if isinstance(g, Mapping) and g.get("index") not in gpu_idx:
                gpu_idx.append(g.get("index"))
    if gpu_idx:
        gpu_series = []
        for i, idx in enumerate(gpu_idx[:16]):
            ys = [
                next(
                    (
                        _num(g.get("util_percent"))
                        for g in gpus_of(r)
                        if isinstance(g, Mapping) and g.get("index") == idx
                    ),
                    None,
                )
                for r in samples
            ]
            gpu_series.append({"label": f"GPU {idx}", "y": ys, "color": _COLORS[i % len(_COLORS)], "dash": False})
        charts.append({"id": "gpu", "title": "GPU utilisation", "unit": "percent", "series": gpu_series})
    return charts


def chart_data(report: Incident | Mapping[str, Any], timeline: Sequence[Any] | None = None) -> dict[str, Any]:
    """The charts' series from the timeline samples: plain lists, x in seconds relative to the incident."""
    r = schema.incident(report)
    records = timeline if timeline is not None else r.timeline or []
    samples = _samples(records)
    t0 = incident_ts(r)
    if t0 is None:
        t0 = samples[-1]["ts"] if samples else 0.0
    xs = [round(rec["ts"] - t0, 3) for rec in samples]
    roles: dict[int, str] = {}
    for p in r.processes or ():
        if isinstance(p.pid, int):
            roles[p.pid] = str(p.role or "process") + (f" {p.worker_id}" if p.worker_id is not None else "")

    def label(pid: Any, p: Mapping[str, Any]) -> str:
        return f"{roles.get(pid) or p.get('role') or 'process'} ({pid})"

    charts = _charts(samples, lambda p: p["pid"], label)
    markers = [{"x": 0.0, "label": "incident", "color": "#d62728"}]
    stall = _num(r.progress.get("stall_s")) if r.progress else None
    if stall:
        markers.append({"x": -round(stall, 3), "label": "last batch", "color": "#7f7f7f"})
    return {
        "x": xs,
        "charts": charts,
        "markers": markers,
        "pin": 0.0,
        "xlabel": "seconds relative to the incident",
        "xname": "s from incident",
    }


MAX_EPOCH_MARKERS = 20


def summary_chart_data(
    summary: RunSummary, timeline: Sequence[Any] | None, incident_times: Mapping[str, float] | None = None
) -> dict[str, Any]:
    """The run's charts: x in seconds since the block started; one series per worker slot (worker_id),
    so a worker restarted each epoch stays one line; epochs and incidents marked."""
    samples = _samples(timeline or [])
    started = None
    try:
        started = _dt.datetime.fromisoformat(str(summary.started_at)).timestamp()
    except (TypeError, ValueError):
        pass
    t0 = (
        started
        if started is not None and (not samples or started <= samples[0]["ts"])
        else (samples[0]["ts"] if samples else 0.0)
    )
    xs = [round(r["ts"] - t0, 3) for r in samples]
    worker_ids: dict[int, Any] = {}
    for w in summary.workers or ():
        if isinstance(w, Mapping) and isinstance(w.get("pid"), int) and isinstance(w.get("worker_id"), int):
            worker_ids[w["pid"]] = w["worker_id"]

    def slot(p: Mapping[str, Any]) -> Any:
        wid = worker_ids.get(p["pid"])
        return ("worker", wid) if wid is not None else ("pid", p["pid"])

    def label(s: Any, p: Mapping[str, Any]) -> str:
        return f"worker {s[1]}" if s[0] == "worker" else f"{p.get('role') or 'process'} ({s[1]})"

    charts = _charts(samples, slot, label)
    # `dlwatch run`: each loader iteration where it began (`loader1 epoch 1`), from its row; a watch's
    # epochs where a sample first saw them (the heartbeat counts them; one shorter than a poll is missed)
    markers: list[dict[str, Any]] = runview.markers(summary, t0, MAX_EPOCH_MARKERS) or []
    last_epochs = None
    for x, r in zip(xs, samples) if not runview.iterations(summary) else ():
        hb = r.get("heartbeat") if isinstance(r.get("heartbeat"), Mapping) else {}
        epochs = _num(hb.get("epochs"))
        if epochs is not None and last_epochs is not None and epochs > last_epochs:
            markers.append({"x": x, "label": f"epoch {int(epochs)}", "color": "#7f7f7f"})
        last_epochs = epochs if epochs is not None else last_epochs
    if len(markers) > MAX_EPOCH_MARKERS:
        markers = []  # a line per epoch would hide the data
    for name, ts in (incident_times or {}).items():
        markers.append({"x": round(ts - t0, 3), "label": f"incident {name}", "color": "#d62728"})
    return {
        "x": xs,
        "charts": charts,
        "markers": markers,
        "pin": None,
        "xlabel": "seconds since the watched block started",
        "xname": "s since start",
    }


# ---------------------------------------------------------------------------- page


def _e(v: Any) -> str:
    # html.escape(quote=True), without importing the html package (its entity tables cost the
    # monitor, which imports this module to start the render child, about half a MiB)
    return (
        str(v)
        .replace("&", "&amp;")
        .replace("<", "&lt;")
        .replace(">", "&gt;")
        .replace('"', "&quot;")
        .replace("'", "&#x27;")
    )


def _table(t: display.Table) -> str:
    if not t.rows:
        return "<p>none</p>"
    head = "".join(f"<th>{_e(h)}</th>" for h in t.headers)
    body = "".join("<tr>" + "".join(f"<td>{_e(c)}</td>" for c in r) + "</tr>" for r in t.rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def _evidence(ev: Any) -> str:
    out = ["<dl>"]
    for label, value in display.evidence_items(ev):
        out.append(f"<dt>{_e(label)}</dt><dd>")
        if isinstance(value, display.Table):
            out.append(_table(value))
        elif isinstance(value, list):
            out.append("<ul>" + "".join(f"<li><code>{_e(v)}</code></li>" for v in value) + "</ul>")
        else:
            out.append(_e(value))
        out.append("</dd>")
    out.append("</dl>")
    return "".join(out)


def _json_script(obj: Any) -> str:
    # inside <script>: no "</" can end the element early, no U+2028/9 surprises
    text = json.dumps(obj, separators=(",", ":"), allow_nan=False, default=str)
    return (
        text.replace("<", "\\u003c")
        .replace(">", "\\u003e")
        .replace("&", "\\u0026")
        .replace("\u2028", "\\u2028")
        .replace("\u2029", "\\u2029")
    )


def _clean(obj: Any) -> Any:
    if isinstance(obj, float) and obj != obj or obj in (float("inf"), float("-inf")):
        return None
    if isinstance(obj, dict):
        return {k: _clean(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_clean(v) for v in obj]
    return obj


_SCRIPT = r"""
(function () {
  var errors = [];
  window.addEventListener("error", function (e) { errors.push(String(e.message)); document.body.setAttribute("data-errors", errors.join("; ")); });
  var D = JSON.parse(document.getElementById("dlwatch-data").textContent);
  function bytes(v) {
    if (v == null) return "";
    var u = ["B", "KiB", "MiB", "GiB", "TiB"], i = 0, a = Math.abs(v);
    while (a >= 1024 && i < u.length - 1) { a /= 1024; v /= 1024; i++; }
    return (i ? v.toFixed(1) : v.toFixed(0)) + " " + u[i];
  }
  var FMT = {
    bytes: bytes, count: function (v) { return v == null ? "" : String(Math.round(v)); },
    seconds: function (v) { return v == null ? "" : (Math.abs(v) < 120 ? v.toPrecision(3) + " s" : (v / 60).toFixed(1) + " min"); },
    percent: function (v) { return v == null ? "" : v.toFixed(0) + "%"; },
    cores: function (v) { return v == null ? "" : v.toFixed(2); },
    rate: function (v) { return v == null ? "" : (Math.abs(v) >= 100 ? v.toFixed(0) : v.toPrecision(3)) + "/s"; }
  };
  function markers() {
    return { hooks: { draw: [function (u) {
      var ctx = u.ctx;
      D.markers.forEach(function (m) {
        var x = u.valToPos(m.x, "x", true);
        if (!(x >= u.bbox.left && x <= u.bbox.left + u.bbox.width)) return;
        ctx.save(); ctx.strokeStyle = m.color; ctx.fillStyle = m.color; ctx.lineWidth = 2 * devicePixelRatio;
        ctx.setLineDash([6, 4]); ctx.beginPath(); ctx.moveTo(x, u.bbox.top); ctx.lineTo(x, u.bbox.top + u.bbox.height); ctx.stroke();
        ctx.font = (12 * devicePixelRatio) + "px sans-serif"; ctx.fillText(m.label, x + 4, u.bbox.top + 14 * devicePixelRatio);
        ctx.restore();
      });
    }] } };
  }
  // Axes that fit the data: ticks at round steps of the data's own unit (bytes in powers of 1024, counts
  // in whole numbers), labelled with as many decimals as the step needs (so no two ticks read alike),
  // and a range from the data (all zero: up to one unit, not uPlot's 0-100).
  var UNITS = ["B", "KiB", "MiB", "GiB", "TiB"];
  function steps(base, least) {
    var out = [];
    for (var e = -6; e <= 9; e++) [1, 2, 5].forEach(function (m) { var v = m * Math.pow(10, e) * base; if (v >= least) out.push(v); });
    return out;
  }
  function decimals(step) { return Math.max(0, Math.min(6, Math.ceil(-Math.log10(step) - 1e-9))); }
  function axisOf(c) {
    var top = 0;
    c.series.forEach(function (s) { if (s.scale !== "pct") s.y.forEach(function (v) { if (v != null && Math.abs(v) > top) top = Math.abs(v); }); });
    if (c.unit === "bytes") {
      var i = 0; while (i < UNITS.length - 1 && top >= Math.pow(1024, i + 1)) i++;
      var base = Math.pow(1024, i);
      return { incrs: steps(base, 1), empty: 1024, label: function (v, step) { return (v / base).toFixed(decimals(step / base)) + " " + UNITS[i]; } };
    }
    if (c.unit === "seconds" && top >= 120) {
      return { incrs: steps(60, 0.6), empty: 60, label: function (v, step) { return (v / 60).toFixed(decimals(step / 60)) + " min"; } };
    }
    if (c.unit === "seconds") return { incrs: steps(1, 1e-6), empty: 1, label: function (v, step) { return v.toFixed(decimals(step)) + " s"; } };
    if (c.unit === "percent") return { incrs: steps(1, 1), empty: 100, fixed: [0, 100], label: function (v, step) { return v.toFixed(decimals(step)) + "%"; } };
    if (c.unit === "cores") return { incrs: steps(1, 0.001), empty: 1, label: function (v, step) { return v.toFixed(decimals(step)); } };
    return { incrs: steps(1, 1), empty: 1, label: function (v) { return String(Math.round(v)); } };
  }
  function rangeOf(ax) {
    return function (u, lo, hi) {
      if (ax.fixed) return ax.fixed;
      if (lo == null || hi == null) return [0, ax.empty];
      if (lo === hi) return lo === 0 ? [0, ax.empty] : [lo - Math.abs(lo) * 0.05, hi + Math.abs(hi) * 0.05];
      var r = uPlot.rangeNum(lo, hi, 0.1, true);
      return [lo >= 0 ? Math.max(0, r[0]) : r[0], r[1]];
    };
  }
  var drawn = 0;
  D.charts.forEach(function (c) {
    var el = document.getElementById("chart-" + c.id);
    var fmt = FMT[c.unit] || FMT.count;
    var ax = axisOf(c);
    var xs = D.x.slice(); if (D.pin != null) xs.push(D.pin);  // the incident moment is on every axis
    var data = [xs];
    var series = [{ label: D.xname }];
    c.series.forEach(function (s) {
      var y = s.y.slice(); if (D.pin != null) y.push(null); data.push(y);
      series.push({ label: s.label, stroke: s.color, width: 2, dash: s.dash ? [6, 4] : undefined, scale: s.scale || "y",
                    value: function (u, v) { return (s.scale === "pct" ? FMT.percent : fmt)(v); }, spanGaps: false,
                    points: { show: !!D.points || D.x.length < 3 } });
    });
    var axes = [{ label: D.xlabel }, { incrs: ax.incrs, size: 90, values: function (u, vs, i, space, step) {
      var labels = vs.map(function (v) { return v == null ? "" : ax.label(v, step); });
      el.setAttribute("data-y-ticks", JSON.stringify(labels));  // what the axis reads, for people's tools and tests
      return labels;
    } }];
    var scales = { x: { time: false }, y: { range: rangeOf(ax) } };
    if (c.unit2) { axes.push({ side: 1, scale: "pct", values: function (u, vs) { return vs.map(FMT.percent); }, grid: { show: false } });
                   scales.pct = { range: [0, 100] }; }
    new uPlot({ width: Math.min(1000, document.body.clientWidth - 40), height: 260, title: c.title, plugins: [markers()],
                scales: scales, axes: axes, series: series }, data, el);
    drawn++;
  });
  document.body.setAttribute("data-charts-drawn", String(drawn));
})();
"""

_STYLE = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:20px;color:#222;max-width:1100px}
h1{font-size:20px;margin:0 0 6px} h2{font-size:17px;margin:26px 0 8px;border-bottom:1px solid #ddd}
.headline{background:#fff4f4;border-left:4px solid #d62728;padding:8px 12px;margin:10px 0}
.headline div{margin:2px 0} table{border-collapse:collapse;margin:6px 0}
td,th{border:1px solid #ddd;padding:3px 8px;text-align:left;font-size:13px;vertical-align:top} th{background:#f5f5f5}
dt{font-weight:600;margin-top:6px} dd{margin:2px 0 6px 18px} pre{background:#f7f7f7;padding:8px;overflow:auto;font-size:12px}
.chart{margin:10px 0 18px} .muted{color:#777} .headline.calm{background:#f3faf3;border-left-color:#2ca02c}
"""


def _script_hash(code: str) -> str:
    import base64
    import hashlib

    return "'sha256-" + base64.b64encode(hashlib.sha256(code.encode("utf-8")).digest()).decode("ascii") + "'"


@functools.lru_cache(maxsize=1)
def _scripts() -> tuple[str, str]:
    """The page's own scripts, in page order: what the policy allows by hash, nothing else."""
    return _vendor("uPlot.iife.min.js"), _SCRIPT


def csp() -> str:
    """The page's Content-Security-Policy: nothing fetched, only its own scripts run."""
    return _CSP.format(hashes=" ".join(_script_hash(code) for code in _scripts()))


def _page_head(title: str) -> list[str]:
    """Doctype, the no-fetch policy, the styles and the heading; ``title`` already escaped."""
    return [
        '<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{csp()}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>{title}</title>",
        f"<style>{_vendor('uPlot.min.css')}{_STYLE}</style></head><body>",
        f"<h1>{title}</h1>",
    ]


def _page_end(parts: list[str], notes: Any, data: Any) -> str:
    """The notes, the chart data (as JSON in a non-executing script tag), uPlot and the drawing code."""
    if notes and isinstance(notes, list):
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    parts.append(f'<script id="dlwatch-data" type="application/json">{_json_script(data)}</script>')
    uplot, draw = _scripts()  # exactly the text the policy hashed
    parts.append(f"<script>{uplot}</script>")
    parts.append(f"<script>{draw}</script></body></html>")
    return "".join(parts) + "\n"


def page(title: str, body: Sequence[str], notes: Any, data: Mapping[str, Any]) -> str:
    """A page under the same rules as report.html (one file, nothing fetched, only its own scripts run).

    ``title`` is text (escaped here); ``body`` is markup already escaped with :func:`escape`;
    ``data`` the charts' data (``x``, ``charts``, ``markers``, ``xlabel``, ``xname``; ``points``
    to mark every point), drawn by the same code as report.html's charts.  Used by the tune report."""
    return _page_end(_page_head(_e(title)) + list(body), notes, _clean(dict(data)))


def escape(v: Any) -> str:
    return _e(v)


def table_html(t: display.Table) -> str:
    return _table(t)


def kv_table_html(rows: Sequence[tuple[str, str]]) -> str:
    return _kv_table(rows)


def render_html(report: Incident | Mapping[str, Any], timeline: Sequence[Any] | None = None) -> str:
    """The page for one incident (report as loaded and redacted)."""
    r = schema.incident(report)
    data = _clean(chart_data(r, timeline))
    findings = r.findings or ()
    procs = r.processes or ()
    parts = _page_head(f"dlwatch incident {_e(r.id)}") + [
        '<div class="headline">',
        f"<div><b>{_e(str(r.trigger or '?').upper())}</b>"
        + (f" ({_e(r.classification)})" if r.classification else "")
        + f": {_e(r.summary or '')}</div>",
    ]
    if findings:
        top = findings[0]
        parts.append(
            f"<div>Top finding: <b>{_e(top.title)}</b> (<code>{_e(top.playbook)}</code>, "
            f"confidence {_e(display.percent(top.confidence))})</div>"
        )
    exc = r.exception
    if exc:
        # the message's last line: a worker's exception carries its whole traceback in the message
        last = ([line for line in str(exc.message or "").splitlines() if line.strip()] or [""])[-1]
        parts.append(f"<div>Exception: <code>{_e(exc.type)}</code>: {_e(display.one_line(last, 300))}</div>")
    parts.append(f'<div class="muted">{_e(r.created_at)} on {_e(r.host)}, pid {_e(r.pid)}</div></div>')
    parts.append("<h2>Timeline</h2>")
    if data["charts"]:
        parts.append(
            f'<p class="muted">{len(data["x"])} samples before the incident; the dashed red line is '
            "the incident, the grey one the last batch.</p>"
        )
        for c in data["charts"]:
            parts.append(f'<div class="chart" id="chart-{_e(c["id"])}"></div>')
    else:
        parts.append("<p>No samples were recorded before this incident.</p>")
    parts.append("<h2>Findings</h2>")
    parts += _findings_html(findings, "No playbook matched.")
    if exc and exc.traceback:
        parts.append(f"<h2>Traceback</h2><pre>{_e(str(exc.traceback).rstrip())}</pre>")
    if procs:
        parts.append("<h2>Processes</h2>")
        parts.append(_table(display.process_table(procs)))
        excerpts = display.process_excerpts(procs, n=12)
        if excerpts:
            parts.append("<h2>Stacks</h2>")
            for who, frames in excerpts:
                parts.append(f"<p><b>{_e(who)}</b> (innermost first)</p><pre>{_e(chr(10).join(frames))}</pre>")
    return _page_end(parts, shown_notes(r) if r.notes is not None else None, data)


def _headline_rows(s: RunSummary) -> list[tuple[str, str]]:
    loop: Mapping[str, Any] = s.loop or {}
    first: Mapping[str, Any] = loop["first_batch_s"] if isinstance(loop.get("first_batch_s"), Mapping) else {}
    per_epoch: list[Any] = first["per_epoch"] if isinstance(first.get("per_epoch"), list) else []
    shown = ", ".join(f"{i}: {display.human_seconds(v)}" for i, v in enumerate(per_epoch[:40], 1))
    if len(per_epoch) > 40:
        shown += f", ... ({len(per_epoch) - 40} more epochs; mean {display.human_seconds(first.get('mean_s'))})"
    rows = [
        ("batches", display.human_number(loop.get("batches"))),
        *(  # `dlwatch run` with several loaders: its epochs are each loader's (see Loaders and iterations)
            [("epochs", display.human_number(loop.get("epochs")))]
            if len(runview.loaders(s)) < 2
            else [
                ("loader iterations", display.human_number(loop.get("iterations"))),
                *(
                    (f"epochs of {e.get('loader')}", display.human_number(e.get("iterations")))
                    for e in runview.loaders(s)
                ),
            ]
        ),
        ("wall time of the block", display.human_seconds(loop.get("wall_s"))),
        ("data-wait share (whole loop)", display.percent(loop.get("data_wait_share"))),
        (
            "data-wait share (steady: after each epoch's first batch)",
            display.percent(loop.get("steady_data_wait_share")),
        ),
        ("loop-body share", display.percent(loop.get("body_share"))),
        ("steady batch interval", display.human_seconds(loop.get("steady_batch_s"))),
        ("first-batch latency per epoch", shown or "-"),
    ]
    cpus = s.cpus if isinstance(s.cpus, Mapping) else {}  # not checked as the summary is loaded
    if cpus:
        rows.append(
            (
                "CPUs this process may use",
                f"{display.human_number(cpus.get('usable'))} (affinity "
                f"{display.human_number(cpus.get('affinity'))}, cgroup quota "
                f"{display.human_number(cpus.get('cgroup_quota'))}, machine {display.human_number(cpus.get('cpu_count'))})",
            )
        )
    return rows


def _kv_table(rows: Sequence[tuple[str, str]]) -> str:
    return (
        "<table><tbody>" + "".join(f"<tr><th>{_e(k)}</th><td>{_e(v)}</td></tr>" for k, v in rows) + "</tbody></table>"
    )


def _main_table(s: RunSummary) -> display.Table:
    """The training process alone (a program's workers are listed by iteration)."""
    table = _workers_table(s)
    return display.Table(table.headers, tuple(r for r in table.rows if r[0] == "training process"))


def _workers_table(s: RunSummary) -> display.Table:
    rows = []
    states = ("running", "waiting_for_work", "blocked_put", "io", "sleeping")
    for w in s.workers or ():
        if not isinstance(w, Mapping):
            continue
        share: Mapping[str, Any] = w["state_share"] if isinstance(w.get("state_share"), Mapping) else {}
        rows.append(
            (
                f"worker {display.human_number(w.get('worker_id'))}",
                display.human_number(w.get("pid")),
                display.human_number(w.get("cpu_util")),
                *(display.percent(share.get(k)) for k in states),
                display.human_bytes(w.get("rss_peak")),
                display.human_bytes(w.get("uss_peak")),
            )
        )
    main = s.main if isinstance(s.main, Mapping) else None
    if main:
        rows.append(
            (
                "training process",
                display.human_number(main.get("pid")),
                display.human_number(main.get("cpu_util")),
                *("" for _ in states),
                display.human_bytes(main.get("rss_peak")),
                display.human_bytes(main.get("uss_peak")),
            )
        )
    return display.Table(
        (
            "process",
            "pid",
            "CPU (cores)",
            "running",
            "waiting for work",
            "blocked on put",
            "I/O",
            "sleeping",
            "RSS peak",
            "USS peak",
        ),
        tuple(rows),
    )


def _findings_html(
    findings: Sequence[Finding], none: str, hint: Callable[[Finding], str | None] | None = None
) -> list[str]:
    """Findings with their evidence (through display) and remediation: an incident's, a summary's advice
    (``hint``: a line under a finding, the `dlwatch tune` command for advice it answers)."""
    if not findings:
        return [f"<p>{_e(none)}</p>"]
    parts = []
    for i, f in enumerate(findings, 1):
        parts.append(
            f"<h3>{i}. {_e(f.title)} (<code>{_e(f.playbook)}</code>, "
            f"confidence {_e(display.percent(f.confidence))})</h3>"
        )
        parts.append(_evidence(f.evidence or {}))
        if f.remediation:
            parts.append(f"<p><b>What to do</b></p><pre>{_e(str(f.remediation).strip())}</pre>")
        line = hint(f) if hint is not None else None
        if line:
            parts.append(f"<p>{_e(line)}</p>")
    return parts


def render_summary_html(
    summary: RunSummary | Mapping[str, Any],
    timeline: Sequence[Any] | None = None,
    incident_times: Mapping[str, float] | None = None,
) -> str:
    """The page for one run summary (as loaded and redacted), with the run's thinned timeline."""
    from dlwatch.report import summary as sm

    s = schema.run_summary(summary)
    data = _clean(summary_chart_data(s, timeline, incident_times))
    advice = s.advice or ()
    preflight = s.preflight or ()
    parts = _page_head(f"dlwatch run summary {_e(s.id)}") + [
        '<div class="headline' + (" calm" if not advice else "") + '">'
    ]
    if advice:
        parts.append(
            "<div><b>ADVICE</b>: "
            + "; ".join(f"{_e(f.title)} (<code>{_e(f.playbook)}</code>)" for f in advice)
            + "</div>"
        )
    else:
        parts.append(f"<div><b>No advice</b>: {_e(runview.no_advice_line(s).removeprefix('No advice: '))}</div>")
    try:
        loop_line = sm.loop_line(s)
    except Exception as exc:  # a summary edited or damaged: the page says so, the rest is drawn
        loop_line = f"loop figures damaged ({type(exc).__name__})"
    parts.append(f"<div>{_e(display.one_line(loop_line, 500))}</div>")
    if s.incidents:
        parts.append(
            "<div>Incidents in this run: " + ", ".join(f"<code>{_e(i)}</code>" for i in s.incidents) + "</div>"
        )
    parts.append(
        f'<div class="muted">ended {_e(s.ended)}; started {_e(s.started_at)}, written '
        f"{_e(s.created_at)} on {_e(s.host)}, pid {_e(s.pid)}</div></div>"
    )
    parts.append("<h2>Timeline</h2>")
    if data["charts"]:
        parts.append(
            f'<p class="muted">{len(data["x"])} samples over the run (thinned evenly to at most '
            f"{MAX_POINTS + 1}; the peaks below are exact). Grey dashed lines: an epoch starts; red: an incident.</p>"
        )
        for c in data["charts"]:
            parts.append(f'<div class="chart" id="chart-{_e(c["id"])}"></div>')
    else:
        parts.append(
            "<p>No samples were kept for this run (the monitor took none, or report.html was turned "
            "off with DLWATCH_HTML=0 when the run ended, so no render child kept them).</p>"
        )
    parts.append("<h2>Figures</h2>")
    parts.append(_kv_table(_headline_rows(s)))
    loaders = runview.loaders(s)
    if loaders:  # `dlwatch run`: the program's loaders, its iterations, every worker of each
        parts.append("<h2>Loaders and iterations</h2>")
        parts.append(_table(runview.loaders_table(s)))
        iterations = runview.iterations_table(s)
        if iterations.rows:
            parts.append(_table(iterations))
    parts.append("<h2>Workers</h2>")
    each = runview.worker_table(s)
    table = _workers_table(s) if each is None else _main_table(s)
    if each is not None:
        parts.append(_table(each) if each.rows else "<p>No worker processes were started.</p>")
    if table.rows:
        parts.append(_table(table))
    elif each is None:
        parts.append("<p>No worker processes were observed.</p>")
    try:
        peaks = list(sm._peak_lines(s))
    except Exception as exc:
        peaks = [f"peak figures damaged ({type(exc).__name__})"]
    parts.append("<h2>Peaks</h2>")
    parts.append("<ul>" + "".join(f"<li>{_e(line)}</li>" for line in peaks) + "</ul>" if peaks else "<p>none</p>")
    parts.append("<h2>Advice</h2>")
    parts += _findings_html(advice, runview.no_advice_line(s), lambda f: sm.tune_hint(s, f))
    unjudged = runview.not_judged_words(s)
    if advice and unjudged:
        parts.append(f"<p>Too short to judge {_e(unjudged)}.</p>")
    parts.append("<h2>Preflight</h2>")
    parts += _findings_html(preflight, "No preflight finding.")
    loader = s.loader
    settings = runview.settings_table(s)
    if settings is not None:  # `dlwatch run` with several loaders: each one's settings
        parts.append("<h2>Loaders' settings</h2>")
        parts.append(_table(settings))
    elif isinstance(loader, Mapping) and loader:  # unchecked in a summary as it is loaded
        parts.append("<h2>Loader</h2>")
        parts.append(_kv_table([(str(k), display.scalar(str(k), v)) for k, v in loader.items()]))
    return _page_end(parts, shown_notes(s) if isinstance(s.notes, list) else s.notes, data)


def _open_dir(path: str) -> int:
    """The incident's or run's directory, opened once: every read, write and rename below is relative to it,
    so swapping the path for a link after the read changes nothing (O_NOFOLLOW refuses a link now)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)


def is_ours(dir_fd: int) -> bool:
    """Whether the open directory belongs to the effective uid: only then is the page written into it."""
    return os.fstat(dir_fd).st_uid == os.geteuid()


def _write_elsewhere(page: str, name: str) -> str:
    """Another user's directory is theirs to swap: the page goes to a fresh private directory instead."""
    import tempfile

    from dlwatch._fs import write_private

    private = tempfile.mkdtemp(prefix="dlwatch-html-")  # 0700, a new name: nothing planted in advance
    path = os.path.join(private, name)
    write_private(path, page)
    return path


def _write_page(dir_fd: int, directory: str, page: str, name: str = HTML_NAME) -> str:
    """Write ``page`` as ``name`` in the open directory (privately, atomically); return its path.

    Into a directory of another user (root on a user's incident) nothing is written: the page goes
    to a private temporary file, whose path is returned (the caller says so)."""
    from dlwatch._fs import replace_private
    from dlwatch.redact import outbound_bytes

    if not is_ours(dir_fd):
        return _write_elsewhere(page, name)
    replace_private(name, outbound_bytes(page), dir_fd=dir_fd)  # replaces the name, never follows it
    return os.path.join(directory, name)


def write_html(incident_dir: str) -> str:
    """Render ``incident_dir``'s report.html (privately, atomically); return its path (see _write_page)."""
    from dlwatch.redact import outbound
    from dlwatch.report import store

    fd = _open_dir(incident_dir)
    try:
        report = outbound(store.load_report(incident_dir, dir_fd=fd))
        return _write_page(fd, incident_dir, render_html(report))
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- the run summary's page

TIMELINE_NAME = "timeline.jsonl"  # runs/<id>/timeline.jsonl: the run's samples, thinned, for the charts
MAX_POINTS = 500  # samples kept for a run's charts: the page stays well under 1 MB for any run length
MAX_TIMELINE_BYTES = 16 << 20
_KEEP = {
    "heartbeat": ("batches", "epochs", "data_wait_s", "step_s", "last_interval_s"),
    "system": ("shm_total", "shm_free", "mlocked", "mem_available"),
    "procs": ("pid", "role", "num_fds", "fd_limit", "rss", "uss", "cpu_s", "gone"),
    "gpus": ("index", "util_percent"),
}


def _slim(record: Mapping[str, Any]) -> dict[str, Any]:
    """A sample with only what the charts draw."""
    out: dict[str, Any] = {"kind": "sample", "ts": record.get("ts")}
    for key, fields in _KEEP.items():
        v = record.get(key)
        if isinstance(v, Mapping):
            out[key] = {k: v[k] for k in fields if k in v}
        elif isinstance(v, list):
            out[key] = [{k: p[k] for k in fields if k in p} for p in v if isinstance(p, Mapping)]
    return out


def thin_samples(lines: Iterable[bytes], limit: int = MAX_POINTS) -> list[dict[str, Any]]:
    """Every k-th sample of a timeline of any length, k doubling as it grows: at most 2 x limit held."""
    kept: list[dict[str, Any]] = []
    stride, seen, last = 1, 0, None
    for line in lines:
        if b'"sample"' not in line:
            continue  # events: the summary has what they said
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if not isinstance(record, dict) or record.get("kind") != "sample" or _num(record.get("ts")) is None:
            continue
        last = record
        if seen % stride == 0:
            kept.append(_slim(record))
            last = None
            if len(kept) >= 2 * limit:
                kept = kept[::2]
                stride *= 2
        seen += 1
    if len(kept) > limit:
        kept = kept[:: -(-len(kept) // limit)]
    if last is not None:  # the run's end is always on the chart
        kept.append(_slim(last))
    return kept


def _read_fd_lines(fd: int) -> Iterable[bytes]:
    with os.fdopen(fd, "rb") as f:
        yield from f


def _read_kept_timeline(run_dir: str, dir_fd: int) -> list[dict[str, Any]]:
    from dlwatch.errors import DlwatchError
    from dlwatch.report import store

    try:  # a regular file, no link, capped: anything else is no samples, never a lost page
        raw = store.read_regular(os.path.join(run_dir, TIMELINE_NAME), MAX_TIMELINE_BYTES, dir_fd=dir_fd)
    except (DlwatchError, OSError):
        return []
    return thin_samples(raw.splitlines())


def _incident_times(run_dir: str, summary: Mapping[str, Any]) -> dict[str, float]:
    """When each incident of the run happened (its report.json, next to runs/): markers on the charts."""
    from dlwatch.report import store

    out: dict[str, float] = {}
    base = os.path.dirname(os.path.dirname(os.path.abspath(run_dir)))
    for name in (summary.get("incidents") or ())[:20]:
        if not isinstance(name, str) or not name or name.startswith(".") or os.sep in name:
            continue
        try:
            ts = incident_ts(store.load_incident(os.path.join(base, name)))
        except Exception:
            continue
        if ts is not None:
            out[name] = ts
    return out


def write_summary_html(run_dir: str, timeline_fds: Sequence[int] = ()) -> str:
    """Render ``runs/<id>/report.html``; return its path.

    ``timeline_fds``: the run's timeline files (oldest first), opened by the monitor and handed
    over, since the watch's run directory is removed when the block ends; their samples are
    thinned and kept next to the summary (timeline.jsonl) so that the page can be drawn again.
    Without them the kept copy is read.
    """
    from dlwatch._fs import json_line, replace_private
    from dlwatch.redact import outbound
    from dlwatch.report import store

    fd = _open_dir(run_dir)
    try:
        summary = outbound(store.load_summary(run_dir, dir_fd=fd))
        if timeline_fds:

            def lines() -> Iterable[bytes]:
                for tfd in timeline_fds:
                    yield from _read_fd_lines(tfd)

            timeline = thin_samples(lines())
            if is_ours(fd):  # kept for later drawings only in a directory of ours
                replace_private(TIMELINE_NAME, b"".join(json_line(r) for r in timeline), dir_fd=fd)
        else:
            timeline = _read_kept_timeline(run_dir, fd)
        page = render_summary_html(summary, outbound(timeline), _incident_times(run_dir, summary))
        return _write_page(fd, run_dir, page)
    finally:
        os.close(fd)


def is_summary_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "summary.json")) and not os.path.exists(os.path.join(path, "report.json"))


def write_any(path: str, timeline_fds: Sequence[int] = ()) -> str:
    """An incident's or a run summary's report.html, whichever ``path`` holds."""
    if is_summary_dir(path):
        return write_summary_html(path, timeline_fds)
    return write_html(path)


def _open_timeline(run_dir: str) -> list[int]:
    """The watch's timeline files (rotated one first), opened read-only: regular files of ours, one link."""
    import stat

    fds = []
    for name in ("timeline.1.jsonl", "timeline.jsonl"):
        try:
            fd = os.open(os.path.join(run_dir, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
        except OSError:
            continue
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
            os.close(fd)
            continue
        fds.append(fd)
    return fds


def spawn_render(target_dir: str, timeline_dir: str | None = None) -> subprocess.Popen[bytes] | None:
    """Render report.html in a short-lived isolated child; never raises, never waits.

    ``target_dir``: an incident, or a run summary's directory; for a summary, ``timeline_dir`` is
    the watch's run directory, whose timeline files are handed to the child open (the directory
    may be gone before the child reads them).  A daemon thread reaps the child, so no zombie
    stays behind the monitor.
    """
    if os.environ.get("DLWATCH_HTML", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    fds: list[int] = []
    try:
        from dlwatch._spawn import python_argv, sigint_blocked

        fds = _open_timeline(timeline_dir) if timeline_dir else []
        args = [os.path.abspath(target_dir)]
        for fd in fds:
            args += ["--timeline-fd", str(fd)]
        with sigint_blocked():  # the page is finished even when the user's Ctrl-C reaches the whole group
            proc = subprocess.Popen(
                python_argv(module="dlwatch.report.html", args=args, ignore_sigint=True),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                close_fds=True,
                pass_fds=fds,
            )
    except Exception:
        return None
    finally:
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass

    def reap() -> None:
        try:
            proc.wait(RENDER_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    threading.Thread(target=reap, name="dlwatch-html-reaper", daemon=True).start()
    return proc


def main(argv: Iterable[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = "usage: python -m dlwatch.report.html INCIDENT_OR_RUN_DIR [--timeline-fd FD]..."
    if not args:
        print(usage, file=sys.stderr)
        return 2
    target, rest, fds = args[0], args[1:], []
    while rest:
        if rest[0] != "--timeline-fd" or len(rest) < 2 or not (rest[1].isascii() and rest[1].isdigit()):
            print(usage, file=sys.stderr)
            return 2
        fds.append(int(rest[1]))
        rest = rest[2:]
    try:
        write_any(target, fds)
    except Exception as exc:
        from dlwatch.redact import outbound

        print(outbound(f"dlwatch: could not write {HTML_NAME}: {type(exc).__name__}: {exc}"), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
