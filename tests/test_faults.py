"""Faults dlwatch survives: training goes on, unchanged, with at most one clear warning."""

from __future__ import annotations

import glob
import os
import stat
import platform
import shutil
import signal
import subprocess
import sys
import time
import warnings

import psutil
import pytest
from torch.utils.data import DataLoader

import dlwatch
from conftest import REPO, TARGETS, batches_of, in_private_mount_namespace, incidents, load, wait_for
from dlwatch.inproc.agent import DlwatchWarning
from dlwatch.collect import procfs
from dlwatch.collect.gpu import GpuProbe
from dlwatch.monitor.journal import Timeline

sys.path.insert(0, TARGETS)
from datasets import Squares  # noqa: E402


def test_monitor_killed_mid_run(tmp_path, no_leftovers):
    dl = DataLoader(Squares(40), batch_size=4, num_workers=2)
    bare = batches_of(dl)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as batches:
            got = batches_of(batches)
            os.kill(batches.monitor_pid, signal.SIGKILL)
            got2 = batches_of(batches)  # the epoch boundary notices the monitor is gone
            got3 = batches_of(batches)
    assert got == got2 == got3 == bare
    ours = [w for w in caught if issubclass(w.category, DlwatchWarning)]
    assert len(ours) == 1 and "monitor process exited early" in str(ours[0].message)


def test_exception_after_monitor_died_is_still_reported(tmp_path, no_leftovers):
    dl = DataLoader(Squares(40), batch_size=4, num_workers=0)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with pytest.raises(ZeroDivisionError):
            with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.1) as batches:
                os.kill(batches.monitor_pid, signal.SIGKILL)
                wait_for(lambda: batches._session.monitor.poll() is not None, 5)
                for _ in batches:
                    _ = 1 / 0
    report = load(incidents(str(tmp_path))[0])
    assert report["exception"]["type"] == "builtins.ZeroDivisionError"
    assert any("monitor process was not running" in n for n in report["notes"])


def test_py_spy_failing_falls_back(tmp_path, target):
    t = target("hang.py", "deadlock", str(tmp_path), env={"DLWATCH_PY_SPY": shutil.which("false") or "/bin/false"})
    t.wait_line("READY", timeout=60)
    found = wait_for(lambda: incidents(str(tmp_path)), timeout=30)
    assert found
    report = load(found[0])
    assert report["classification"] == "deadlock"
    assert all(p["stack"]["source"] == "faulthandler" for p in report["processes"] if p["role"] != "other")
    assert any("py-spy stacks missing" in n for n in report["notes"])


@pytest.mark.skipif(platform.machine() != "x86_64", reason="the seccomp filter in tests/targets is x86_64 only")
def test_ptrace_denied_for_real(tmp_path, target):
    venv_spy = os.path.join(os.path.dirname(sys.executable), "py-spy")
    spy = shutil.which("py-spy") or venv_spy
    wrapper = tmp_path / "py-spy-denied"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} {os.path.join(TARGETS, "seccomp_exec.py")} {spy} "$@"\n')
    wrapper.chmod(0o755)
    probe = subprocess.run(
        [str(wrapper), "dump", "--pid", str(os.getpid())], capture_output=True, text=True, timeout=30
    )
    if probe.returncode == 0:
        pytest.skip("seccomp filter not enforced here; py-spy still attached")
    t = target("hang.py", "deadlock", str(tmp_path / "r"), env={"DLWATCH_PY_SPY": str(wrapper)})
    t.wait_line("READY", timeout=60)
    found = wait_for(lambda: incidents(str(tmp_path / "r")), timeout=40)
    assert found
    report = load(found[0])
    notes = " ".join(report["notes"])
    assert "CAP_SYS_PTRACE" in notes and "SYS_PTRACE" in notes, notes
    stacks = [p["stack"] for p in report["processes"] if p["role"] in ("main", "worker")]
    assert all(s["source"] == "faulthandler" and s["threads"] for s in stacks)
    assert report["classification"] == "deadlock"


def _nvidia_driver_present() -> bool:
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/proc/driver/nvidia/version")


@pytest.mark.skipif(
    _nvidia_driver_present(),
    reason="an NVIDIA driver is present: NVML is not absent here (test_nvml_on_a_real_gpu checks the probe instead)",
)
def test_nvml_absent_is_quiet(monkeypatch):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        probe = GpuProbe()
        assert probe.sample() == () and probe.sample() == ()
    assert probe.unavailable


