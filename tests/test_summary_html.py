"""The run summary's report.html (runs/<id>/report.html): written after real watched runs by the
short-lived render child from the timeline the monitor hands it, small, private, escaped, drawn by a
real headless Chromium, and written again by `dlwatch report RUN-ID --html`.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from conftest import cpu_starved, REPO, chromium_path, batches_of, descendants_of, fuzz_fields, kill_session, wait_for
from dlwatch.cli import main
from dlwatch.report import html, store
from dlwatch.report import summary as sm

EXAMPLES = os.path.join(REPO, "examples")
HOSTILE = "</script><script>alert(1)</script><img src=x onerror=alert(2)>"


def _data(page: str) -> dict:
    return json.loads(re.search(r'<script id="dlwatch-data" type="application/json">(.*?)</script>', page).group(1))


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory):
    """An input-bound run (earns `input-bound` advice) and a balanced one (no advice), each with its page.

    The example exits as soon as its block ends; the render child it leaves behind (started by
    the monitor) must finish on its own, so the test waits for the page before the session is killed.
    """
    base = tmp_path_factory.mktemp("summary-html")
    runs = {}
    for name in ("input_bound", "balanced"):
        report_dir = str(base / name)
        proc = subprocess.Popen(
            [sys.executable, os.path.join(EXAMPLES, f"{name}.py"), "--report-dir", report_dir],
            cwd=EXAMPLES,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        known: set[int] = set()
        try:
            deadline = time.monotonic() + 240
            while proc.poll() is None and time.monotonic() < deadline:
                known.update(p.pid for p in descendants_of(proc.pid))
                time.sleep(0.2)
            out, err = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert proc.returncode == 0, err[-2000:]
            (run,) = os.listdir(os.path.join(report_dir, "runs"))
            path = os.path.join(report_dir, "runs", run)
            assert wait_for(lambda: os.path.isfile(os.path.join(path, "report.html")), timeout=60), (
                f"{name}: runs/{run}/report.html never appeared; stderr: {err[-2000:]}"
            )
            runs[name] = path
        finally:
            kill_session(proc.pid, known)
            if proc.poll() is None:
                proc.kill()
                proc.wait(5)
    return runs


# --------------------------------------------------------------------------- real runs


def test_real_runs_get_a_small_private_page_with_the_whole_run(real_runs):
    for name, path in real_runs.items():
        page_path = os.path.join(path, "report.html")
        page = open(page_path, encoding="utf-8").read()
        s = store.load_summary(path)
        assert os.path.getsize(page_path) < 1_000_000  # attachable to a ticket
        assert os.stat(page_path).st_mode & 0o777 == 0o600
        assert os.stat(os.path.join(path, html.TIMELINE_NAME)).st_mode & 0o777 == 0o600
        assert [n for n in os.listdir(path) if n.startswith(".")] == []  # no temporary file left
        assert "default-src 'none'" in page
        assert not re.search(r"""(src|href)\s*=\s*["']?\s*(https?:)?//""", page, re.I)
        assert page.count("</script>") == 3
        data = _data(page)
        ids = [c["id"] for c in data["charts"]]
        assert {"fds", "memory", "cpu", "shm", "mlocked", "mem_available", "batches"} <= set(ids), ids
        # the whole run: from its first seconds to its end (the block's wall time)
        wall = s["loop"]["wall_s"]
        assert data["x"][0] < max(5.0, 0.5 * wall) and data["x"][-1] > 0.5 * wall
        cpu = {c["label"]: c for c in next(c for c in data["charts"] if c["id"] == "cpu")["series"]}
        assert set(cpu) >= {f"worker {w['worker_id']}" for w in s["workers"]}
        assert f"{s['loop']['batches']} batches" in page and s["id"] in page
        assert "first-batch latency per epoch" in page
        for w in s["workers"]:
            assert f"<td>{w['pid']}</td>" in page  # the per-worker table
        if name == "input_bound":
            assert [f["playbook"] for f in s["advice"]] == ["input-bound"]
            assert "<code>input-bound</code>" in page and "What to do" in page
            assert "cpu-saturated" in page  # the evidence, through display (no Python repr)
            assert "{&#x27;running" not in page and "{'running" not in page  # a table or words, no repr
            # the worker runs flat out: the chart draws the CPU it got (the summary's mean, as a peak at
            # least; how much that is depends on the machine's other load)
            w0 = next(w for w in s["workers"] if w["worker_id"] == 0)
            assert max(v for v in cpu["worker 0"]["y"] if v is not None) >= 0.9 * w0["cpu_util"] > 0, w0
        else:
            starved = cpu_starved(s)
            if starved and s["advice"]:  # a loaded machine made it input-bound: the page says that instead
                assert [f["playbook"] for f in s["advice"]] == ["input-bound"] and "<code>input-bound</code>" in page
            else:
                assert s["advice"] == []
                assert "No advice" in page
            assert "No preflight finding." in page
            epochs = [m["label"] for m in data["markers"]]
            # three epochs: each one's start marked (the first only when a sample came before it)
            assert epochs[-2:] == ["epoch 2", "epoch 3"] and epochs in (["epoch 1", "epoch 2", "epoch 3"], epochs[-2:])


