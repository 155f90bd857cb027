"""Starting dlwatch's own Python processes isolated from the directory they start in.

``python -m dlwatch.monitor.loop`` would put the training program's working directory
first on ``sys.path`` (and ``PYTHONPATH`` entries after it): a ``select.py`` left
there would run inside the monitor.  So every Python dlwatch starts runs with
``-I`` (no working directory or script directory on the path, no PYTHONPATH, no
user site), and a short bootstrap then loads *this* dlwatch from its own
directory by file location, and appends, after the standard library and
site-packages, only the directories where this process found dlwatch's
dependencies (a ``pip install --user`` for instance).  Nothing can shadow a
standard-library module, and nothing else from those directories is put first.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import sys
from typing import Iterator, Sequence

PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))
MONITOR_DEPS = ("psutil", "structlog", "pynvml", "tomli", "prometheus_client")  # the last only if installed

# Runs under -I: argv[1] is a JSON spec; the rest is the program's own argv.  With "quiet_int", SIGINT
# (blocked by the parent around the spawn, see sigint_blocked) is ignored before it is unblocked: a
# terminal's Ctrl-C reaches the whole foreground group, and it is the training program's to handle.
_BOOTSTRAP = (
    "import sys,json,importlib.util as u\n"
    "a=json.loads(sys.argv.pop(1))\n"
    "if a.get('quiet_int'):import signal as g;g.signal(g.SIGINT,g.SIG_IGN);g.pthread_sigmask(g.SIG_UNBLOCK,[g.SIGINT])\n"
    "sys.path[:0]=a['first']\n"
    "sys.path.extend(p for p in a['path'] if p not in sys.path)\n"
    "s=u.spec_from_file_location('dlwatch',a['pkg']+'/__init__.py',submodule_search_locations=[a['pkg']])\n"
    "m=u.module_from_spec(s);sys.modules['dlwatch']=m;s.loader.exec_module(m)\n"
    "import runpy\n"
    "if a.get('module'):runpy.run_module(a['module'],run_name='__main__',alter_sys=True)\n"
    "else:runpy.run_path(a['script'],run_name='__main__')\n"
)


def _path_entry(name: str) -> str | None:
    """The sys.path entry this process would import ``name`` from (without importing it)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or spec.origin in ("built-in", "frozen"):
        return None
    entry = os.path.dirname(spec.origin)
    if spec.submodule_search_locations is not None:  # a package: its parent is the entry
        entry = os.path.dirname(entry)
    return entry


def dependency_path(names: Sequence[str]) -> list[str]:
    """Where ``names`` live, without the working directory (never trusted) or dlwatch's own parent."""
    try:
        cwd: str | None = os.path.realpath(os.getcwd())
    except OSError:  # the working directory was removed under the job: nothing can be imported from it
        cwd = None
    out: list[str] = []
    for name in names:
        entry = _path_entry(name)
        if entry and os.path.isabs(entry) and os.path.realpath(entry) != cwd and entry not in out:
            out.append(entry)
    return out


@contextlib.contextmanager
def sigint_blocked() -> Iterator[None]:
    """SIGINT blocked in this thread while a child is spawned: the child starts with it blocked (the mask
    survives exec) until its bootstrap ignores it (``ignore_sigint``).  A Ctrl-C meanwhile stays pending
    for this process and is delivered, unchanged, when the mask is restored a moment later."""
    try:
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    except (AttributeError, OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def python_argv(
    *,
    module: str | None = None,
    script: str | None = None,
    args: Sequence[str] = (),
    deps: Sequence[str] = MONITOR_DEPS,
    first: Sequence[str] = (),
    ignore_sigint: bool = False,
) -> list[str]:
    """``[sys.executable, "-I", "-c", bootstrap, spec, *args]`` running ``module`` (``-m`` style) or ``script``.

    ``first`` are directories put before everything (only dlwatch's own, e.g. the
    examples folder for ``dlwatch demo``).
    """
    spec = {
        "pkg": PACKAGE_DIR,
        "path": dependency_path(deps),
        "first": list(first),
        "module": module,
        "script": script,
        "quiet_int": ignore_sigint,
    }
    return [sys.executable, "-I", "-c", _BOOTSTRAP, json.dumps(spec), *args]
