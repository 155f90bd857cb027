"""Write the docs' lists from where they are declared, or check that the committed docs match.

    python docs/gendocs.py           rewrite every generated block in place
    python docs/gendocs.py --check   exit 1 and name each block that differs (tests/test_docs.py runs this)

A generated block sits between two marker lines in a Markdown file::

    <!-- generated: NAME (python docs/gendocs.py) -->
    ...
    <!-- end generated: NAME -->

and is written from its source, never by hand:

- ``playbooks``: the playbook table (id, kind, title), from playbooks/*.toml;
- ``playbook-ids``: the shipped ids, failures and advice, from the same files;
- ``thresholds``: every ``[thresholds]`` key a playbook file sets, its default and the file's
  own comment on that line (a comment ending in ``...`` goes on in the next line's);
- ``examples``: the examples table, from the failure registry (``FAILURE.examples``), the
  demo's healthy and advice lists and each script's docstring;
- ``modules``: each folder of the package with its modules and their docstring's first line;
- ``failure-ids``: the failure ids in a sentence (for the README's test section);
- ``sample-<name>``: what a command printed, as docs/capture.py recorded it in docs/samples/;
- ``bench-table``, ``tune-table``: a benchmark's table from the raw figures it saved (bench/results.json,
  bench/tune_results.json), as its ``--table-from`` prints it;
- ``run-cost``: what ``dlwatch run`` costs, in words (the README), from bench/run_iteration_cost.json.

Adding a failure or an example therefore changes these files only through this script.
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import sys
from typing import Callable, Iterable

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if REPO not in sys.path:
    sys.path.insert(0, REPO)

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

PLAYBOOKS = os.path.join(REPO, "playbooks")
EXAMPLES = os.path.join(REPO, "examples")
PACKAGE = os.path.join(REPO, "dlwatch")

# The files that hold generated blocks (a block's name may appear in several).
FILES = ("README.md", "playbooks/README.md", "examples/README.md", "docs/design.md", "docs/benchmarks.md")

BEGIN = "<!-- generated: {name} (python docs/gendocs.py) -->"
END = "<!-- end generated: {name} -->"
_BLOCK = re.compile(
    r"^<!-- generated: (?P<name>[a-z0-9-]+) \(python docs/gendocs\.py\) -->\n(?P<body>.*?)^<!-- end generated: (?P=name) -->$",
    re.S | re.M,
)


# --------------------------------------------------------------------------- sources


def _playbook_files() -> list[tuple[str, dict, str]]:
    """(file name, parsed TOML, raw text) of each shipped playbook, by id."""
    out = []
    for name in sorted(os.listdir(PLAYBOOKS)):
        if name.endswith(".toml"):
            with open(os.path.join(PLAYBOOKS, name), "rb") as f:
                raw = f.read()
            out.append((name, tomllib.loads(raw.decode("utf-8")), raw.decode("utf-8")))
    return out


def _kind(doc: dict) -> str:
    return doc.get("kind", "failure")


def _docstring_line(path: str) -> str:
    """The first sentence of a module's docstring (its first paragraph, up to the first full stop)."""
    with open(path, encoding="utf-8") as f:
        doc = ast.get_docstring(ast.parse(f.read())) or ""
    paragraph = " ".join(doc.strip().split("\n\n")[0].split())
    end = paragraph.find(". ")
    return paragraph[: end + 1] if end >= 0 else paragraph


def _cell(text: str) -> str:
    return text.replace("|", "\\|").strip()


# --------------------------------------------------------------------------- blocks


def playbooks_table() -> str:
    """Failures first (each ends as an incident report), then advice (the run summary and preflight)."""
    rows = ["| id | becomes | what it names |", "|---|---|---|"]
    docs = [doc for _, doc, _ in _playbook_files()]
    for kind, becomes in (("failure", "an incident"), ("advice", "advice")):
        for doc in docs:
            if _kind(doc) == kind:
                rows.append(f"| `{doc['id']}` | {becomes} | {_cell(doc['title'])} |")
    return "\n".join(rows)


def _ids(kind: str) -> list[str]:
    return [doc["id"] for _, doc, _ in _playbook_files() if _kind(doc) == kind]


def playbook_ids() -> str:
    failures = ", ".join(f"`{i}`" for i in _ids("failure"))
    advice = ", ".join(f"`{i}`" for i in _ids("advice"))
    return (
        f"Shipped ids (a public contract, never renamed): {failures}; and the advice ids "
        f'(`kind = "advice"`, for the run summary and the preflight check, never an incident): {advice}.'
    )


