"""`dlwatch run`: an unmodified program runs as under plain python, with every DataLoader iteration watched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import TARGETS, descendants_of, incidents, kill_session, load, run_bounded, run_to_end, wait_for
from dlwatch.report.store import RUN_ID

SCRIPT = os.path.join(TARGETS, "plain_train.py")


def _env(tmp_path, **extra):
    env = dict(os.environ)
    env.pop("DLWATCH_DIR", None)
    env.pop("DLWATCH_DISABLE", None)
    env["PYTHONPATH"] = ""  # the program needs nothing but the installed dlwatch
    env.update(extra)
    return env


def _run(args, tmp_path, *, timeout=120, cwd=None, **extra):
    """Run a command in its own session; kill everything it started if it outlives the bound."""
    return run_bounded(args, env=_env(tmp_path, **extra), cwd=cwd or str(tmp_path), timeout=timeout)


def dlwatch_run(tmp_path, *args, **kw):
    return _run(
        [sys.executable, "-m", "dlwatch", "run", "--report-dir", str(tmp_path / "reports"), *args], tmp_path, **kw
    )


def plain(tmp_path, *args, **kw):
    return _run([sys.executable, *args], tmp_path, **kw)


def unwatched(out):
    """The program's output as plain python prints it: only the probe's iterator type differs."""
    return out.replace("RunIterator", "_MultiProcessingDataLoaderIter")


def iter_types(out):
    return [line.split()[-1] for line in out.splitlines() if line.startswith("ITER")]


def test_ok_program_same_output_every_iteration_watched(tmp_path):
    rc, out, err = dlwatch_run(tmp_path, SCRIPT, "ok", "--lr", "0.1")
    prc, pout, perr = plain(tmp_path, SCRIPT, "ok", "--lr", "0.1")
    assert rc == prc == 0 and unwatched(out) == pout
    assert err == perr
    # same sys.argv and __main__ as plain python
    assert f"ARGV {[SCRIPT, 'ok', '--lr', '0.1']!r} NAME __main__" in out
    # two epochs x (train + validation): each iteration went through dlwatch, none without
    assert iter_types(out) == ["RunIterator"] * 4
    assert set(iter_types(pout)) == {"_MultiProcessingDataLoaderIter"}
    assert incidents(str(tmp_path / "reports")) == []  # a healthy program makes no incident
    # each iteration's monitor stopped and its run directory went, before the program exited
    assert os.listdir(tmp_path / "reports" / ".runs") == []


def test_disable_runs_unwatched(tmp_path):
    rc, out, err = dlwatch_run(tmp_path, SCRIPT, "ok", DLWATCH_DISABLE="1")
    assert rc == 0
    assert set(iter_types(out)) == {"_MultiProcessingDataLoaderIter"}
    assert not os.path.exists(tmp_path / "reports" / ".runs")


def test_exit_code_is_the_programs(tmp_path):
    rc, out, err = dlwatch_run(tmp_path, SCRIPT, "exit3")
    prc, pout, perr = plain(tmp_path, SCRIPT, "exit3")
    assert rc == prc == 3
    assert unwatched(out) == pout and err == perr
    assert incidents(str(tmp_path / "reports")) == []  # sys.exit is not an incident


def test_raise_shows_the_same_traceback(tmp_path):
    rc, out, err = dlwatch_run(tmp_path, SCRIPT, "raise")
    prc, pout, perr = plain(tmp_path, SCRIPT, "raise")
    assert rc == prc == 1
    assert "ValueError: bad batch in the loop body" in err
    assert err == perr  # the very same traceback, line for line
    assert unwatched(out) == pout


def test_loader_exception_same_traceback_and_an_incident(tmp_path):
    rc, out, err = dlwatch_run(tmp_path, SCRIPT, "loader-raise")
    prc, pout, perr = plain(tmp_path, SCRIPT, "loader-raise")
    assert rc == prc == 1
    # the program's stderr unchanged, after dlwatch's one line naming the incident
    notice = [line for line in err.splitlines() if line.startswith("dlwatch: ")]
    assert len(notice) == 1 and "exception incident" in notice[0]
    assert "KeyError" in err and err.replace(notice[0] + "\n", "", 1) == perr
    found = incidents(str(tmp_path / "reports"))
    assert len(found) == 1
    report = load(found[0])
    assert report["trigger"] == "exception"
    assert "KeyError" in report["exception"]["type"]
    run = report["config"]["program_run"]  # shaped like a run id, in UTC
    assert RUN_ID.fullmatch(run) and run.split("-")[0].endswith("Z"), run


def test_caught_loader_exception_formats_the_same_traceback(tmp_path):
    """The program catches the loader's exception and prints traceback.format_exc() itself:
    no excepthook runs, so dlwatch's wrapper frames must not be in the traceback object at all."""
    rc, out, err = dlwatch_run(tmp_path, SCRIPT, "loader-catch")
    prc, pout, perr = plain(tmp_path, SCRIPT, "loader-catch")
    assert rc == prc == 0, err
    assert "CAUGHT Traceback" in pout and "KeyError" in pout
    inproc = os.path.join("dlwatch", "inproc", "")
    assert "runhook.py" not in out and inproc not in out  # no frame of dlwatch's wrappers (agent/, runhook)
    assert out == pout  # line for line, frames and all


