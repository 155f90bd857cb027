"""`dlwatch report`: listing, showing, JSON, and clear one-line errors on bad input."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from dlwatch.cli import main
from dlwatch.report import build, render, store

from conftest import fuzz_fields


def make_incident(
    report_dir: str, trigger: str = "exception", *, playbook: str | None = None, now: float | None = None
) -> str:
    report = store.skeleton(trigger=trigger, pid=4242, now=now or time.time())
    if trigger == "exception":
        report["exception"] = {
            "type": "builtins.OSError",
            "message": "[Errno 24] Too many open files",
            "errno": 24,
            "traceback": "Traceback ...",
            "from_loader": True,
        }
    if playbook:
        report["findings"] = [
            {
                "playbook": playbook,
                "title": "Too many open files",
                "confidence": 0.9,
                "evidence": {"num_fds": 1021},
                "remediation": "Close your files.",
            }
        ]
    report["processes"] = [
        build.process_entry(4242, "main", sample={"num_fds": 1021, "fd_limit": 1024, "rss": 1 << 20})
    ]
    return build.write(report, report_dir)


def test_list_newest_first_and_show(tmp_path, capsys):
    old = make_incident(str(tmp_path), now=time.time() - 100)
    new = make_incident(str(tmp_path), "threshold", playbook="fd-exhaustion")
    assert main(["report", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(os.path.basename(new)) and "fd-exhaustion" in lines[1]
    assert lines[2].startswith(os.path.basename(old))
    assert main(["report", old]) == 0
    out = capsys.readouterr().out
    assert "builtins.OSError" in out and out.startswith("EXCEPTION: ")  # the headline first
    assert main(["report", "--json", new]) == 0
    assert json.loads(capsys.readouterr().out)["findings"][0]["playbook"] == "fd-exhaustion"
    assert main(["report", "--dir", str(tmp_path), os.path.basename(new)]) == 0
    shown = capsys.readouterr().out
    assert "fd-exhaustion" in shown and "num fds: 1021" in shown  # the evidence, not only the title


def test_default_dir_from_env(tmp_path, monkeypatch, capsys):
    inc = make_incident(str(tmp_path))
    monkeypatch.setenv("DLWATCH_DIR", str(tmp_path))
    assert main(["report"]) == 0
    assert os.path.basename(inc) in capsys.readouterr().out
    assert main(["report", os.path.basename(inc)]) == 0


def test_files_are_private_and_markdown_complete(tmp_path):
    inc = make_incident(str(tmp_path / "r"), playbook="fd-exhaustion")
    assert os.stat(tmp_path / "r").st_mode & 0o777 == 0o700
    assert os.stat(inc).st_mode & 0o777 == 0o700
    for name in os.listdir(inc):
        assert os.stat(os.path.join(inc, name)).st_mode & 0o777 == 0o600
    md = open(os.path.join(inc, "report.md")).read()
    assert "## Findings" in md and "Close your files." in md and "## Processes" in md


def test_errors_are_one_line_with_exit_codes(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 3
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("dlwatch: error:")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["report", str(empty)]) == 0
    assert "no incidents" in capsys.readouterr().out
    assert main(["report", "--dir", str(empty), "no-such-id"]) == 3


def test_damaged_and_newer_reports(tmp_path, capsys):
    good = make_incident(str(tmp_path))
    bad = tmp_path / "20200101T000000Z-exception-1-dead"
    bad.mkdir()
    (bad / "report.json").write_text('{"schema_version": 1, "id": "x", "crea')  # truncated
    newer = tmp_path / "20200101T000000Z-exception-1-beef"
    newer.mkdir()
    data = json.load(open(os.path.join(good, "report.json")))
    data["schema_version"] = 99
    (newer / "report.json").write_text(json.dumps(data))
    (tmp_path / ".tmp-half-written").mkdir()
    assert main(["report", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert os.path.basename(good) in captured.out
    assert "skipped 20200101T000000Z-exception-1-dead" in captured.err
    assert "newer than this dlwatch understands" in captured.err
    assert ".tmp-half-written" not in captured.out
    assert main(["report", str(bad)]) == 6
    assert "damaged or truncated" in capsys.readouterr().err
    assert main(["report", str(newer)]) == 6
    assert "upgrade dlwatch" in capsys.readouterr().err


def test_write_is_atomic_on_failure(tmp_path, monkeypatch):
    report = store.skeleton(trigger="exception", pid=1, now=time.time())

    def broken(_report):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        store.write_incident(str(tmp_path), report, render_markdown=broken)
    assert [n for n in os.listdir(tmp_path)] == []  # neither the incident nor its temporary directory


def test_console_script_and_module_entry(tmp_path):
    make_incident(str(tmp_path))
    out = subprocess.run(
        [sys.executable, "-m", "dlwatch", "report", str(tmp_path)], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "exception" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "dlwatch", "report", "--bogus"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1


def test_render_lists_stacks_and_gone_processes():
    report = store.skeleton(trigger="stall", pid=7, now=time.time())
    report["classification"] = "deadlock"
    entry = build.process_entry(8, "worker", worker_id=0, sample={"gone": True})
    entry["status"] = "blocked"
    entry["waiting_in"] = "lock acquire"
    entry["stack"] = {
        "source": "py-spy",
        "threads": [
            {
                "thread_id": 1,
                "name": "MainThread",
                "frames": [{"function": "__getitem__", "filename": "ds.py", "line": 3, "native": False}],
            }
        ],
        "error": None,
    }
    report["processes"] = [entry]
    text = "\n".join(render.terminal_lines(report))
    row = next(line.split() for line in text.splitlines() if line.strip().startswith("8 "))
    assert row == ["8", "worker", "0", "blocked,", "gone", "lock", "acquire", "-", "-", "-", "-"]
    assert "pid 8 (worker 0): __getitem__ (ds.py:3)" in text


# --------------------------------------------------------------------------- hostile report files (issue 9, item 7)

NOBODY = 65534


def _shared_dir_prepared_by_nobody(code: str) -> str:
    """A report directory owned by another uid, with what ``code`` (run as that uid) put in it."""
    import shutil
    import tempfile

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv to let a second uid prepare the files")
    shared = tempfile.mkdtemp(prefix="dlwatch-shared-", dir="/tmp")
    os.chmod(shared, 0o755)
    os.chown(shared, NOBODY, NOBODY)
    out = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", sys.executable, "-c", code, shared],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    return shared


TRAPS = r"""
import json, os, sys, time
d = sys.argv[1]
good = {"schema_version": 1, "id": "x", "created_at": "2026-01-01T00:00:00+00:00", "trigger": "exception",
        "pid": 1, "summary": "s", "findings": [], "processes": [], "notes": []}
