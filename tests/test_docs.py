"""The docs' generated lists match their sources (docs/gendocs.py), and the check can fail."""

from __future__ import annotations

import importlib.util
import os

import pytest

from dlwatch.detect import registry
from test_playbooks import FAILURE_IDS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _gendocs():
    spec = importlib.util.spec_from_file_location("gendocs", os.path.join(REPO, "docs", "gendocs.py"))
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_committed_docs_are_what_the_script_writes(capsys: pytest.CaptureFixture[str]) -> None:
    gen = _gendocs()
    rc = gen.main(["--check"])
    assert rc == 0, capsys.readouterr().err


def test_a_stale_block_is_found(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = _gendocs()
    path = os.path.join(REPO, "playbooks", "README.md")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    assert gen.render(text, "playbooks/README.md") == text
    stale = text.replace("`worker-deadlock`, ", "", 1)
    assert stale != text
    assert gen.render(stale, "playbooks/README.md") == text  # the script puts the id back


def test_every_example_and_failure_is_in_the_docs() -> None:
    with open(os.path.join(REPO, "examples", "README.md"), encoding="utf-8") as f:
        examples_doc = f.read()
    for name in os.listdir(os.path.join(REPO, "examples")):
        if name.endswith(".py") and not name.startswith("_"):
            assert f"`{name}`" in examples_doc, name
    assert {f.playbook for f in registry.failures()} == FAILURE_IDS
