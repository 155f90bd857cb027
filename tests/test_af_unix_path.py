"""af-unix-path-too-long: a temp directory too long for the Unix socket through which a worker hands over
its batch's fds.  Real runs with real workers and a real TMPDIR: the hang happens for real (the workers'
feeder threads die with "AF_UNIX path too long"), ends by torch's own DataLoader timeout, and the stall
incident names the cause under watch() and `dlwatch run`; the forkserver form raises at the start.  Quiet
where the same directory stops nothing (batches without tensors) and on a directory at each socket's
limit; under file_system torch's own manager's socket fails, and that exception is named too.  The check in the training process changes nothing of the program's (tempfile is not asked)."""

from __future__ import annotations

import os
import sys

import pytest

from conftest import TARGETS, incidents, load, run_bounded

SCRIPT = os.path.join(TARGETS, "socket_path.py")
LIMIT = 107
# the socket's path: TMPDIR + "/pymp-XXXXXXXX/listener-XXXXXXXX"
OVERHEAD = 1 + len("pymp-") + 8 + 1 + len("listener-") + 8
# torch's shared-memory manager's (file_system): TMPDIR + "/torch-shm-dir-XXXXXX/manager.sock"
SHM_OVERHEAD = len("/torch-shm-dir-XXXXXX/manager.sock")


def _run(tmp_path, form, case, tmpdir, timeout=150):
    reports = tmp_path / f"{form}-{case}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_")}
    env["TMPDIR"] = tmpdir
    prefix = [sys.executable]
    if form == "bare":
        prefix += [
            "-m",
            "dlwatch",
            "run",
            "--report-dir",
            str(reports),
            "--stall-timeout",
            "3",
            "--poll-interval",
            "0.2",
        ]
    rc, out, err = run_bounded([*prefix, SCRIPT, form, case, str(reports)], env=env, cwd=str(tmp_path), timeout=timeout)
    found = [load(path) for path in incidents(str(reports))]
    return rc, out, err, found


@pytest.mark.parametrize("form", ["plain", "bare"])
def test_a_tmpdir_too_long_for_the_socket_hangs_and_the_stall_names_it(tmp_path, tmpdir_of_length, form):
    tmpdir = tmpdir_of_length(LIMIT - OVERHEAD + 1)  # one byte over
    rc, out, err, found = _run(tmp_path, form, "tensors", tmpdir)
    # the failure is real: the workers' feeder threads died, no batch came, torch's timeout ended the run
    assert "AF_UNIX path too long" in err and "BATCHES 0" in out, (out, err[-2000:])
    assert rc != 0 and "DataLoader timed out" in err
    stalls = [r for r in found if r["trigger"] == "stall"]
    assert stalls, [r["trigger"] for r in found]
    top = stalls[0]["findings"][0]
    assert top["playbook"] == "af-unix-path-too-long", [f["playbook"] for f in stalls[0]["findings"]]
    ev = top["evidence"]
    assert ev["path_len"] == LIMIT + 1 and ev["path_max"] == LIMIT and ev["base"] == tmpdir
    assert ev["sharing_strategy"] == "file_descriptor" and ev["start_method"] == "fork"
    assert ev["socket"] == "multiprocessing"
    assert "no batch arrived" in ev["link"]


@pytest.mark.parametrize(
    "case, length",
    [
        ("tensors", LIMIT - OVERHEAD),  # at multiprocessing's limit (75): the socket binds, the run ends
        ("file_system", LIMIT - SHM_OVERHEAD),  # at torch's manager's limit (73)
        ("no_tensors", 110),  # no tensor, no fd to send: the run ends
        ("no_tensors_then_slow", 110),  # a stall of its own, after batches arrived
    ],
)
def test_where_the_directory_stops_nothing_it_is_never_named(tmp_path, tmpdir_of_length, case, length):
    rc, out, err, found = _run(tmp_path, "plain", case, tmpdir_of_length(length))
    assert rc == 0 and "BATCHES 4" in out, (out, err[-2000:])
    assert "AF_UNIX path too long" not in err and "torch_shm_manager" not in err
    named = [f["playbook"] for r in found for f in r["findings"]]
    assert "af-unix-path-too-long" not in named, named
    if case == "no_tensors_then_slow":  # the slow read is a stall of its own, judged on its own
        assert any(r["trigger"] == "stall" for r in found), [r["trigger"] for r in found]