def incident(name, body):
    os.mkdir(os.path.join(d, name))
    with open(os.path.join(d, name, "report.json"), "wb") as f:
        f.write(body if isinstance(body, bytes) else json.dumps(body).encode())
incident("20260101T000000Z-exception-1-deep", b"[" * 200000 + b"]" * 200000)
incident("20260101T000000Z-exception-1-deep2", dict(good, notes=json.loads("[" * 70 + "1" + "]" * 70)))
incident("20260101T000000Z-exception-1-types", dict(good, exception="boom", processes=[{"pid": 1, "role": 5,
         "stack": {"threads": [{"frames": "not a list"}]}}], findings=[{"evidence": [1, 2]}]))
incident("20260101T000000Z-exception-1-types2", dict(good, processes=[{"pid": 1, "role": None, "sample": 7}]))
os.mkdir(os.path.join(d, "20260101T000000Z-exception-1-fifo"))
os.mkfifo(os.path.join(d, "20260101T000000Z-exception-1-fifo", "report.json"))
incident("20260101T000000Z-exception-1-ansi", dict(good, id="ansi\x1b]0;owned\x07", summary="\x1b[2J\x1b[31mred\u202e",
         exception={"type": "builtins.ValueError", "message": "\x1b[1;1H\x1b[2Kfake prompt $ \x9b31m"}))
