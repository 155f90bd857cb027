"""Test tiers, assigned by rule at collection (conftest.py's hooks call this module).

Nothing here lists tests: every marker comes from what a test is, so a new test lands in its
tier by itself and the tiers cannot drift.

- ``procs``: the test starts real processes.  Read from its code: the test function, the
  fixtures it uses and every helper of tests/ they name (transitively, imports inside functions
  included) are searched for a process starter (``subprocess``, ``multiprocessing``, ``pty``,
  playwright, ``os.fork``/``system``/``posix_spawn``, and the product calls in
  ``_PRODUCT_STARTERS``).  A runtime check keeps this rule honest: an audit hook counts the
  processes each test starts, and a test that starts one without the marker fails, naming this
  rule.
- ``core``: the default tier (``python -m pytest``).  Every test that starts no process, plus,
  of those that do: for each failure of the registry (``dlwatch.detect.registry``) the first
  test that runs its first example; the differential harness's ``fork`` and ``start-methods``
  groups (tests/transparency); for each verb of the CLI (``dlwatch.cli.COMMANDS``) the first
  test that runs it (``dlwatch VERB`` in an argv, or the CLI's ``main`` with VERB first) in the
  test module that runs it most often.
- ``serial``: timing-sensitive, run alone in CI's serial stage (never beside another test):
  the tests that start processes and run an example script (its verdicts are judged on the CPU
  the machine gave it), check a run's CPU starvation (``cpu_starved``) or the CPU a tune's
  candidates got (``cpu_cores``, ``wait_cores``: the bound it names), or look for dlwatch's
  notices on a real run's stderr (a loaded machine earns a healthy run real advice).

CI runs the rest with ``--dist loadscope``: each module's tests on one xdist worker, one after the
other. That keeps together what must not run twice or side by side: a harness group's programs
(run once per process by harness.results), a module-scoped fixture's processes, and a module's
machine-wide process scans by command line (conftest.processes_with, run_to_end: each module
scans for its own target script, and would see and kill another worker's).  (``xdist_group``
with ``--dist loadgroup`` does not group at all with pytest 9.2: pytest-xdist issue 1386.)
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import threading
import types
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(TESTS)
EXAMPLES = os.path.join(REPO, "examples")

TIERS = ("core", "rest", "all")
MARKERS = {
    "procs": "starts real processes (assigned by rule: tests/tiers.py)",
    "core": "in the default tier, `python -m pytest` (assigned by rule: tests/tiers.py)",
    "serial": "timing-sensitive: CI runs it alone, never beside another test (assigned by rule: tests/tiers.py)",
}

# modules whose use starts a process (playwright: its driver and the browser), and os's functions that do
_PROCESS_MODULES = ("subprocess", "multiprocessing", "pty", "concurrent.futures.process", "playwright")
_OS_STARTERS = frozenset({"fork", "forkpty", "system", "popen", "posix_spawn", "posix_spawnp", "spawnv", "spawnve"})
# product entry points that start a process when called: watch() starts the monitor, a report's
# writer (and the monitor's summary) the child that draws its report.html, the stack dumps py-spy,
# the demo an example; and torch's DataLoader
_PRODUCT_STARTERS = frozenset(
    {
        "dlwatch.watch",
        "dlwatch.inproc.agent.watch",
        "dlwatch.report.build.write",
        "dlwatch.report.html.spawn_render",
        "dlwatch.monitor.loop.Monitor._write_summary",
        "dlwatch.collect.stacks.dump_stack",
        "dlwatch.collect.stacks.dump_stacks",
        "dlwatch.cli.demo_cmd.run_example",
        # a monitor's handlers write incidents (each draws its report.html in a child); the reader of a
        # target's source files forks a child that takes the target's uid
        "dlwatch.monitor.loop.Monitor",
        "dlwatch.collect.source.SourceReader",
        # a DataLoader with workers forks them (how many it has is not read: one with none is counted too)
        "torch.utils.data.dataloader.DataLoader",
    }
)
# the harness groups in the core tier: the default start method, and the others
CORE_TRANSPARENCY_GROUPS = ("fork", "start-methods")
# a test that reaches one of these judges the CPU a run got (a run's starvation; the cores a tune's
# candidate used and its workers' wait for one): timing-sensitive
_TIMING_NAMES = frozenset({"cpu_starved", "cpu_cores", "wait_cores"})


# --------------------------------------------------------------------------- reading a test's code


def _in_tests(obj: Any) -> bool:
    code = getattr(obj, "__code__", None)
    path = code.co_filename if code is not None else getattr(obj, "__file__", None)
    return bool(path) and os.path.abspath(path).startswith(TESTS + os.sep)


def _qualname(obj: Any) -> str:
    return f"{getattr(obj, '__module__', '')}.{getattr(obj, '__qualname__', getattr(obj, '__name__', ''))}"


def _is_starter(value: Any, names: frozenset[str]) -> bool:
    """Whether a name's value starts processes, given every name its code uses (a module's
    functions are named as attributes: ``os.fork``, ``build.write``)."""
    if isinstance(value, types.ModuleType):
        if value.__name__ == "os":
            return bool(names & _OS_STARTERS)
        if value.__name__.startswith(_PROCESS_MODULES):
            return True
        return _module_starts(value.__name__, names)
    module = getattr(value, "__module__", None) or ""
    if module.startswith(_PROCESS_MODULES) or _qualname(value) in _PRODUCT_STARTERS:
        return True
    return inspect.isclass(value) and any(f"{_qualname(value)}.{attr}" in _PRODUCT_STARTERS for attr in names)


def _module_starts(module: str, names: frozenset[str]) -> bool:
    """A product starter reached through its module: ``dlwatch`` and ``watch``, ``build`` and ``write``,
    or ``dlwatch.monitor.loop``, ``Monitor`` and ``_write_summary`` (a function's own import)."""
    prefix = module + "."
    return any(s.startswith(prefix) and set(s[len(prefix) :].split(".")) <= names for s in _PRODUCT_STARTERS)


def _names_process_module(text: str) -> bool:
    """A string that names a process module ("playwright.sync_api" given to pytest.importorskip)."""
    return any(text == m or text.startswith(m + ".") for m in _PROCESS_MODULES)


class _Reader:
    """What a test's code reaches: names, string constants, process starters (memoised per function)."""

    def __init__(self) -> None:
        self._seen: dict[int, tuple[bool, frozenset[str], frozenset[str]]] = {}

    def function(self, func: Any) -> tuple[bool, frozenset[str], frozenset[str]]:
        """(starts processes, every name reached, every string constant of the function itself)."""
        func = inspect.unwrap(func)
        inner = getattr(getattr(func, "hypothesis", None), "inner_test", None)  # a @given test's own body
        func = inspect.unwrap(inner) if inner is not None else func
        key = id(func)
        if key in self._seen:
            return self._seen[key]
        self._seen[key] = (False, frozenset(), frozenset())  # a recursion ends here
        code = getattr(func, "__code__", None)
        if code is None:
            return self._seen[key]
        names: set[str] = set()
        consts: set[str] = set()
        _code_names(code, names, consts)
        frozen = frozenset(names)
        starts = any(_names_process_module(c) for c in consts)
        reached = set(names)
        globs = getattr(func, "__globals__", {})
        for name in names:
            # a module imported inside the function is no global: the module of that name
            value = globs.get(name, sys.modules.get(name))
            if value is None:
                # a module imported inside the function and not imported yet: its name is enough
                starts = starts or _names_process_module(name) or _module_starts(name, frozen)
                continue
            if _is_starter(value, frozen):
                starts = True
            for helper in _helpers(value, frozen):
                s, n, _ = self.function(helper)
                starts = starts or s
                reached |= n
        self._seen[key] = (starts, frozenset(reached), frozenset(consts))
        return self._seen[key]


def cli_verbs_run(func: Any) -> frozenset[str]:
    """The verbs a test's own code runs as ``dlwatch VERB``: the word after "dlwatch" in an argv
    (``[sys.executable, "-m", "dlwatch", "run", ...]``), or the first word of the argv handed to
    the CLI's ``main`` (read from the source: pytest's assertion rewriting reorders the bytecode)."""
    import ast
    import textwrap

    from dlwatch.cli import COMMANDS, main

    func = inspect.unwrap(func)
    func = getattr(getattr(func, "hypothesis", None), "inner_test", None) or func
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError, SyntaxError):
        return frozenset()
    globs = getattr(func, "__globals__", {})
    verbs: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.List, ast.Tuple)):
            words = [e.value if isinstance(e, ast.Constant) else None for e in node.elts]
            verbs.update(w for prev, w in zip(words, words[1:]) if prev == "dlwatch" and w in COMMANDS)
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and globs.get(node.func.id) is main:
            argv = node.args[0] if node.args else None
            if isinstance(argv, (ast.List, ast.Tuple)) and argv.elts and isinstance(argv.elts[0], ast.Constant):
                if argv.elts[0].value in COMMANDS:
                    verbs.add(argv.elts[0].value)
    return frozenset(verbs)