def test_under_file_system_the_managers_socket_fails_first_and_the_exception_is_named(tmp_path, tmpdir_of_length):
    """file_system is no way around it: torch's manager binds <TMPDIR>/torch-shm-dir-XXXXXX/manager.sock."""
    tmpdir = tmpdir_of_length(LIMIT - SHM_OVERHEAD + 1)  # 74: under multiprocessing's limit, over the manager's
    rc, out, err, found = _run(tmp_path, "plain", "file_system", tmpdir)
    assert rc != 0 and "torch_shm_manager at" in err and "Invalid argument" in err, err[-2000:]
    exc = [r for r in found if r["trigger"] == "exception"]
    assert exc, [r["trigger"] for r in found]
    top = exc[0]["findings"][0]
    assert top["playbook"] == "af-unix-path-too-long", [f["playbook"] for f in exc[0]["findings"]]
    ev = top["evidence"]
    assert ev["socket"] == "torch_shm_manager" and ev["path_len"] == LIMIT + 1 and ev["base"] == tmpdir


def test_with_forkserver_the_start_raises_and_the_exception_is_named(tmp_path, tmpdir_of_length):
    script = tmp_path / "fs.py"
    script.write_text(
        "import sys, torch, dlwatch\n"
        "from torch.utils.data import DataLoader\n"
        "loader = DataLoader([torch.zeros(2)] * 8, batch_size=2, num_workers=2, multiprocessing_context='forkserver')\n"
        "with dlwatch.watch(loader, report_dir=sys.argv[1]):\n"
        "    for b in loader:\n"
        "        pass\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_")}
    env["TMPDIR"] = tmpdir_of_length(LIMIT - OVERHEAD + 10)
    reports = tmp_path / "r"
    rc, out, err = run_bounded([sys.executable, str(script), str(reports)], env=env, cwd=str(tmp_path), timeout=120)
    assert rc == 1 and "OSError: AF_UNIX path too long" in err, err[-2000:]
    (path,) = incidents(str(reports))
    report = load(path)
    assert report["trigger"] == "exception"
    top = report["findings"][0]
    assert top["playbook"] == "af-unix-path-too-long"
    assert top["evidence"]["start_method"] == "forkserver"


def test_the_check_reads_the_temp_directory_without_choosing_it(monkeypatch, tmp_path):
    """tempfile.gettempdir() caches its choice for the program (a TMPDIR set later would be ignored):
    the check must leave tempfile.tempdir as it found it, and read the same directory."""
    import tempfile as tf

    from dlwatch.inproc import sockpath

    from multiprocessing import process

    long_dir = tmp_path / ("x" * 90)
    long_dir.mkdir()
    # this process's own pymp directory, when an earlier test made one, is where its sockets go: none here
    monkeypatch.delitem(process.current_process()._config, "tempdir", raising=False)
    monkeypatch.setattr(tf, "tempdir", None)
    monkeypatch.setenv("TMPDIR", str(long_dir))
    got = sockpath.check(2, "file_descriptor", "fork")
    assert tf.tempdir is None  # not chosen for the program
    assert got is not None and got["base"] == str(long_dir) and got["path_len"] == len(str(long_dir)) + OVERHEAD
    assert sockpath.check(0, "file_descriptor", "fork") is None  # no workers
    assert sockpath.check(2, "file_system", "forkserver")["socket"] == "multiprocessing"  # the forkserver's
    manager = sockpath.check(2, "file_system", "fork")  # torch's manager reads TMPDIR itself
    assert manager["socket"] == "torch_shm_manager" and manager["path_len"] == len(str(long_dir)) + SHM_OVERHEAD
    monkeypatch.setenv("TMPDIR", "/tmp")
    assert sockpath.check(2, "file_system", "fork") is None
    monkeypatch.setenv("TMPDIR", str(long_dir))
    monkeypatch.setattr(tf, "tempdir", "/tmp")  # chosen already (or set by the program): read as it is
    assert sockpath.check(2, "file_descriptor", "fork") is None
    pymp = str(long_dir / "pymp-abcdefgh")  # a pymp directory made already: a forked worker binds in it
    monkeypatch.setitem(process.current_process()._config, "tempdir", pymp)
    assert sockpath.check(2, "file_descriptor", "fork")["path_len"] == len(pymp) + 1 + len("listener-") + 8
    monkeypatch.delitem(process.current_process()._config, "tempdir")
    monkeypatch.setenv("TMPDIR", "/nonexistent/" + "y" * 100)  # not a directory: gettempdir would skip it
    monkeypatch.setattr(tf, "tempdir", None)
    assert sockpath.check(2, "file_descriptor", "fork") is None or tf.tempdir is None
