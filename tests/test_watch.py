"""The core agent end to end: real DataLoader workers, a real monitor process, real /proc."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
import traceback
import weakref

import psutil
import pytest
from torch.utils.data import DataLoader
from torch.utils.data import default_collate

import dlwatch
from conftest import REPO, TARGETS, batches_of, incidents, load, wait_for

sys.path.insert(0, TARGETS)
from datasets import FailingInit, FailsAt, Squares, record_init  # noqa: E402


def test_as_form_yields_same_batches_and_monitor_exits(tmp_path, no_leftovers):
    dl = DataLoader(Squares(40), batch_size=4, num_workers=2)
    bare = batches_of(dl)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as batches:
        monitor = batches.monitor_pid
        assert monitor is not None and psutil.pid_exists(monitor)
        watched = batches_of(batches)
        second_epoch = batches_of(batches)
    assert watched == bare and second_epoch == bare
    assert wait_for(lambda: not psutil.pid_exists(monitor), timeout=5)
    assert incidents(str(tmp_path)) == []
    assert os.listdir(tmp_path / ".runs") == []  # the run directory is removed after a clean block


def test_loader_form_is_instrumented_and_restored(tmp_path, no_leftovers):
    dl = DataLoader(Squares(40), batch_size=4, num_workers=2, worker_init_fn=None)
    bare = batches_of(dl)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as w:
        assert isinstance(dl, DataLoader)
        watched = batches_of(dl)
        run_dir = w.run_dir
        from dlwatch.wire import heartbeat

        hb = heartbeat.read(os.path.join(run_dir, "heartbeat"))
        assert hb.batches == 10 and hb.epochs == 1
    assert watched == bare
    assert type(dl) is DataLoader and dl.worker_init_fn is None
    assert "_dlwatch_watch" not in dl.__dict__
    assert incidents(str(tmp_path)) == []


def test_no_reference_to_loader_after_block(tmp_path, no_leftovers):
    dl = DataLoader(Squares(16), batch_size=4, num_workers=2, persistent_workers=True)
    ref = weakref.ref(dl)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as batches:
        for _ in range(3):  # several epochs in one block, persistent workers reused
            assert len(batches_of(batches)) == 4
        workers = [w.pid for w in dl._iterator._workers]
    del dl, batches
    gc.collect()
    assert ref() is None  # so persistent workers shut down exactly as without dlwatch
    assert wait_for(
        lambda: not any(psutil.pid_exists(p) and psutil.Process(p).status() != "zombie" for p in workers), 10
    )


def test_num_workers_zero_and_plain_iterables(tmp_path, no_leftovers):
    dl = DataLoader(Squares(12), batch_size=4, num_workers=0)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as batches:
        assert batches_of(batches) == batches_of(DataLoader(Squares(12), batch_size=4))
    data = [1, 2, 3]
    with dlwatch.watch(data, report_dir=tmp_path, poll_interval=0.1) as items:
        assert list(items) == [1, 2, 3] and list(items) == [1, 2, 3]
    gen = (i * 2 for i in range(5))
    with dlwatch.watch(gen, report_dir=tmp_path, poll_interval=0.1) as items:
        assert list(items) == [0, 2, 4, 6, 8]
    assert incidents(str(tmp_path)) == []


@pytest.mark.parametrize("method", ["fork", "spawn", "forkserver"])
def test_start_methods(method, tmp_path, target):
    init_log = tmp_path / "init.log"
    t = target("start_methods.py", method, str(tmp_path / "reports"), str(init_log))
    out, err = t.communicate(timeout=90)
    assert t.proc.returncode == 0, err[-2000:]
    result = json.loads(next(line for line in out.splitlines() if line.startswith("RESULT "))[7:])
    assert result == {
        "same": True,
        "n": 6,
        "fingerprints": ["after_first_batch", "after_first_batch", "start", "start"],
    }
    # two epochs (bare and watched), two workers each: the user's init ran once per worker
    assert len(init_log.read_text().splitlines()) == 4


def _escaped(dl: DataLoader, watched: bool, report_dir, take):
    """Iterate dl bare or watched; ``take(exc)`` of what escaped, then its traceback dropped (it would
    keep the iterator and its workers alive: see drop_traceback)."""
    try:
        if watched:
            with dlwatch.watch(dl, report_dir=report_dir, poll_interval=0.1):
                for _ in dl:
                    pass
        else:
            for _ in dl:
                pass
    except BaseException as exc:  # noqa: BLE001 - we compare exactly what escaped
        result = take(exc)
        exc.__traceback__ = None
        return result
    raise AssertionError("no exception")


def test_worker_exception_reaches_user_unchanged_and_is_recorded(tmp_path, no_leftovers):
    def run(watched: bool) -> tuple[type, str, bool]:
        return _escaped(
            DataLoader(FailsAt(13), batch_size=4, num_workers=2),
            watched,
            tmp_path,
            lambda exc: (type(exc), str(exc), exc.__cause__ is None and exc.__context__ is None),
        )

    bare, watched = run(False), run(True)
    assert watched[0] is bare[0] is ValueError
    assert watched == bare
    found = incidents(str(tmp_path))
    assert len(found) == 1
    report = load(found[0])
    assert report["trigger"] == "exception"
    assert report["exception"]["type"] == "builtins.ValueError"
    assert "bad sample 13" in report["exception"]["message"]
    assert report["exception"]["from_loader"] is True
    assert report["loader"]["num_workers"] == 2
    for name in ("report.json", "report.md", "timeline.jsonl"):
        assert os.path.exists(os.path.join(found[0], name))


def test_caught_loader_exception_has_the_bare_traceback(tmp_path, no_leftovers):
    """A program that catches the loader's exception and formats its traceback itself sees the
    frames it sees without dlwatch: the watch's wrapper is not one of them."""

    def frames(watched: bool) -> list[tuple[str, str, str | None]]:
        # below the program's own frame (its line differs between the two loops)
        return _escaped(
            DataLoader(FailsAt(13), batch_size=4, num_workers=1),
            watched,
            tmp_path,
            lambda exc: [(f.filename, f.name, f.line) for f in traceback.extract_tb(exc.__traceback__)[1:]],
        )

    bare, watched = frames(False), frames(True)
    assert bare and any(name == "__next__" for _, name, _ in bare)  # torch's own frames are there
    ours = os.path.dirname(os.path.abspath(dlwatch.__file__)) + os.sep  # the package, not a path that names it
    assert not [f for f in watched if os.path.abspath(f[0]).startswith(ours)]
    assert watched == bare


