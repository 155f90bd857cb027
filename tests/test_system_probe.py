"""SystemProbe: what it keeps between polls, what it reads every poll, and that it agrees with read_system."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from dlwatch.collect import system
from dlwatch.collect.system import SystemProbe, read_system

CGROUP_V1 = "/sys/fs/cgroup/memory"


def _moving(s):
    # figures another process on the machine moves between two reads
    return dataclasses.replace(
        s, ts=0, mem_available=None, mlocked=None, shm_free=None, shm_torch_files=None, cgroup_memory_usage=None
    )


def test_probe_agrees_with_read_system_here():
    probe = SystemProbe(os.getpid())
    for _ in range(3):  # the first sample finds the cgroup, the next ones reuse it
        got = probe.sample()
        assert _moving(got) == _moving(read_system(os.getpid()))
        assert got.mem_available and got.shm_total is not None


def _fake_v1(root, limit, usage, oom_kills):
    d = root / "job"
    d.mkdir(exist_ok=True)
    (d / "memory.limit_in_bytes").write_text(f"{limit}\n")
    (d / "memory.usage_in_bytes").write_text(f"{usage}\n")
    (d / "memory.oom_control").write_text(f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kills}\n")
    return d


def test_counters_every_poll_limit_at_its_cadence(tmp_path, monkeypatch):
    monkeypatch.setattr(system, "_V1", str(tmp_path))
    d = _fake_v1(tmp_path, 8 << 30, 1 << 30, 0)
    probe = SystemProbe(os.getpid(), ("/job", None))
    first = probe.sample()
    assert (first.cgroup_memory_limit, first.cgroup_memory_usage, first.cgroup_oom_kills) == (8 << 30, 1 << 30, 0)
    _fake_v1(tmp_path, 4 << 30, 2 << 30, 1)  # a kill and a resize between two polls
    s = probe.sample()
    assert (s.cgroup_memory_usage, s.cgroup_oom_kills) == (2 << 30, 1)  # what judges a death: now
    assert s.cgroup_memory_limit == 8 << 30  # the limit: at its cadence
    monkeypatch.setattr(system, "LIMIT_EVERY_S", 0.0)
    assert probe.sample().cgroup_memory_limit == 4 << 30
    # the directory goes: the probe looks again, as read_system does (here: the controller's root)
    for f in d.iterdir():
        f.unlink()
    d.rmdir()
    (tmp_path / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "unlimited"
    (tmp_path / "memory.usage_in_bytes").write_text("123\n")
    s = probe.sample()
    assert (s.cgroup_memory_limit, s.cgroup_memory_usage) == (None, 123)
    assert _moving(s) == _moving(read_system(os.getpid(), ("/job", None)))


def test_real_cgroup_limit_is_reread_at_its_cadence(monkeypatch):
    if not os.access(CGROUP_V1, os.W_OK) or not os.path.exists(os.path.join(CGROUP_V1, "memory.limit_in_bytes")):
        pytest.skip("no writable cgroup v1 memory controller here (covered by the fake one above)")
    cg = os.path.join(CGROUP_V1, f"dlwatch-probe-{os.getpid()}")
    os.mkdir(cg)
    sleeper = None
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(900 << 20))
        sleeper = subprocess.Popen(
            ["sh", "-c", f"echo $$ > {cg}/cgroup.procs && exec sleep 60"], start_new_session=True
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and str(sleeper.pid) not in open(os.path.join(cg, "cgroup.procs")).read():
            time.sleep(0.02)
        probe = SystemProbe(sleeper.pid)
        assert probe.sample().cgroup_memory_limit == 900 << 20
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(800 << 20))
        assert probe.sample().cgroup_memory_limit == 900 << 20  # kept until LIMIT_EVERY_S passes
        monkeypatch.setattr(system, "LIMIT_EVERY_S", 0.0)
        assert probe.sample().cgroup_memory_limit == 800 << 20
        assert read_system(sleeper.pid).cgroup_memory_limit == 800 << 20
    finally:
        if sleeper is not None:
            sleeper.kill()
            sleeper.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.rmdir(cg)
                break
            except OSError:  # the killed sleeper leaves the cgroup a moment later
                time.sleep(0.05)


def test_shm_count_follows_every_change(tmp_path, monkeypatch):
    shm = tmp_path / "shm"
    shm.mkdir()
    probe = SystemProbe(os.getpid(), shm_dir=str(shm))
    assert probe.sample().shm_torch_files == 0
    (shm / "torch_1").write_bytes(b"")
    (shm / "other").write_bytes(b"")
    assert probe.sample().shm_torch_files == 1  # a fresh mtime: never trusted, counted again
    past = time.time() - 60
    os.utime(shm, (past, past))  # settled: the next count may be kept
    assert probe.sample().shm_torch_files == 1
    calls = []
    real = system.torch_shm_files
    monkeypatch.setattr(system, "torch_shm_files", lambda path: calls.append(path) or real(path))
    assert probe.sample().shm_torch_files == 1 and calls == []  # nothing changed: not scanned
    (shm / "torch_2").write_bytes(b"")
    assert probe.sample().shm_torch_files == 2 and calls == [str(shm)]
    (shm / "torch_1").unlink()
    (shm / "torch_2").rename(shm / "x")
    assert probe.sample().shm_torch_files == 0
    # and at least every SHM_RECOUNT_EVERY_S, whatever the mtime says
    os.utime(shm, (past, past))
    probe.sample()
    n = len(calls)
    probe.sample()
    assert len(calls) == n
    monkeypatch.setattr(system, "SHM_RECOUNT_EVERY_S", 0.0)
    probe.sample()
    assert len(calls) == n + 1


def test_meminfo_search_reads_what_the_line_parser_reads():
    from dlwatch.collect.procfs import parse_kv_kib

    text = open("/proc/meminfo").read()
    keys = [line.split(":")[0] for line in text.splitlines()] + ["Nope", "Mem", ""]
    for key in keys:
        assert system._meminfo_kib(text, key) == parse_kv_kib(text, (key,)).get(key), key
    assert system._meminfo_kib("Mlocked:  4 kB", "Mlocked") == 4096
    assert system._meminfo_kib("XMlocked: 4 kB\n", "Mlocked") is None


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
