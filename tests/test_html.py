"""report.html: self-contained, small, escaped, written outside the monitor, and drawn by a real browser."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest

from conftest import chromium_path, fuzz_fields, incidents, wait_for
from dlwatch.report import build, html, store


def sampled_report(n: int = 60) -> dict:
    """A stall with a timeline like the monitor's: fds climbing in worker 0, memory growing, shm filling."""
    now = time.time()
    r = store.skeleton(trigger="stall", pid=100, now=now)
    r["summary"] = "no batch progress for 30 s <script>alert(1)</script>"
    r["progress"] = {"batches": 40, "epochs": 1, "stall_s": 30.0, "data_wait_s": 3.0, "step_s": 9.0}
    r["findings"] = [
        {
            "playbook": "fd-exhaustion",
            "title": "Too many open files </script><b>x</b>",
            "confidence": 0.9,
            "evidence": {"num_fds": 1000, "fd_limit": 1024, "top_files": [["/d/a</script>.bin", 900]]},
            "remediation": "Close your files.",
        }
    ]
    r["processes"] = [
        build.process_entry(100, "main", sample={"num_fds": 20, "fd_limit": 1024, "rss": 1 << 30}),
        build.process_entry(101, "worker", worker_id=0, sample={"num_fds": 1000, "fd_limit": 1024}),
    ]
    t0 = now - n
    r["timeline"] = [
        {
            "kind": "sample",
            "ts": t0 + i,
            "heartbeat": {
                "batches": min(i, 40),
                "data_wait_s": 0.05 * min(i, 40),
                "step_s": 0.2 * min(i, 40),
                "last_interval_s": 0.25,
            },
            "procs": [
                {
                    "pid": 100,
                    "role": "main",
                    "num_fds": 20,
                    "fd_limit": 1024,
                    "rss": (1 << 30) + i * (1 << 20),
                    "uss": 1 << 28,
                },
                {
                    "pid": 101,
                    "role": "worker",
                    "num_fds": 30 + 16 * i,
                    "fd_limit": 1024,
                    "rss": 1 << 29,
                    "uss": (1 << 26) + i * (1 << 21),
                },
            ],
            "system": {"shm_total": 8 << 30, "shm_free": (8 << 30) - i * (1 << 26), "mlocked": 1 << 24},
            "gpus": [],
        }
        for i in range(n)
    ]
    return r


def test_page_is_self_contained_small_and_escaped():
    page = html.render_html(sampled_report())
    assert len(page.encode()) < 300_000  # well under 1 MB: uPlot is ~50 kB, the data a few kB
    assert "default-src 'none'" in page  # the page may fetch nothing at all
    assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
    assert "<script>alert(1)</script>" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    # the only </script> closers are the page's own three elements
    assert page.count("</script>") == 3
    data = json.loads(re.search(r'<script id="dlwatch-data" type="application/json">(.*?)</script>', page).group(1))
    ids = [c["id"] for c in data["charts"]]
    assert ids == ["fds", "memory", "shm", "mlocked", "batches"]  # no GPU series: no GPU chart
    fds = data["charts"][0]["series"]
    assert fds[1]["label"] == "worker 0 (101)" and fds[1]["y"][-1] == 30 + 16 * 59
    assert fds[-1]["label"] == "fd limit" and fds[-1]["y"][0] == 1024
    assert data["x"][-1] <= 0 and data["markers"][0] == {"x": 0.0, "label": "incident", "color": "#d62728"}
    assert data["markers"][1]["x"] == -30.0  # the last batch, 30 s before
    share = data["charts"][-1]["series"][1]["y"]
    assert share[5] == 20.0 and share[-1] is None  # 0.05 s waiting for 0.2 s of loop body, then no batches


def test_every_incident_gets_its_html_from_a_short_lived_child(tmp_path, no_leftovers):
    path = build.write(sampled_report(), str(tmp_path))
    page = os.path.join(path, "report.html")
    assert wait_for(lambda: os.path.isfile(page), timeout=60), "report.html never appeared"
    assert os.stat(page).st_mode & 0o777 == 0o600
    assert [n for n in os.listdir(path) if n.startswith(".")] == []  # no temporary file left


