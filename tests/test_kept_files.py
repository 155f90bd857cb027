"""Files the monitor keeps open between polls (procfs.ProcFiles, SystemProbe, HeartbeatReader), and
model.proc_sample: each gives what the fresh read or the plain constructor gives, and lets go.

Real processes, a real cgroup where this machine has a writable v1 memory controller, a real heartbeat.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from dlwatch.collect import procfs, system
from dlwatch.collect.system import SystemProbe
from dlwatch.model import ProcSample, proc_sample
from dlwatch.wire import heartbeat

CGROUP_V1 = "/sys/fs/cgroup/memory"


def _own_fds_to(prefix: str) -> list[str]:
    out = []
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target == prefix or target.startswith(prefix.rstrip("/") + "/"):
            out.append(target)
    return out


def test_proc_sample_is_the_constructor():
    assert "__post_init__" not in vars(ProcSample)  # proc_sample skips __init__: nothing may hide there
    for fields in (
        {},
        {"name": "pt_data_worker", "state": "S", "cpu_s": 1.5, "num_fds": 9, "rss": 1 << 20, "syscall": 202},
        {"gone": True, "minflt": 3, "exit_code": 9, "uss": 7, "uss_ts": 2.0, "wchan": None},
    ):
        a, b = proc_sample(4242, 12.5, fields), ProcSample(pid=4242, ts=12.5, **fields)
        assert a == b and hash(a) == hash(b) and repr(a) == repr(b) and a.to_dict() == b.to_dict()
        assert list(vars(a)) == list(vars(b))  # same fields in the same order
        with pytest.raises(dataclasses.FrozenInstanceError):
            a.pid = 1  # type: ignore[misc]
    with pytest.raises(TypeError, match="no_such_field"):
        proc_sample(1, 0.0, {"no_such_field": 1})


def test_an_unchanged_process_reads_as_the_very_values_of_the_last_poll():
    """Through kept files, a process whose files read the same gives the same value objects as the poll
    before (what the timeline relies on), equal to a read by path; a change is seen at the next read."""
    child = subprocess.Popen([sys.executable, "-c", _GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    files = procfs.ProcFiles(child.pid)
    try:
        deadline = time.monotonic() + 30
        prev = procfs.read_proc(child.pid, files=files)
        while True:  # idle: two reads in a row with the same stat (start-up may still move it), as polls carry
            a = procfs.read_proc(child.pid, files=files, carry=prev)
            time.sleep(0.05)
            b = procfs.read_proc(child.pid, files=files, carry=a)
            if a.cpu_s == b.cpu_s and a.minflt == b.minflt and a.state == b.state == "S":
                break
            assert time.monotonic() < deadline, "the child never went idle"
            prev = b
        same = [f.name for f in dataclasses.fields(ProcSample) if getattr(a, f.name) is getattr(b, f.name)]
        assert set(f.name for f in dataclasses.fields(ProcSample)) - set(same) == {"ts"}, same
        fresh = procfs.read_proc(child.pid, carry=a)
        assert dataclasses.replace(b, ts=0.0) == dataclasses.replace(fresh, ts=0.0)
        # the carried figures are the sample's too: another carry (a USS read in between) is not the last read's
        for uss in (5 << 20, 7 << 20, None):
            carry = dataclasses.replace(b, uss=uss, uss_ts=None if uss is None else time.time())
            got = procfs.read_proc(child.pid, files=files, carry=carry)
            assert got.uss == uss and got.uss_ts == carry.uss_ts and got.ts > b.ts
            assert procfs.read_proc(child.pid, files=files, carry=carry).uss is carry.uss  # the same carry again
        bare = procfs.read_proc(child.pid, files=files)  # no carry at all: nothing carried
        assert bare.uss is None and bare.uss_ts is None and bare.name == b.name
        # a detail read goes the general way, through the same files, and says what it read
        detail = procfs.read_proc(child.pid, files=files, mem_detail=True, carry=b)
        assert detail.uss is not None and detail.uss_ts == detail.ts and detail.rss == b.rss
        child.stdin.write("grow\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "grown"
        c = procfs.read_proc(child.pid, files=files, carry=b)
        assert c.rss >= b.rss + (60 << 20) and c.minflt > b.minflt and c.rss is not b.rss
    finally:
        child.kill()
        child.wait(10)
        files.close()


_GROWER = "import sys\nblocks = []\nfor line in sys.stdin:\n    blocks.append(bytearray(64 << 20))\n    print('grown', flush=True)\n"


def test_proc_files_read_fresh_text_each_poll_and_see_the_process_go():
    child = subprocess.Popen([sys.executable, "-c", _GROWER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    files = procfs.ProcFiles(child.pid)
    try:
        before = procfs.read_proc(child.pid, files=files)
        by_path = procfs.read_proc(child.pid)
        assert not before.gone and before.name == by_path.name and before.num_fds == by_path.num_fds
        assert before.fd_limit == by_path.fd_limit and before.syscall == by_path.syscall
        assert len(_own_fds_to(f"/proc/{child.pid}")) == procfs.ProcFiles.FDS  # the directory and four files
        child.stdin.write("grow\n")
        child.stdin.flush()
        assert child.stdout.readline().strip() == "grown"
        after = procfs.read_proc(child.pid, files=files)  # the same descriptors, read again at offset 0
        assert after.rss >= before.rss + (60 << 20), (before.rss, after.rss)
        assert abs(after.rss - procfs.read_proc(child.pid).rss) < 4 << 20  # what a fresh open reads
    finally:
        child.kill()
        child.wait(10)
    assert procfs.read_proc(child.pid, files=files).gone  # reaped: its /proc directory is gone
    files.close()
    assert _own_fds_to(f"/proc/{child.pid}") == []


def test_proc_files_stay_with_their_process_when_its_pid_is_reused():
    """A path names whatever process holds the pid now; the kept files name the one they were opened for."""
    ns_last_pid = "/proc/sys/kernel/ns_last_pid"
    if not os.access(ns_last_pid, os.W_OK):
        pytest.skip("needs root to choose the next pid (ns_last_pid); the gone case is covered above")
    first = subprocess.Popen(["sleep", "60"])
    files = procfs.ProcFiles(first.pid)
    second = None
    try:
        assert procfs.read_proc(first.pid, files=files).name == "sleep"
        first.kill()
        first.wait(10)
        for _ in range(20):  # other processes on the machine may take the pid first: try again
            with open(ns_last_pid, "w") as f:
                f.write(str(first.pid - 1))
            second = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            if second.pid == first.pid:
                break
            second.kill()
            second.wait(10)
            second = None
        if second is None:
            pytest.skip("the pid could not be taken again (a busy machine); the gone case is covered above")
        time.sleep(0.2)  # exec'd: the path now names the new process
        assert procfs.read_proc(first.pid).gone is False  # by path: another process under the same pid
        assert procfs.read_proc(first.pid, files=files).gone is True  # kept: the one that was watched is gone
    finally:
        files.close()
        first.kill()
        first.wait(10)
        if second is not None:
            second.kill()
            second.wait(10)


def test_system_probe_keeps_its_files_and_lets_go_of_a_removed_cgroup():
    if not os.access(CGROUP_V1, os.W_OK) or not os.path.exists(os.path.join(CGROUP_V1, "memory.limit_in_bytes")):
        pytest.skip("no writable cgroup v1 memory controller here (tests/test_system_probe.py fakes one)")
    cg = os.path.join(CGROUP_V1, f"dlwatch-kept-{os.getpid()}")
    os.mkdir(cg)
    sleeper = None
    probe = None
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(700 << 20))
        sleeper = subprocess.Popen(["sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec sleep 60"])
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and str(sleeper.pid) not in open(os.path.join(cg, "cgroup.procs")).read():
            time.sleep(0.02)
        probe = SystemProbe(sleeper.pid)
        first = probe.sample()
        assert first.cgroup_memory_limit == 700 << 20
        assert first.mem_available and first.cgroup_memory_usage is not None
        kept = _own_fds_to(cg)
        assert kept, "the cgroup's files are kept open between polls"
        assert probe.sample().cgroup_memory_usage is not None  # read again through the same descriptors
        assert _own_fds_to(cg) == kept
        sleeper.kill()
        sleeper.wait(10)
        sleeper = None
        deadline = time.monotonic() + 10
        while os.path.exists(cg) and time.monotonic() < deadline:
            try:
                os.rmdir(cg)
            except OSError:  # the killed sleeper leaves the cgroup a moment later
                time.sleep(0.05)
        assert not os.path.exists(cg)
        # the kept files now fail (ENODEV): the probe closes them and finds the controller's root, as
        # read_system would for this cgroup path
        s = probe.sample()
        with open(os.path.join(CGROUP_V1, "memory.limit_in_bytes")) as f:
            assert s.cgroup_memory_limit == system._int(f.read())
        assert s.cgroup_memory_usage is not None
        assert _own_fds_to(cg) == []
    finally:
        if probe is not None:
            probe.close()
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait(10)
        deadline = time.monotonic() + 10
        while os.path.exists(cg) and time.monotonic() < deadline:
            try:
                os.rmdir(cg)
            except OSError:
                time.sleep(0.05)


def test_system_probe_close_lets_go_of_everything():
    before = set(os.listdir("/proc/self/fd"))
    probe = SystemProbe(os.getpid())
    probe.sample()
    assert set(os.listdir("/proc/self/fd")) - before  # meminfo, vmstat, the cgroup's files
    probe.close()
    assert set(os.listdir("/proc/self/fd")) <= before
    system.read_system(os.getpid())  # reads everything once and closes what it opened
    assert set(os.listdir("/proc/self/fd")) <= before


def test_heartbeat_reader_follows_the_writer_and_waits_for_the_file(tmp_path):
    path = str(tmp_path / "heartbeat")
    reader = heartbeat.HeartbeatReader(path)
    try:
        assert reader.read() is None  # not written yet: looked for again at the next read
        writer = heartbeat.HeartbeatWriter(path)
        writer.write(heartbeat.STATE_WAITING)
        got = reader.read()
        assert got is not None and got == heartbeat.read(path) and got.state == heartbeat.STATE_WAITING
        for _ in range(3):  # epoch edges: what the training process writes through write()
            writer.begin_epoch()
            writer.write(heartbeat.STATE_BODY)
        got = reader.read()  # the same descriptor, the writer's latest record
        assert got == heartbeat.read(path) and got.epochs == 3 and got.state == heartbeat.STATE_BODY
        writer.close()
        assert reader.read().state == heartbeat.STATE_ENDED
        held = len(_own_fds_to(path))  # the reader's, and the writer's mapping (it keeps a dup)
    finally:
        reader.close()
    assert len(_own_fds_to(path)) == held - 1


_BUDGET_SIDE = r"""
import json, os, resource, sys
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[2]), hard))
from dlwatch.monitor import loop as monitor
m = monitor.Monitor(sys.argv[1])
m._drain_events()
out = {"budget": m.sampler.files_budget}
m.poll()
out["kept"] = sorted(t.pid for t in m.procs.values() if t.files is not None)
out["sampled"] = sorted(t.pid for t in m.procs.values() if t.last is not None and t.last.name == "sleep")
os.kill(out["kept"][0], 9)
print(json.dumps(out), flush=True)
sys.stdin.readline()  # the test reaps the killed sleeper, then says go on
m.poll()
out["gone"] = sorted(t.pid for t in m.procs.values() if t.gone)
out["kept_after"] = sorted(t.pid for t in m.procs.values() if t.files is not None)
m._close()
out["budget_after_close"] = m.sampler.files_budget
print(json.dumps(out), flush=True)
"""


def test_monitor_keeps_files_within_its_fd_limit_and_hands_them_on(tmp_path):
    """A monitor whose fd limit leaves room for two processes' files reads the rest by path; the files of
    a process that goes are closed and the next process gets them."""
    import json

    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(4)]
    side = None
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir(mode=0o700)
        (run_dir / "dumps").mkdir(mode=0o700)
        main, workers = sleepers[0].pid, [s.pid for s in sleepers[1:]]
        (run_dir / "config.json").write_text(
            json.dumps({"pid": main, "started_at": time.time(), "report_dir": str(tmp_path / "reports"), "options": {}})
        )
        events = run_dir / "events.jsonl"
        events.write_text(
            json.dumps({"ts": time.time(), "event": "loader_workers", "pid": main, "pids": workers}) + "\n"
        )
        events.chmod(0o600)
        limit = monitor_fds_spare() + 2 * procfs.ProcFiles.FDS + 3  # room for two processes' files
        side = subprocess.Popen(
            [sys.executable, "-c", _BUDGET_SIDE, str(run_dir), str(limit)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        first = json.loads(side.stdout.readline())
        assert first["budget"] == 2
        assert len(first["kept"]) == 2
        assert first["sampled"] == sorted(s.pid for s in sleepers)  # the others read by path, all sampled
        killed = next(s for s in sleepers if s.pid == first["kept"][0])
        killed.wait(10)  # reaped: its /proc directory is gone
        side.stdin.write("go\n")
        side.stdin.flush()
        second = json.loads(side.stdout.readline())
        assert second["gone"] == [killed.pid]
        assert killed.pid not in second["kept_after"] and len(second["kept_after"]) == 2  # handed on
        assert second["budget_after_close"] == 2  # every kept file closed at the end
        assert side.wait(30) == 0
    finally:
        if side is not None and side.poll() is None:
            side.kill()
            side.wait(10)
        for s in sleepers:
            s.kill()
            s.wait(10)


def monitor_fds_spare() -> int:
    from dlwatch.monitor import sampling

    return sampling.FDS_SPARE
