"""Stack dumps: py-spy against real processes, the faulthandler fallback, and the parsers.

Targets live in tests/stack_targets and say "ready" through a FIFO; every test
kills the whole process group (and any descendant) of what it started in
``finally``, because a DataLoader worker stuck on a lock never exits by itself.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from typing import Iterator

import psutil
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dlwatch.collect import faultdump, stacks
from dlwatch.collect.faultdump import DUMP_SIGNAL, parse_faulthandler, request_dumps
from dlwatch.collect.stacks import (
    INSTALL_HINT,
    PY_SPY_ENV,
    cut_at_worker_loop,
    dump_stacks,
    find_py_spy,
    parse_py_spy_json,
    summarize_py_spy_error,
)
from dlwatch.detect.classify import ProcessObservation, classify_stall, syscall_category
from dlwatch.errors import PTRACE_HELP
from dlwatch.model import Frame, ProcSample

from conftest import alive, kill_session, wait_for  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = os.path.join(HERE, "stack_targets")
PY_SPY = find_py_spy()
needs_py_spy = pytest.mark.skipif(PY_SPY is None, reason="py-spy is not installed")


# --------------------------------------------------------------------------- process helpers


class Started:
    """A target in its own session, with FIFO readiness and group-wide cleanup."""

    def __init__(self, tmp_path, argv: list[str]) -> None:
        self.fifo = str(tmp_path / f"ready-{len(os.listdir(tmp_path))}.fifo")
        os.mkfifo(self.fifo, 0o600)
        # Open the read end first, non-blocking, so the target's open() for
        # writing finds a reader and the test's wait is bounded by select().
        self.read_fd = os.open(self.fifo, os.O_RDONLY | os.O_NONBLOCK)
        self.proc = subprocess.Popen(
            [*argv[:1], *[a.replace("{fifo}", self.fifo) for a in argv[1:]]],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self.pid = self.proc.pid
        self.known: set[int] = set()

    def wait_ready(self, timeout: float) -> list[str]:
        buf = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            readable, _, _ = select.select([self.read_fd], [], [], 0.05)
            if readable:
                chunk = os.read(self.read_fd, 4096)
                buf += chunk
                if b"\n" in buf:
                    self.remember()
                    return buf.split(b"\n", 1)[0].decode().split()
                if not chunk:  # no writer yet (or it closed): EOF until one opens
                    time.sleep(0.02)
            if self.proc.poll() is not None:
                raise AssertionError(
                    f"target exited {self.proc.returncode}: {self.proc.stderr.read().decode(errors='replace')[-2000:]}"
                )
        raise AssertionError(f"target not ready within {timeout} s")

    def remember(self) -> None:
        try:
            self.known.update(p.pid for p in psutil.Process(self.pid).children(recursive=True))
        except psutil.NoSuchProcess:
            pass

    def cleanup(self) -> None:
        self.remember()
        leftover = kill_session(self.pid, self.known)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        assert not leftover, f"processes left behind: {leftover}"
        os.close(self.read_fd)
        self.proc.stderr.close()


@pytest.fixture
def start(tmp_path) -> Iterator:
    started: list[Started] = []

    def _start(*argv: str) -> Started:
        s = Started(tmp_path, list(argv))
        started.append(s)
        return s

    try:
        yield _start
    finally:
        for s in started:
            s.cleanup()


def read_sample(pid: int) -> ProcSample:
    """A minimal /proc read (state, cpu_s, syscall) for the end-to-end classify check."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat_text = f.read()
        fields = stat_text[stat_text.rindex(")") + 2 :].split()
        cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        with open(f"/proc/{pid}/syscall") as f:
            first = f.read().split()[0]
        syscall = -1 if first == "running" else int(first)
        return ProcSample(pid=pid, ts=time.time(), state=fields[0], cpu_s=cpu_s, syscall=syscall)
    except (OSError, ValueError, IndexError):
        return ProcSample(pid=pid, ts=time.time(), gone=True)


def funcs(thread) -> list[str]:
    return [f.function for f in thread.frames]


# --------------------------------------------------------------------------- real py-spy


