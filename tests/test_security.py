"""Privacy: secrets never reach a file dlwatch writes; files are private; nothing listens."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import psutil
from torch.utils.data import DataLoader

import dlwatch
from conftest import REPO, TARGETS, incidents, load, wait_for

sys.path.insert(0, TARGETS)
from datasets import Squares  # noqa: E402

SECRETS = ["hunter2-secret-value", "pw-secret-value", "tok-3f9a8b7c6d5e4f3a", "AKIAIOSFODNN7EXAMPLE",
           "hf_abcdefghijklmnopqrstuvwxyzABCDEF12", "argpass-0123456789", "env-secret-never-read"]


def test_no_secret_in_any_file_written(tmp_path):
    args = ["--api-token=tok-3f9a8b7c6d5e4f3a", "--password", "argpass-0123456789",
            "--aws-key", "AKIAIOSFODNN7EXAMPLE", "hf_abcdefghijklmnopqrstuvwxyzABCDEF12",
            "--data-url=https://bob:pw-secret-value@example.invalid/x"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TARGETS]), MY_SERVICE_SECRET="env-secret-never-read",
               TMPDIR=str(tmp_path / "tmp"))
    os.makedirs(env["TMPDIR"])
    out = subprocess.run([sys.executable, os.path.join(TARGETS, "faulty.py"), str(tmp_path / "r"), *args],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "ValueError" in out.stderr
    found = incidents(str(tmp_path / "r"))
    assert len(found) == 1
    report = load(found[0])
    assert "password=***" in report["exception"]["message"]  # readable, but not the value
    assert "--password ***" in next(p["cmdline"] for p in report["processes"] if p["role"] == "main")
    written = 0
    for root, dirs, files in os.walk(tmp_path / "r"):
        for d in dirs:
            assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o700, (root, d)
        for name in files:
            path = os.path.join(root, name)
            assert stat.S_IMODE(os.stat(path).st_mode) == 0o600, path
            data = open(path, "rb").read().decode("utf-8", "replace")
            written += 1
            for secret in SECRETS:
                assert secret not in data, (secret, path)
    assert written >= 3
    # what dlwatch printed (the monitor's stderr line) holds none either
    dlwatch_lines = [line for line in out.stderr.splitlines() if line.startswith("dlwatch:")]
    assert dlwatch_lines and not any(s in line for s in SECRETS for line in dlwatch_lines)
    assert "env-secret-never-read" not in open(os.path.join(found[0], "report.json")).read()


def test_run_directory_is_private_and_monitor_listens_nowhere(tmp_path, no_leftovers):
    dl = DataLoader(Squares(64, sleep_s=0.005), batch_size=4, num_workers=2)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.05) as batches:
        for i, _ in enumerate(batches):
            if i == 8:
                assert wait_for(lambda: os.path.exists(os.path.join(batches.run_dir, "timeline.jsonl")), 10)
                monitor = psutil.Process(batches.monitor_pid)
                assert monitor.net_connections(kind="all") == []
                assert not [f for f in os.listdir(f"/proc/{monitor.pid}/fd")
                            if os.readlink(f"/proc/{monitor.pid}/fd/{f}").startswith("socket:")]
                for root, dirs, files in os.walk(tmp_path):
                    for d in dirs:
                        assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o700
                    for name in files:
                        assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o600, name
                assert {"heartbeat", "events.jsonl", "config.json", "timeline.jsonl"} <= set(os.listdir(batches.run_dir))
