"""Multi-rank jobs without processes: rank/job ids, collective waits, the job view, stragglers.

The real torchrun runs are in test_ddp.py; here the same logic is fed hand-built
stacks, reports and rank figures, healthy look-alikes included.
"""

from __future__ import annotations

import io
import json
import os
import time
from contextlib import redirect_stdout

import pytest

from dlwatch._fs import replace_private
from dlwatch.cli import main as cli_main
from dlwatch.detect import straggler
from dlwatch.detect.classify import classify_stall, collective_from_stack, waiting_in_from_stack
from dlwatch.wire.job import job_id, rank_info, safe_name
from dlwatch.model import Frame, ThreadStack
from dlwatch.report import build, jobview, rankfigures, render, store

from test_classify import MAIN_IN_BODY, MAIN_WAITING, POLL, SITE, WORKER_IDLE, WORKER_LOCKED, native, proc, py, worker

DIST = f"{SITE}/torch/distributed/distributed_c10d.py"
LOGGER = f"{SITE}/torch/distributed/c10d_logger.py"
TORCH_LIB = f"{SITE}/torch/lib/libtorch_cpu.so"

# rank 0 of a DDP loop, blocked in all_reduce: py-spy --native, innermost first
MAIN_ALL_REDUCE = [
    native("0x7f3a1c2d3e4f"),
    native("pthread_cond_wait"),
    native("std::condition_variable::wait(std::unique_lock<std::mutex>&)", "/usr/lib/libstdc++.so.6"),
    native("c10d::ProcessGroupGloo::AsyncWork::wait(std::chrono::duration<long, std::ratio<1l, 1000l> >)", TORCH_LIB),
    py("all_reduce", DIST, 3252),
    py("_exception_logger.<locals>.wrapper", LOGGER, 83),
    py("train_step", "/home/user/train/train.py", 40),
    py("<module>", "/home/user/train/train.py", 50),
]
MAIN_BARRIER_NATIVE_ONLY = [  # faulthandler-less native view: no Python frame of torch.distributed
    native("0x7f3a1c2d3e4f"),
    native("pthread_cond_wait"),
    native("gloo::barrier(gloo::BarrierOptions&)", TORCH_LIB),
    native("c10d::ProcessGroupGloo::AsyncBarrierWork::run()", TORCH_LIB),
]
MAIN_NCCL = [native("ncclAllReduce", "/usr/lib/libnccl.so.2"), py("train_step", "/home/user/train/train.py", 40)]


def thread(frames: list[Frame]) -> ThreadStack:
    return ThreadStack(thread_id=1, name="MainThread", native_tid=10, frames=tuple(frames))


# --------------------------------------------------------------------------- rank and job id


TORCHRUN_ENV = {
    "RANK": "1",
    "LOCAL_RANK": "1",
    "WORLD_SIZE": "2",
    "LOCAL_WORLD_SIZE": "2",
    "TORCHELASTIC_RUN_ID": "f467e341-16cd-43d2-bc26-d80687b18339",
    "MASTER_ADDR": "127.0.0.1",
    "MASTER_PORT": "29500",
}


def test_rank_info_under_torchrun() -> None:
    info = rank_info(TORCHRUN_ENV, parent_started=1767225600.25)
    assert info == {
        "rank": 1,
        "local_rank": 1,
        "world_size": 2,
        "local_world_size": 2,
        "job_id": "f467e341-16cd-43d2-bc26-d80687b18339",
        "job_id_source": "TORCHELASTIC_RUN_ID",
        # which run: torchrun's agent (the rank's parent) started then; the run id is the job id here
        "launched_at": 1767225600.25,
        "run_id": None,
    }


def test_job_id_fallbacks() -> None:
    # torchrun's placeholder run id ("none", multi-node static rendezvous): address plus the agent's start
    env = dict(TORCHRUN_ENV, TORCHELASTIC_RUN_ID="none")
    assert job_id(env, parent_started=1_764_576_000.0) == (
        "127.0.0.1:29500@20251201T080000Z",
        "MASTER_ADDR:MASTER_PORT",
    )
    assert job_id(dict(env, DLWATCH_JOB_ID=" 4242 ")) == ("4242", "DLWATCH_JOB_ID")  # the user's own id wins
    assert job_id({}) == (None, None)  # a plain single-process run is no job
    assert rank_info({"RANK": "x", "WORLD_SIZE": "-1"})["rank"] is None
    assert rank_info({"RANK": "x", "WORLD_SIZE": "-1"})["world_size"] is None
    assert "/" not in safe_name("../../etc") and not safe_name("..x").startswith(".")


