"""One failure = one module + its playbook file + its example (docs/design.md, "Adding a failure").

Everything particular to a failure is declared by its module in ``dlwatch/detect/``
(``FAILURE``, see :mod:`dlwatch.detect.registry`); the generic machinery finds it there.
These tests fail when per-failure code creeps back into a generic module (a failure's
playbook id, or the name of an event a failure declares, written as a string in it),
when a failure's module lacks its playbook file or example, when two modules claim one
playbook, and when what a module declares does not fit the rest (a detector configured
by another playbook, an evidence form the renderers do not know).
"""

from __future__ import annotations

import ast
import os
import sys
import tomllib

import dlwatch
from dlwatch.cli.demo_cmd import examples as demo_examples
from dlwatch.detect import build, registry
from dlwatch.report import display
from dlwatch.wire import events

PKG = os.path.dirname(os.path.abspath(dlwatch.__file__))
REPO = os.path.dirname(PKG)

# The cross-failure machinery: it must find every failure through the registry, never by name.
GENERIC = (
    "detect/__init__.py",
    "detect/match.py",
    "detect/evidence.py",
    "detect/registry.py",
    "report/display.py",
    "report/html.py",
    "monitor/loop.py",
    "wire/events.py",
)


def _shipped() -> dict[str, dict]:
    out = {}
    directory = os.path.join(REPO, "playbooks")
    for name in sorted(os.listdir(directory)):
        if name.endswith(".toml"):
            with open(os.path.join(directory, name), "rb") as f:
                doc = tomllib.load(f)
            out[doc["id"]] = doc
    return out


def _failure_ids() -> set[str]:
    return {pid for pid, doc in _shipped().items() if doc.get("kind", "failure") == "failure"}


def _strings(source: str) -> set[str]:
    """The string constants of a module, docstrings left out (prose may name a failure)."""
    tree = ast.parse(source)
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return {
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    }


def _named_in(strings: set[str], names: set[str]) -> set[str]:
    # a literal that is the name, or holds it (an f-string's part, a message)
    return {n for n in names if any(n == s or n in s for s in strings)}


def _module_strings(rel: str) -> set[str]:
    with open(os.path.join(PKG, rel), encoding="utf-8") as f:
        return _strings(f.read())


def test_generic_modules_name_no_failure():
    failure_ids = _failure_ids() | {f.playbook for f in registry.failures()}
    event_names = set(registry.event_schemas())
    assert failure_ids and event_names  # the check below has something to look for
    bad = []
    for rel in GENERIC:
        strings = _module_strings(rel)
        for name in sorted(_named_in(strings, failure_ids)):
            bad.append(f"{rel}: playbook id {name!r}")
        for name in sorted(_named_in(strings, event_names)):
            bad.append(f"{rel}: event {name!r}, whose schema its failure's module declares")
    assert not bad, "per-failure code in a generic module (move it to the failure's module):\n" + "\n".join(bad)


def test_the_training_process_watch_names_no_playbook():
    """The watch's rooms (inproc/agent/) run every check the same way: a check made in the training
    process declares the playbook it serves and the thresholds it reads in its own module
    (inproc/shapes.py, inproc/rngcheck.py, inproc/preflight.py), never the generic code by its id."""
    ids = set(_shipped())
    folder = os.path.join(PKG, "inproc", "agent")
    rooms = sorted(f"inproc/agent/{n}" for n in os.listdir(folder) if n.endswith(".py"))
    assert len(rooms) > 5 and _named_in({"if pb.id == 'batch-dim-mismatch':"}, ids)  # the check can see one
    bad = [f"{rel}: playbook id {name!r}" for rel in rooms for name in sorted(_named_in(_module_strings(rel), ids))]
    assert not bad, "a failure's id in the watch's generic code (declare it in the check's module):\n" + "\n".join(bad)


def test_generic_modules_import_no_failure_module():
    failure_modules = {f.module for f in registry.failures()}
    bad = []
    for rel in GENERIC:
        with open(os.path.join(PKG, rel), encoding="utf-8") as f:
            tree = ast.parse(f.read())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = {node.module} | {f"{node.module}.{a.name}" for a in node.names}
            elif isinstance(node, ast.Import):
                names = {a.name for a in node.names}
            else:
                continue
            bad += [f"{rel} imports {n}" for n in sorted(names & failure_modules)]
    assert not bad, "\n".join(bad)