def _open_in_chromium(pages: dict[str, str], shots: str) -> dict[str, dict]:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    browser_path = chromium_path()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium; .ci/run installs it)")
    seen = {}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            for name, page in pages.items():
                requests, errors, dialogs = [], [], []
                tab = browser.new_page(viewport={"width": 1100, "height": 1250})
                tab.on("request", lambda r: requests.append(r.url))
                tab.on("console", lambda m: errors.append(m.text) if m.type in ("error", "warning") else None)
                tab.on("pageerror", lambda e: errors.append(str(e)))
                tab.on("dialog", lambda d: (dialogs.append(d.message), d.dismiss()))
                tab.goto("file://" + page)
                tab.wait_for_function("document.body.getAttribute('data-charts-drawn') !== null", timeout=30_000)
                shot = os.path.join(shots, f"summary-html-{name}.png")
                tab.screenshot(path=shot, full_page=True)
                seen[name] = {
                    "requests": requests,
                    "errors": errors,
                    "dialogs": dialogs,
                    "shot": shot,
                    "drawn": int(tab.evaluate("document.body.getAttribute('data-charts-drawn')")),
                    "inked": tab.evaluate("""Array.from(document.querySelectorAll('.chart canvas')).map(c => {
                        const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
                        let n = 0; for (let i = 3; i < d.length; i += 4) if (d[i]) n++; return n; })"""),
                    "titles": tab.evaluate("Array.from(document.querySelectorAll('.u-title')).map(e => e.textContent)"),
                    "text": tab.evaluate("document.body.innerText"),
                }
                tab.close()
        finally:
            browser.close()
    artifacts = os.environ.get("DLWATCH_ARTIFACT_DIR")
    if artifacts:  # kept for people (CI artifact), like test_html's report-html.png
        os.makedirs(artifacts, exist_ok=True)
        for s in seen.values():
            shutil.copy(s["shot"], os.path.join(artifacts, os.path.basename(s["shot"])))
    return seen


def test_real_summary_pages_in_headless_chromium(real_runs, tmp_path):
    """Both real runs' pages opened in Chromium: no request, no error, every chart drawn with lines on it."""
    pages = {name: os.path.join(path, "report.html") for name, path in real_runs.items()}
    seen = _open_in_chromium(pages, str(tmp_path))
    for name, s in seen.items():
        assert s["requests"] == ["file://" + pages[name]], s["requests"]  # the page itself, nothing else
        assert s["errors"] == [] and s["dialogs"] == []
        assert s["drawn"] >= 7 and len(s["inked"]) == s["drawn"]
        assert all(n > 2000 for n in s["inked"]), (name, s["inked"])  # lines, not just an empty frame
        # a healthy run's few fds get their own scale; the limit (far above) is named, not drawn
        assert s["titles"][0].startswith("Open file descriptors per process (limit "), s["titles"][0]
        assert "CPU per process (cores: CPU seconds per second)" in s["titles"]
        assert os.path.getsize(s["shot"]) > 20_000
    assert "ADVICE" in seen["input_bound"]["text"]
    with open(os.path.join(real_runs["balanced"], "summary.json")) as f:
        balanced = json.load(f)
    # the balanced run earns no advice unless the machine starved its workers (see conftest.cpu_starved)
    assert ("No advice" in seen["balanced"]["text"]) == (balanced["advice"] == []), balanced["advice"]
    assert balanced["advice"] == [] or cpu_starved(balanced), balanced["advice"]


