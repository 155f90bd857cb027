"""Run-summary retention (keep_runs): the oldest summaries beyond the cap go after each write.

Unit tests build summaries with the real ``store.write_summary`` so they look exactly like real
ones; hostile look-alikes (links, other users' directories, foreign names, summaries being
written) are left alone and not counted.  End to end: real watched DataLoader blocks with real
workers, in process and under ``dlwatch run``; and two processes writing and pruning the same
report directory at once.
"""

from __future__ import annotations

import errno
import os
import secrets
import shutil
import subprocess
import sys
import time

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from conftest import REPO, TARGETS, in_private_mount_namespace, kill_session, run_bounded
from dlwatch.wire import config
from dlwatch.cli import main
from dlwatch.report import store
from dlwatch.report import summary as sm

PID = 4242


def run_id(second: int, tag: str | None = None, pid: int = PID, utc: bool = True) -> str:
    """A run id as store.new_run_id makes it (``utc=False``: as older dlwatch did, local time
    without Z), at a chosen second of 2026-01-01."""
    z = "Z" if utc else ""
    return (
        f"20260101T{second // 3600:02d}{second // 60 % 60:02d}{second % 60:02d}{z}-{pid}-{tag or secrets.token_hex(3)}"
    )


def write(report_dir, rid: str) -> str:
    s = sm.skeleton(run_id=rid, pid=PID, now=time.time())
    return store.write_summary(str(report_dir), s, render_markdown=sm.render_markdown)


def summaries(report_dir) -> list[str]:
    return sorted(r.id for r in store.list_runs(str(report_dir))[0])


def entries(report_dir) -> list[str]:
    return sorted(os.listdir(os.path.join(report_dir, "runs")))


# --------------------------------------------------------------------------- unit, real summaries


def test_cap_respected_oldest_go_newest_and_just_written_stay(tmp_path):
    ids = [run_id(i) for i in range(6)]
    for rid in ids[:5]:
        write(tmp_path, rid)
    path = write(tmp_path, ids[5])
    removed = store.prune_runs(os.path.dirname(os.path.dirname(path)), 3, spare=os.path.basename(path))
    assert removed == ids[:3]
    assert summaries(tmp_path) == entries(tmp_path) == ids[3:]
    assert store.prune_runs(str(tmp_path), 3) == []  # at the cap: nothing more goes


def test_the_summary_just_written_stays_even_when_its_block_started_first(tmp_path):
    # an outer block (or a long one) ends after shorter ones that started later: its id is the oldest
    ids = [run_id(i) for i in range(5)]
    for rid in ids[1:]:
        write(tmp_path, rid)
    path = write(tmp_path, ids[0])
    assert store.prune_runs(str(tmp_path), 2, spare=os.path.basename(path)) == ids[1:4]
    assert summaries(tmp_path) == [ids[0], ids[4]]


@pytest.mark.parametrize("keep", [0, -1, None, True])
def test_keep_zero_keeps_all_and_nonsense_prunes_nothing(tmp_path, keep):
    ids = [run_id(i) for i in range(4)]
    for rid in ids:
        write(tmp_path, rid)
    assert store.prune_runs(str(tmp_path), keep) == []
    assert summaries(tmp_path) == ids


def test_ties_in_the_same_second_go_by_when_the_summary_was_written(tmp_path):
    # blocks a fraction of a second apart share the id's timestamp; the random tag says nothing of order
    a, b, c = run_id(7, "ffffff"), run_id(7, "000000"), run_id(7, "888888")
    for rid, mtime_ns in ((a, 1_000_000_000), (b, 3_000_000_000), (c, 2_000_000_000)):
        p = write(tmp_path, rid)
        os.utime(os.path.join(p, "summary.json"), ns=(mtime_ns, mtime_ns))
    assert store.prune_runs(str(tmp_path), 1) == [a, c]
    assert summaries(tmp_path) == [b]


def test_no_runs_dir_or_no_report_dir_is_nothing_to_do(tmp_path):
    assert store.prune_runs(str(tmp_path), 1) == []
    assert store.prune_runs(str(tmp_path / "missing"), 1) == []  # logged, never raised


# --------------------------------------------------------------------------- UTC ids, DST and time zones


