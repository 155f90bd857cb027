"""`dlwatch top PID` in a real terminal: tmux, 80x24, a real DataLoader job, keys sent, the pane captured."""

from __future__ import annotations

import os
import re
import secrets
import shutil
import subprocess
import sys

import pytest

from conftest import TARGETS, descendants_of, incidents, kill_session, load, wait_for

SCRIPT = os.path.join(TARGETS, "plain_train.py")
pytestmark = pytest.mark.skipif(
    shutil.which("tmux") is None, reason="tmux is not installed (apt-get install tmux; .ci/run installs it)"
)


class Tmux:
    """A private tmux server (its own socket) with one 80x24 pane."""

    def __init__(self) -> None:
        self.socket = f"dlwatch-test-{os.getpid()}-{secrets.token_hex(3)}"

    def tmux(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(["tmux", "-L", self.socket, *args], capture_output=True, text=True, timeout=30)

    def start(self, command: list[str], env: dict[str, str]) -> None:
        import shlex

        line = " ".join(shlex.quote(c) for c in command)
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        out = self.tmux(
            "-f",
            "/dev/null",
            "new-session",
            "-d",
            "-x",
            "80",
            "-y",
            "24",
            "-s",
            "top",
            f"env {exports} {line}; echo EXITED $?; sleep 30",
        )
        assert out.returncode == 0, out.stderr

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "top").stdout

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "top", *keys)

    def close(self) -> None:
        self.tmux("kill-server")


def _job(tmp_path, watched: bool):
    env = dict(os.environ)
    env["PYTHONPATH"] = ""
    cmd = (
        [
            sys.executable,
            "-m",
            "dlwatch",
            "run",
            "--report-dir",
            str(tmp_path / "run-reports"),
            "--stall-timeout",
            "3600",
            SCRIPT,
            "deadlock",
        ]
        if watched
        else [sys.executable, SCRIPT, "deadlock"]
    )
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    line = ""
    while not line.startswith("READY"):
        line = proc.stdout.readline()
        assert line or proc.poll() is None, proc.stderr.read()
    return proc


@pytest.mark.parametrize("watched", [True, False])
def test_top_in_tmux_shows_workers_snapshots_and_quits(tmp_path, watched):
    proc = _job(tmp_path, watched)
    term = Tmux()
    known: set[int] = set()
    try:
        known.update(p.pid for p in descendants_of(proc.pid))

        def named_workers():  # a worker names itself pt_data_worker once it runs: wait for both
            found = []
            for p in descendants_of(proc.pid):
                try:
                    if p.name() == "pt_data_worker":
                        found.append(p.pid)
                except Exception:
                    pass
            return found if len(found) == 2 else None

        workers = wait_for(named_workers, timeout=30)
        assert workers, [p.name() for p in descendants_of(proc.pid)]
        out = tmp_path / "attach"
        term.start(
            [sys.executable, "-m", "dlwatch", "top", str(proc.pid), "--interval", "0.3", "--out", str(out)],
            {"PYTHONPATH": "", "TERM": "xterm"},
        )
        screen = wait_for(
            lambda: (s := term.screen()) and all(f"{w}  worker" in s for w in workers) and "lock acquire" in s and s,
            timeout=60,
        )
        assert screen, term.screen()
        lines = screen.splitlines()
        assert len(lines) <= 24 and all(len(line) <= 80 for line in lines)
        assert lines[0].startswith(f"dlwatch top - pid {proc.pid} - ")
        rows = {line.split()[0]: line.split() for line in lines if line.split() and line.split()[0].isdigit()}
        for w in workers:  # each worker: state S, waits in a lock (the lock held across fork), fds/limit
            line = " ".join(rows[str(w)])
            # the worker id comes from the watched run's registrations; unwatched, only the role is known
            worker = r"worker \d" if watched else "worker"
            assert re.fullmatch(rf"{w} {worker} S lock acquire \S+ \d+/\d+ \S+ \S+ -", line), line
        assert rows[str(proc.pid)][1] == "main"
        if watched:
            assert "watched: 0 batches, epoch 1" in screen and "now waiting_for_data" in screen
            assert any(r[1] == "monitor" for r in rows.values())
        else:
            assert "not watched by dlwatch" in screen
        assert "q quit   s write an attach incident now" in screen
        term.keys("s")
        shown = wait_for(lambda: "wrote an attach incident (" in term.screen() and term.screen(), timeout=90)
        assert shown, term.screen()
        found = incidents(str(out))
        assert len(found) == 1, shown
        report = load(found[0])
        assert report["trigger"] == "attach" and report["pid"] == proc.pid
        assert report["classification"] == "deadlock"
        assert os.path.basename(found[0]) in shown.replace("\n", "")
        term.keys("q")
        assert wait_for(lambda: "EXITED 0" in term.screen(), timeout=30), term.screen()
    finally:
        term.close()
        known.update(p.pid for p in descendants_of(proc.pid))
        kill_session(proc.pid, known)
        proc.communicate()


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["top", "abc"], 2, "PID must be a number"),
        (["top", "999999999"], 3, "no process with pid 999999999"),
        (["top", "1"], 4, "pid 1 is the init process"),
        (["top", str(os.getpid()), "--interval", "0"], 2, "--interval must be between"),
    ],
)
def test_top_bad_input_one_line(args, code, text):
    out = subprocess.run([sys.executable, "-m", "dlwatch", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == code, out.stderr
    assert out.stderr.count("\n") == 1 and out.stderr.startswith("dlwatch: error: ") and text in out.stderr


def test_top_once_prints_one_frame(target, tmp_path):
    t = target("hang.py", "deadlock", str(tmp_path), "--unwatched")
    t.wait_line("READY", timeout=60)
    out = subprocess.run(
        [sys.executable, "-m", "dlwatch", "top", str(t.pid), "--once", "--interval", "0.2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"dlwatch top - pid {t.pid}")
    workers = [line for line in lines if " worker " in line]
    assert len(workers) == 2 and all("lock acquire" in line for line in workers)
