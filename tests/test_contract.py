"""The event contract (dlwatch/wire/contract.py) is what both sides use, and all they use.

Every event the training process or a worker sends is declared once; these tests fail when
``inproc`` sends an event (or a field) that is not declared — read from the lines of real runs
under both ``watch()`` forms and ``dlwatch run``, and from every emit site of its source — when
a declaration has no sender, and when the monitor (its handler table, a failure's schema, a
detector's ``on_event``) reads an event nobody sends.  Emitting stays what it was: no check on
the hot path, and nothing undeclared ever raises into the training process.
"""

from __future__ import annotations

import ast
import json
import os
import re
import sys
from typing import Any, Iterator


import dlwatch
from conftest import REPO, TARGETS, run_bounded
from dlwatch.detect import registry
from dlwatch.detect.base import Observer
from dlwatch.monitor.loop import Monitor
from dlwatch.wire import contract, events

PKG = os.path.dirname(os.path.abspath(dlwatch.__file__))
_TEMPLATE_EVENT = re.compile(rb'"event": "([^"\\]+)"')


# --------------------------------------------------------------------------- the declarations


def test_declarations_are_well_formed():
    assert len(contract.EVENTS) == len({e.name for e in contract.EVENTS.values()})
    for name, decl in contract.EVENTS.items():
        assert decl.name == name and re.fullmatch(r"[a-z][a-z0-9_]*", name), name
        assert decl.senders and set(decl.senders) <= {contract.TRAINING, contract.WORKER}, name
        assert decl.about, f"{name}: say what it is for"
        names = [f.name for f in decl.fields]
        assert len(names) == len(set(names)), name
        assert not set(names) & {f.name for f in contract.COMMON}, f"{name}: ts, event and pid are emit's"
        for f in decl.fields:
            assert f.kind in contract.KINDS, f"{name}.{f.name}: {f.kind}"


def test_problems_names_what_breaks_the_contract():
    ok = {"ts": 1.5, "event": "stop", "pid": 7, "clean": True, "interrupted": False}
    assert contract.problems(ok) == []
    assert contract.problems({**ok, "ended": "clean"}) == []  # optional
    assert contract.problems({**ok, "clean": 1}) == ["stop: field 'clean' = 1 is not bool"]
    assert contract.problems({k: v for k, v in ok.items() if k != "clean"}) == ["stop: field 'clean' missing"]
    assert contract.problems({**ok, "why": "x"}) == ["stop: field 'why' is not declared"]
    assert contract.problems({**ok, "event": "made_up"}) == ["event 'made_up' is not declared in dlwatch.wire.contract"]
    assert contract.problems({**ok, "pid": True})[0].startswith("pid: True is not int")
    # an event that carries evidence: its declared fields checked, the rest free
    advice = {"ts": 1.0, "event": "advice", "pid": 7, "playbook": "x", "confidence": 0.5, "anything": [1]}
    assert contract.problems(advice) == []
    assert contract.problems({**advice, "playbook": None}) == ["advice: field 'playbook' = None is not str"]
    # nullable is not optional
    reg = {"ts": 1.0, "event": "worker_registered", "pid": 9, "worker_id": 0, "ppid": 7, "start_method": None}
    assert contract.problems({**reg, "dump_path": None, "crash_output": None}) == []
    assert contract.problems(reg) == [
        "worker_registered: field 'dump_path' missing",
        "worker_registered: field 'crash_output' missing",
    ]


# --------------------------------------------------------------------------- real runs