def test_loop_body_exception_is_same_object(tmp_path, no_leftovers):
    dl = DataLoader(Squares(8), batch_size=4, num_workers=0)
    boom = KeyError("from the loop body")
    with pytest.raises(KeyError) as info:
        with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as batches:
            for _ in batches:
                raise boom
    assert info.value is boom
    assert info.value.__traceback__ is not None
    report = load(incidents(str(tmp_path))[0])
    assert report["exception"]["type"] == "builtins.KeyError" and report["exception"]["from_loader"] is False


def test_worker_init_fn_runs_once_per_worker_and_errors_surface(tmp_path, no_leftovers):
    log = tmp_path / "init.log"
    dl = DataLoader(Squares(16), batch_size=4, num_workers=3, worker_init_fn=record_init(str(log)))
    with dlwatch.watch(dl, report_dir=tmp_path / "r", poll_interval=0.1):
        batches_of(dl)
    lines = log.read_text().splitlines()
    assert sorted(int(line.split()[1]) for line in lines) == [0, 1, 2]
    assert len({line.split()[0] for line in lines}) == 3

    def error_of(watched: bool) -> tuple[type, str]:
        loader = DataLoader(Squares(16), batch_size=4, num_workers=2, worker_init_fn=FailingInit())
        try:
            if watched:
                with dlwatch.watch(loader, report_dir=tmp_path / "r2", poll_interval=0.1):
                    batches_of(loader)
            else:
                batches_of(loader)
        except BaseException as exc:  # noqa: BLE001
            exc.__traceback__ = None  # free the iterator now (see conftest.drop_traceback)
            return type(exc), str(exc)
        raise AssertionError("the failing worker_init_fn raised nothing")

    bare, watched = error_of(False), error_of(True)
    assert bare[0] is watched[0] is RuntimeError
    assert bare[1].splitlines()[0] == watched[1].splitlines()[0]
    assert (
        bare[1].splitlines()[-1] == watched[1].splitlines()[-1] == "RuntimeError: init failed in worker 0"
        or bare[1].splitlines()[-1] == watched[1].splitlines()[-1]
    )


