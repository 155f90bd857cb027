"""The texts a newcomer reads first, read from real runs: the demo's report, the warnings, the stall's
figures, the pointer to a run summary, a `dlwatch run` summary of two loaders, its page's charts.

Each test runs the real thing (the demo, `dlwatch run`, a real stall) and reads what a person would
see: the terminal text, report.md / summary.md, the page in headless Chromium.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shlex
import shutil
import sys

import pytest

from conftest import REPO, TARGETS, chromium_path, incidents, run_bounded, wait_for
from dlwatch.collect.gpu import nvidia_device_nodes

WIDTH = 100  # the terminal view's width when stdout is not a terminal
SCRIPT = "texts_runs.py"


def _line_of(path: str, marker: str) -> int:
    with open(path) as f:
        return next(i for i, line in enumerate(f, 1) if marker in line)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """The package laid out as `pip install .` lays it out (pyproject.toml's package-dir): examples/
    inside it as dlwatch/_examples, playbooks/ as dlwatch/_playbooks; this file's target script ships
    there too, like an example.  First on PYTHONPATH, it is the dlwatch the runs import."""
    site = tmp_path_factory.mktemp("site")
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info")
    shutil.copytree(os.path.join(REPO, "dlwatch"), site / "dlwatch", ignore=skip)
    shutil.copytree(os.path.join(REPO, "examples"), site / "dlwatch" / "_examples", ignore=skip)
    shutil.copytree(os.path.join(REPO, "playbooks"), site / "dlwatch" / "_playbooks", ignore=skip)
    shutil.copy(os.path.join(TARGETS, SCRIPT), site / "dlwatch" / "_examples" / SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("DLWATCH_DIR", "PYTHONWARNINGS")}
    env.update(PYTHONPATH=str(site), DLWATCH_HTML="0")
    return site, env


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("DLWATCH_DIR", "PYTHONWARNINGS")}
    env.update(PYTHONPATH=os.pathsep.join([REPO, TARGETS]), **extra)
    return env


# --------------------------------------------------------------------------- the demo, as installed


@pytest.fixture(scope="module")
def demo(installed, tmp_path_factory):
    """`dlwatch demo` (the deadlock example) from the installed layout, as the README has a newcomer run it."""
    site, env = installed
    tmp = tmp_path_factory.mktemp("demo")
    rc, out, err = run_bounded(
        [sys.executable, "-m", "dlwatch", "demo", "--report-dir", str(tmp / "r")], env=env, cwd=str(tmp), timeout=150
    )
    assert rc == 0, (out[-3000:], err[-3000:])
    (incident,) = incidents(str(tmp / "r"))
    with open(os.path.join(incident, "report.json")) as f:
        report = json.load(f)
    return {"site": site, "env": env, "tmp": tmp, "out": out, "incident": incident, "report": report}


def _block(lines: list[str], start: int) -> list[str]:
    """The line at ``start`` and the lines that continue it (indented deeper than two spaces)."""
    out = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.startswith("    "):
            break
        out.append(line)
    return out


def test_the_demo_s_headline_and_remedy_are_whole_words(demo):
    """Item 1: the headline and the remedy line are wrapped between words, never cut (`held the~`),
    and the verdict is said once (`STALL (deadlock): ... (deadlock) -> ...` said it twice)."""
    lines = demo["out"].splitlines()
    report = demo["report"]
    assert report["trigger"] == "stall" and report["classification"] == "deadlock"
    start = next(i for i, line in enumerate(lines) if line.startswith("STALL"))
    head = _block(lines, start)
    headline = " ".join(line.strip() for line in head)
    assert headline.startswith("STALL (deadlock): no batch progress for ")
    assert headline.count("deadlock") == 1, headline
    title = report["findings"][0]["title"]
    assert headline.endswith(f"-> {title}"), headline  # the top finding's title, every word of it
    remedy_at = next(i for i, line in enumerate(lines) if line.startswith("  -> "))
    remedy = " ".join(line.strip() for line in _block(lines, remedy_at))[3:]
    paragraph = " ".join(
        line.strip() for line in report["findings"][0]["remediation"].split("\n\n")[0].splitlines()
    ).replace("**", "")
    said = remedy.removesuffix(" see report.md").removesuffix("...")
    assert paragraph.startswith(said) and len(said) > 40, (remedy, paragraph)
    assert len(said) == len(paragraph) or paragraph[len(said)] == " ", remedy  # never inside a word
    finding_at = next(i for i, line in enumerate(lines) if line.startswith("  finding: "))
    assert " ".join(line.strip() for line in _block(lines, finding_at)).endswith(title)
    shown = lines[start : lines.index("processes:")]
    assert all(len(line) <= WIDTH and not line.endswith("~") for line in shown), shown


def test_the_demo_s_warning_points_at_the_example_s_for_line(demo):
    """Item 2: installed, the examples live inside the package; the fork-with-threads warning pointed past
    every frame (`sys:1:`), now at the example's `for` line."""
    example = str(demo["site"] / "dlwatch" / "_examples" / "deadlock.py")
    warned = [line for line in demo["out"].splitlines() if "DlwatchWarning: dlwatch: fork-with-threads" in line]
    assert warned, demo["out"][-3000:]
    assert warned[0].startswith(f"  | {example}:{_line_of(example, 'for _ in batches:')}: DlwatchWarning"), warned
    assert "sys:1" not in demo["out"]


def test_no_nvml_note_where_no_gpu_is_expected_but_the_fact_is_kept(demo):
    """Item 3: on a machine without an NVIDIA device node the report's NVML note is a quiet one: kept in
    report.json (notes and quiet_notes), shown with -v only."""
    notes = demo["report"]["notes"]
    gpu = [n for n in notes if n.startswith("GPU: ")]
    if not gpu:
        pytest.skip("NVML works on this machine: no GPU note to keep quiet")
    if nvidia_device_nodes():
        assert "note: GPU: " in demo["out"]  # a GPU is expected here: its absence is news
        return
    assert demo["report"]["quiet_notes"] == gpu
    assert "NVML" not in demo["out"]
    rc, out, err = run_bounded(
        [sys.executable, "-m", "dlwatch", "report", demo["incident"], "-v"],
        env=demo["env"],
        cwd=str(demo["tmp"]),
        timeout=60,
    )
    assert rc == 0, err
    assert f"  note: {gpu[0]}" in out.splitlines()
    with open(os.path.join(demo["incident"], "report.md")) as f:
        assert "NVML" not in f.read()


def test_nvidia_device_nodes_are_character_devices_by_name(tmp_path):
    """The GPU expectation, where no NVIDIA device exists: real device nodes made with mknod (root)."""
    if os.geteuid() != 0:
        pytest.skip("mknod of a character device needs root")
    import stat

    for name in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia1x"):
        os.mknod(tmp_path / name, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    (tmp_path / "nvidia7").write_text("a file, not a device")
    assert nvidia_device_nodes(str(tmp_path)) == (str(tmp_path / "nvidia0"), str(tmp_path / "nvidiactl"))
    assert nvidia_device_nodes(str(tmp_path / "missing")) == ()


def test_the_demo_s_stall_counts_the_wait_it_is_in(demo):
    """Item 4, the epoch's first wait: waiting for data 0.00 s while no progress for 3 s is now 3 s of wait."""
    prog = demo["report"]["progress"]
    assert prog["state"] == "waiting_for_data" and prog["batches"] == 0
    # the wait is read as the report is made, the stall a moment before (and stall_s is rounded to ms)
    assert prog["data_wait_s"] >= prog["data_wait_in_progress_s"] >= prog["stall_s"] - 0.001 > 0, prog
    with open(os.path.join(demo["incident"], "report.md")) as f:
        md = f.read()
    assert "in epoch 0, 0 batches into it (0 batches in all); waiting for data " in md and "1 epochs" not in md


# --------------------------------------------------------------------------- the warning's line, each form


@pytest.mark.parametrize("form", ["as", "plain", "bare"])
def test_the_warning_points_at_the_for_line_in_each_form(installed, tmp_path, form):
    """Item 2 under `with watch(loader) as batches`, `with watch(loader): for b in loader` and `dlwatch run`,
    from a program inside the installed package (where the shipped examples are)."""
    site, env = installed
    script = str(site / "dlwatch" / "_examples" / SCRIPT)
    argv = [script, f"fork-threads-{form}", str(tmp_path / "r")]
    if form == "bare":
        argv = ["-m", "dlwatch", "run", "--report-dir", str(tmp_path / "r"), *argv]
    rc, out, err = run_bounded([sys.executable, *argv], env=env, cwd=str(tmp_path), timeout=90)
    assert rc == 0, err[-3000:]
    warned = [line for line in err.splitlines() if "DlwatchWarning: dlwatch: fork-with-threads" in line]
    line = _line_of(script, f"LINE-{form.upper()}")
    assert warned and warned[0].startswith(f"{script}:{line}: DlwatchWarning"), err[-3000:]


# --------------------------------------------------------------------------- a wait after batches


def test_a_stall_after_batches_counts_the_wait_it_is_in(tmp_path, target):
    """Item 4, a later wait (its start is not in the heartbeat: after the last batch and the last poll
    that saw the loop body): the report's data wait holds it, said apart as data_wait_in_progress_s."""
    from dlwatch.report import render

    t = target(SCRIPT, "stuck-after-batches", str(tmp_path / "r"), env={"DLWATCH_HTML": "0"}, cwd=str(tmp_path))
    t.wait_line("READY", timeout=60)
    assert wait_for(lambda: incidents(str(tmp_path / "r")), timeout=30), "no stall incident"
    (incident,) = incidents(str(tmp_path / "r"))
    with open(os.path.join(incident, "report.json")) as f:
        report = json.load(f)
    prog = report["progress"]
    assert report["trigger"] == "stall" and prog["state"] == "waiting_for_data" and prog["batches"] == 4
    assert prog["data_wait_in_progress_s"] >= prog["stall_s"] - 0.001 and prog["stall_s"] >= 2.0, prog  # ms rounding
    assert prog["data_wait_s"] >= prog["data_wait_in_progress_s"], prog
    shown = "\n".join(render.terminal_view(report))
    said = re.search(r"data wait ([0-9.]+) s", shown)
    assert said and float(said.group(1)) >= 2.0, shown
    assert "in epoch 0, 4 batches into it (4 batches in all);" in render.render_markdown(report)


# --------------------------------------------------------------------------- the pointer to a run summary


def _pointer(err: str) -> tuple[str, str]:
    (line,) = [ln for ln in err.splitlines() if "run summary with advice" in ln]
    m = re.search(r"\((dlwatch report .*)\)$", line)
    assert m, line
    return line, m.group(1)


@pytest.mark.parametrize("where", ["custom", "default"])
def test_the_pointer_to_a_run_summary_runs_as_printed(tmp_path, where):
    """Item 5: `(dlwatch report RUN-ID)` looked in ./dlwatch-reports whatever report_dir was: exit 3.
    Printed with --dir where the directory is not the default, it runs as printed (same directory)."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("pin_memory earns its advice only without an accelerator")
    report_dir = str(tmp_path / "elsewhere" / "reports") if where == "custom" else "-"
    rc, out, err = run_bounded(
        [sys.executable, os.path.join(TARGETS, SCRIPT), "pinned", report_dir],
        env=_env(DLWATCH_HTML="0"),
        cwd=str(tmp_path),
        timeout=90,
    )
    assert rc == 0, err[-3000:]
    line, command = _pointer(err)
    argv = shlex.split(command)
    assert argv[0] == "dlwatch" and ("--dir" in argv) == (where == "custom"), line
    rc, out, err = run_bounded(
        [sys.executable, "-m", *argv], env=_env(), cwd=str(tmp_path), timeout=60
    )  # `dlwatch` is `python -m dlwatch`
    run_id = argv[2]
    assert rc == 0 and out.startswith(f"run {run_id}"), (command, out, err)
    # and plain `dlwatch report` (with the same directory) lists the run under the incidents
    listing = [sys.executable, "-m", "dlwatch", "report"] + (argv[3:] if where == "custom" else [])
    rc, out, err = run_bounded(listing, env=_env(), cwd=str(tmp_path), timeout=60)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0] == "no incidents" and any(ln.startswith(run_id) for ln in lines[1:]), out


# --------------------------------------------------------------------------- two loaders under `dlwatch run`


@pytest.fixture(scope="module")
def two_loaders(tmp_path_factory):
    """`dlwatch run` of a program with 2 loaders x 3 epochs (polled every 0.1 s), its page written."""
    tmp = tmp_path_factory.mktemp("two")
    rc, out, err = run_bounded(
        [
            sys.executable,
            "-m",
            "dlwatch",
            "run",
            "--report-dir",
            str(tmp / "r"),
            "--poll-interval",
            "0.1",
            os.path.join(TARGETS, SCRIPT),
            "two-loaders",
            "-",
        ],
        env=_env(),
        cwd=str(tmp),
        timeout=120,
    )
    assert rc == 0 and "DONE" in out, err[-3000:]
    (run,) = glob.glob(str(tmp / "r" / "runs" / "*"))
    assert wait_for(lambda: os.path.isfile(os.path.join(run, "report.html")), timeout=60), "no report.html"
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    rc, shown, err = run_bounded(
        [sys.executable, "-m", "dlwatch", "report", "--dir", str(tmp / "r"), summary["id"]],
        env=_env(),
        cwd=str(tmp),
        timeout=60,
    )
    assert rc == 0, err
    with open(os.path.join(run, "summary.md")) as f:
        md = f.read()
    with open(os.path.join(run, "report.html")) as f:
        page = f.read()
    return {"run": run, "summary": summary, "terminal": shown, "md": md, "page": page}


def test_a_program_s_epochs_are_said_per_loader(two_loaders):
    """Item 6: `36 batches, 6 epochs` for 2 loaders x 3 epochs; now each loader's epochs and batches."""
    s, shown, md = two_loaders["summary"], two_loaders["terminal"], two_loaders["md"]
    loaders = {e["loader"]: e for e in s["loaders"]}
    assert [(e["iterations"], e["batches"]) for e in loaders.values()] == [(3, 36), (3, 12)]
    assert s["loop"]["iterations"] == 6 and s["loop"]["batches"] == 48
    headline = (
        "48 batches in 6 iterations of 2 loaders "
        "(loader1 (Squares): 3 epochs, 36 batches; loader2 (Squares): 3 epochs, 12 batches)"
    )
    assert headline in shown and headline in md
    assert "6 epochs" not in shown and "6 epochs" not in md
    assert "loader1 (Squares, 2 workers): 3 epochs, 36 batches" in shown
    assert "loader2 (Squares, 1 worker): 3 epochs, 12 batches" in shown
    # every loader's settings, not only the last one's
    assert [e["config"]["num_workers"] for e in loaders.values()] == [2, 1]
    assert "## Loaders' settings" in md and "| setting | loader1 (Squares) | loader2 (Squares) |" in md
    page = two_loaders["page"]
    assert "<h2>Loaders' settings</h2>" in page and "<th>loader1 (Squares)</th><th>loader2 (Squares)</th>" in page


def test_every_worker_of_every_iteration_is_named_with_its_figures(two_loaders):
    """Item 6: later workers read `worker - (pid N)` with `cpu - cores; not observed`; now each iteration
    names each worker it started (its worker id), with its figures or why a figure is missing."""
    s, shown, md = two_loaders["summary"], two_loaders["terminal"], two_loaders["md"]
    rows = s["iterations"]
    assert [(r["loader"], r["epoch"]) for r in rows] == [(f"loader{i % 2 + 1}", i // 2) for i in range(6)]
    measured = 0
    for r in rows:
        each = r["worker_processes"]
        assert [w["worker_id"] for w in each] == list(range(2 if r["loader"] == "loader1" else 1)), r
        for w in each:
            line = f"iteration {r['iteration']}: {r['loader']} (Squares) epoch {r['epoch']}, worker {w['worker_id']} (pid {w['pid']}): "
            assert line in shown, (line, shown)
            if w["cpu_util"] is not None:
                measured += 1
                assert w["polls"] >= 2 and f"cpu {w['cpu_util']:.3g} cores;" in shown
            else:
                assert w["polls"] in (0, 1) and ("between two polls" in shown or "need two" in shown)
    assert measured >= 4, rows  # polled every 0.1 s, iterations of about 0.3 s: most workers are measured
    for text in (shown, md):
        assert "worker -" not in text and "cpu - cores" not in text and "not observed" not in text


def test_no_advice_says_which_minimum_was_not_reached(two_loaders):
    """Item 7: a run that waited for data nearly all the time said `No advice: nothing in this run's
    figures called for a change`; it says that input-bound needs 5 s of steady loop time."""
    s = two_loaders["summary"]
    loop = s["loop"]
    steady = loop["steady_data_wait_s"] + loop["body_s"]
    assert loop["steady_data_wait_share"] >= 0.2 and steady < 5.0, loop  # waiting, but too short to judge
    assert s["advice"] == []
    (entry,) = [e for e in s["advice_not_judged"] if e["playbook"] == "input-bound"]
    assert entry["unmet"] == [{"figure": "steady_loop_s", "needs": 5.0, "value": round(steady, 3)}]
    said = "too short to judge input-bound (needs at least 5.00 s of steady loop time, this run "
    assert said in two_loaders["md"] and said in two_loaders["terminal"], two_loaders["md"]
    assert said in two_loaders["page"]
    assert "No advice: nothing in this run" not in two_loaders["md"]


def test_the_page_marks_each_loader_s_epochs(two_loaders):
    """Item 6: the page's epoch markers read `epoch 3/5/6` (iterations of every loader counted as one,
    those between two polls missed); now `loader1 epoch 0`... where each iteration began."""
    m = re.search(r'<script id="dlwatch-data" type="application/json">(.*?)</script>', two_loaders["page"], re.S)
    assert m, "no chart data in the page"
    data = json.loads(m.group(1))
    labels = [mk["label"] for mk in data["markers"]]
    assert labels == [f"loader{i % 2 + 1} epoch {i // 2}" for i in range(6)], labels


# --------------------------------------------------------------------------- the charts' axes, in Chromium


def _ticks(pages: dict[str, str], tmp_path) -> dict[str, dict[str, list[str]]]:
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    browser_path = chromium_path()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium; .ci/run installs it)")
    seen: dict[str, dict[str, list[str]]] = {}
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            tab = browser.new_page(viewport={"width": 1100, "height": 1000})
            tab.on("pageerror", lambda e: errors.append(str(e)))
            for name, page in pages.items():
                tab.goto(f"file://{page}")
                tab.wait_for_function("document.body.getAttribute('data-charts-drawn') !== null", timeout=30_000)
                seen[name] = tab.evaluate(
                    "Object.fromEntries([...document.querySelectorAll('.chart')].map("
                    "el => [el.id.slice(6), JSON.parse(el.getAttribute('data-y-ticks') || 'null')]))"
                )
                tab.screenshot(path=str(tmp_path / f"{name}.png"), full_page=True)
        finally:
            browser.close()
    assert errors == []
    return seen


def test_chart_axes_fit_their_data(demo, two_loaders, tmp_path):
    """Item 8: the CPU axis ran 0-100 cores with every process idle; Mlocked's ticks all read 13.8 MiB.
    Now every axis's ticks read apart, in the data's unit, over the data's range (idle: up to one core)."""
    rc, out, err = run_bounded(
        [sys.executable, "-m", "dlwatch", "report", demo["incident"], "--html"],
        env=demo["env"],
        cwd=str(demo["tmp"]),
        timeout=60,
    )
    assert rc == 0, err
    seen = _ticks({"incident": out.strip(), "run": os.path.join(two_loaders["run"], "report.html")}, tmp_path)
    for page, charts in seen.items():
        for chart, ticks in charts.items():
            assert ticks and len(set(ticks)) == len(ticks), (page, chart, ticks)  # no two alike
    # the deadlocked job: every process idle, so the CPU axis ends at one core, not at 100
    cpu = [float(t) for t in seen["incident"]["cpu"]]
    assert max(cpu) <= 1.0, seen["incident"]["cpu"]
    # sizes step in one binary unit (50 MiB, not 47.7 MiB)
    for page in seen:
        for chart in ("memory", "mlocked", "mem_available"):
            ticks = seen[page].get(chart)
            if not ticks or len(ticks) < 2:
                continue
            units = {t.split()[1] for t in ticks}
            values = [float(t.split()[0]) for t in ticks]
            steps = {round(b - a, 6) for a, b in zip(values, values[1:])}
            assert len(units) == 1 and len(steps) == 1, (page, chart, ticks)
