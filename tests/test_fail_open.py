"""Fail open: whatever dlwatch cannot do at the start of a block, the loop gets every batch it would
have got, in both forms, and the user gets one warning that says the run is not (fully) watched.

Each way in is made for real in a fresh process (tests/targets/fail_open.py): a working directory
removed under the job, a full filesystem for the report dir and TMPDIR (a tiny tmpfs in a private
mount namespace), an interpreter the monitor cannot be started from, a heartbeat that cannot be
allocated.  Before the fixes, the `as` form raised "iterate the watched object inside its with
block" in the first two, and a sparse heartbeat could SIGBUS the trainer on a full filesystem.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import sys

import pytest

from conftest import REPO, TARGETS, in_private_mount_namespace, run_to_end

SCRIPT = os.path.join(TARGETS, "fail_open.py")
EXPECTED = [[[float(i), float(i * i)] for i in range(b, b + 4)] for b in range(0, 16, 4)]


def _env(tmp, **extra: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TARGETS]), TMPDIR=str(tmp))
    env.pop("DLWATCH_DIR", None)
    env.update(extra)
    return env


def _check(rc: int, out: str, err: str) -> list[str]:
    """Every batch of both epochs, exit 0; returns the dlwatch warnings the script received."""
    assert rc == 0, (out, err)
    epochs = [json.loads(line.split(" ", 2)[2]) for line in out.splitlines() if line.startswith("EPOCH ")]
    assert epochs == [EXPECTED, EXPECTED], out
    warned = [line[len("WARNING ") :] for line in out.splitlines() if line.startswith("WARNING ")]
    assert f"WARNINGS {len(warned)}" in out
    return warned


@pytest.mark.parametrize("form", ["plain", "as"])
def test_working_directory_removed(short_tmp, form):
    # the default report dir (./dlwatch-reports) cannot be made: reports go to a private dir in TMPDIR
    rc, out, err = run_to_end(
        [sys.executable, SCRIPT, "cwd-deleted", form],
        env=_env(short_tmp),
        marker=SCRIPT,
        timeout=120,
        what="the fail-open target",
    )
    warned = _check(rc, out, err)
    assert len(warned) == 1, warned
    assert "report directory" in warned[0] and "instead" in warned[0]


@pytest.mark.parametrize("form", ["plain", "as"])
def test_monitor_cannot_be_started(short_tmp, form):
    rc, out, err = run_to_end(
        [sys.executable, SCRIPT, "no-spawn", form],
        env=_env(short_tmp),
        marker=SCRIPT,
        timeout=120,
        what="the fail-open target",
    )
    warned = _check(rc, out, err)
    assert len(warned) == 1, warned
    assert "could not start monitoring" in warned[0] and "training continues unwatched" in warned[0]
    assert os.listdir(short_tmp) == [] or not any(  # nothing half-made left in the report dir
        os.listdir(os.path.join(short_tmp, d, "runs"))
        for d in os.listdir(short_tmp)
        if os.path.isdir(os.path.join(short_tmp, d, "runs"))
    )


@pytest.mark.parametrize("form", ["plain", "as"])
def test_heartbeat_cannot_be_allocated(tmp_path, short_tmp, form):
    rc, out, err = run_to_end(
        [sys.executable, SCRIPT, "heartbeat", form],
        env=_env(short_tmp, DLWATCH_DIR=str(tmp_path / "reports")),
        marker=SCRIPT,
        timeout=120,
        what="the fail-open target",
    )
    warned = _check(rc, out, err)
    assert len(warned) == 1, warned
    assert "could not start monitoring" in warned[0] and "training continues unwatched" in warned[0]


@pytest.mark.parametrize("form", ["plain", "as"])
def test_full_filesystem_for_reports_and_tmpdir(tmp_path, form):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = _env(tmp_path, DLWATCH_DIR=str(mnt / "reports"))
    env["TMPDIR"] = str(mnt / "tmp")
    # fill the tiny tmpfs to the last page: no run directory, no heartbeat, no fallback can be written
    cmd = (
        f"mount -t tmpfs -o size=64k tmpfs {mnt} && mkdir {mnt}/tmp && "
        f"(dd if=/dev/zero of={mnt}/filler bs=4k 2>/dev/null; true) && "
        f"{sys.executable} {SCRIPT} as-is {form}"
    )
    rc, out, err = in_private_mount_namespace(cmd, env=env, timeout=120)
    warned = _check(rc, out, err)
    assert len(warned) == 1, warned
    assert "No space left on device" in warned[0], warned
    # Python's tempfile skips an unwritable TMPDIR for the next candidate (/tmp): the run may still be
    # watched from there, and the one warning says where; else it says the run is not watched
    if "instead" in warned[0]:
        fallback = warned[0].rsplit("writing reports to ", 1)[1].split("'")[1]
        assert not fallback.startswith(str(mnt))
        shutil.rmtree(fallback, ignore_errors=True)
    else:
        assert "could not start monitoring" in warned[0] and "training continues unwatched" in warned[0]


def test_full_filesystem_heartbeat_is_an_error_not_sigbus(tmp_path):
    """The heartbeat's blocks are allocated before it is mapped: on a filesystem with no free page
    creating it fails with ENOSPC (so the run goes unwatched), where a sparse mapping let the first
    store kill the process with SIGBUS."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    probe = (
        "import errno,sys\n"
        "from dlwatch.wire.heartbeat import HeartbeatWriter\n"
        "try:\n"
        f"    hb = HeartbeatWriter({str(mnt / 'heartbeat')!r})\n"
        "except OSError as exc:\n"
        "    print('REFUSED', errno.errorcode[exc.errno]); sys.exit(0)\n"
        "hb.begin_epoch(); hb.first_batch(1.0, 2.0); hb.close(); print('WROTE')\n"
    )
    cmd = (
        f"mount -t tmpfs -o size=16k tmpfs {mnt} && "
        f"(dd if=/dev/zero of={mnt}/filler bs=4k 2>/dev/null; true) && "
        f"{sys.executable} -c {shlex.quote(probe)}"
    )
    rc, out, err = in_private_mount_namespace(cmd, env=_env(tmp_path), timeout=60)
    assert rc == 0, (rc, out, err)  # -7 (SIGBUS) before the fix
    assert out.strip() == "REFUSED ENOSPC", (out, err)


