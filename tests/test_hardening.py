"""Hardening II (issue 18): what a local user could still turn against root, performed for real.

Each exploitable path is attacked with two uids, as a local user would: the victim is root
(running ``dlwatch attach`` or ``dlwatch report``), the adversary is ``nobody`` (the job's
owner).  Helpers for the second uid come from test_security.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import string
import subprocess
import sys
import tempfile
import time

import pytest
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from conftest import REPO, kill_session, run_bounded
from dlwatch._fs import write_json
from dlwatch.redact import redact, redact_argv
from dlwatch.report import build, store
from dlwatch.wire import config, events
from dlwatch.wire.job import rank_info
from test_redact_everywhere import detect_secrets_findings, everything_written, printed_by_attach, warned
from test_security import NOBODY, _as_nobody, _need_two_uids

# --------------------------------------------------------------------------- item 1: attach signals a recycled pid

# nobody's fake "watched job": a Python process that maps a run directory's heartbeat (so attach
# reads that run directory) and names one fake worker, a child that catches the dump signal.
FAKE_JOB = r"""
import faulthandler, json, mmap, os, signal, sys, time
run_dir = sys.argv[1]
os.makedirs(os.path.join(run_dir, "dumps"))
signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the fake worker is reaped the moment it dies: its pid is free
r, w = os.pipe()
worker = os.fork()
if worker == 0:
    f = open(os.path.join(run_dir, "dumps", f"{os.getpid()}.txt"), "w")
    faulthandler.register(signal.SIGRTMIN + 6, file=f, all_threads=True)
    os.write(w, b"x")
    time.sleep(300)
    os._exit(0)
os.read(r, 1)
with open(os.path.join(run_dir, "heartbeat"), "wb") as f:
    f.write(b"\0" * 4096)
hb = open(os.path.join(run_dir, "heartbeat"), "r+b")
m = mmap.mmap(hb.fileno(), 4096)
with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump({"pid": os.getpid()}, f)
with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
    f.write(json.dumps({"event": "worker_registered", "ts": time.time(), "pid": worker, "worker_id": 0,
                        "dump_path": os.path.join(run_dir, "dumps", f"{worker}.txt")}) + "\n")
print("READY", worker, flush=True)
time.sleep(300)
"""

# root's `dlwatch attach`, the real code path, with one hook: right after the helper (nobody's, which
# nobody could SIGSTOP for as long as it takes) has read the worker's dump file, and before the dump
# signal goes out, the fake worker dies and a root process takes its pid.  That is the window the
# attack needs; the hook makes it certain instead of a race.
DRIVER = r'''
import json, os, subprocess, sys, time
if sys.argv[4] == "no-pidfd":
    del os.pidfd_open  # an older kernel or Python: the recheck path
from dlwatch.cli import main
from dlwatch.collect import rundir

job_pid, worker, out = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
victim = []
real_read_one = rundir.RunDirReader.read_one


def take_pid(pid):
    """A root process at exactly ``pid`` (the next pid after ns_last_pid; again when another fork won)."""
    for _ in range(500):
        with open("/proc/sys/kernel/ns_last_pid", "w") as f:
            f.write(str(pid - 1))
        p = subprocess.Popen(["sleep", "120"])
        if p.pid == pid:
            return p
        p.kill()
        p.wait()
    return None


def read_one(self, name):
    data = real_read_one(self, name)
    if name == f"dumps/{worker}.txt" and not victim:
        os.kill(worker, 9)  # as its owner would
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{worker}") and time.monotonic() < deadline:
            time.sleep(0.01)
        victim.append(take_pid(worker))
    return data


rundir.RunDirReader.read_one = read_one
try:
    rc = main(["attach", str(job_pid), "--out", out, "--duration", "0.1", "--no-native", "--json"])
finally:
    v = victim[0] if victim else None
    fate = v.poll() if v is not None else None
    if v is not None:
        v.kill()
        v.wait()
print("RESULT", json.dumps({"rc": rc, "swapped": v is not None, "victim_exit": fate}))
'''


def _can_place_pids() -> None:
    try:
        with open("/proc/sys/kernel/ns_last_pid", "r+") as f:
            f.write(f.read().strip())
    except OSError as exc:
        pytest.skip(f"cannot choose the next pid here (ns_last_pid: {exc.strerror}): the pid swap cannot be staged")


@pytest.mark.parametrize("mode", ["pidfd", "no-pidfd"])
def test_attach_never_signals_a_pid_recycled_by_a_root_process(tmp_path, mode):
    """nobody's fake worker dies between attach's checks and its dump signal; root's `sleep` takes the pid."""
    _need_two_uids()
    _can_place_pids()
    if mode == "pidfd" and not hasattr(os, "pidfd_open"):
        pytest.skip("no os.pidfd_open in this Python or kernel; the no-pidfd case covers the recheck")
    shared = tempfile.mkdtemp(prefix="dlwatch-victim-", dir="/tmp")
    os.chmod(shared, 0o755)
    os.chown(shared, NOBODY, NOBODY)
    run_dir = os.path.join(shared, ".runs", "20260101T000000-1-abcdef")
    os.makedirs(os.path.dirname(run_dir))
    os.chown(os.path.dirname(run_dir), NOBODY, NOBODY)
    job = subprocess.Popen(
        _as_nobody(sys.executable, "-I", "-c", FAKE_JOB, run_dir),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        start_new_session=True,
    )
    try:
        line = job.stdout.readline()
        if not line.startswith("READY"):
            pytest.skip(f"nobody cannot run {sys.executable} here: {job.stderr.read()[-500:]}")
        worker = int(line.split()[1])
        out = tmp_path / "out"
        env = dict(os.environ, PYTHONPATH=REPO, DLWATCH_PY_SPY="", DLWATCH_PLAYBOOKS="")
        rc, stdout, stderr = run_bounded(
            [sys.executable, "-c", DRIVER, str(job.pid), str(worker), str(out), mode],
            env=env,
            cwd=str(tmp_path),
            timeout=120,
        )
        assert rc == 0, stderr[-3000:]
        result = json.loads(stdout[stdout.rindex("RESULT ") + 7 :])
        if not result["swapped"]:
            pytest.skip("no root process could be placed at the worker's pid (other forks kept winning)")
        # the root process holding the recycled pid got no signal: it still ran when attach ended
        assert result["victim_exit"] is None, f"the dump signal reached root's process: {result}"
        report = json.loads(stdout[: stdout.rindex("RESULT ")])
        worker_entry = next(p for p in report["processes"] if p["pid"] == worker)
        notes = "\n".join(report["notes"])
        assert worker_entry["stack"]["source"] == "none"
        if mode == "pidfd":
            assert "no longer exists (not signalled" in worker_entry["stack"]["error"] + notes
        else:
            assert "now belongs to another process" in worker_entry["stack"]["error"] + notes
    finally:
        kill_session(job.pid, set())
        job.wait(timeout=10)
        job.stdout.close()
        job.stderr.close()
        shutil.rmtree(shared, ignore_errors=True)


def test_process_handle_refuses_another_uid_and_a_recycled_pid(monkeypatch):
    """The handle's rules one by one, with real processes: uid mismatch, exit, and the recheck path."""
    from dlwatch.collect import pidhandle

    proc = subprocess.Popen(["sleep", "60"])
    try:
        h = pidhandle.ProcessHandle.open(proc.pid)
        assert h is not None and h.uid == os.geteuid()
        with pytest.raises(pidhandle.RefusedSignal, match="not as the target's uid"):
            h.send(0, uid=os.geteuid() + 1)
        h.send(0, uid=os.geteuid())
        # without a pidfd: the same pid with another start time is refused
        monkeypatch.delattr(os, "pidfd_open")
        g = pidhandle.ProcessHandle.open(proc.pid)
        assert g is not None and not g.is_pidfd
        g.send(0)
        stale = pidhandle.ProcessHandle(pid=proc.pid, uid=g.uid, start=g.start - 1)
        with pytest.raises(pidhandle.RefusedSignal, match="belongs to another process"):
            stale.send(0)
        monkeypatch.undo()
        proc.kill()
        proc.wait()
        with pytest.raises(ProcessLookupError):
            h.send(0)  # the pidfd names the dead process, whatever holds its pid now
        h.close()
        g.close()
    finally:
        proc.kill()
        proc.wait()


# --------------------------------------------------------------------------- item 2: report --html into a swapped directory

SWAP = "import os, sys; os.rename(sys.argv[1], sys.argv[1] + '.moved'); os.symlink(sys.argv[2], sys.argv[1])"

# root's `dlwatch report TARGET --html --force`, the real code path; the hook runs nobody's swap right
# after root has read report.json (summary.json): the window the attack uses, made certain
HTML_DRIVER = r"""
import os, subprocess, sys
from dlwatch.cli import main
from dlwatch.report import store

target, chosen, swap = sys.argv[1], sys.argv[2], sys.argv[3:]
done = []


def hooked(real):
    def load(path, **kw):
        data = real(path, **kw)
        if not done:
            done.append(subprocess.run([*swap, target, chosen], capture_output=True, timeout=60).returncode)
        return data
    return load


store.load_report = hooked(store.load_report)
store.load_summary = hooked(store.load_summary)
rc = main(["report", target, "--html", "--force"])
print("SWAPPED", done)
sys.exit(rc)
"""


def _nobody_owns(path: str) -> None:
    for root, dirs, files in os.walk(path):
        for name in [*dirs, *files]:
            os.chown(os.path.join(root, name), NOBODY, NOBODY, follow_symlinks=False)
    os.chown(path, NOBODY, NOBODY)


@pytest.mark.parametrize("kind", ["incident", "summary"])
def test_report_html_as_root_never_writes_where_the_owner_points(tmp_path, kind):
    """nobody swaps its incident (run summary) directory for a link to a root-only directory after root read it."""
    import time

    from dlwatch.report import store
    from dlwatch.report import summary as sm

    _need_two_uids()
    shared = tempfile.mkdtemp(prefix="dlwatch-victim-", dir="/tmp")  # nobody's report directory
    os.chmod(shared, 0o755)
    try:
        if kind == "incident":
            target = os.path.join(shared, "20260101-000000-exception-1-abcdef")
            os.mkdir(target, 0o755)
            report = store.skeleton(trigger="exception", pid=1, now=time.time())
            with open(os.path.join(target, "report.json"), "w") as f:
                json.dump(report, f)
        else:
            s = sm.skeleton(run_id="20260101T000000-1-abcdef", pid=1, now=time.time())
            target = store.write_summary(os.path.join(shared, "r"), s, render_markdown=sm.render_markdown)
        _nobody_owns(shared)
        chosen = tmp_path / "root-only"  # where nobody wants a root-owned report.html
        chosen.mkdir(mode=0o700)
        private_tmp = tmp_path / "tmp"
        private_tmp.mkdir(mode=0o700)
        env = dict(os.environ, PYTHONPATH=REPO, TMPDIR=str(private_tmp))
        rc, out, err = run_bounded(
            [sys.executable, "-c", HTML_DRIVER, target, str(chosen), *_as_nobody(sys.executable, "-I", "-c", SWAP)],
            env=env,
            cwd=str(tmp_path),
            timeout=120,
        )
        assert "SWAPPED [0]" in out, (out, err)  # the swap happened, as nobody, after the read
        assert os.path.islink(target)
        assert rc == 0, err
        # nothing in the directory nobody chose, nothing written into nobody's own directory either
        assert os.listdir(chosen) == []
        assert not os.path.exists(os.path.join(target + ".moved", "report.html"))
        # the page went to a private file of root's, and the command said so in one line
        page = out.splitlines()[0]
        assert page.startswith(str(private_tmp)) and os.path.getsize(page) > 10_000
        assert os.stat(page).st_uid == 0 and os.stat(page).st_mode & 0o777 == 0o600
        assert os.stat(os.path.dirname(page)).st_mode & 0o777 == 0o700
        assert err.count("\n") == 1 and "is not yours" in err and "private file" in err
    finally:
        shutil.rmtree(shared, ignore_errors=True)