def _code_names(code: types.CodeType, names: set[str], consts: set[str]) -> None:
    names.update(code.co_names)
    for c in code.co_consts:
        if isinstance(c, types.CodeType):
            _code_names(c, names, consts)
        elif isinstance(c, str):
            consts.add(c)
        elif isinstance(c, tuple):
            consts.update(x for x in c if isinstance(x, str))


def _helpers(value: Any, names: frozenset[str]) -> Iterable[Any]:
    """The functions of tests/ that a name leads to: a function, a class's methods, a module's
    functions named as its attributes."""
    if isinstance(value, types.ModuleType):
        if _in_tests(value):
            for attr in names:
                yield from _helpers(getattr(value, attr, None), frozenset())
        return
    if inspect.isclass(value):
        if value.__module__ in sys.modules and _in_tests(sys.modules[value.__module__]):
            for member in vars(value).values():
                member = getattr(member, "__func__", member)
                if isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member):
                    yield member
        return
    if inspect.isfunction(value) and _in_tests(value):
        yield value


# --------------------------------------------------------------------------- the rules


def _fixture_funcs(item: pytest.Item) -> Iterable[Any]:
    info = getattr(item, "_fixtureinfo", None)
    if info is None:
        return
    for defs in info.name2fixturedefs.values():
        for d in defs:
            if _in_tests(d.func):
                yield d