def failure_ids() -> str:
    return ", ".join(f"`{i}`" for i in _ids("failure"))


_KEY = re.compile(r"^(?P<key>[A-Za-z_][A-Za-z0-9_]*)\s*=\s*(?P<value>[^#]+?)\s*(?:#\s*(?P<comment>.*))?$")


def _threshold_lines(raw: str) -> Iterable[tuple[str, str]]:
    """(key, comment) of each line of a file's [thresholds] table, in file order."""
    inside = False
    for line in raw.splitlines():
        stripped = line.strip()
        if stripped.startswith("["):
            inside = stripped == "[thresholds]"
            continue
        if inside:
            m = _KEY.match(stripped)
            if m:
                yield m["key"], (m["comment"] or "").strip()


def _value(v: object) -> str:
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, int) and v >= 1 << 20 and v % (1 << 20) == 0:
        return f"{v} ({v >> 20} MiB)"
    return str(v)


def thresholds_table() -> str:
    rows = ["| playbook | key | default | meaning |", "|---|---|---|---|"]
    for _, doc, raw in _playbook_files():
        table = doc.get("thresholds", {})
        first = True
        for key, comment in _threshold_lines(raw):
            # a comment may go on from the line before ("... by at least this much ...")
            meaning = "the finding's confidence" if key == "confidence" else comment.strip(". ").strip()
            if comment.endswith("...") or comment.startswith("..."):
                meaning = comment.strip().removeprefix("...").removesuffix("...").strip()
            pid = f"`{doc['id']}`" if first else ""
            first = False
            rows.append(f"| {pid} | `{key}` | {_value(table[key])} | {_cell(meaning)} |")
    return "\n".join(rows)


def _expected(name: str) -> str:
    from dlwatch.cli import demo_cmd
    from dlwatch.detect import registry

    failing = registry.examples()
    if name in failing:
        return f"`{failing[name]}` as the top finding"
    if name in demo_cmd.ADVICE:
        advice = demo_cmd.ADVICE[name]
        return f"no incident; run-summary advice `{advice}`" if advice else "no incident, no advice"
    if name in demo_cmd.HEALTHY:
        return "nothing (no incident)"
    raise SystemExit(f"gendocs: examples/{name}.py is in no list: declare it in its failure module or the demo's lists")


def examples_table() -> str:
    from dlwatch.cli import demo_cmd

    names = list(demo_cmd.examples())
    on_disk = sorted(n[:-3] for n in os.listdir(EXAMPLES) if n.endswith(".py") and not n.startswith("_"))
    missing = sorted(set(on_disk) - set(names))
    if missing:
        raise SystemExit(f"gendocs: examples not declared anywhere: {', '.join(missing)}")
    rows = ["| script | what happens | dlwatch should say |", "|---|---|---|"]
    for name in names:
        path = os.path.join(EXAMPLES, f"{name}.py")
        rows.append(f"| `{name}.py` | {_cell(_docstring_line(path))} | {_expected(name)} |")
    return "\n".join(rows)


def modules_table() -> str:
    rows = ["| folder | module | what it holds |", "|---|---|---|"]
    folders = [("", PACKAGE)] + sorted(  # every package below, nested ones too (inproc/agent/)
        (os.path.relpath(dirpath, PACKAGE).replace(os.sep, "/") + "/", dirpath)
        for dirpath, _, _ in os.walk(PACKAGE)
        if dirpath != PACKAGE and os.path.isfile(os.path.join(dirpath, "__init__.py"))
    )
    for label, path in folders:
        first = True
        for name in sorted(os.listdir(path)):
            if not name.endswith(".py") or name == "__main__.py" or (name == "__init__.py" and not label):
                continue
            mod = "(package)" if name == "__init__.py" else f"`{name[:-3]}`"
            folder = f"`{label or 'dlwatch/'}`" if first else ""
            first = False
            rows.append(f"| {folder} | {mod} | {_cell(_docstring_line(os.path.join(path, name)))} |")
    return "\n".join(rows)


def _sample(name: str) -> Callable[[], str]:
    """A terminal sample docs/capture.py recorded, as a fenced block."""

    def block() -> str:
        path = os.path.join(HERE, "samples", f"{name}.txt")
        with open(path, encoding="utf-8") as f:
            return "```text\n" + f.read().rstrip("\n") + "\n```"

    return block


