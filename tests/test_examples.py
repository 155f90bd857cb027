"""End to end: each script in examples/ makes its failure happen for real, and dlwatch names it.

Every example runs as a subprocess in its own session, bounded in time; the
test kills whatever is left in ``finally`` and fails if the example itself left
a process behind (any process whose command line names the test's report dir:
the training process, its workers, dlwatch's monitor).
"""

from __future__ import annotations

import json
import os
from datetime import datetime
import sys
import time
from dataclasses import dataclass

import pytest

from conftest import cpu_starved, REPO, load, run_to_end

EXAMPLES = os.path.join(REPO, "examples")
EXAMPLE_TIMEOUT_S = 60  # the examples promise to end by themselves within this


@dataclass
class Run:
    returncode: int
    stdout: str
    stderr: str
    reports: list[str]
    seconds: float

    def report(self, i: int = -1) -> dict:
        return load(self.reports[i])

    def top(self, report: dict) -> dict:
        assert report["findings"], f"no finding in {report['id']}: {report['summary']}"
        return report["findings"][0]


def run_example(name: str, report_dir: str) -> Run:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    env.pop("DLWATCH_DIR", None)
    t0 = time.monotonic()
    # nothing may outlive the example (a monitor exits within a poll or two of its training process)
    returncode, out, err = run_to_end(
        [sys.executable, os.path.join(EXAMPLES, f"{name}.py"), "--report-dir", report_dir],
        env=env,
        marker=report_dir,
        timeout=EXAMPLE_TIMEOUT_S,
        what=name,
    )
    seconds = time.monotonic() - t0
    assert returncode == 0, f"{name} exited {returncode}\nstdout:\n{out}\nstderr:\n{err[-3000:]}"
    reports = [line[len("REPORT ") :] for line in out.splitlines() if line.startswith("REPORT ")]
    for path in reports:
        assert os.path.isfile(os.path.join(path, "report.json")) and os.path.isfile(os.path.join(path, "report.md"))
    # the script names every incident in its report dir, and nothing else
    # (runs/ holds the run summaries: never an incident)
    listed = (
        {os.path.join(report_dir, n) for n in os.listdir(report_dir) if not n.startswith(".") and n != "runs"}
        if os.path.isdir(report_dir)
        else set()
    )
    assert set(reports) == listed
    return Run(returncode, out, err, reports, seconds)


@pytest.fixture
def report_dir(tmp_path) -> str:
    return str(tmp_path / "reports")


def _only_playbook(run: Run, playbook: str) -> None:
    assert run.reports, f"no incident\nstdout:\n{run.stdout}\nstderr:\n{run.stderr[-3000:]}"
    for path in run.reports:
        r = load(path)
        assert r["findings"] and r["findings"][0]["playbook"] == playbook, (path, r["summary"], r["findings"][:1])


def test_lock_owner_names_the_thread_and_its_line(report_dir):
    run = run_example("lock_owner", report_dir)
    _only_playbook(run, "lock-held-at-fork")
    (path,) = run.reports
    r = load(path)
    assert r["classification"] == "deadlock"
    ev = r["findings"][0]["evidence"]
    assert ev["holder_thread"] == "metrics-flusher"
    assert ev["holder_frame"].startswith("flush (") and "lock_owner.py:" in ev["holder"]
    assert "`self._lock`" in ev["holder"] and "lock_owner.py:" in ev["lock"]
    # the idle thread is listed as alive at the fork, never named
    assert any(t.startswith("heartbeat: ") and "(idle: " in t for t in ev["threads_at_fork"])
    assert "heartbeat" not in ev["holder"]
    assert "worker-deadlock" in [f["playbook"] for f in r["findings"]]


def test_lock_unknown_holder_says_unknown_rather_than_guess(report_dir):
    run = run_example("lock_unknown_holder", report_dir)
    _only_playbook(run, "worker-deadlock")
    (path,) = run.reports
    r = load(path)
    assert "lock-held-at-fork" not in [f["playbook"] for f in r["findings"]]
    ev = r["findings"][0]["evidence"]
    assert ev["holder"].startswith("unknown: ")
    assert [t.split(":")[0] for t in ev["threads_at_fork"]] == ["prefetcher"]


