"""Advice: each advisor earns its finding from measured figures and stays quiet on look-alikes.

Hand-built run figures (the summary's ``loop``, ``workers``, ``peaks``, ``cpus``) cover the
judgement, including the healthy look-alikes; RunStats is fed hand-built /proc samples.
The real runs that earn each advice are in test_examples.py.
"""

from __future__ import annotations

import copy

import pytest

from dlwatch.detect import build
from dlwatch.detect.advice import (
    DatasetMemoryPerWorker,
    InputBound,
    PrefetchTooDeep,
    SamplerEpochNotSet,
    SlowEpochStart,
    TooManyWorkers,
    to_finding,
)
from dlwatch.detect.base import View
from dlwatch.collect.runstats import RunStats, classify_interval, worker_totals
from dlwatch.wire.heartbeat import STATE_BODY, STATE_WAITING, Heartbeat
from dlwatch.model import GpuSample, ProcSample, SystemSample
from dlwatch.wire.playbooks import load_playbooks

MIB = 1 << 20
PBS = {pb.id: pb for pb in load_playbooks()}


def thresholds(cls):
    return dict(PBS[cls.playbook].thresholds)


def worker(wid, util, running, waiting=0.0, blocked=0.0, io=0.0, observed=10.0, uss=20 * MIB):
    states = {
        "running": running * observed,
        "waiting_for_work": waiting * observed,
        "blocked_put": blocked * observed,
        "io": io * observed,
    }
    return {
        "pid": 100 + wid,
        "worker_id": wid,
        "cpu_util": util,
        "observed_s": observed,
        "state_s": states,
        "state_share": {k: v / observed for k, v in states.items()},
        "rss_peak": 200 * MIB,
        "uss_peak": uss,
    }


def run(**over):
    base = {
        "loop": {
            "batches": 300,
            "epochs": 1,
            "steady_batches": 299,
            "steady_data_wait_share": 0.05,
            "steady_data_wait_s": 0.5,
            "body_s": 9.5,
            "steady_batch_s": 0.0334,
            "first_batch_s": {"per_epoch": [0.3], "mean_s": 0.3, "total_s": 0.3},
        },
        "workers": [worker(0, 0.4, 0.4, waiting=0.1, blocked=0.5), worker(1, 0.4, 0.4, waiting=0.1, blocked=0.5)],
        "main": {"pid": 1, "cpu_util": 0.9},
        "peaks": {"gpus": [], "mem_available": {"first": 16 << 30}, "cgroup_memory": {"limit": None}},
        "cpus": {"usable": 8, "affinity": 8, "cgroup_quota": None},
    }
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(base.get(k), dict):
            base[k] = {**base[k], **v}
        else:
            base[k] = v
    return base


LOADER = {
    "num_workers": 2,
    "prefetch_factor": 2,
    "persistent_workers": False,
    "pin_memory": False,
    "batch_bytes": 1 * MIB,
}


def judge(cls, r, loader=LOADER):
    return cls(thresholds(cls)).judge(r, loader)


# --------------------------------------------------------------------------- the balanced run


def test_a_balanced_run_earns_no_advice_from_any_advisor():
    view = View(now=0.0, procs={}, loader=LOADER, loader_pids=frozenset(), system=None, heartbeat=None, run=run())
    detectors = build({pb.id: pb.thresholds for pb in PBS.values()})
    assert [s for d in detectors for s in d.on_finish(view)] == []


# --------------------------------------------------------------------------- input-bound


def input_bound_run(**loop):
    return run(loop={"steady_data_wait_share": 0.6, "steady_data_wait_s": 12.0, "body_s": 8.0, **loop})


def test_input_bound_cpu_saturated_workers_and_no_spare_cpus():
    r = input_bound_run()
    r["workers"] = [worker(0, 0.95, 0.97), worker(1, 0.93, 0.96)]
    r["cpus"] = {"usable": 2}
    sig = judge(InputBound, r)
    assert sig["playbook"] == "input-bound" and sig["cause"] == "cpu-saturated"
    assert sig["steady_data_wait_share"] == 0.6 and sig["worker_cpu_util_mean"] == 0.94


def test_input_bound_too_few_workers_when_cpus_are_free():
    r = input_bound_run()
    r["workers"] = [worker(0, 0.95, 0.97), worker(1, 0.93, 0.96)]
    sig = judge(InputBound, r)
    assert sig["cause"] == "too-few-workers" and sig["suggested_num_workers"] == 7