# --------------------------------------------------------------------------- item 5: pruning never crosses a mount

PRUNE_IN_NAMESPACE = r"""
set -e
mount --bind "$DATA" "$OLD1/bound"                      # nobody's data, same filesystem: st_dev alike
mount -t tmpfs -o size=1m dlwatch-test "$OLD2/scratch"  # another filesystem
echo "scratch file" > "$OLD2/scratch/kept.txt"
"$PY" -c 'import sys, logging; logging.basicConfig(); from dlwatch.report import store; print("REMOVED", store.prune_runs(sys.argv[1], 1))' "$REPORTS"
test -f "$OLD2/scratch/kept.txt" && echo "TMPFS KEPT"
ls "$OLD1" "$OLD2"
"""


def test_pruning_never_deletes_files_of_a_bind_mount_inside_an_old_summary(tmp_path):
    """Root's keep_runs prune; nobody's data bind-mounted (and a tmpfs mounted) inside the two oldest summaries."""
    from conftest import in_private_mount_namespace
    from test_prune import run_id, write

    _need_two_uids()
    reports = tmp_path / "reports"
    old1, old2, newest = (write(reports, run_id(i)) for i in range(3))
    os.mkdir(os.path.join(old1, "bound"))
    os.mkdir(os.path.join(old2, "scratch"))
    data = tmp_path / "nobodys-data"  # the second uid's files, which root's prune must not touch
    data.mkdir()
    (data / "sub").mkdir()
    for rel in ("victim.txt", "sub/deeper.txt"):
        (data / rel).write_text("nobody's data\n")
    _nobody_owns(str(data))
    before = sorted((p.relative_to(data), p.read_bytes()) for p in data.rglob("*") if p.is_file())
    env = dict(
        os.environ, PYTHONPATH=REPO, DATA=str(data), OLD1=old1, OLD2=old2, REPORTS=str(reports), PY=sys.executable
    )
    rc, out, err = in_private_mount_namespace(PRUNE_IN_NAMESPACE, env=env, timeout=120)
    if rc != 0 and ("mount" in err and ("denied" in err or "not permitted" in err)):
        pytest.skip(f"cannot mount in a private namespace here: {err.strip()[-300:]}")
    assert rc == 0, err
    # the mounted files are all there, and the tmpfs kept its file while still mounted
    assert sorted((p.relative_to(data), p.read_bytes()) for p in data.rglob("*") if p.is_file()) == before
    assert "TMPFS KEPT" in out
    # the summaries around the mounts went; the mount points stayed (with nothing else), and the
    # newest summary is untouched; the failure to remove them fully is one log line, not an error
    assert "REMOVED []" in out
    assert sorted(os.listdir(old1)) == ["bound"] and sorted(os.listdir(old2)) == ["scratch"]
    assert os.path.isfile(os.path.join(newest, "summary.json"))
    assert "prune_runs_incomplete" in err and "mount point" in err


# --------------------------------------------------------------------------- item 3: the Prometheus textfile directory


def _prom_state():
    from test_prom import _state

    return _state()


def test_prometheus_textfile_dir_of_another_user_is_refused_and_cannot_redirect_root(tmp_path):
    """Root's run writes its textfile into nobody's directory; nobody swaps it for a link to a root-only one."""
    pytest.importorskip("prometheus_client")
    from dlwatch._fs import UnsafeDirError
    from dlwatch.monitor.prom import PromSink

    _need_two_uids()
    shared = tempfile.mkdtemp(prefix="dlwatch-prom-", dir="/tmp")
    os.chmod(shared, 0o755)
    try:
        textdir = os.path.join(shared, "textfile")
        os.mkdir(textdir, 0o755)
        _nobody_owns(shared)
        chosen = tmp_path / "root-only"
        chosen.mkdir(mode=0o700)
        sink, refused = None, ""
        try:  # root's run starts its sink on nobody's directory
            sink = PromSink({"file": os.path.join(textdir, "dlwatch.prom")}, {}, pid=os.getpid())
        except UnsafeDirError as exc:
            refused = str(exc)
        # nobody swaps the directory for a link to a root-only one while the run goes on
        swap = subprocess.run(
            _as_nobody(sys.executable, "-I", "-c", SWAP, textdir, str(chosen)), capture_output=True, timeout=60
        )
        assert swap.returncode == 0 and os.path.islink(textdir)
        landed = []
        if sink is not None:
            try:
                sink.on_poll(_prom_state())  # the next poll's textfile
                landed = os.listdir(chosen)
            finally:
                sink.close(None, clean=False)
        assert landed == [] and os.listdir(chosen) == []  # nothing of root's where nobody pointed
        assert sink is None and "owned by nobody" in refused
        assert os.listdir(chosen) == []
    finally:
        shutil.rmtree(shared, ignore_errors=True)


@pytest.mark.parametrize(
    "owner, mode, ok",
    [
        ("self", 0o700, True),
        ("root", 0o755, True),
        ("self", 0o1777, True),
        ("self", 0o770, False),
        ("self", 0o777, False),
        ("nobody", 0o755, False),
        ("nobody", 0o1777, False),
    ],
)
def test_prometheus_textfile_dir_rules(tmp_path, owner, mode, ok):
    """Yours or root's, not writable by group or others unless sticky; a refusal is one warning, the run goes on."""
    pytest.importorskip("prometheus_client")
    from dlwatch.monitor import outputs

    if owner == "nobody":
        _need_two_uids()
    textdir = tmp_path / "textfile"
    textdir.mkdir()
    if owner == "nobody":
        os.chown(textdir, NOBODY, NOBODY)
    os.chmod(textdir, mode)
    warnings = []
    built = outputs.build(
        {"pid": os.getpid(), "prometheus": {"file": str(textdir / "dlwatch.prom")}},
        str(tmp_path),
        {},
        lambda event, text: warnings.append((event, text)),
    )
    if ok:
        assert [type(s).__name__ for s in built] == ["PromSink"] and warnings == []
        built[0].on_poll(_prom_state())
        assert os.listdir(textdir) == [f"dlwatch.{os.getpid()}.prom"]
        built[0].close(None, clean=True)
    else:
        assert built == [] and len(warnings) == 1 and warnings[0][0] == "prometheus_unavailable"
        assert "UnsafeDirError" in warnings[0][1] and os.listdir(textdir) == []


# --------------------------------------------------------------------------- item 6: bounded playbook loading

PLAYBOOK = 'id = "p{n}"\ntitle = "P {n}"\n[[signals]]\nexception_text = "boom{n}"\nconfidence = 0.5\n'

# the load in a process whose address space is capped well below the file: reading it whole would be
# a MemoryError, not the PlaybookError; no timing involved
LOAD_CAPPED = r"""
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
from dlwatch.errors import PlaybookError
from dlwatch.wire.playbooks import load_playbooks
try:
    load_playbooks([sys.argv[1]])
except PlaybookError as exc:
    print("ERROR", str(exc).splitlines()[0])
"""


def test_a_huge_sparse_playbook_fails_at_once_with_one_line(tmp_path):
    d = tmp_path / "pb"
    d.mkdir()
    (d / "a.toml").write_text(PLAYBOOK.format(n=1))
    with open(d / "huge.toml", "wb") as f:
        f.truncate(3 << 30)  # 3 GiB, sparse: nothing on disk
    rc, out, err = run_bounded(
        [sys.executable, "-c", LOAD_CAPPED, str(d)],
        env=dict(os.environ, PYTHONPATH=REPO),
        cwd=str(tmp_path),
        timeout=120,
    )
    assert rc == 0, err
    assert out.count("\n") == 1 and out.startswith(
        f"ERROR playbook {d / 'huge.toml'}: field '(file)': 3221225472 bytes"
    )
    assert "split it or remove it" in out


def test_a_link_to_a_big_file_or_a_fifo_is_not_read_whole(tmp_path):
    from dlwatch.errors import PlaybookError
    from dlwatch.wire.playbooks import MAX_PLAYBOOK_BYTES, load_dir, load_file

    d = tmp_path / "pb"
    d.mkdir()
    big = tmp_path / "big"
    big.write_bytes(b"#" * (MAX_PLAYBOOK_BYTES + 1))
    os.symlink(big, d / "linked.toml")  # a link to a file: followed, as the loader always did, but capped
    with pytest.raises(PlaybookError, match="linked.toml: field '\\(file\\)': 1048577 bytes"):
        load_dir(d)
    os.unlink(d / "linked.toml")
    os.mkfifo(d / "fifo.toml")  # listed but not a file: skipped by the listing; named directly, refused
    assert load_dir(d) == []
    with pytest.raises(PlaybookError, match="not a regular file"):
        load_file(d / "fifo.toml")
    exact = d / "exact.toml"  # a file of exactly the cap still loads
    text = PLAYBOOK.format(n=2)
    exact.write_text(text + "#" * (MAX_PLAYBOOK_BYTES - len(text)))
    assert [pb.id for pb in load_dir(d)] == ["p2"]


def test_too_many_playbook_files_fail_before_any_is_parsed(tmp_path, monkeypatch):
    from dlwatch.cli import main
    from dlwatch.errors import PlaybookError
    from dlwatch.wire.playbooks import MAX_PLAYBOOK_FILES, load_playbooks

    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    two.mkdir()
    for n in range(MAX_PLAYBOOK_FILES):  # exactly the cap in the first directory: fine
        (one / f"p{n:04d}.toml").write_text(PLAYBOOK.format(n=n))
    assert len(load_playbooks([str(one)])) >= MAX_PLAYBOOK_FILES
    (two / "a-malformed.toml").write_text("id = ")  # parsed first if anything were parsed
    # one more file in all the directories: the count is the error, naming the directory
    with pytest.raises(
        PlaybookError, match=f"field '\\(directory\\)': 1 playbook files; dlwatch reads at most {MAX_PLAYBOOK_FILES}"
    ):
        load_playbooks([str(one), str(two)])
    for n in range(3000):
        (two / f"q{n:04d}.toml").write_text(PLAYBOOK.format(n=n))
    with pytest.raises(PlaybookError) as info:
        load_playbooks([str(two)])
    assert str(two) in str(info.value) and "3001 playbook files" in str(info.value)
    # through the environment: watch() gets one warning and goes on without that directory (the environment
    # fails open, issue 29), `dlwatch playbooks`, where the user checks them, exits 7
    monkeypatch.setenv("DLWATCH_PLAYBOOKS", str(two))
    import dlwatch

    with pytest.warns(dlwatch.DlwatchWarning) as warned:
        w = dlwatch.watch([1, 2, 3])
    (line,) = [str(x.message) for x in warned if "merge or remove some" in str(x.message)]
    assert "\n" not in line and line.startswith(f"dlwatch: DLWATCH_PLAYBOOKS: playbook directory {str(two)!r}")
    assert w.options.enabled
    assert main(["playbooks"]) == 7


# --------------------------------------------------------------------------- item 10: scripts allowed by hash only


def _page_scripts(page: str) -> tuple[str, list[str]]:
    import re

    policy = re.search(r'<meta http-equiv="Content-Security-Policy" content="([^"]*)">', page).group(1)
    return policy, re.findall(r"<script>(.*?)</script>", page, re.S)