@pytest.fixture
def set_tz():
    """Set this process's time zone (TZ + tzset, as a rank started in another zone has it); restored after."""
    before = os.environ.get("TZ")

    def set_to(zone: str) -> None:
        assert os.path.exists(os.path.join("/usr/share/zoneinfo", zone)), f"no tzdata for {zone}"
        os.environ["TZ"] = zone
        time.tzset()

    try:
        yield set_to
    finally:
        if before is None:
            os.environ.pop("TZ", None)
        else:
            os.environ["TZ"] = before
        time.tzset()


# 2026-11-01, America/New_York: at 06:00 UTC the clocks go back from 02:00 EDT to 01:00 EST
BEFORE_FALL_BACK = 1793512800 - 30 * 60  # 05:30 UTC, 01:30 EDT
AFTER_FALL_BACK = 1793512800 + 10 * 60  # 06:10 UTC, 01:10 EST: later, yet earlier on the local clock


def test_ids_across_a_dst_change_sort_and_prune_by_real_time(tmp_path, set_tz):
    set_tz("America/New_York")
    # the precondition that makes this a test: on the local clock the later block looks earlier
    assert time.strftime("%H%M", time.localtime(BEFORE_FALL_BACK)) == "0130"
    assert time.strftime("%H%M", time.localtime(AFTER_FALL_BACK)) == "0110"
    first = store.new_run_id(pid=PID, now=BEFORE_FALL_BACK)
    second = store.new_run_id(pid=PID, now=AFTER_FALL_BACK)
    third = store.new_run_id(pid=PID, now=AFTER_FALL_BACK + 60)
    assert first.startswith("20261101T053000Z-4242-") and second.startswith("20261101T061000Z-4242-")
    assert store.run_id_time(first) == BEFORE_FALL_BACK and store.run_id_time(second) == AFTER_FALL_BACK
    for rid in (second, first, third):  # written out of order: the order is the ids'
        write(tmp_path, rid)
    assert store.prune_runs(str(tmp_path), 2) == [first]
    assert summaries(tmp_path) == sorted([second, third])


def test_an_id_is_the_same_in_every_time_zone(set_tz):
    ids = set()
    for zone in ("UTC", "America/New_York", "Asia/Kolkata", "Etc/GMT-14", "Etc/GMT+12"):
        set_tz(zone)
        ids.add(store.new_run_id(pid=7, now=AFTER_FALL_BACK).rsplit("-", 1)[0])
        assert store.run_id_time(store.new_run_id(now=AFTER_FALL_BACK)) == AFTER_FALL_BACK
    assert ids == {"20261101T061000Z-7"}


def test_old_local_time_ids_are_still_read_listed_ordered_and_pruned(tmp_path, set_tz):
    """Ids without Z were local time: read in this process's zone, they order among the UTC ones."""
    set_tz("Asia/Kolkata")  # UTC+05:30, no DST
    old_early = run_id(3600 * 9, "aaaaaa", utc=False)  # 09:00 IST = 03:30 UTC
    new_middle = run_id(3600 * 4, "bbbbbb")  # 04:00 UTC
    old_late = run_id(3600 * 10, "cccccc", utc=False)  # 10:00 IST = 04:30 UTC
    new_last = run_id(3600 * 5, "dddddd")  # 05:00 UTC
    assert store.run_id_time(old_early) == store.run_id_time(run_id(3600 * 3 + 1800, "eeeeee"))
    for rid in (new_last, old_late, new_middle, old_early):
        write(tmp_path, rid)
    assert summaries(tmp_path) == sorted([old_early, new_middle, old_late, new_last])  # all listed
    assert store.prune_runs(str(tmp_path), 2) == [old_early, new_middle]
    assert summaries(tmp_path) == sorted([old_late, new_last])


def test_real_blocks_in_different_time_zones_prune_the_one_that_started_first(tmp_path, set_tz, no_leftovers):
    """Three real watched blocks, the first in UTC+14, the next two in UTC-12 (ranks in other zones
    share a report directory).  On local clocks the first looks 26 hours newer than the others; in
    UTC it is the oldest, and keep_runs=2 removes it."""
    dl = DataLoader(Squares(), batch_size=4, num_workers=2)
    ids = []
    for zone in ("Etc/GMT-14", "Etc/GMT+12", "Etc/GMT+12"):
        set_tz(zone)
        with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1, keep_runs=2) as w:
            assert [y.tolist() for _, y in w] == [[0, 1, 4, 9], [16, 25, 36, 49]]
        ids.append(w.summary["id"])
    assert all(store.RUN_ID.fullmatch(i) and i.split("-")[0].endswith("Z") for i in ids), ids
    times = [store.run_id_time(i) for i in ids]
    assert times == sorted(times)  # ids say UTC: the order they were made in
    assert summaries(tmp_path) == sorted(ids[1:])