def test_input_bound_io_bound_workers():
    r = input_bound_run()
    r["workers"] = [worker(0, 0.1, 0.1, io=0.85, waiting=0.05), worker(1, 0.1, 0.1, io=0.8, waiting=0.1)]
    sig = judge(InputBound, r)
    assert sig["cause"] == "io-bound" and sig["worker_state_share"]["io"] == pytest.approx(0.825)
    finding = to_finding(sig, PBS)
    assert finding["remediation"].startswith("**The workers wait on storage.**")


def test_input_bound_main_process_loading():
    sig = judge(InputBound, input_bound_run(), {**LOADER, "num_workers": 0})
    assert sig["cause"] == "main-process-loading" and sig["main_cpu_util"] == 0.9


@pytest.mark.parametrize(
    "loop",
    [
        {"steady_batches": 2, "steady_data_wait_s": 0.01, "body_s": 0.01},  # a 3-batch smoke test: all cold start
        {"steady_data_wait_s": 1.0, "body_s": 2.0},  # too short to judge
        {"steady_data_wait_share": 0.1},  # ordinary jitter
    ],
)
def test_input_bound_quiet_on_smoke_tests_short_runs_and_jitter(loop):
    assert judge(InputBound, input_bound_run(**loop)) is None


def test_input_bound_quiet_when_the_gpus_are_busy():
    # CUDA launches are asynchronous: a loop waiting for data while the GPU works is not input-bound
    r = input_bound_run()
    r["peaks"] = {**r["peaks"], "gpus": [{"index": 0, "util_mean": 97.0, "util_low": 80}]}
    assert judge(InputBound, r) is None
    r["peaks"]["gpus"] = [{"index": 0, "util_mean": 35.0, "util_low": 0}]
    assert judge(InputBound, r)["playbook"] == "input-bound"


# --------------------------------------------------------------------------- slow-epoch-start


def slow_start_run(**first):
    return run(
        loop={
            "epochs": 3,
            "steady_batch_s": 0.02,
            "first_batch_s": {"per_epoch": [1.6, 1.5, 1.55], "mean_s": 1.55, "total_s": 4.65, **first},
        }
    )


def test_slow_epoch_start_measures_the_cost_per_epoch():
    sig = judge(SlowEpochStart, slow_start_run())
    assert sig["playbook"] == "slow-epoch-start"
    assert sig["cost_per_epoch_s"] == pytest.approx(1.53) and sig["cost_total_s"] == pytest.approx(3.06)
    assert sig["first_batch_factor"] == pytest.approx(77.5)


@pytest.mark.parametrize(
    "loader,loop",
    [
        ({**LOADER, "persistent_workers": True}, {}),  # already persistent
        ({**LOADER, "num_workers": 0}, {}),  # no workers to keep
        (LOADER, {"epochs": 1}),  # one epoch: nothing to save
        (LOADER, {"first_batch_s": {"mean_s": 0.6}}),  # under a second
        (LOADER, {"steady_batch_s": 0.5}),  # a few steady batches only
    ],
)
def test_slow_epoch_start_quiet_on_look_alikes(loader, loop):
    r = slow_start_run()
    r["loop"] = {**r["loop"], **loop}
    if "first_batch_s" in loop:
        r["loop"]["first_batch_s"] = {**slow_start_run()["loop"]["first_batch_s"], **loop["first_batch_s"]}
    assert judge(SlowEpochStart, r, loader) is None


# --------------------------------------------------------------------------- prefetch-too-deep


DEEP = {**LOADER, "prefetch_factor": 8, "batch_bytes": 9 * MIB}


def test_prefetch_too_deep_with_the_bytes_it_costs():
    sig = judge(PrefetchTooDeep, run(), DEEP)
    assert sig["inflight_bytes"] == 9 * MIB * 2 * 8 and sig["saves_bytes"] == 9 * MIB * 2 * 6
    assert sig["blocked_put_share"] == 0.5 and sig["suggested_prefetch_factor"] == 2


@pytest.mark.parametrize(
    "loader",
    [
        {**DEEP, "prefetch_factor": 2},  # the default depth of a GPU-bound job: workers idle, nothing to lower
        {**DEEP, "batch_bytes": 64 * 1024},  # deep but tiny batches
    ],
)
def test_prefetch_quiet_on_default_depth_and_small_batches(loader):
    assert judge(PrefetchTooDeep, run(), loader) is None