def _captured(path: str) -> list[dict[str, Any]]:
    with open(path, "rb") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_real_runs_send_only_declared_events_and_every_declared_event_is_sent(tmp_path):
    """Every line the training process and its workers append to the events file, copied as written
    (tests/targets/contract_events.py: under watch() with workers, advice, a nested watch, a killed
    worker, a Ctrl-C; then a program under `dlwatch run`), keeps the contract; together they send
    every declared event."""
    env = dict(os.environ)
    for key in ("DLWATCH_DIR", "DLWATCH_DISABLE", "DLWATCH_ENABLED", "DLWATCH_IGNORE"):
        env.pop(key, None)
    script = os.path.join(TARGETS, "contract_events.py")
    watched, program = str(tmp_path / "watch.jsonl"), str(tmp_path / "run.jsonl")
    rc, out, err = run_bounded(
        [sys.executable, script, watched, str(tmp_path / "r1"), "watch"],
        env={**env, "PYTHONPATH": os.pathsep.join([REPO, TARGETS])},
        cwd=str(tmp_path),
        timeout=180,
    )
    assert rc == 0 and "DONE" in out.splitlines(), err[-3000:]
    assert "CAUGHT RuntimeError" in out and "CAUGHT KeyboardInterrupt" in out, out
    rc, out, err = run_bounded(
        [sys.executable, "-m", "dlwatch", "run", "--report-dir", str(tmp_path / "r2"), script, program, "-", "run"],
        env={**env, "PYTHONPATH": ""},
        cwd=str(tmp_path),
        timeout=180,
    )
    assert rc == 0 and "DONE" in out.splitlines(), err[-3000:]
    lines = _captured(watched) + _captured(program)
    bad = [f"{p} in {json.dumps(ev)[:300]}" for ev in lines for p in contract.problems(ev)]
    assert not bad, "lines that break the contract:\n" + "\n".join(bad[:20])
    seen = {ev["event"] for ev in lines}
    assert seen == set(contract.EVENTS), f"declared but not seen in the runs: {sorted(set(contract.EVENTS) - seen)}"
    # and from both kinds of sender
    workers = {ev["event"] for ev in lines if ev["event"] in ("worker_registered", "rng_fingerprint")}
    assert workers == {"worker_registered", "rng_fingerprint"}


# --------------------------------------------------------------------------- the source


class Site:
    def __init__(self, where: str, event: str | None, fields: list[str] | None, extra: bool) -> None:
        self.where, self.event, self.fields, self.extra = where, event, fields, extra


def _constants(tree: ast.Module) -> dict[str, ast.expr]:
    """Module-level NAME = value assignments."""
    out: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            out[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            out[node.target.id] = node.value
    return out


def _name(expr: ast.expr, consts: dict[str, ast.expr], depth: int = 0) -> str | None:
    """The event name an expression stands for: a string, ``contract.X(.name)``, or a module constant."""
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
        return expr.value
    if isinstance(expr, ast.Attribute) and expr.attr == "name":
        expr = expr.value
    if isinstance(expr, ast.Attribute) and isinstance(expr.value, ast.Name) and expr.value.id == "contract":
        decl = getattr(contract, expr.attr, None)
        return decl.name if isinstance(decl, contract.Event) else None
    if isinstance(expr, ast.Name) and expr.id in consts and depth < 4:
        return _name(consts[expr.id], consts, depth + 1)
    return None


def _field_names(expr: ast.expr, consts: dict[str, ast.expr], local: dict[str, list[ast.expr]]) -> list[str] | None:
    """The names of a LineFormat's fields, ``(("name", slot), ...)``, where the source spells them
    (a local assigned in several branches: all of their names)."""
    if isinstance(expr, ast.Name) and expr.id in local:
        names: list[str] = []
        for value in local[expr.id]:
            got = _field_names(value, consts, {})
            if got is None:
                return None
            names += [n for n in got if n not in names]
        return names
    if isinstance(expr, ast.Name) and expr.id in consts:
        expr = consts[expr.id]
    if not isinstance(expr, (ast.Tuple, ast.List)):
        return None
    names = []
    for elt in expr.elts:
        if isinstance(elt, ast.Starred):
            more = _field_names(elt.value, consts, local)
            if more is None:
                return None
            names += more
        elif isinstance(elt, ast.Tuple) and elt.elts and isinstance(elt.elts[0], ast.Constant):
            names.append(str(elt.elts[0].value))
        else:
            return None
    return names


def _locals(tree: ast.Module) -> dict[int, dict[str, list[ast.expr]]]:
    """For each call: the assignments of its innermost enclosing function, name -> values."""
    out: dict[int, dict[str, list[ast.expr]]] = {}

    def visit(node: ast.AST, scope: dict[str, list[ast.expr]]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner: dict[str, list[ast.expr]] = {}
                for n in ast.walk(child):
                    if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name):
                        inner.setdefault(n.targets[0].id, []).append(n.value)
                visit(child, inner)
            else:
                if isinstance(child, ast.Call):
                    out[id(child)] = scope
                visit(child, scope)

    visit(tree, {})
    return out


def _callee(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Name):
        return f.id
    if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "events":
        return f.attr
    if isinstance(f, ast.Attribute) and f.attr in ("line_format", "LineFormat"):
        return f.attr
    return None


def emit_sites(source: str, filename: str) -> Iterator[Site]:
    """Every place a module sends an event: ``events.emit(path, EVENT, **fields)``, ``line_format`` /
    ``LineFormat(EVENT, fields)`` (the %-templates), and JSON written by hand (``"event": "NAME"``
    in a bytes or str constant, ``{"event": NAME}``)."""
    tree = ast.parse(source, filename)
    consts = _constants(tree)
    scopes = _locals(tree)
    docstrings = set()  # prose may show an event's line
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    for node in ast.walk(tree):
        if id(node) in docstrings:
            continue
        where = f"{filename}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Call):
            callee = _callee(node)
            if callee == "emit" and len(node.args) >= 2:
                fields = [k.arg for k in node.keywords if k.arg is not None]
                yield Site(where, _name(node.args[1], consts), fields, any(k.arg is None for k in node.keywords))
            elif callee in ("line_format", "LineFormat") and node.args:
                local = scopes.get(id(node), {})
                fields = _field_names(node.args[1], consts, local) if len(node.args) > 1 else None
                yield Site(where, _name(node.args[0], consts), fields, fields is None)
        elif isinstance(node, ast.Constant) and isinstance(node.value, (str, bytes)):
            raw = node.value.encode() if isinstance(node.value, str) else node.value
            for m in _TEMPLATE_EVENT.finditer(raw):
                yield Site(where, m.group(1).decode(), None, True)
        elif isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and k.value == "event" and v is not None:
                    yield Site(where, _name(v, consts), None, True)


def _inproc_sources() -> Iterator[tuple[str, str]]:
    for dirpath, dirnames, filenames in os.walk(os.path.join(PKG, "inproc")):
        dirnames[:] = [d for d in dirnames if d != "__pycache__"]
        for name in sorted(filenames):
            if name.endswith(".py"):
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, PKG), f.read()