@pytest.mark.skipif(
    not _nvidia_driver_present(),
    reason="no NVIDIA driver on this machine: the probe's logic is covered by test_nvml_logic_with_a_stand_in",
)
def test_nvml_on_a_real_gpu():
    probe = GpuProbe()
    try:
        assert not probe.unavailable, probe.unavailable
        gpus = probe.sample()
        assert gpus, "NVML initialised but reported no device"
        for g in gpus:
            assert g.name and g.util_percent is not None and 0 <= g.util_percent <= 100
            assert g.memory_total and 0 <= g.memory_used <= g.memory_total
    finally:
        probe.close()


def test_nvml_logic_with_a_stand_in(monkeypatch):
    """No GPU here: a stand-in pynvml module covers the sampling logic (the real one needs a driver)."""
    import types

    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 2,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"Fake GPU",
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=37 + h),
        nvmlDeviceGetMemoryInfo=lambda h: (
            (_ for _ in ()).throw(RuntimeError("no memory info"))
            if h
            else types.SimpleNamespace(used=1 << 30, total=16 << 30)
        ),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    samples = GpuProbe().sample()
    assert [(g.index, g.name, g.util_percent, g.memory_used) for g in samples] == [
        (0, "Fake GPU", 37, 1 << 30),
        (1, "Fake GPU", 38, None),
    ]


def test_proc_vanishing_between_reads():
    """Processes that exit at every point of a read: never an exception, `gone` at the end."""
    for _ in range(30):
        p = subprocess.Popen([sys.executable, "-c", "pass"])
        seen = []
        while True:
            s = procfs.read_proc(p.pid, fd_detail=True, mem_detail=True)
            seen.append(s)
            if s.gone or p.poll() is not None and len(seen) > 3:
                break
        p.wait()
        final = procfs.read_proc(p.pid, fd_detail=True, mem_detail=True)
        assert final.gone
    gone = p.pid
    assert procfs.fd_limit(gone) is None and procfs.fd_summary(gone) is None
    assert procfs.children(gone) == [] and procfs.cmdline(gone) is None and procfs.comm(gone) is None


def test_worker_exiting_mid_poll(tmp_path, no_leftovers):
    """Non-persistent workers come and go every epoch while the monitor polls fast."""
    dl = DataLoader(Squares(8), batch_size=4, num_workers=2)
    with dlwatch.watch(dl, report_dir=tmp_path, poll_interval=0.01) as batches:
        for _ in range(15):
            assert len(batches_of(batches)) == 2
    assert incidents(str(tmp_path)) == []


def _in_private_mount(tmp_path, tmpdir, mount_opts: str, script: str, *args: str, timeout: float = 90):
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TARGETS]), TMPDIR=str(tmpdir))
    cmd = (
        f"mount -t tmpfs -o {mount_opts} tmpfs {mnt} && "
        f"{sys.executable} {os.path.join(TARGETS, script)} {mnt}/reports {' '.join(args)}; "
        f"rc=$?; echo TREE; find {mnt} | sort; exit $rc"
    )
    returncode, out, err = in_private_mount_namespace(cmd, env=env, timeout=timeout)
    return returncode, out, err, env["TMPDIR"]


def _check_fallback(out: str, err: str, tmpdir: str) -> dict:
    assert "BATCHES 5" in out
    assert "ValueError: step failed" in err  # the user's exception, unchanged, ends the script
    # a fresh mkdtemp directory (never the predictable dlwatch-reports-<uid>), 0700
    made = glob.glob(os.path.join(tmpdir, f"dlwatch-reports-{os.getuid()}-*"))
    assert not os.path.lexists(os.path.join(tmpdir, f"dlwatch-reports-{os.getuid()}"))
    found = [i for d in made for i in incidents(d)]
    assert len(found) == 1, (out, err)
    assert stat.S_IMODE(os.stat(os.path.dirname(found[0])).st_mode) == 0o700
    report = load(found[0])
    assert report["trigger"] == "exception" and report["exception"]["type"] == "builtins.ValueError"
    return report


def test_read_only_report_dir(tmp_path, short_tmp):
    rc, out, err, tmpdir = _in_private_mount(tmp_path, short_tmp, "ro,size=64k", "faulty.py")
    assert rc == 1
    assert out.count("WARNING dlwatch: report directory") == 1 and "not writable" in out
    report = _check_fallback(out, err, tmpdir)
    named = out.split("writing reports to ", 1)[1].split("'")[1]  # the warning names the fallback
    assert report["id"] in os.listdir(named)


