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

SCRIPT = os.path.join(TARGETS, "interrupt.py")
PACKAGE = os.path.dirname(os.path.abspath(dlwatch.__file__)) + os.sep  # dlwatch's own frames live here


def _run(
    argv: list[str], env: dict[str, str], wait_s: float = 0.0, within_s: float | None = None
) -> tuple[int, str, str]:
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
        ready = time.monotonic()
        time.sleep(wait_s)  # how long the loop waits before the user gives up
        if within_s is not None and time.monotonic() - ready > within_s:
            pytest.skip(f"precondition: Ctrl-C {time.monotonic() - ready:.1f} s after READY, past {within_s} s")
        # the pgid is the target's pid (a session of its own): the whole group, as a terminal does
        os.killpg(proc.pid, signal.SIGINT)
        rest, err = proc.communicate(timeout=90)
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


# ---------------------------------------------------------------------------- a Ctrl-C that stops a hang

# explicit allowances of 12 s: a wait of SHARE x 12 = 3 s is long enough for an interrupt incident,
# and the test presses Ctrl-C at 5 s, well before a stall incident (12 s) could be written
ALLOWANCE_S = 12.0
PRESS_AT_S = 5.0


@pytest.mark.parametrize("mode,where", [("plain", "deadlock"), ("run", "next"), ("as", "body"), ("run", "body")])
def test_ctrl_c_after_a_long_wait_leaves_every_stack(tmp_path, mode, where):
    """The user stops a hang with Ctrl-C: an ``interrupt`` incident with every process's stacks.

    A terminal's Ctrl-C reaches the workers too, and torch's workers end on it: their stacks are
    the ones they wrote as SIGINT arrived, their verdict the monitor's reads before it.  The main
    thread's stack is where the KeyboardInterrupt landed.  The program still ends as Python ends it.
    """
    argv = (
        [sys.executable, "-m", "dlwatch", "run", "--poll-interval", "0.2", SCRIPT, "bare", where]
        if mode == "run"
        else [sys.executable, SCRIPT, mode, where]
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([REPO, TARGETS]),
        DLWATCH_DIR=str(tmp_path),
        DLWATCH_STALL_TIMEOUT=str(ALLOWANCE_S),
        DLWATCH_BODY_TIMEOUT=str(ALLOWANCE_S),
    )
    rc, out, err = _run(argv, env, wait_s=PRESS_AT_S, within_s=ALLOWANCE_S - 2)
    assert rc == -signal.SIGINT, (rc, err)
    own = [line for line in err.splitlines() if line.startswith("dlwatch: ")]
    assert len(own) == 1 and own[0].startswith("dlwatch: interrupt incident"), err
    plain = "\n".join(line for line in err.splitlines() if not line.startswith("dlwatch: "))
    assert plain.rstrip().endswith("KeyboardInterrupt") and plain.count("Traceback") == 1, err
    assert PACKAGE not in plain, err
    incidents = [d for d in os.listdir(tmp_path) if d not in ("runs", ".runs", ".jobs")]
    assert len(incidents) == 1 and "-interrupt-" in incidents[0], incidents
    with open(tmp_path / incidents[0] / "report.json") as f:
        report = json.load(f)
    assert report["trigger"] == "interrupt"
    assert report["progress"]["interrupted_after_s"] >= 0.25 * ALLOWANCE_S
    assert report["progress"]["interrupted_in"] == ("in_loop_body" if where == "body" else "waiting_for_data")

    def thread_frames(p, name="MainThread"):
        threads = (p.get("stack") or {}).get("threads") or []
        return [
            (f["function"], os.path.basename(f.get("filename") or ""))
            for t in threads
            if t.get("name") == name
            for f in t["frames"]
        ]

    main = [p for p in report["processes"] if p["role"] == "main"]
    workers = [p for p in report["processes"] if p["role"] == "worker"]
    assert len(main) == 1 and len(workers) == 2, report["processes"]
    frames = thread_frames(main[0])
    assert frames and frames[-1] == ("<module>", "interrupt.py"), frames  # the traceback, outermost last
    if where != "body":
        assert ("_next_data", "dataloader.py") in frames, frames  # it landed inside next(loader)
    for w in workers:  # each worker's stack as SIGINT reached it: inside the sample it was loading
        assert ("__getitem__", "interrupt.py") in thread_frames(w), w.get("stack")
        assert w["stack"]["source"] == "faulthandler-sigint", w["stack"]["source"]
    top = report["findings"][0]["playbook"] if report["findings"] else None
    if where == "deadlock":
        assert report["classification"] == "deadlock", report["classification_reason"]
        assert top == "lock-held-at-fork", report["findings"]
        assert "cache-refresher" in json.dumps(report["findings"][0]["evidence"])
    elif where == "next":
        assert report["classification"] == "slow", report["classification_reason"]  # workers asleep in time.sleep
    else:
        assert report["classification"] == "main-blocked", report["classification_reason"]
        assert "interrupt.py:" in report["classification_reason"], report["classification_reason"]
    assert report["classification"] != "dead-worker" and top != "worker-killed"  # Ctrl-C ended them, not a kill
    runs = os.listdir(tmp_path / "runs")
    assert len(runs) == 1
    with open(tmp_path / "runs" / runs[0] / "summary.json") as f:
        assert json.load(f)["ended"] == "interrupted"