# --------------------------------------------------------------------------- hostile look-alikes


def test_hostile_look_alikes_are_left_alone_and_not_counted(tmp_path, caplog):
    reports = tmp_path / "reports"
    real = [run_id(100 + i) for i in range(3)]
    for rid in real:
        write(reports, rid)
    runs = reports / "runs"
    # a victim outside, holding what a summary holds, reached through a link named like the oldest run
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "summary.json").write_text("{}")
    (victim / "precious.txt").write_text("keep me")
    link = run_id(1, "aaaaaa")
    os.symlink(victim, runs / link)
    # a run id without summary.json (a crashed writer, or someone's own directory)
    bare = run_id(2, "bbbbbb")
    (runs / bare).mkdir()
    (runs / bare / "notes.txt").write_text("x")
    # a run id whose summary.json is a link to a file elsewhere
    linked_json = run_id(3, "cccccc")
    (runs / linked_json).mkdir()
    os.symlink(victim / "summary.json", runs / linked_json / "summary.json")
    # a regular file named like a run id
    plain_file = run_id(4, "dddddd")
    (runs / plain_file).write_text("not a directory")
    # names that are not exactly a run id, each a directory with a summary.json
    odd = [
        "notes",
        run_id(5, "ABCDEF"),
        run_id(6, "eeeeee") + ".bak",
        "x" + run_id(7, "eeeeee"),
        "20260101T000008-12-abcdef0",
        "20260101T000009z-12-abcdef",
        "20261399T000000Z-12-abcdef",
    ]
    # a summary being written right now
    odd.append(store.TMP_PREFIX + run_id(8, "ffffff") + "-k2j3h4")
    for name in odd:
        (runs / name).mkdir()
        (runs / name / "summary.json").write_text("{}")
    before = set(entries(reports))

    # three real summaries and keep=3: the look-alikes do not count, nothing goes
    assert store.prune_runs(str(reports), 3) == []
    assert set(entries(reports)) == before

    assert store.prune_runs(str(reports), 1) == real[:2]
    assert set(entries(reports)) == before - set(real[:2])
    assert summaries(reports) == real[2:]
    assert (victim / "precious.txt").read_text() == "keep me" and (victim / "summary.json").exists()
    assert os.path.islink(runs / link) and os.path.islink(runs / linked_json / "summary.json")
    assert "prune_runs" not in caplog.text


def test_another_users_run_directory_is_never_removed(tmp_path):
    reports = tmp_path / "reports"
    mine = [run_id(10), run_id(11)]
    for rid in mine:
        write(reports, rid)
    theirs = run_id(1, "111111")
    path = write(reports, theirs)
    try:
        os.chown(path, 65534, 65534)
    except PermissionError:
        pytest.skip("chown is not permitted here (not root): another user's directory cannot be made")
    assert os.stat(path).st_uid == 65534
    assert store.prune_runs(str(reports), 1) == [mine[0]]
    assert entries(reports) == [theirs, mine[1]]
    assert os.path.isfile(os.path.join(path, "summary.json"))


def test_a_link_inside_a_pruned_summary_is_removed_not_followed(tmp_path):
    reports = tmp_path / "reports"
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "data.bin").write_bytes(b"x" * 100)
    old = write(reports, run_id(1))
    os.symlink(victim, os.path.join(old, "report.html"))  # planted where a late file could go
    os.symlink(victim / "data.bin", os.path.join(old, "timeline.jsonl"))
    write(reports, run_id(2))
    assert store.prune_runs(str(reports), 1) == [os.path.basename(old)]
    assert not os.path.lexists(old)
    assert (victim / "data.bin").read_bytes() == b"x" * 100


