"""Shared fixtures: real subprocesses with bounded time, and cleanup that leaves nothing behind."""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Iterator

import psutil
import pytest
from hypothesis import settings

# Property tests are derandomized by default (a fixed seed: the same examples on every run, in CI
# and from a fresh clone), with no per-example deadline (a loaded machine is slow, not wrong).
# HYPOTHESIS_PROFILE=explore searches with fresh random examples locally.
settings.register_profile("fixed", derandomize=True, deadline=None, database=None, print_blob=True)
settings.register_profile("explore", deadline=None, max_examples=1000, print_blob=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "fixed"))

HERE = os.path.dirname(os.path.abspath(__file__))
TARGETS = os.path.join(HERE, "targets")
REPO = os.path.dirname(HERE)

import tiers  # noqa: E402  (the test tiers: markers assigned by rule, see tests/tiers.py)

tiers.install_guard()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--tier",
        choices=tiers.TIERS,
        default=None,
        help="core: the default tier; rest: every test not in it (CI's second stage); all: both. "
        "Default: core, or all when files or test ids are named",
    )


def pytest_configure(config: pytest.Config) -> None:
    for name, text in tiers.MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {text}")


def pytest_report_header(config: pytest.Config) -> list[str]:
    import dlwatch

    return [f"tier: {tiers.tier(config)}; dlwatch imported from {os.path.dirname(dlwatch.__file__)}"]


@pytest.hookimpl(tryfirst=True)  # before -m and -k read the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    tiers.classify(items)
    tiers.select(config, items)


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> Iterator[None]:
    tiers.guard_start()
    return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Iterator[None]:
    result = yield
    tiers.guard_check(item)
    return result


