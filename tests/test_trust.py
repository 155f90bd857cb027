"""Trust on real jobs: a loop body is not a data stall, nested and several loaders, one incident a site.

Every case runs a real DataLoader with real workers in a target process (tests/targets/trust.py),
bounded in time and killed with its whole session in ``finally`` (the ``target`` fixture).
"""

from __future__ import annotations

import json
import os
import warnings

import pytest
from torch.utils.data import DataLoader

import dlwatch
from conftest import incidents, load, wait_for
from dlwatch.wire import config
from dlwatch.inproc.agent import DlwatchWarning


def _finish(t, timeout: float = 60) -> tuple[str, str]:
    out, err = t.communicate(timeout=timeout)
    assert t.proc.returncode == 0, err[-3000:]
    return out, err


def test_main_blocked_in_the_body_is_one_main_blocked_stall(tmp_path, target):
    rd = str(tmp_path / "r")
    t = target("trust.py", "body_blocked", rd)
    t.wait_line("ready", timeout=60)
    found = wait_for(lambda: incidents(rd), timeout=30)
    assert found, "no stall incident for a loop body blocked on a lock"
    r = load(found[0])
    assert r["trigger"] == "stall" and r["classification"] == "main-blocked"
    assert r["progress"]["stall_allowance"] == "body" and r["progress"]["stall_timeout_s"] == 2
    assert r["progress"]["state"] == "in_loop_body"
    main = next(p for p in r["processes"] if p["role"] == "main")
    assert main["waiting_in"] == "lock acquire" and main["status"] == "blocked"


def test_a_nested_watched_loop_making_progress_is_progress(tmp_path, target):
    rd = str(tmp_path / "r")
    t = target("trust.py", "nested_progress", rd)
    out, err = _finish(t)
    assert "validated 30" in out and "done" in out
    assert incidents(rd) == [], [load(i)["summary"] for i in incidents(rd)]
    assert "dlwatch:" not in err


def test_workers_belong_to_the_watch_whose_iterator_started_them(tmp_path, target):
    rd = str(tmp_path / "r")
    t = target("trust.py", "foreign_workers", rd)
    out, err = t.communicate(timeout=60)
    assert t.proc.returncode == 1 and "stop here" in err
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("val ", "train ")))
    val = {int(p) for p in lines["val"].split()}
    train = {int(p) for p in lines["train"].split()}
    (inc,) = incidents(rd)
    r = load(inc)
    roles = {p["pid"]: p["role"] for p in r["processes"]}
    assert {pid for pid, role in roles.items() if role == "worker"} == train
    assert all(roles.get(pid) in (None, "other") for pid in val)  # seen in the tree, not ours


def test_one_exception_escaping_nested_watches_is_one_incident(tmp_path, target):
    rd = str(tmp_path / "r")
    t = target("trust.py", "nested_exception", rd)
    out, _err = _finish(t)
    assert "caught KeyError('bad label')" in out
    (inc,) = incidents(rd)
    assert load(inc)["exception"]["type"] == "builtins.KeyError"


def test_repeated_stalls_at_one_site_make_one_incident_and_every_stall_is_in_the_timeline(tmp_path, target):
    rd = str(tmp_path / "r")
    t = target("trust.py", "repeated_stall", rd)
    out, _err = _finish(t, timeout=90)
    assert "stalls in timeline 2" in out, out
    found = incidents(rd)
    assert len(found) == 1, [load(i)["summary"] for i in found]
    r = load(found[0])
    assert r["trigger"] == "stall" and r["classification"] == "slow"


# --------------------------------------------------------------------------- in this process


def _gen():
    yield from range(3)


def test_an_iterable_that_cannot_be_watched_in_place_warns_once_at_the_with(tmp_path, no_leftovers):
    g = _gen()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dlwatch.watch(g, report_dir=str(tmp_path)):
            assert list(g) == [0, 1, 2]
    mine = [w for w in caught if issubclass(w.category, DlwatchWarning)]
    assert len(mine) == 1 and "as batches" in str(mine[0].message)
    assert mine[0].filename == __file__  # points at the user's `with` line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dlwatch.watch(_gen(), report_dir=str(tmp_path)) as batches:
            assert list(batches) == [0, 1, 2]
    assert not [w for w in caught if issubclass(w.category, DlwatchWarning)]


def test_the_same_loader_watched_twice_keeps_the_outer_watch(tmp_path, no_leftovers):
    loader = DataLoader(list(range(8)), batch_size=2, num_workers=1)
    with dlwatch.watch(loader, report_dir=str(tmp_path)) as outer:
        with pytest.warns(DlwatchWarning, match="already watched"):
            inner = dlwatch.watch(loader, report_dir=str(tmp_path))
            inner.__enter__()
        try:
            assert [b.tolist() for b in inner] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        finally:
            inner.__exit__(None, None, None)
        assert inner.monitor_pid is None and outer.monitor_pid is not None
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # still instrumented
        assert type(loader).__iter__ is not DataLoader.__iter__
    assert type(loader) is DataLoader