@needs_py_spy
@pytest.mark.timeout(60)
def test_fork_held_lock_loader_stacks_and_verdict(start) -> None:
    target = start(sys.executable, os.path.join(TARGETS, "fork_lock_loader.py"), "{fifo}")
    _, main_pid, *worker_pids = target.wait_ready(timeout=30)
    main, workers = int(main_pid), [int(w) for w in worker_pids]
    assert len(workers) == 2

    def syscall(pid: int) -> int | None:
        return read_sample(pid).syscall

    assert wait_for(lambda: all(syscall(w) == 202 for w in workers), timeout=15), "workers never blocked in futex"
    # /proc first: a ptrace attach turns the main's sleeping poll into restart_syscall
    before = {pid: read_sample(pid) for pid in [main, *workers]}
    dumps = dump_stacks([main, *workers], native=True, timeout_s=10)
    time.sleep(0.5)
    after = {pid: read_sample(pid) for pid in [main, *workers]}

    for w in workers:
        d = dumps[w]
        assert d.source in ("py-spy-native", "py-spy"), d.error
        mt = next(t for t in d.threads if t.native_tid == w)
        names = funcs(mt)
        # the wait is in the dataset, the stack ends at torch's worker loop (parent frames cut)
        assert any(n.endswith("__getitem__") for n in names), names
        assert names[-1].endswith("_worker_loop"), names
        assert not any("Popen" in n or n == "<module>" for n in names), names
        getitem = next(f for f in mt.frames if f.function.endswith("__getitem__"))
        assert getitem.filename and getitem.filename.endswith("fork_lock_loader.py")
        if d.source == "py-spy-native":
            assert any(f.native for f in mt.frames)
            assert any("acquire_lock" in f.function for f in mt.frames if f.native), names

    md = dumps[main]
    assert md.source in ("py-spy-native", "py-spy"), md.error
    main_thread = next(t for t in md.threads if t.native_tid == main)
    assert any(n.endswith("_try_get_data") for n in funcs(main_thread))
    assert any(t.name == "lock-holder" for t in md.threads)

    obs = [ProcessObservation(pid=main, role="main", before=before[main], after=after[main], stack=dumps[main])]
    obs += [
        ProcessObservation(pid=w, role="worker", worker_id=i, before=before[w], after=after[w], stack=dumps[w])
        for i, w in enumerate(workers)
    ]
    verdict = classify_stall(obs, expected_workers=2)
    assert verdict.classification == "deadlock", verdict.reason
    by_pid = {v.pid: v for v in verdict.processes}
    assert by_pid[main].status == "idle"
    for w in workers:
        assert by_pid[w].status == "blocked"
        assert by_pid[w].waiting_in == "lock acquire"
        assert by_pid[w].where and "__getitem__" in by_pid[w].where


@needs_py_spy
@pytest.mark.timeout(30)
def test_dead_pid_and_non_python_give_one_line_errors(start) -> None:
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    dead = subprocess.Popen(["true"])
    dead.wait()
    try:
        dumps = dump_stacks([sleeper.pid, dead.pid], timeout_s=5)
    finally:
        sleeper.kill()
        sleeper.wait()
    for pid in (sleeper.pid, dead.pid):
        d = dumps[pid]
        assert d.source == "none" and not d.threads
        assert d.error and "\n" not in d.error and "backtrace" not in d.error.lower()
    assert "not a Python process" in dumps[sleeper.pid].error
    assert "no longer exists" in dumps[dead.pid].error


@pytest.mark.timeout(30)
def test_zombie_gives_one_line_error() -> None:
    child = subprocess.Popen(["true"])
    try:
        assert wait_for(lambda: psutil.Process(child.pid).status() == psutil.STATUS_ZOMBIE, timeout=5)
        d = dump_stacks([child.pid], py_spy=PY_SPY or "/bin/false")[child.pid]
        assert d.source == "none" and "zombie" in d.error
    finally:
        child.wait()


