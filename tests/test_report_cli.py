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


def make_incident(report_dir: str, trigger: str = "exception", *, playbook: str | None = None, now: float | None = None) -> str:
    report = store.skeleton(trigger=trigger, pid=4242, now=now or time.time())
    if trigger == "exception":
        report["exception"] = {"type": "builtins.OSError", "message": "[Errno 24] Too many open files",
                               "errno": 24, "traceback": "Traceback ...", "from_loader": True}
    if playbook:
        report["findings"] = [{"playbook": playbook, "title": "Too many open files", "confidence": 0.9,
                               "evidence": {"num_fds": 1021}, "remediation": "Close your files."}]
    report["processes"] = [build.process_entry(4242, "main", sample={"num_fds": 1021, "fd_limit": 1024, "rss": 1 << 20})]
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
    assert "builtins.OSError" in out and "[exception]" in out
    assert main(["report", "--json", new]) == 0
    assert json.loads(capsys.readouterr().out)["findings"][0]["playbook"] == "fd-exhaustion"
    assert main(["report", "--dir", str(tmp_path), os.path.basename(new)]) == 0
    shown = capsys.readouterr().out
    assert "fd-exhaustion" in shown and "num_fds: 1021" in shown  # the evidence, not only the title


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
    out = subprocess.run([sys.executable, "-m", "dlwatch", "report", str(tmp_path)], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "exception" in out.stdout
    out = subprocess.run([sys.executable, "-m", "dlwatch", "report", "--bogus"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1


def test_render_lists_stacks_and_gone_processes():
    report = store.skeleton(trigger="stall", pid=7, now=time.time())
    report["classification"] = "deadlock"
    entry = build.process_entry(8, "worker", worker_id=0, sample={"gone": True})
    entry["status"] = "blocked"
    entry["waiting_in"] = "lock acquire"
    entry["stack"] = {"source": "py-spy", "threads": [{"thread_id": 1, "name": "MainThread", "frames": [
        {"function": "__getitem__", "filename": "ds.py", "line": 3, "native": False}]}], "error": None}
    report["processes"] = [entry]
    text = "\n".join(render.terminal_lines(report))
    assert "blocked in lock acquire" in text and "__getitem__ (ds.py:3)" in text and "gone" in text
