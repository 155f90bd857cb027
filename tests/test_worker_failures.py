"""worker-killed, worker-memory-growth, pinned-memory-growth: the pure judgement with hand-built samples,
the crash file of a real crashing process, and /proc fields read from real processes.

The real reproductions (a segfault, an outside SIGKILL, an OOM kill in a cgroup, copy-on-read,
mlock'd growth, and the healthy look-alikes) are in tests/test_examples.py.
"""

from __future__ import annotations

import collections
import os
import signal
import subprocess
import sys
import textwrap

from dlwatch.collect import faultdump, procfs
from dlwatch.collect import growth
from dlwatch.detect.base import View
from dlwatch.detect.memory_growth import WorkerMemoryGrowth
from dlwatch.detect.pinned_memory import PinnedMemoryGrowth
from dlwatch.detect.worker_killed import WorkerKilled, exit_cause, wait_status_signal
from dlwatch.model import ProcSample, SystemSample
from dlwatch.wire.heartbeat import Heartbeat

MiB = 1 << 20


class P:
    def __init__(self, pid, role, samples, worker_id=None, gone=False, crash=None):
        self.pid, self.role, self.worker_id, self.gone, self.crash = pid, role, worker_id, gone, crash
        self.history = collections.deque(samples)
        self.last_fds = None

    @property
    def last(self):
        return self.history[-1] if self.history else None


def heartbeat(epoch_batches=100, epochs=1):
    return Heartbeat(
        batches=epoch_batches,
        epoch_batches=epoch_batches,
        epochs=epochs,
        state=0,
        pid=1,
        ts_last_batch=0.0,
        ts_wait_start=0.0,
        total_wait_s=0.0,
        total_step_s=0.0,
        last_interval_s=0.0,
    )


def view(procs, system, now, hb=None):
    return View(
        now=now, procs={p.pid: p for p in procs}, loader=None, loader_pids=frozenset(), system=system, heartbeat=hb
    )


def growth_detector(pids=(10, 11), at=999.0):
    """A WorkerMemoryGrowth that saw these workers' first batches delivered at ``at`` (before their reads)."""
    det = WorkerMemoryGrowth()
    assert list(det.on_poll(view([P(pid, "worker", []) for pid in pids], None, now=at, hb=heartbeat()))) == []
    return det


def uss_series(pid, values, rss=500 * MiB, step=2.0, t0=1000.0):
    return [
        ProcSample(
            pid=pid, ts=t0 + i * step, uss=int(v), rss=int(rss if not callable(rss) else rss(i)), uss_ts=t0 + i * step
        )
        for i, v in enumerate(values)
    ]


def system(limit=None, usage=None, avail=20 << 30, mlocked=None, ts=1000.0, oom=None):
    return SystemSample(
        ts=ts,
        mem_available=avail,
        cgroup_memory_limit=limit,
        cgroup_memory_usage=usage,
        mlocked=mlocked,
        cgroup_oom_kills=oom,
    )


# --------------------------------------------------------------------------- growth


def test_steady_growth_wants_a_still_climbing_late_half():
    rising = [(t, 100 * MiB + t * 12 * MiB) for t in range(0, 12, 2)]
    g = growth.steady_growth(rising, min_rate=MiB, min_rise=64 * MiB, min_window_s=8)
    assert g is not None and 11 * MiB < g["rate_bytes_per_s"] < 13 * MiB
    # start-up burst then a plateau: same overall rise, flat later half
    plateau = [(0, 100 * MiB), (2, 200 * MiB), (4, 260 * MiB), (6, 262 * MiB), (8, 262 * MiB), (10, 263 * MiB)]
    assert growth.steady_growth(plateau, min_rate=MiB, min_rise=64 * MiB, min_window_s=8) is None
    # too short, too small, or too few points
    assert growth.steady_growth(rising[:3], min_rate=MiB, min_rise=64 * MiB, min_window_s=8) is None
    small = [(t, 100 * MiB + t * MiB) for t in range(0, 20, 2)]
    assert growth.steady_growth(small, min_rate=MiB, min_rise=64 * MiB, min_window_s=8) is None
    assert growth.time_to_limit(100 * MiB, 10 * MiB) == 10.0 and growth.time_to_limit(None, 1.0) is None