def check_sites(sites: list[Site]) -> list[str]:
    bad = []
    for s in sites:
        if s.event is None:
            bad.append(f"{s.where}: an event this check cannot read (use a name declared in dlwatch.wire.contract)")
            continue
        decl = contract.EVENTS.get(s.event)
        if decl is None:
            bad.append(f"{s.where}: event {s.event!r} is not declared in dlwatch.wire.contract")
            continue
        for name in s.fields or ():
            if decl.field(name) is None and not decl.extra:
                bad.append(f"{s.where}: {s.event} field {name!r} is not declared")
    return bad


def _inproc_sites() -> list[Site]:
    return [site for rel, source in _inproc_sources() for site in emit_sites(source, rel)]


def test_every_emit_site_of_inproc_sends_a_declared_event_with_declared_fields():
    sites = _inproc_sites()
    bad = check_sites(sites)
    assert not bad, "\n".join(bad)
    sent = {s.event for s in sites}
    assert sent == set(contract.EVENTS), f"declared, but no emit site sends: {sorted(set(contract.EVENTS) - sent)}"


def test_the_scan_finds_what_breaks_the_contract():
    source = (
        "from dlwatch.wire import contract, events\n"
        "LATER = 'made_up_too'\n"
        "events.emit(p, 'made_up', x=1)\n"
        "events.emit(p, contract.STOP.name, clean=True, bogus=1)\n"
        "events.emit(p, LATER)\n"
        "events.emit(p, name_from_somewhere)\n"
        "events.line_format('loader_iter_end', (('iteration', events.INT), ('nope', events.INT)))\n"
        'LINE = b\'{"ts": %r, "event": "hand_written", "pid": %d}\'\n'
        "events.emit(p, contract.ADVICE.name, playbook='x', **evidence)\n"  # evidence: free
    )
    bad = check_sites(list(emit_sites(source, "m.py")))
    assert bad == [
        "m.py:3: event 'made_up' is not declared in dlwatch.wire.contract",
        "m.py:4: stop field 'bogus' is not declared",
        "m.py:5: event 'made_up_too' is not declared in dlwatch.wire.contract",
        "m.py:6: an event this check cannot read (use a name declared in dlwatch.wire.contract)",
        "m.py:7: loader_iter_end field 'nope' is not declared",
        "m.py:8: event 'hand_written' is not declared in dlwatch.wire.contract",
    ]