def test_incident_ids_name_the_rank_and_never_collide(tmp_path) -> None:
    rdir = str(tmp_path / "shared")
    store.prepare_report_dir(rdir)
    report = store.skeleton(trigger="stall", pid=1234, now=time.time())
    report["rank"] = rank_info(TORCHRUN_ENV)
    report["id"] = store.new_incident_id("stall", 1234, time.time(), rank=1)
    assert "-stall-r1-1234-" in report["id"]
    # another host's rank took the very same id first (a shared filesystem): nothing is overwritten
    taken = os.path.join(rdir, report["id"])
    os.mkdir(taken, 0o700)
    with open(os.path.join(taken, "report.json"), "w") as f:
        f.write("other host")
    path = store.write_incident(rdir, report, render_markdown=render.render_markdown)
    assert path != taken and os.path.basename(path).startswith(report["id"].rsplit("-", 1)[0])
    assert open(os.path.join(taken, "report.json")).read() == "other host"
    written = store.load_report(path)
    assert written["id"] == os.path.basename(path) and written["rank"]["job_id"] == TORCHRUN_ENV["TORCHELASTIC_RUN_ID"]


# --------------------------------------------------------------------------- collectives


def test_collective_named_from_python_and_native_frames() -> None:
    assert waiting_in_from_stack(thread(MAIN_ALL_REDUCE)) == "collective: all_reduce"
    assert waiting_in_from_stack(thread(MAIN_BARRIER_NATIVE_ONLY)) == "collective: barrier"
    assert waiting_in_from_stack(thread(MAIN_NCCL)) == "collective: all_reduce"


def test_lookalikes_are_not_collective_waits() -> None:
    # a main waiting for data (its loop body calls all_reduce, but not now), a loop body in its own
    # code, a worker locked in a dataset, an idle worker: none waits in a collective
    for frames in (MAIN_WAITING, MAIN_IN_BODY, WORKER_LOCKED, WORKER_IDLE):
        assert collective_from_stack(thread(frames)) is None
    # torch.distributed further out than the program's own code (a callback run from inside a
    # collective's hook, now sleeping in user code) is not a wait in that collective
    callback = [py("time.sleep", "/home/user/train/hooks.py", 3), py("all_reduce", DIST, 3252)]
    assert collective_from_stack(thread(callback)) is None


def test_rank_waiting_in_all_reduce_is_main_blocked_with_a_healthy_loader() -> None:
    main = proc(10, "main", syscall=202, frames=MAIN_ALL_REDUCE)
    v = classify_stall(
        [main, worker(0, frames=WORKER_IDLE, syscall=POLL), worker(1, frames=WORKER_IDLE, syscall=POLL)],
        main_waiting_for_data=False,
        expected_workers=2,
    )
    assert v.classification == "main-blocked"
    assert v.processes[0].waiting_in == "collective: all_reduce"
    assert v.processes[0].where == "train_step (train.py:40)"
    assert "collective all_reduce" in v.reason and "healthy" in v.reason


def test_own_deadlock_still_deadlock_and_loop_body_still_main_blocked() -> None:
    locked = classify_stall(
        [proc(10, "main", syscall=POLL, frames=MAIN_WAITING), worker(0, frames=WORKER_LOCKED)], expected_workers=1
    )
    assert locked.classification == "deadlock"
    body = classify_stall(
        [proc(10, "main", frames=MAIN_IN_BODY), worker(0, frames=WORKER_IDLE, syscall=POLL)],
        main_waiting_for_data=False,
    )
    assert body.classification == "main-blocked" and "collective" not in body.reason


