"""Ctrl-C stays the user's: a KeyboardInterrupt ends a watched program exactly as it ends the bare one.

A terminal's Ctrl-C sends SIGINT to the whole foreground process group: the training process, its
DataLoader workers (torch makes them ignore it) and dlwatch's monitor.  The test does the same
(killpg) once the target says it is in the loop body or waiting for a batch, in fresh processes:
bare, watch() in both forms, and `dlwatch run`.  Compared with the bare run: the exit status, stdout,
stderr (one traceback, the same frames, no dlwatch frame), and no process left behind.  dlwatch
records no failure for it: no exception incident, and the run summary says ``ended: interrupted``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

import dlwatch

from conftest import REPO, TARGETS, processes_with, wait_for

pytestmark = pytest.mark.slow

SCRIPT = os.path.join(TARGETS, "interrupt.py")
PACKAGE = os.path.dirname(os.path.abspath(dlwatch.__file__)) + os.sep  # dlwatch's own frames live here


def _run(argv: list[str], env: dict[str, str]) -> tuple[int, str, str]:
    # as a terminal starts a program: SIGINT at its default.  A shell's background job (a CI runner's
    # `cmd &`) ignores SIGINT and its children inherit that, and Python then never raises on Ctrl-C.
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=_default_sigint,
    )
    out: list[str] = []
    try:
        for line in proc.stdout:  # bounded: the target sleeps 30 s at most before READY is printed
            out.append(line)
            if line.startswith("READY"):
                break
        else:
            pytest.fail(f"the target never got ready: {''.join(out)} {proc.stderr.read()}")
        # precondition: the main thread is blocked in the sleep or the wait for a batch (not still
        # between READY and the call), seen twice in a row, so a loaded machine cannot move the landing spot
        assert wait_for(lambda: _blocked(proc.pid) and (time.sleep(0.1) or _blocked(proc.pid)), timeout=30)
        # the pgid is the target's pid (a session of its own): the whole group, as a terminal does
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=60)
        left = wait_for(lambda: not processes_with(SCRIPT), timeout=10) or processes_with(SCRIPT)
        assert left is True, f"processes left behind: {[(p.pid, p.name()) for p in left]}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for p in processes_with(SCRIPT):
            p.kill()
        proc.wait()
    return proc.returncode, "".join(out) + rest, err


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _blocked(pid: int) -> bool:
    """The process's main thread sits in a blocking system call (sleep, poll), not running code."""
    try:
        with open(f"/proc/{pid}/syscall") as f:
            first = f.read().split()[0]
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return first.isdigit() and state == "S"


def _frames(stderr: str) -> str:
    """The traceback with the run-specific parts made comparable (interpreter and library paths)."""
    text = re.sub(r'File "[^"]*/(site-packages|lib/python3\.\d+)/', r'File "<\1>/', stderr)
    return text


@pytest.mark.parametrize("where", ["body", "next"])
def test_ctrl_c_ends_the_program_as_bare(tmp_path, where):
    results = {}
    for mode, argv in [
        ("bare", [sys.executable, SCRIPT, "bare", where]),
        ("plain", [sys.executable, SCRIPT, "plain", where]),
        ("as", [sys.executable, SCRIPT, "as", where]),
        ("run", [sys.executable, "-m", "dlwatch", "run", "--poll-interval", "0.2", SCRIPT, "bare", where]),
    ]:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TARGETS]), DLWATCH_DIR=str(tmp_path / mode))
        results[mode] = _run(argv, env)
    rc, out, err = results["bare"]
    assert rc == -signal.SIGINT, (rc, err)  # python re-raises the SIGINT it died of
    assert err.rstrip().endswith("KeyboardInterrupt") and err.count("Traceback") == 1, err
    for mode in ("plain", "as", "run"):
        got = results[mode]
        assert got[0] == rc, (mode, got)
        assert got[1] == out, (mode, got[1], out)
        assert _frames(got[2]) == _frames(err), (mode, got[2], err)
        # no frame of dlwatch's package and no warning of its own (paths may hold "dlwatch": CI's venv does)
        assert PACKAGE not in got[2] and "Dlwatch" not in got[2], (mode, got[2])
    # dlwatch recorded the runs, and no failure: no incident; the summary says "interrupted" (under
    # `dlwatch run` the program's one summary is written at exit, where the KeyboardInterrupt that
    # ended it is known wherever it landed)
    for mode in ("plain", "as", "run"):
        reports = tmp_path / mode
        assert [d for d in os.listdir(reports) if d not in ("runs", ".runs", ".jobs")] == [], mode
        ended = []
        for run in os.listdir(reports / "runs"):
            with open(reports / "runs" / run / "summary.json") as f:
                ended.append(json.load(f)["ended"])
        assert ended == ["interrupted"], (mode, ended)