def test_sigkill_of_training_process_gives_exit_incident(tmp_path, target):
    t = target("killed.py", str(tmp_path))
    line = t.wait_line("READY", timeout=60)
    monitor = int(line.split()[1])
    workers = [p.pid for p in psutil.Process(t.pid).children() if p.pid != monitor]
    os.kill(t.pid, signal.SIGKILL)
    found = wait_for(lambda: incidents(str(tmp_path)), timeout=15)
    assert found, "no exit incident"
    report = load(found[0])
    assert report["trigger"] == "exit" and report["exit_cause"] == "vanished"
    assert report["progress"]["batches"] >= 6
    main = next(p for p in report["processes"] if p["role"] == "main")
    assert main["status"] == "gone"
    assert wait_for(lambda: not psutil.pid_exists(monitor), timeout=10), "monitor left behind"
    # torch's workers notice their parent is gone by themselves; none may be left behind
    assert wait_for(lambda: not any(psutil.pid_exists(p) for p in workers), timeout=15), "workers left behind"


def test_timeline_agrees_with_proc(tmp_path, no_leftovers):
    dl = DataLoader(Squares(64), batch_size=4, num_workers=2)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as w:
        it = iter(dl)
        next(it)
        timeline = os.path.join(w.run_dir, "timeline.jsonl")
        pids = [os.getpid()] + [p.pid for p in it._workers]

        def sampled_all():
            try:
                records = [json.loads(x) for x in open(timeline)]
            except OSError:
                return None
            samples = [r for r in records if r["kind"] == "sample"]
            if len(samples) < 3:
                return None
            last = samples[-1]
            seen = {p["pid"]: p for p in last["procs"]}
            return last if all(pid in seen for pid in pids) else None

        time.sleep(0.3)  # let the prefetching settle, so that the figures hold still
        last = wait_for(sampled_all, timeout=10)
        assert last, "the monitor never sampled all processes"
        seen = {p["pid"]: p for p in last["procs"]}
        for pid in pids:
            proc = psutil.Process(pid)
            assert abs(seen[pid]["num_fds"] - proc.num_fds()) <= 2, (pid, seen[pid]["num_fds"], proc.num_fds())
            rss = proc.memory_info().rss
            assert abs(seen[pid]["rss"] - rss) <= max(0.1 * rss, 4 << 20), (pid, seen[pid]["rss"], rss)
            assert seen[pid]["fd_limit"] == __import__("resource").getrlimit(__import__("resource").RLIMIT_NOFILE)[0]
        del it


