"""The test tiers' rules (tests/tiers.py): what they read of a test, and what the core tier holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

import tiers
from conftest import REPO
from dlwatch.cli import main

# ---- sample test bodies, read and never called


def _spawns() -> None:
    subprocess.run(["true"])


def _calls_a_helper_that_spawns() -> None:
    _spawns()


def _imports_its_own_starter() -> None:
    import multiprocessing

    multiprocessing.Process(target=print).start()


def _forks() -> None:
    os.fork()


def _writes_a_report(report, path) -> None:
    from dlwatch.report import build

    build.write(report, path)


def _writes_a_summary_through_the_monitor(run_dir) -> None:
    from dlwatch.monitor.loop import Monitor

    Monitor(run_dir)._write_summary("clean")


def _drives_chromium() -> None:
    sync_api = pytest.importorskip("playwright.sync_api")
    sync_api.sync_playwright()


def _pure(report) -> str:
    return os.path.join(str(report), "report.json")


@given(st.integers())
def _property_that_spawns(n) -> None:
    subprocess.run(["true", str(n)])


def _runs_attach(pid) -> None:
    main(["attach", str(pid), "--out", "x"])


def _runs_dlwatch_run(script) -> None:
    subprocess.run([sys.executable, "-m", "dlwatch", "run", "--report-dir", "r", script])


def _names_a_verb_without_running_it() -> list[str]:
    return ["run", "report", "top"]


@pytest.mark.parametrize(
    "func, starts",
    [
        (_spawns, True),
        (_calls_a_helper_that_spawns, True),
        (_imports_its_own_starter, True),
        (_forks, True),
        (_writes_a_report, True),
        (_writes_a_summary_through_the_monitor, True),
        (_drives_chromium, True),
        (_property_that_spawns, True),
        (_pure, False),
        (_names_a_verb_without_running_it, False),
    ],
)
def test_the_rule_finds_what_starts_processes(func, starts):
    assert tiers._Reader().function(func)[0] is starts


@pytest.mark.parametrize(
    "func, verbs",
    [
        (_runs_attach, {"attach"}),
        (_runs_dlwatch_run, {"run"}),
        (_names_a_verb_without_running_it, set()),
        (_spawns, set()),
    ],
)
def test_cli_verbs_are_read_from_the_argv(func, verbs):
    assert tiers.cli_verbs_run(func) == verbs


class _Item:
    def __init__(self, marked: bool) -> None:
        self.marked = marked

    def get_closest_marker(self, name):
        return object() if (name == "procs" and self.marked) else None


def test_the_runtime_check_fails_a_test_the_rule_missed():
    tiers.guard_start()
    subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60)
    tiers.guard_check(_Item(marked=True))  # marked: nothing to say
    with pytest.raises(AssertionError, match=r"started processes \(.*subprocess\.Popen.*\) but the tiers rule"):
        tiers.guard_check(_Item(marked=False))
    tiers.guard_start()
    tiers.guard_check(_Item(marked=False))  # a test that started nothing passes unmarked


PLUGIN = """
import json, os

def pytest_collection_finish(session):
    import tiers

    reader = tiers._Reader()
    rows = []
    for i in session.items:
        facts = tiers.facts_of(i, reader)
        marks = {m: i.get_closest_marker(m) is not None for m in ("procs", "core", "serial")}
        rows.append({"id": i.nodeid, "examples": sorted(facts.examples), "verbs": sorted(facts.verbs), **marks})
    with open(os.environ["TIERS_OUT"], "w") as f:
        json.dump(rows, f)
"""


@pytest.mark.timeout(600)  # one collection of the whole suite, in a fresh process
def test_the_core_tier_starts_real_processes_for_every_family_verb_and_start_method(tmp_path):
    """The whole suite as collected: the core tier holds, for each failure of the registry, a test
    running its first example; for each CLI verb that a test runs for real, one such test; the
    harness's fork and start-methods rows; and every test that starts no process."""
    from dlwatch.cli import COMMANDS
    from dlwatch.detect import registry

    (tmp_path / "tiersdump.py").write_text(PLUGIN)
    out = tmp_path / "rows.json"
    env = dict(os.environ, PYTHONPATH=str(tmp_path), TIERS_OUT=str(out))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "-p", "tiersdump"]
        + ["--tier", "all"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=500,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = json.loads(out.read_text())
    core = [r for r in rows if r["core"]]
    assert all(r["procs"] for r in rows if not r["core"]), "a test that starts no process is in the core tier"
    core_procs = [r for r in core if r["procs"]]
    for failure in registry.failures():
        if failure.examples:
            first = failure.examples[0]
            assert any(first in r["examples"] for r in core_procs), f"no core test runs {first} ({failure.playbook})"
    # `dlwatch playbooks` only reads files: no test needs a process for it
    assert {v for r in core_procs for v in r["verbs"]} >= set(COMMANDS) - {"playbooks"}
    programs = [r["id"] for r in core if "test_program_is_the_bare_one[" in r["id"]]
    assert {i.split("[")[1].rsplit("-", 1)[0] for i in programs} == set(tiers.CORE_TRANSPARENCY_GROUPS)


class _Config:
    def __init__(self, tier: str | None, source: pytest.Config.ArgsSource) -> None:
        self.option_tier, self.args_source = tier, source

    def getoption(self, name):
        assert name == "tier"
        return self.option_tier


def test_the_default_tier_is_core_for_python_m_pytest_and_all_for_named_tests():
    testpaths, named = pytest.Config.ArgsSource.TESTPATHS, pytest.Config.ArgsSource.ARGS
    assert tiers.tier(_Config(None, testpaths)) == "core"
    assert tiers.tier(_Config(None, named)) == "all"
    assert tiers.tier(_Config("rest", testpaths)) == "rest"
    assert tiers.tier(_Config("core", named)) == "core"