def test_a_linked_or_shared_runs_directory_is_not_pruned(tmp_path, caplog):
    reports = tmp_path / "reports"
    for i in range(3):
        write(reports, run_id(i))
    elsewhere = tmp_path / "elsewhere"
    os.rename(reports / "runs", elsewhere)
    os.symlink(elsewhere, reports / "runs")
    with caplog.at_level("WARNING", logger="dlwatch"):
        assert store.prune_runs(str(reports), 1) == []
    assert len(os.listdir(elsewhere)) == 3 and "prune_runs_failed" in caplog.text
    os.unlink(reports / "runs")
    os.rename(elsewhere, reports / "runs")
    os.chmod(reports / "runs", 0o770)  # writable by the group: someone else could have put things there
    assert store.prune_runs(str(reports), 1) == []
    assert len(entries(reports)) == 3


def test_without_symlink_safe_rmtree_nothing_is_pruned(tmp_path, monkeypatch, caplog):
    for i in range(3):
        write(tmp_path, run_id(i))
    monkeypatch.setattr(shutil.rmtree, "avoids_symlink_attacks", False)
    with caplog.at_level("WARNING", logger="dlwatch"):
        assert store.prune_runs(str(tmp_path), 1) == []
    assert len(summaries(tmp_path)) == 3 and "prune_runs_skipped" in caplog.text


def test_a_concurrent_pruner_that_was_first_is_not_an_error(tmp_path, monkeypatch, caplog):
    """The other rank removes a victim between our listing and our rmtree: ENOENT is fine."""
    ids = [run_id(i) for i in range(4)]
    for rid in ids:
        write(tmp_path, rid)
    real_remove = store._remove_tree

    def other_pruner_first(dir_fd, name, *args):
        shutil.rmtree(os.path.join(tmp_path, "runs", name))  # the other process, a moment earlier
        return real_remove(dir_fd, name, *args)

    monkeypatch.setattr(store, "_remove_tree", other_pruner_first)
    with caplog.at_level("WARNING", logger="dlwatch"):
        assert store.prune_runs(str(tmp_path), 2) == ids[:2]
    assert summaries(tmp_path) == ids[2:] and "prune_runs" not in caplog.text


def test_a_late_file_in_a_summary_being_pruned_is_removed_on_a_second_pass(tmp_path, monkeypatch, caplog):
    """That summary's report.html child may still be writing into it: rmdir fails once (ENOTEMPTY)."""
    ids = [run_id(i) for i in range(3)]
    for rid in ids:
        write(tmp_path, rid)
    real_remove = store._remove_tree
    calls = []

    def late_file_once(dir_fd, name, fs, errors):
        calls.append(name)
        if len(calls) == 1:  # as if a file arrived between the listing and the final rmdir
            return errors.append(OSError(errno.ENOTEMPTY, "Directory not empty"))
        return real_remove(dir_fd, name, fs, errors)

    monkeypatch.setattr(store, "_remove_tree", late_file_once)
    with caplog.at_level("WARNING", logger="dlwatch"):
        assert store.prune_runs(str(tmp_path), 2) == ids[:1]
    assert calls == [ids[0], ids[0]] and summaries(tmp_path) == ids[1:] and "prune_runs" not in caplog.text


def test_a_removal_that_keeps_failing_is_one_log_line_never_raised(tmp_path, monkeypatch, caplog):
    ids = [run_id(i) for i in range(3)]
    for rid in ids:
        write(tmp_path, rid)

    def denied(dir_fd, name, fs, errors):
        errors.append(PermissionError(errno.EACCES, "Permission denied"))

    monkeypatch.setattr(store, "_remove_tree", denied)
    with caplog.at_level("WARNING", logger="dlwatch"):
        assert store.prune_runs(str(tmp_path), 1) == []
    assert summaries(tmp_path) == ids
    assert [r.message.split()[0] for r in caplog.records] == ["event='prune_runs_incomplete'"], caplog.text


# --------------------------------------------------------------------------- options


@pytest.mark.parametrize(
    "value, kind",
    [(-1, ValueError), (2.0, TypeError), (True, TypeError), ("many", ValueError), ("-3", ValueError), ([2], TypeError)],
)
def test_bad_keep_runs_keyword_names_the_keyword(value, kind):
    with pytest.raises(kind) as info:
        config.resolve(keep_runs=value, environ={})
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("dlwatch.watch: keep_runs must be a whole number >= 0")
    assert msg.endswith("(keyword argument)")
    with pytest.raises(kind):
        dlwatch.watch([1, 2], keep_runs=value)  # before anything starts