@needs_py_spy
@pytest.mark.timeout(30)
def test_dead_pid_reported_by_py_spy_itself() -> None:
    # bypass our /proc pre-check: py-spy's own failure must be reduced to one line too
    dead = subprocess.Popen(["true"])
    dead.wait()
    out = subprocess.run([PY_SPY, "dump", "--json", "--pid", str(dead.pid)], capture_output=True, text=True, timeout=10)
    assert out.returncode != 0
    line = summarize_py_spy_error(out.stderr)
    assert "\n" not in line and "Stack backtrace" not in line and line


def test_py_spy_disabled_gives_install_hint(monkeypatch) -> None:
    monkeypatch.setenv(PY_SPY_ENV, "")
    assert find_py_spy() is None
    d = dump_stacks([os.getpid()])[os.getpid()]
    assert d.source == "none"
    assert INSTALL_HINT in d.error and "\n" not in d.error


def test_py_spy_env_path_not_executable(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv(PY_SPY_ENV, str(tmp_path / "nope"))
    assert find_py_spy() is None
    d = dump_stacks([os.getpid()])[os.getpid()]
    assert d.source == "none" and INSTALL_HINT in d.error and "nope" in d.error


def test_find_py_spy_beside_interpreter(monkeypatch) -> None:
    monkeypatch.delenv(PY_SPY_ENV, raising=False)
    monkeypatch.setenv("PATH", "/nonexistent")
    beside = os.path.join(os.path.dirname(sys.executable), "py-spy")
    assert find_py_spy() == (beside if os.access(beside, os.X_OK) else None)


@pytest.mark.timeout(30)
def test_hanging_py_spy_is_killed_with_its_group(tmp_path) -> None:
    marker = tmp_path / "pids"
    fake = tmp_path / "py-spy"
    # a py-spy that hangs and has a child: both must die, and the call must return in time
    fake.write_text(f"#!/bin/sh\nsleep 30 &\necho $$ $! > {marker}\nwait\n")
    fake.chmod(0o755)
    t0 = time.monotonic()
    d = dump_stacks([os.getpid()], timeout_s=1.0, py_spy=str(fake))[os.getpid()]
    elapsed = time.monotonic() - t0
    assert elapsed < 3.0
    assert d.source == "none" and "timed out" in d.error and "\n" not in d.error
    pids = [int(p) for p in marker.read_text().split()] if marker.exists() else []
    assert pids
    assert wait_for(lambda: not any(alive(pid) for pid in pids), timeout=3, interval=0.01)
    # our own state must not have been touched (we were never stopped)
    assert psutil.Process().status() != psutil.STATUS_STOPPED


def test_permission_denied_message_from_fake(tmp_path) -> None:
    fake = tmp_path / "py-spy"
    fake.write_text(
        '#!/bin/sh\necho "Permission Denied: Try running again with elevated '
        'permissions by going \'sudo env \\"PATH=\\$PATH\\" !!\'" >&2\nexit 1\n'
    )
    fake.chmod(0o755)
    d = dump_stacks([os.getpid()], py_spy=str(fake))[os.getpid()]
    assert d.source == "none" and PTRACE_HELP in d.error and "\n" not in d.error


@needs_py_spy
@pytest.mark.timeout(30)
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root and setpriv to run py-spy as another user"
)
def test_permission_denied_real(start, tmp_path) -> None:
    target = start(sys.executable, os.path.join(TARGETS, "sleeper.py"), "{fifo}")
    target.wait_ready(timeout=15)
    as_nobody = tmp_path / "py-spy"
    as_nobody.write_text(f'#!/bin/sh\nexec setpriv --reuid=65534 --regid=65534 --clear-groups {PY_SPY} "$@"\n')
    as_nobody.chmod(0o755)
    os.chmod(tmp_path, 0o755)
    d = dump_stacks([target.pid], py_spy=str(as_nobody), timeout_s=5)[target.pid]
    assert d.source == "none", d
    assert PTRACE_HELP in d.error