def _bench_table(module: str, results: str) -> Callable[[], str]:
    """A benchmark's table, as its own ``--table-from`` prints it from the raw figures it saved."""

    def block() -> str:
        import importlib
        import json

        mod = importlib.import_module(f"bench.{module}")
        with open(os.path.join(REPO, "bench", results), encoding="utf-8") as f:
            data = json.load(f)
        if module == "tune":
            lines = mod.table(data["results"])
            meta = data.get("meta") or {}
            lines.append("")
            lines.append(
                f"(`python bench/tune.py`, {meta.get('started')}, {meta.get('wall_s')} s, {meta.get('cpus')} CPUs, "
                f"load average {(meta.get('load_before') or ['?'])[0]} before / {(meta.get('load_after') or ['?'])[0]} after)"
            )
            return "\n".join(lines)
        return str(mod.table(data)).rstrip("\n")

    return block


def run_cost() -> str:
    """What ``dlwatch run`` costs, in words, from the figures bench/run_iteration_cost.py saved
    (``cost --json bench/run_iteration_cost.json``): per loader iteration and once per program."""
    import json

    with open(os.path.join(REPO, "bench", "run_iteration_cost.json"), encoding="utf-8") as f:
        data = json.load(f)
    meta = data["meta"]
    two, none = data["workers2"]["medians"], data["workers0"]["medians"]

    def added(med: dict, key: str) -> float:
        return float(med["run"][key] - med["bare"][key])

    def ms(x: float) -> str:
        return f"{0.0 if abs(x) < 0.05 else x:+.1f} ms"  # never "-0.0"

    def s_or_ms(x: float) -> str:
        return f"{x / 1000:+.2f} s" if abs(x) >= 100 else f"{x:+.0f} ms"

    aa_wall = float(two["bare A/A"]["wall_ms"] - two["bare"]["wall_ms"])
    aa_cpu = float(two["bare A/A"]["cpu_ms"] - two["bare"]["cpu_ms"])
    return (
        f"What it costs (`dlwatch run` against bare `python` as separate processes, {meta['install']} install, "
        f"median of {meta['rounds']} rounds on {meta['cpus']} cores at load {meta['load_before']:g}, {meta['started']}; "
        f"`python bench/run_iteration_cost.py cost --rounds {meta['rounds']} --json bench/run_iteration_cost.json`): "
        "each loader iteration "
        f"with 2 workers {ms(added(two, 'wall_ms'))} wall and {ms(added(two, 'cpu_ms'))} CPU (bare against itself "
        f"in the same run: {ms(aa_wall)} wall, {ms(aa_cpu)} CPU; with no workers "
        f"{ms(added(none, 'wall_ms'))} wall, {ms(added(none, 'cpu_ms'))} CPU); once per program "
        f"{s_or_ms(added(two, 'start_ms'))} before the script's first line, {s_or_ms(added(two, 'first_iteration_ms'))} "
        f"on the first iteration (the monitor and the watch start), {s_or_ms(added(two, 'exit_ms'))} at exit, and "
        f"{added(two, 'process_cpu_s'):+.2f} s of CPU in all, the monitor's included. More figures: "
        "[docs/benchmarks.md](docs/benchmarks.md)."
    )


BLOCKS: dict[str, Callable[[], str]] = {
    "playbooks": playbooks_table,
    "playbook-ids": playbook_ids,
    "thresholds": thresholds_table,
    "examples": examples_table,
    "modules": modules_table,
    "failure-ids": failure_ids,
    **{f"sample-{n}": _sample(n) for n in ("demo", "report", "run", "attach")},
    "bench-table": _bench_table("run", "results.json"),
    "tune-table": _bench_table("tune", "tune_results.json"),
    "run-cost": run_cost,
}


# --------------------------------------------------------------------------- files


def render(text: str, path: str) -> str:
    """The file's text with every generated block written anew."""

    def one(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in BLOCKS:
            raise SystemExit(f"gendocs: {path}: unknown block {name!r} (known: {', '.join(BLOCKS)})")
        return f"{BEGIN.format(name=name)}\n{BLOCKS[name]()}\n{END.format(name=name)}"

    return _BLOCK.sub(one, text)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed block differs")
    args = parser.parse_args(argv)
    stale = []
    for rel in FILES:
        path = os.path.join(REPO, rel)
        with open(path, encoding="utf-8") as f:
            text = f.read()
        new = render(text, rel)
        if new != text:
            stale.append(rel)
            if not args.check:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(new)
    if args.check and stale:
        print(f"gendocs: out of date: {', '.join(stale)}; run `python docs/gendocs.py` and commit", file=sys.stderr)
        return 1
    if not args.check:
        print(f"gendocs: rewrote {', '.join(stale) or 'nothing (all up to date)'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