def test_the_check_sees_per_failure_code():
    # the checker itself: an enricher table keyed by playbook id, as match.py had, is found
    source = '"""a docstring: worker-deadlock"""\n_ENRICHERS = {"fd-exhaustion": _enrich_fd}\nx = f"see {1} io-stall"\n'
    found = _named_in(_strings(source), {"fd-exhaustion", "io-stall", "worker-deadlock"})
    assert found == {"fd-exhaustion", "io-stall"}


def test_every_failure_playbook_has_at_most_one_module_and_one_if_code_names_it():
    modules: dict[str, list[str]] = {}
    for f in registry.failures():
        modules.setdefault(f.playbook, []).append(f.module)
    assert all(len(m) == 1 for m in modules.values()), {k: m for k, m in modules.items() if len(m) > 1}
    # a failure playbook that any of the package's code names has per-failure code: it has its module
    named: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(PKG):
        dirnames[:] = [d for d in dirnames if d not in ("__pycache__", "vendor", "_boot")]
        for name in filenames:
            if name.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, name), PKG)
                named |= _named_in(_module_strings(rel), _failure_ids())
    assert named  # the shipped failures are named in code (detectors, enrichers)
    without = sorted(named - set(modules))
    assert not without, f"failure playbooks with code but no module in dlwatch/detect/: {without}"
    # today every shipped failure has one (a failure found by its TOML's signals alone would not need it)
    assert set(modules) == _failure_ids(), set(modules) ^ _failure_ids()


def test_every_module_has_its_playbook_file_and_its_examples():
    shipped = _shipped()
    demo = demo_examples()
    for f in registry.failures():
        assert f.module.startswith("dlwatch.detect."), f.module
        doc = shipped.get(f.playbook)
        assert doc is not None, f"{f.module}: no playbooks/{f.playbook}.toml"
        assert doc.get("kind", "failure") == "failure", f"{f.playbook} is not a failure playbook"
        assert f.examples, f"{f.module}: no example (add examples/<name>.py that makes this failure happen)"
        for name in f.examples:
            assert os.path.isfile(os.path.join(REPO, "examples", f"{name}.py")), f"{f.module}: no examples/{name}.py"
            assert demo[name] == f.playbook  # `dlwatch demo NAME` expects this failure


def test_detectors_are_configured_by_their_failures_playbook_and_all_run():
    for f in registry.failures():
        for cls in f.detectors:
            assert cls.playbook == f.playbook, f"{cls.__name__} is configured by {cls.playbook}, declared by {f.module}"
    built = {type(d) for d in build({})}
    assert set(registry.detector_classes()) <= built
    ignored = {type(d) for d in build({}, ignore=["fd-exhaustion"])}
    assert not any(cls.playbook == "fd-exhaustion" for cls in ignored)


def test_evidence_forms_are_known_documented_and_agree():
    shared = set(display.EVIDENCE_FORMS)
    seen: dict[str, tuple[str, str]] = {}
    for f in registry.failures():
        documented = set(_shipped()[f.playbook].get("evidence") or {})
        for key, form in f.evidence_forms.items():
            assert form in registry.FORM_NAMES, f"{f.module}: {key}: unknown form {form!r}"
            assert key in documented, f"{f.module}: {key} is not in [evidence] of playbooks/{f.playbook}.toml"
            assert key not in shared, f"{f.module}: {key} is a shared key (display.EVIDENCE_FORMS)"
            if key in seen:
                assert seen[key][1] == form, f"{key}: {seen[key][0]} shows it as {seen[key][1]}, {f.module} as {form}"
            seen[key] = (f.module, form)
    forms = display.evidence_forms()
    for key, form in registry.evidence_forms().items():  # the renderers use what the modules declare
        want = form if form in ("bytes", "seconds", "count", "text", "table", "lines") else None
        assert forms[key] == want if want else callable(forms[key]), key


def test_event_schemas_apply_in_the_reader():
    # a failure's event is type-checked by its module's schema when the table is passed, as the monitor does
    schemas = registry.event_schemas()
    bad = {"event": "rng_fingerprint", "worker_id": 0, "fingerprints": {"a": "x", "b": 1}}
    assert events.normalize(dict(bad), schemas)["fingerprints"] == {"a": "x"}
    assert events.normalize({"event": "rng_fingerprint", "fingerprints": {}}, schemas) is None
    assert events.normalize(dict(bad), None) == bad  # without the table: passed through for the timeline