@needs_py_spy
@pytest.mark.timeout(30)
def test_stopped_target_falls_back_to_nonblocking(start) -> None:
    target = start(sys.executable, os.path.join(TARGETS, "sleeper.py"), "{fifo}")
    target.wait_ready(timeout=15)
    # "ready" is written just before sleep_here(): stop it only once it sleeps there
    assert wait_for(lambda: syscall_category(read_sample(target.pid).syscall) == "sleep", timeout=10)
    os.kill(target.pid, signal.SIGSTOP)
    assert wait_for(lambda: psutil.Process(target.pid).status() == psutil.STATUS_STOPPED, timeout=5)
    d = dump_stacks([target.pid], native=True, timeout_s=5)[target.pid]
    assert d.source == "py-spy-nonblocking", d.error
    assert "--native dump failed" in d.error and "\n" not in d.error
    assert any("sleep_here" in n for t in d.threads for n in funcs(t))
    # we never resume a process that was stopped before we came
    assert psutil.Process(target.pid).status() == psutil.STATUS_STOPPED


# --------------------------------------------------------------------------- faulthandler fallback


@pytest.mark.timeout(30)
def test_faulthandler_fallback_parent_and_forked_child(start, tmp_path) -> None:
    dump_dir = tmp_path / "stacks"
    target = start(sys.executable, os.path.join(TARGETS, "faultdump_target.py"), "{fifo}", str(dump_dir))
    _, pid_s, path, child_s, child_path = target.wait_ready(timeout=15)
    pid, child = int(pid_s), int(child_s)
    assert path == str(dump_dir / f"{pid}.txt") and child_path == str(dump_dir / f"{child}.txt")
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert faultdump.is_handler_installed(pid) and faultdump.is_handler_installed(child)
    # the child closed the copy of the parent's dump fd it inherited
    child_links = [os.readlink(f"/proc/{child}/fd/{fd}") for fd in os.listdir(f"/proc/{child}/fd")]
    assert child_path in child_links and path not in child_links

    for _attempt in range(2):  # twice: the second dump follows a truncation of the first
        dumps = request_dumps({pid: path, child: child_path}, timeout_s=3)
        d, c = dumps[pid], dumps[child]
        assert d.source == "faulthandler", d.error
        assert c.source == "faulthandler", c.error
        all_funcs = [n for t in d.threads for n in funcs(t)]
        assert "hang_in_parent" in all_funcs and "blocked_thread" in all_funcs
        assert any("hang_in_child" in funcs(t) for t in c.threads)
        assert not any("hang_in_parent" in funcs(t) for t in c.threads)  # the child's own file
        with open(path, "rb") as f:
            text = f.read()
        # O_APPEND writer: after our truncation the dump starts at offset 0, no NUL hole
        assert text.startswith(b"Thread 0x") or text.startswith(b"Current thread 0x"), text[:40]
        assert text.count(b"Current thread") == 1
    assert psutil.Process(pid).is_running() and psutil.Process(child).is_running()


