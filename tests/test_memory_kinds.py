"""Worker memory is judged on what a copy grows, never on file pages: a memory-mapped dataset
(a look-alike that must stay quiet) and a real leak in the same program (must stay caught).

Both run for real: two forked workers over a 640 MiB array on disk in a 1.25 GiB memory cgroup
(tests/targets/mapped_memory.py; skipped where no cgroup can be made).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import TARGETS, kill_session, descendants_of

MiB = 1 << 20


def _run(mode: str, tmp_path) -> tuple[list[dict], dict, str]:
    report_dir, data_dir = tmp_path / "reports", tmp_path / "data"
    data_dir.mkdir()
    proc = subprocess.Popen(
        [sys.executable, os.path.join(TARGETS, "mapped_memory.py"), mode, str(report_dir), str(data_dir)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    known: set[int] = set()
    try:
        try:
            out, err = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            known.update(p.pid for p in descendants_of(proc.pid))
            raise
    finally:
        kill_session(proc.pid, known)
        proc.wait(timeout=10)
    if out.startswith("SKIP"):
        pytest.skip(out.strip())
    assert proc.returncode == 0, err[-3000:]
    reports = []
    for line in out.splitlines():
        if line.startswith("REPORT "):
            with open(os.path.join(line[len("REPORT ") :], "report.json")) as f:
                reports.append(json.load(f))
    summary = json.loads(next(line for line in out.splitlines() if line.startswith("SUMMARY "))[len("SUMMARY ") :])
    return reports, summary, err


def test_mapped_file_pages_are_not_a_leak(tmp_path):
    reports, summary, err = _run("mmap", tmp_path)
    workers = summary["workers"]
    assert len(workers) == 2
    # the look-alike did what it is for: each worker's USS rose by the file pages it alone maps ...
    for w in workers:
        assert w["uss_peak"] - w["private_dirty_peak"] >= 150 * MiB, w
    # ... and dlwatch called none of it a leak or a copy
    assert [r["findings"][0]["playbook"] for r in reports if r["findings"]] == []
    assert not [
        a for a in summary.get("advice") or () if a["playbook"] in ("dataset-memory-per-worker", "worker-memory-growth")
    ]


def test_a_real_leak_next_to_mapped_pages_is_caught(tmp_path):
    reports, summary, err = _run("leak", tmp_path)
    growth = [r for r in reports if r["findings"] and r["findings"][0]["playbook"] == "worker-memory-growth"]
    assert growth, (reports, err[-2000:])
    ev = growth[0]["findings"][0]["evidence"]
    assert growth[0]["trigger"] == "threshold"
    for g in ev["growth"]:
        assert g["judged"] == "private_dirty"
        assert g["uss"]["rise_bytes"] >= 64 * MiB
        assert g["file_backed_last"] >= g["file_backed_first"]  # the file pages are shown apart


# --------------------------------------------------------------------------- the rule, on hand-built reads


def _split_series(pid, dirty, clean, step=2.0, t0=1000.0):
    from dlwatch.model import ProcSample

    return [
        ProcSample(
            pid=pid,
            ts=t0 + i * step,
            uss=int(d + c),
            private_dirty=int(d),
            private_clean=int(c),
            rss=600 * MiB,
            uss_ts=t0 + i * step,
        )
        for i, (d, c) in enumerate(zip(dirty, clean))
    ]


def test_the_detector_judges_private_dirty_pages_only():
    from test_worker_failures import P, growth_detector, system, view

    near = system(limit=2 << 30, usage=1 << 30)
    flat_dirty = [20 * MiB] * 6
    rising = [20 * MiB + i * 24 * MiB for i in range(6)]
    mapped = [P(10 + w, "worker", _split_series(10 + w, flat_dirty, rising), worker_id=w) for w in range(2)]
    assert list(growth_detector().on_poll(view(mapped, near, now=1011.0))) == []  # file pages: quiet
    leaking = [P(10 + w, "worker", _split_series(10 + w, rising, rising), worker_id=w) for w in range(2)]
    (sig,) = growth_detector().on_poll(view(leaking, near, now=1011.0))
    assert sig["event"] == "threshold" and sig["workers_growing"] == 2
    g = sig["growth"][0]
    assert g["judged"] == "private_dirty" and g["uss"]["rise_bytes"] == 5 * 24 * MiB
    assert (g["file_backed_first"], g["file_backed_last"]) == (20 * MiB, 140 * MiB)


def test_the_advice_weighs_what_the_workers_wrote():
    from dlwatch.detect.advice import DatasetMemoryPerWorker

    loader = {"num_workers": 4, "dataset": "Rows"}
    peaks = {"cgroup_memory": {"limit": 2 << 30}}
    mapped = {"workers": [{"uss_peak": 400 * MiB, "private_dirty_peak": 12 * MiB}] * 4, "peaks": peaks}
    assert DatasetMemoryPerWorker().judge(mapped, loader) is None
    copied = {"workers": [{"uss_peak": 400 * MiB, "private_dirty_peak": 380 * MiB}] * 4, "peaks": peaks}
    sig = DatasetMemoryPerWorker().judge(copied, loader)
    assert sig is not None and sig["judged"] == "private_dirty_peak"
    old = {"workers": [{"uss_peak": 400 * MiB}] * 4, "peaks": peaks}  # a summary without the split: USS as before
    assert DatasetMemoryPerWorker().judge(old, loader) is not None