NEW_MODULE = '''
"""A failure added the documented way: this module, its TOML, nothing else."""

from typing import Any, Iterable, Mapping

from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import Context
from dlwatch.detect.registry import Failure

PLAYBOOK = "lock-owner-probe"


class LockOwner(Detector):
    playbook = PLAYBOOK
    defaults = {"min_wait_s": 1.0}

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        if ev.get("event") == "lock_owner_seen" and ev["waited"] >= self.thresholds["min_wait_s"]:
            return [{"event": "threshold", "signal": "lock_owner", "owner": ev["owner"], "owner_wait": ev["waited"]}]
        return ()


def _schema(ev: dict[str, Any]) -> dict[str, Any] | None:
    if not isinstance(ev.get("owner"), int) or not isinstance(ev.get("waited"), (int, float)):
        return None
    return ev


def _enrich(pb: Any, ctx: Context, evidence: dict[str, Any]) -> str | None:
    seen = ctx.signal_events("lock_owner")
    evidence["owner_pid"] = seen[-1]["owner"]
    evidence["owner_wait"] = seen[-1]["owner_wait"]
    return "main-holds" if evidence["owner_pid"] == (ctx.report.get("pid") or 0) else "worker-holds"


FAILURE = Failure(
    playbook=PLAYBOOK,
    detectors=(LockOwner,),
    enrich=_enrich,
    evidence_forms={"owner_pid": "text", "owner_wait": "seconds"},
    events={"lock_owner_seen": _schema},
)
'''

NEW_TOML = """
id = "lock-owner-probe"
title = "A lock's owner never lets go"
summary = "The workers wait on a lock whose owner is known."

[thresholds]
min_wait_s = 2.0

[[signals]]
name = "owner-seen"
signal = "lock_owner"
confidence = 0.9

[evidence]
owner_pid = "the process that holds the lock"
owner_wait = "how long the others waited"

[remediation]
text = "Release the lock before forking."

[remediation.variants]
main-holds = "The main process holds it."
worker-holds = "A worker holds it."
"""


def test_a_new_failure_is_found_everywhere_from_its_module_and_toml_alone(tmp_path, monkeypatch):
    """The path of docs/design.md, "Adding a failure", walked for real: a module and a TOML
    outside the package, and the monitor's detectors, the event reader, the matcher and the
    renderers all use what the module declares, with no generic file changed."""
    from dlwatch.detect.base import View
    from dlwatch.detect.match import match
    from dlwatch.wire.playbooks import load_playbooks

    pkg = tmp_path / "newfailures"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "lock_owner.py").write_text(NEW_MODULE)
    books = tmp_path / "playbooks"
    books.mkdir()
    (books / "lock-owner-probe.toml").write_text(NEW_TOML)
    monkeypatch.syspath_prepend(str(tmp_path))
    added = registry.discover(str(pkg), "newfailures")
    assert [f.playbook for f in added] == ["lock-owner-probe"] and added[0].module == "newfailures.lock_owner"
    shipped = registry.failures()
    registry.reset()
    display.evidence_forms.cache_clear()
    monkeypatch.setattr(registry, "failures", lambda: shipped + added)
    try:
        # the monitor: its detector runs, configured by its playbook's thresholds
        playbooks = load_playbooks([str(books)])
        detectors = build({p.id: p.thresholds for p in playbooks})
        det = next(d for d in detectors if d.playbook == "lock-owner-probe")
        assert det.thresholds == {"min_wait_s": 2.0}
        view = View(now=0.0, procs={}, loader=None, loader_pids=frozenset(), system=None, heartbeat=None)
        # the event reader: its event is type-checked by its schema
        schemas = registry.event_schemas()
        assert events.normalize({"event": "lock_owner_seen", "owner": "x", "waited": 3}, schemas) is None
        ev = events.normalize({"event": "lock_owner_seen", "owner": 4242, "waited": 3.5}, schemas)
        signals = list(det.on_event(ev, view))
        assert signals == [{"event": "threshold", "signal": "lock_owner", "owner": 4242, "owner_wait": 3.5}]
        # the matcher: its signal matches, its enricher measures, its variant is chosen
        report = {"pid": 1, "events": signals, "processes": []}
        top = match(report, playbooks)[0]
        assert top.playbook == "lock-owner-probe"
        assert top.evidence["owner_pid"] == 4242 and top.evidence["owner_wait"] == 3.5
        assert top.remediation.startswith("A worker holds it.") and "main process" not in top.remediation
        # the renderers: its evidence reads by its forms
        assert display.evidence_value("owner_wait", 3.5) == "3.50 s"
        assert display.evidence_value("owner_wait", 3.5) != display.evidence_value("owner_wait_x", 3.5)
    finally:
        monkeypatch.undo()
        registry.reset()
        display.evidence_forms.cache_clear()
        for name in ("newfailures.lock_owner", "newfailures"):
            sys.modules.pop(name, None)
    assert registry.find("lock-owner-probe") is None  # gone again for the other tests