@pytest.mark.parametrize("value", ["-1", "1.5", "true", "2e3", "ten"])
def test_bad_keep_runs_variable_falls_back_naming_the_variable(value):
    """Fail open on the environment (issue 29): the default applies, and the one line to warn names the variable."""
    options = config.resolve(environ={"DLWATCH_KEEP_RUNS": value})
    assert options.keep_runs == 200 and "keep_runs" not in options.from_env
    (msg,) = options.problems
    assert "\n" not in msg and "keep_runs must be a whole number" in msg
    assert msg.startswith(f"DLWATCH_KEEP_RUNS={value!r} is ignored: ") and msg.endswith("the default (200) applies")


def test_keep_runs_precedence_default_and_to_dict():
    assert config.resolve(environ={}).keep_runs == 200
    assert config.resolve(environ={"DLWATCH_KEEP_RUNS": " 7 "}).keep_runs == 7
    assert config.resolve(keep_runs=0, environ={"DLWATCH_KEEP_RUNS": "7"}).keep_runs == 0
    assert config.resolve(keep_runs="5", environ={}).to_dict()["keep_runs"] == 5
    assert config.ENV["keep_runs"] == "DLWATCH_KEEP_RUNS"


def _cli(args, cwd, timeout=120, **extra):
    env = dict(os.environ)
    env.pop("DLWATCH_DIR", None)
    env.pop("DLWATCH_DISABLE", None)
    env.pop("DLWATCH_KEEP_RUNS", None)
    env["PYTHONPATH"] = REPO  # this tree's dlwatch, whatever the environment has installed
    env.update(extra)
    return run_bounded([sys.executable, "-m", "dlwatch", *args], env=env, cwd=str(cwd), timeout=timeout)


@pytest.mark.parametrize(
    "args, extra, text",
    [
        (["--keep-runs", "-1"], {}, "keep_runs must be a whole number >= 0 (0 keeps all), got '-1' (--keep-runs)"),
        (["--keep-runs", "2.5"], {}, "got '2.5' (--keep-runs)"),
        # a bad DLWATCH_KEEP_RUNS no longer stops the program: tests/test_hardening.py (issue 29, item 6)
        (["--keep-runs", "lots"], {"DLWATCH_KEEP_RUNS": "7"}, "got 'lots' (--keep-runs)"),
    ],
)
def test_run_bad_keep_runs_one_line_exit_2(tmp_path, args, extra, text):
    script = os.path.join(TARGETS, "plain_train.py")
    rc, out, err = _cli(
        ["run", "--report-dir", str(tmp_path / "r"), *args, script, "ok"], tmp_path, timeout=60, **extra
    )
    assert rc == 2  # a usage error (see `dlwatch --help`)
    assert err.count("\n") == 1 and err.startswith("dlwatch: error: ") and text in err, err
    assert out == "" and not (tmp_path / "r").exists()  # refused before the program started


# --------------------------------------------------------------------------- end to end, real workers


class Squares(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), torch.tensor(i * i)


def test_real_watched_blocks_keep_the_two_newest(tmp_path, no_leftovers, capfd):
    dl = DataLoader(Squares(), batch_size=4, num_workers=2)
    ids = []
    for _ in range(4):
        with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1, keep_runs=2) as w:
            assert [y.tolist() for _, y in w] == [[0, 1, 4, 9], [16, 25, 36, 49]]  # the same batches
        ids.append(w.summary["id"])
    assert len(set(ids)) == 4
    assert [e for e in entries(tmp_path) if not e.startswith(".")] == sorted(ids[2:])
    assert summaries(tmp_path) == sorted(ids[2:])
    capfd.readouterr()
    assert main(["report", "--runs", str(tmp_path)]) == 0
    rows = capfd.readouterr().out.splitlines()
    assert rows[0].startswith("RUN") and len(rows) == 3 and {r.split()[0] for r in rows[1:]} == set(ids[2:])


def test_the_training_process_prunes_when_it_writes_the_summary_itself(tmp_path, no_leftovers):
    """The monitor is gone (SIGKILL): the fallback summary written in the training process prunes too."""
    import signal
    import warnings

    from conftest import wait_for

    older = [run_id(i) for i in range(3)]  # summaries of earlier blocks (2026-01-01: older than any new id)
    for rid in older:
        write(tmp_path, rid)
    dl = DataLoader(Squares(), batch_size=4, num_workers=2)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1, keep_runs=2) as w:
            os.kill(w.monitor_pid, signal.SIGKILL)
            wait_for(lambda: w._session.monitor.poll() is not None, 5)
            assert [y.tolist() for _, y in w] == [[0, 1, 4, 9], [16, 25, 36, 49]]
    s = w.summary
    assert any("monitor process was not running" in n for n in s["notes"])
    assert summaries(tmp_path) == sorted([older[2], s["id"]])


