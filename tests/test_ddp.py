"""Real multi-rank jobs: torchrun --nproc_per_node 2 on gloo (CPU), each rank under dlwatch.watch.

- examples/ddp_deadlock.py: rank 1's workers deadlock (a lock held across fork), rank 0 blocks in
  all_reduce; each rank writes its incident and `dlwatch report --job` names rank 1 first.
- tests/targets/ddp_steps.py: both ranks healthy, in lock-step through all_reduce; with rank 1's
  dataset three times slower it is a straggler-rank in the job view, and nobody writes an incident;
  with both alike (the healthy look-alike) nobody is a straggler.

Every run is bounded in time, in its own session, and nothing it started may outlive it.
"""

from __future__ import annotations

import io
import glob
import json
import os
import sys
from contextlib import redirect_stdout

import pytest

from conftest import REPO, TARGETS, cpu_starved, run_to_end
from dlwatch.cli import main as cli_main
from dlwatch.report import jobview, store

RUN_TIMEOUT_S = 120


def _run(argv: list[str], marker: str) -> tuple[int, str, str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([REPO, TARGETS, os.environ.get("PYTHONPATH", "")]), OMP_NUM_THREADS="1"
    )
    for var in ("DLWATCH_DIR", "RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", "DLWATCH_JOB_ID"):
        env.pop(var, None)
    # torchrun puts each rank in a session of its own: run_to_end finds them by the marker
    return run_to_end(argv, env=env, marker=marker, timeout=RUN_TIMEOUT_S, what=" ".join(argv[1:4]), settle_s=10)


def test_ddp_deadlock_rank1_origin_rank0_waits_in_all_reduce(tmp_path) -> None:
    report_dir = str(tmp_path / "reports")
    rc, out, err = _run(
        [sys.executable, os.path.join(REPO, "examples", "ddp_deadlock.py"), "--report-dir", report_dir], report_dir
    )
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
    reports = [line[len("REPORT ") :] for line in out.splitlines() if line.startswith("REPORT ")]
    assert len(reports) == 2, f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
    by_rank = {}
    for path in reports:
        with open(os.path.join(path, "report.json")) as f:
            r = json.load(f)
        by_rank[r["rank"]["rank"]] = r
    assert set(by_rank) == {0, 1}
    r0, r1 = by_rank[0], by_rank[1]
    job_line = next(line for line in out.splitlines() if line.startswith("JOB "))
    assert r0["rank"]["job_id"] == r1["rank"]["job_id"] == job_line[len("JOB ") :]
    assert r0["rank"]["world_size"] == 2 and r1["rank"]["local_world_size"] == 2
    assert "-r1-" in r1["id"] and "-r0-" in r0["id"]
    # rank 1: its own failure
    assert r1["classification"] == "deadlock" and r1["findings"][0]["playbook"] == "lock-held-at-fork"
    assert "worker-deadlock" in [f["playbook"] for f in r1["findings"]]
    # rank 0: only waiting, in the collective, with no DataLoader playbook of its own
    main0 = next(p for p in r0["processes"] if p["role"] == "main")
    assert r0["classification"] == "main-blocked" and main0["waiting_in"] == "collective: all_reduce"
    assert r0["findings"] == [] and r0["job"]["role"] == "waiting"
    assert r0["job"]["view"].startswith(f"dlwatch report --job {report_dir}")
    # the job view, as the command prints it
    view = jobview.job_view(report_dir)
    assert view["origin"]["rank"] == 1 and view["origin"]["top_finding"] == "lock-held-at-fork"
    assert [(w["rank"], w["waiting_in"]) for w in view["waiting"]] == [(0, "collective: all_reduce")]
    text = io.StringIO()
    with redirect_stdout(text):
        assert cli_main(["report", "--job", report_dir]) == 0
    assert "stalled first: rank 1" in text.getvalue() and "deadlock -> lock-held-at-fork" in text.getvalue()
    assert "waited for it: rank 0" in text.getvalue()


@pytest.mark.parametrize("factor,stragglers", [(3.0, [1]), (1.0, [])])
def test_ddp_straggler_rank_and_healthy_lookalike(tmp_path, factor, stragglers) -> None:
    report_dir = str(tmp_path / "reports")
    rc, out, err = _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            os.path.join(TARGETS, "ddp_steps.py"),
            report_dir,
            str(factor),
        ],
        report_dir,
    )
    assert rc == 0, f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
    assert "DONE 0 120" in out and "DONE 1 120" in out
    # runs/ holds the run summaries (one per rank's watched block), never an incident
    incidents = [n for n in os.listdir(report_dir) if not n.startswith(".") and n != store.SUMMARIES_DIR]
    assert incidents == [], "a healthy job raised an incident"
    view = jobview.job_view(report_dir)
    assert sorted(f["rank"] for f in view["ranks"]) == [0, 1]
    # plain torchrun: the job id is its rendezvous id, the same on both ranks
    assert len({f["job_id"] for f in view["ranks"]}) == 1 and view["job_id"] != "none"
    assert all(f["ended"] and f["batches"] == 120 for f in view["ranks"])
    figures = {f["rank"]: f for f in view["ranks"]}
    assert [s["rank"] for s in view["stragglers"]] == stragglers, (figures, view["stragglers"])
    if stragglers:
        assert figures[1]["data_wait_share"] > figures[0]["data_wait_share"]
        assert figures[0]["worker_idle_share"] > figures[1]["worker_idle_share"]
        text = "\n".join(jobview.job_lines(view))
        assert "straggler-rank: rank 1" in text and "no incident: no rank stalled" in text


def test_ddp_straggler_example(tmp_path) -> None:
    report_dir = str(tmp_path / "reports")
    rc, out, err = _run(
        [sys.executable, os.path.join(REPO, "examples", "ddp_straggler.py"), "--report-dir", report_dir], report_dir
    )
    assert rc == 0 and "no incident" in out, f"stdout:\n{out}\nstderr:\n{err[-4000:]}"
    job_id = next(line for line in out.splitlines() if line.startswith("JOB "))[len("JOB ") :]
    view = jobview.job_view(report_dir, job_id)
    assert view["incidents"] == [], view["incidents"]
    # Precondition: each rank's monitor read its workers often enough for an idle share to count
    # (min_worker_reads). A machine so loaded that the monitors missed their polls cannot show a
    # straggler by that rule; it says nothing about dlwatch, so the test says so instead of failing.
    from dlwatch.detect import straggler

    need = straggler.thresholds()["min_worker_reads"]
    short = [r for r in view["ranks"] if (r.get("worker_reads") or 0) < need]
    if short:
        pytest.skip(
            f"the machine starved the monitors: worker reads {[r.get('worker_reads') for r in short]} "
            f"< {need} (the straggler rule needs them)"
        )
    figures = [
        {k: r.get(k) for k in ("rank", "batches", "data_wait_share", "worker_idle_share", "worker_reads")}
        for r in view["ranks"]
    ]
    if [s["rank"] for s in view["stragglers"]] != [1]:
        # Precondition: the fast rank's workers got the CPU they needed, so they could sit idle (the idle
        # gap the rule asks for). A loaded machine keeps them runnable instead; that is no straggler.
        starved = [
            why
            for path in sorted(glob.glob(os.path.join(report_dir, "runs", "*", "summary.json")))
            for why in [cpu_starved(json.load(open(path)))]
            if why
        ]
        if starved:
            pytest.skip(f"the machine had the ranks' CPUs: {starved[0]} ({figures})")
    assert [s["rank"] for s in view["stragglers"]] == [1], figures