@dataclass(frozen=True)
class Facts:
    """What the rules read of one test."""

    starts: bool  # it starts processes (its code, its fixtures', their helpers')
    names: frozenset[str]  # every name reached
    examples: frozenset[str]  # the example scripts it runs (by name, from its code or its fixtures')
    verbs: frozenset[str]  # the CLI verbs its own code runs
    reads_dlwatch_voice: bool  # it looks for dlwatch's notices ("dlwatch: ...") on a real run's stderr


def facts_of(item: pytest.Item, reader: "_Reader") -> Facts:
    func = getattr(item, "obj", None)
    starts, names, consts = reader.function(func) if func is not None else (False, frozenset(), frozenset())
    for d in _fixture_funcs(item):
        s, n, c = reader.function(d.func)
        starts, names, consts = starts or s, names | n, consts | c
    callspec = getattr(item, "callspec", None)
    if callspec is not None:  # @pytest.mark.parametrize("name", ["healthy_fast", ...])
        consts |= frozenset(v for v in callspec.params.values() if isinstance(v, str))
    return Facts(
        starts=starts,
        names=names,
        examples=_examples_run(consts, names) if starts else frozenset(),
        verbs=cli_verbs_run(func) if starts and func is not None else frozenset(),
        reads_dlwatch_voice="dlwatch:" in consts,
    )


def classify(items: list[pytest.Item]) -> None:
    """Add the tier markers to every item (in collection order: 'first' means first in it)."""
    reader = _Reader()
    facts = {item.nodeid: facts_of(item, reader) for item in items}
    for item in items:
        f = facts[item.nodeid]
        if not f.starts:
            continue
        item.add_marker(pytest.mark.procs)
        if f.examples or f.names & _TIMING_NAMES or f.reads_dlwatch_voice:
            item.add_marker(pytest.mark.serial)

    procs = [item for item in items if facts[item.nodeid].starts]
    core = {item.nodeid for item in items if not facts[item.nodeid].starts}
    # one real example per failure family: the first test that runs the family's first example
    for name in _first_examples():
        found = next((i for i in procs if name in facts[i.nodeid].examples), None)
        if found is not None:
            core.add(found.nodeid)
    # each CLI verb, run for real: the first test of the verb's home module (the test module that
    # runs it most often) that runs it
    for verb in _cli_verbs():
        running = [i for i in procs if verb in facts[i.nodeid].verbs]
        if running:
            counts = Counter(i.nodeid.split("::")[0] for i in running)
            home = max(counts, key=lambda m: counts[m])  # ties: the first in collection order
            core.add(next(i for i in running if i.nodeid.split("::")[0] == home).nodeid)
    # the differential harness's default start method and the others
    core.update(i.nodeid for i in procs if _harness_group(i) in CORE_TRANSPARENCY_GROUPS)
    for item in items:
        if item.nodeid in core:
            item.add_marker(pytest.mark.core)