def test_interrupt_constants_agree_with_the_stall_allowances():
    from dlwatch.detect import stall
    from dlwatch.wire import interrupt

    assert interrupt.MIN_ALLOWANCE_S == {
        "data": stall.ADAPTIVE_FLOOR_S,
        "first": stall.FIRST_BATCH_S,
        "body": min(stall.BODY_BLOCKED_S, stall.BODY_FLOOR_S),
    }
    det = stall.StallDetector(None, None)
    assert det.allowance("data", 0.0) >= interrupt.MIN_ALLOWANCE_S["data"]
    assert det.allowance("first", 0.0) == interrupt.MIN_ALLOWANCE_S["first"]
    assert det.allowance("body", 0.0) >= interrupt.MIN_ALLOWANCE_S["body"]
    # below SHARE of the smallest allowance the monitor is not even asked; an explicit timeout rules
    assert not interrupt.worth_telling(interrupt.WAITING, False, 14.9, None)
    assert interrupt.worth_telling(interrupt.WAITING, False, 15.0, None)
    assert not interrupt.worth_telling(interrupt.WAITING, True, 74.0, None)
    assert interrupt.worth_telling(interrupt.BODY, False, 3.0, 12.0)


def test_interrupt_event_is_checked_like_every_event():
    from dlwatch.wire.events import normalize

    good = {"event": "interrupt", "seq": 1, "where": "waiting_for_data", "waited_s": 20.5, "frames": []}
    assert normalize(dict(good))["first_batch"] is False
    for bad in ({"seq": "1"}, {"seq": True}, {"where": "elsewhere"}, {"waited_s": -1}, {"waited_s": "x"}):
        assert normalize({**good, **bad}) is None, bad
    ev = normalize(
        {**good, "frames": [{"function": "f", "filename": 3, "line": True}, "junk", {"line": 1}] * 100, "thread": 7}
    )
    assert ev["frames"][0] == {"function": "f", "filename": None, "line": None}
    assert len(ev["frames"]) <= 200 and ev["thread"] is None


def test_interrupt_answer_never_follows_a_link(tmp_path):
    from dlwatch.wire import interrupt

    target = tmp_path / "elsewhere"
    target.write_text("")
    link = tmp_path / "interrupt-ack-1"
    link.symlink_to(target)
    interrupt.answer(str(link))
    assert target.read_text() == ""
    fresh = tmp_path / "interrupt-ack-2"  # no FIFO made (mkfifo refused): the answer is a private file
    interrupt.answer(str(fresh))
    assert fresh.exists() and (fresh.stat().st_mode & 0o777) == 0o600
    fifo = tmp_path / "interrupt-ack-3"
    os.mkfifo(fifo, 0o600)
    r = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        interrupt.answer(str(fifo))
        assert os.read(r, 8) == b"1"
    finally:
        os.close(r)
    interrupt.answer(str(fifo))  # nobody reads any more: no error, no block