def test_prefetch_measured_in_shared_memory():
    # /dev/shm held the batches: the advice stands; it never held them: the computed bytes were not in flight
    held = run(peaks={"shm": {"used_peak": 150 * MIB, "total": 8 << 30}})
    assert judge(PrefetchTooDeep, held, DEEP)["shm_used_peak"] == 150 * MIB
    empty = run(peaks={"shm": {"used_peak": 2 * MIB, "total": 8 << 30}})
    assert judge(PrefetchTooDeep, empty, DEEP) is None


def test_prefetch_quiet_when_the_workers_are_busy():
    r = run(workers=[worker(0, 0.9, 0.9, blocked=0.1), worker(1, 0.9, 0.9, blocked=0.1)])
    assert judge(PrefetchTooDeep, r, DEEP) is None


# --------------------------------------------------------------------------- too-many-workers


def test_too_many_workers_cpu_bound_and_far_from_a_core():
    r = run(cpus={"usable": 2, "affinity": 2, "cgroup_quota": None}, workers=[worker(i, 0.24, 0.95) for i in range(8)])
    sig = judge(TooManyWorkers, r, {**LOADER, "num_workers": 8})
    assert sig["usable_cpus"] == 2 and sig["worker_cpu_util_mean"] == 0.24 and sig["suggested_num_workers"] == 2


def test_too_many_workers_quiet_for_io_bound_workers():
    # 16 workers waiting on an object store on 4 CPUs is a sound configuration
    r = run(cpus={"usable": 4}, workers=[worker(i, 0.05, 0.05, io=0.9, waiting=0.05) for i in range(16)])
    assert judge(TooManyWorkers, r, {**LOADER, "num_workers": 16}) is None


def test_too_many_workers_quiet_within_the_cpus():
    r = run(cpus={"usable": 8}, workers=[worker(i, 0.5, 0.95) for i in range(8)])
    assert judge(TooManyWorkers, r, {**LOADER, "num_workers": 8}) is None


# --------------------------------------------------------------------------- sampler-epoch-not-set


def _sampler(values, shuffle=True):
    det = SamplerEpochNotSet(thresholds(SamplerEpochNotSet))
    view = View(now=0.0, procs={}, loader=LOADER, loader_pids=frozenset(), system=None, heartbeat=None)
    for v in values:
        det.on_event(
            {
                "event": "sampler_epoch",
                "sampler_epoch": v,
                "shuffle": shuffle,
                "seed": 0,
                "sampler": "torch.utils.data.distributed.DistributedSampler",
                "num_replicas": 1,
            },
            view,
        )
    return det.judge(run(), LOADER)


def test_sampler_epoch_never_changed():
    sig = _sampler([0, 0, 0])
    assert sig["epochs_started"] == 3 and sig["sampler_epoch_each_epoch"] == [0, 0, 0]


@pytest.mark.parametrize("values,shuffle", [([0, 1, 2], True), ([0, 0, 0], False), ([0], True)])
def test_sampler_quiet_with_set_epoch_without_shuffle_or_one_epoch(values, shuffle):
    assert _sampler(values, shuffle) is None


# --------------------------------------------------------------------------- dataset-memory-per-worker


def test_dataset_memory_per_worker_against_the_cgroup_limit():
    r = run(
        workers=[worker(i, 0.5, 0.5, uss=900 * MIB) for i in range(4)],
        peaks={"cgroup_memory": {"limit": 8 << 30}, "mem_available": {"first": 64 << 30}, "gpus": []},
    )
    sig = judge(DatasetMemoryPerWorker, r, {**LOADER, "num_workers": 4})
    assert sig["memory_limit_source"] == "cgroup memory limit" and sig["share_of_limit"] == pytest.approx(
        0.44, abs=0.01
    )


def test_dataset_memory_quiet_for_small_workers_or_plenty_of_memory():
    small = run(workers=[worker(i, 0.5, 0.5, uss=30 * MIB) for i in range(4)])
    assert judge(DatasetMemoryPerWorker, small, {**LOADER, "num_workers": 4}) is None
    big = run(workers=[worker(i, 0.5, 0.5, uss=900 * MIB) for i in range(4)])  # 3.6 GiB of 16 GiB available
    assert judge(DatasetMemoryPerWorker, big, {**LOADER, "num_workers": 4}) is None