def test_report_html_command(tmp_path, capsys, monkeypatch):
    from dlwatch.cli import main

    monkeypatch.setenv("DLWATCH_HTML", "0")  # no child: the command writes it
    path = build.write(sampled_report(), str(tmp_path))
    assert not os.path.exists(os.path.join(path, "report.html"))
    assert main(["report", path, "--html"]) == 0
    assert capsys.readouterr().out.strip() == os.path.join(path, "report.html")
    assert os.path.getsize(os.path.join(path, "report.html")) > 50_000
    assert main(["report", str(tmp_path), "--html"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--html needs one incident" in err


def test_real_incident_page_in_headless_chromium(tmp_path):
    """A real fd-exhaustion run; its report.html opened in Chromium: no request, no error, charts drawn."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    browser_path = chromium_path()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium; .ci/run installs it)")
    reports = tmp_path / "reports"
    out = subprocess.run(
        [sys.executable, "-m", "dlwatch", "demo", "fd_exhaustion", "--report-dir", str(reports)],
        capture_output=True,
        text=True,
        timeout=300,
        start_new_session=True,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    (incident,) = [p for p in incidents(str(reports)) if "exception" in p]
    page = os.path.join(incident, "report.html")
    assert wait_for(lambda: os.path.isfile(page), timeout=60), "report.html never appeared"
    assert os.path.getsize(page) < 1_000_000
    requests, errors = [], []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            tab = browser.new_page(viewport={"width": 1100, "height": 1250})
            tab.on("request", lambda r: requests.append(r.url))
            tab.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
            tab.on("pageerror", lambda e: errors.append(str(e)))
            tab.goto("file://" + page)
            tab.wait_for_function("document.body.getAttribute('data-charts-drawn') !== null", timeout=30_000)
            drawn = int(tab.evaluate("document.body.getAttribute('data-charts-drawn')"))
            inked = tab.evaluate("""Array.from(document.querySelectorAll('.chart canvas')).map(c => {
                const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })""")
            titles = tab.evaluate("Array.from(document.querySelectorAll('.u-title')).map(e => e.textContent)")
            shot = tmp_path / "report-html.png"
            tab.screenshot(path=str(shot))
        finally:
            browser.close()
    artifacts = os.environ.get("DLWATCH_ARTIFACT_DIR")
    if artifacts:  # kept for people (CI artifact; docs/images/report-html.png comes from here)
        os.makedirs(artifacts, exist_ok=True)
        shutil.copy(shot, os.path.join(artifacts, "report-html.png"))
    assert requests == ["file://" + page]  # the page itself, nothing else
    assert errors == []
    assert drawn >= 4 and len(inked) == drawn
    assert all(n > 2000 for n in inked), inked  # every chart has lines on it, not just an empty frame
    assert titles[0] == "Open file descriptors against the limit, per process"
    assert os.path.getsize(shot) > 20_000


def test_any_field_of_any_type_renders_or_is_called_damaged(tmp_path):
    """Wrong types anywhere the page looks (a report edited or damaged): a page, or a ReportError."""
    base = sampled_report(5)
    paths = [
        ("summary",),
        ("progress",),
        ("progress", "stall_s"),
        ("findings",),
        ("findings", 0, "evidence"),
        ("processes",),
        ("processes", 0),
        ("timeline",),
        ("timeline", 0),
        ("timeline", 0, "procs"),
        ("timeline", 0, "procs", 0),
        ("timeline", 0, "system"),
        ("timeline", 0, "heartbeat"),
        ("timeline", 0, "gpus"),
        ("timeline", 0, "ts"),
        ("created_at",),
        ("notes",),
        ("exception",),
    ]
    target = tmp_path / "one"
    target.mkdir()
    fuzz_fields(base, paths, target, "report.json", store.load_report, html.render_html)


# --------------------------------------------------------------------------- the fd and /dev/shm charts' scale


def few_fds_report(n: int = 60) -> dict:
    """A healthy-looking run: 12 to 40 fds per process against a limit of 20,000, and 50 to 400 MiB of
    a 64 GiB /dev/shm: drawn on one scale with their limits, both would be flat lines at zero."""
    r = sampled_report(n)
    for i, rec in enumerate(r["timeline"]):
        main, worker = rec["procs"]
        main.update(num_fds=12 + (28 * i) // (n - 1), fd_limit=20000)
        worker.update(num_fds=20 + i // 6, fd_limit=20000)
        rec["system"].update(shm_total=64 << 30, shm_free=(64 << 30) - (50 << 20) - i * (6 << 20))
    return r


def few_fds_summary(n: int = 60) -> tuple[dict, list]:
    """The same samples as a run summary's page draws them (no incident: no red marker)."""
    from dlwatch.report import summary as sm

    r = few_fds_report(n)
    first = r["timeline"][0]["ts"]
    s = sm.skeleton(run_id="20260101T000000Z-100-abcdef", pid=100, now=first + n, started_at=first)
    s["workers"] = [{"pid": 101, "worker_id": 0}]
    return s, r["timeline"]


# The share of the plot area's height that a chart's lines span, read from the pixels drawn in its
# canvas: the rows holding a pixel of one of the chart's series colours, over the plot area's height
# (uPlot's .u-over, in CSS pixels, times the device pixel ratio).  Only the figures' own lines count:
# not a dashed reference (a limit), nor a series coloured like a marker (the incident's red, an
# epoch's grey: full-height vertical lines).
LINE_SPAN_JS = """() => {
    const D = JSON.parse(document.getElementById('dlwatch-data').textContent);
    const marks = new Set(D.markers.map(m => m.color.toLowerCase()));
    return D.charts.map(c => {
        const chart = document.getElementById('chart-' + c.id);
        const canvas = chart.querySelector('canvas'), over = chart.querySelector('.u-over');
        const colors = c.series.filter(s => !s.dash).map(s => s.color.toLowerCase()).filter(x => !marks.has(x));
        const rgb = colors.map(h => [1, 3, 5].map(i => parseInt(h.slice(i, i + 2), 16)));
        const d = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
        let top = null, bottom = null;
        for (let y = 0; y < canvas.height; y++) {
            for (let x = 0; x < canvas.width; x++) {
                const i = 4 * (y * canvas.width + x);
                if (d[i + 3] > 200 && rgb.some(k => Math.abs(k[0] - d[i]) + Math.abs(k[1] - d[i + 1]) + Math.abs(k[2] - d[i + 2]) < 40)) {
                    if (top === null) top = y;
                    bottom = y;
                    break;
                }
            }
        }
        return {id: c.id, title: chart.querySelector('.u-title').textContent, measured: colors.length,
                span: top === null ? 0 : (bottom - top) / (over.clientHeight * devicePixelRatio)};
    });
}"""


def test_few_fds_under_a_high_limit_get_their_own_scale():
    data = html.chart_data(few_fds_report())
    fds, shm = data["charts"][0], next(c for c in data["charts"] if c["id"] == "shm")
    assert [s["label"] for s in fds["series"]] == ["main (100)", "worker 0 (101)"]  # no limit series
    assert fds["title"] == "Open file descriptors per process (limit 20,000, not drawn: peak under 1%)"
    assert [s["label"] for s in shm["series"]] == ["/dev/shm used"]
    assert shm["title"] == "/dev/shm used (size 64.0 GiB, not drawn: peak under 1%)"
    # within reach (a quarter of the limit or more), the limit is drawn as before
    near = sampled_report()  # worker 0 climbs to 974 of 1024 fds; /dev/shm fills to about 46%
    titles = {c["id"]: (c["title"], [s["label"] for s in c["series"]]) for c in html.chart_data(near)["charts"]}
    assert titles["fds"] == (
        "Open file descriptors against the limit, per process",
        ["main (100)", "worker 0 (101)", "fd limit"],
    )
    assert titles["shm"] == ("/dev/shm used against its size", ["/dev/shm used", "/dev/shm size"])
    # a share of a few percent is said as such
    assert html._share_text(0.034) == "3%" and html._peak_share([(None, 5.0), (3.0, 0.0), (2.0, 8.0)]) == (0.25, 8.0)


def test_fd_chart_in_chromium_shows_the_fds_not_the_limit(tmp_path):
    """Both pages in headless Chromium: the fd lines (and /dev/shm's) span most of their plot's height."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    browser_path = chromium_path()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium; .ci/run installs it)")
    pages = {"incident": tmp_path / "incident.html", "summary": tmp_path / "summary.html"}
    pages["incident"].write_text(html.render_html(few_fds_report()))
    pages["summary"].write_text(html.render_summary_html(*few_fds_summary()))
    errors: list[str] = []
    spans: dict[str, dict] = {}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            tab = browser.new_page(viewport={"width": 1100, "height": 1000})
            tab.on("pageerror", lambda e: errors.append(str(e)))
            for name, page in pages.items():
                tab.goto(f"file://{page}")
                tab.wait_for_function("document.body.getAttribute('data-charts-drawn') !== null", timeout=30_000)
                spans.update({f"{name}-{c['id']}": c for c in tab.evaluate(LINE_SPAN_JS)})
                for chart in ("fds", "shm"):
                    tab.locator(f"#chart-{chart}").screenshot(path=str(tmp_path / f"{name}-{chart}.png"))
        finally:
            browser.close()
    artifacts = os.environ.get("DLWATCH_ARTIFACT_DIR")
    if artifacts:  # kept for people to look at
        os.makedirs(artifacts, exist_ok=True)
        for name in pages:
            for chart in ("fds", "shm"):
                shutil.copy(tmp_path / f"{name}-{chart}.png", os.path.join(artifacts, f"{name}-{chart}.png"))
    assert errors == []
    for key in ("incident-fds", "summary-fds", "summary-shm"):
        s = spans[key]
        assert s["measured"] >= 1, s  # a series to measure (the incident page's red is its marker's)
        assert s["span"] >= 0.5, spans  # 12 to 40 fds, 50 to 400 MiB fill their chart: no flat line at zero
    assert spans["incident-fds"]["title"].startswith("Open file descriptors per process (limit 20,000,")
    assert spans["summary-shm"]["title"].startswith("/dev/shm used (size 64.0 GiB,")