def test_dlwatch_run_keep_runs_2_lists_two(tmp_path):
    """plain_train.py ok, three times: one summary per program (four watched iterations each), two kept."""
    reports = tmp_path / "reports"
    for _ in range(3):
        rc, out, err = _cli(
            ["run", "--report-dir", str(reports), "--keep-runs", "2", os.path.join(TARGETS, "plain_train.py"), "ok"],
            tmp_path,
            timeout=180,
        )
        assert rc == 0, err
        assert out.count("ITER") == 4  # four watched iterations, one program summary
    assert len([e for e in entries(reports) if not e.startswith(".")]) == 2
    rc, out, err = _cli(["report", "--runs", str(reports)], tmp_path, timeout=60)
    assert rc == 0, err
    rows = out.splitlines()
    assert rows[0].startswith("RUN") and len(rows) == 3, out


# --------------------------------------------------------------------------- two pruners at once

WRITER = r"""
import os, sys, time
sys.path.insert(0, sys.argv[1])
from dlwatch._log import configure_own_process
from dlwatch.report import store, summary as sm
configure_own_process()  # a prune failure would be a line on stderr
report_dir, go, n, keep = sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
while not os.path.exists(go):
    time.sleep(0.005)
for i in range(n):
    rid = store.new_run_id()
    path = store.write_summary(report_dir, sm.skeleton(run_id=rid, pid=os.getpid(), now=time.time()),
                               render_markdown=sm.render_markdown)
    # never its own just-written summary; the other process may prune it, if its id is older than keep others
    assert rid not in store.prune_runs(os.path.dirname(os.path.dirname(path)), keep, spare=rid)
print("DONE", n)
"""


def test_two_processes_writing_and_pruning_at_once(tmp_path):
    reports = tmp_path / "reports"
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, REPO, str(reports), str(go), "40", "3"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        for _ in range(2)
    ]
    try:
        go.write_text("")
        results = [p.communicate(timeout=120) for p in procs]
        for p, (out, err) in zip(procs, results):
            assert p.returncode == 0 and out.strip() == "DONE 40" and err == "", err
        left = summaries(reports)
        assert 1 <= len(left) <= 3 and entries(reports) == left  # no half-removed or temporary leftovers
    finally:
        for p in procs:
            kill_session(p.pid, set())
            p.wait()


# --------------------------------------------------------------------------- .jobs (multi-rank figures)

NOBODY = 65534


def write_job(report_dir, job_id: str, *, rank: int = 0, pid: int = PID, age_s: float | None = None) -> str:
    """A job's rank figures file as the monitor's real sink writes it; its directory's path.
    ``age_s``: as if the job's last write was that long ago."""
    from dlwatch.monitor.rankfigures import RankFiguresSink
    from dlwatch.monitor.sinks import PollState

    store.prepare_report_dir(str(report_dir))
    sink = RankFiguresSink(str(report_dir), {"job_id": job_id, "rank": rank, "world_size": 2}, pid=pid)
    now = time.time()
    sink.close(
        PollState(
            now=now,
            monotonic=time.monotonic(),
            pid=pid,
            started_at=now - 5,
            rank=sink.rank,
            heartbeat=None,
            procs=(),
            system=None,
            stalls=0,
            incidents=0,
            stalled=False,
        ),
        clean=True,
    )
    if age_s is not None:
        os.utime(sink.path, (now - age_s, now - age_s))
    return os.path.dirname(sink.path)


def jobs(report_dir) -> list[str]:
    return sorted(os.listdir(os.path.join(report_dir, store.JOBS_DIR)))


