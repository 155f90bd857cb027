"""Helpers shared by the benchmarks: which dlwatch is measured (a normal install), statistics, starting
targets, killing whole process trees."""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Iterator, Mapping, Sequence

import psutil

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TARGETS = os.path.join(HERE, "targets.py")


def add_install_option(ap: argparse.ArgumentParser) -> None:
    ap.add_argument(
        "--editable",
        action="store_true",
        help="measure dlwatch from a source tree (an editable install, the checkout on sys.path) instead of "
        "refusing: users run the normal install (`pip install .`), which costs differently",
    )


def dlwatch_under_test(*, editable: bool = False, env: Mapping[str, str] | None = None) -> str:
    """The dlwatch a benchmark measures (its package directory), printed; the normal install by default.

    Both the one this process imported (if any) and the one a fresh process gets (from a scratch
    directory, with ``env``: what ``python -m dlwatch run`` children get) are looked at.  One from a
    source tree (a folder with a pyproject.toml above the package: an editable install, or the
    checkout first on sys.path) ends the benchmark with a one-line error unless ``editable``
    (each benchmark's ``--editable``): the normal install is what users run, and its per-iteration
    cost under ``dlwatch run`` was measured several times the editable one's.
    """
    probe = subprocess.run(
        [sys.executable, "-c", "import os, dlwatch; print(os.path.dirname(os.path.realpath(dlwatch.__file__)))"],
        cwd=tempfile.gettempdir(),
        env=None if env is None else dict(env),
        capture_output=True,
        text=True,
        timeout=60,
    )
    if probe.returncode != 0:
        raise SystemExit(f"bench: a fresh {sys.executable} cannot import dlwatch: {probe.stderr.strip()[-300:]}")
    found = [probe.stdout.strip()]
    own = sys.modules.get("dlwatch")
    if own is not None and getattr(own, "__file__", None):
        found.append(os.path.dirname(os.path.realpath(own.__file__)))
    source = sorted({d for d in found if os.path.isfile(os.path.join(os.path.dirname(d), "pyproject.toml"))})
    if source and not editable:
        raise SystemExit(
            f"bench: dlwatch is imported from the source tree {source[0]}, not from an install; benchmarks measure "
            "what users run: `pip install torch==2.13.0 && pip install .` in a fresh venv, then run this from "
            "outside the checkout (or pass --editable to measure the source tree)"
        )
    if len(set(found)) > 1:
        raise SystemExit(f"bench: this process imports dlwatch from {found[1]}, a fresh one from {found[0]}")
    print(f"dlwatch under test: {found[0]} ({'source tree' if source else 'installed'})", flush=True)
    return found[0]


def median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def load_average() -> float:
    return os.getloadavg()[0]


def kill_tree(pid: int) -> None:
    """SIGKILL pid and every descendant (hung DataLoader workers never exit on their own)."""
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        procs = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.kill()
    with contextlib.suppress(OSError):
        os.killpg(pid, signal.SIGKILL)  # targets run in their own session: group id == pid
    psutil.wait_procs(procs, timeout=5)


class Target:
    """``python bench/targets.py MODE ARGS...`` in its own session; it prints one 'ready ...' line."""

    def __init__(self, *args: str, env: dict[str, str] | None = None) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, TARGETS, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            env=env,
        )
        self.pid = self.proc.pid

    def wait_ready(self, timeout: float) -> list[str]:
        """The words after 'ready' on the target's first stdout line."""
        fd = self.proc.stdout.fileno()  # type: ignore[union-attr]
        buf = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            readable, _, _ = select.select([fd], [], [], 0.05)
            if readable:
                chunk = os.read(fd, 4096)
                buf += chunk
                if b"\n" in buf:
                    words = buf.split(b"\n", 1)[0].decode().split()
                    if words[:1] == ["ready"]:
                        return words[1:]
                    raise RuntimeError(f"target said {words!r}")
                if not chunk and self.proc.poll() is not None:
                    break
        err = b""
        if self.proc.poll() is not None:
            err = self.proc.stderr.read()  # type: ignore[union-attr]
        raise RuntimeError(f"target not ready after {timeout:g} s: {err.decode(errors='replace')[-1500:]}")

    def kill(self) -> None:
        kill_tree(self.pid)
        with contextlib.suppress(Exception):
            self.proc.wait(5)
        for stream in (self.proc.stdout, self.proc.stderr):
            with contextlib.suppress(Exception):
                stream.close()  # type: ignore[union-attr]


@contextlib.contextmanager
def target(
    *args: str, ready_timeout: float = 60.0, env: dict[str, str] | None = None
) -> Iterator[tuple[Target, list[str]]]:
    t = Target(*args, env=env)
    try:
        yield t, t.wait_ready(ready_timeout)
    finally:
        t.kill()


def proc_cpu_s(pid: int) -> float:
    """utime + stime of pid from /proc/<pid>/stat, in seconds."""
    with open(f"/proc/{pid}/stat", "rb") as f:
        text = f.read().decode()
    rest = text[text.rfind(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def proc_status_kib(pid: int, key: str) -> int | None:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


TORCH_VERSION = "2.13.0"  # the only torch to use here (a plain `torch` requirement pulls a multi-GB CUDA build)


def normal_install(venv: str, checkout: str = REPO, extra: Sequence[str] = ()) -> str:
    """``checkout`` installed the way users install it, ``pip install .`` (not editable), in the venv
    ``venv`` with torch==TORCH_VERSION and the ``extra`` requirements; returns the venv's python.

    The venv is made on the first call and kept (torch is the slow part); dlwatch is installed anew at
    every call, so the figures are of the tree as it is now.  An editable install is not what users run:
    its modules are read from the tree, with no bytecode compiled at install.
    """
    python = os.path.join(venv, "bin", "python")
    pip = [python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    ready = os.path.join(venv, ".dlwatch-bench-ready")  # written once torch and the rest are in
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "src")  # a copy: nothing the build writes (build/, *.egg-info) lands in the tree
        shutil.copytree(
            checkout,
            src,
            ignore=shutil.ignore_patterns(".git", "build", "*.egg-info", "__pycache__", "dlwatch-reports"),
        )
        if not os.path.exists(ready):
            shutil.rmtree(venv, ignore_errors=True)
            subprocess.run([sys.executable, "-m", "venv", venv], check=True)
            subprocess.run([*pip, f"torch=={TORCH_VERSION}", *extra, src], check=True)
            with open(ready, "w"):
                pass
        else:
            if extra:
                subprocess.run([*pip, *extra], check=True)
            subprocess.run([*pip, "--force-reinstall", "--no-deps", src], check=True)
    return python