def _stall_report(
    rank: int,
    job: str,
    *,
    main_frames_waiting: str | None,
    classification: str,
    findings=(),
    last_batch_ts: float | None = None,
    created: float | None = None,
) -> dict:
    created = created or time.time()
    r = store.skeleton(trigger="stall", pid=100 + rank, now=created)
    r["rank"] = {
        "rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "local_world_size": 2,
        "job_id": job,
        "job_id_source": "TORCHELASTIC_RUN_ID",
    }
    r["id"] = store.new_incident_id("stall", 100 + rank, created, rank=rank)
    r["classification"] = classification
    r["progress"] = {
        "batches": 3 if last_batch_ts else 0,
        "stall_s": 3.0,
        **({"last_batch_ts": last_batch_ts} if last_batch_ts else {}),
    }
    r["processes"] = [
        {"pid": 100 + rank, "role": "main", "status": "blocked", "waiting_in": main_frames_waiting},
        {"pid": 200 + rank, "role": "worker", "worker_id": 0, "status": "idle", "waiting_in": "queue get"},
    ]
    r["findings"] = [dict(f) for f in findings]
    r["config"] = {"report_dir": "/reports"}
    return r


DEADLOCK_FINDING = {
    "playbook": "worker-deadlock",
    "title": "DataLoader workers deadlocked",
    "confidence": 0.9,
    "evidence": {},
    "remediation": "spawn",
}


def test_annotate_waiting_rank_drops_dataloader_findings() -> None:
    r = _stall_report(
        0,
        "j1",
        main_frames_waiting="collective: all_reduce",
        classification="main-blocked",
        findings=[DEADLOCK_FINDING],
    )
    jobview.annotate(r)
    assert r["job"]["role"] == "waiting" and r["job"]["waiting_in"] == "collective: all_reduce"
    assert r["job"]["view"] == "dlwatch report --job /reports --job-id j1"
    assert r["findings"] == [] and any("worker-deadlock" in n for n in r["notes"])
    assert "waits in collective: all_reduce" in build.summary_line(r)


def test_annotate_lookalikes_keep_their_findings() -> None:
    # main-blocked in its own loop body (no collective): its own problem, findings kept
    r = _stall_report(
        0, "j1", main_frames_waiting="lock acquire", classification="main-blocked", findings=[DEADLOCK_FINDING]
    )
    jobview.annotate(r)
    assert r["job"]["role"] == "own" and r["findings"]
    # in a collective but its own workers are deadlocked: not only waiting
    r = _stall_report(0, "j1", main_frames_waiting="collective: barrier", classification="main-blocked")
    r["processes"][1].update(status="blocked", waiting_in="lock acquire", alive_by=[])
    jobview.annotate(r)
    assert r["job"]["role"] == "own"
    # a dataset's own network error that reads like a collective's (no torch.distributed frame)
    e = store.skeleton(trigger="exception", pid=5, now=time.time())
    e["exception"] = {
        "type": "ConnectionError",
        "message": "Connection closed by peer",
        "traceback": 'File "/home/user/data.py", line 3, in fetch',
    }
    jobview.annotate(e)
    assert "job" not in e  # no job, no collective: untouched
    # the real thing: gloo's error raised from all_reduce
    g = store.skeleton(trigger="exception", pid=5, now=time.time())
    g["exception"] = {
        "type": "torch.distributed.DistBackendError",
        "message": "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer",
        "traceback": f'File "{DIST}", line 3252, in all_reduce',
    }
    jobview.annotate(g)
    assert g["job"]["role"] == "waiting" and g["job"]["waiting_in"] == "collective error: DistBackendError"


# --------------------------------------------------------------------------- the job view


def _write(rdir: str, r: dict) -> str:
    jobview.annotate(r)
    return build.write(r, rdir)


def _figures(
    rdir: str,
    job: str,
    rank: int,
    *,
    share: float,
    rate: float,
    batches: int = 100,
    first: float | None = 1.0,
    idle: float | None = 0.1,
) -> None:
    d = os.path.join(rdir, rankfigures.JOBS_DIR, safe_name(job))
    os.makedirs(d, mode=0o700, exist_ok=True)
    rec = {
        "kind": "dlwatch-rank-figures",
        "version": 1,
        "job_id": job,
        "rank": rank,
        "local_rank": rank,
        "world_size": 2,
        "host": f"node{rank}",
        "pid": 100 + rank,
        "started_at": 1.0,
        "updated_at": time.time(),
        "ended": True,
        "batches": batches,
        "epochs": 1,
        "data_wait_s": 1.0,
        "step_s": 1.0,
        "data_wait_share": share,
        "batch_rate_per_s": rate,
        "first_batch_s": first,
        "first_batch_exact": True,
        "stalls": 0,
        "incidents": 0,
        "stalled": False,
        "worker_idle_share": idle,
        "worker_reads": 40 if idle is not None else 0,
    }
    replace_private(os.path.join(d, f"rank{rank}-node{rank}-{100 + rank}.json"), json.dumps(rec).encode())