# --------------------------------------------------------------------------- findings and figures


def test_to_finding_has_the_shape_of_an_incident_finding():
    sig = {"event": "advice", "playbook": "slow-epoch-start", "confidence": 0.85, "cost_per_epoch_s": 1.5}
    f = to_finding(sig, PBS)
    assert set(f) == {"playbook", "title", "confidence", "evidence", "remediation"}
    assert f["title"] == PBS["slow-epoch-start"].title and "persistent_workers=True" in f["remediation"]
    assert f["evidence"] == {"cost_per_epoch_s": 1.5}
    # an advice event of a playbook this dlwatch does not ship (a user's detector) keeps its id as title
    other = to_finding({"event": "advice", "playbook": "my-team-advice", "confidence": 0.7, "x": 1}, PBS)
    assert other["playbook"] == "my-team-advice" and other["title"] == "my-team-advice"
    assert other["evidence"] == {"x": 1}
    # a failure playbook's advice event (worker-memory-growth's slow trend) takes that playbook's text
    growth = to_finding(
        {"event": "advice", "playbook": "worker-memory-growth", "confidence": 0.7, "reason": "limit_far"}, PBS
    )
    assert growth["title"] == PBS["worker-memory-growth"].title and growth["remediation"]


def test_advice_playbooks_are_never_matched_into_incidents():
    from dlwatch.detect.match import match

    report = {
        "events": [{"event": "advice", "playbook": "input-bound", "signal": "input-bound"}],
        "timeline": [],
        "processes": [],
    }
    assert [f.playbook for f in match(report, PBS.values())] == []


def sample(pid, ts, cpu, state="S", syscall=7, uss=None):
    return ProcSample(
        pid=pid, ts=ts, state=state, cpu_s=cpu, syscall=syscall, rss=100 * MIB, uss=uss, num_fds=10, fd_limit=1024
    )


def test_worker_interval_split_by_state():
    prev = sample(5, 0.0, 1.0)
    assert classify_interval(prev, sample(5, 1.0, 1.3), loop_in_body=True) == pytest.approx(
        {"running": 0.3, "blocked_put": 0.7}
    )
    assert classify_interval(prev, sample(5, 1.0, 1.3), loop_in_body=False) == pytest.approx(
        {"running": 0.3, "waiting_for_work": 0.7}
    )
    assert classify_interval(prev, sample(5, 1.0, 1.1, state="D"), False) == pytest.approx({"running": 0.1, "io": 0.9})
    assert classify_interval(prev, sample(5, 1.0, 1.05, syscall=0), False) == pytest.approx(
        {"running": 0.05, "io": 0.95}
    )
    # runnable but starved of CPU (over-subscribed): it wants to run
    assert classify_interval(prev, sample(5, 1.0, 1.2, state="R", syscall=-1), False) == {"running": 1.0}


class _T:
    def __init__(self, pid, role, worker_id=None):
        self.pid, self.role, self.worker_id = pid, role, worker_id


def test_runstats_figures_from_polls():
    rs = RunStats(started_at=0.0)
    tracked = [_T(1, "main"), _T(5, "worker", 0)]

    def hb(batches, epochs, state, first_wait, ts_first):
        return Heartbeat(
            batches=batches,
            epoch_batches=batches,
            epochs=epochs,
            state=state,
            pid=1,
            ts_last_batch=10.0,
            ts_wait_start=ts_first - first_wait,
            total_wait_s=4.0,
            total_step_s=6.0,
            last_interval_s=0.1,
            ts_first_batch=ts_first,
            total_first_wait_s=first_wait,
        )

    for i, (cpu, state) in enumerate([(0.0, STATE_WAITING), (0.9, STATE_WAITING), (1.0, STATE_BODY)]):
        system = SystemSample(
            ts=float(i), mem_available=(10 - i) << 30, mlocked=1000 + i, shm_total=1 << 30, shm_free=(1 << 30) - i * MIB
        )
        rs.update(
            hb(10 * (i + 1), 1, state, 1.0, 2.0),
            tracked,
            [sample(1, float(i), 0.5 * i, "R", -1), sample(5, float(i), cpu, uss=(i + 1) * MIB)],
            system,
            [GpuSample(index=0, util_percent=50 + 10 * i)],
        )
    fig = rs.figures(hb(100, 2, STATE_BODY, 2.5, 5.0), ended_at=12.0)
    loop = fig["loop"]
    assert loop["batches"] == 100 and loop["data_wait_share"] == 0.4 and loop["body_share"] == 0.6
    assert loop["steady_batches"] == 98 and loop["steady_data_wait_s"] == 1.5
    assert loop["steady_data_wait_share"] == pytest.approx(1.5 / 7.5, abs=1e-4)
    assert loop["first_batch_s"]["per_epoch"] == [1.0, 2.5] and loop["first_batch_s"]["mean_s"] == 1.25
    (w,) = fig["workers"]
    assert w["cpu_util"] == 0.5 and w["state_s"]["running"] == pytest.approx(1.0)
    assert w["state_s"]["waiting_for_work"] == pytest.approx(0.1) and w["state_s"]["blocked_put"] == pytest.approx(0.9)
    assert w["uss_peak"] == 3 * MIB
    peaks = fig["peaks"]
    assert peaks["shm"]["used_peak"] == 2 * MIB and peaks["mlocked"]["change"] == 2
    assert peaks["mem_available"]["low"] == 8 << 30 and peaks["gpus"][0]["util_mean"] == 60.0
    assert peaks["gpus"][0]["util_low"] == 50 and peaks["fds"]["num_fds"] == 10
    tot = worker_totals(fig["workers"])
    assert tot["workers"] == 1 and tot["state_share"]["running"] == 0.5