def test_producer_gone_links_the_dead_decoder(report_dir):
    run = run_example("producer_gone", report_dir)
    _only_playbook(run, "producer-gone")
    (path,) = run.reports
    r = load(path)
    assert r["classification"] == "deadlock"
    ev = r["findings"][0]["evidence"]
    assert "wait in queue get" in ev["link"] and "was killed by SIGKILL" in ev["link"]
    assert ev["producer"].endswith("SIGKILL")
    dl = next(f for f in r["findings"] if f["playbook"] == "worker-deadlock")
    assert "A queue or pipe nobody feeds" in dl["remediation"] and "held across fork" not in dl["remediation"]


def test_af_unix_path_too_long_names_the_directory(report_dir):
    run = run_example("af_unix_path_too_long", report_dir)
    _only_playbook(run, "af-unix-path-too-long")
    (path,) = run.reports
    r = load(path)
    assert r["trigger"] == "stall" and r["progress"]["batches"] == 0
    ev = r["findings"][0]["evidence"]
    assert ev["path_len"] > ev["path_max"] == 107 and ev["socket"] == "multiprocessing"
    assert "AF_UNIX path too long" in run.stderr  # what the workers' feeder threads died of, for real
    assert not os.path.exists(os.path.dirname(ev["base"])), "the example's scratch directory is left behind"


def test_cat_collate(report_dir):
    run = run_example("cat_collate", report_dir)
    assert "loop finished" in run.stdout  # nothing raised
    _only_playbook(run, "batch-dim-mismatch")
    (path,) = run.reports
    r = load(path)
    assert r["trigger"] == "threshold" and r["exception"] is None
    ev = r["findings"][0]["evidence"]
    assert ev["shapes"] == {"batch[0]": [12, 8, 8], "batch[1]": [4]}
    assert ev["leading_dims"] == {"batch[0]": 12, "batch[1]": 4}
    assert ev["reason"] == "inconsistent_leading_dims"
    assert ev["expected_batch_size"] == 4 and ev["batch_index"] == 0
    assert ev["collate_fn"].endswith("cat_collate")


def test_rng_duplication(report_dir):
    run = run_example("rng_duplication", report_dir)
    _only_playbook(run, "rng-duplication")
    (path,) = run.reports
    r = load(path)
    assert r["trigger"] == "threshold"
    dups = {d["attribute"]: d for d in r["findings"][0]["evidence"]["duplicates"]}
    assert set(dups) == {"dataset.rng", "dataset.py_rng"}  # the globals are seeded apart by torch
    for d in dups.values():
        assert d["workers"] == [0, 1] and d["kind"] == "object"
    assert "global:random" not in dups and "global:numpy" not in dups and "global:torch" not in dups


def test_rng_epoch_repeat(report_dir):
    run = run_example("rng_epoch_repeat", report_dir)
    epochs = [line.split(": ", 1)[1] for line in run.stdout.splitlines() if line.startswith("epoch ")]
    assert len(epochs) == 2 and epochs[0] == epochs[1]  # the same jitters both epochs, for real
    _only_playbook(run, "rng-duplication")
    (path,) = run.reports
    r = load(path)
    assert r["trigger"] == "threshold"
    ev = r["findings"][0]["evidence"]
    assert ev["repeats"] == [{"attribute": "global:random", "workers": [0, 1], "epochs": [1, 2], "kind": "global"}]
    assert "duplicates" not in ev  # each worker has its own stream; it is the epochs that repeat
    assert ev["worker_init_fn"].endswith("seed_worker") and ev["persistent_workers"] is False