def test_job_view_names_origin_and_waiters(tmp_path) -> None:
    rdir = str(tmp_path / "r")
    store.prepare_report_dir(rdir)
    now = time.time()
    # an older job in the same directory must not be mixed in
    _write(
        rdir,
        _stall_report(
            1,
            "old",
            main_frames_waiting=None,
            classification="deadlock",
            findings=[DEADLOCK_FINDING],
            created=now - 3600,
        ),
    )
    # rank 0 wrote first (it noticed sooner), but rank 1 stopped progressing first and has a cause of its own
    _write(
        rdir,
        _stall_report(
            0,
            "new",
            main_frames_waiting="collective: all_reduce",
            classification="main-blocked",
            last_batch_ts=now - 5,
            created=now - 1,
        ),
    )
    _write(
        rdir,
        _stall_report(
            1, "new", main_frames_waiting=None, classification="deadlock", findings=[DEADLOCK_FINDING], created=now
        ),
    )
    v = jobview.job_view(rdir)
    assert v["job_id"] == "new" and v["other_jobs"] == ["old"]
    assert v["origin"]["rank"] == 1 and v["origin"]["top_finding"] == "worker-deadlock"
    assert v["origin"]["classification"] == "deadlock"
    assert [(w["rank"], w["waiting_in"]) for w in v["waiting"]] == [(0, "collective: all_reduce")]
    assert [t["rank"] for t in v["timeline"]][-2:] == [0, 1]
    assert jobview.job_view(rdir, "old")["origin"]["rank"] == 1
    with pytest.raises(Exception, match="no job 'nope'"):
        jobview.job_view(rdir, "nope")
    # the command: text names the origin and the waiter; --json is the same view
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["report", "--job", rdir]) == 0
    text = out.getvalue()
    assert "stalled first: rank 1" in text and "-> worker-deadlock" in text
    assert "waited for it: rank 0" in text and "collective: all_reduce" in text
    out = io.StringIO()
    with redirect_stdout(out):
        assert cli_main(["report", rdir, "--job-id", "old", "--json"]) == 0
    assert json.loads(out.getvalue())["job_id"] == "old"


def test_job_view_without_an_origin_says_so(tmp_path) -> None:
    rdir = str(tmp_path / "r")
    store.prepare_report_dir(rdir)
    _write(rdir, _stall_report(0, "j", main_frames_waiting="collective: barrier", classification="main-blocked"))
    v = jobview.job_view(rdir)
    assert v["origin"] is None and v["missing_ranks"] == [1]
    assert "wrote none" in v["notes"][0]


def test_job_view_skips_damaged_and_linked_figures(tmp_path) -> None:
    rdir = str(tmp_path / "r")
    store.prepare_report_dir(rdir)
    _figures(rdir, "j", 0, share=0.1, rate=5.0)
    d = os.path.join(rdir, rankfigures.JOBS_DIR, "j")
    with open(os.path.join(d, "rank1-x-1.json"), "w") as f:
        f.write('{"kind": "dlwatch-rank-figures", "job_id": 5}')
    os.symlink("/etc/hostname", os.path.join(d, "rank2-x-2.json"))
    v = jobview.job_view(rdir)
    assert [f["rank"] for f in v["ranks"]] == [0]
    assert any("rank1-x-1.json" in w for w in v["warnings"]) and any("rank2-x-2.json" in w for w in v["warnings"])


def test_no_job_is_a_clear_error(tmp_path) -> None:
    rdir = str(tmp_path / "r")
    store.prepare_report_dir(rdir)
    err = io.StringIO()
    from contextlib import redirect_stderr

    with redirect_stderr(err):
        assert cli_main(["report", "--job", rdir]) == 3
    assert "no multi-rank job" in err.getvalue()


# --------------------------------------------------------------------------- stragglers