def test_import_and_cli_work_without_torch(tmp_path):
    blocker = tmp_path / "torch"
    blocker.mkdir()
    (blocker / "__init__.py").write_text("raise ImportError('torch is not installed here')\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), REPO]))
    code = (
        "import sys, dlwatch, dlwatch.cli, dlwatch.monitor.loop, dlwatch.inproc.agent; "
        "assert 'torch' not in sys.modules or sys.modules['torch'] is None; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "ok" in out.stdout, out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "dlwatch", "report", "--help"], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "List incident reports" in out.stdout, out.stderr
    out = subprocess.run(
        [sys.executable, "-m", "dlwatch", "report", str(tmp_path)], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0 and "no incidents" in out.stdout, out.stderr


def test_disable_switch_and_options(tmp_path, monkeypatch, no_leftovers):
    dl = DataLoader(Squares(8), batch_size=4)
    monkeypatch.setenv("DLWATCH_DISABLE", "1")
    with dlwatch.watch(dl, report_dir=tmp_path, enabled=True) as w:
        assert w.monitor_pid is None and batches_of(w) == batches_of(dl)
    monkeypatch.delenv("DLWATCH_DISABLE")
    monkeypatch.setenv("DLWATCH_POLL_INTERVAL", "0.5")
    assert dlwatch.watch(dl).options.poll_interval == 0.5
    assert dlwatch.watch(dl, poll_interval=2).options.poll_interval == 2.0
    monkeypatch.setenv("DLWATCH_DIR", str(tmp_path / "env"))
    assert dlwatch.watch(dl).options.report_dir == str(tmp_path / "env")
    with pytest.raises(ValueError, match="poll_interval"):
        dlwatch.watch(dl, poll_interval=-1)
    with pytest.raises(TypeError, match="poll_interval"):
        dlwatch.watch(dl, poll_interval=[1])
    with pytest.raises(ValueError, match="stall_timeout"):
        dlwatch.watch(dl, stall_timeout=float("nan"))
    with pytest.raises(TypeError, match="enabled"):
        dlwatch.watch(dl, enabled="maybe")
    with pytest.raises(TypeError, match="expected a DataLoader or another iterable"):
        dlwatch.watch(42)
    monkeypatch.setenv("DLWATCH_STALL_TIMEOUT", "soon")  # the environment fails open (issue 29): the default
    assert dlwatch.watch(dl).options.stall_timeout is None
    with pytest.raises(ValueError, match="stall_timeout"):  # the argument does not
        dlwatch.watch(dl, stall_timeout="soon")


def test_rng_fingerprints_only_for_the_first_worker_generations(tmp_path, no_leftovers):
    dl = DataLoader(Squares(8), batch_size=4, num_workers=2)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as batches:
        for _ in range(4):  # four epochs, four generations of workers
            batches_of(batches)
        events = [json.loads(line) for line in open(os.path.join(batches.run_dir, "events.jsonl"))]
    registered = [e for e in events if e["event"] == "worker_registered"]
    fingerprinted = [(e["epoch"], e["worker_id"], e["stage"]) for e in events if e["event"] == "rng_fingerprint"]
    assert len(registered) == 8  # every worker still registers
    # two generations of two workers, each at its start and after its first batch: enough to compare
    assert sorted(fingerprinted) == [
        (epoch, wid, stage) for epoch in (1, 2) for wid in (0, 1) for stage in ("after_first_batch", "start")
    ]
    assert dl.worker_init_fn is None
    assert dl.collate_fn is default_collate


def test_sys_exit_zero_is_not_an_incident(tmp_path, no_leftovers):
    dl = DataLoader(Squares(8), batch_size=4)
    with pytest.raises(SystemExit):
        with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as batches:
            for _ in batches:
                sys.exit(0)  # a script that ends itself from the loop is not a failure
    with pytest.raises(SystemExit):
        with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as batches:
            for _ in batches:
                sys.exit(3)
    found = incidents(str(tmp_path))
    assert len(found) == 1 and load(found[0])["exception"]["type"] == "builtins.SystemExit"


def test_block_leaves_no_dump_handler_behind(tmp_path, no_leftovers):
    from dlwatch.collect import faultdump

    with dlwatch.watch([1, 2], report_dir=tmp_path, poll_interval=0.1) as items:
        assert faultdump.is_handler_installed(os.getpid())
        list(items)
    assert not faultdump.is_handler_installed(os.getpid())
    from dlwatch.collect.procfs import fd_summary

    summary = fd_summary(os.getpid(), top=1000)
    assert not [path for path, _ in summary.top_files if str(tmp_path) in path]


def test_an_iterator_kept_past_the_block_still_works(tmp_path, no_leftovers):
    dl = DataLoader(Squares(12), batch_size=4, num_workers=0)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1):
        it = iter(dl)
        first = next(it)
    rest = list(it)  # the user's own business after the block: dlwatch must not break it
    assert [first[1].tolist()] + [b[1].tolist() for b in rest] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