# --------------------------------------------------------------------------- hostile strings


def hostile_summary(n: int = 40) -> tuple[dict, list[dict]]:
    now = float(int(time.time()))  # started_at is kept to the second
    s = sm.skeleton(run_id="20260101T000000-100-abcdef", pid=100, now=now, started_at=now - n)
    s["loop"] = {
        "batches": 40,
        "epochs": 2,
        "wall_s": float(n),
        "data_wait_share": 0.8,
        "body_share": 0.2,
        "steady_data_wait_share": 0.8,
        "steady_batch_s": 0.1,
        "first_batch_s": {"per_epoch": [0.5, 0.25], "epochs_seen": 2, "total_s": 0.75, "mean_s": 0.375},
    }
    s["workers"] = [
        {
            "pid": 101,
            "worker_id": 0,
            "cpu_util": 0.9,
            "state_share": {"running": 1.0, HOSTILE: 0.5},
            "rss_peak": 1 << 28,
            "uss_peak": 1 << 24,
        },
        {"pid": 103, "worker_id": 0, "cpu_util": 0.9, "rss_peak": 1 << 28},
    ]  # worker 0 restarted
    s["main"] = {"pid": 100, "cpu_util": 0.1, "rss_peak": 1 << 30, "uss_peak": 1 << 28}
    s["peaks"] = {
        "fds": {"num_fds": 30, "fd_limit": 1024, "pid": 101, "role": HOSTILE},
        "gpus": [{"index": 0, "name": HOSTILE, "util_mean": 40.0, "util_low": 0.0}],
    }
    s["advice"] = [
        {
            "playbook": "input-bound",
            "title": "Waits for data " + HOSTILE,
            "confidence": 0.8,
            "evidence": {"cause": HOSTILE, "top_files": [[HOSTILE, 3]], HOSTILE: {"a": HOSTILE}},
            "remediation": "Do this: " + HOSTILE,
        }
    ]
    s["preflight"] = [{"playbook": HOSTILE, "title": HOSTILE, "confidence": 1.0, "evidence": {"x": HOSTILE}}]
    s["loader"] = {"dataset": HOSTILE, "num_workers": 1}
    s["incidents"] = [HOSTILE]
    s["notes"] = [HOSTILE]
    s["host"] = HOSTILE
    timeline = [
        {
            "kind": "sample",
            "ts": now - n + i,
            "heartbeat": {
                "batches": i,
                "epochs": 1 + (i >= n // 2),
                "data_wait_s": 0.08 * i,
                "step_s": 0.02 * i,
                "last_interval_s": 0.1,
            },
            "procs": [
                {
                    "pid": 100,
                    "role": "main",
                    "num_fds": 20,
                    "fd_limit": 1024,
                    "rss": 1 << 30,
                    "uss": 1 << 28,
                    "cpu_s": 0.1 * i,
                },
                {
                    "pid": 101 if i < n // 2 else 103,
                    "role": HOSTILE,
                    "num_fds": 30,
                    "fd_limit": 1024,
                    "rss": 1 << 28,
                    "uss": 1 << 24,
                    "cpu_s": 0.9 * (i % (n // 2)),
                },
            ],
            "system": {"shm_total": 8 << 30, "shm_free": 7 << 30, "mlocked": 1 << 20, "mem_available": 4 << 30},
            "gpus": [{"index": 0, "util_percent": 40}],
        }
        for i in range(n)
    ]
    return s, timeline


def test_hostile_strings_in_a_summary_stay_text(tmp_path):
    s, timeline = hostile_summary()
    page = html.render_summary_html(s, timeline)
    assert "<script>alert" not in page and "<img" not in page
    assert page.count("</script>") == 3  # the page's own three elements, nothing from the summary
    assert page.count("&lt;/script&gt;&lt;script&gt;alert(1)") >= 8  # advice, preflight, notes, loader, ...
    data = _data(page)
    assert [c["id"] for c in data["charts"]] == [
        "fds",
        "memory",
        "cpu",
        "shm",
        "mlocked",
        "mem_available",
        "batches",
        "gpu",
    ]
    # a worker restarted in the run (pid 101, then 103, both worker 0) stays one line
    cpu = data["charts"][2]["series"]
    assert [c["label"] for c in cpu] == ["main (100)", "worker 0"]
    assert cpu[1]["y"][1] == 0.9 and cpu[1]["y"][20] is None and cpu[1]["y"][21] == 0.9  # no jump at the restart
    assert data["markers"] == [{"x": 20.0, "label": "epoch 2", "color": "#7f7f7f"}]
    assert data["pin"] is None and data["x"][0] == 0.0
    # written the way the child writes it: a real summary directory, private, then read back by the CLI
    path = store.write_summary(str(tmp_path), s, render_markdown=sm.render_markdown)
    page_path = html.write_summary_html(path)
    assert os.stat(page_path).st_mode & 0o777 == 0o600
    assert open(page_path).read().count("</script>") == 3


def test_hostile_summary_page_in_headless_chromium(tmp_path):
    """The hostile page in a real browser: nothing runs but the page's own script, no alert, charts drawn."""
    s, timeline = hostile_summary()
    page = tmp_path / "report.html"
    page.write_text(html.render_summary_html(s, timeline))
    seen = _open_in_chromium({"hostile": str(page)}, str(tmp_path))["hostile"]
    assert seen["dialogs"] == [] and seen["errors"] == [] and seen["requests"] == ["file://" + str(page)]
    assert seen["drawn"] == 8 and all(n > 2000 for n in seen["inked"])
    assert HOSTILE in seen["text"]  # shown as text


def test_a_run_without_samples_or_advice_still_gets_a_page():
    now = time.time()
    s = sm.skeleton(run_id="r1", pid=1, now=now)
    page = html.render_summary_html(s, [])
    assert "No advice" in page and "No samples were kept" in page and "No worker processes" in page
    assert _data(page)["charts"] == []


def test_thinning_keeps_the_whole_run_evenly_and_bounded():
    lines = []
    for i in range(5003):
        lines.append(
            json.dumps(
                {"kind": "sample", "ts": float(i), "procs": [{"pid": 1, "rss": i, "name": "x"}], "unused": "x" * 50}
            ).encode()
        )
        lines.append(json.dumps({"kind": "event", "ts": float(i), "event": "sample"}).encode())
    lines.append(b"{not json")
    kept = html.thin_samples(lines, limit=500)
    ts = [r["ts"] for r in kept]
    assert len(kept) <= 501 and ts[0] == 0.0 and ts[-1] == 5002.0 and ts == sorted(ts)
    steps = {b - a for a, b in zip(ts[:-2], ts[1:-1])}
    assert len(steps) == 1  # evenly spaced (the last one is the run's end)
    assert kept[0] == {"kind": "sample", "ts": 0.0, "procs": [{"pid": 1, "rss": 0}]}  # only what the charts draw


# --------------------------------------------------------------------------- in process: the CLI and DLWATCH_HTML=0


class Slow(Dataset):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        time.sleep(0.02)
        return torch.zeros(4), i


def test_report_run_id_html_writes_prints_and_forces(tmp_path, capsys, monkeypatch, no_leftovers):
    monkeypatch.setenv("DLWATCH_HTML", "0")  # no child: the page is off until the command writes it
    dl = DataLoader(Slow(), batch_size=4, num_workers=2)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as w:
        for _ in range(2):
            batches_of(w)
    run = tmp_path / "runs" / w.summary["id"]
    assert (run / "summary.json").is_file() and not (run / "report.html").exists()
    assert html.spawn_render(str(run), timeline_dir=str(tmp_path)) is None  # DLWATCH_HTML=0: no child at all
    assert main(["report", "--dir", str(tmp_path), w.summary["id"], "--html"]) == 0
    page = capsys.readouterr().out.strip()
    assert page == str(run / "report.html") and os.path.getsize(page) > 50_000
    text = open(page).read()
    assert "No advice" in text and "No samples were kept" in text  # no child ran: no samples were kept
    inode = os.stat(page).st_ino
    assert main(["report", str(run), "--html"]) == 0  # by directory too; there already: not rewritten
    assert capsys.readouterr().out.strip() == page and os.stat(page).st_ino == inode
    assert main(["report", "--dir", str(tmp_path), w.summary["id"], "--html", "--force"]) == 0
    assert capsys.readouterr().out.strip() == page and os.stat(page).st_ino != inode
    # bad input: one line that says what to do, documented exit codes
    assert main(["report", "--dir", str(tmp_path), "no-such-run", "--html"]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no incident or report directory named 'no-such-run'" in err
    assert main(["report", str(tmp_path), "--html"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--html needs one incident or run" in err
    (run / "summary.json").write_text("{damaged")
    assert main(["report", str(run), "--html", "--force"]) == 6
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "damaged or truncated" in err


def test_the_monitor_renders_the_page_in_a_child_with_the_timeline_handed_over(tmp_path, no_leftovers):
    """An in-process watch with real workers: the page appears after the block, drawn from samples
    the child read from the (by then removed) run directory's timeline."""
    dl = DataLoader(Slow(), batch_size=4, num_workers=2)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as w:
        run_dir = w.run_dir
        for _ in range(3):
            batches_of(w)
    assert not os.path.exists(run_dir)  # the watch's run directory is gone ...
    run = tmp_path / "runs" / w.summary["id"]
    assert wait_for(lambda: (run / "report.html").is_file(), timeout=60), "report.html never appeared"
    data = _data((run / "report.html").read_text())
    assert len(data["x"]) >= 3 and data["charts"]  # ... and its samples reached the page
    assert (run / html.TIMELINE_NAME).is_file()


def test_a_summary_written_by_the_training_process_gets_its_page_too(tmp_path, no_leftovers):
    """The monitor killed mid-run: the training process writes the summary and starts the render
    child itself, handing it the samples the monitor took before it died."""
    import signal
    import warnings

    dl = DataLoader(Slow(), batch_size=4, num_workers=2)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as w:
            batches_of(w)
            timeline = os.path.join(w.run_dir, "timeline.jsonl")

            def samples() -> int:
                try:
                    with open(timeline, "rb") as f:
                        return sum(1 for line in f if b'"kind": "sample"' in line)
                except OSError:
                    return 0

            # a chart needs two points: wait for three samples before the monitor goes
            assert wait_for(lambda: samples() >= 3, timeout=30)
            os.kill(w.monitor_pid, signal.SIGKILL)
            wait_for(lambda: w._session.monitor.poll() is not None, 5)
            batches_of(w)
    s = w.summary
    assert any("monitor process was not running" in n for n in s["notes"])
    run = tmp_path / "runs" / s["id"]
    assert wait_for(lambda: (run / "report.html").is_file(), timeout=60), "report.html never appeared"
    page = (run / "report.html").read_text()
    assert "monitor process was not running" in page and _data(page)["charts"]


def test_the_page_stays_under_1_mb_for_the_largest_run():
    """The most the page can hold: 40 processes with noisy figures in every sample, 8 GPUs, a timeline
    far longer than MAX_POINTS (thinned first, as the child does): still well under 1 MB."""
    import random

    rng = random.Random(0)
    now = time.time()
    lines = (
        json.dumps(
            {
                "kind": "sample",
                "ts": now + i * 0.2,
                "heartbeat": {
                    "batches": i,
                    "epochs": 1,
                    "data_wait_s": i * rng.random(),
                    "step_s": i * 0.9,
                    "last_interval_s": rng.random(),
                },
                "procs": [
                    {
                        "pid": 1000 + p,
                        "role": "worker",
                        "num_fds": rng.randrange(10**5),
                        "fd_limit": 1 << 20,
                        "rss": rng.randrange(1 << 40),
                        "uss": rng.randrange(1 << 40),
                        "cpu_s": i * rng.random(),
                    }
                    for p in range(40)
                ],
                "system": {
                    "shm_total": 1 << 40,
                    "shm_free": rng.randrange(1 << 40),
                    "mlocked": rng.randrange(1 << 40),
                    "mem_available": rng.randrange(1 << 40),
                },
                "gpus": [{"index": g, "util_percent": rng.randrange(101)} for g in range(8)],
            }
        ).encode()
        for i in range(3000)
    )
    s = sm.skeleton(run_id="big", pid=1000, now=now)
    page = html.render_summary_html(s, html.thin_samples(lines))
    assert len(_data(page)["x"]) <= html.MAX_POINTS + 1
    assert len(page.encode()) < 900_000, len(page.encode())


def test_secrets_in_a_summary_or_its_timeline_are_redacted_on_the_page(tmp_path):
    """The page and the kept samples go through the same redaction as every other file dlwatch writes."""
    secret = "s3cr3tValue9f8e7d"
    s, timeline = hostile_summary()
    s["notes"] = [f'password = "{secret}"']
    s["advice"][0]["evidence"]["cmdline"] = f"train.py --api-token={secret}"
    timeline[0]["procs"][1]["role"] = f"--secret {secret}"
    path = store.write_summary(str(tmp_path), s, render_markdown=sm.render_markdown)
    src = tmp_path / "timeline.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in timeline))
    fd = os.open(src, os.O_RDONLY)
    page = html.write_summary_html(path, [fd])  # the child's path: the samples handed over open, then kept
    text = open(page).read() + open(os.path.join(path, html.TIMELINE_NAME)).read()
    assert secret not in text
    assert "--secret" in text  # the label is there, its value is not


def test_a_vanished_training_process_still_gets_its_page(tmp_path, target):
    """SIGKILL of the training process: the monitor writes the exit incident and the summary, hands the
    timeline to the render child and removes the run directory; the page has the run, its incident marked."""
    import signal

    t = target("killed.py", str(tmp_path))
    t.wait_line("READY", timeout=60)

    def samples() -> int:  # a few samples taken before the kill
        for name in os.listdir(tmp_path / ".runs"):
            try:
                with open(tmp_path / ".runs" / name / "timeline.jsonl", "rb") as f:
                    return f.read().count(b'"kind": "sample"')
            except OSError:
                pass
        return 0

    assert wait_for(lambda: samples() >= 5, timeout=60)
    os.kill(t.pid, signal.SIGKILL)
    runs = tmp_path / "runs"
    page = wait_for(
        lambda: [p / "report.html" for p in runs.iterdir() if (p / "report.html").is_file()] if runs.is_dir() else [],
        timeout=60,
    )
    assert page, "runs/<id>/report.html never appeared"
    s = store.load_summary(str(page[0].parent))
    assert s["ended"] == "vanished" and len(s["incidents"]) == 1
    assert wait_for(lambda: os.listdir(tmp_path / ".runs") == [], timeout=15)  # the run directory went
    data = _data(page[0].read_text())
    assert data["charts"] and len(data["x"]) >= 5
    assert [m["label"] for m in data["markers"] if m["color"] == "#d62728"] == [f"incident {s['incidents'][0]}"]


def test_a_link_planted_as_the_kept_timeline_is_not_followed(tmp_path, capsys):
    s, _ = hostile_summary()
    path = store.write_summary(str(tmp_path / "reports"), s, render_markdown=sm.render_markdown)
    elsewhere = tmp_path / "elsewhere.jsonl"
    elsewhere.write_text(json.dumps({"kind": "sample", "ts": 1.0, "procs": [{"pid": 7, "rss": 1}]}) + "\n")
    os.symlink(elsewhere, os.path.join(path, html.TIMELINE_NAME))
    assert main(["report", path, "--html"]) == 0
    page = open(capsys.readouterr().out.strip()).read()
    assert "No samples were kept" in page and _data(page)["charts"] == []


def test_any_field_of_any_type_renders_or_is_called_damaged(tmp_path):
    """Wrong types anywhere the summary page looks (a summary edited or damaged): a page, or a ReportError."""
    s, timeline = hostile_summary(5)
    paths = [
        ("loop",),
        ("loop", "batches"),
        ("loop", "first_batch_s"),
        ("loop", "first_batch_s", "per_epoch"),
        ("workers",),
        ("workers", 0),
        ("workers", 0, "state_share"),
        ("workers", 0, "pid"),
        ("main",),
        ("peaks",),
        ("peaks", "fds"),
        ("peaks", "gpus"),
        ("advice",),
        ("advice", 0, "evidence"),
        ("preflight",),
        ("loader",),
        ("cpus",),
        ("notes",),
        ("incidents",),
        ("started_at",),
        ("created_at",),
    ]
    target = tmp_path / "one"
    target.mkdir()
    fuzz_fields(
        s, paths, target, "summary.json", store.load_summary, lambda loaded: html.render_summary_html(loaded, timeline)
    )