def test_unmodified_deadlock_gets_its_stall_incident(tmp_path):
    reports = tmp_path / "reports"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dlwatch",
            "run",
            "--report-dir",
            str(reports),
            "--stall-timeout",
            "1.5",
            "--poll-interval",
            "0.2",
            SCRIPT,
            "deadlock",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(tmp_path),
        cwd=str(tmp_path),
        start_new_session=True,
    )
    known: set[int] = set()
    try:
        found = wait_for(lambda: incidents(str(reports)), timeout=60)
        known.update(p.pid for p in descendants_of(proc.pid))
        assert found, "no stall incident"
        # the monitor runs isolated (-I: no PYTHONPATH), so the bootstrap never reaches it
        monitors = [p.cmdline() for p in descendants_of(proc.pid) if "dlwatch.monitor" in " ".join(p.cmdline())]
        assert monitors and all(c[1] == "-I" for c in monitors), monitors
        report = load(found[0])
        assert report["trigger"] == "stall"
        assert report["classification"] == "deadlock"
        # the fork record works under dlwatch run too: the thread inside the lock at fork is named
        assert report["findings"][0]["playbook"] == "lock-held-at-fork", [f["playbook"] for f in report["findings"]]
        assert "hold_lock" in json.dumps(report["findings"][0]["evidence"]), report["findings"][0]["evidence"]
        assert "worker-deadlock" in [f["playbook"] for f in report["findings"]]
        assert report["pid"] == proc.pid  # dlwatch run became the program: same pid
        assert report["config"]["program_run"]
        assert sum(1 for p in report["processes"] if p["role"] == "worker") == 2
    finally:
        known.update(p.pid for p in descendants_of(proc.pid))
        kill_session(proc.pid, known)
        proc.communicate()


def test_module_form_and_cwd_semantics(tmp_path):
    # -m: the module is found from the working directory, as with python -m
    rc, out, err = _run(
        [sys.executable, "-m", "dlwatch", "run", "--report-dir", str(tmp_path / "r"), "-m", "plain_train", "ok", "-x"],
        tmp_path,
        cwd=TARGETS,
    )
    prc, pout, perr = _run([sys.executable, "-m", "plain_train", "ok", "-x"], tmp_path, cwd=TARGETS)
    assert rc == prc == 0 and err == perr
    assert f"ARGV {[os.path.join(TARGETS, 'plain_train.py'), 'ok', '-x']!r} NAME __main__" in out
    assert iter_types(out) == ["RunIterator"] * 4