def ranks(*rows: tuple) -> list[dict]:
    """(data_wait_share, batch_rate_per_s, first_batch_s[, worker_idle_share]) per rank; idle defaults to 10%,
    None for a rank without workers."""
    out = []
    for i, row in enumerate(rows):
        s, r, f = row[:3]
        idle = row[3] if len(row) > 3 else 0.1
        out.append(
            {
                "rank": i,
                "host": f"node{i}",
                "batches": 200,
                "data_wait_share": s,
                "batch_rate_per_s": r,
                "first_batch_s": f,
                "worker_idle_share": idle,
                "worker_reads": 0 if idle is None else 100,
            }
        )
    return out


def test_straggler_rank_three_times_slower_data() -> None:
    # synchronous DDP: same rate everywhere; the straggler waits for data, the others in all_reduce
    # while their workers idle (figures as measured by test_ddp.py's 3x run)
    found = straggler.judge(ranks((0.08, 4.0, 1.1, 0.66), (0.72, 4.0, 2.9, 0.03)))
    assert [f["rank"] for f in found] == [1]
    assert "waits for data 72%" in found[0]["reason"] and "workers idle 66%" in found[0]["reason"]
    assert len(found[0]["evidence"]["ranks"]) == 2
    # ranks without workers load in their own loop: the wait share alone is their loading cost
    found = straggler.judge(ranks((0.1, 4.0, 1.0, None), (0.7, 4.0, 1.0, None)))
    assert [f["rank"] for f in found] == [1]
    # without a collective between ranks: its rate is a third of the others', and it is data-bound
    found = straggler.judge(ranks((0.3, 6.0, 1.0), (0.35, 6.2, 1.0), (0.5, 2.0, 1.0), (0.3, 5.9, 1.0)))
    assert [f["rank"] for f in found] == [2] and "batches/s" in found[0]["reason"]
    # a cold shard: the first batch far later
    found = straggler.judge(ranks((0.1, 4.0, 2.0), (0.1, 4.0, 30.0), (0.1, 4.0, 2.5)))
    assert [f["rank"] for f in found] == [1] and "first batch" in found[0]["reason"]


@pytest.mark.parametrize(
    "rows",
    [
        # eight balanced ranks with ordinary noise
        [(0.10 + 0.02 * (i % 3), 4.0 + 0.3 * (i % 2), 1.0 + 0.4 * (i % 4)) for i in range(8)],
        # rank 0 logs, evaluates and checkpoints in its loop body: slower, but not waiting for data
        [(0.02, 2.0, 1.0), (0.10, 4.1, 1.0), (0.11, 4.0, 1.2), (0.09, 4.2, 0.9)],
        # every rank input-bound alike (a slow shared store): slow, but nobody straggles
        [(0.80, 1.0, 5.0), (0.82, 1.0, 5.5), (0.78, 1.1, 4.8)],
        # first-batch jitter of seconds (worker start-up under load)
        [(0.1, 4.0, 0.5), (0.1, 4.0, 2.4), (0.1, 4.0, 0.6)],
        # lock-step ranks whose data is equally slow: one rank a hair behind always waits for data, the
        # other in all_reduce; nobody's workers idle (figures as measured by test_ddp.py's even run)
        [(0.08, 40.0, 0.2, 0.04), (0.68, 40.0, 0.2, 0.02)],
        # the same, with the idle noise one even run showed (one rank's workers idle in 25% of the reads)
        [(0.67, 44.8, 0.2, 0.0), (0.08, 44.4, 0.2, 0.25)],
    ],
)
def test_straggler_lookalikes_stay_quiet(rows) -> None:
    assert straggler.judge(ranks(*rows)) == []


def test_straggler_idle_share_needs_enough_reads() -> None:
    rows = ranks((0.08, 4.0, 1.1, 0.66), (0.72, 4.0, 2.9, 0.03))
    for r in rows:
        r["worker_reads"] = 6  # a short run polled a few times: the idle shares are noise
    assert straggler.judge(rows) == []


def test_straggler_needs_enough_batches_and_two_ranks() -> None:
    few = ranks((0.1, 4.0, 1.0), (0.9, 4.0, 1.0))
    for r in few:
        r["batches"] = 5
    assert straggler.judge(few) == []
    assert straggler.judge(ranks((0.9, 1.0, 1.0))) == []


def test_straggler_thresholds_come_from_the_playbook() -> None:
    t = straggler.thresholds()
    assert t["wait_share_gap"] == 0.25 and t["min_batches"] == 20