def test_the_policy_allows_exactly_the_pages_own_scripts_as_written(tmp_path):
    """No 'unsafe-inline' for scripts; the hashes are those of the two scripts in the file as written
    (the redaction on the way out must not change a byte of them)."""
    import base64
    import hashlib
    import time

    from dlwatch.report import html, store

    report = store.skeleton(trigger="exception", pid=1, now=time.time())
    incident = tmp_path / "inc"
    incident.mkdir(mode=0o700)
    (incident / "report.json").write_text(json.dumps(report))
    page = open(html.write_html(str(incident)), encoding="utf-8").read()
    policy, scripts = _page_scripts(page)
    directives = dict(d.strip().split(" ", 1) for d in policy.split(";"))
    assert directives["default-src"] == "'none'" and "unsafe" not in directives["script-src"]
    assert len(scripts) == 2
    assert directives["script-src"].split() == [
        "'sha256-" + base64.b64encode(hashlib.sha256(s.encode()).digest()).decode() + "'" for s in scripts
    ]


def test_only_the_pages_own_scripts_run_in_headless_chromium(tmp_path):
    """The page draws its charts with no CSP violation; markup injected past the escaping does not run."""
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[test]')"
    )
    from conftest import chromium_path
    from dlwatch.report import html
    from test_html import sampled_report

    browser_path = chromium_path()
    if browser_path is None:
        pytest.skip("no Chromium on this machine (apt-get install chromium)")
    clean = html.render_html(sampled_report())
    injected = clean.replace(
        "<h1>",
        "<script>window.__pwned = 1; document.title = 'PWNED'</script><img src=x onerror=\"window.__pwned = 2\"><h1>",
        1,
    )
    pages = {"clean": clean, "injected": injected}
    seen = {}
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            for name, text in pages.items():
                path = tmp_path / f"{name}.html"
                path.write_text(text)
                messages = []
                tab = browser.new_page()
                tab.on("console", lambda m: messages.append(m.text) if m.type in ("error", "warning") else None)
                tab.on("pageerror", lambda e: messages.append(str(e)))
                tab.goto(f"file://{path}")
                tab.wait_for_function("document.body.getAttribute('data-charts-drawn') !== null", timeout=30_000)
                pwned = tab.evaluate("window.__pwned === undefined ? null : window.__pwned")
                seen[name] = {
                    "messages": messages,
                    "pwned": pwned,
                    "title": tab.title(),
                    "drawn": int(tab.evaluate("document.body.getAttribute('data-charts-drawn')")),
                }
                tab.close()
        finally:
            browser.close()
    assert seen["clean"]["messages"] == [] and seen["clean"]["drawn"] == 5 and seen["clean"]["pwned"] is None
    # the injected script and the inline handler were refused by the policy, the page's own still ran
    assert seen["injected"]["pwned"] is None and seen["injected"]["title"] != "PWNED"
    assert seen["injected"]["drawn"] == 5
    messages = seen["injected"]["messages"]
    assert all("Content Security Policy" in m for m in messages), messages  # nothing else went wrong
    assert any(m.startswith("Executing inline script violates") for m in messages), messages
    assert any(m.startswith("Executing inline event handler violates") for m in messages), messages


# --------------------------------------------------------------------------- item 11: the run bootstrap in other interpreters

SPAWNS_OTHER = r"""
import os, subprocess, sys
other = sys.argv[1]
env = dict(os.environ)
if len(sys.argv) > 2:  # a dlwatch of another location later on the path
    env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + sys.argv[2]
r = subprocess.run([other, "-c", "import sys; print('CHILD RAN', 'dlwatch' in sys.modules)"], env=env,
                   capture_output=True, text=True, timeout=60)
print(r.stdout.strip())
sys.stderr.write(r.stderr)
import torch.utils.data as d
print("HOOKED", getattr(d.DataLoader.__iter__, "_dlwatch_run", False))
"""


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory):
    """The same Python in a fresh virtualenv: dlwatch is not importable there."""
    where = tmp_path_factory.mktemp("bare") / "venv"
    subprocess.run(
        [sys.executable, "-m", "venv", "--without-pip", str(where)], check=True, timeout=120, capture_output=True
    )
    exe = str(where / "bin" / "python")
    probe = subprocess.run(
        [exe, "-c", "import dlwatch"], capture_output=True, cwd="/", env={"PATH": os.environ["PATH"]}, timeout=60
    )
    if probe.returncode == 0:
        pytest.skip("dlwatch is importable even in a fresh virtualenv here")
    return exe


@pytest.mark.parametrize("case", ["no-dlwatch", "another-dlwatch"])
def test_the_run_bootstrap_stays_silent_in_an_interpreter_it_does_not_belong_to(tmp_path, bare_python, case):
    script = tmp_path / "spawns_other.py"
    script.write_text(SPAWNS_OTHER)
    args = [str(script), bare_python]
    if case == "another-dlwatch":
        fake = tmp_path / "elsewhere" / "dlwatch"
        fake.mkdir(parents=True)
        (fake / "__init__.py").write_text("import sys; sys.stderr.write('OTHER DLWATCH IMPORTED\\n')\n")
        args.append(str(fake.parent))
    env = dict(os.environ, PYTHONPATH="")
    env.pop("DLWATCH_DISABLE", None)
    rc, out, err = run_bounded(
        [sys.executable, "-m", "dlwatch", "run", "--report-dir", str(tmp_path / "r"), *args],
        env=env,
        cwd=str(tmp_path),
        timeout=180,
    )
    assert rc == 0, err
    # the other interpreter ran as without dlwatch: nothing imported, nothing printed
    assert "CHILD RAN False" in out
    assert "dlwatch: warning" not in err and "OTHER DLWATCH IMPORTED" not in err, err
    # the program itself, whose interpreter the bootstrap belongs to, is still watched
    assert "HOOKED True" in out


# =========================================================================== Hardening III (issue 29)
# Items 1, 2, 4 and 5: root's attach reads only the target's own source, within one budget; py-spy
# runs under a memory limit, a few at a time; signals check the process's credentials right before
# they go out; one line of terminal output per line; job ids reused by two runs; a bounded listing; a
# stopped monitor and Ctrl-C.  The job's owner (the adversary) is uid 2001; root runs dlwatch.

VICTIM = 2001  # the job's owner: no passwd entry needed
STACK_TARGETS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "stack_targets")
LOCK_JOB = os.path.join(STACK_TARGETS, "lock_source_job.py")
# runs a command and reports its wall time and the peak RSS of it and everything it waited for
MEASURE = (
    "import resource, subprocess, sys, time; t = time.monotonic(); "
    "p = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
    "sys.stdout.write(p.stdout); sys.stderr.write(p.stderr); "
    "print('MEASURED', p.returncode, time.monotonic() - t, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)"
)


def _as_uid(uid, *argv):
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv]


def _python_for(uid: int) -> str:
    """An interpreter ``uid`` can run (the targets need only the standard library)."""
    for exe in (sys.executable, shutil.which("python3", path="/usr/bin:/usr/local/bin:/bin")):
        if exe and subprocess.run(_as_uid(uid, exe, "-c", "pass"), capture_output=True, cwd="/").returncode == 0:
            return exe
    pytest.skip(f"no Python interpreter here that uid {uid} can run")


def _shared_dir(owner: int = VICTIM) -> str:
    d = tempfile.mkdtemp(prefix="dlwatch-h3-", dir="/tmp")
    os.chmod(d, 0o755)
    os.chown(d, owner, owner)
    return d


def _lock_job(report_dir: str, spec: dict, uid: int | None = VICTIM):
    """Start lock_source_job.py (as ``uid``, or as this user with None): (Popen, main pid, worker pid)."""
    argv = [sys.executable if uid is None else _python_for(uid), LOCK_JOB, report_dir, json.dumps(spec)]
    job = subprocess.Popen(
        argv if uid is None else _as_uid(uid, *argv),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        start_new_session=True,
    )
    line = job.stdout.readline()
    if not line.startswith("READY"):
        _stop(job)
        pytest.fail(f"the job did not start: {line} {job.stderr.read()[-2000:]}")
    _, main, worker = line.split()
    # precondition: the worker sits on its lock (state S), as a deadlocked DataLoader worker does
    from conftest import wait_for

    assert wait_for(lambda: _state(int(worker)) == "S", 10), _state(int(worker))
    return job, int(main), int(worker)


def _state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _stop(job) -> None:
    kill_session(job.pid, set())
    job.wait(timeout=10)
    for stream in (job.stdout, job.stderr):
        if stream is not None:
            stream.close()


def _attach(pid: int, out: str, *extra: str, env: dict | None = None) -> tuple[int, str, str, float, int]:
    """Root's real `dlwatch attach` (py-spy on): (rc, stdout, stderr, wall s, peak RSS KiB of it and its children)."""
    env = dict(os.environ, PYTHONPATH=REPO, DLWATCH_PLAYBOOKS="", **(env or {}))
    rc, stdout, stderr = run_bounded(
        [sys.executable, "-c", MEASURE, sys.executable, "-m", "dlwatch", "attach", str(pid), "--out", out, *extra],
        env=env,
        cwd="/",
        timeout=180,
    )
    assert rc == 0, stderr[-3000:]
    line = stdout[stdout.rindex("MEASURED ") :].split()
    return int(line[1]), stdout[: stdout.rindex("MEASURED ")], stderr, float(line[2]), int(line[3])


def _incident(out: str) -> tuple[str, dict]:
    names = [n for n in os.listdir(out) if not n.startswith(".")]
    assert len(names) == 1, names
    with open(os.path.join(out, names[0], "report.json")) as f:
        return os.path.join(out, names[0]), json.load(f)


# --------------------------------------------------------------------------- item 1: the sources root's attach reads

ROOT_ONLY_SOURCE = "import threading\n\n\nwith ROOT_ONLY_LOCK_NAME_7f3a:\n    pass\n"


def test_root_attach_reads_no_root_only_source_and_opens_no_fifo(tmp_path):
    """uid 2001's deadlocked job names, in its worker's stack, a root-only 0600 file (its `with` line at
    the line the job chooses) and a FIFO; its fork record claims a thread sat inside that `with`.

    Before: root parsed the root-only file (owned by root: accepted) and its lock expression reached
    root's report.json/md/html as a lock-held-at-fork finding; the FIFO was opened for reading, which
    released the job's writer blocked on it (a device node is opened the same way)."""
    _need_two_uids()
    shared = _shared_dir()
    private = tempfile.mkdtemp(prefix="dlwatch-h3-root-", dir="/tmp")
    os.chmod(private, 0o755)  # enterable, but the file is root's alone
    secret = os.path.join(private, "rootonly.py")
    with open(secret, "w") as f:
        f.write(ROOT_ONLY_SOURCE)
    os.chmod(secret, 0o600)
    fifo = os.path.join(shared, "pipe.py")
    os.mkfifo(fifo)
    os.chown(fifo, VICTIM, VICTIM)
    spec = {"frames": [[secret, 4], [fifo, 1]], "holder": [[secret, 5]], "fifo_writer": fifo}
    job, main, worker = _lock_job(shared, spec)
    try:
        out = str(tmp_path / "out")
        rc, stdout, _err, _wall, _rss = _attach(main, out, "--duration", "0.3")
        path, report = _incident(out)
        assert report["classification"] == "deadlock", report["classification_reason"]
        for root, _dirs, files in os.walk(out):  # json, md, html, stacks: none holds the root-only line
            for name in files:
                with open(os.path.join(root, name), "rb") as f:
                    assert b"ROOT_ONLY_LOCK_NAME" not in f.read(), name
        assert "ROOT_ONLY_LOCK_NAME" not in stdout
        assert not os.path.exists(fifo + ".opened"), "root's attach opened the job's FIFO"
        assert [f["playbook"] for f in report["findings"]][:1] == ["worker-deadlock"]
        evidence = report["findings"][0]["evidence"]
        assert "owned by uid 0, not by the target's uid 2001" in evidence["holder"], evidence["holder"]
        assert "pipe.py: not a regular file (not opened)" in evidence["holder"], evidence["holder"]
    finally:
        _stop(job)
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(private, ignore_errors=True)