@pytest.mark.timeout(30)
def test_request_dumps_never_signals_a_process_without_the_handler(tmp_path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        path = tmp_path / f"{sleeper.pid}.txt"
        path.write_text("")
        d = request_dumps({sleeper.pid: str(path)}, timeout_s=0.5)[sleeper.pid]
        assert d.source == "none" and "not signalled" in d.error
        time.sleep(0.1)
        assert sleeper.poll() is None  # a real-time signal would have killed it
    finally:
        sleeper.kill()
        sleeper.wait()
    dead = subprocess.Popen(["true"])
    dead.wait()
    d = request_dumps({dead.pid: str(path)}, timeout_s=0.5)[dead.pid]
    assert d.source == "none" and "no longer exists" in d.error


def test_install_failure_returns_none(tmp_path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("x")
    # a path under a regular file cannot be created: None, no exception
    assert faultdump.install(str(blocker / "sub")) is None


@pytest.mark.timeout(30)
def test_install_leaves_someone_elses_handler_alone(tmp_path) -> None:
    code = (
        "import signal, sys; from dlwatch.collect import faultdump as f; "
        "signal.signal(f.DUMP_SIGNAL, lambda *a: None); print(f.install(sys.argv[1]))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=20)
    assert out.stdout.strip() == "None", out.stderr


def test_dump_signal_is_real_time() -> None:
    assert signal.SIGRTMIN <= DUMP_SIGNAL <= signal.SIGRTMAX
    assert DUMP_SIGNAL not in (signal.SIGUSR1, signal.SIGUSR2)


FAULTHANDLER_TEXT = """\
Thread 0x00007f8554ddb6c0 (most recent call first):
  File "/tmp/expl/fh.py", line 5 in blocked
  File "/usr/lib/python3.11/threading.py", line 982 in run

Current thread 0x00007f8555a27b80 (most recent call first):
  File "/tmp/expl/fh.py", line 7 in <module>
"""


def test_parse_faulthandler_format() -> None:
    threads = parse_faulthandler(FAULTHANDLER_TEXT)
    assert [t.thread_id for t in threads] == [0x7F8554DDB6C0, 0x7F8555A27B80]
    assert threads[0].frames[0] == Frame("blocked", "/tmp/expl/fh.py", 5)
    assert threads[0].frames[1].function == "run"
    assert threads[1].frames == (Frame("<module>", "/tmp/expl/fh.py", 7),)
    # named threads (newer Pythons), single-thread header, "???" lines, NUL bytes
    odd = (
        "\x00\x00Current thread 0x1 [MainThread] (most recent call first):\n"
        '  File "???", line ??? in ???\n  <no Python frame>\n'
        'Stack (most recent call first):\n  File "a.py", line 3 in f\n'
    )
    t = parse_faulthandler(odd)
    assert t[0].name == "MainThread" and t[0].frames[0].line is None
    assert t[1].thread_id is None and t[1].frames[0].function == "f"


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=len(FAULTHANDLER_TEXT)), st.text(max_size=200))
def test_parse_faulthandler_never_raises(cut: int, junk: str) -> None:
    for text in (
        FAULTHANDLER_TEXT[:cut],
        FAULTHANDLER_TEXT[:cut] + junk,
        junk,
        (FAULTHANDLER_TEXT[:cut] + junk).encode("utf-8", "surrogatepass"),
    ):
        threads = parse_faulthandler(text)
        assert isinstance(threads, tuple)
        for t in threads:
            assert all(isinstance(f.function, str) for f in t.frames)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300))
def test_parse_faulthandler_binary_garbage(data: bytes) -> None:
    assert isinstance(parse_faulthandler(data), tuple)


# --------------------------------------------------------------------------- py-spy JSON parsing


def _pyframe(name: str, file: str, line: int = 1) -> dict:
    return {
        "name": name,
        "filename": file,
        "module": None,
        "short_filename": file.rsplit("/", 1)[-1],
        "line": line,
        "locals": None,
        "is_entry": False,
        "is_shim_entry": False,
    }


WORKER_JSON = json.dumps(
    [
        {
            "pid": 12,
            "thread_id": 140,
            "thread_name": "MainThread",
            "os_thread_id": 12,
            "active": False,
            "owns_gil": False,
            "frames": [
                {
                    "name": "PyThread_acquire_lock_timed",
                    "filename": "/usr/lib/libpython3.11.so.1.0",
                    "module": "/usr/lib/libpython3.11.so.1.0",
                    "short_filename": "libpython3.11.so.1.0",
                    "line": 0,
                    "locals": None,
                    "is_entry": True,
                    "is_shim_entry": True,
                },
                _pyframe("DS.__getitem__", "/tmp/x/hang.py", 8),
                _pyframe("_MapDatasetFetcher.fetch", "/v/site-packages/torch/utils/data/_utils/fetch.py", 54),
                _pyframe("_worker_loop", "/v/site-packages/torch/utils/data/_utils/worker.py", 374),
                _pyframe("BaseProcess.run", "/usr/lib/python3.11/multiprocessing/process.py", 108),
                _pyframe("Popen._launch", "/usr/lib/python3.11/multiprocessing/popen_fork.py", 71),
                _pyframe("<module>", "/tmp/x/hang.py", 16),
            ],
        }
    ],
    indent=2,
)


def test_parse_py_spy_json_real_shape() -> None:
    d = parse_py_spy_json(12, WORKER_JSON, source="py-spy-native", duration_s=0.1)
    assert d.source == "py-spy-native" and d.error is None and d.duration_s == 0.1
    (t,) = d.threads
    assert (t.thread_id, t.name, t.native_tid, t.active, t.owns_gil) == (140, "MainThread", 12, False, False)
    assert funcs(t) == ["PyThread_acquire_lock_timed", "DS.__getitem__", "_MapDatasetFetcher.fetch", "_worker_loop"]
    assert t.frames[0].native and t.frames[0].line is None
    assert not t.frames[1].native and t.frames[1].line == 8