def test_ignore_option_and_variable():
    o = config.resolve(ignore=["rng-duplication", "batch-dim-mismatch:boxes"], environ={})
    assert o.ignored_playbooks == ("rng-duplication",) and o.ignored_batch_keys == ("boxes",)
    o = config.resolve(environ={"DLWATCH_IGNORE": "worker-deadlock, batch-dim-mismatch"})
    assert o.ignored_playbooks == ("worker-deadlock", "batch-dim-mismatch")
    assert config.resolve(environ={"DLWATCH_BODY_TIMEOUT": "90"}).body_timeout == 90.0
    with pytest.raises(ValueError, match="only batch-dim-mismatch takes a key"):
        config.resolve(ignore=["rng-duplication:x"], environ={})
    with pytest.raises(TypeError, match="list of playbook ids"):
        config.resolve(ignore=42, environ={})
    with pytest.raises(ValueError, match="body_timeout"):
        config.resolve(body_timeout=-1, environ={})
    with pytest.raises(ValueError, match="no known playbook: no-such-playbook"):
        dlwatch.watch([1], ignore=["no-such-playbook"])


def test_an_ignored_playbook_makes_no_finding_in_a_real_report(tmp_path):
    from dlwatch.report import build, store

    report = store.skeleton(trigger="exception", pid=os.getpid(), now=0.0)
    report["exception"] = {
        "type": "builtins.OSError",
        "message": "[Errno 24] Too many open files",
        "errno": 24,
        "traceback": "",
        "from_loader": True,
    }
    build.add_findings(report)
    assert report["findings"][0]["playbook"] == "fd-exhaustion"
    build.add_findings(report, ignore=["fd-exhaustion"])
    assert all(f["playbook"] != "fd-exhaustion" for f in report["findings"])
    assert any("ignored" in n and "fd-exhaustion" in n for n in report["notes"])
    json.dumps(report)


def test_batch_bytes_are_measured_without_a_shape_probe(tmp_path, no_leftovers):
    """batch_size=None (pre-batched) or an ignored batch check: the shm need must still be known."""
    import torch

    loader = DataLoader([torch.zeros(4, 8)] * 6, batch_size=None, num_workers=1)
    with dlwatch.watch(loader, report_dir=str(tmp_path), ignore=["batch-dim-mismatch"]) as w:
        assert w._probes.shape_probe is None
        assert sum(1 for _ in w) == 6
        with open(os.path.join(w.run_dir, "events.jsonl")) as f:
            sizes = [json.loads(line)["batch_bytes"] for line in f if '"batch_bytes"' in line]
    assert sizes == [4 * 8 * 4]


def test_batch_check_confirmation_is_a_playbook_threshold(tmp_path, no_leftovers):
    """A user who wants the cat-collate finding sooner lowers confirm_batches in their own copy."""
    import shutil

    import torch

    from dlwatch.wire.playbooks import builtin_dir

    mine = tmp_path / "playbooks"
    mine.mkdir()
    text = (builtin_dir() / "batch-dim-mismatch.toml").read_text()
    assert "confirm_batches = 8" in text
    (mine / "batch-dim-mismatch.toml").write_text(text.replace("confirm_batches = 8", "confirm_batches = 2"))

    def cat_collate(samples):
        return torch.cat([s[0] for s in samples]), torch.tensor([s[1] for s in samples])

    data = [(torch.zeros(3, 8, 8), i) for i in range(12)]  # (12, 8, 8) next to 4 labels
    loader = DataLoader(data, batch_size=4, num_workers=1, collate_fn=cat_collate)
    rd = tmp_path / "r"
    with dlwatch.watch(loader, report_dir=str(rd), playbooks=[str(mine)], poll_interval=0.1) as w:
        from dlwatch.inproc import shapes

        assert w._settings.threshold(shapes, "confirm_batches") == 2  # the probe declares it; the playbook sets it
        assert w._probes.shape_probe.confirm_batches == 2
        assert sum(1 for _ in w) == 3  # 3 batches: the shipped 8 would never confirm
        assert wait_for(lambda: incidents(str(rd)), timeout=15)
    (inc,) = incidents(str(rd))
    ev = load(inc)["findings"][0]["evidence"]
    assert ev["confirmed_batches"] == 2 and ev["confirmed_at_index"] == 1
    shutil.rmtree(mine)