def test_copy_on_read_near_the_limit_is_a_threshold():
    workers = [
        P(10 + w, "worker", uss_series(10 + w, [20 * MiB + i * 24 * MiB for i in range(6)]), worker_id=w)
        for w in range(2)
    ]
    sys_ = system(limit=2 << 30, usage=1 << 30)
    (sig,) = growth_detector().on_poll(view(workers, sys_, now=1011.0))
    assert sig["event"] == "threshold" and sig["signal"] == "worker_memory_growth"
    assert sig["copy_on_read"] is True and sig["workers_growing"] == 2
    assert sig["limit"] == "cgroup memory limit" and sig["limit_in_s"] < 60


def test_far_limit_is_advice_once_and_rss_growth_is_not_copy_on_read():
    # RSS grows with USS: a heap growing (not shared pages turning private)
    w = P(
        10,
        "worker",
        uss_series(10, [20 * MiB + i * 24 * MiB for i in range(6)], rss=lambda i: 500 * MiB + i * 24 * MiB),
        worker_id=0,
    )
    det = growth_detector()
    (adv,) = det.on_poll(view([w], system(avail=1 << 40), now=1011.0))
    assert adv["event"] == "advice" and adv["playbook"] == "worker-memory-growth"
    assert "signal" not in adv  # advice never matches a playbook signal by itself
    assert adv["copy_on_read"] is False and adv["limit_in_s"] > 900
    assert list(det.on_poll(view([w], system(avail=1 << 40), now=1011.0))) == []


def test_flat_and_plateauing_workers_stay_quiet():
    flat = P(10, "worker", uss_series(10, [300 * MiB] * 8), worker_id=0)
    warm = P(11, "worker", uss_series(11, [20, 120, 220, 224, 225, 225, 226, 226]), worker_id=1)
    warm.history = collections.deque(uss_series(11, [v * MiB for v in (20, 120, 220, 224, 225, 225, 226, 226)]))
    assert list(growth_detector().on_poll(view([flat, warm], system(limit=1 << 30, usage=900 * MiB), now=1015.0))) == []


def test_warmup_slowing_to_a_plateau_is_quiet_even_with_a_limit_in_reach():
    """Measured on a loaded machine (examples/healthy_warmup.py): a worker filling a cache,
    30 -> 264 MiB over 10 s at a rate that halves in the later half, MemAvailable 22 GiB.
    Its later half still climbs, but slowing: a plateau to come, not a leak."""
    values = [30, 95, 150, 200, 235, 250, 258, 264]
    warm = P(11, "worker", uss_series(11, [v * MiB for v in values], step=2.0), worker_id=0)
    assert (
        growth.steady_growth(
            [(s.uss_ts, float(s.uss)) for s in warm.history], min_rate=MiB, min_rise=64 * MiB, min_window_s=8
        )
        is None
    )
    assert list(growth_detector().on_poll(view([warm], system(avail=22 << 30), now=1015.0))) == []