def kill_tree(pid: int, timeout: float = 5.0) -> None:
    """SIGKILL a process and every descendant (a hung DataLoader worker never exits by itself)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def alive(pid: int) -> bool:
    """Exists and is not a zombie (an orphaned zombie is reaped by pid 1 soon)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def kill_session(pid: int, known: set[int], timeout: float = 5.0) -> list[int]:
    """SIGKILL a target's process group and every pid seen under it; return those still alive.

    Targets run in their own session, so the group takes workers and monitor at once; the
    known pids catch any that left the group.  psutil.wait_procs backs off to ~1 s polls for
    non-children, so this polls briefly itself.
    """
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    for p in known | {pid}:
        try:
            os.kill(p, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    wait_for(lambda: not any(alive(p) for p in known), timeout=timeout, interval=0.01)
    return [p for p in known if alive(p)]


def descendants_of(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def wait_for(predicate, timeout: float, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


class Target:
    """A target script under tests/targets, run in its own session so that cleanup can take the group."""

    def __init__(self, script: str, *args: str, env: dict[str, str] | None = None, cwd: str | None = None) -> None:
        full_env = dict(os.environ)
        full_env["PYTHONPATH"] = os.pathsep.join([REPO, TARGETS, full_env.get("PYTHONPATH", "")])
        full_env.update(env or {})
        self.proc = subprocess.Popen(
            [sys.executable, os.path.join(TARGETS, script), *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=full_env,
            cwd=cwd,
            start_new_session=True,
            text=True,
        )
        self.pid = self.proc.pid
        self.known: set[int] = set()

    def remember(self) -> None:
        self.known.update(p.pid for p in descendants_of(self.pid))

    def wait_line(self, marker: str, timeout: float) -> str:
        """Read stdout until a line starts with marker (targets print readiness, tests never sleep blindly)."""
        import selectors

        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    continue
                line = self.proc.stdout.readline()
                if not line:
                    break
                if line.startswith(marker):
                    self.remember()
                    return line.strip()
        finally:
            sel.close()
        err = self.proc.stderr.read() if self.proc.poll() is not None else ""
        raise AssertionError(f"target never printed {marker!r} within {timeout}s; stderr: {err[-2000:]}")

    def communicate(self, timeout: float) -> tuple[str, str]:
        return self.proc.communicate(timeout=timeout)

    def cleanup(self) -> None:
        self.remember()
        kill_session(self.pid, self.known)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        for stream in (self.proc.stdout, self.proc.stderr):
            try:
                stream.close()
            except Exception:
                pass


@pytest.fixture
def target() -> Iterator:
    started: list[Target] = []

    def start(script: str, *args: str, **kw) -> Target:
        t = Target(script, *args, **kw)
        started.append(t)
        return t

    try:
        yield start
    finally:
        for t in started:
            t.cleanup()


@pytest.fixture
def no_leftovers() -> Iterator[None]:
    """Fail a test that leaves children of the test process (monitors, workers) behind."""
    import gc

    before = {p.pid for p in descendants_of(os.getpid())}
    yield
    gc.collect()  # iterators kept alive by tracebacks hold their workers

    def leftovers() -> list[psutil.Process]:
        out = []
        for p in descendants_of(os.getpid()):
            try:
                if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except psutil.NoSuchProcess:
                pass
        return out

    t0 = time.monotonic()
    snapshot = leftovers()
    wait_for(lambda: not leftovers(), timeout=10)
    if os.environ.get("DLWATCH_DEBUG_LEFTOVERS"):
        print("LEFTOVERS", [(p.pid, p.name()) for p in snapshot if p.is_running()], time.monotonic() - t0)
    leftover = leftovers()
    for p in leftover:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not leftover, f"processes left behind: {[(p.pid, p.name()) for p in leftover]}"


@pytest.fixture
def short_tmp() -> Iterator[pathlib.Path]:
    """A TMPDIR for a target with DataLoader workers.  multiprocessing binds AF_UNIX sockets in it (the
    fd passing of every batch from a worker), and a socket's path must stay under 108 bytes: a folder in
    pytest-xdist's tmp_path (one level deeper, and deeper again as pytest's run counter grows) is too
    deep for that, and the worker's batch is then never sent (the loop waits for it for good)."""
    tmp = tempfile.mkdtemp(prefix="dlwatch-t-")
    try:
        yield pathlib.Path(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def tmpdir_of_length():
    """``make(n)``: a directory of exactly ``n`` bytes, made under /tmp (short: room to reach any length) and
    removed after; a TMPDIR of a chosen length for the tests of the socket paths workers bind under it."""
    made = []

    def make(n: int) -> str:
        top = tempfile.mkdtemp(prefix="dlw-len-", dir="/tmp")
        made.append(top)
        path = os.path.join(top, "d" * (n - len(top) - 1))
        os.makedirs(path)
        assert len(path) == n
        return path

    try:
        yield make
    finally:
        for top in made:
            shutil.rmtree(top, ignore_errors=True)


def drop_traceback(info) -> None:
    """Free a DataLoader iterator that raised, now rather than at some later GC.

    torch's reraise keeps the exception in a local of a frame of its own traceback: a cycle
    that holds the iterator and its workers until the cycle collector runs, and an iterator
    collected that way waits 5 s per worker to shut down (its queues are finalized first).
    """
    info.value.__traceback__ = None
    info._excinfo = None


def batches_of(loader) -> list:
    """Batches of the tests' Squares datasets as plain lists, to compare epochs exactly."""
    return [(x.tolist(), y.tolist()) for x, y in loader]


def incidents(report_dir: str) -> list[str]:
    if not os.path.isdir(report_dir):
        return []
    return sorted(
        os.path.join(report_dir, n)
        for n in os.listdir(report_dir)
        if not n.startswith(".") and os.path.exists(os.path.join(report_dir, n, "report.json"))
    )


def load(incident: str) -> dict:
    import json

    import reasoncheck

    with open(os.path.join(incident, "report.json")) as f:
        report = json.load(f)
    if report.get("trigger") == "stall" and report.get("classification_reason"):
        reasoncheck.check(report)  # every stall test: the verdict's line agrees with its evidence
    return report


def fuzz_fields(base: dict, paths: list, target_dir, filename: str, load, render, *, examples: int = 200) -> None:
    """Put values of any type at each of ``paths`` in ``base``, write it as ``filename`` in
    ``target_dir``: ``load`` either refuses it (ReportError) or ``render(loaded)`` works, and
    where it returns a page, the page's scripts are only its own three (no string got out of
    its escaping)."""
    import json

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from dlwatch.errors import ReportError

    values = st.recursive(
        st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
        max_leaves=8,
    )
    base = json.loads(json.dumps(base))

    @settings(max_examples=examples, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(paths), values)
    def check(path, value):
        doc = json.loads(json.dumps(base))
        node = doc
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        with open(os.path.join(str(target_dir), filename), "w") as f:
            json.dump(doc, f)
        try:
            loaded = load(str(target_dir))
        except ReportError:
            return
        page = render(loaded)
        if page is not None:
            assert page.count("</script>") == 3

    check()


def chromium_path() -> str | None:
    """A headless-capable Chromium on PATH (what .ci/run installs), or None."""
    import shutil

    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        found = shutil.which(name)
        if found:
            return found
    return None


def run_bounded(argv: list, *, env: dict, cwd: str, timeout: float = 120) -> tuple[int, str, str]:
    """Run a command in its own session; whatever it started is killed when it ends or outlives
    the bound (a hung DataLoader worker included). Returns (returncode, stdout, stderr)."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    known: set[int] = set()
    try:
        out, err = proc.communicate(timeout=timeout)
        return proc.returncode, out, err
    finally:
        known.update(p.pid for p in descendants_of(proc.pid))
        kill_session(proc.pid, known)
        proc.wait()


def in_private_mount_namespace(cmd: str, *, env: dict, timeout: float) -> tuple[int, str, str]:
    """``sh -c cmd`` in a private mount namespace of its own (so it may mount a small tmpfs
    without touching the machine), in its own session, killed with all it started if it outlives
    the bound.  Skips the test where unshare is missing or a mount namespace is not permitted."""
    import shutil

    if not shutil.which("unshare"):
        pytest.skip("unshare is not installed")
    probe = subprocess.run(["unshare", "--mount", "--propagation", "private", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no private mount namespace here: {probe.stderr.decode().strip()}")
    proc = subprocess.Popen(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", cmd],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            kill_tree(proc.pid)
            proc.wait()
    return proc.returncode, out, err


def processes_with(marker: str) -> list[psutil.Process]:
    """Live (not zombie) processes whose command line contains ``marker``: what a test's run left behind."""
    out = []
    for p in psutil.process_iter(["cmdline", "status"]):
        try:
            if p.info["status"] != psutil.STATUS_ZOMBIE and marker in " ".join(p.info["cmdline"] or ()):
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return out


def run_to_end(
    argv: list, *, env: dict, marker: str, timeout: float, what: str, settle_s: float = 5.0
) -> tuple[int, str, str]:
    """Run ``argv`` in its own session until it ends by itself (the test fails after ``timeout``);
    then nothing whose command line names ``marker`` may be left after ``settle_s``.  Whatever it
    started is killed in any case, including processes in sessions of their own (torchrun's ranks)."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    )
    try:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{what} did not end by itself within {timeout} s")
        left = wait_for(lambda: not processes_with(marker), timeout=settle_s) or processes_with(marker)
        assert left is True, f"{what} left processes behind: {[(p.pid, p.name()) for p in left]}"
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        kill_tree(proc.pid)
        for p in processes_with(marker):
            kill_tree(p.pid)
    return proc.returncode, out, err


def cpu_starved(summary: dict) -> str | None:
    """Why a run's workers were starved of CPU by the machine, or None.

    A worker that is runnable (state R) much more of the time than it actually runs was waiting on
    the run queue: other processes had the cores.  An example that is "balanced" on a quiet machine
    is input-bound on such a one, and dlwatch is right to say so; a test of the quiet-machine
    verdict checks this precondition instead of failing on a loaded machine.
    """
    for w in summary.get("workers") or []:
        util = w.get("cpu_util")
        running = (w.get("state_share") or {}).get("running")
        if isinstance(util, (int, float)) and isinstance(running, (int, float)) and running - util > 0.25:
            return (
                f"worker {w.get('worker_id')} was runnable {running:.0%} of the time but ran "
                f"{util:.0%}: the machine's other load had the CPUs"
            )
    return None