def test_torchrun_ranks_are_watched(tmp_path):
    rc, out, err = _run(
        [
            sys.executable,
            "-m",
            "dlwatch",
            "run",
            "--report-dir",
            str(tmp_path / "r"),
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            SCRIPT,
            "ok",
        ],
        tmp_path,
        timeout=180,
        OMP_NUM_THREADS="1",
    )
    assert rc == 0, err[-2000:]
    # two ranks print to one pipe: a line of one can land in the middle of the other's, so split
    # on the marker, not on newlines
    lines = [chunk.split()[:3] for chunk in out.split("ITER rank ")[1:]]
    for rank in ("0", "1"):
        mine = [words[2] for words in lines if words[0] == rank]
        assert mine == ["RunIterator"] * 4, lines
    # one summary per rank, for its whole program: 2 epochs of train (4 batches) and validation (2)
    found = _summaries(str(tmp_path / "r"))
    assert len(found) == 2, found
    for run in found:
        s = _summary(run)
        assert s["program"] is True and s["loop"]["batches"] == 12, s["loop"]
        assert [r["batches"] for r in s["iterations"]] == [4, 2, 4, 2], s["iterations"]
    # the job view reads each rank's whole program, not its last iteration
    from dlwatch.report.jobview import job_view

    view = job_view(str(tmp_path / "r"))
    assert sorted(r["rank"] for r in view["ranks"]) == [0, 1]
    assert [r["batches"] for r in view["ranks"]] == [12, 12], view["ranks"]


def test_user_watch_inside_run_is_left_alone(tmp_path):
    code = (
        "import dlwatch, torch\n"
        "from torch.utils.data import DataLoader\n"
        "dl = DataLoader(list(range(8)), batch_size=4)\n"
        "with dlwatch.watch(dl) as b:\n"
        "    it = iter(b)\n"
        "    print(type(it).__name__, [x.tolist() for x in it])\n"
    )
    script = tmp_path / "own_watch.py"
    script.write_text(code)
    rc, out, err = dlwatch_run(tmp_path, str(script))
    assert rc == 0, err
    assert out.strip() == "_TimedIterator [[0, 1, 2, 3], [4, 5, 6, 7]]"  # the user's watch only, not two


@pytest.mark.parametrize(
    "args, code, text",
    [
        (["no_such_script.py"], 3, "no such script: no_such_script.py"),
        ([], 2, "no program given"),
        (["--stall-timeout", "soon", SCRIPT], 2, "stall_timeout must be a number of seconds"),
        (["--ignore", "no-such-playbook", SCRIPT], 2, "--ignore names no known playbook: no-such-playbook"),
        (["-m"], 2, "-m needs a module name"),
        (
            ["--keep-runs", "-1", SCRIPT],
            2,
            "keep_runs must be a whole number >= 0 (0 keeps all), got '-1' (--keep-runs)",
        ),
    ],
)
def test_bad_input_one_line(tmp_path, args, code, text):
    rc, out, err = _run([sys.executable, "-m", "dlwatch", "run", *args], tmp_path, timeout=60)
    assert rc == code
    assert err.count("\n") == 1 and err.startswith("dlwatch: error: ") and text in err, err
    assert out == ""


