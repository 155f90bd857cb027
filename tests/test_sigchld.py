"""A worker dying while dlwatch's own code runs surfaces exactly as it would bare.

torch installs a SIGCHLD handler that raises "DataLoader worker (pid N) is killed by signal" in
whatever Python code the main thread runs when a worker dies.  Inside dlwatch's code that exception
used to be swallowed by the catch-alls that keep dlwatch's failures from the training loop (the
loop then met torch's slower "exited unexpectedly" 5 s later, or nothing at all), or lost while the
watch's exit had the handler set aside.  Now torch's handler waits while dlwatch's code runs and is
run right after: the same exception, with no dlwatch frame, and the incident is written.

Each moment is hit for real: a worker is SIGKILLed from inside the named dlwatch function, in a fresh
process (tests/targets/worker_dies.py).
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import REPO, TARGETS, incidents, load, run_to_end

SCRIPT = os.path.join(TARGETS, "worker_dies.py")
KILLED = "EXC RuntimeError: DataLoader worker (pid N) is killed by signal: Killed."


def _run(tmp_path, moment: str) -> tuple[int, str, str, str]:
    report_dir = str(tmp_path / moment)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TARGETS]))
    rc, out, err = run_to_end(
        [sys.executable, SCRIPT, moment, report_dir], env=env, marker=SCRIPT, timeout=120, what=f"worker_dies {moment}"
    )
    return rc, out, err, report_dir


@pytest.mark.parametrize(
    "moment,bare", [("shape-check", "bare-body"), ("preflight", "bare-body"), ("fallback-summary", "bare-after")]
)
def test_worker_killed_while_dlwatch_code_runs(tmp_path, moment, bare):
    rc0, out0, err0, _ = _run(tmp_path, bare)
    assert rc0 == 1 and KILLED in out0, (out0, err0)  # what the program meets bare
    rc, out, err, report_dir = _run(tmp_path, moment)
    assert rc == 1 and KILLED in out, (out, err)
    assert "OWN_FRAMES 0" in out, out
    if moment == "fallback-summary":
        # the worker died as the block ended: the summary the training process wrote is still there
        runs = os.listdir(os.path.join(report_dir, "runs"))
        assert len(runs) == 1, runs
        with open(os.path.join(report_dir, "runs", runs[0], "summary.json")) as f:
            assert "not running at the end of the block" in " ".join(json.load(f)["notes"])
    else:
        # the exception left the block: its incident is written, naming the dead worker
        found = incidents(report_dir)
        assert len(found) == 1, (found, err)
        report = load(found[0])
        assert report["trigger"] == "exception" and "killed by signal" in report["exception"]["message"]
        assert report["findings"] and report["findings"][0]["playbook"] == "worker-killed", report["findings"][:1]
