"""Property tests: the /proc parsers never fail on truncated or garbled text except as documented."""

from __future__ import annotations

import os

from hypothesis import given, settings
from hypothesis import strategies as st

from dlwatch.collect import procfs

REAL_STAT = open(f"/proc/{os.getpid()}/stat").read()
REAL_MAPS = open(f"/proc/{os.getpid()}/maps").read()[:4000]
REAL_MEMINFO = open("/proc/meminfo").read()


@given(st.integers(min_value=0, max_value=len(REAL_STAT)), st.text(max_size=40))
def test_parse_stat_truncated_or_garbled(cut, junk):
    for text in (REAL_STAT[:cut], REAL_STAT[:cut] + junk, junk + REAL_STAT[cut:]):
        try:
            out = procfs.parse_stat(text)
        except ValueError:
            continue  # the one documented failure: the caller keeps what it read before
        assert isinstance(out["state"], str) and out["cpu_s"] >= 0


def test_parse_stat_comm_with_spaces_and_parens():
    text = REAL_STAT.replace(f"({REAL_STAT[REAL_STAT.find('(') + 1:REAL_STAT.rfind(')')]})", "(a) b (c")
    text = text.replace("(a) b (c", "(a) b (c)") if text.count(")") < 2 else text
    out = procfs.parse_stat(f"123 (evil ) R 1 x) {REAL_STAT[REAL_STAT.rfind(')') + 2:]}")
    assert out["name"] == "evil ) R 1 x"


@given(st.text(max_size=200))
def test_parse_syscall_never_raises(text):
    out = procfs.parse_syscall(text)
    assert out is None or isinstance(out, int)


def test_parse_syscall_values():
    assert procfs.parse_syscall("202 0x7f 0x80 0x0 0x0 0x0 0x0 0x7ffc 0x7f12\n") == 202
    assert procfs.parse_syscall("running\n") == -1
    assert procfs.parse_syscall("-1 0x7ffc 0x7f12\n") == -1
    assert procfs.parse_syscall("") is None


@given(st.integers(min_value=0, max_value=len(REAL_MEMINFO)), st.text(max_size=60))
def test_parse_kv_kib(cut, junk):
    out = procfs.parse_kv_kib(REAL_MEMINFO[:cut] + junk, ("MemAvailable", "Mlocked"))
    assert all(isinstance(v, int) and v >= 0 for v in out.values())


@settings(max_examples=200)
@given(st.integers(min_value=0, max_value=len(REAL_MAPS)), st.text(max_size=80))
def test_shm_mappings(cut, junk):
    count, total = procfs.shm_mappings(REAL_MAPS[:cut] + junk + "\nzz-yy rw-s 0 00:1 2 /dev/shm/torch_1 (deleted)\n")
    assert count >= 0 and total >= 0


def test_shm_mappings_counts_torch_segments():
    maps = ("7f0000000000-7f0000100000 rw-s 00000000 00:1a 12 /dev/shm/torch_5_123_0 (deleted)\n"
            "7f0000100000-7f0000300000 rw-s 00000000 00:1a 13 /dev/shm/torch_5_124_0 (deleted)\n"
            "7f0000300000-7f0000400000 r-xp 00000000 08:01 99 /usr/lib/libc.so.6\n")
    assert procfs.shm_mappings(maps) == (2, 0x100000 + 0x200000)


def test_classify_fd_target():
    assert procfs.classify_fd_target("/dev/shm/torch_1_2 (deleted)") == "shm"
    assert procfs.classify_fd_target("socket:[123]") == "socket"
    assert procfs.classify_fd_target("pipe:[9]") == "pipe"
    assert procfs.classify_fd_target("/data/img_001.jpg") == "file"
    assert procfs.classify_fd_target("anon_inode:[eventfd]") == "other"
    assert procfs.classify_fd_target("/dev/null") == "other"