def test_a_sitecustomize_already_on_the_path_still_runs(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(
        "import os, sys\n"
        "sys.stderr.write(f\"USER SITECUSTOMIZE {os.environ['PYTHONPATH'].split(os.pathsep)[0].endswith('_boot')}\\n\")\n"
    )
    script = tmp_path / "probe.py"
    script.write_text(
        "import sys, torch.utils.data as d\n"
        "print(getattr(d.DataLoader.__iter__, '_dlwatch_run', False), "
        "any(p.endswith('_boot') for p in sys.path))\n"
    )
    rc, out, err = _run(
        [sys.executable, "-m", "dlwatch", "run", "--report-dir", str(tmp_path / "r"), str(script)],
        tmp_path,
        PYTHONPATH=str(site),
    )
    assert rc == 0, err
    # once in the dlwatch command itself (before it becomes the program), once in the program
    assert err.splitlines() == ["USER SITECUSTOMIZE False", "USER SITECUSTOMIZE True"]
    assert out.split() == ["True", "False"]  # DataLoader hooked; the bootstrap's directory is off sys.path again


def _summaries(report_dir):
    runs = os.path.join(report_dir, "runs")
    return [os.path.join(runs, d) for d in sorted(os.listdir(runs))] if os.path.isdir(runs) else []


def _summary(run):
    import json

    with open(os.path.join(run, "summary.json")) as f:
        return json.load(f)


def _stall_iterations(report_dir):
    """The iteration (heartbeat epoch: one per loader iteration of the program) each stall incident names."""
    return sorted(load(i)["progress"]["epochs"] for i in incidents(report_dir) if load(i)["trigger"] == "stall")


def test_lightning_style_loop_gets_a_stall_incident_in_every_planted_epoch(tmp_path):
    """Iterators kept until the next iter(), len(loader) batches by next() (no StopIteration): a real worker
    stall planted in epochs 0, 1 and 2 gives an incident in each, and the program one summary."""
    reports = tmp_path / "reports"
    script = os.path.join(TARGETS, "lightning_style.py")
    args = ["--stall-timeout", "2", "--poll-interval", "0.2", script, "4", "0,1,2", "6"]
    rc, out, err = dlwatch_run(tmp_path, *args, timeout=240)
    assert rc == 0 and out.splitlines() == ["EPOCH 0", "EPOCH 1", "EPOCH 2", "EPOCH 3", "DONE"], err
    # train iterations are the 1st, 3rd, 5th of the program (validation's between them)
    stalled = set(_stall_iterations(str(reports)))
    assert {1, 3, 5} <= stalled, (stalled, err)
    assert len(_summaries(str(reports))) == 1
    summary = _summary(_summaries(str(reports))[0])
    rows = [(r["loader"], r["epoch"], r["batches"]) for r in summary["iterations"]]
    train, val = rows[0][0], rows[1][0]
    assert rows == [(key, epoch, n) for epoch in range(4) for key, n in ((train, 8), (val, 4))], rows
    assert os.listdir(reports / ".runs") == []


def test_lightning_fit_one_summary_with_every_epoch_and_each_planted_stall(tmp_path):
    pytest.importorskip("lightning", reason="lightning (a test extra) is not installed")
    reports = tmp_path / "reports"
    script = os.path.join(TARGETS, "lightning_fit.py")
    args = ["--stall-timeout", "2", "--poll-interval", "0.2", script, "3", "0,1", "6"]
    rc, out, err = dlwatch_run(tmp_path, *args, timeout=300)
    assert rc == 0 and "DONE global_step 24" in out, err[-3000:]
    found = _summaries(str(reports))
    assert len(found) == 1, found  # one summary for the whole Trainer.fit
    summary = _summary(found[0])
    assert summary["program"] is True and summary["ended"] == "clean"
    rows = [(r["iteration"], r["batches"]) for r in summary["iterations"]]
    # Lightning's sanity check (2 validation batches), then each epoch's training (8) and validation (2)
    assert [n for _, n in rows] == [2, 8, 2, 8, 2, 8, 2], rows
    by_loader = {e["loader"]: (e["iterations"], e["batches"]) for e in summary["loaders"]}
    assert sorted(by_loader.values()) == [(3, 24), (4, 8)], by_loader
    # the stall in epoch 0 (the 2nd iteration) and in epoch 1 (the 4th) each gave an incident
    assert {2, 4} <= set(_stall_iterations(str(reports))), err[-3000:]
    assert os.listdir(reports / ".runs") == []


KEPT_TO_EXIT = """
import torch
from torch.utils.data import DataLoader

KEEP = []


def main():
    for ctx in ("fork", "forkserver"):
        dl = DataLoader(list(range(16)), batch_size=4, num_workers=2, persistent_workers=True,
                        multiprocessing_context=ctx)
        it = iter(dl)
        print("BATCH", next(it).tolist(), flush=True)
        KEEP.append(it)  # alive until the interpreter's exit
    print("END", flush=True)


if __name__ == "__main__":
    main()
"""


def test_iterators_alive_at_exit_end_as_bare(tmp_path):
    """Persistent fork and forkserver iterators still alive at interpreter exit: the program ends as the bare
    one (output, exit code, no warning), its summary is written, nothing is left in .runs, no process left."""
    script = tmp_path / "kept_to_exit.py"
    script.write_text(KEPT_TO_EXIT)
    reports = tmp_path / "reports"
    env = _env(tmp_path)
    marker = str(tmp_path)  # the script's path (forked workers share it) and the monitor's run directory
    prc, pout, perr = run_to_end([sys.executable, str(script)], env=env, marker=marker, timeout=180, what="bare")
    rc, out, err = run_to_end(
        [sys.executable, "-m", "dlwatch", "run", "--report-dir", str(reports), str(script)],
        env=env,
        marker=marker,
        timeout=180,
        what="dlwatch run",
    )
    assert rc == prc == 0 and out == pout, err
    assert [line for line in err.splitlines() if not line.startswith("dlwatch: run summary")] == perr.splitlines()
    assert "Warning" not in err
    assert os.listdir(reports / ".runs") == []
    found = _summaries(str(reports))
    assert len(found) == 1
    s = _summary(found[0])
    assert s["ended"] == "clean" and [r["batches"] for r in s["iterations"]] == [1, 1], s["iterations"]


FORKED_CHILD = """
import multiprocessing as mp
from torch.utils.data import DataLoader


def child():
    for _ in range(2):
        for b in DataLoader(list(range(8)), batch_size=4):
            pass
    print("child done", flush=True)


if __name__ == "__main__":
    p = mp.get_context("fork").Process(target=child)
    p.start()
    p.join()
    print("exit", p.exitcode)
"""


def test_forked_child_that_iterates_writes_its_summary_not_a_vanished_incident(tmp_path):
    """A multiprocessing child (fork) ends with os._exit, where atexit never runs: its watch closes from a
    multiprocessing finalizer, so its summary is written and no 'vanished' incident is."""
    script = tmp_path / "forked_child.py"
    script.write_text(FORKED_CHILD)
    reports = tmp_path / "reports"
    rc, out, err = dlwatch_run(tmp_path, str(script))
    assert rc == 0 and out.splitlines() == ["child done", "exit 0"], err
    assert incidents(str(reports)) == [], err
    found = _summaries(str(reports))
    assert len(found) == 1 and _summary(found[0])["ended"] == "clean"
    assert [r["batches"] for r in _summary(found[0])["iterations"]] == [2, 2]
    assert os.listdir(reports / ".runs") == []


NO_GARBAGE = """
import gc, sys
import torch
from torch.utils.data import DataLoader

loader = DataLoader(torch.arange(64.0).reshape(32, 2), batch_size=8, num_workers=int(sys.argv[1]))
for _ in range(2):  # first uses (and under dlwatch run the watch's start) before the look
    for batch in loader:
        pass
gc.collect()
gc.disable()
gc.set_debug(gc.DEBUG_SAVEALL)
for _ in range(3):
    for batch in loader:
        pass
    for batch in loader:
        break  # an iterator dropped early ends its segment from __del__
gc.collect()
kinds = sorted({type(o).__name__ for o in gc.garbage})
gc.set_debug(0)
print("GARBAGE", len(gc.garbage), kinds, flush=True)
"""


@pytest.mark.parametrize("workers", [0, 2])
def test_iterations_leave_no_garbage_in_the_training_process(tmp_path, workers):
    """Each watched iteration (a segment, its hooks, its shape checks, its workers' start) is freed by reference
    counting, as the bare loop's is: nothing waits for the collector.  Garbage there held the checked batches'
    tensors until a collection, and counted toward the training process's next one (whose timing decides
    whether forked workers each run a full collection of the heap they inherit)."""
    script = tmp_path / "no_garbage.py"
    script.write_text(NO_GARBAGE)
    prc, pout, perr = plain(tmp_path, str(script), str(workers))
    rc, out, err = dlwatch_run(tmp_path, str(script), str(workers))
    assert prc == 0 and pout.splitlines() == ["GARBAGE 0 []"], perr
    assert rc == 0 and out.splitlines() == ["GARBAGE 0 []"], err