def test_full_report_dir(tmp_path, short_tmp):
    # 24 KiB: the run directory fits, the incident does not
    rc, out, err, tmpdir = _in_private_mount(tmp_path, short_tmp, "size=24k", "faulty.py")
    assert rc == 1
    report = _check_fallback(out, err, tmpdir)
    assert any("could not write to" in n for n in report["notes"])
    tree = out.split("TREE", 1)[1].split()
    # never a half-written report: no temporary directory, no incident without its report.json
    assert not [p for p in tree if "/.tmp-" in p]
    incident_dirs = {
        p
        for p in tree
        if p.count("/reports/")
        and p.split("/reports/")[1].count("/") == 0
        and not os.path.basename(p).startswith(".")
        and os.path.basename(p) != "runs"
    }
    assert all(any(q == d + "/report.json" for q in tree) for d in incident_dirs)
    # runs/ holds run summaries (never incidents): none half-written either
    summaries = {p for p in tree if "/reports/runs/" in p and p.split("/reports/runs/")[1].count("/") == 0}
    assert all(any(q == d + "/summary.json" for q in tree) for d in summaries)


def test_many_workers_and_many_epochs_stay_bounded(tmp_path, no_leftovers):
    dl = DataLoader(Squares(64), batch_size=1, num_workers=64, persistent_workers=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns about 64 workers on 2 cores
        with dlwatch.watch(dl, report_dir=tmp_path / "a", poll_interval=0.2) as batches:
            assert len(batches_of(batches)) == 64
            monitor = psutil.Process(batches.monitor_pid)
            time.sleep(1.0)
            assert monitor.memory_info().rss < 80 << 20
    del dl, batches
    import gc

    gc.collect()  # the 64 persistent workers go now, or the next monitor would watch them too
    small = DataLoader(Squares(2), batch_size=2, num_workers=2, persistent_workers=True)
    with dlwatch.watch(small, report_dir=tmp_path / "b", poll_interval=0.01) as batches:
        monitor = psutil.Process(batches.monitor_pid)
        rss = []
        for epoch in range(1000):
            assert len(batches_of(batches)) == 1
            if epoch >= 400 and epoch % 200 == 0 or epoch == 999:
                # from epoch 400 the per-process history (HISTORY polls) is full: memory must stay flat
                rss.append(monitor.memory_info().rss)
        timeline = os.path.join(batches.run_dir, "timeline.jsonl")
        size = os.path.getsize(timeline)
    del small, batches  # persistent workers shut down with their loaders
    assert max(rss) - rss[0] < 2 << 20, rss  # flat across 600 epochs, beyond allocator noise
    assert max(rss) < 50 << 20
    assert size <= 8 << 20
    assert incidents(str(tmp_path / "b")) == []


def test_timeline_rotates_at_its_cap(tmp_path):
    t = Timeline(str(tmp_path / "timeline.jsonl"), cap=4096)
    for i in range(1000):
        t.append({"kind": "sample", "i": i, "pad": "x" * 50})
    t.close()
    assert os.path.getsize(tmp_path / "timeline.jsonl") <= 4096
    assert os.path.getsize(tmp_path / "timeline.1.jsonl") <= 4096
    assert sorted(os.listdir(tmp_path)) == ["timeline.1.jsonl", "timeline.jsonl"]


CGROUP_V1 = "/sys/fs/cgroup/memory"


def test_oom_kill_gives_exit_incident(tmp_path):
    if not os.access(CGROUP_V1, os.W_OK) or not os.path.exists(os.path.join(CGROUP_V1, "memory.limit_in_bytes")):
        pytest.skip("no writable cgroup v1 memory controller here")
    cg = os.path.join(CGROUP_V1, f"dlwatch-test-{os.getpid()}")
    os.mkdir(cg)
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(900 << 20))
        with open(os.path.join(cg, "memory.oom_control")) as f:
            if "oom_kill " not in f.read():
                pytest.skip("this kernel's memory cgroup does not count OOM kills")
        wrapper = f"echo $$ > {cg}/cgroup.procs && exec {sys.executable} {os.path.join(TARGETS, 'oom.py')} {tmp_path}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, TARGETS]))
        proc = subprocess.Popen(
            ["sh", "-c", wrapper],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        try:
            proc.communicate(timeout=120)
            found = wait_for(lambda: incidents(str(tmp_path)), timeout=20)
            assert found, "no exit incident"
            report = load(found[0])
            assert report["trigger"] == "exit"
            assert report["exit_cause"] == "oom-kill", report["summary"]
            assert "OOM killer" in report["summary"]
        finally:
            os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
            proc.wait()
    finally:
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            with open(os.path.join(cg, "cgroup.procs")) as f:
                pids = [int(x) for x in f.read().split()]
            if not pids:
                break
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.1)
        os.rmdir(cg)