def _harness_group(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or not item.nodeid.startswith("tests/transparency/"):
        return None
    group = callspec.params.get("group")
    return group if isinstance(group, str) else None


@functools.lru_cache(maxsize=1)
def _example_names() -> frozenset[str]:
    return frozenset(n[:-3] for n in os.listdir(EXAMPLES) if n.endswith(".py") and not n.startswith("_"))


def _examples_run(consts: frozenset[str], names: frozenset[str]) -> frozenset[str]:
    """The example scripts a test runs: it names one ("lock_owner" or "lock_owner.py") and reaches
    the examples folder (a helper's ``EXAMPLES``, or "examples" in a path it joins)."""
    if "EXAMPLES" not in names and "examples" not in consts:
        return frozenset()
    return frozenset(c[:-3] if c.endswith(".py") else c for c in consts) & _example_names()


def _first_examples() -> list[str]:
    from dlwatch.detect import registry

    return [f.examples[0] for f in registry.failures() if f.examples]


def _cli_verbs() -> tuple[str, ...]:
    from dlwatch.cli import COMMANDS

    return COMMANDS


def tier(config: pytest.Config) -> str:
    """``--tier``; without it, ``core`` when pytest runs its testpaths (``python -m pytest``), and
    ``all`` when files or test ids are named (what was named runs, whatever its tier)."""
    chosen = config.getoption("tier")
    if chosen:
        return chosen
    return "core" if config.args_source == pytest.Config.ArgsSource.TESTPATHS else "all"


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the tier asked for; the others are deselected (pytest counts them as such)."""
    tier_ = tier(config)
    if tier_ == "all":
        return
    keep = [i for i in items if (i.get_closest_marker("core") is not None) == (tier_ == "core")]
    dropped = [i for i in items if (i.get_closest_marker("core") is not None) != (tier_ == "core")]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep


# --------------------------------------------------------------------------- the runtime check of the rule

_PROCESS_EVENTS = frozenset({"os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "subprocess.Popen"})
_PID = os.getpid()
_started: list[tuple[str, int]] = []  # (event, thread) since the current test's setup began
_before: set[int] = set()  # threads alive when it began (a thread an earlier test left is not this test's)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in _PROCESS_EVENTS and os.getpid() == _PID:
        _started.append((event, threading.get_ident()))


def install_guard() -> None:
    """Count the processes this (pytest's) process starts: audit events, and multiprocessing's
    spawn and forkserver starts, which call _posixsubprocess.fork_exec without one."""
    import _posixsubprocess

    sys.addaudithook(_audit)
    fork_exec = _posixsubprocess.fork_exec

    def counted(*args: Any, **kwargs: Any) -> Any:
        _audit("os.posix_spawn", ())
        return fork_exec(*args, **kwargs)

    _posixsubprocess.fork_exec = counted


def guard_start() -> None:
    _started.clear()
    _before.clear()
    _before.update(t.ident for t in threading.enumerate() if t is not threading.main_thread() and t.ident)


def guard_check(item: pytest.Item) -> None:
    """Fail a test that started a process without the ``procs`` marker: the rule missed a starter."""
    mine = sorted({event for event, thread in _started if thread not in _before})
    if mine and item.get_closest_marker("procs") is None:
        raise AssertionError(
            f"this test started processes ({', '.join(mine)}) but the tiers rule did not mark it `procs`: "
            "teach tests/tiers.py the process starter it uses (see its docstring)"
        )