def test_interrupt_site_names_the_programs_line():
    from dlwatch.monitor.incidents import interrupt_site

    frames = [
        {"function": "select", "filename": "/usr/lib/python3.11/selectors.py", "line": 415},
        {"function": "_next_data", "filename": "/x/site-packages/torch/utils/data/dataloader.py", "line": 1505},
        {"function": "train", "filename": "/home/u/train.py", "line": 41},
    ]
    assert interrupt_site(frames) == ", at train.py:41 in train() (inside selectors.py:415 in select())"
    assert interrupt_site(frames[2:]) == ", at train.py:41 in train()"
    assert interrupt_site([]) == ""


def test_a_worker_that_the_interrupt_ends_during_the_window_is_judged_on_its_sigint_stacks(tmp_path):
    """A worker still leaving its KeyboardInterrupt when the forensic window opens, a zombie by its
    end: py-spy can only say "has exited", so the stacks it wrote as SIGINT arrived are its stacks,
    and the monitor's reads before the interrupt are what it is judged on.  A real child with the
    worker's SIGINT handler (faulthandler, chained), signalled 0.3 s into the 1 s window and left
    unreaped, as torch's worker is until the loader joins it: its stacks are not on disk yet when
    the window opens (a worker the scheduler runs late writes them after the training process has
    reported the Ctrl-C), so they are read once the window has closed."""
    import threading

    from dlwatch.collect import faultdump, procfs
    from dlwatch.model import TrackedProcess
    from dlwatch.monitor import forensics
    from dlwatch.report.schema import Incident, ProcessEntry

    assert forensics.SECOND_READ_AFTER_S >= 0.8  # the signal below lands inside the window
    path = str(tmp_path / "sigint.txt")
    code = (
        "import faulthandler, signal, sys, time\n"
        f"f = open({path!r}, 'w')\n"
        "faulthandler.register(signal.SIGINT, file=f, all_threads=True, chain=True)\n"
        "def __getitem__(i):\n"
        "    time.sleep(60)\n"
        "print('READY', flush=True)\n"
        "__getitem__(0)\n"
    )
    child = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, preexec_fn=_default_sigint
    )
    timer = threading.Timer(0.3, child.send_signal, (signal.SIGINT,))
    try:
        assert child.stdout.readline().startswith(b"READY")
        first = procfs.read_proc(child.pid)
        time.sleep(0.2)
        last = procfs.read_proc(child.pid)
        assert not last.gone and last.state not in ("Z", "X")
        assert faultdump.read_interrupt(path, child.pid) is None  # nothing written before the signal
        report = Incident(trigger="interrupt", processes=[ProcessEntry(pid=child.pid, role="worker", worker_id=0)])
        timer.start()
        out, _ = forensics.investigate(
            report,
            {child.pid: TrackedProcess(child.pid, "worker", 0)},
            main_waiting_for_data=True,
            expected_workers=1,
            native=False,
            exited={child.pid: (first, last)},
            at_signal=lambda pid: faultdump.read_interrupt(path, pid),
        )
        assert child.poll() is not None  # precondition: the signal ended it (reaped just now by poll)
        (entry,) = out.processes
        stack = entry.stack if isinstance(entry.stack, dict) else entry.stack.to_dict()
        assert stack["source"] == "faulthandler-sigint", (stack, out.notes)
        functions = [f["function"] for t in stack["threads"] for f in t["frames"]]
        assert "__getitem__" in functions, stack
        assert any(f"pid {child.pid} had exited" in n and "as SIGINT arrived" in n for n in out.notes), out.notes
    finally:
        timer.cancel()
        child.kill()
        child.wait(10)
