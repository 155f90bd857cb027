"""False findings seen on PyTorch's own DataLoader tests (issue 21 items 7-10), each with its real twin.

Every run is a real training process under ``dlwatch.watch`` with real workers
(tests/targets/false_findings.py): the look-alike must stay quiet, the failure must
still be named.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

from conftest import REPO, TARGETS, incidents, load, run_bounded
from dlwatch.collect import growth
from dlwatch.detect.evidence import Context
from dlwatch.detect.match import match
from dlwatch.wire.playbooks import PlaybookError, load_playbooks, load_file

RUN_TIMEOUT_S = 240


def run_mode(mode: str, report_dir: str) -> tuple[int, str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([REPO, TARGETS, env.get("PYTHONPATH", "")])
    return run_bounded(
        [sys.executable, os.path.join(TARGETS, "false_findings.py"), mode, report_dir],
        env=env,
        cwd=report_dir,
        timeout=RUN_TIMEOUT_S,
    )


def reports(report_dir: str) -> list[dict]:
    return sorted((load(p) for p in incidents(report_dir)), key=lambda r: r["created_at"])


def top(report: dict) -> str | None:
    return report["findings"][0]["playbook"] if report["findings"] else None


# --------------------------------------------------------------------------- item 7: torch's timeout


def test_timeout_while_spawn_workers_start_is_not_a_deadlock(tmp_path) -> None:
    """PyTorch's test_timeout: timeout=1 on spawn; the workers were importing torch when torch raised."""
    rc, out, err = run_mode("timeout-starting", str(tmp_path))
    assert rc != 0 and "DataLoader timed out after 1 seconds" in err
    (r,) = reports(str(tmp_path))
    assert r["trigger"] == "exception"
    # the precondition: the workers were alive and starting or working when torch raised
    progressing = Context(r, load_playbooks()).fact("workers_progressing")
    assert progressing and {p["why"] for p in progressing} <= {
        "starting",
        "running",
        "cpu rising",
        "sleeping on a timer",
    }
    assert all(f["playbook"] != "worker-deadlock" for f in r["findings"]), r["findings"]
    assert "related" not in r  # no earlier incident of this run to name


def test_timeout_on_workers_deadlocked_at_fork_is_still_a_deadlock(tmp_path) -> None:
    rc, out, err = run_mode("timeout-deadlock-fork", str(tmp_path))
    assert "BLOCKED" in out and "DataLoader timed out after 2 seconds" in err
    (r,) = reports(str(tmp_path))
    assert r["trigger"] == "exception" and top(r) == "worker-deadlock"
    f = r["findings"][0]
    assert [h["signal"] for h in f["evidence"]["matched"]] == ["torch-timeout"]
    assert Context(r, load_playbooks()).fact("workers_progressing") == []
    # a fork loader is told about spawn; a loader with a timeout is not told to set one
    assert 'multiprocessing_context="spawn"' in f["remediation"]
    assert "timeout=120" not in f["remediation"]


def test_timeout_on_spawn_workers_deadlocked_never_recommends_spawn(tmp_path) -> None:
    rc, out, err = run_mode("timeout-deadlock-spawn", str(tmp_path))
    assert "BLOCKED" in out and "DataLoader timed out after 2 seconds" in err
    (r,) = reports(str(tmp_path))
    assert top(r) == "worker-deadlock"
    f = r["findings"][0]
    assert f["evidence"]["multiprocessing_context"] == "spawn"
    assert "already start with spawn or forkserver" in f["remediation"]
    assert 'multiprocessing_context="spawn"' not in f["remediation"] and "timeout=120" not in f["remediation"]


def test_a_loader_without_a_timeout_is_told_of_one_and_the_unknown_start_method_of_spawn() -> None:
    """A stall report (no loader settings known): both the spawn and the timeout advice."""
    r = {"trigger": "stall", "classification": "deadlock", "processes": [], "loader": {}}
    (f,) = match(r, load_playbooks())
    assert 'multiprocessing_context="spawn"' in f.remediation and "timeout=120" in f.remediation
    r["loader"] = {"multiprocessing_context": "forkserver", "timeout": 0}
    (f,) = match(r, load_playbooks())
    assert 'multiprocessing_context="spawn"' not in f.remediation and "timeout=120" in f.remediation


def test_fact_conditions_are_validated_and_evaluated(tmp_path) -> None:
    good = tmp_path / "good.toml"
    good.write_text(
        'id = "x"\ntitle = "t"\n[[signals]]\nexception_text = "boom"\n'
        'facts = ["fd_at_limit"]\nnot_facts = "workers_progressing"\nconfidence = 0.5\n'
    )
    pb = load_file(str(good))
    assert pb.signals[0].facts == ("fd_at_limit",) and pb.signals[0].not_facts == ("workers_progressing",)
    exc = {"type": "RuntimeError", "message": "boom"}
    at_limit = {"pid": 7, "role": "worker", "sample": {"num_fds": 128, "fd_limit": 128}}
    assert [f.playbook for f in match({"exception": exc, "processes": [at_limit]}, [pb])] == ["x"]
    assert match({"exception": exc, "processes": []}, [pb]) == []  # the fact is false
    for bad, why in (
        ('not_facts = ["a"]', "no positive"),  # a negation alone would match every healthy run
        ('exception_text = "b"\nfacts = ["Bad-Name"]', "not a fact name"),
        ('exception_text = "b"\nfacts = [1]', "string"),
    ):
        p = tmp_path / "bad.toml"
        p.write_text(f'id = "x"\ntitle = "t"\n[[signals]]\n{bad}\nconfidence = 0.5\n')
        with pytest.raises(PlaybookError, match=why):
            load_file(str(p))