def test_jobs_beyond_keep_go_oldest_last_write_first_and_the_current_job_stays(tmp_path):
    for i, job in enumerate(["j-a", "j-b", "j-c", "j-d"]):
        write_job(tmp_path, job, age_s=4000 - 1000 * i)  # j-a written longest ago
        write_job(tmp_path, job, rank=1, pid=PID + 1, age_s=4000 - 1000 * i)
    write_job(tmp_path, "j-b", rank=1, pid=PID + 1, age_s=10)  # j-b's rank 1 wrote just now: j-b is recent
    # the pruning run belongs to j-a (a long job, its last write long ago): it stays
    assert store.prune_jobs(str(tmp_path), 3, spare="j-a") == ["j-c"]
    assert jobs(tmp_path) == ["j-a", "j-b", "j-d"]
    assert store.prune_jobs(str(tmp_path), 2) == ["j-a"]
    assert store.prune_jobs(str(tmp_path), 2) == []  # at the cap
    assert store.prune_jobs(str(tmp_path), 0) == [] and jobs(tmp_path) == ["j-b", "j-d"]  # 0 keeps all
    assert store.prune_jobs(str(tmp_path / "missing"), 1) == []


def test_job_look_alikes_links_and_foreign_entries_are_left_alone(tmp_path, caplog):
    reports = tmp_path / "reports"
    real = [write_job(reports, f"job{i}", age_s=100 - i) for i in range(3)]
    root = reports / store.JOBS_DIR
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "rank0-host-1.json").write_text("{}")
    (victim / "precious.txt").write_text("keep me")
    os.symlink(victim, root / "linked-job")  # a link named like a job, to a directory holding figures
    (root / "empty-job").mkdir()  # no figures file: not ours to count
    (root / "nested-job").mkdir()
    (root / "nested-job" / "rank0-host-1.json").write_text("{}")
    (root / "nested-job" / "sub").mkdir()  # rank figures are flat files: a directory means not ours
    (root / "file-job").write_text("a file named like a job")
    (root / ".hidden-job").mkdir()
    (root / ".hidden-job" / "rank0-host-1.json").write_text("{}")
    # a link planted inside a job of ours: the job goes, the link is unlinked, its target stays
    os.symlink(victim / "precious.txt", os.path.join(real[0], "rank9-host-9.json"))
    for d in ("empty-job", "nested-job", ".hidden-job"):
        os.utime(root / d, (1, 1))  # as old as can be: still not pruned
    before = set(jobs(reports))
    with caplog.at_level("WARNING", logger="dlwatch"):
        assert store.prune_jobs(str(reports), 3) == []  # only the three real jobs count
        assert store.prune_jobs(str(reports), 1) == ["job0", "job1"]
    assert set(jobs(reports)) == before - {"job0", "job1"}
    assert (victim / "precious.txt").read_text() == "keep me" and (victim / "rank0-host-1.json").exists()
    assert os.path.islink(root / "linked-job")
    assert "prune_jobs" not in caplog.text


def test_a_linked_or_shared_jobs_directory_is_not_pruned(tmp_path, caplog):
    reports = tmp_path / "reports"
    for i in range(3):
        write_job(reports, f"job{i}", age_s=100 - i)
    elsewhere = tmp_path / "elsewhere"
    os.rename(reports / store.JOBS_DIR, elsewhere)
    os.symlink(elsewhere, reports / store.JOBS_DIR)
    with caplog.at_level("WARNING", logger="dlwatch"):
        assert store.prune_jobs(str(reports), 1) == []
    assert len(os.listdir(elsewhere)) == 3 and "prune_jobs_failed" in caplog.text
    os.unlink(reports / store.JOBS_DIR)
    os.rename(elsewhere, reports / store.JOBS_DIR)
    os.chmod(reports / store.JOBS_DIR, 0o770)  # writable by the group: someone else could have put things there
    assert store.prune_jobs(str(reports), 1) == []
    assert len(jobs(reports)) == 3


