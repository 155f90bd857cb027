"""A user's own playbook, patterns only and no code, names a failure in a real incident."""

from __future__ import annotations

import sys

import pytest
from torch.utils.data import DataLoader

import dlwatch
from conftest import TARGETS, drop_traceback, incidents, load

sys.path.insert(0, TARGETS)
from datasets import FailsAt  # noqa: E402

PLAYBOOK = """
id = "corrupt-sample"
title = "A corrupt sample in the dataset"
summary = "One sample cannot be decoded."

[[signals]]
name = "bad-sample-text"
exception_text = "bad sample \\\\d+"
confidence = 0.8

[[signals]]
name = "getitem-in-worker"
frame_function = "__getitem__"
role = "worker"
confidence = 0.2

[remediation]
text = "Find the sample index in the message and re-encode that file."
"""


@pytest.mark.parametrize("via", ["option", "env"])
def test_user_playbook_matches_a_real_worker_exception(tmp_path, monkeypatch, via, no_leftovers):
    pb_dir = tmp_path / "playbooks"
    pb_dir.mkdir()
    (pb_dir / "corrupt-sample.toml").write_text(PLAYBOOK)
    kw = {}
    if via == "option":
        kw["playbooks"] = str(pb_dir)
    else:
        monkeypatch.setenv("DLWATCH_PLAYBOOKS", str(pb_dir))
    dl = DataLoader(FailsAt(5), batch_size=2, num_workers=2)
    with pytest.raises(ValueError, match="bad sample 5") as info:
        with dlwatch.watch(dl, report_dir=tmp_path / "r", poll_interval=0.1, **kw):
            for _ in dl:
                pass
    drop_traceback(info)
    report = load(incidents(str(tmp_path / "r"))[0])
    top = report["findings"][0]
    assert top["playbook"] == "corrupt-sample"
    assert "re-encode" in top["remediation"]
    assert any("bad sample 5" in str(hit) for hit in top["evidence"]["matched"])


# --------------------------------------------------------------------------- hostile patterns (issue 9, item 8)

EXPONENTIAL = """
id = "nested-quantifier"
title = "A pattern that backtracks exponentially on a backtracking engine"

[[signals]]
name = "trailing-as"
exception_text = "(a+)+$"
confidence = 0.5
"""


@pytest.mark.parametrize("pattern", [r"(a)\\1", "(?=lookahead)x", "(?<!x)y"])
def test_pattern_re2_cannot_take_is_a_clear_error_at_load(tmp_path, pattern):
    from dlwatch.errors import PlaybookError
    from dlwatch.wire.playbooks import load_dir

    from pathlib import Path

    (tmp_path / "mine.toml").write_text(
        f'id = "mine"\ntitle = "t"\n[[signals]]\nframe = "ok"\nconfidence = 0.5\n'
        f'[[hints]]\nname = "h"\nframe_function = "{pattern}"\n'
    )
    with pytest.raises(PlaybookError) as info:
        load_dir(Path(tmp_path))
    msg = str(info.value)
    assert "mine.toml" in msg and "hints[0].frame_function" in msg and "RE2" in msg


def test_shipped_playbooks_compile_under_re2():
    from dlwatch.wire.playbooks import load_playbooks

    pbs = load_playbooks(())
    assert {"fd-exhaustion", "shm-exhaustion", "worker-deadlock", "batch-dim-mismatch", "rng-duplication"} <= {
        p.id for p in pbs
    }
    assert all(
        type(s.exception_text).__module__.startswith("re2")
        for p in pbs
        for s in p.signals
        if s.exception_text is not None
    )


def test_exponential_pattern_on_long_exception_text_returns(tmp_path):
    """The matcher returns on the text that stalled Python's re for minutes (pytest's timeout guards)."""
    from pathlib import Path

    from dlwatch.detect.match import match
    from dlwatch.wire.playbooks import load_dir

    (tmp_path / "n.toml").write_text(EXPONENTIAL)
    pbs = load_dir(Path(tmp_path))
    exc = {"type": "builtins.ValueError", "message": "a" * 61 + "!", "traceback": "x" * 10_000_000}
    assert match({"exception": exc}, pbs) == []
    exc = {"type": "builtins.ValueError", "message": "b" * 1_000_000, "traceback": "a" * 100_000}
    found = match({"exception": exc}, pbs)  # matches: the tail of the bounded text is all a's
    assert [f.playbook for f in found] == ["nested-quantifier"]


def test_exponential_user_pattern_does_not_delay_the_training_program(tmp_path, no_leftovers):
    """The reported attack: `(a+)+$` and a 61-character message hung the program for minutes."""
    import subprocess
    import textwrap

    from conftest import REPO

    pb_dir = tmp_path / "playbooks"
    pb_dir.mkdir()
    (pb_dir / "n.toml").write_text(EXPONENTIAL)
    code = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {TARGETS!r})
        from torch.utils.data import DataLoader
        import dlwatch
        from datasets import Squares
        dl = DataLoader(Squares(16), batch_size=2, num_workers=1)
        with dlwatch.watch(dl, report_dir={str(tmp_path / "r")!r}, poll_interval=0.1, playbooks={str(pb_dir)!r}):
            for _ in dl:
                pass
            raise ValueError("a" * 61 + "!")
    """)
    env = dict(__import__("os").environ, PYTHONPATH=REPO)
    # 60 s is a hang guard only (the reported run took over two minutes), not a speed claim
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 1 and "ValueError: " + "a" * 61 + "!" in out.stderr
    assert "did not stop in time" not in out.stderr and "exited early" not in out.stderr, out.stderr
    report = load(incidents(str(tmp_path / "r"))[0])
    assert report["trigger"] == "exception"
    assert not any("monitor process was not running" in n for n in report["notes"])