def test_cut_at_worker_loop() -> None:
    loop = Frame("_worker_loop", "/x/torch/utils/data/_utils/worker.py", 3)
    inner = Frame("DS.__getitem__", "/x/ds.py", 1)
    outer = Frame("Popen._launch", "/x/multiprocessing/popen_fork.py", 71)
    assert cut_at_worker_loop([inner, loop, outer, Frame("main", "/x/train.py")]) == (inner, loop)
    assert cut_at_worker_loop([inner, outer]) == (inner, outer)  # not a worker: unchanged
    assert cut_at_worker_loop([]) == ()
    # a user function that happens to be named _worker_loop elsewhere is not torch's
    other = Frame("_worker_loop", "/x/mine.py", 3)
    assert cut_at_worker_loop([other, outer]) == (other, outer)


@pytest.mark.parametrize(
    "text", ["", "[", "{}", "null", "[]", "[1, 2]", '[{"frames": 3}]x', "\x00\xff", "[" * 5000 + "]" * 5000]
)
def test_parse_py_spy_json_garbage(text: str) -> None:
    d = parse_py_spy_json(1, text)
    assert d.source == "none" and d.error and "\n" not in d.error


def test_parse_py_spy_json_wrong_types_skipped() -> None:
    raw = json.dumps([{"thread_id": True, "os_thread_id": "x", "frames": [3, {"name": 5, "line": "x"}]}, 7])
    d = parse_py_spy_json(1, raw)
    assert d.source == "py-spy"
    (t,) = d.threads
    assert t.thread_id is None and t.native_tid is None
    assert t.frames == (Frame("<unknown>", None, None, False),)


@settings(max_examples=300, deadline=None)
@given(st.integers(min_value=0, max_value=len(WORKER_JSON)), st.text(max_size=50))
def test_parse_py_spy_json_truncated_never_raises(cut: int, junk: str) -> None:
    for text in (WORKER_JSON[:cut], WORKER_JSON[:cut] + junk, junk + WORKER_JSON[cut:]):
        d = parse_py_spy_json(12, text)
        assert d.source in ("py-spy", "none")
        if d.source == "none":
            assert d.error and "\n" not in d.error


@settings(max_examples=300, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers() | st.text(max_size=10),
        lambda kids: (
            st.lists(kids, max_size=4)
            | st.dictionaries(
                st.sampled_from(
                    [
                        "name",
                        "frames",
                        "thread_id",
                        "line",
                        "module",
                        "filename",
                        "os_thread_id",
                        "thread_name",
                        "active",
                    ]
                ),
                kids,
                max_size=5,
            )
        ),
        max_leaves=30,
    )
)
def test_parse_py_spy_json_any_json_never_raises(value) -> None:
    d = parse_py_spy_json(1, json.dumps(value))
    assert d.source in ("py-spy", "none")


def test_summarize_py_spy_error() -> None:
    err = (
        "Error: Failed to get process executable name. Check that the process is running.\n\n"
        "Caused by:\n    0: No such file or directory (os error 2)\n"
        "    1: No such file or directory (os error 2)\n\nStack backtrace:\n"
        "   0: <E as anyhow::context::ext::StdError>::ext_context\n   1: py_spy::main\n"
    )
    assert summarize_py_spy_error(err) == (
        "Failed to get process executable name. Check that the "
        "process is running.: No such file or directory (os error 2)"
    )
    assert summarize_py_spy_error("") == "py-spy failed without a message"
    assert summarize_py_spy_error(b"Error: boom\n") == "boom"


def test_stacks_module_imports_no_torch() -> None:
    code = (
        "import sys, dlwatch.collect.stacks, dlwatch.collect.faultdump, dlwatch.detect.classify; "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30)
    assert out.stdout.strip() == "False", out.stderr
    assert stacks.__doc__ and faultdump.__doc__
