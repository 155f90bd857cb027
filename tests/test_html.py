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
    r["findings"] = [{"playbook": "fd-exhaustion", "title": "Too many open files </script><b>x</b>", "confidence": 0.9,
                      "evidence": {"num_fds": 1000, "fd_limit": 1024, "top_files": [["/d/a</script>.bin", 900]]},
                      "remediation": "Close your files."}]
    r["processes"] = [build.process_entry(100, "main", sample={"num_fds": 20, "fd_limit": 1024, "rss": 1 << 30}),
                      build.process_entry(101, "worker", worker_id=0, sample={"num_fds": 1000, "fd_limit": 1024})]
    t0 = now - n
    r["timeline"] = [{"kind": "sample", "ts": t0 + i, "heartbeat": {
        "batches": min(i, 40), "data_wait_s": 0.05 * min(i, 40), "step_s": 0.2 * min(i, 40), "last_interval_s": 0.25},
        "procs": [{"pid": 100, "role": "main", "num_fds": 20, "fd_limit": 1024, "rss": (1 << 30) + i * (1 << 20), "uss": 1 << 28},
                  {"pid": 101, "role": "worker", "num_fds": 30 + 16 * i, "fd_limit": 1024, "rss": 1 << 29,
                   "uss": (1 << 26) + i * (1 << 21)}],
        "system": {"shm_total": 8 << 30, "shm_free": (8 << 30) - i * (1 << 26), "mlocked": 1 << 24}, "gpus": []}
        for i in range(n)]
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


@pytest.mark.slow
def test_real_incident_page_in_headless_chromium(tmp_path):
    """A real fd-exhaustion run; its report.html opened in Chromium: no request, no error, charts drawn."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')")
    browser_path = chromium_path()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium; .ci/run installs it)")
    reports = tmp_path / "reports"
    out = subprocess.run([sys.executable, "-m", "dlwatch", "demo", "fd_exhaustion", "--report-dir", str(reports)],
                         capture_output=True, text=True, timeout=300, start_new_session=True)
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
    paths = [("summary",), ("progress",), ("progress", "stall_s"), ("findings",), ("findings", 0, "evidence"),
             ("processes",), ("processes", 0), ("timeline",), ("timeline", 0), ("timeline", 0, "procs"),
             ("timeline", 0, "procs", 0), ("timeline", 0, "system"), ("timeline", 0, "heartbeat"),
             ("timeline", 0, "gpus"), ("timeline", 0, "ts"), ("created_at",), ("notes",), ("exception",)]
    target = tmp_path / "one"
    target.mkdir()
    fuzz_fields(base, paths, target, "report.json", store.load_report, html.render_html)