def test_runstats_keep_figures_of_a_run_without_heartbeat():
    fig = RunStats(started_at=0.0).figures(None, ended_at=3.0)
    assert fig["loop"] == {"batches": 0, "epochs": 0, "wall_s": 3.0} and fig["workers"] == []
    assert copy.deepcopy(fig) == fig


def test_runstats_iteration_row_from_its_end_event_and_its_workers_polls():
    """`dlwatch run`: a loader iteration's row; its workers' CPU and RSS as polled; hostile figures count 0."""
    rs = RunStats(started_at=0.0)
    tracked = [_T(1, "main"), _T(5, "worker", 0), _T(6, "worker", 1)]
    for i in range(3):
        rs.update(
            None, tracked, [sample(1, float(i), 0.1 * i), sample(5, float(i), 0.5 * i), sample(6, float(i), 0.0)], None
        )
    end = {"ts": 12.5, "batches": 8, "active_s": 2.0, "data_wait_s": 0.5, "first_batch_s": 0.25, "wall_s": 2.5}
    row = rs.iteration_row(3, "loader1", "train", 1, {**end, "worker_pids": [5, 6, 99, True]})
    assert list(row) == [
        "iteration",
        "loader",
        "name",
        "epoch",
        "started_at",
        "batches",
        "active_s",
        "wall_s",
        "data_wait_s",
        "data_wait_share",
        "first_batch_s",
        "workers",
        "worker_processes",
    ]
    assert row["iteration"] == 3 and row["epoch"] == 1 and row["started_at"] == 12.5 and row["batches"] == 8
    assert row["data_wait_share"] == 0.25 and row["first_batch_s"] == 0.25 and row["wall_s"] == 2.5
    # True is no pid; 99 was never polled: three workers, the mean over the two polled (0.5 and 0.0)
    assert row["workers"] == {"num_workers": 3, "cpu_util_mean": 0.25, "rss_peak": 100 * MIB}
    # each worker named by its place in the iterator; one never polled has no figures
    assert [(w["pid"], w["worker_id"], w["cpu_util"]) for w in row["worker_processes"]] == [
        (5, 0, 0.5),
        (6, 1, 0.0),
        (99, 2, None),
    ]
    hostile = {"batches": -3, "active_s": float("nan"), "data_wait_s": True, "wall_s": "1", "first_batch_s": 9.0}
    bad = rs.iteration_row(4, "loader1", "", 0, hostile)
    assert bad["batches"] == 0 and bad["active_s"] == 0.0 and bad["data_wait_s"] == 0.0 and bad["wall_s"] == 0.0
    assert bad["data_wait_share"] is None and bad["first_batch_s"] is None  # no batch: no first-batch time
    assert bad["workers"] == {"num_workers": 0, "cpu_util_mean": None, "rss_peak": None}
    # a wait longer than the active time (clocks read apart) is capped at the whole
    assert (
        rs.iteration_row(5, "l", "", 0, {"batches": 1, "active_s": 1.0, "data_wait_s": 2.0})["data_wait_share"] == 1.0
    )