def test_fd_exhaustion(report_dir):
    run = run_example("fd_exhaustion", report_dir)
    assert "training loop failed" in run.stdout
    _only_playbook(run, "fd-exhaustion")
    r = run.report(-1)  # the failure itself; a threshold incident may come first
    assert r["trigger"] == "exception"
    assert r["exception"]["from_loader"] is True
    assert "Too many open files" in r["exception"]["message"]
    ev = r["findings"][0]["evidence"]
    assert ev["exception"]["errno"] == 24
    assert ev["fd_limit"] == 128 and ev["num_fds"] >= 0.9 * 128  # the example's `ulimit -n 128`
    assert ev["role"] == "worker"
    assert ev["cause"] == "regular-files"
    assert ev["sharing_strategy"] == "file_system"
    assert ev["fds"]["file"] >= 0.5 * 128  # the leaked handles
    assert ev["top_files"] and ev["top_files"][0][1] >= 0.5 * 128  # one path opened over and over
    assert any(a["role"] == "worker" for a in ev["at_fd_limit"])
    if len(run.reports) > 1:  # the climb was seen long before the crash: two events, linked
        first = run.report(0)
        assert first["trigger"] == "threshold" and first["findings"][0]["playbook"] == "fd-exhaustion"
        assert r["related"][0]["id"] == first["id"]  # one failure: the exception names the earlier incident
        gap = datetime.fromisoformat(r["created_at"]) - datetime.fromisoformat(first["created_at"])
        assert gap.total_seconds() >= 1  # never two incidents in the same second for one event
    else:  # the climb and the crash as one event: one incident, the threshold noted in it when it was seen
        noted = [n for n in r.get("notes") or () if "crossed its threshold" in n]
        assert all("one event, one incident" in n for n in noted)


def test_sampler_exhausted_early(report_dir):
    run = run_example("sampler_exhausted_early", report_dir)
    assert "asked 16 batches, got 12" in run.stdout  # the program's own view: the sampler ran out
    _only_playbook(run, "sampler-exhausted-early")
    (path,) = run.reports
    r = load(path)
    assert r["trigger"] == "threshold"
    ev = r["findings"][0]["evidence"]
    assert (ev["epoch"], ev["batches"], ev["asked_len"], ev["missing_batches"]) == (0, 12, 16, 4)


def test_shm_exhaustion(report_dir):
    run = run_example("shm_exhaustion", report_dir)
    skip = [line for line in run.stdout.splitlines() if line.startswith("SKIP: ")]
    if skip:
        assert not run.reports
        pytest.skip(skip[0][len("SKIP: ") :])
    _only_playbook(run, "shm-exhaustion")
    r = run.report(-1)
    assert r["trigger"] == "exception"
    assert "unable to allocate shared memory" in r["exception"]["message"]
    ev = r["findings"][0]["evidence"]
    assert ev["errno"] == 28
    assert ev["shm_total"] == 8 << 20  # the example's tmpfs, seen from inside its namespace
    assert ev["loader"]["batch_size"] == 4 and ev["loader"]["num_workers"] == 2
    assert r["system"]["shm_total"] == 8 << 20


def test_deadlock(report_dir):
    run = run_example("deadlock", report_dir)
    _only_playbook(run, "lock-held-at-fork")  # the holder is named (#21 item 1); worker-deadlock follows
    (path,) = run.reports
    r = load(path)
    assert [f["playbook"] for f in r["findings"]][:2] == ["lock-held-at-fork", "worker-deadlock"]
    holder = r["findings"][0]["evidence"]["holder"]
    assert "refresh_in_background" in holder and "deadlock.py:" in holder and "`self.lock`" in holder
    assert r["trigger"] == "stall" and r["classification"] == "deadlock"
    assert r["progress"]["batches"] == 0 and r["progress"]["stall_s"] >= 3
    ev = r["findings"][1]["evidence"]  # worker-deadlock's: the workers' stacks
    workers = ev["workers"]
    assert len(workers) == 2
    for w in workers:
        assert w["state"] == "S" and w["cpu_progress_s"] == 0
        assert w["waiting_in"] == "lock acquire"
        assert w["user_frame"].startswith("CachedSamples.__getitem__ (") and "deadlock.py" in w["user_frame"]
        assert any("acquire_lock" in f for f in w["frames"])  # the lock wait itself
    assert ev["multiprocessing_context"] == "fork"
    assert run.seconds < 30


