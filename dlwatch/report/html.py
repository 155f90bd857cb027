"""report.html: one self-contained page per incident, with charts over the timeline.

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
privately and replaces nothing it did not make.
"""

from __future__ import annotations

import datetime as _dt
import html
import json
import os
import secrets
import subprocess
import sys
import threading
from importlib import resources
from typing import Any, Iterable, Mapping, Sequence

from dlwatch.report import display

HTML_NAME = "report.html"
RENDER_TIMEOUT_S = 60.0
_CSP = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; img-src data:"
_COLORS = ("#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
           "#bcbd22", "#17becf")


def _vendor(name: str) -> str:
    return resources.files("dlwatch.report").joinpath("vendor", name).read_text(encoding="utf-8")


def incident_ts(report: Mapping[str, Any]) -> float | None:
    try:
        return _dt.datetime.fromisoformat(str(report.get("created_at"))).timestamp()
    except (TypeError, ValueError):
        return None


def _num(v: Any) -> float | None:
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def _proc_label(p: Mapping[str, Any], roles: Mapping[int, str]) -> str:
    pid = p.get("pid")
    return roles.get(pid, str(p.get("role") or "process")) + f" ({pid})" if isinstance(pid, int) else "?"


def chart_data(report: Mapping[str, Any], timeline: Sequence[Any] | None = None) -> dict[str, Any]:
    """The charts' series from the timeline samples: plain lists, x in seconds relative to the incident."""
    records = timeline if timeline is not None else report.get("timeline") or []
    samples = [r for r in records if isinstance(r, Mapping) and r.get("kind") == "sample" and _num(r.get("ts")) is not None]
    samples.sort(key=lambda r: r["ts"])
    t0 = incident_ts(report)
    if t0 is None:
        t0 = samples[-1]["ts"] if samples else 0.0
    xs = [round(r["ts"] - t0, 3) for r in samples]
    roles: dict[int, str] = {}
    for p in report.get("processes") or ():
        if isinstance(p, Mapping) and isinstance(p.get("pid"), int):
            roles[p["pid"]] = str(p.get("role") or "process") + (
                f" {p['worker_id']}" if p.get("worker_id") is not None else "")
    pids: list[int] = []
    per: list[dict[int, Mapping[str, Any]]] = []
    for r in samples:
        row = {}
        for p in r.get("procs") or ():
            if isinstance(p, Mapping) and isinstance(p.get("pid"), int) and not p.get("gone"):
                row[p["pid"]] = p
                if p["pid"] not in pids:
                    pids.append(p["pid"])
                if p["pid"] not in roles and p.get("role"):
                    roles[p["pid"]] = str(p["role"])
        per.append(row)
    pids = pids[:16]  # a legend people can read; the table below has every process

    def proc_series(key: str, dash: bool = False, suffix: str = "") -> list[dict[str, Any]]:
        out = []
        for i, pid in enumerate(pids):
            ys = [_num(row[pid].get(key)) if pid in row else None for row in per]
            if any(y is not None for y in ys):
                out.append({"label": f"{roles.get(pid, 'process')} ({pid}){suffix}", "y": ys,
                            "color": _COLORS[i % len(_COLORS)], "dash": dash})
        return out

    charts: list[dict[str, Any]] = []
    fds = proc_series("num_fds")
    if fds:
        limits = [max((v for v in (_num(p.get("fd_limit")) for p in row.values()) if v is not None), default=None)
                  for row in per]
        if any(v is not None for v in limits):
            fds.append({"label": "fd limit", "y": limits, "color": "#000000", "dash": True})
        charts.append({"id": "fds", "title": "Open file descriptors against the limit, per process",
                       "unit": "count", "series": fds})
    mem = proc_series("rss", suffix=" RSS") + proc_series("uss", dash=True, suffix=" USS")
    if mem:
        charts.append({"id": "memory", "title": "Memory per process: RSS (solid) and USS (dashed)",
                       "unit": "bytes", "series": mem})
    systems = [r.get("system") if isinstance(r.get("system"), Mapping) else {} for r in samples]
    total = [_num(s.get("shm_total")) for s in systems]
    free = [_num(s.get("shm_free")) for s in systems]
    used = [t - f if t is not None and f is not None else None for t, f in zip(total, free)]
    if any(v is not None for v in used):
        charts.append({"id": "shm", "title": "/dev/shm used against its size", "unit": "bytes", "series": [
            {"label": "/dev/shm used", "y": used, "color": _COLORS[1], "dash": False},
            {"label": "/dev/shm size", "y": total, "color": "#000000", "dash": True}]})
    locked = [_num(s.get("mlocked")) for s in systems]
    if any(v is not None for v in locked):
        charts.append({"id": "mlocked", "title": "Mlocked (pinned memory)", "unit": "bytes", "series": [
            {"label": "Mlocked", "y": locked, "color": _COLORS[4], "dash": False}]})
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
        charts.append({"id": "batches", "title": "Batch interval (left) and share of time waiting for data (right)",
                       "unit": "seconds", "unit2": "percent", "series": [
                           {"label": "batch interval", "y": interval, "color": _COLORS[0], "dash": False},
                           {"label": "data-wait share", "y": share, "color": _COLORS[3], "dash": False,
                            "scale": "pct"}]})
    gpu_idx: list[Any] = []
    for r in samples:
        for g in r.get("gpus") or ():
            if isinstance(g, Mapping) and g.get("index") not in gpu_idx:
                gpu_idx.append(g.get("index"))
    if gpu_idx:
        series = []
        for i, idx in enumerate(gpu_idx[:16]):
            ys = [next((_num(g.get("util_percent")) for g in r.get("gpus") or ()
                        if isinstance(g, Mapping) and g.get("index") == idx), None) for r in samples]
            series.append({"label": f"GPU {idx}", "y": ys, "color": _COLORS[i % len(_COLORS)], "dash": False})
        charts.append({"id": "gpu", "title": "GPU utilisation", "unit": "percent", "series": series})
    markers = [{"x": 0.0, "label": "incident", "color": "#d62728"}]
    stall = _num((report.get("progress") or {}).get("stall_s")) if isinstance(report.get("progress"), Mapping) else None
    if stall:
        markers.append({"x": -round(stall, 3), "label": "last batch", "color": "#7f7f7f"})
    return {"x": xs, "charts": charts, "markers": markers}


