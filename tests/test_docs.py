"""The docs' generated lists match their sources (docs/gendocs.py), and the check can fail."""

from __future__ import annotations

import importlib.util
import os
import re

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


# a measured figure: a number with a unit of time, size or share
_FIGURE = re.compile(r"(?<![\w.=-])\d+(?:\.\d+)?\s?(?:(?:ms|s|µs|KiB|MiB|GiB|kB|MB|GB|min|minutes?|seconds?)\b|%)")


def _unit_figures(text: str) -> list[str]:
    """The figures of a README outside its generated blocks (generated ones come from saved results)."""
    gen = _gendocs()
    outside = gen._BLOCK.sub("", text)
    return _FIGURE.findall(outside)


def test_the_readme_types_no_measured_figure_by_hand() -> None:
    """Issue 28: figures in the README are generated from saved results (or checked by a script),
    never typed: a hand-typed one goes stale (the old README's page sizes, its three test times)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as f:
        assert _unit_figures(f.read()) == []
    # and the check can fail: a typed figure is found, one inside a generated block is not
    typed = "The core tier takes 2 min 41 s; a page is about 100 kB; 0.5% of a core.\n"
    assert _unit_figures(typed) == ["2 min", "41 s", "100 kB", "0.5%"]
    block = "<!-- generated: run-cost (python docs/gendocs.py) -->\n+2.2 ms wall\n<!-- end generated: run-cost -->\n"
    assert _unit_figures(block) == []