def test_shipped_fact_conditions_name_facts_a_failure_provides() -> None:
    from dlwatch.detect import registry

    provided = set(registry.fact_providers())
    for pb in load_playbooks():
        for s in pb.signals:
            assert set(s.facts) | set(s.not_facts) <= provided, (pb.id, s.name)


# --------------------------------------------------------------------------- item 9: one failure, one incident


def test_exception_names_the_threshold_incident_of_the_same_failure(tmp_path) -> None:
    """PyTorch's test_fd_limit_exceeded: the fd climb (threshold) and the worker's EMFILE (exception)
    are one failure; the exception incident names the threshold incident."""
    rc, out, err = run_mode("fd-leak", str(tmp_path))
    assert "Too many open files" in err
    first, last = reports(str(tmp_path))
    assert first["trigger"] == "threshold" and top(first) == "fd-exhaustion" and "related" not in first
    assert last["trigger"] == "exception" and top(last) == "fd-exhaustion"
    assert last["related"] == [
        {"id": first["id"], "trigger": "threshold", "playbook": "fd-exhaustion", "relation": "seen-before"}
    ]
    assert first["id"] in last["summary"] and any(first["id"] in n for n in last["notes"])
    assert f"first seen in {first['id']}" in err


# --------------------------------------------------------------------------- item 10: where the crash stack is


def test_segfault_under_the_programs_own_faulthandler_says_the_stack_is_on_stderr(tmp_path) -> None:
    """PyTorch's test_segfault enables faulthandler itself: dlwatch leaves it alone, so the stack is on
    the worker's stderr, not in the report; the finding says so and never speaks of a stack above."""
    rc, out, err = run_mode("segfault-own-faulthandler", str(tmp_path))
    # what the worker's stderr holds: torch's worker handler took SIGSEGV over the inherited faulthandler
    assert "Unexpected segmentation fault encountered in worker" in err
    assert "Fatal Python error" not in err
    (r,) = reports(str(tmp_path))
    assert r["trigger"] == "exception" and top(r) == "worker-killed"
    f = r["findings"][0]
    ev = f["evidence"]
    assert ev["cause"] == "native-crash" and "crash_stack" not in ev
    assert ev["exit_signal"] == "SIGSEGV"
    assert ev["crash_stack_at"].startswith("the worker's stderr, without a Python stack")
    registered = [e for e in r["events"] if e.get("event") == "worker_registered"]
    assert registered and {e["crash_output"] for e in registered} == {"program"}
    assert "this report has no crash\nstack" in f["remediation"] and "faulthandler.enable()" in f["remediation"]
    assert "crash stack above" not in f["remediation"] and "PYTHONFAULTHANDLER=1" not in f["remediation"]


# --------------------------------------------------------------------------- item 8: start-up is not growth


def test_short_spawn_loader_start_up_is_not_memory_growth(tmp_path) -> None:
    """6 batches from spawn workers whose start-up climbs steadily for ~12 s before their first batch
    (a fresh interpreter importing torch on a loaded machine): no worker-memory-growth, not even advice."""
    rc, out, err = run_mode("short-spawn", str(tmp_path))
    assert rc == 0 and "BATCHES 6" in out, err[-2000:]
    assert reports(str(tmp_path)) == []
    (run,) = [os.path.join(tmp_path, "runs", n) for n in os.listdir(os.path.join(tmp_path, "runs"))]
    with open(os.path.join(run, "summary.json")) as f:
        summary = json.load(f)
    assert [a["playbook"] for a in summary.get("advice") or ()] == []
    # the precondition: each worker's USS rose steadily before its first batch, as the growth rule
    # would have judged it without the gate (one point per USS read: where the carried figure changes)
    with open(os.path.join(run, "timeline.jsonl")) as f:
        samples = [json.loads(line) for line in f]
    by_pid: dict[int, list[tuple[float, float]]] = {}
    for rec in samples:
        for p in rec.get("procs") or ():
            if p.get("role") == "worker" and isinstance(p.get("uss"), int):
                pts = by_pid.setdefault(p["pid"], [])
                if not pts or pts[-1][1] != p["uss"]:
                    pts.append((rec["ts"], float(p["uss"])))
    steady = [
        pid
        for pid, pts in by_pid.items()
        if growth.steady_growth(pts, min_rate=float(1 << 20), min_rise=float(64 << 20), min_window_s=8.0)
    ]
    if not steady:
        pytest.skip(f"the start-up climb was not seen as steady growth here ({len(by_pid)} workers): nothing to test")