# ---------------------------------------------------------------------------- page

def _e(v: Any) -> str:
    return html.escape(str(v), quote=True)


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
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026") \
        .replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")


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
    percent: function (v) { return v == null ? "" : v.toFixed(0) + "%"; }
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
  var drawn = 0;
  D.charts.forEach(function (c) {
    var el = document.getElementById("chart-" + c.id);
    var fmt = FMT[c.unit] || FMT.count;
    var xs = D.x.slice(); xs.push(0);  // the incident moment is on every axis
    var data = [xs];
    var series = [{ label: "s from incident" }];
    c.series.forEach(function (s) {
      var y = s.y.slice(); y.push(null); data.push(y);
      series.push({ label: s.label, stroke: s.color, width: 2, dash: s.dash ? [6, 4] : undefined, scale: s.scale || "y",
                    value: function (u, v) { return (s.scale === "pct" ? FMT.percent : fmt)(v); }, spanGaps: false,
                    points: { show: D.x.length < 3 } });
    });
    var axes = [{ label: "seconds relative to the incident" }, { values: function (u, vs) { return vs.map(fmt); }, size: 80 }];
    var scales = { x: { time: false } };
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
.chart{margin:10px 0 18px} .muted{color:#777}
"""


def render_html(report: Mapping[str, Any], timeline: Sequence[Any] | None = None) -> str:
    """The page for one incident (report as loaded and redacted)."""
    data = _clean(chart_data(report, timeline))
    findings = [f for f in report.get("findings") or () if isinstance(f, Mapping)]
    procs = [p for p in report.get("processes") or () if isinstance(p, Mapping)]
    parts = ["<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">",
             f"<meta http-equiv=\"Content-Security-Policy\" content=\"{_CSP}\">",
             "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">",
             f"<title>dlwatch incident {_e(report.get('id'))}</title>",
             f"<style>{_vendor('uPlot.min.css')}{_STYLE}</style></head><body>",
             f"<h1>dlwatch incident {_e(report.get('id'))}</h1>",
             "<div class=\"headline\">",
             f"<div><b>{_e(str(report.get('trigger') or '?').upper())}</b>"
             + (f" ({_e(report['classification'])})" if report.get("classification") else "")
             + f": {_e(report.get('summary') or '')}</div>"]
    if findings:
        top = findings[0]
        parts.append(f"<div>Top finding: <b>{_e(top.get('title'))}</b> (<code>{_e(top.get('playbook'))}</code>, "
                     f"confidence {_e(display.percent(top.get('confidence')))})</div>")
    exc = report.get("exception") if isinstance(report.get("exception"), Mapping) else None
    if exc:
        # the message's last line: a worker's exception carries its whole traceback in the message
        last = ([line for line in str(exc.get("message") or "").splitlines() if line.strip()] or [""])[-1]
        parts.append(f"<div>Exception: <code>{_e(exc.get('type'))}</code>: "
                     f"{_e(display.one_line(last, 300))}</div>")
    parts.append(f"<div class=\"muted\">{_e(report.get('created_at'))} on {_e(report.get('host'))}, "
                 f"pid {_e(report.get('pid'))}</div></div>")
    parts.append("<h2>Timeline</h2>")
    if data["charts"]:
        parts.append(f"<p class=\"muted\">{len(data['x'])} samples before the incident; the dashed red line is "
                     "the incident, the grey one the last batch.</p>")
        for c in data["charts"]:
            parts.append(f"<div class=\"chart\" id=\"chart-{_e(c['id'])}\"></div>")
    else:
        parts.append("<p>No samples were recorded before this incident.</p>")
    parts.append("<h2>Findings</h2>")
    if not findings:
        parts.append("<p>No playbook matched.</p>")
    for i, f in enumerate(findings, 1):
        parts.append(f"<h3>{i}. {_e(f.get('title'))} (<code>{_e(f.get('playbook'))}</code>, "
                     f"confidence {_e(display.percent(f.get('confidence')))})</h3>")
        parts.append(_evidence(f.get("evidence") or {}))
        if f.get("remediation"):
            parts.append(f"<p><b>What to do</b></p><pre>{_e(str(f['remediation']).strip())}</pre>")
    if exc and exc.get("traceback"):
        parts.append(f"<h2>Traceback</h2><pre>{_e(str(exc['traceback']).rstrip())}</pre>")
    if procs:
        parts.append("<h2>Processes</h2>")
        parts.append(_table(display.process_table(procs)))
        excerpts = display.process_excerpts(procs, n=12)
        if excerpts:
            parts.append("<h2>Stacks</h2>")
            for who, frames in excerpts:
                parts.append(f"<p><b>{_e(who)}</b> (innermost first)</p><pre>{_e(chr(10).join(frames))}</pre>")
    notes = report.get("notes") or []
    if notes:
        parts.append("<h2>Notes</h2><ul>" + "".join(f"<li>{_e(n)}</li>" for n in notes) + "</ul>")
    parts.append(f"<script id=\"dlwatch-data\" type=\"application/json\">{_json_script(data)}</script>")
    parts.append(f"<script>{_vendor('uPlot.iife.min.js')}</script>")
    parts.append(f"<script>{_SCRIPT}</script></body></html>")
    return "".join(parts) + "\n"


def write_html(incident_dir: str) -> str:
    """Render ``incident_dir``'s report.html (privately, atomically); return its path."""
    from dlwatch._fs import write_private
    from dlwatch.redact import outbound
    from dlwatch.report import store

    report = outbound(store.load_report(incident_dir))
    page = render_html(report)
    final = os.path.join(incident_dir, HTML_NAME)
    tmp = os.path.join(incident_dir, f".{HTML_NAME}.{secrets.token_hex(4)}")
    write_private(tmp, page)  # O_EXCL|O_NOFOLLOW: a name we just made up, never someone's link
    try:
        os.rename(tmp, final)
    except BaseException:
        os.unlink(tmp)
        raise
    return final


_children: list[subprocess.Popen[bytes]] = []


def spawn_render(incident_dir: str) -> subprocess.Popen[bytes] | None:
    """Render report.html in a short-lived isolated child; never raises, never waits.

    A daemon thread reaps the child, so no zombie stays behind the monitor.
    """
    if os.environ.get("DLWATCH_HTML", "").strip().lower() in ("0", "false", "no", "off"):
        return None
    try:
        from dlwatch._spawn import python_argv

        proc = subprocess.Popen(python_argv(module="dlwatch.report.html", args=[os.path.abspath(incident_dir)]),
                                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                close_fds=True)
    except Exception:
        return None

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
    if len(args) != 1:
        print("usage: python -m dlwatch.report.html INCIDENT_DIR", file=sys.stderr)
        return 2
    try:
        write_html(args[0])
    except Exception as exc:
        print(f"dlwatch: could not write {HTML_NAME}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