def test_io_stall(report_dir):
    run = run_example("io_stall", report_dir)
    _only_playbook(run, "io-stall")
    (path,) = run.reports
    r = load(path)
    assert r["trigger"] == "stall" and r["classification"] == "io-wait"
    assert r["progress"]["batches"] == 0 and r["progress"]["stall_s"] >= 3
    assert all(f["playbook"] != "worker-deadlock" for f in r["findings"])
    ev = r["findings"][0]["evidence"]
    workers = ev["workers"]
    assert {w["worker_id"] for w in workers} == {0, 1}
    (peer,) = ev["peers"]
    assert peer["workers"] == 2 and peer["peer"].startswith("127.0.0.1:")
    for w in workers:
        assert w["via"] == "thread pool" and w["thread"].startswith("fetch") and w["tid"] != w["pid"]
        assert w["kind"] == "socket poll"  # http.client's 600 s timeout: the read waits in poll
        assert w["peer"] == peer["peer"] and w["tcp_state"] == "ESTABLISHED"
        assert w["where"].startswith("RemoteShards._get (") and "io_stall.py" in w["where"]
    assert ev["stall_s"] >= 3
    assert ev["wait"].startswith("worker ") and f"socket poll on {peer['peer']} ESTABLISHED for " in ev["wait"]
    assert run.seconds < 30


def _skip_if_said(run: Run) -> None:
    skip = [line for line in run.stdout.splitlines() if line.startswith("SKIP: ")]
    if skip:
        assert not run.reports
        pytest.skip(skip[0][len("SKIP: ") :])


def test_worker_segfault(report_dir):
    run = run_example("worker_segfault", report_dir)
    assert "training loop failed" in run.stdout
    _only_playbook(run, "worker-killed")
    r = run.report(-1)
    assert r["trigger"] == "exception"
    ev = r["findings"][0]["evidence"]
    assert ev["cause"] == "native-crash" and ev["exit_signal"] == "SIGSEGV"
    assert ev["crash"]["fatal_error"] == "Segmentation fault"
    # the dataset line torch never names: ctypes.string_at(0) in NativeDecoder.__getitem__
    assert ev["crash_frame"].startswith("__getitem__ (") and "worker_segfault.py:" in ev["crash_frame"]
    crashed = next(p for p in r["processes"] if p["pid"] == ev["pid"])
    assert crashed["stack"]["source"] == "faulthandler-crash"
    assert "from faulthandler-crash" in open(os.path.join(run.reports[-1], "report.md")).read()


def test_worker_killed_from_outside(report_dir):
    run = run_example("worker_killed", report_dir)
    # the loop's read says "exited unexpectedly"; torch's SIGCHLD handler says "is killed by signal" when
    # it runs first (rare, seen on a loaded machine): both are this kill, and give the same finding
    assert "exited unexpectedly" in run.stdout or "is killed by signal: Killed" in run.stdout, run.stdout
    _only_playbook(run, "worker-killed")
    r = run.report(-1)
    ev = r["findings"][0]["evidence"]
    assert ev["exit_signal"] == "SIGKILL"
    assert ev["cause"] == "external-kill", ev["cause_basis"]  # not called an OOM kill
    assert "OOM" not in r["findings"][0]["title"]
    assert any(m.get("rss") for m in ev["memory"])  # its memory up to the end (a read may miss a figure)


def test_worker_oom_kill(report_dir):
    run = run_example("worker_oom", report_dir)
    _skip_if_said(run)
    r = run.report(-1)
    assert r["trigger"] == "exception"
    top = run.top(r)
    assert top["playbook"] == "worker-killed"
    ev = top["evidence"]
    assert ev["cause"] == "oom-kill", ev["cause_basis"]
    assert ev["exit_signal"] == "SIGKILL"
    assert ev["oom_kills"]["after"]["cgroup"] > ev["oom_kills"]["before"]["cgroup"]
    assert ev["memory_limit"]["cgroup_memory_limit"] == 1 << 30
    for path in run.reports[:-1]:  # growth seen before the kill, if any: that playbook only
        assert load(path)["findings"][0]["playbook"] == "worker-memory-growth"