# --------------------------------------------------------------------------- the monitor's side


def _detector_event_names() -> dict[str, str]:
    """Event names the detectors' ``on_event`` compare an event's name with: name -> where."""
    out: dict[str, str] = {}
    detect_dir = os.path.join(PKG, "detect")
    for name in sorted(os.listdir(detect_dir)):
        if not name.endswith(".py"):
            continue
        with open(os.path.join(detect_dir, name), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        consts = _constants(tree)
        for fn in ast.walk(tree):
            if not (isinstance(fn, ast.FunctionDef) and fn.name == "on_event"):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.Compare) and 'get("event")' in ast.unparse(node.left).replace("'", '"'):
                    for comp in node.comparators:
                        if name == "base.py" and ast.unparse(comp) == "self.event":
                            continue  # base.Observer: each subclass names its event (below)
                        got = _name(comp, consts)
                        out[got or f"<unreadable: {ast.unparse(comp)}>"] = f"detect/{name}:{node.lineno}"
    # a base.Observer reads the one event its class names
    for cls in registry.detector_classes():
        if issubclass(cls, Observer):
            out[cls.event or f"<no event: {cls.__qualname__}>"] = f"{cls.__module__}.{cls.__qualname__}"
    return out


def test_the_monitor_reads_only_events_somebody_sends():
    sent = {s.event for s in _inproc_sites()}
    declared = set(contract.EVENTS.values())
    # the handler table: keyed by the declarations themselves
    handled = set(Monitor.HANDLERS)
    assert handled <= declared, [e for e in handled if e not in declared]
    assert {e.name for e in handled} <= sent
    # a failure's schemas: keyed by their declarations too (a shipped failure never by a bare name)
    for f in registry.failures():
        for key in f.events:
            assert isinstance(key, contract.Event) and key in declared, f"{f.module}: {key!r} is not declared"
    assert set(registry.event_schemas()) <= sent
    # the detectors' on_event
    seen = _detector_event_names()
    assert seen, "the scan found no detector reading an event"
    unknown = {name: where for name, where in seen.items() if name not in sent}
    assert not unknown, f"detectors read events nobody sends: {unknown}"


def test_every_declared_event_has_a_reader_on_the_monitors_side():
    readers = {e.name for e in Monitor.HANDLERS} | set(registry.event_schemas()) | set(_detector_event_names())
    assert set(contract.EVENTS) <= readers, sorted(set(contract.EVENTS) - readers)


def test_the_readers_checks_are_keyed_by_declarations():
    assert set(events._OWN) <= set(contract.EVENTS)


# --------------------------------------------------------------------------- the sender never pays


def test_an_undeclared_or_unwritable_event_never_raises(tmp_path):
    path = str(tmp_path / "events.jsonl")
    assert events.emit(path, "not_declared_anywhere", anything=[1, {"x": None}]) is True
    (line,) = _captured(path)
    assert line["event"] == "not_declared_anywhere" and contract.problems(line)  # written, and the test would see it

    class Hostile:
        def __repr__(self) -> str:
            raise RuntimeError("no repr")

        __str__ = __repr__

    cycle: list[Any] = []
    cycle.append(cycle)
    for value in (Hostile(), cycle, {Hostile(): 1}, float("nan")):  # written as best it can be, or dropped
        assert isinstance(events.emit(path, "not_declared_anywhere", value=value), bool)
    assert events.emit(str(tmp_path / "missing" / "events.jsonl"), contract.STOP.name, clean=True) is False
    fmt = events.LineFormat("not_declared_either", (("n", events.INT),))
    assert fmt.emit(path, n=3) is True and fmt.emit(path, n="three") is True  # the general path, as always
    assert [ev["n"] for ev in _captured(path) if ev["event"] == "not_declared_either"] == [3, "three"]
