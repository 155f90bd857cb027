"""The package's layout says which process runs what; these rules keep it true.

dlwatch's code runs in three processes (the training process with its workers, the
monitor, the CLI) and each folder belongs to one side (docs/design.md, "Process map"):

- ``inproc/`` runs in the training process and its workers.  It never imports
  ``monitor``, ``detect``, ``report`` or ``cli``: what the training process loads is
  what it needs, and a change in judgement or rendering cannot change the user's program.
- nothing imports ``inproc`` but the package root (``dlwatch.watch``) and ``cli/run_cmd``
  (``dlwatch run``'s bootstrap).
- the other folders form layers, each importing only those below it:
  shared helpers < ``wire`` < ``collect`` < ``detect`` < ``report`` < ``monitor`` < ``cli``.
- ``tuning/`` (``dlwatch.tune`` and ``dlwatch tune``) runs in the process that holds the loader,
  like ``inproc``, but only when a user asks for a tune: it may import the shared helpers,
  ``wire``, ``collect``, ``detect``, ``report`` and, of ``inproc``, only ``preflight`` and
  ``worker_hook``; nothing imports it but the package root (``dlwatch.tune``, lazily), and
  ``inproc`` never does (the training process of a watched run never loads the tuner).
- no import cycles between modules, lazy imports (inside functions) included.

Read from the source with ``ast``: imports inside functions count, those under
``if TYPE_CHECKING`` do not (they never run).
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from collections import defaultdict

import dlwatch

PKG_DIR = os.path.dirname(os.path.abspath(dlwatch.__file__))

SHARED = {"_entry", "_fs", "_log", "_regex", "_spawn", "_version", "errors", "redact", "model"}
LAYERS = ["shared", "wire", "collect", "detect", "report", "monitor", "cli"]
FORBIDDEN_FOR_INPROC = {"monitor", "detect", "report", "cli", "tuning"}
MAY_IMPORT_INPROC = {"dlwatch", "dlwatch.cli.run_cmd"}
TUNING_MAY_IMPORT = {"shared", "wire", "collect", "detect", "report", "tuning"}
# the training process's checks the tuner runs too (pure: no torch import, no thread, no side effect)
TUNING_MAY_IMPORT_FROM_INPROC = {"dlwatch.inproc.preflight", "dlwatch.inproc.worker_hook", "dlwatch.inproc.sockpath"}


def _modules() -> dict[str, str]:
    mods = {}
    for dirpath, dirnames, filenames in os.walk(PKG_DIR):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "vendor")]
        for name in filenames:
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                rel = os.path.relpath(path, os.path.dirname(PKG_DIR))[:-3].replace(os.sep, ".")
                mods[rel.removesuffix(".__init__")] = path
    return mods


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def _imports(mods: dict[str, str]) -> dict[str, set[str]]:
    deps: dict[str, set[str]] = defaultdict(set)
    for mod, path in mods.items():
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), path)
        skip = _type_checking_nodes(tree)
        package = mod if path.endswith("__init__.py") else mod.rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "dlwatch":
                    continue
                for alias in node.names:
                    full = f"{target}.{alias.name}"
                    deps[mod].add(full if full in mods else target)
            elif isinstance(node, ast.Import):
                deps[mod].update(a.name for a in node.names if a.name.split(".")[0] == "dlwatch")
    return deps


def _side(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return "root"
    if parts[1] in SHARED:
        return "shared"
    if parts[1] in ("__main__",):
        return "cli"
    return parts[1]


MODS = _modules()
DEPS = _imports(MODS)


def test_every_module_has_a_side():
    sides = {_side(m) for m in MODS}
    unknown = sides - set(LAYERS) - {"root", "inproc", "tuning"}
    assert not unknown, f"modules outside the layout (add them to a folder or to SHARED): {unknown}"


def test_inproc_never_imports_monitor_detect_report_or_cli():
    bad = sorted(
        f"{m} -> {d}" for m in MODS if _side(m) == "inproc" for d in DEPS[m] if _side(d) in FORBIDDEN_FOR_INPROC
    )
    assert not bad, "the training process would load judgement or rendering code:\n" + "\n".join(bad)


def test_nothing_but_the_root_and_run_imports_inproc():
    bad = sorted(
        f"{m} -> {d}"
        for m in MODS
        if _side(m) not in ("inproc", "tuning") and m not in MAY_IMPORT_INPROC
        for d in DEPS[m]
        if _side(d) == "inproc"
    )
    assert not bad, "\n".join(bad)


def test_tuning_imports_what_its_rule_allows():
    bad = sorted(
        f"{m} -> {d}"
        for m in MODS
        if _side(m) == "tuning"
        for d in DEPS[m]
        if _side(d) not in TUNING_MAY_IMPORT
        and not (_side(d) == "inproc" and d in TUNING_MAY_IMPORT_FROM_INPROC)
        and _side(d) != "root"
    )
    assert not bad, "the tuner imports outside its rule:\n" + "\n".join(bad)


def test_nothing_but_the_root_imports_tuning():
    bad = sorted(
        f"{m} -> {d}" for m in MODS if _side(m) not in ("root", "tuning") for d in DEPS[m] if _side(d) == "tuning"
    )
    assert not bad, "\n".join(bad)


def test_layers_import_only_downwards():
    rank = {name: i for i, name in enumerate(LAYERS)}
    bad = []
    for m in MODS:
        side = _side(m)
        if side not in rank:
            continue
        for d in DEPS[m]:
            dside = _side(d)
            if dside == "root":
                bad.append(f"{m} -> dlwatch (the root imports the training side lazily: import dlwatch._version)")
            elif dside in ("inproc", "tuning"):
                continue  # test_nothing_but_the_root_and_run_imports_inproc, ..._imports_tuning
            elif rank[dside] > rank[side]:
                bad.append(f"{m} ({side}) -> {d} ({dside})")
    assert not bad, "imports against the layering:\n" + "\n".join(sorted(bad))


def test_inproc_imports_only_shared_wire_collect():
    bad = sorted(
        f"{m} -> {d}"
        for m in MODS
        if _side(m) == "inproc"
        for d in DEPS[m]
        if _side(d) not in ("shared", "wire", "collect", "inproc")
    )
    assert not bad, "\n".join(bad)


def test_no_import_cycles():
    graph = {m: {d for d in DEPS[m] if d in MODS and d != m} for m in MODS}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:  # Tarjan; the graph is ~100 nodes, recursion is fine
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in graph:
        if v not in index:
            strong(v)
    # a package's __init__ importing its own modules, and them importing a sibling through it, is no cycle we mind
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_rules_see_a_violation():
    # the checker itself: a forbidden import written into a module is found
    tree = ast.parse("from dlwatch.report import store\n")
    found = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert _side(next(iter(found)) + ".x") == "report"
    assert _side("dlwatch.inproc.agent") == "inproc" and _side("dlwatch._fs") == "shared"


def test_each_folder_says_what_lives_there_and_what_it_may_import():
    for folder in ("inproc", "wire", "collect", "detect", "report", "monitor", "cli", "tuning"):
        doc = ast.get_docstring(ast.parse(open(os.path.join(PKG_DIR, folder, "__init__.py"), encoding="utf-8").read()))
        assert doc and "import" in doc.lower(), f"dlwatch/{folder}/__init__.py: say what lives there and may import"


def test_every_package_is_shipped():
    # a non-editable install carries only the packages pyproject.toml lists
    import tomllib

    root = os.path.dirname(PKG_DIR)
    with open(os.path.join(root, "pyproject.toml"), "rb") as f:
        listed = set(tomllib.load(f)["tool"]["setuptools"]["packages"])
    on_disk = {m for m, p in MODS.items() if p.endswith("__init__.py") and "._boot" not in m}
    assert on_disk <= listed, f"add to [tool.setuptools] packages: {sorted(on_disk - listed)}"


def test_dlwatch_run_starts_the_program_without_the_other_commands_imports():
    """`dlwatch run` parses its own options only: report, monitor, detect and the other commands'
    modules are not imported before the program is exec'd (they cost ~0.15 s of every run's start)."""
    code = (
        "import os, sys\n"
        "from dlwatch.cli import build_parser, run_cmd\n"
        "args = build_parser('run').parse_args(['run', '--poll-interval', '0.5', 'x.py'])\n"
        "run_cmd.program_env(args, dict(os.environ))\n"
        "print(' '.join(sorted(m for m in sys.modules if m.startswith('dlwatch'))))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=os.path.dirname(PKG_DIR),
        check=True,
    ).stdout.split()
    assert "dlwatch.cli.run_cmd" in out  # precondition: the run command was really built
    heavy = [
        m
        for m in out
        if m.split(".")[1:2] in (["report"], ["monitor"], ["detect"])
        or m.startswith("dlwatch.cli.")
        and m != "dlwatch.cli.run_cmd"
    ]
    assert heavy == [], heavy
