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

SECRETS = [
    "hunter2-secret-value",
    "pw-secret-value",
    "tok-3f9a8b7c6d5e4f3a",
    "AKIAIOSFODNN7EXAMPLE",
    "hf_abcdefghijklmnopqrstuvwxyzABCDEF12",
    "argpass-0123456789",
    "env-secret-never-read",
]


def test_no_secret_in_any_file_written(tmp_path, short_tmp):
    args = [
        "--api-token=tok-3f9a8b7c6d5e4f3a",
        "--password",
        "argpass-0123456789",
        "--aws-key",
        "AKIAIOSFODNN7EXAMPLE",
        "hf_abcdefghijklmnopqrstuvwxyzABCDEF12",
        "--data-url=https://bob:pw-secret-value@example.invalid/x",
    ]
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([REPO, TARGETS]),
        MY_SERVICE_SECRET="env-secret-never-read",
        TMPDIR=str(short_tmp),
    )
    out = subprocess.run(
        [sys.executable, os.path.join(TARGETS, "faulty.py"), str(tmp_path / "r"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
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
                assert not [
                    f
                    for f in os.listdir(f"/proc/{monitor.pid}/fd")
                    if os.readlink(f"/proc/{monitor.pid}/fd/{f}").startswith("socket:")
                ]
                for root, dirs, files in os.walk(tmp_path):
                    for d in dirs:
                        assert stat.S_IMODE(os.stat(os.path.join(root, d)).st_mode) == 0o700
                    for name in files:
                        assert stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode) == 0o600, name
                assert {"heartbeat", "events.jsonl", "config.json", "timeline.jsonl"} <= set(
                    os.listdir(batches.run_dir)
                )


# --------------------------------------------------------------------------- attach on a hostile run (issue 9, item 1)

NOBODY = 65534
OTHER = 65533  # a third uid: neither root nor the target's


def _need_two_uids():
    import shutil

    import pytest

    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv: the test switches to a second uid (nobody)")


def _as_nobody(*argv, **kw):
    return ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv]


def _nobody_python() -> tuple[str, str]:
    """An interpreter the second uid can run, spawning the monitor too, and the PYTHONPATH it needs.

    This venv's interpreter may live under a directory only root can enter (pyenv under /root):
    then the system interpreter of the same version runs the same site-packages.
    """
    import shutil
    import sysconfig

    import pytest

    site = sysconfig.get_paths()["purelib"]
    probe = "import subprocess, sys; sys.exit(subprocess.run([sys.executable, '-c', 'import torch, re2, dlwatch']).returncode)"
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for exe in (sys.executable, shutil.which(version, path="/usr/bin:/usr/local/bin:/bin")):
        if not exe:
            continue
        path = os.pathsep.join([site, REPO, TARGETS])
        out = subprocess.run(
            _as_nobody("env", f"PYTHONPATH={path}", exe, "-c", probe), capture_output=True, timeout=120, cwd="/"
        )
        if out.returncode == 0:
            return exe, path
    pytest.skip("no Python interpreter here that the second uid (nobody) can run with torch and dlwatch")


PLANT = r"""
import json, os, sys
run_dir, secret_a, secret_b, secret_c, bait_pid, pb_dir = sys.argv[1:7]
cfg_path = os.path.join(run_dir, "config.json")
cfg = json.load(open(cfg_path))
main_pid = cfg["pid"]
cfg["main_dump_path"] = secret_a                       # a root-only file, outside the run directory
cfg["options"]["playbooks"] = [pb_dir]                 # a playbook directory of the target's user
tmp = cfg_path + ".new"
with open(tmp, "w") as f:
    json.dump(cfg, f)
os.replace(tmp, cfg_path)
workers = [json.loads(l) for l in open(os.path.join(run_dir, "events.jsonl")) if '"worker_registered"' in l]
first, second = workers[0], workers[1]
# worker 0: its dump file replaced by a link to a root-only file (truncate it, copy it into stacks/)
os.unlink(first["dump_path"])
os.symlink(secret_b, first["dump_path"])
# worker 1 stays honest; its dump file already holds text from before: attach must not empty it
with open(second["dump_path"], "a") as f:
    f.write("EARLIER-DUMP-TEXT\n")
# the timeline replaced by a link to a root-only JSONL file
os.replace(os.path.join(run_dir, "timeline.jsonl"), os.path.join(run_dir, "timeline.old"))
os.symlink(secret_c, os.path.join(run_dir, "timeline.jsonl"))
with open(os.path.join(run_dir, "events.jsonl"), "a") as f:
    # an unrelated root process that catches the dump signal, named as a worker
    f.write(json.dumps({"event": "worker_registered", "pid": int(bait_pid), "worker_id": 7,
                        "dump_path": os.path.join(run_dir, "dumps", bait_pid + ".txt")}) + "\n")
print(main_pid, first["pid"], second["pid"])
"""

PLANTED_PLAYBOOK = """
id = "planted"
title = "PLANTED PLAYBOOK LOADED"
[[signals]]
name = "always"
frame = "."
confidence = 1.0
"""

BAIT = r"""
import faulthandler, signal, sys, time
f = open(sys.argv[1], "w")
faulthandler.register(signal.SIGRTMIN + 6, file=f, all_threads=True)
print("READY", flush=True)
time.sleep(120)
"""


def test_attach_as_root_on_a_hostile_run_leaks_and_touches_nothing(tmp_path):
    """nobody runs a watched, hung job and rewrites its run directory; root runs `dlwatch attach`."""
    import shutil
    import tempfile
    import time

    from conftest import kill_session, wait_for

    _need_two_uids()
    shared = tempfile.mkdtemp(prefix="dlwatch-victim-", dir="/tmp")  # the job's report dir, nobody's
    os.chmod(shared, 0o755)
    os.chown(shared, NOBODY, NOBODY)
    secrets = {}
    for name, text in (
        ("a", "ROOT-ONLY-SECRET-A\n" * 50),
        ("b", "ROOT-ONLY-SECRET-B\n" * 50),
        ("c", '{"kind": "sample", "secret": "ROOT-ONLY-SECRET-C"}\n' * 50),
    ):
        path = tmp_path / f"secret-{name}"  # tmp_path is root's, 0700
        path.write_text(text)
        path.chmod(0o600)
        st = os.stat(path)
        secrets[str(path)] = (text, st.st_mtime_ns, st.st_size)
    bait_dump = tmp_path / "bait-dump.txt"
    pb_dir = os.path.join(shared, "pb")
    py, pythonpath = _nobody_python()
    env = dict(os.environ, PYTHONPATH=pythonpath, HOME=shared)
    job = subprocess.Popen(
        _as_nobody(py, os.path.join(TARGETS, "hang.py"), "deadlock", shared, "--stall-timeout", "600"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=shared,
        start_new_session=True,
    )
    bait = subprocess.Popen([sys.executable, "-c", BAIT, str(bait_dump)], stdout=subprocess.PIPE, text=True)
    known: set[int] = set()
    try:
        assert job.stdout.readline().startswith("READY"), job.stderr.read()[-2000:]
        assert bait.stdout.readline().startswith("READY")
        runs = os.path.join(shared, ".runs")
        run_dir = os.path.join(runs, os.listdir(runs)[0])
        events = os.path.join(run_dir, "events.jsonl")
        assert wait_for(lambda: open(events).read().count("worker_registered") >= 2, 30)
        assert wait_for(lambda: os.path.exists(os.path.join(run_dir, "timeline.jsonl")), 30)
        known.update(p.pid for p in psutil.Process(job.pid).children(recursive=True))
        planter = (
            "import os, sys; os.mkdir(sys.argv[1]); "
            "open(os.path.join(sys.argv[1], 'planted.toml'), 'w').write(sys.argv[2])"
        )
        subprocess.run(_as_nobody(py, "-c", planter, pb_dir, PLANTED_PLAYBOOK), check=True, timeout=60)
        out = subprocess.run(
            _as_nobody(py, "-c", PLANT, run_dir, *secrets, str(bait.pid), pb_dir),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        main_pid, linked_worker, honest_worker = map(int, out.stdout.split())
        honest_dump = os.path.join(run_dir, "dumps", f"{honest_worker}.txt")
        time.sleep(0.5)  # the workers sit on the lock

        # root attaches; py-spy disabled, so the stacks come from the faulthandler files: the path
        # that opened, emptied and copied whatever the run directory named
        root_out = tmp_path / "out"
        attach = subprocess.run(
            [sys.executable, "-m", "dlwatch", "attach", str(job.pid), "--out", str(root_out), "--duration", "0.2"],
            capture_output=True,
            text=True,
            timeout=120,
            env=dict(os.environ, PYTHONPATH=REPO, DLWATCH_PY_SPY="", DLWATCH_PLAYBOOKS=""),
        )
        assert attach.returncode == 0, attach.stderr
        incident = os.path.join(root_out, next(n for n in os.listdir(root_out) if not n.startswith(".")))
        report = load(incident)

        # nothing outside was touched: the root-only files keep their content and mtime
        for path, (text, mtime, size) in secrets.items():
            st = os.stat(path)
            assert (open(path).read(), st.st_mtime_ns, st.st_size) == (text, mtime, size), path
        # nothing of them leaked into any file of the report
        for root, _dirs, files in os.walk(root_out):
            for name in files:
                data = open(os.path.join(root, name), "rb").read()
                assert b"ROOT-ONLY-SECRET" not in data, name
        # the unrelated root process got no signal and no stack dump, and is not in the report
        assert bait.poll() is None and os.path.getsize(bait_dump) == 0
        assert bait.pid not in {p["pid"] for p in report["processes"]}
        # the planted playbook directory was not loaded
        assert all(f["playbook"] != "planted" for f in report["findings"])
        notes = "\n".join(report["notes"])
        assert "playbook directories named by the run were not loaded" in notes
        assert "not the target's processes" in notes and str(bait.pid) in notes
        assert "outside its run directory" in notes  # main_dump_path
        assert "timeline.jsonl: a symbolic link (not followed)" in notes
        assert f"dumps/{linked_worker}.txt: a symbolic link (not followed)" in notes
        # the safe path still works: the run was read with nobody's rights, the honest worker's
        # dump came from its own file, which attach did not empty
        assert report["config"]["watched"] is True and report["loader"]["num_workers"] == 2
        by_pid = {p["pid"]: p for p in report["processes"]}
        assert by_pid[honest_worker]["stack"]["source"] == "faulthandler"
        assert open(honest_dump).read().startswith("EARLIER-DUMP-TEXT\n")
        copied = open(os.path.join(incident, "stacks", f"{honest_worker}.txt")).read()
        assert "EARLIER-DUMP-TEXT" not in copied and "most recent call first" in copied
        assert not os.path.exists(os.path.join(incident, "stacks", f"{linked_worker}.txt"))
        assert job.poll() is None  # the target still runs
        # attach wrote nothing in the run directory
        assert not [
            n for n in os.listdir(run_dir) if os.stat(os.path.join(run_dir, n), follow_symlinks=False).st_uid != NOBODY
        ]

    finally:
        kill_session(job.pid, known)
        job.wait(timeout=10)
        bait.kill()
        bait.wait(timeout=10)
        for stream in (job.stdout, job.stderr, bait.stdout):
            stream.close()
        shutil.rmtree(shared, ignore_errors=True)


PTRACER = [
    "setpriv",
    f"--reuid={OTHER}",
    f"--regid={OTHER}",
    "--clear-groups",
    "--inh-caps=+sys_ptrace",
    "--ambient-caps=+sys_ptrace",
]


def test_attach_by_a_ptrace_capable_other_uid_refuses_the_run_dir(tmp_path):
    """A third uid with CAP_SYS_PTRACE (may inspect the job) but no CAP_SETUID: a clear note, still a report."""
    import shutil
    import tempfile

    import pytest

    from conftest import kill_session, wait_for

    _need_two_uids()
    probe = subprocess.Popen(_as_nobody("sleep", "30"))
    try:
        time_ok = wait_for(lambda: open(f"/proc/{probe.pid}/status").read().count("65534") >= 4, 10)
        ls = subprocess.run([*PTRACER, "ls", f"/proc/{probe.pid}/fd"], capture_output=True, text=True, timeout=30)
    finally:
        probe.kill()
        probe.wait()
    if not time_ok or ls.returncode != 0:
        pytest.skip(
            "a uid with ambient CAP_SYS_PTRACE cannot inspect another uid's process here "
            f"({ls.stderr.strip()}); the refusal itself is covered by "
            "test_attach_without_the_right_to_take_the_targets_uid_refuses_the_run_dir"
        )
    py, pythonpath = _nobody_python()
    shared = tempfile.mkdtemp(prefix="dlwatch-victim-", dir="/tmp")
    os.chmod(shared, 0o755)
    os.chown(shared, NOBODY, NOBODY)
    job = subprocess.Popen(
        _as_nobody(py, os.path.join(TARGETS, "hang.py"), "deadlock", shared, "--stall-timeout", "600"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=shared,
        env=dict(os.environ, PYTHONPATH=pythonpath, HOME=shared),
        start_new_session=True,
    )
    known: set[int] = set()
    try:
        assert job.stdout.readline().startswith("READY"), job.stderr.read()[-2000:]
        known.update(p.pid for p in psutil.Process(job.pid).children(recursive=True))
        # a third uid with CAP_SYS_PTRACE (may inspect the job) but no CAP_SETUID (cannot take nobody's
        # rights): attach refuses the run directory with a clear note and still writes a report
        other_out = tmp_path / "other"
        other_out.mkdir()
        os.chown(other_out, OTHER, OTHER)
        os.chmod(tmp_path, 0o711)  # let the third uid reach its output directory
        other = subprocess.run(
            [
                *PTRACER,
                "env",
                f"PYTHONPATH={pythonpath}",
                py,
                "-m",
                "dlwatch",
                "attach",
                str(job.pid),
                "--out",
                str(other_out),
                "--duration",
                "0.2",
                "--no-native",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            cwd="/",
            env=dict(os.environ, DLWATCH_PY_SPY="", DLWATCH_PLAYBOOKS=""),
        )
        assert other.returncode == 0, other.stderr
        report = load(os.path.join(other_out, next(n for n in os.listdir(other_out) if not n.startswith("."))))
        notes = "\n".join(report["notes"])
        assert f"cannot take the target's uid {NOBODY}" in notes and f"Run dlwatch attach as uid {NOBODY}" in notes
        assert report["config"]["watched"] is False and report["events"] == []
    finally:
        kill_session(job.pid, known)
        job.wait(timeout=10)
        for stream in (job.stdout, job.stderr):
            stream.close()
        shutil.rmtree(shared, ignore_errors=True)


def test_run_dir_reader_refuses_links_fifos_foreign_files_and_escapes(tmp_path):
    """Same uid, no helper: the checks themselves (links below the run dir, FIFOs, owner, names)."""
    from dlwatch.collect.rundir import Creds, RunDirReader

    run = tmp_path / "run"
    (run / "dumps").mkdir(parents=True)
    (run / "config.json").write_text("{}")
    (run / "dumps" / "1.txt").write_text("dump")
    os.mkfifo(run / "events.jsonl")
    (run / "heartbeat").symlink_to(run / "config.json")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "2.txt").write_text("outside")
    (run / "linked").symlink_to(tmp_path / "elsewhere")
    me = Creds(os.geteuid(), os.getegid(), ())
    reader = RunDirReader(str(run), me, default_cap=3)
    got = reader.read(
        [
            "config.json",
            "dumps/1.txt",
            "events.jsonl",
            "heartbeat",
            "linked/2.txt",
            "../run/config.json",
            "/etc/passwd",
            "missing",
        ]
    )
    assert got == {"config.json": b"{}", "dumps/1.txt": b"dum"}  # capped at 3 bytes
    text = "\n".join(reader.refusals)
    assert "events.jsonl: not a regular file" in text and "heartbeat: a symbolic link" in text
    assert (
        "linked/2.txt: a symbolic link or a file where a directory belongs" in text
        and "../run/config.json: not a regular file inside" in text
    )
    assert "/etc/passwd: not a regular file inside" in text and "missing" not in text
    if os.geteuid() == 0:
        os.chown(run / "config.json", NOBODY, NOBODY)
        assert RunDirReader(str(run), me).read(["config.json"]) == {}  # not the target's file
        linked_run = tmp_path / "run-link"
        linked_run.symlink_to(run)
        r = RunDirReader(str(linked_run), me)
        assert r.read(["dumps/1.txt"]) == {} and "symbolic link" in r.refusals[0]


def test_attach_without_the_right_to_take_the_targets_uid_refuses_the_run_dir(tmp_path):
    """A uid that may not become the target's (no CAP_SETUID) gets a clear refusal, not a read."""
    import shutil
    import tempfile

    _need_two_uids()
    py, pythonpath = _nobody_python()
    run = tempfile.mkdtemp(prefix="dlwatch-run-", dir="/tmp")
    try:
        with open(os.path.join(run, "config.json"), "w") as f:
            f.write('{"pid": 1}')
        os.chmod(run, 0o755)
        os.chmod(os.path.join(run, "config.json"), 0o644)  # readable by anyone: only the rights decide
        for p in (run, os.path.join(run, "config.json")):
            os.chown(p, NOBODY, NOBODY)
        code = (
            "import sys; from dlwatch.collect.rundir import Creds, RefusedError, RunDirReader\n"
            f"r = RunDirReader(sys.argv[1], Creds({NOBODY}, {NOBODY}, ()))\n"
            "try:\n    print('READ', r.read(['config.json']))\n"
            "except RefusedError as e:\n    print('REFUSED', e)\n"
        )
        out = subprocess.run(
            [
                "setpriv",
                f"--reuid={OTHER}",
                f"--regid={OTHER}",
                "--clear-groups",
                "env",
                f"PYTHONPATH={pythonpath}",
                py,
                "-c",
                code,
                run,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("REFUSED"), out.stdout
        assert f"cannot take the target's uid {NOBODY}" in out.stdout and f"as uid {NOBODY}, or as root" in out.stdout
    finally:
        shutil.rmtree(run, ignore_errors=True)


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
from dlwatch.wire import reportdir  # noqa: E402

NOBODY = 65534


def _can_switch() -> str | None:
    if os.geteuid() != 0:
        return "switching to a second uid needs root"
    if not shutil.which("setpriv"):
        return "setpriv (util-linux) is not installed"
    return None


def as_nobody(script: str, check: bool = True) -> subprocess.CompletedProcess:
    """Run a shell script as the adversary, a second unprivileged uid."""
    return subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=30,
        check=check,
    )


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
    monkeypatch.setattr(reportdir, "_fallback", None)
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
    out = subprocess.run(
        [sys.executable, os.path.join(TARGETS, "faulty.py"), os.path.join(blocker, "reports")],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
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


@pytest.mark.parametrize(
    "trap",
    [
        "owned-by-other",
        "group-writable",
        "symlink-by-other",
        "symlink-to-victim-file",
        "link-above-by-other",
        "link-above-by-other-missing-leaf",
    ],
)
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
    assert "owned by" in note or "writable by group" in note or "symbolic link" in note, note


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
    with pytest.raises(OSError):
        _fs.append_new_or_private(str(link))  # nor does a worker making its dump file
    os.link(victim_file, d / "hard")  # a hard link to another file: nlink 2
    with pytest.raises(OSError):
        _fs.open_private(str(d / "hard"))
    with pytest.raises(OSError):
        _fs.append_new_or_private(str(d / "hard"))
    other = d / "other"
    other.write_text("")
    os.chown(other, NOBODY, NOBODY)
    with pytest.raises(OSError):
        _fs.open_private(str(other))
    with pytest.raises(OSError):
        _fs.append_new_or_private(str(other))
    # an events file checked once is opened plainly after: a link swapped in is still refused
    from dlwatch.wire import events

    ev = d / "ev.jsonl"
    assert events.emit(str(ev), "one")
    os.unlink(ev)
    ev.symlink_to(victim_file)
    assert not events.emit(str(ev), "two")
    assert state(os.path.dirname(victim_file)) == before
    old = os.umask(0o377)  # a new dump file is 0600 whatever the umask: the monitor must read it
    try:
        os.close(_fs.append_new_or_private(str(d / "new.txt")))
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.lstat(d / "new.txt").st_mode) == 0o600
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


def test_atomic_replace_replaces_links_never_follows_them_and_leaves_no_temporary(shared, tmp_path):
    """The one write-temporary-then-rename (figures, metrics, report.html, the kept timeline)."""
    victim_file = os.path.join(shared, "victim", "precious.txt")
    before = state(os.path.dirname(victim_file))
    d = tmp_path / "out"
    d.mkdir(mode=0o700)
    (d / "figures.json").symlink_to(victim_file)  # planted at the final name: the link itself is replaced
    old = os.umask(0)
    try:
        _fs.replace_private(str(d / "figures.json"), b"new")
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        try:
            (d / "report.html").symlink_to(victim_file)
            _fs.replace_private("report.html", b"page", dir_fd=fd)  # the dir_fd variant: a name in that directory
            (d / "busy").mkdir()
            (d / "busy" / "x").write_text("")
            with pytest.raises(OSError):  # rename over a non-empty directory fails: the temporary goes too
                _fs.replace_private("busy", b"lost", dir_fd=fd, fsync=False)
        finally:
            os.close(fd)
    finally:
        os.umask(old)
    assert state(os.path.dirname(victim_file)) == before
    for name, data in (("figures.json", b"new"), ("report.html", b"page")):
        st = os.lstat(d / name)
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and (d / name).read_bytes() == data
    assert sorted(os.listdir(d)) == ["busy", "figures.json", "report.html"]  # no temporary left


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

PLANTED_MODULE = """import os
with open(os.path.join({marker_dir!r}, "RAN-" + __name__ + "-" + str(os.getpid())), "w") as f:
    f.write("planted module ran")
raise SystemExit("planted module ran")
"""

TRAIN = """import json, select, selectors, subprocess, sys  # the program's own imports happen first
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
"""


def test_monitor_imports_nothing_from_cwd_or_dlwatch_parent(shared):
    base = shared
    work = os.path.join(base, "tmp", "work")  # the training job's working directory, writable by others
    pkgroot = os.path.join(base, "tmp", "software")  # where dlwatch was unpacked, writable by others
    markers = os.path.join(base, "markers")
    os.mkdir(markers)
    os.chmod(markers, 0o777)
    as_nobody(f"mkdir -m 777 {work} {pkgroot}")
    shutil.copytree(
        os.path.join(REPO, "dlwatch"), os.path.join(pkgroot, "dlwatch"), ignore=shutil.ignore_patterns("__pycache__")
    )
    shutil.copytree(os.path.join(REPO, "playbooks"), os.path.join(pkgroot, "dlwatch", "_playbooks"))  # as installed
    for d in (work, pkgroot):
        for name in ("select", "json"):
            plant = PLANTED_MODULE.format(marker_dir=markers).replace("'", "'\\''")
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
    # isolated (-I), through the bootstrap (-c); a -W option before them keeps the demo quiet about numpy
    at = argv.index("-I")
    assert argv[0] == sys.executable and argv[at + 1] == "-c"
    assert all(a.startswith("-W") or argv[i] == "-W" for i, a in enumerate(argv[1:at]))
    spec = json.loads(argv[at + 3])
    assert spec["script"] == "/x/examples/deadlock.py" and spec["first"] == ["/x/examples"]
    assert os.getcwd() not in spec["path"]


def test_py_spy_is_never_taken_from_a_relative_path_entry(shared, monkeypatch):
    """A PATH with "" or "." must not make the monitor (or attach, as root) run a planted py-spy."""
    from dlwatch.collect import stacks

    work = os.path.join(shared, "tmp", "work")
    as_nobody(
        f"mkdir -m 777 {work} && printf '#!/bin/sh\\ntouch {work}/RAN\\n' > {work}/py-spy && chmod 755 {work}/py-spy"
    )
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