os.symlink("/root", os.path.join(d, "20260101T000000Z-exception-1-link"))
"""


def test_hostile_report_files_from_another_user(capsys):
    """Another uid fills a shared report directory with traps; root lists and shows it."""
    import shutil

    shared = _shared_dir_prepared_by_nobody(TRAPS)
    try:

        def cli(*args):
            # a subprocess with a bound: the FIFO named report.json used to hang here for good
            return subprocess.run(
                [sys.executable, "-m", "dlwatch", "report", *args], capture_output=True, text=True, timeout=60
            )

        out = cli(shared)
        assert out.returncode == 0, out.stderr
        rows = {line.split()[0]: line for line in out.stdout.splitlines()[1:]}
        assert "ansi\\x1b]0;owned\\x07" in rows  # listed, escaped
        for name in ("deep", "deep2", "types", "types2", "fifo", "link"):
            row = rows[f"20260101T000000Z-exception-1-{name}"]
            assert "DAMAGED" in row, row
        assert "not a regular file" in rows["20260101T000000Z-exception-1-fifo"]
        assert "symbolic link" in rows["20260101T000000Z-exception-1-link"]
        assert "\x1b" not in out.stdout + out.stderr and "\x9b" not in out.stdout + out.stderr
        assert "Traceback" not in out.stderr
        listed = json.loads(cli("--json", shared).stdout)
        assert {e["id"] for e in listed if e["damaged"]} == {
            f"20260101T000000Z-exception-1-{n}" for n in ("deep", "deep2", "types", "types2", "fifo", "link")
        }
        for name in ("deep", "deep2", "types", "types2", "fifo"):
            shown = cli(os.path.join(shared, f"20260101T000000Z-exception-1-{name}"))
            assert shown.returncode == 6, (name, shown.stderr)
            assert shown.stderr.count("\n") == 1 and "Traceback" not in shown.stderr
        shown = cli(os.path.join(shared, "20260101T000000Z-exception-1-ansi"))
        assert shown.returncode == 0, shown.stderr
        assert "\\x1b[2J\\x1b[31mred\\u202e" in shown.stdout and "fake prompt $ \\x9b31m" in shown.stdout
        assert "\x1b" not in shown.stdout and "\x9b" not in shown.stdout and "\u202e" not in shown.stdout
        assert not os.path.exists(os.path.join(shared, "20260101T000000Z-exception-1-fifo", "x"))
    finally:
        shutil.rmtree(shared, ignore_errors=True)


def test_backticks_in_exception_cannot_leave_the_code_block(tmp_path, no_leftovers):
    """A real exception whose message holds fences and Markdown: report.md keeps it inside one block."""
    from torch.utils.data import DataLoader

    import dlwatch
    from conftest import TARGETS, drop_traceback, incidents

    sys.path.insert(0, TARGETS)
    from datasets import Squares

    message = "bad\n```\n# Injected heading\n[click](http://example.invalid)\n````\nend `x`"
    dl = DataLoader(Squares(8), batch_size=2, num_workers=1)
    with pytest.raises(ValueError) as info:
        with dlwatch.watch(dl, report_dir=tmp_path / "r", poll_interval=0.05):
            for _ in dl:
                raise ValueError(message)
    drop_traceback(info)
    md = open(os.path.join(incidents(str(tmp_path / "r"))[0], "report.md")).read().splitlines()
    start = md.index("bad") - 1
    fence = md[start]
    assert set(fence) == {"`"} and len(fence) == 5  # one longer than the longest run inside
    end = md.index(fence, start + 1)
    assert md[start + 1 : end] == message.splitlines()
    open_fence, outside = None, []  # CommonMark: a fence closes on a backtick-only line at least as long
    for line in md:
        ticks = line.strip()
        if ticks and set(ticks) == {"`"} and len(ticks) >= 3:
            if open_fence is None:
                open_fence = len(ticks)
                continue
            if len(ticks) >= open_fence:
                open_fence = None
                continue
        if open_fence is None:
            outside.append(line)
    assert open_fence is None
    assert not any(line.startswith(("# Injected", "[click]", "end `x`")) for line in outside)
    assert md.count("# Injected heading") == 2  # the message block and the traceback block


def test_fence_and_terminal_escape_helpers():
    assert render.fence("no ticks") == "```"
    assert render.fence("a ```` b") == "`````"
    assert render.code("x`y") == "``x`y``" and render.code("`x") == "`` `x ``"
    assert render.terminal_safe("a\x1b[0mb\tc\x7f\x85\u202e") == "a\\x1b[0mb\tc\\x7f\\x85\\u202e"


def test_any_field_of_any_type_is_shown_or_called_damaged(tmp_path):
    """Wrong types anywhere the renderers look: a clean ReportError (exit 6), never a traceback."""
    base = json.load(open(os.path.join(make_incident(str(tmp_path / "r"), playbook="fd-exhaustion"), "report.json")))
    base["processes"][0]["stack"] = {
        "source": "py-spy",
        "threads": [{"name": "MainThread", "frames": [{"function": "f", "filename": "a.py", "line": 1}]}],
    }
    paths = [
        ("summary",),
        ("exception",),
        ("exception", "message"),
        ("exception", "type"),
        ("findings",),
        ("findings", 0),
        ("findings", 0, "evidence"),
        ("findings", 0, "remediation"),
        ("processes",),
        ("processes", 0),
        ("processes", 0, "role"),
        ("processes", 0, "sample"),
        ("processes", 0, "stack"),
        ("processes", 0, "stack", "threads"),
        ("processes", 0, "stack", "threads", 0),
        ("processes", 0, "stack", "threads", 0, "frames", 0),
        ("processes", 0, "sample", "fds"),
        ("rank",),
        ("progress",),
        ("system",),
        ("gpus",),
        ("loader",),
        ("notes",),
        ("classification",),
    ]
    target = tmp_path / "one"
    target.mkdir()

    def show(loaded):
        "\n".join(render.terminal_lines(loaded))
        render.render_markdown(loaded)

    fuzz_fields(base, paths, target, "report.json", store.load_report, show, examples=300)
