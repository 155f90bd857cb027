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


# ---------------------------------------------------------------------------------------------
# Another user on the machine (issue 9).  The adversary is `nobody` through setpriv; the victim
# is this process's uid (root here, as an operator running dlwatch).  The adversary prepares the
# trap; the victim runs dlwatch; nothing outside may be touched, nothing may leak, and the victim
# gets a safe fallback and one clear line.

import hashlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import pytest  # noqa: E402

from dlwatch import _fs  # noqa: E402
from dlwatch.report import build, store  # noqa: E402

NOBODY = 65534


def _can_switch() -> str | None:
    if os.geteuid() != 0:
        return "switching to a second uid needs root"
    if not shutil.which("setpriv"):
        return "setpriv (util-linux) is not installed"
    return None


def as_nobody(script: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a shell script as the adversary, a second unprivileged uid."""
    return subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c", script],
                          capture_output=True, text=True, timeout=30, check=check)


@pytest.fixture
def shared():
    """A sandbox like a cluster node: base/ (the victim's, 0755) with tmp/ (sticky, world-writable like /tmp)."""
    reason = _can_switch()
    if reason:
        pytest.skip(reason)
    base = tempfile.mkdtemp(prefix="dlwatch-sec-", dir="/tmp")
    os.chmod(base, 0o755)
    os.mkdir(os.path.join(base, "tmp"))
    os.chmod(os.path.join(base, "tmp"), 0o1777)
    victim = os.path.join(base, "victim")
    os.mkdir(victim, 0o700)
    with open(os.path.join(victim, "precious.txt"), "w") as f:
        f.write("the victim's own data\n")
    try:
        yield base
    finally:
        shutil.rmtree(base, ignore_errors=True)


def state(path: str) -> dict:
    """Everything under path (links not followed): type, owner, mode, size, mtime, content hash."""
    out = {}
    for root, dirs, files in os.walk(path, followlinks=False):
        for name in [*dirs, *files, "."]:
            p = os.path.normpath(os.path.join(root, name))
            st = os.lstat(p)
            digest = None
            if stat.S_ISREG(st.st_mode):
                with open(p, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[p] = (stat.S_IFMT(st.st_mode), st.st_uid, stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out


def _report(trigger: str = "exception") -> dict:
    report = store.skeleton(trigger=trigger, pid=os.getpid(), now=time.time())
    report["summary"] = "planted"
    return report


@pytest.fixture
def private_fallback(shared, monkeypatch):
    """This process's tempfile dir is the sandbox's shared tmp; no fallback made yet."""
    monkeypatch.setattr(tempfile, "tempdir", os.path.join(shared, "tmp"))
    monkeypatch.setattr(store, "_fallback", None)
    return os.path.join(shared, "tmp")


@pytest.mark.parametrize("trap", ["symlink", "directory"])
def test_predictable_fallback_cannot_be_hijacked(shared, trap):
    """Item 2: the adversary prepares /tmp/dlwatch-reports-<uid>; the victim's report dir fails."""
    tmp = os.path.join(shared, "tmp")
    predictable = os.path.join(tmp, f"dlwatch-reports-{os.getuid()}")
    loot = os.path.join(tmp, "loot")
    if trap == "symlink":
        as_nobody(f"mkdir -m 777 {loot} && ln -s {loot} {predictable}")
    else:
        as_nobody(f"mkdir -m 777 {predictable} && mkdir -m 777 {loot}")
    before = {**state(loot), **state(predictable)}
    blocker = os.path.join(shared, "not-a-dir")
    open(blocker, "w").close()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TARGETS]), TMPDIR=tmp)
    out = subprocess.run([sys.executable, os.path.join(TARGETS, "faulty.py"), os.path.join(blocker, "reports")],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "ValueError: step failed" in out.stderr
    assert {**state(loot), **state(predictable)} == before  # nothing written, nothing truncated, no mtime moved
    warning = [line for line in out.stdout.splitlines() if "report directory" in line]
    assert len(warning) == 1 and "not writable" in warning[0]
    named = warning[0].split("writing reports to ", 1)[1].split("'")[1]
    assert named.startswith(predictable + "-") and os.path.dirname(named) == tmp  # mkdtemp, named in the warning
    st = os.lstat(named)
    assert stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and stat.S_IMODE(st.st_mode) == 0o700
    found = incidents(named)
    assert len(found) == 1 and load(found[0])["trigger"] == "exception"
    # and the adversary cannot read it
    assert as_nobody(f"cat {found[0]}/report.json", check=False).returncode != 0


@pytest.mark.parametrize("trap", ["owned-by-other", "group-writable", "symlink-by-other", "symlink-to-victim-file",
                                  "link-above-by-other", "link-above-by-other-missing-leaf"])
def test_existing_report_dir_is_used_only_when_private(shared, private_fallback, trap):
    """Item 2: an existing report dir is used only when ours and not writable by group or others."""
    tmp = private_fallback
    reports = os.path.join(tmp, "reports")
    victim = os.path.join(shared, "victim")
    if trap == "owned-by-other":
        as_nobody(f"mkdir -m 755 {reports}")  # root could write in it; it must not
    elif trap == "group-writable":
        reports = os.path.join(shared, "reports")
        os.mkdir(reports)
        os.chmod(reports, 0o770)  # ours, but a group member could swap what we write
    elif trap == "symlink-by-other":
        as_nobody(f"ln -s {victim} {reports}")  # points into the victim's private directory
    elif trap == "symlink-to-victim-file":
        as_nobody(f"ln -s {victim}/precious.txt {reports}")
    else:  # a link above the report dir, pointing at the victim's own directory: its owner could re-point it
        as_nobody(f"ln -s {victim} {tmp}/x")
        if trap == "link-above-by-other":
            os.mkdir(os.path.join(victim, "reports"), 0o700)
        reports = os.path.join(tmp, "x", "reports")
    watched = {**state(victim), **state(reports)}
    report = _report()
    path = build.write(report, reports)
    assert {**state(victim), **state(reports)} == watched  # nothing written there or through it
    assert os.path.dirname(path) == store.fallback_dir() and os.path.isfile(os.path.join(path, "report.json"))
    note = next(n for n in report["notes"] if n.startswith("could not write to"))
    assert ("owned by" in note or "writable by group" in note or "symbolic link" in note), note


def test_own_symlink_to_scratch_disk_keeps_working(shared):
    scratch = os.path.join(shared, "scratch")
    os.mkdir(scratch, 0o700)
    link = os.path.join(shared, "reports")
    os.symlink(scratch, link)
    report = _report()
    path = build.write(report, link)
    assert os.path.dirname(os.path.realpath(path)) == scratch and not report["notes"]
    assert os.path.isfile(os.path.join(scratch, os.path.basename(path), "report.json"))


def test_sticky_shared_report_dir_gets_a_private_child(shared):
    tmp = os.path.join(shared, "tmp")
    path = build.write(_report(), tmp)
    child = os.path.dirname(path)
    assert os.path.dirname(child) == tmp and os.path.basename(child).startswith(f"dlwatch-reports-{os.getuid()}-")
    assert stat.S_IMODE(os.stat(child).st_mode) == 0o700
    assert as_nobody(f"ls {child}", check=False).returncode != 0


def test_staging_directory_cannot_be_swapped(shared, tmp_path):
    """A `.tmp-<id>` planted in advance (the old predictable staging name) is never written through."""
    victim = os.path.join(shared, "victim")
    reports = tmp_path / "reports"
    reports.mkdir(mode=0o700)
    report = _report()
    os.symlink(victim, reports / (store.TMP_PREFIX + report["id"]))
    before = state(victim)
    path = build.write(report, str(reports), extra_files={"stacks/1.txt": b"x"})
    assert state(victim) == before and os.path.isfile(os.path.join(path, "stacks", "1.txt"))
    with pytest.raises(OSError):  # an extra file may not climb out of the incident
        store.write_incident(str(reports), _report(), render_markdown=lambda r: "", extra_files={"../x": b"x"})


def test_files_are_created_exclusively_and_never_through_links(shared, tmp_path, monkeypatch):
    victim_file = os.path.join(shared, "victim", "precious.txt")
    before = state(os.path.dirname(victim_file))
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    link = d / "events.jsonl"
    link.symlink_to(victim_file)
    with pytest.raises(OSError):
        _fs.create_private(str(link))
    with pytest.raises(OSError):
        _fs.open_private(str(link))  # appenders never follow a link either
    os.link(victim_file, d / "hard")  # a hard link to another file: nlink 2
    with pytest.raises(OSError):
        _fs.open_private(str(d / "hard"))
    other = d / "other"
    other.write_text("")
    os.chown(other, NOBODY, NOBODY)
    with pytest.raises(OSError):
        _fs.open_private(str(other))
    assert state(os.path.dirname(victim_file)) == before
    # a failed fchmod is an error, and the fd is not leaked
    monkeypatch.setattr(os, "fchmod", lambda fd, mode: (_ for _ in ()).throw(PermissionError(1, "denied")))
    old = os.umask(0o277)
    try:
        with pytest.raises(PermissionError):
            _fs.create_private(str(d / "new"))
        with pytest.raises(PermissionError):
            _fs.make_private_dir(str(d / "a" / "b"))
    finally:
        os.umask(old)


def test_every_created_level_is_0700_whatever_the_umask(tmp_path):
    old = os.umask(0)
    try:
        _fs.make_private_dir(str(tmp_path / "a" / "b" / "c"))
    finally:
        os.umask(old)
    for p in ("a", "a/b", "a/b/c"):
        assert stat.S_IMODE(os.lstat(tmp_path / p).st_mode) == 0o700


def test_incidents_and_write_test_are_0600_under_umask_0(tmp_path, monkeypatch):
    """Item 9: the two files that used to get the umask's mode."""
    modes = {}
    real_unlink = os.unlink

    def unlink(path, *a, **kw):
        if str(path).endswith(".write-test"):
            modes[".write-test"] = stat.S_IMODE(os.lstat(path).st_mode)
        return real_unlink(path, *a, **kw)

    monkeypatch.setattr(os, "unlink", unlink)
    old = os.umask(0)
    try:
        import torch

        # torch.cat where torch.stack was meant: the monitor writes a threshold incident mid-run
        dl = DataLoader([torch.zeros(3, 2) for _ in range(64)], batch_size=4, collate_fn=torch.cat)
        with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.05) as batches:
            monkeypatch.setattr(os, "unlink", real_unlink)
            incidents_file = os.path.join(batches.run_dir, "incidents")
            for _ in batches:
                if os.path.exists(incidents_file):
                    break
                time.sleep(0.05)
            assert wait_for(lambda: os.path.exists(incidents_file), 30)
            modes["incidents"] = stat.S_IMODE(os.lstat(incidents_file).st_mode)
    finally:
        os.umask(old)
    assert modes == {".write-test": 0o600, "incidents": 0o600}


# ---------------------------------------------------------------------------------------------
# Item 3: the monitor imports nothing from the training program's working directory, nor from a
# directory dlwatch itself sits in (which the old code put first on the monitor's PYTHONPATH).

PLANT = '''import os
with open(os.path.join({marker_dir!r}, "RAN-" + __name__ + "-" + str(os.getpid())), "w") as f:
    f.write("planted module ran")
raise SystemExit("planted module ran")
'''

TRAIN = '''import json, select, selectors, subprocess, sys  # the program's own imports happen first
sys.path.insert(0, {pkgroot!r})  # dlwatch from a shared software directory
import dlwatch
assert dlwatch.__file__.startswith({pkgroot!r}), dlwatch.__file__
try:
    with dlwatch.watch(range(10), report_dir={reports!r}, poll_interval=0.05) as batches:
        for i in batches:
            if i == 5:
                raise ValueError("boom")
except ValueError:
    pass
print("DONE", flush=True)
'''


def test_monitor_imports_nothing_from_cwd_or_dlwatch_parent(shared):
    base = shared
    work = os.path.join(base, "tmp", "work")  # the training job's working directory, writable by others
    pkgroot = os.path.join(base, "tmp", "software")  # where dlwatch was unpacked, writable by others
    markers = os.path.join(base, "markers")
    os.mkdir(markers)
    os.chmod(markers, 0o777)
    as_nobody(f"mkdir -m 777 {work} {pkgroot}")
    shutil.copytree(os.path.join(REPO, "dlwatch"), os.path.join(pkgroot, "dlwatch"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(os.path.join(REPO, "playbooks"), os.path.join(pkgroot, "dlwatch", "_playbooks"))  # as installed
    for d in (work, pkgroot):
        for name in ("select", "json"):
            plant = PLANT.format(marker_dir=markers).replace("'", "'\\''")
            as_nobody(f"printf '%s' '{plant}' > {d}/{name}.py")
    # control: the planted modules do run when a Python puts that directory first
    subprocess.run([sys.executable, "-c", "import select"], cwd=work, capture_output=True, timeout=30)
    assert [n for n in os.listdir(markers) if n.startswith("RAN-select")], "the control import did not run the plant"
    for n in os.listdir(markers):
        os.unlink(os.path.join(markers, n))
    prog = os.path.join(base, "train.py")
    reports = os.path.join(base, "reports")
    with open(prog, "w") as f:
        f.write(TRAIN.format(pkgroot=pkgroot, reports=reports))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, prog], cwd=work, env=env, capture_output=True, text=True, timeout=120)
    assert "DONE" in out.stdout, out.stderr
    assert os.listdir(markers) == [], (os.listdir(markers), out.stderr)
    found = incidents(reports)  # the monitor ran (it wrote the exception incident)
    assert len(found) == 1 and load(found[0])["exception"]["message"] == "boom", out.stderr


def test_demo_example_runs_isolated(tmp_path):
    from dlwatch.cli.demo_cmd import _example_argv

    argv = _example_argv("/x/examples/deadlock.py", "/r")
    assert argv[:3] == [sys.executable, "-I", "-c"]
    spec = json.loads(argv[4])
    assert spec["script"] == "/x/examples/deadlock.py" and spec["first"] == ["/x/examples"]
    assert os.getcwd() not in spec["path"]


def test_py_spy_is_never_taken_from_a_relative_path_entry(shared, monkeypatch):
    """A PATH with "" or "." must not make the monitor (or attach, as root) run a planted py-spy."""
    from dlwatch.collect import stacks

    work = os.path.join(shared, "tmp", "work")
    as_nobody(f"mkdir -m 777 {work} && printf '#!/bin/sh\\ntouch {work}/RAN\\n' > {work}/py-spy && chmod 755 {work}/py-spy")
    monkeypatch.chdir(work)
    monkeypatch.delenv("DLWATCH_PY_SPY", raising=False)
    for path in (".", "", f".{os.pathsep}/nonexistent"):
        monkeypatch.setenv("PATH", path)
        if path != "":  # control: a plain PATH lookup would pick the planted one
            assert os.path.realpath(shutil.which("py-spy")) == os.path.join(work, "py-spy")
        found = stacks.find_py_spy()
        assert found is None or os.path.realpath(found) != os.path.join(work, "py-spy"), (path, found)
    monkeypatch.setenv("PATH", ".")
    stacks.dump_stack(os.getpid(), native=False, timeout_s=2)
    assert not os.path.exists(os.path.join(work, "RAN"))