def _big_source(path: str, size: int) -> None:
    line = "a = b + c * d - e\n"
    with open(path, "w") as f:
        f.write(line * (size // len(line)))
    os.chown(path, VICTIM, VICTIM)


def test_root_attach_parses_no_big_source_and_stays_small(tmp_path):
    """uid 2001's worker has 2 frames in 1 MiB files of its own (dense code: a parse tree of hundreds of
    MB each).  Before: root's attach parsed both, kept both trees, and took ~0.65-1.4 GB and 17-20 s
    here.  Now: a file over the per-file cap is refused before it is read, and what is parsed is parsed
    in a child with a memory limit; root's attach stays at its usual size."""
    _need_two_uids()
    from dlwatch.collect.source import MAX_SOURCE_BYTES

    shared = _shared_dir()
    a, b = os.path.join(shared, "a.py"), os.path.join(shared, "b.py")
    _big_source(a, 1 << 20)
    _big_source(b, 1 << 20)
    job, main, _worker = _lock_job(shared, {"frames": [[a, 10], [b, 20]], "holder": [[b, 21]]})
    try:
        out = str(tmp_path / "out")
        _rc, _stdout, _err, _wall, rss_kib = _attach(main, out, "--duration", "0.3")
        _path, report = _incident(out)
        assert report["classification"] == "deadlock"
        holder = report["findings"][0]["evidence"]["holder"]
        assert f"more than the {MAX_SOURCE_BYTES} read of a source file" in holder, holder
        assert rss_kib < 300 << 10, f"root's attach peaked at {rss_kib >> 10} MiB"
    finally:
        _stop(job)
        shutil.rmtree(shared, ignore_errors=True)


OWN_SOURCE = (
    "import threading\n"
    "LOCK = threading.Lock()\n"
    "\n"
    "def __getitem__(i):\n"
    "    with LOCK:\n"
    "        return i\n"
    "\n"
    "def refresh(release):\n"
    "    with LOCK:\n"
    "        release.wait()\n"
)


def test_root_attach_still_names_the_holder_from_the_targets_own_source(tmp_path):
    """The look-alike that must keep working: the job's own dataset file (owned by uid 2001, small),
    read with the job's rights in the reading child: the holder is named, as under the monitor."""
    _need_two_uids()
    shared = _shared_dir()
    src = os.path.join(shared, "dataset.py")
    with open(src, "w") as f:
        f.write(OWN_SOURCE)
    os.chown(src, VICTIM, VICTIM)
    job, main, _worker = _lock_job(shared, {"frames": [[src, 5]], "holder": [[src, 10]]})
    try:
        out = str(tmp_path / "out")
        _attach(main, out, "--duration", "0.3")
        _path, report = _incident(out)
        assert report["findings"][0]["playbook"] == "lock-held-at-fork", report["findings"]
        evidence = report["findings"][0]["evidence"]
        assert evidence["holder_thread"] == "lock-holder" and "`LOCK`" in evidence["lock"], evidence
    finally:
        _stop(job)
        shutil.rmtree(shared, ignore_errors=True)


def test_source_files_are_checked_before_anything_is_opened_and_within_one_budget(tmp_path):
    """open_source's refusals, each before a read (a device node and a FIFO are never opened), and one
    reader's budget of files and bytes; the reader keeps no text, tree or outline once it answered."""
    from dlwatch.collect import source

    me = os.geteuid()
    good = tmp_path / "good.py"
    good.write_text(OWN_SOURCE)
    assert source.open_source(str(good), me) == OWN_SOURCE.encode()
    link = tmp_path / "link.py"
    link.symlink_to(good)
    fifo = tmp_path / "fifo.py"
    os.mkfifo(fifo)
    checks = {str(link): "a symbolic link", str(fifo): "not a regular file (not opened)", "rel.py": "absolute"}
    if me == 0:  # a character device node, made here: refused on its type, never opened
        dev = tmp_path / "dev.py"
        os.mknod(dev, 0o600 | __import__("stat").S_IFCHR, os.makedev(1, 3))
        checks[str(dev)] = "not a regular file (not opened)"
        theirs = tmp_path / "theirs.py"
        theirs.write_text(OWN_SOURCE)
        os.chown(theirs, 12345, 12345)
        checks[str(theirs)] = "owned by uid 12345"
    big = tmp_path / "big.py"
    big.write_text("x = 1\n" * (source.MAX_SOURCE_BYTES // 6 + 1))
    checks[str(big)] = "more than the"
    for path, why in checks.items():
        with pytest.raises(source.Refused, match=re.escape(why)):
            source.open_source(path, me)
    # one reader, one budget: 3 files at most, two files' bytes in all
    budget = source.SourceBudget(files=3, total_bytes=2 * len(OWN_SOURCE) + 10)
    small = []
    for i in range(5):
        p = tmp_path / f"s{i}.py"
        p.write_text(OWN_SOURCE)
        small.append(str(p))
    reader = source.SourceReader(budget=budget)
    got = reader.outlines(small[:2])
    assert got[small[0]] is not None and got[small[0]].site(5) == "LOCK" and got[small[1]] is not None
    assert any(r.expr == "LOCK" and r.start == 9 for r in got[small[0]].regions)
    got = reader.outlines(small[2:])
    assert got[small[2]] is None and "bytes were spent" in reader.refusals[small[2]]  # the bytes are gone
    assert got[small[3]] is None and "budget of 3 files" in reader.refusals[small[3]]
    assert reader.bytes_read == 2 * len(OWN_SOURCE)
    assert set(vars(reader)) == {"creds", "budget", "disabled", "refusals", "files_read", "bytes_read", "seconds_spent"}


# --------------------------------------------------------------------------- item 2: py-spy's memory and numbers

# 60 threads, each 800 frames deep in a function with a 2,000-character name: py-spy builds its whole
# answer (over 100 MB of JSON) before it writes any of it
FLOOD = r"""
import sys, threading, time
sys.setrecursionlimit(5000)
threading.stack_size(32 << 20)
name = "f" * 2000
deep = threading.Semaphore(0)
ns = {"deep": deep}
exec(compile(f"def {name}(n):\n    if n == 0:\n        import time; deep.release(); time.sleep(600)\n    {name}(n - 1)\n",
             "/srv/" + "d" * 200 + ".py", "exec"), ns)
for i in range(60):
    threading.Thread(target=ns[name], args=(800,), daemon=True).start()
for i in range(60):  # every thread at its full depth, however busy the machine
    deep.acquire()
print("READY", flush=True)
time.sleep(600)
"""


def test_py_spy_runs_under_a_memory_limit_and_the_report_says_what_was_cut(tmp_path):
    """A process whose stacks make py-spy's answer huge.  Before: py-spy grew to ~500 MB (911 MB in the
    issue's shape) before its output cap could stop it.  Now: py-spy runs with RLIMIT_DATA, is stopped
    at its limit, and the report's ``truncated`` names the pid."""
    from dlwatch.collect import bounds

    if not shutil.which("py-spy"):
        pytest.skip("py-spy is not installed")
    target = subprocess.Popen([sys.executable, "-c", FLOOD], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert target.stdout.readline().startswith("READY")
        out = str(tmp_path / "out")
        _rc, _stdout, _err, _wall, rss_kib = _attach(target.pid, out, "--duration", "0.2", "--no-native")
        _path, report = _incident(out)
        stack = next(p for p in report["processes"] if p["pid"] == target.pid)["stack"]
        assert rss_kib < (bounds.MAX_PY_SPY_MEMORY_BYTES >> 10) + (128 << 10), f"peak {rss_kib >> 10} MiB"
        if stack.get("memory_cut_bytes") is None and "timed out" in (stack.get("error") or ""):
            # quiet, py-spy reaches its limit in ~0.7 s; a machine that did not lend it the CPU for that
            # within attach's 5 s per process cannot show the cut (the memory bound above still held)
            pytest.skip(f"py-spy did not reach its memory limit within its time here: {stack['error'][:300]}")
        assert stack["source"] == "none" and stack.get("memory_cut_bytes") == bounds.MAX_PY_SPY_MEMORY_BYTES, stack
        assert "memory limit" in stack["error"]
        assert report["truncated"]["py_spy_memory_cut"] == [target.pid]
        assert report["truncated"]["limits"]["py_spy_memory_bytes"] == bounds.MAX_PY_SPY_MEMORY_BYTES
        assert any("py-spy reached its memory limit" in n for n in report["notes"])
    finally:
        _stop(target)


SLEEPER = "import time; print('READY', flush=True); time.sleep(600)"


def test_py_spy_runs_a_machine_sized_number_at_a_time(monkeypatch):
    """Real py-spy on 6 real processes, 2 at a time: never more in flight; the default is sized to
    this machine (two per usable CPU, at most what a quarter of the free memory holds at the limit)."""
    from dlwatch.collect import stacks
    from dlwatch.collect.system import usable_cpus

    if not shutil.which("py-spy"):
        pytest.skip("py-spy is not installed")
    limit = stacks.parallel_limit()
    assert 1 <= limit <= min(32, max(2, int(2 * (usable_cpus()["usable"] or 1))))
    procs = [subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True) for _ in range(6)]
    lock = __import__("threading").Lock()
    flight = {"now": 0, "most": 0}
    real = stacks._run_once

    def counted(*args, **kwargs):
        with lock:
            flight["now"] += 1
            flight["most"] = max(flight["most"], flight["now"])
        try:
            return real(*args, **kwargs)
        finally:
            with lock:
                flight["now"] -= 1

    monkeypatch.setattr(stacks, "_run_once", counted)
    try:
        for p in procs:
            assert p.stdout.readline().startswith("READY")
        got = stacks.dump_stacks([p.pid for p in procs], native=False, timeout_s=10, parallel=2)
        assert all(d.threads for d in got.values()), got
        assert flight["most"] == 2, flight
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


def test_stack_dumps_left_for_lack_of_time_are_named_as_not_run():
    """One py-spy at a time, 8 processes, a short budget: the ones whose turn came after the dumps'
    time (2 x timeout) are not dumped, and say so (``not_run``, one reason)."""
    from dlwatch.collect import stacks

    if not shutil.which("py-spy"):
        pytest.skip("py-spy is not installed")
    procs = [subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=subprocess.PIPE, text=True) for _ in range(8)]
    try:
        for p in procs:
            assert p.stdout.readline().startswith("READY")
        got = stacks.dump_stacks([p.pid for p in procs], native=True, timeout_s=0.05, parallel=1)
        skipped = [d for d in got.values() if d.not_run]
        if not skipped:
            pytest.skip("precondition: py-spy answered 8 processes within 0.1 s here; nothing was left")
        assert skipped[-1].pid == procs[-1].pid  # the queue's tail
        for d in skipped:
            assert d.source == "none" and "1 py-spy at a time on this machine" in d.error and not d.threads
            assert d.to_dict()["not_run"] is True
        done = [d for d in got.values() if not d.not_run]
        assert done and all("not_run" not in d.to_dict() for d in done)
    finally:
        for p in procs:
            p.kill()
            p.wait()
            p.stdout.close()


# --------------------------------------------------------------------------- item 4: the final check before a signal

# uid 2001's fake watched job (as FAKE_JOB above); its worker, once TRIGGER exists, execs a setuid-root
# copy of sleep: same pid, same pidfd, real uid 2001, effective uid 0, no dump handler any more
SETUID_JOB = r"""
import faulthandler, json, mmap, os, signal, sys, time
run_dir, trigger, setuid_sleep = sys.argv[1:4]
os.makedirs(os.path.join(run_dir, "dumps"))
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
r, w = os.pipe()
worker = os.fork()
if worker == 0:
    f = open(os.path.join(run_dir, "dumps", f"{os.getpid()}.txt"), "w")
    faulthandler.register(signal.SIGRTMIN + 6, file=f, all_threads=True)
    os.write(w, b"x")
    while not os.path.exists(trigger):
        time.sleep(0.005)
    os.execv(setuid_sleep, ["sleep", "120"])
os.read(r, 1)
with open(os.path.join(run_dir, "heartbeat"), "wb") as f:
    f.write(b"\0" * 4096)
hb = open(os.path.join(run_dir, "heartbeat"), "r+b")
m = mmap.mmap(hb.fileno(), 4096)
with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump({"pid": os.getpid()}, f)
with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
    f.write(json.dumps({"event": "worker_registered", "ts": time.time(), "pid": worker, "worker_id": 0,
                        "dump_path": os.path.join(run_dir, "dumps", f"{worker}.txt")}) + "\n")
print("READY", worker, flush=True)
time.sleep(300)
"""

# root's real `dlwatch attach`; right after attach has checked the worker (uid, relation, dump handler)
# and read its dump file, and before the signal, the worker execs the setuid program: the hook makes
# the window certain instead of a race
SETUID_DRIVER = r"""
import json, os, sys, time
if sys.argv[5] == "no-pidfd":
    del os.pidfd_open
from dlwatch.cli import main
from dlwatch.collect import rundir

job_pid, worker, out, trigger = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
real_read_one = rundir.RunDirReader.read_one
seen = {}


def euid(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(l.split()[2]) for l in f if l.startswith("Uid:"))


def read_one(self, name):
    data = real_read_one(self, name)
    if name == f"dumps/{worker}.txt" and not seen:
        before = os.stat(f"/proc/{worker}/exe").st_ino
        open(trigger, "w").close()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and os.stat(f"/proc/{worker}/exe").st_ino == before:
            time.sleep(0.005)
        time.sleep(0.05)
        seen["euid"] = euid(worker)
    return data


rundir.RunDirReader.read_one = read_one
rc = main(["attach", str(job_pid), "--out", out, "--duration", "0.1", "--no-native", "--json"])
alive = os.path.exists(f"/proc/{worker}")
print("RESULT", json.dumps({"rc": rc, "euid_after_exec": seen.get("euid"), "alive": alive}))
"""


@pytest.mark.parametrize("mode", ["pidfd", "no-pidfd"])
def test_attach_never_signals_a_worker_that_became_a_setuid_program(tmp_path, mode):
    """Before (with a pidfd): the pidfd still named the process, so root's dump signal killed the
    setuid program uid 2001's worker had exec'd after attach's checks."""
    _need_two_uids()
    if mode == "pidfd" and not hasattr(os, "pidfd_open"):
        pytest.skip("no os.pidfd_open in this Python or kernel; the no-pidfd case covers the recheck")
    shared = _shared_dir()
    tools = tempfile.mkdtemp(prefix="dlwatch-h3-suid-", dir="/tmp")
    os.chmod(tools, 0o755)
    setuid_sleep = os.path.join(tools, "sleep")
    shutil.copy(shutil.which("sleep"), setuid_sleep)
    os.chmod(setuid_sleep, 0o4755)  # root's, setuid
    run_dir = os.path.join(shared, ".runs", "20260101T000000-1-suid01")
    os.makedirs(os.path.dirname(run_dir))
    os.chown(os.path.dirname(run_dir), VICTIM, VICTIM)
    trigger = os.path.join(tools, "go")
    job = subprocess.Popen(
        _as_uid(VICTIM, _python_for(VICTIM), "-I", "-c", SETUID_JOB, run_dir, trigger, setuid_sleep),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd="/",
        start_new_session=True,
    )
    try:
        line = job.stdout.readline()
        assert line.startswith("READY"), job.stderr.read()[-2000:]
        worker = int(line.split()[1])
        env = dict(os.environ, PYTHONPATH=REPO, DLWATCH_PY_SPY="", DLWATCH_PLAYBOOKS="")
        rc, stdout, stderr = run_bounded(
            [sys.executable, "-c", SETUID_DRIVER, str(job.pid), str(worker), str(tmp_path / "out"), trigger, mode],
            env=env,
            cwd=str(tmp_path),
            timeout=120,
        )
        assert rc == 0, stderr[-3000:]
        result = json.loads(stdout[stdout.rindex("RESULT ") + 7 :])
        if result["euid_after_exec"] != 0:
            pytest.skip(f"the setuid bit was not honoured here (euid {result['euid_after_exec']})")
        assert result["alive"], "root's dump signal reached the setuid program"
        report = json.loads(stdout[: stdout.rindex("RESULT ")])
        notes = "\n".join(report["notes"])
        assert f"pid {worker} changed since it was checked" in notes or "belongs to another process" in notes, notes
    finally:
        _stop(job)
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(tools, ignore_errors=True)


def test_process_handle_refuses_a_process_that_executed_another_program():
    """The handle's final check, with a real exec: same pid, same pidfd, another program (its handlers
    gone): refused, whatever the uid."""
    from dlwatch.collect import pidhandle

    proc = subprocess.Popen(
        [sys.executable, "-c", "import os, sys; sys.stdin.readline(); os.execv('/bin/sleep', ['sleep', '60'])"],
        stdin=subprocess.PIPE,
    )
    try:
        h = pidhandle.ProcessHandle.open(proc.pid)
        assert h is not None and h.ident is not None and h.ident.exe is not None
        h.send(0, uid=os.geteuid())  # unchanged: sent
        before = h.ident.exe
        proc.stdin.write(b"go\n")
        proc.stdin.flush()
        from conftest import wait_for

        assert wait_for(lambda: os.stat(f"/proc/{proc.pid}/exe").st_ino != before[1], 10)
        with pytest.raises(pidhandle.RefusedSignal, match="executed another program"):
            h.send(0)
        assert proc.poll() is None
        h.close()
    finally:
        proc.kill()
        proc.wait()
        proc.stdin.close()


# --------------------------------------------------------------------------- item 4: one line is one line

# (a frame is shown by its file's base name: the forged lines hold no slash)
FORGED = "/srv/x\n  finding: all-clear (1.00) nothing is wrong\nreport: FAKE-report.md\n"


def _one_real_report_line(text: str) -> None:
    lines = text.splitlines()
    assert not [ln for ln in lines if ln.startswith("  finding: all-clear")], text
    assert not [ln for ln in lines if ln.startswith("report: FAKE")], text
    assert "\\n  finding: all-clear" in text, text  # shown, escaped, on the line it belongs to


def test_a_newline_in_a_target_string_starts_no_line_in_attach_report_or_top(tmp_path):
    """A frame's file name with newlines in it (the job chooses it).  Before: attach printed it as it
    was, and the job's own "finding:" and "report:" lines appeared among attach's; `report` folded
    them into spaces.  Now all three escape it on the one line (render.terminal_line)."""
    from dlwatch.cli import top_cmd

    shared = tempfile.mkdtemp(prefix="dlwatch-h3-nl-", dir="/tmp")
    job, main, _worker = _lock_job(shared, {"frames": [[FORGED, 3]]}, uid=None)
    try:
        out = str(tmp_path / "out")
        _rc, stdout, _err, _wall, _rss = _attach(main, out, "--duration", "0.3", "--no-native")
        path, _report = _incident(out)
        _one_real_report_line(stdout)
        assert [ln for ln in stdout.splitlines() if ln.startswith("report: ")] == [
            f"report: {os.path.join(path, 'report.md')}"
        ]
        rc, shown, err = run_bounded(
            [sys.executable, "-m", "dlwatch", "report", path],
            env=dict(os.environ, PYTHONPATH=REPO, NO_COLOR="1"),
            cwd=str(tmp_path),
            timeout=60,
        )
        assert rc == 0, err
        _one_real_report_line(shown)
    finally:
        _stop(job)
        shutil.rmtree(shared, ignore_errors=True)
    frame = top_cmd.Frame(rows=[top_cmd.Row(1, "worker 0", "S", FORGED, None, 1, 2, 3, 4, None)], watched=False)
    screen = "\n".join(top_cmd.frame_lines(1, frame, width=200, message=f"wrote {FORGED}"))
    assert not [ln for ln in screen.splitlines() if ln.startswith(("report: FAKE", "  finding: all-clear"))]
    assert "\\nreport: FAKE" in screen


# --------------------------------------------------------------------------- item 5: a reused job id, a big report, a stopped monitor

RANK_INFO = "import json; from dlwatch.wire.job import rank_info; print(json.dumps(rank_info()))"


def _ranks(*ranks: int) -> list[dict]:
    """rank_info() of real processes launched together, one per rank, as a launcher would."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", RANK_INFO],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ, PYTHONPATH=REPO, WORLD_SIZE="2", RANK=str(r), DLWATCH_JOB_ID="job-7"),
        )
        for r in ranks
    ]
    return [json.loads(p.communicate(timeout=60)[0]) for p in procs]


def test_a_reused_job_id_keeps_two_runs_apart(tmp_path):
    """Two unrelated runs with DLWATCH_JOB_ID=job-7: an older one whose rank 1 stalled, a newer one
    whose rank 0 stalled (rank 1 waiting for it).  Before: one job view, "stalled first: rank 1" (the
    older run's).  Now: the newer run is the job; the older is a job of its own, `job-7@<launch>`."""
    import time

    from dlwatch.report import jobview, store
    from test_job import DEADLOCK_FINDING, _stall_report, _write

    old = _ranks(1)
    time.sleep(3)  # more than a launch's spread (2 s): the next run is another launch
    new = _ranks(0, 1)
    launches = [r.get("launched_at") for r in old + new]
    if None not in launches and (launches[1] - launches[0] <= 2.0 or abs(launches[2] - launches[1]) > 2.0):
        pytest.skip(f"precondition: the launches were not apart and together as staged: {launches}")
    rdir = str(tmp_path / "r")
    store.prepare_report_dir(rdir)
    now = time.time()

    def incident(rank_obj, *, waiting, created, last_batch):
        r = _stall_report(
            rank_obj["rank"],
            "job-7",
            main_frames_waiting="collective: all_reduce" if waiting else "queue get",
            classification="main-blocked" if waiting else "deadlock",
            findings=() if waiting else (DEADLOCK_FINDING,),
            last_batch_ts=last_batch,
            created=created,
        )
        r["rank"] = rank_obj
        _write(rdir, r)

    incident(old[0], waiting=False, created=now - 600, last_batch=now - 700)  # the older run: rank 1
    incident(new[0], waiting=False, created=now - 5, last_batch=now - 60)  # the newer run: rank 0 ...
    incident(new[1], waiting=True, created=now - 4, last_batch=now - 50)  # ... and rank 1 waiting for it
    v = jobview.job_view(rdir)
    assert v["job_id"] == "job-7" and v["origin"]["rank"] == 0, v["origin"]
    assert [e["rank"] for e in v["incidents"]] == [0, 1]
    older = [k for k in v["other_jobs"] if k.startswith("job-7@")]
    assert len(older) == 1 and any("used by 2 runs" in n for n in v["notes"]), (v["other_jobs"], v["notes"])
    w = jobview.job_view(rdir, older[0])
    assert w["origin"]["rank"] == 1 and [e["rank"] for e in w["incidents"]] == [1]
    text = "\n".join(jobview.job_lines(v))
    assert "stalled first: rank 0" in text and "stalled first: rank 1" not in text


# `dlwatch report DIR` in a process whose address space is capped far below what loading a 60 MiB
# report.json whole takes (2.7 GB for 64 MiB in the issue): a listing that reads whole files fails
LIST_CAPPED = r"""
import resource, runpy, sys
resource.setrlimit(resource.RLIMIT_AS, (768 << 20, 768 << 20))
sys.argv = ["dlwatch", "report", sys.argv[1]]
runpy.run_module("dlwatch", run_name="__main__")
"""


def test_listing_reads_a_bounded_head_of_each_report(tmp_path):
    from dlwatch.report import build, store
    from test_job import DEADLOCK_FINDING, _stall_report

    rdir = str(tmp_path / "r")
    store.prepare_report_dir(rdir)
    r = _stall_report(0, "j", main_frames_waiting="queue get", classification="deadlock", findings=(DEADLOCK_FINDING,))
    path = build.write(r, rdir)
    with open(os.path.join(path, "report.json")) as f:
        doc = json.load(f)
    # after every key the listing shows: 6 million small objects (about 1.3 GB once parsed)
    with open(os.path.join(path, "report.json"), "w") as f:
        f.write(json.dumps(doc)[:-1] + ', "padding": [' + ", ".join(['{"k": 0}'] * 6_000_000) + "]}")
    size = os.path.getsize(os.path.join(path, "report.json"))
    assert 48 << 20 < size < store.MAX_REPORT_BYTES, size
    rc, out, err = run_bounded(
        [sys.executable, "-c", LIST_CAPPED, rdir], env=dict(os.environ, PYTHONPATH=REPO), cwd=str(tmp_path)
    )
    assert rc == 0, err[-2000:]
    line = next(ln for ln in out.splitlines() if ln.startswith(doc["id"]))
    assert line.split()[1:] == [doc["created_at"], "stall", "worker-deadlock"], line
    head = store.load_report_head(path)
    assert head["_head_only"] is True and "padding" not in head and head["findings"][0]["playbook"] == "worker-deadlock"


INTERRUPTED = os.path.join(os.path.dirname(os.path.abspath(__file__)), "targets", "interrupt.py")


def test_a_stopped_monitor_costs_ctrl_c_no_more_than_its_budget(tmp_path):
    """The monitor is SIGSTOPped; the user presses Ctrl-C after a long wait.  Before: the program took
    30.5-31 s to exit (20 s waiting for an answer that cannot come, then 10 s for a stop that cannot
    happen).  Now it sees the monitor stopped, kills it at exit, and the run summary is still written."""
    import signal
    import time

    import psutil

    from dlwatch.wire import interrupt

    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([REPO, os.path.dirname(INTERRUPTED)]),
        DLWATCH_DIR=str(tmp_path / "r"),
        DLWATCH_STALL_TIMEOUT="8",
        DLWATCH_BODY_TIMEOUT="8",
    )
    proc = subprocess.Popen(
        [sys.executable, INTERRUPTED, "plain", "body"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        for line in proc.stdout:
            if line.startswith("READY"):
                break
        monitors = [c for c in psutil.Process(proc.pid).children() if "dlwatch.monitor.loop" in " ".join(c.cmdline())]
        assert len(monitors) == 1
        time.sleep(3)  # past a quarter of the 8 s allowance: the Ctrl-C is worth an interrupt incident
        os.kill(monitors[0].pid, signal.SIGSTOP)
        pressed = time.monotonic()
        os.killpg(proc.pid, signal.SIGINT)
        _out, err = proc.communicate(timeout=90)
        took = time.monotonic() - pressed
        assert proc.returncode == -signal.SIGINT, err
        assert took < interrupt.ACK_TIMEOUT_S, f"Ctrl-C took {took:.1f} s with the monitor stopped"
        assert "monitor is stopped (SIGSTOP) and cannot stop; killed it" in err, err
        runs = os.listdir(tmp_path / "r" / "runs")
        with open(tmp_path / "r" / "runs" / runs[0] / "summary.json") as f:
            assert json.load(f)["ended"] == "interrupted"
    finally:
        kill_session(proc.pid, set())
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()


# =========================================================================== Hardening III (issue 29): items 3, 6, 7
# Each section below performs one attack of the review for real; on the code before the
# change, each test fails.  (The other items of issue 29 have sections of their own.)

# --------------------------------------------------------------------------- issue 29 item 3: entry points and the cwd

# A module planted in the working directory: it leaves a marker (the uid it ran as), then loads the
# real module in its place, so the program that imported it still works and every later import of
# the same run is seen too.
PLANTED_SHIM = """
import sys as _s, os as _o
with open({marks!r} + "/" + __name__, "w") as _f:
    _f.write(str(_o.getuid()))
import importlib.machinery as _m, importlib.util as _u
_here = _o.path.dirname(_o.path.abspath(__file__))
_spec = _m.PathFinder.find_spec(__name__, [p for p in _s.path if p and _o.path.abspath(p) != _here])
if _spec is None:
    raise ModuleNotFoundError("No module named %r" % __name__, name=__name__)
_mod = _u.module_from_spec(_spec)
_s.modules[__name__] = _mod
_spec.loader.exec_module(_mod)
"""


# dlwatch's dependencies, required and optional (pyproject.toml), by the names they are imported as
DLWATCH_DEPENDENCIES = ("psutil", "structlog", "re2", "_re2", "pynvml", "tomli", "prometheus_client")


def _startup_modules() -> set[str]:
    """What this Python has imported before it runs any program: imported before the working directory
    is on the path, so a file there can never stand in for them."""
    out = subprocess.run(
        [sys.executable, "-c", "import sys; print(' '.join(sys.modules))"],
        capture_output=True,
        text=True,
        cwd="/",
        timeout=60,
    )
    return set(out.stdout.split())


def plant_every_module(directory, marks) -> set[str]:
    """A shim for every standard-library module and every dependency of dlwatch, in ``directory``,
    owned by the second uid where the test may hand files over (the job owner planted them)."""
    names = (set(sys.stdlib_module_names) | set(DLWATCH_DEPENDENCIES)) - (
        _startup_modules() | set(sys.builtin_module_names) | {"__main__", "sitecustomize", "usercustomize"}
    )
    os.makedirs(marks, exist_ok=True)
    os.chmod(marks, 0o1777)  # the shims run as whoever imports them
    for name in names:
        path = os.path.join(directory, name + ".py")
        with open(path, "w") as f:
            f.write(PLANTED_SHIM.format(marks=str(marks)))
        if os.geteuid() == 0:
            os.chown(path, NOBODY, NOBODY)
    return names


def planted_that_ran(marks) -> set[str]:
    return set(os.listdir(marks))


def _clear(marks) -> None:
    for name in os.listdir(marks):
        os.unlink(os.path.join(marks, name))


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_")}
    env["PYTHONPATH"] = REPO  # this tree's dlwatch, whatever the environment has installed
    env.update(extra)
    return env


def test_python_m_dlwatch_imports_nothing_from_the_working_directory(tmp_path):
    """Item 3: root runs ``python -m dlwatch VERB`` in a job owner's directory where a module stands in for
    every standard-library module and every dependency.  None of them may run, for any verb: before,
    ``typing``, ``json``, ``argparse``, ``subprocess``, ``re2`` ... ran as root from there."""
    job = tmp_path / "owner-dir"
    job.mkdir()
    marks = tmp_path / "marks"
    planted = plant_every_module(str(job), str(marks))
    if os.geteuid() == 0:
        os.chown(job, NOBODY, NOBODY)
    assert {"json", "typing", "argparse", "subprocess", "re2", "psutil"} <= planted
    (tmp_path / "reports").mkdir(mode=0o700)
    prog = tmp_path / "prog.py"
    prog.write_text("print('program ran')\n")
    target = subprocess.Popen(
        [sys.executable, "-c", "import time; print('READY', flush=True); time.sleep(120)"],
        stdout=subprocess.PIPE,
        text=True,
        cwd="/",
        start_new_session=True,
    )
    try:
        assert target.stdout.readline().strip() == "READY"
        # the shims are live: a plain python in that directory runs them
        subprocess.run([sys.executable, "-c", "import json, argparse"], cwd=str(job), timeout=60, check=True)
        assert {"json", "argparse"} <= planted_that_ran(str(marks))
        _clear(str(marks))
        out = str(tmp_path / "reports")
        verbs = {
            "--version": ["--version"],
            "playbooks": ["playbooks"],
            "report": ["report", "--dir", out],
            "attach": ["attach", str(target.pid), "--no-native", "--duration", "0.2", "--out", out],
            "top": ["top", str(target.pid), "--once", "--out", out],
            "demo --list": ["demo", "--list"],
            "run": ["run", "--report-dir", out, str(prog)],
        }
        ran = {}
        for verb, args in verbs.items():
            rc, stdout, err = run_bounded(
                [sys.executable, "-m", "dlwatch", *args], env=_cli_env(), cwd=str(job), timeout=120
            )
            assert rc in (0, 4), (verb, rc, err[-2000:])  # 4: attach/top on a process dlwatch does not watch
            ran[verb] = sorted(planted_that_ran(str(marks)))
            _clear(str(marks))
        assert "program ran" in stdout  # the last verb, run: the program did run
        assert ran == {verb: [] for verb in verbs}, ran
    finally:
        kill_session(target.pid, set())
        target.stdout.close()
        target.wait()


JOB_MODULE = """
import sys
import torch
from torch.utils.data import DataLoader, Dataset


class Lazy(Dataset):
    \"\"\"Imports the program's own modules from the working directory lazily, as datasets do.\"\"\"

    def __len__(self):
        return 4

    def __getitem__(self, i):
        import jobhelper  # first imported here, under dlwatch's iteration (0 workers: the main process)

        if torch.utils.data.get_worker_info() is not None:
            import jobpayload  # only in the worker: torch imports it in the main process to unpickle a batch

            return jobpayload.Payload(jobhelper.double(i))
        return jobhelper.double(i)


def collate(items):
    return items


seen = []
for workers in (0, 2):
    loader = DataLoader(Lazy(), batch_size=2, num_workers=workers, collate_fn=collate,
                        multiprocessing_context="fork" if workers else None)
    for batch in loader:
        seen.append([getattr(x, "value", x) for x in batch])
print("JOB", seen, type(batch[0]).__module__, sys.path[0] == __import__("os").getcwd(), flush=True)
"""


@pytest.mark.timeout(300)
def test_dlwatch_run_m_imports_nothing_planted_that_bare_python_m_does_not(tmp_path):
    """Item 3: in a world-writable directory where another user planted a module for every standard-library
    module and every dependency, root runs a job with ``python -m job``, ``dlwatch run -m job`` and
    ``python -m dlwatch run -m job``.  Under dlwatch, nothing planted may run that the bare job does not
    run itself (before: ``re2``, ``resource``, ``tomllib``, imported by dlwatch's watch inside the program);
    the job's own lazy imports from that directory (in its dataset, and torch unpickling a batch whose
    class lives there) still work, and the job is watched."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: anyone may leave a file
    marks = tmp_path / "marks"
    plant_every_module(str(shared), str(marks))
    (shared / "job.py").write_text(JOB_MODULE)
    (shared / "jobhelper.py").write_text("def double(i):\n    return 2 * i\n")
    (shared / "jobpayload.py").write_text(
        "class Payload:\n    def __init__(self, value):\n        self.value = value\n"
    )
    reports = tmp_path / "reports"
    env = _cli_env(DLWATCH_DIR=str(reports))
    dlwatch_cmd = os.path.join(os.path.dirname(sys.executable), "dlwatch")
    forms = {
        "bare": [sys.executable, "-m", "job"],
        "dlwatch run -m": [dlwatch_cmd, "run", "-m", "job"],
        "python -m dlwatch run -m": [sys.executable, "-m", "dlwatch", "run", "-m", "job"],
    }
    ran, out = {}, {}
    for form, argv in forms.items():
        rc, stdout, err = run_bounded(argv, env=env, cwd=str(shared), timeout=240)
        assert rc == 0, (form, err[-3000:])
        out[form] = [line for line in stdout.splitlines() if line.startswith("JOB ")]
        ran[form] = planted_that_ran(str(marks))
        _clear(str(marks))
    assert out["bare"] == ["JOB [[0, 2], [4, 6], [0, 2], [4, 6]] jobpayload True"], out
    assert ran["bare"], "the planted modules never ran: the test would prove nothing"
    for form in ("dlwatch run -m", "python -m dlwatch run -m"):
        assert out[form] == out["bare"], (form, out)  # the program saw what bare python -m gives it
        assert ran[form] <= ran["bare"], (form, sorted(ran[form] - ran["bare"]))
        assert "re2" not in ran[form]
    assert len(os.listdir(reports / "runs")) >= 2  # both dlwatch runs watched the job


# --------------------------------------------------------------------------- issue 29 item 6: fail open on the environment

# Every DLWATCH_* variable dlwatch reads, each set to a bad or hostile value (DLWATCH_DIR aside: it names the
# report directory the test reads; a directory that cannot be used falls back, see test_security).  "{...}"
# values are filled in by the test.  The first nine are checked: each gets exactly one warning and its default.
BAD_ENVIRONMENT = {
    "DLWATCH_POLL_INTERVAL": "nan",
    "DLWATCH_STALL_TIMEOUT": "soon --password hunter2-0123456789",  # a secret in a bad value: the warning masks it
    "DLWATCH_BODY_TIMEOUT": "-1",
    "DLWATCH_KEEP_RUNS": "lots",
    "DLWATCH_ENABLED": "maybe",
    "DLWATCH_IGNORE": "no-such-playbook,Not An Id!,rng-duplication",
    "DLWATCH_PLAYBOOKS": "{missing}" + os.pathsep + "{malformed}",
    "DLWATCH_PROM_PORT": "abc",
    "DLWATCH_PROM_FILE": "{missing}/metrics.prom",
    # read as text or as a yes/no word: any value is valid, a hostile one must not stop the program either
    "DLWATCH_JOB_ID": "job\nwith a newline/../../and more",
    "DLWATCH_PROGRAM_RUN": "../../run\nid",
    "DLWATCH_PY_SPY": "/nonexistent/py-spy",
    "DLWATCH_HTML": "perhaps",
    "DLWATCH_QUIET": "perhaps",
    "DLWATCH_DISABLE": "perhaps",
    "DLWATCH_RUN_PACKAGE": "/nonexistent",
}
WARNED = {
    "DLWATCH_POLL_INTERVAL": "DLWATCH_POLL_INTERVAL='nan' is ignored: ",
    "DLWATCH_STALL_TIMEOUT": "DLWATCH_STALL_TIMEOUT='soon --password ***' is ignored: ",
    "DLWATCH_BODY_TIMEOUT": "DLWATCH_BODY_TIMEOUT='-1' is ignored: ",
    "DLWATCH_KEEP_RUNS": "DLWATCH_KEEP_RUNS='lots' is ignored: ",
    "DLWATCH_ENABLED": "DLWATCH_ENABLED='maybe' is ignored: ",
    "DLWATCH_IGNORE": "DLWATCH_IGNORE names no known playbook: no-such-playbook ",
    "DLWATCH_IGNORE entry": "DLWATCH_IGNORE: ignore entry 'Not' is not a playbook id",
    "DLWATCH_PLAYBOOKS": "DLWATCH_PLAYBOOKS: playbook directory '{missing}' does not exist",
    "DLWATCH_PLAYBOOKS malformed": "DLWATCH_PLAYBOOKS: playbook directory '{malformed}' is ignored: playbook ",
    "DLWATCH_PROM_PORT": "DLWATCH_PROM_PORT must be a TCP port number (1-65535), got 'abc'",
    "DLWATCH_PROM_FILE": "DLWATCH_PROM_FILE: directory '{missing}' does not exist",
}
BAD_ENV_PROGRAM = """
import json, sys
from torch.utils.data import DataLoader
dl = DataLoader(list(range(6)), batch_size=3, num_workers=1)
if sys.argv[1] == "watch":
    import dlwatch
    for epoch in range(2):  # two watches: each warning still comes once
        with dlwatch.watch(dl) as batches:
            print("BATCHES", [b.tolist() for b in batches], flush=True)
    w = dlwatch.watch(dl)
    print("OPTIONS", json.dumps({**w.options.to_dict(), "prometheus": w._settings.prometheus}), flush=True)
else:
    for epoch in range(2):
        print("BATCHES", [b.tolist() for b in dl], flush=True)
"""


def _bad_environment(tmp_path) -> tuple[dict[str, str], dict[str, str]]:
    malformed = tmp_path / "malformed"
    malformed.mkdir()
    (malformed / "bad.toml").write_text('id = "x"\ntitle = "t"\n[[signals]]\nexception_text = "("\nconfidence = 0.5\n')
    fill = {"missing": str(tmp_path / "missing"), "malformed": str(malformed)}
    env = {k: v.format(**fill) for k, v in BAD_ENVIRONMENT.items()}
    return env, {k: v.format(**fill) for k, v in WARNED.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("form", ["watch", "dlwatch run"])
def test_bad_environment_values_warn_once_and_the_program_runs(tmp_path, form):
    """Item 6: with every DLWATCH_* variable set to a bad or hostile value (as an environment set for a whole
    cluster may be), the program runs as bare: same batches, exit code 0, and each bad value is one warning
    (redacted) and its default.  Before, the first of them raised into the program under watch(), and
    stopped `dlwatch run` before the program started."""
    script = tmp_path / "prog.py"
    script.write_text(BAD_ENV_PROGRAM)
    bad, warned = _bad_environment(tmp_path)
    reports = tmp_path / "reports"
    clean = _cli_env(DLWATCH_DIR=str(reports))
    rc, bare_out, bare_err = run_bounded(
        [sys.executable, str(script), "bare"], env=clean, cwd=str(tmp_path), timeout=120
    )
    assert rc == 0, bare_err
    if form == "watch":
        argv = [sys.executable, str(script), "watch"]
    else:
        argv = [sys.executable, "-m", "dlwatch", "run", str(script), "bare"]
    rc, out, err = run_bounded(argv, env={**clean, **bad}, cwd=str(tmp_path), timeout=240)
    assert rc == 0, err[-3000:]
    batches = [line for line in out.splitlines() if line.startswith("BATCHES")]
    assert batches == [line for line in bare_out.splitlines() if line.startswith("BATCHES")], out
    assert "Traceback" not in err, err[-3000:]
    for name, line in warned.items():
        assert err.count("DlwatchWarning: dlwatch: " + line) == 1, (name, line, err[-4000:])
    assert "hunter2-0123456789" not in err + out
    if form == "watch":
        (options,) = [line for line in out.splitlines() if line.startswith("OPTIONS")]
        got = json.loads(options[len("OPTIONS ") :])
        assert got["poll_interval"] == 1.0 and got["stall_timeout"] is None and got["body_timeout"] is None
        assert got["keep_runs"] == 200 and got["enabled"] is True and got["ignore"] == ["rng-duplication"]
        assert got["playbooks"] == [bad["DLWATCH_PLAYBOOKS"].split(os.pathsep)[1]]  # kept: its error is a warning
        assert got["prometheus"] == {"file": None, "port": None}
    # watched, with the defaults: a run summary per watch (two), or one for the program under dlwatch run
    assert len(os.listdir(reports / "runs")) == (2 if form == "watch" else 1)


def test_a_bad_argument_still_raises_as_a_bad_dataloader_argument_does(tmp_path, monkeypatch):
    """Item 6, the other half: what the program's own code (or `dlwatch run`'s user) passes explicitly is
    checked at the call; the environment's value of the same option does not make it pass."""
    import dlwatch
    from dlwatch.errors import PlaybookError

    bad, _ = _bad_environment(tmp_path)
    for name, value in bad.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DLWATCH_DISABLE")
    for kwargs, kind in [
        ({"poll_interval": float("nan")}, ValueError),
        ({"stall_timeout": "soon"}, ValueError),
        ({"keep_runs": "lots"}, ValueError),
        ({"enabled": "maybe"}, TypeError),
        ({"ignore": ["no-such-playbook"]}, ValueError),
        ({"playbooks": [str(tmp_path / "missing")]}, ValueError),
        ({"playbooks": [str(tmp_path / "malformed")]}, PlaybookError),
    ]:
        with pytest.raises(kind):
            dlwatch.watch([1, 2], report_dir=tmp_path / "r", **kwargs)
    assert not (tmp_path / "r").exists()  # nothing started
    (tmp_path / "prog.py").write_text("print('ran')\n")
    rc, out, err = run_bounded(
        [sys.executable, "-m", "dlwatch", "run", "--poll-interval", "nan", "prog.py"],
        env=_cli_env(),
        cwd=str(tmp_path),
        timeout=60,
    )
    assert (
        rc == 2
        and err.startswith("dlwatch: error: poll_interval must be a finite number")
        and "(--poll-interval)" in err
    )


DELETED_CWD_PROGRAM = """
import os, sys
try:
    os.getcwd()
    where = "cwd exists"
except OSError as exc:
    where = f"cwd gone ({type(exc).__name__})"
print("PROGRAM", sys.argv[1:], where, flush=True)
"""


@pytest.mark.parametrize("form", ["dlwatch", "python -m dlwatch"])
def test_dlwatch_run_in_a_removed_working_directory_runs_the_program_as_bare(tmp_path, form):
    """Item 6: `dlwatch run /abs/script.py` from a working directory that was removed (DLWATCH_DIR unset)
    runs the program as `python /abs/script.py` does.  Before: a FileNotFoundError traceback, exit code 1,
    the program never started."""
    script = tmp_path / "prog.py"
    script.write_text(DELETED_CWD_PROGRAM)
    gone = tmp_path / "gone"
    dlwatch_cmd = (
        [os.path.join(os.path.dirname(sys.executable), "dlwatch")]
        if form == "dlwatch"
        else [sys.executable, "-m", "dlwatch"]
    )
    results = []
    for argv in ([sys.executable, str(script), "a", "b"], [*dlwatch_cmd, "run", str(script), "a", "b"]):
        gone.mkdir()
        results.append(
            run_bounded(
                ["sh", "-c", 'cd "$1" && rmdir "$1" && shift && exec "$@"', "sh", str(gone), *argv],
                env=_cli_env(),
                cwd=str(tmp_path),
                timeout=120,
            )
        )
    bare, run = results
    assert bare == (0, "PROGRAM ['a', 'b'] cwd gone (FileNotFoundError)\n", ""), bare
    assert run == bare, run


# --------------------------------------------------------------------------- issue 29 item 7: six real-world secret shapes

_ALNUM = string.ascii_letters + string.digits
_HEX = "0123456789abcdef"
SECRET_BODY = st.text(_ALNUM, min_size=20, max_size=40)
AZURE_KEY = st.text(_ALNUM + "+/", min_size=40, max_size=86)  # an account key is 88 base64 characters, "==" last
DIGEST = st.sampled_from([32, 40, 64, 128]).flatmap(lambda n: st.text(_HEX, min_size=n, max_size=n))
WANDB_KEY = st.text(_HEX, min_size=40, max_size=40)
# a URL password holding "@" and then "/" (the review's leak showed what followed the first "@")
URL_PASSWORD = st.tuples(*[st.text(_ALNUM, min_size=8, max_size=16)] * 3).map(lambda t: f"{t[0]}@{t[1]}/{t[2]}")

# (template, body): "{s}" is where the body goes; each as the review met it
SHAPES_29 = {
    "azure-account-key": (
        "DefaultEndpointsProtocol=https;AccountName=acct;AccountKey={s}==;EndpointSuffix=core.windows.net",
        AZURE_KEY,
    ),
    "curl-user": ("curl -s -u alice:{s} https://example.invalid/data", SECRET_BODY),
    "sshpass": ("sshpass -p {s} ssh -p 2222 build@example.invalid", SECRET_BODY),
    "digest-response": (
        'Authorization: Digest username="alice", realm="data", nonce="abc", uri="/x", response="{s}", opaque="o"',
        DIGEST,
    ),
    "url-password-at-slash": ("postgresql://alice:{s}@db.example.invalid:5432/train", URL_PASSWORD),
    "wandb-after-name": ('os.environ["WANDB_API_KEY"] = "{s}"', WANDB_KEY),
    "wandb-login": ("wandb login --relogin {s}", WANDB_KEY),
}


def secret_parts(body: str) -> list[str]:
    """What must appear nowhere: the body, and each piece of a URL password between its "@" and "/"."""
    return [body, *(p for p in re.split(r"[@/]", body) if len(p) >= 8 and p != body)]


def _plant_argv(d: str, report: dict, text: str) -> None:
    argv = ["python", "train.py", "--hook", text, *text.split(" ")]  # one element, and as a shell splits it
    write_json(os.path.join(d, "run", "config.json"), {"argv": redact_argv(argv)})  # as the watch writes it
    report["processes"].append(build.process_entry(1, "main", name="python", cmdline=argv))  # as read from /proc


def _plant_env(d: str, report: dict, text: str) -> str:
    report["rank"] = rank_info({"DLWATCH_JOB_ID": text, "RANK": "0", "WORLD_SIZE": "2"})
    problems = config.resolve(environ={"DLWATCH_STALL_TIMEOUT": text}).problems  # a bad value: warned about
    return warned_text(problems[0])


def _plant_exception(d: str, report: dict, text: str) -> str:
    report["exception"] = {"type": "builtins.ValueError", "message": text, "traceback": f"  line 3\n    {text}\n"}
    events.emit(os.path.join(d, "run", "events.jsonl"), "exception", text=text)
    return ""


def _plant_warning(d: str, report: dict, text: str) -> str:
    return warned_text(text)


def _plant_dataset_repr(d: str, report: dict, text: str) -> str:
    report["loader"] = {"dataset": f"Planted({text})", "num_workers": 2}
    write_json(os.path.join(d, "run", "loader.json"), {"loader": {"dataset": f"Planted({text})"}})
    return ""


CHANNELS_29 = {
    "argv": _plant_argv,
    "env": _plant_env,
    "exception": _plant_exception,
    "warning": _plant_warning,
    "dataset-repr": _plant_dataset_repr,
}


def warned_text(text: str) -> str:
    """What reaches the program's stderr when dlwatch warns with ``text`` (see test_redact_everywhere.warned)."""
    return warned(text)


@settings(max_examples=300, deadline=None)
@given(shape=st.sampled_from(sorted(SHAPES_29)), channel=st.sampled_from(sorted(CHANNELS_29)), data=st.data())
def test_each_new_shape_in_each_channel_is_redacted(shape, channel, data):
    """Item 7: each of the six shapes, with a random body, planted in the program's argv, the environment,
    exception text, a warning and a dataset's repr, then written and printed the way the watch, the monitor
    and `dlwatch attach` do: no part of the body anywhere, and detect-secrets finds nothing."""
    template, body_strategy = SHAPES_29[shape]
    body = data.draw(body_strategy, label="body")
    text = template.format(s=body)
    out = _written_and_printed(channel, text)
    # a piece of a URL password may be a word the report holds anyway ("classifi" in "classification"):
    # a piece leaks when it is shown more often than with a body of the same shape made of other letters
    control = _written_and_printed(channel, template.format(s=re.sub(r"[^@/]", "~", body)))
    assert [p for p in secret_parts(body) if out.count(p) > control.count(p)] == [], (shape, channel, text)
    assert detect_secrets_findings(out) == [], (shape, channel, text)


def _written_and_printed(channel: str, text: str) -> str:
    """Everything written and printed for one planted text, the way the watch, the monitor and attach do."""
    d = tempfile.mkdtemp()
    try:
        os.mkdir(os.path.join(d, "run"), 0o700)
        report = store.skeleton(trigger="exception", pid=1234, now=time.time())
        printed = CHANNELS_29[channel](d, report, text) or ""
        path = build.write(report, os.path.join(d, "r"))
        return everything_written(d) + printed_by_attach(report, path) + printed
    finally:
        shutil.rmtree(d, ignore_errors=True)


SECRETS_PROGRAM = """
import json, sys, threading
import torch
from torch.utils.data import DataLoader, Dataset

texts = json.loads(sys.argv[3])


class Planted(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 5:
            raise ValueError("bad sample in " + repr(self))  # the dataset's repr in a worker's exception
        return i

    def __repr__(self):
        return "Planted(" + " | ".join(texts) + ")"


stop = threading.Event()
threading.Thread(target=stop.wait, name=" ".join(texts), daemon=True).start()  # named in the fork warning
loader = DataLoader(Planted(), batch_size=2, num_workers=1, multiprocessing_context="fork")
try:
    if sys.argv[1] == "watch":
        import dlwatch

        with dlwatch.watch(loader, report_dir=sys.argv[2], poll_interval=0.2) as batches:
            for b in batches:
                pass
    else:
        for b in loader:
            pass
except ValueError:
    print("CAUGHT", flush=True)
stop.set()
"""


def _distinctive(body: str) -> bool:
    """A body that cannot turn up in a report by chance (a run of zeros is in every timestamp)."""
    return all(len(set(part)) >= 5 for part in re.split(r"[@/]", body))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("form", ["watch", "dlwatch run"])
@settings(max_examples=2, deadline=None, phases=[Phase.generate])  # real runs: two each, never shrunk
@given(
    bodies=st.fixed_dictionaries(
        {name: strategy.filter(_distinctive) for name, (_t, strategy) in SHAPES_29.items()}
    ).filter(lambda b: len(set(b.values())) == len(b))
)
def test_the_new_shapes_planted_in_a_real_run_reach_nothing_written_or_printed(form, bodies):
    """Item 7, performed for real: a program gets all six shapes in its argv (each as one argument, and as a
    shell splits it), in the environment (DLWATCH_JOB_ID, and a bad DLWATCH_STALL_TIMEOUT that dlwatch warns
    about), in a thread's name (the fork warning), in its dataset's repr and so in the exception a worker
    raises.  dlwatch writes the exception incident, the run summary and their pages, and warns: no part of
    any body is in any of it, or in what was printed.  Before, each shape reached report.json/md/html."""
    texts = [SHAPES_29[name][0].format(s=body) for name, body in sorted(bodies.items())]
    d = tempfile.mkdtemp()
    try:
        script = os.path.join(d, "prog.py")
        with open(script, "w") as f:
            f.write(SECRETS_PROGRAM)
        reports = os.path.join(d, "reports")
        argv = [script, "watch" if form == "watch" else "bare", reports, json.dumps(texts), *texts]
        argv += [word for text in texts for word in text.split(" ")]
        if form == "dlwatch run":
            argv = ["-m", "dlwatch", "run", *argv]
        env = _cli_env(
            DLWATCH_DIR=reports,
            DLWATCH_JOB_ID=texts[0][:120],
            DLWATCH_STALL_TIMEOUT="\n".join(texts),
            DLWATCH_POLL_INTERVAL="0.2",
        )
        rc, out, err = run_bounded([sys.executable, *argv], env=env, cwd=d, timeout=300)
        assert rc == 0 and "CAUGHT" in out, err[-3000:]
        assert "fork-with-threads" in err and "DLWATCH_STALL_TIMEOUT=" in err, err[-3000:]  # both warnings shown
        written = everything_written(reports)
        assert '"trigger": "exception"' in written and "bad sample in Planted(" in written  # the incident is there
        shown = written + out + err
        leaked = {name: p for name, body in bodies.items() for p in secret_parts(body) if p in shown}
        assert leaked == {}, leaked
        assert detect_secrets_findings(shown) == []
    finally:
        shutil.rmtree(d, ignore_errors=True)


# Ordinary text that looks like one of the shapes (or like the old rules' catches): never masked.
LOOKALIKES = [
    "forward_pass: {n}",
    "backward_pass={n} ms",
    "first_pass: {n}",
    "num_pass={n}",
    "cookiecutter {w}",
    "authorization: required",
    "Authorization: {w}",
    '"authorization": "optional"',
    "git checkout {sha}",
    "commit {sha}",
    "HEAD is now at {sha}",
    "{sha}  data/{w}.tar",
    "checksum={sha}",
    "https://github.com/{w}/{w}/commit/{sha}",
    "wandb: Syncing run {w}-{n}",
    "WANDB_PROJECT={w}",
    "WANDB_API_KEY is not set: run `wandb login`",
    "wandb.init(project='{w}', id='{sha}')",
    "response=200",
    "response: ok",
    'response="{w}"',
    "response_time={n}",
    "curl -u {w} https://example.invalid/{w}",
    "curl -o {w}.tar -L https://example.invalid/{w}",
    "ssh -p 2222 {w}@example.invalid",
    "sshpass -f /home/{w}/.pw ssh -p 22 example.invalid",
    "AccountName={w};EndpointSuffix=core.windows.net",
    "account: {n}",
    "mail {w}@example.com",
    "http://host:8080/x@y.z",
    "s3://{w}/{w}@{n}/part-0001.parquet",
]


@settings(max_examples=300, deadline=None)
@given(
    template=st.sampled_from(LOOKALIKES),
    w=st.text(string.ascii_lowercase, min_size=3, max_size=12),
    n=st.integers(0, 10**6),
    sha=st.text(_HEX, min_size=40, max_size=40),
)
def test_look_alikes_of_the_new_shapes_are_left_alone(template, w, n, sha):
    """Item 7's other half: the new rules mask what they are for and nothing like it: a forward pass, a
    cookiecutter, an authorization that is required, a git commit (40 hex digits not after a W&B key name),
    an HTTP response code, a curl without a password, an ssh port, an Azure account's name."""
    text = template.format(w=w, n=n, sha=sha)
    assert redact(text) == text
    assert redact_argv(text.split(" ")) == text.split(" ")


@pytest.mark.timeout(300)
def test_dlwatch_run_m_loads_no_dlwatch_of_the_working_directory(tmp_path):
    """Item 3: a `dlwatch` package (and a `sitecustomize`) that another user left in a world-writable working
    directory is never what `dlwatch run -m job` loads, neither in the command nor in the program's
    processes, where the working directory is on sys.path for the job's own modules.  (`python -m dlwatch`
    there would run it: Python itself picks the -m package from the working directory first; docs/security.md.)
    A guard, not an attack of the review: the code before passes it too (the bootstrap finds dlwatch at
    interpreter start, before the working directory is on the path)."""
    shared = tmp_path / "shared"
    (shared / "dlwatch" / "inproc").mkdir(parents=True)
    os.chmod(shared, 0o1777)
    marks = tmp_path / "marks"
    marks.mkdir(mode=0o1777)
    plant = f"open({str(marks)!r} + '/' + __name__, 'w').close()\n"
    for path in ("dlwatch/__init__.py", "dlwatch/inproc/__init__.py", "dlwatch/inproc/runhook.py", "sitecustomize.py"):
        (shared / path).write_text(plant)
    (shared / "job.py").write_text(
        "from torch.utils.data import DataLoader\n"
        "import dlwatch, sys\n"  # the program imports dlwatch too: it gets the real one
        "print('JOB', [b.tolist() for b in DataLoader(list(range(4)), batch_size=2, num_workers=1)],"
        " dlwatch.__file__.startswith(sys.path[0]), flush=True)\n"
    )
    if os.geteuid() == 0:
        for root, dirs, files in os.walk(shared):
            for name in dirs + files:
                os.chown(os.path.join(root, name), NOBODY, NOBODY)
    reports = tmp_path / "reports"
    rc, out, err = run_bounded(
        [os.path.join(os.path.dirname(sys.executable), "dlwatch"), "run", "-m", "job"],
        env=_cli_env(DLWATCH_DIR=str(reports)),
        cwd=str(shared),
        timeout=240,
    )
    assert rc == 0 and "JOB [[0, 1], [2, 3]] False" in out, err[-3000:]
    assert os.listdir(marks) == []
    assert os.listdir(reports / "runs")  # watched, by the real dlwatch
