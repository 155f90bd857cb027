"""Hardening II (issue 18): what a local user could still turn against root, performed for real.

Each exploitable path is attacked with two uids, as a local user would: the victim is root
(running ``dlwatch attach`` or ``dlwatch report``), the adversary is ``nobody`` (the job's
owner).  Helpers for the second uid come from test_security.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import REPO, kill_session, run_bounded
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
    # through the environment: watch() gets a one-line ValueError, the CLI exit 7
    monkeypatch.setenv("DLWATCH_PLAYBOOKS", str(two))
    import dlwatch

    with pytest.raises(ValueError) as raised:
        dlwatch.watch([1, 2, 3])
    assert "\n" not in str(raised.value) and "merge or remove some" in str(raised.value)
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