def test_copy_on_read_caught_before_any_kill(report_dir):
    run = run_example("copy_on_read", report_dir)
    _skip_if_said(run)
    _only_playbook(run, "worker-memory-growth")
    (path,) = run.reports
    r = load(path)
    assert r["trigger"] == "threshold" and r["exception"] is None
    ev = r["findings"][0]["evidence"]
    assert ev["copy_on_read"] is True and ev["workers_growing"] >= 1 and ev["workers"] == 2
    assert ev["limit"] == "cgroup memory limit" and ev["limit_in_s"] <= ev["horizon_s"]
    for g in ev["growth"]:
        assert g["uss"]["rise_bytes"] >= 64 << 20
        assert abs(g["rss_last"] - g["rss_first"]) < g["uss"]["rise_bytes"] * 0.3  # RSS flat
    assert r["system"]["cgroup_oom_kills"] == 0  # before any kill


def test_pinned_growth(report_dir):
    run = run_example("pinned_growth", report_dir)
    _skip_if_said(run)
    _only_playbook(run, "pinned-memory-growth")
    (path,) = run.reports
    ev = load(path)["findings"][0]["evidence"]
    assert ev["growth"]["rise_bytes"] >= 64 << 20
    (locker,) = ev["lockers"]
    assert locker["role"] == "main" and locker["vm_lck_rise"] >= 64 << 20


@pytest.mark.parametrize(
    "name",
    [
        "healthy_fast",
        "healthy_slow",
        "healthy_workers0",
        "healthy_eval_pause",
        "healthy_detection_collate",
        "healthy_numpy_dataset",
        "healthy_warmup",
        "healthy_pinned_flat",
    ],
)
def test_healthy_examples_raise_nothing(name, report_dir):
    run = run_example(name, report_dir)
    assert run.reports == []
    # no incident notice, no warning; the one line a run summary with advice prints is neither
    # (these loops have no step at all: waiting for data is most of their time, and input-bound
    # may say so, measured; advice is never an incident)
    notices = [
        ln
        for ln in run.stderr.splitlines()
        if "dlwatch:" in ln and not ln.startswith("dlwatch: run summary with advice (")
    ]
    assert notices == []
    assert "no incident" in run.stdout


# --------------------------------------------------------------------------- advice: run summaries, no incidents


def _summary(run: Run) -> dict:
    (line,) = [ln for ln in run.stdout.splitlines() if ln.startswith("SUMMARY ")]
    with open(os.path.join(line[len("SUMMARY ") :], "summary.json")) as f:
        return json.load(f)


def _advice(run: Run, playbook: str) -> dict:
    assert run.reports == [], "advice is never an incident"
    s = _summary(run)
    by_id = {f["playbook"]: f for f in s["advice"]}
    assert playbook in by_id, (playbook, list(by_id), s["loop"])
    f = by_id[playbook]
    assert set(f) == {"playbook", "title", "confidence", "evidence", "remediation"} and f["remediation"]
    assert f"run summary with advice ({', '.join(by_id)})" in run.stderr  # the one-line pointer
    return f["evidence"]


def test_input_bound(report_dir):
    ev = _advice(run_example("input_bound", report_dir), "input-bound")
    assert ev["cause"] == "cpu-saturated"  # one worker, 2 CPUs: one for the loop, none spare
    assert ev["steady_data_wait_share"] >= 0.5 and ev["steady_batches"] == 119
    # The worker wants the CPU all the time (runnable or running: true however loaded the machine is);
    # how much it gets depends on the machine's other load, so the measured utilisation is checked
    # against the example's own arithmetic (60 ms of CPU per batch over the measured batch interval),
    # not against a fixed figure that four busy neighbours move (0.48 at load 7, 0.6+ when quiet).
    assert ev["worker_state_share"]["running"] >= 0.75
    assert ev["worker_cpu_util_mean"] == pytest.approx(0.06 / ev["steady_batch_s"], rel=0.3), ev
    assert ev["num_workers"] == 1 and ev["usable_cpus"] == 2