def test_start_up_before_the_first_batches_is_not_growth():
    """A spawned worker importing torch on a loaded machine: 45 -> 245 MiB in 8 s, steadily, before any
    batch.  Judged only from the poll at which every worker had delivered a batch: quiet; the same
    climb after the first batches is growth."""
    climb = [45 * MiB + i * 25 * MiB for i in range(9)]  # 45 -> 245 MiB, one read per second
    assert growth.steady_growth(
        [(1000.0 + i, float(v)) for i, v in enumerate(climb)], min_rate=MiB, min_rise=64 * MiB, min_window_s=8
    )
    sys_ = system(limit=2 << 30, usage=1 << 30)
    det = WorkerMemoryGrowth()
    w = P(10, "worker", [], worker_id=0)
    assert list(det.on_poll(view([w], sys_, now=999.0, hb=heartbeat(epoch_batches=0)))) == []
    w.history = collections.deque(uss_series(10, climb, step=1.0))
    # 1 of 2 workers' batches so far (loader unknown: the live workers count), then no heartbeat at all
    assert list(det.on_poll(view([w, P(11, "worker", [])], sys_, now=1008.0, hb=heartbeat(epoch_batches=1)))) == []
    assert list(det.on_poll(view([w], sys_, now=1008.0))) == []
    # the first batches arrive now: the climb before is start-up, and stays out of every later judgement
    assert list(det.on_poll(view([w], sys_, now=1008.5, hb=heartbeat(epoch_batches=2)))) == []
    w.history.extend(uss_series(10, [245 * MiB] * 9, step=1.0, t0=1009.0))  # flat after start-up
    assert list(det.on_poll(view([w], sys_, now=1017.0, hb=heartbeat(epoch_batches=40)))) == []
    # the same climb after the first batches is growth (a later epoch of persistent workers counts too)
    late = WorkerMemoryGrowth()
    assert list(late.on_poll(view([P(10, "worker", [])], sys_, now=990.0, hb=heartbeat(epoch_batches=0)))) == []
    assert list(late.on_poll(view([P(10, "worker", [])], sys_, now=999.0, hb=heartbeat(0, epochs=2)))) == []
    (sig,) = late.on_poll(view([P(10, "worker", uss_series(10, climb, step=1.0), worker_id=0)], sys_, now=1008.0))
    assert sig["signal"] == "worker_memory_growth" and sig["growth"][0]["uss"]["window_s"] == 8.0


def test_a_short_trend_projected_far_waits_to_be_watched_longer():
    """35 MiB/s seen for 10 s against 22 GiB of MemAvailable projects ~11 minutes: not yet an
    incident (10 s is under a tenth of it); the same trend watched for 70 s is one."""
    short = P(10, "worker", uss_series(10, [20 * MiB + i * 70 * MiB for i in range(6)]), worker_id=0)
    det = growth_detector()
    assert list(det.on_poll(view([short], system(avail=22 << 30), now=1011.0))) == []
    long_ = P(10, "worker", uss_series(10, [20 * MiB + i * 70 * MiB for i in range(36)]), worker_id=0)
    (sig,) = growth_detector().on_poll(view([long_], system(avail=22 << 30), now=1071.0))
    assert sig["event"] == "threshold" and sig["observed_s"] >= 0.1 * sig["limit_in_s"]


def test_pinned_growth_needs_a_watched_locker():
    det = PinnedMemoryGrowth()
    locker = P(
        1, "main", [ProcSample(pid=1, ts=1000.0 + i, uss_ts=1000.0 + i, vm_lck=(i + 1) * 40 * MiB) for i in range(10)]
    )
    bystander = P(1, "main", [ProcSample(pid=1, ts=1000.0 + i, uss_ts=1000.0 + i, vm_lck=0) for i in range(10)])
    out = []
    for i in range(12):
        sys_ = system(mlocked=(i + 1) * 40 * MiB, ts=1000.0 + i, limit=2 << 30, usage=1 << 30)
        out += list(det.on_poll(view([locker], sys_, now=1000.0 + i)))
    assert out and out[0]["event"] == "threshold" and out[0]["reason"] == "limit_soon"
    quiet = PinnedMemoryGrowth()  # the host's Mlocked grows, but no watched process locks anything
    for i in range(12):
        assert not list(
            quiet.on_poll(view([bystander], system(mlocked=(i + 1) * 40 * MiB, ts=1000.0 + i), now=1000.0 + i))
        )


def test_pinned_near_rlimit_and_flat_locked_memory():
    near = P(
        1,
        "main",
        [
            ProcSample(pid=1, ts=1000.0 + i, uss_ts=1000.0 + i, vm_lck=int((6 + 1.5 * i) * MiB), memlock_limit=8 * MiB)
            for i in range(2)
        ],
    )
    (sig,) = PinnedMemoryGrowth().on_poll(view([near], system(mlocked=7 * MiB), now=1001.0))
    assert sig["reason"] == "near_memlock_limit"
    flat = P(
        1,
        "main",
        [ProcSample(pid=1, ts=1000.0 + i, uss_ts=1000.0 + i, vm_lck=8 * MiB, memlock_limit=8 * MiB) for i in range(3)],
    )
    det = PinnedMemoryGrowth()
    for i in range(15):
        assert not list(det.on_poll(view([flat], system(mlocked=64 * MiB, ts=1000.0 + i), now=1000.0 + i)))