def test_a_job_made_by_another_user_is_never_removed(tmp_path):
    """A second uid (nobody, through setpriv) really makes a job directory with a figures file in our
    .jobs/ while we let it; ours go by the cap, its directory stays and does not count."""
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv: a second uid makes the directory")
    import tempfile

    reports = tempfile.mkdtemp(prefix="dlwatch-jobs-", dir="/tmp")  # nobody can reach it once we let it
    try:
        mine = [write_job(reports, f"mine{i}", age_s=100 - i) for i in range(3)]
        root = os.path.join(reports, store.JOBS_DIR)
        os.chmod(reports, 0o711)
        os.chmod(root, 0o777)
        try:
            out = subprocess.run(
                [
                    "setpriv",
                    f"--reuid={NOBODY}",
                    f"--regid={NOBODY}",
                    "--clear-groups",
                    "sh",
                    "-c",
                    'mkdir -m 700 "$1/theirs" && echo {} > "$1/theirs/rank0-host-1.json" && '
                    'touch -d @1 "$1/theirs/rank0-host-1.json"',
                    "sh",
                    root,
                ],
                capture_output=True,
                text=True,
                timeout=30,
            )
        finally:
            os.chmod(root, 0o700)
            os.chmod(reports, 0o700)
        assert out.returncode == 0, out.stderr
        st = os.stat(os.path.join(root, "theirs"))
        assert st.st_uid == NOBODY and os.path.getmtime(os.path.join(root, "theirs", "rank0-host-1.json")) == 1
        assert store.prune_jobs(reports, 1) == ["mine0", "mine1"]
        assert jobs(reports) == ["mine2", "theirs"]
        assert os.listdir(os.path.join(root, "theirs")) == ["rank0-host-1.json"]
        assert not os.path.exists(mine[0])
    finally:
        shutil.rmtree(reports, ignore_errors=True)


MOUNTED = r"""
import os, sys
sys.path.insert(0, sys.argv[1])
from dlwatch._log import configure_own_process
from dlwatch.report import store
configure_own_process()  # a refusal is a line on stderr
print(store.prune_jobs(sys.argv[2], 1))
"""


def test_jobs_on_another_filesystem_are_not_pruned(tmp_path):
    """A job directory that is a mount point, and a .jobs/ that is one: never crossed (st_dev)."""
    reports = tmp_path / "reports"
    first = [write_job(reports, f"job{i}", age_s=100 - i) for i in range(3)][0]
    own_files = os.listdir(first)
    root = reports / store.JOBS_DIR
    env = dict(os.environ, PYTHONPATH=REPO)
    # job0, the oldest, is a tmpfs with a figures file on it; job1 goes, job0 stays and does not count
    cmd = (
        f'mount -t tmpfs -o size=1m none "{root}/job0" && echo x > "{root}/job0/rank0-h-1.json" && '
        f'"{sys.executable}" -c \'{MOUNTED}\' "{REPO}" "{reports}" && ls "{root}/job0"'
    )
    rc, out, err = in_private_mount_namespace(cmd, env=env, timeout=60)
    assert rc == 0, err
    assert out.split("\n")[:2] == ["['job1']", "rank0-h-1.json"], out
    assert jobs(reports) == ["job0", "job2"]
    assert os.listdir(first) == own_files  # under the mount, job0's own files were never touched
    # .jobs/ itself a mount point (another filesystem than the report directory): nothing is pruned
    write_job(reports, "job3")
    cmd = (
        f'mkdir -p "{tmp_path}/other" && mount -t tmpfs -o size=1m none "{tmp_path}/other" && '
        f'cp -a "{root}/." "{tmp_path}/other/" && mount --bind "{tmp_path}/other" "{root}" && '
        f'"{sys.executable}" -c \'{MOUNTED}\' "{REPO}" "{reports}" && ls "{root}"'
    )
    rc, out, err = in_private_mount_namespace(cmd, env=env, timeout=60)
    assert rc == 0, err
    assert out.split("\n")[0] == "[]" and sorted(out.split("\n")[1:4]) == ["job0", "job2", "job3"], (out, err)
    assert "prune_jobs_failed" in err and "another filesystem" in err


class _Job(Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.tensor([float(i)]), torch.tensor(i)


def test_a_real_watched_block_in_a_job_prunes_old_jobs_and_keeps_its_own(tmp_path, monkeypatch, no_leftovers):
    for i, job in enumerate(["old-a", "old-b", "old-c"]):
        write_job(tmp_path, job, age_s=3000 - 1000 * i)
    monkeypatch.setenv("DLWATCH_JOB_ID", "current:job")
    dl = DataLoader(_Job(), batch_size=4, num_workers=2)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1, keep_runs=2) as w:
        assert [y.tolist() for _, y in w] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert w.summary["rank"]["job_id"] == "current:job"
    assert jobs(tmp_path) == ["current_job", "old-c"]
    (figures,) = os.listdir(os.path.join(tmp_path, store.JOBS_DIR, "current_job"))
    assert figures.startswith("rank-unknown-") and figures.endswith(f"-{os.getpid()}.json")