def test_a_huge_exception_message_is_copied_bounded(tmp_path, no_leftovers):
    """Item 4: a 50 MB exception message.  The program gets the very same exception (message whole);
    the report keeps both ends of it within a bound and says where and how much was cut.  (Before,
    the block's exit took 15-30 s here and the exception's event, over the reader's line cap, was
    dropped: no incident at all.)"""
    import dlwatch
    from torch.utils.data import DataLoader

    from conftest import incidents, load

    sys.path.insert(0, TARGETS)
    try:
        from datasets import Squares
    finally:
        sys.path.remove(TARGETS)

    message = "head-" + "x" * 50_000_000 + "-tail"
    dl = DataLoader(Squares(8), batch_size=4, num_workers=2)
    seen = []
    with pytest.raises(ValueError) as info:
        with dlwatch.watch(dl, report_dir=str(tmp_path), poll_interval=0.1) as batches:
            for x, _ in batches:
                seen.append(x.tolist())
            raise ValueError(message)
    assert str(info.value) == message and len(seen) == 2  # every batch, and the exception untouched
    info.value.__traceback__ = None
    (path,) = incidents(str(tmp_path))
    exc = load(path)["exception"]
    assert exc["message"].startswith("head-") and exc["message"].endswith("-tail")
    assert len(exc["message"]) < 70_000 and "characters cut here" in exc["message"]
    assert len(exc["traceback"]) < 200_000 and exc["traceback"].rstrip().endswith("-tail")