# --------------------------------------------------------------------------- worker-killed


def test_exit_cause_tells_the_kinds_apart():
    assert exit_cause("SIGKILL", oom_rose=True, memory_share=0.5, crash_signal=None)[0] == "oom-kill"
    assert exit_cause("SIGKILL", oom_rose=False, memory_share=0.97, crash_signal=None)[0] == "oom-kill"
    assert exit_cause("SIGKILL", oom_rose=False, memory_share=0.2, crash_signal=None)[0] == "external-kill"
    assert exit_cause("SIGTERM", oom_rose=False, memory_share=None, crash_signal=None)[0] == "external-kill"
    assert exit_cause(None, oom_rose=False, memory_share=None, crash_signal="SIGSEGV")[0] == "native-crash"
    assert exit_cause("SIGBUS", oom_rose=False, memory_share=None, crash_signal=None)[0] == "sigbus"
    assert exit_cause(None, oom_rose=False, memory_share=0.1, crash_signal=None)[0] == "unknown"
    assert wait_status_signal(9) == 9 and wait_status_signal(1 << 8) is None and wait_status_signal(None) is None


def test_worker_gone_at_epoch_end_is_not_noted():
    det = WorkerKilled()
    alive = P(20, "worker", [ProcSample(pid=20, ts=1000.0, rss=300 * MiB)], worker_id=0)
    assert not list(det.on_poll(view([alive], system(limit=1 << 30, usage=400 * MiB, oom=0), now=1000.0)))
    alive.gone = True
    alive.history.append(ProcSample(pid=20, ts=1001.0, gone=True))
    assert not list(det.on_poll(view([alive], system(limit=1 << 30, usage=400 * MiB, oom=0, ts=1001.0), now=1001.0)))


def test_worker_gone_with_oom_count_rising_is_noted():
    det = WorkerKilled()
    w = P(20, "worker", [ProcSample(pid=20, ts=1000.0, rss=900 * MiB, uss=800 * MiB)], worker_id=0)
    det.on_poll(view([w], system(limit=1 << 30, usage=1000 * MiB, oom=0), now=1000.0))
    w.gone = True
    (obs,) = det.on_poll(view([w], system(limit=1 << 30, usage=200 * MiB, oom=1, ts=1001.0), now=1001.0))
    assert obs["event"] == "observation" and obs["cause"] == "oom-kill"
    assert obs["oom_kills_before"]["cgroup"] == 0 and obs["oom_kills_after"]["cgroup"] == 1
    assert obs["memory"][0]["uss"] == 800 * MiB
    # the exit code the training process read afterwards adds the signal
    (more,) = det.on_event(
        {"event": "worker_exits", "exitcodes": {"20": -signal.SIGKILL, "21": 0}},
        view([w], system(limit=1 << 30, usage=200 * MiB, oom=1), now=1002.0),
    )
    assert more["exit_signal"] == "SIGKILL" and more["cause"] == "oom-kill"


# --------------------------------------------------------------------------- collect


CRASHER = textwrap.dedent("""
    import ctypes, sys
    from dlwatch.collect import faultdump
    print(faultdump.install_crash(sys.argv[1]), flush=True)
    def read_sample():
        ctypes.string_at(0)
    read_sample()
""")


