"""A user's own playbook, patterns only and no code, names a failure in a real incident."""

from __future__ import annotations

import sys

import pytest
from torch.utils.data import DataLoader

import dlwatch
from conftest import TARGETS, drop_traceback, incidents, load

sys.path.insert(0, TARGETS)
from datasets import FailsAt  # noqa: E402

PLAYBOOK = '''
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
'''


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