def test_job_view_shows_straggler_without_incident(tmp_path) -> None:
    rdir = str(tmp_path / "r")
    store.prepare_report_dir(rdir)
    _figures(rdir, "j", 0, share=0.07, rate=4.0, idle=0.6)
    _figures(rdir, "j", 1, share=0.70, rate=4.0, idle=0.02)
    v = jobview.job_view(rdir)
    assert v["incidents"] == [] and v["origin"] is None
    assert [s["rank"] for s in v["stragglers"]] == [1]
    text = "\n".join(jobview.job_lines(v))
    assert "straggler-rank: rank 1" in text and "no incident: no rank stalled" in text


def _make_sink(report_dir, rank, barrier):
    from dlwatch.monitor.rankfigures import RankFiguresSink

    barrier.wait(30)
    RankFiguresSink(report_dir, {"job_id": "race", "rank": rank}, pid=os.getpid())


def test_ranks_creating_the_job_directory_at_once_all_get_their_figures(tmp_path):
    """Ranks start together: .jobs and .jobs/<job> are both missing, and one rank can lose both
    races in a row (measured: 98 of 800 sinks failed before the retry; a missing rank in the job view)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    failed = 0
    for i in range(20):
        report_dir = str(tmp_path / f"r{i}")
        os.mkdir(report_dir, 0o700)
        barrier = ctx.Barrier(4)
        procs = [ctx.Process(target=_make_sink, args=(report_dir, r, barrier)) for r in range(4)]
        try:
            for p in procs:
                p.start()
            for p in procs:
                p.join(30)
            failed += sum(p.exitcode != 0 for p in procs)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                    p.join()
    assert failed == 0


def test_rank_figures_and_run_summary_share_one_steady_definition(tmp_path) -> None:
    """The job view's data_wait_share/batch_rate_per_s are the summary's steady figures (runstats.steady)."""
    from dlwatch.collect.runstats import RunStats
    from dlwatch.wire.heartbeat import STATE_BODY, STATE_ENDED, Heartbeat
    from dlwatch.monitor.rankfigures import RankFiguresSink
    from dlwatch.monitor.sinks import PollState

    def hb(batches: int, epochs: int, wait: float, step: float, first: float, state: int = STATE_BODY) -> Heartbeat:
        return Heartbeat(
            batches=batches,
            epoch_batches=batches,
            epochs=epochs,
            state=state,
            pid=1,
            ts_last_batch=10.0,
            ts_wait_start=9.0,
            total_wait_s=wait,
            total_step_s=step,
            last_interval_s=0.1,
            ts_first_batch=1.0,
            total_first_wait_s=first,
        )

    sink = RankFiguresSink(str(tmp_path), {"job_id": "one", "rank": 0, "world_size": 1}, pid=os.getpid())

    def poll(h: Heartbeat, *, end: bool = False) -> dict:
        st = PollState(
            now=time.time(),
            monotonic=time.monotonic(),
            pid=os.getpid(),
            started_at=0.0,
            rank=sink.rank,
            heartbeat=h,
            procs=(),
            system=None,
            stalls=0,
            incidents=0,
            stalled=False,
        )
        sink.close(st, clean=True) if end else sink.on_poll(st)
        with open(sink.path) as f:
            return json.load(f)

    # one batch: nothing steady yet, the whole run's figures (start-up included)
    first = poll(hb(1, 1, 3.0, 0.1, 3.0))
    assert first["data_wait_share"] == round(3.0 / 3.1, 4) and first["first_batch_exact"]
    # two epochs: 4.5 s of their first waits are start-up, 1.5 s steady wait, 6 s of body, 98 steady batches
    end = hb(100, 2, 6.0, 6.0, 4.5, STATE_ENDED)
    rec = poll(end, end=True)
    loop = RunStats(started_at=0.0).figures(end, ended_at=12.0)["loop"]
    assert rec["data_wait_share"] == loop["steady_data_wait_share"] == round(1.5 / 7.5, 4)
    assert rec["batch_rate_per_s"] == round(98 / 7.5, 4) and loop["steady_batch_s"] == round(7.5 / 98, 6)
    assert rec["data_wait_s"] == 6.0 and rec["batches"] == 100  # the totals stay the whole run's