def test_crash_file_of_a_real_segfault(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env.pop("PYTHONFAULTHANDLER", None)
    proc = subprocess.run(
        [sys.executable, "-c", CRASHER, str(tmp_path / "dumps")], capture_output=True, text=True, env=env, timeout=60
    )
    assert proc.returncode == -signal.SIGSEGV
    path = proc.stdout.strip()
    assert path.endswith(".crash.txt") and oct(os.stat(path).st_mode & 0o777) == "0o600"
    crash = faultdump.read_crash(path)
    assert crash["signal"] == "SIGSEGV" and crash["fatal_error"] == "Segmentation fault"
    frames = [f["function"] for t in crash["stack"]["threads"] for f in t["frames"]]
    assert "read_sample" in frames


def test_user_faulthandler_setting_is_left_alone(tmp_path):
    code = (
        "import faulthandler, sys; faulthandler.enable(); from dlwatch.collect import faultdump; "
        "print(faultdump.install_crash(sys.argv[1]), faulthandler.is_enabled())"
    )
    env = dict(os.environ, PYTHONPATH=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, env=env, timeout=60
    ).stdout.split()
    assert out == ["None", "True"]
    assert not list(tmp_path.iterdir())


def test_read_crash_refuses_links_and_empty_files(tmp_path):
    empty = tmp_path / "1.crash.txt"
    empty.write_text("")
    assert faultdump.read_crash(str(empty)) is None
    secret = tmp_path / "secret"
    secret.write_text("Fatal Python error: Segmentation fault\n")
    link = tmp_path / "2.crash.txt"
    link.symlink_to(secret)
    assert faultdump.read_crash(str(link)) is None


def test_zombie_exit_status_and_minflt(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(child.pid, signal.SIGKILL)
        import time

        deadline = time.monotonic() + 10
        s = procfs.read_proc(child.pid)
        while s.state != "Z" and time.monotonic() < deadline:
            time.sleep(0.01)
            s = procfs.read_proc(child.pid)
        assert s.state == "Z" and wait_status_signal(s.exit_code) == signal.SIGKILL
    finally:
        child.kill()
        child.wait()
    me = procfs.read_proc(os.getpid(), mem_detail=True)
    assert me.minflt and me.minflt > 0 and me.uss_ts is not None and me.vm_lck is not None


# --------------------------------------------------------------------------- the matcher on hand-built reports


def _report(**kw):
    base = {
        "trigger": "exception",
        "exception": None,
        "classification": None,
        "loader": {},
        "system": {},
        "processes": [],
        "events": [],
        "timeline": [],
    }
    base.update(kw)
    return base


def _worker(pid, status=None, crash=None, frames=None):
    stack = {"source": "faulthandler-crash", "threads": [{"thread_id": 1, "frames": frames}]} if frames else None
    p = {
        "pid": pid,
        "role": "worker",
        "worker_id": 0,
        "sample": {"ts": 1000.0, "rss": 300 * MiB},
        "status": status,
        "stack": stack,
    }
    if crash:
        p["crash"] = crash
    return p


def test_match_killed_by_signal_text_and_dead_worker_stall():
    from dlwatch.detect.match import match
    from dlwatch.wire.playbooks import load_playbooks

    pbs = load_playbooks()
    exc = {
        "type": "builtins.RuntimeError",
        "message": "DataLoader worker (pid 4301) is killed by signal: Killed. ",
        "traceback": "",
        "from_loader": True,
    }
    top = match(_report(exception=exc, processes=[_worker(4301, status="gone")]), pbs)[0]
    assert top.playbook == "worker-killed" and top.evidence["exit_signal"] == "SIGKILL"
    assert top.evidence["pid"] == 4301
    # no cgroup, no OOM count, no memory figure: SIGKILL alone is not called an OOM kill
    assert top.evidence["cause"] == "external-kill"
    # the loop hung instead (dead-worker stall), and the worker had written its crash stack
    frames = [
        {"function": "string_at", "filename": "/usr/lib/python3.11/ctypes/__init__.py", "line": 519},
        {"function": "__getitem__", "filename": "/home/u/train/data.py", "line": 42},
        {"function": "_worker_loop", "filename": "/x/site-packages/torch/utils/data/_utils/worker.py"},
    ]
    r = _report(
        trigger="stall",
        classification="dead-worker",
        processes=[
            _worker(77, status="gone", crash={"signal": "SIGSEGV", "fatal_error": "Segmentation fault"}, frames=frames)
        ],
    )
    top = match(r, pbs)[0]
    assert top.playbook == "worker-killed" and top.evidence["cause"] == "native-crash"
    assert top.evidence["crash_frame"] == "__getitem__ (/home/u/train/data.py:42)"
    assert "native crash" in top.remediation.lower()


def test_match_bus_error_stays_shm_and_healthy_report_matches_nothing_new():
    from dlwatch.detect.match import match
    from dlwatch.wire.playbooks import load_playbooks

    pbs = load_playbooks()
    exc = {
        "type": "builtins.RuntimeError",
        "message": "DataLoader worker (pid 4301) is killed by signal: Bus error. "
        "It is possible that dataloader's workers are out of shared memory.",
        "traceback": "",
        "from_loader": True,
    }
    assert [f.playbook for f in match(_report(exception=exc), pbs)] == ["shm-exhaustion"]
    # an advice event alone (long projection) makes no finding in a later report
    advice = {
        "event": "advice",
        "playbook": "worker-memory-growth",
        "advice": "worker_memory_growth",
        "limit_in_s": 5000.0,
    }
    assert match(_report(trigger="stall", classification="slow", events=[advice]), pbs) == []


def test_dead_worker_stall_is_worker_killed_with_the_zombies_signal(tmp_path, target):
    """The loop hangs on a killed worker (iterated in a thread: torch's SIGCHLD handler is not there,
    its own check comes only after 5 s): the stall incident names worker-killed, SIGKILL from the zombie."""

    from conftest import incidents, load, wait_for

    t = target("dead_worker_stall.py", str(tmp_path))
    victim = int(t.wait_line("READY", timeout=60).split()[1])
    found = wait_for(lambda: [p for p in incidents(str(tmp_path)) if "-stall-" in p], timeout=30)
    assert found, "no stall incident"
    r = load(found[0])
    assert r["classification"] == "dead-worker"
    top = r["findings"][0]
    assert top["playbook"] == "worker-killed"
    ev = top["evidence"]
    assert ev["pid"] == victim and ev["exit_signal"] == "SIGKILL" and ev["cause"] == "external-kill"
    t.communicate(timeout=60)


def test_torch_messages_are_parsed_without_regex():
    from dlwatch.detect.worker_killed import torch_worker_exit

    assert torch_worker_exit("RuntimeError: DataLoader worker (pid 4301) is killed by signal: Killed. ") == (
        [4301],
        "SIGKILL",
    )
    assert torch_worker_exit("DataLoader worker (pid 7) is killed by signal: Segmentation fault.") == ([7], "SIGSEGV")
    assert torch_worker_exit("x\nDataLoader worker (pid(s) 12, 13) exited unexpectedly\n") == ([12, 13], None)
    assert torch_worker_exit("DataLoader worker (pid(s) ) exited") == ([], None)
    assert torch_worker_exit("(" * 10000 + "DataLoader worker (pid ") == ([], None)


def test_cuda_pinned_memory_growth(tmp_path):
    """pin_memory'd tensors kept across steps on a GPU host: Mlocked/VmLck must show them.

    The horizon comes from a test playbook (a copy of the shipped one with horizon_s=1e9),
    so that any steady growth is an incident whatever the host's MemAvailable."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip(
            "no CUDA device here: torch ignores pin_memory without one (the mlock'd-buffer "
            "reproduction in examples/pinned_growth.py covers the detector)"
        )
    import time

    from conftest import incidents, load
    from dlwatch.wire.playbooks import builtin_dir
    from torch.utils.data import DataLoader

    import dlwatch

    text = (builtin_dir() / "pinned-memory-growth.toml").read_text()
    pbdir = tmp_path / "playbooks"
    pbdir.mkdir()
    (pbdir / "pinned-memory-growth.toml").write_text(text.replace("horizon_s = 900.0", "horizon_s = 1e9"))
    kept = []
    deadline = time.monotonic() + 60
    dl = DataLoader(list(range(100_000)), batch_size=4, num_workers=1, pin_memory=True)
    with dlwatch.watch(dl, report_dir=str(tmp_path / "r"), poll_interval=0.2, playbooks=[str(pbdir)]) as batches:
        for _ in batches:
            kept.append(torch.empty(8 << 20, dtype=torch.uint8).pin_memory())  # kept across steps
            time.sleep(0.05)
            if incidents(str(tmp_path / "r")) or time.monotonic() > deadline or len(kept) > 96:
                break
    kept.clear()
    found = incidents(str(tmp_path / "r"))
    assert found and load(found[0])["findings"][0]["playbook"] == "pinned-memory-growth"