def test_slow_epoch_start(report_dir):
    run = run_example("slow_epoch_start", report_dir)
    ev = _advice(run, "slow-epoch-start")
    assert ev["epochs"] == 3 and ev["first_batch_mean_s"] >= 1.5 and ev["first_batch_factor"] >= 10
    assert ev["cost_per_epoch_s"] >= 1.4 and ev["cost_total_s"] >= 2.8  # persistent workers save epochs 2 and 3
    assert "input-bound" not in {f["playbook"] for f in _summary(run)["advice"]}  # cold start is not input-bound


def test_prefetch_too_deep(report_dir):
    ev = _advice(run_example("prefetch_too_deep", report_dir), "prefetch-too-deep")
    assert ev["prefetch_factor"] == 8 and ev["batch_bytes"] == 16 * 3 * 224 * 224 * 4 + 16 * 8
    assert ev["inflight_bytes"] == ev["batch_bytes"] * 2 * 8 and ev["saves_bytes"] == ev["batch_bytes"] * 2 * 6
    assert ev["blocked_put_share"] >= 0.5
    assert ev["shm_used_peak"] >= 0.5 * ev["inflight_bytes"]  # the memory was measured in /dev/shm


def test_too_many_workers(report_dir):
    run = run_example("too_many_workers", report_dir)
    ev = _advice(run, "too-many-workers")
    assert ev["num_workers"] == 8 and ev["usable_cpus"] <= 2 and ev["worker_cpu_util_mean"] <= 0.6
    assert ev["worker_running_share"] >= 0.6
    assert "too-many-workers" in {f["playbook"] for f in _summary(run)["preflight"]}
    # the script's affinity is what torch checks: torch warns itself, and dlwatch does not say it again
    assert "This DataLoader will create 8 worker processes" in run.stderr
    assert "dlwatch: too-many-workers" not in run.stderr


def test_pin_memory_cpu(report_dir):
    run = run_example("pin_memory_cpu", report_dir)
    if "SKIP: " in run.stdout:
        pytest.skip("a CUDA device is present")
    ev = _advice(run, "pin-memory-without-cuda")
    assert ev["pin_memory"] is True and ev["cuda_available"] is False
    assert [f["playbook"] for f in _summary(run)["preflight"]] == ["pin-memory-without-cuda"]


def test_sampler_no_set_epoch(report_dir):
    run = run_example("sampler_no_set_epoch", report_dir)
    assert "the same order every epoch: True" in run.stdout  # the script's own check
    ev = _advice(run, "sampler-epoch-not-set")
    assert ev["sampler"] == "torch.utils.data.distributed.DistributedSampler"
    assert ev["sampler_epoch_each_epoch"] == [0, 0, 0] and ev["shuffle"] is True and ev["num_replicas"] == 1


def test_balanced_run_earns_no_advice(report_dir):
    run = run_example("balanced", report_dir)
    assert run.reports == []
    s = _summary(run)
    assert s["preflight"] == [] and s["loop"]["epochs"] == 3
    starved = cpu_starved(s)
    if starved and s["advice"]:
        # the premise (two workers get the CPU they need) did not hold: input-bound was earned
        assert [f["playbook"] for f in s["advice"]] == ["input-bound"], s["advice"]
        pytest.skip(f"the machine was too loaded for a balanced run: {starved}")
    assert s["advice"] == [] and s["loop"]["steady_data_wait_share"] < 0.2
    assert s["loop"]["steady_data_wait_s"] + s["loop"]["body_s"] >= 5  # long enough that input-bound was judged
    assert "dlwatch:" not in run.stderr and "no advice" in run.stdout


def test_deadlock_incident_carries_the_fork_with_threads_preflight(report_dir):
    # the preflight finding, made before the workers forked, names the thread that held the lock
    run = run_example("deadlock", report_dir)
    (path,) = run.reports
    (pre,) = [e for e in load(path)["events"] if e.get("event") == "advice" and e.get("stage") == "preflight"]
    assert pre["playbook"] == "fork-with-threads" and pre["start_method"] == "fork"
    assert [t["name"] for t in pre["threads"]] == ["Thread-1 (refresh_in_background)"]
    assert "refresh_in_background" in pre["threads"][0]["runs"] and "deadlock.py" in pre["threads"][0]["runs"]
    assert "DlwatchWarning: dlwatch: fork-with-threads" in run.stderr
