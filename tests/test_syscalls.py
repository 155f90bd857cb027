"""The one syscall table: its numbers against the kernel's headers and a live process, its groups by name."""

from __future__ import annotations

import os
import platform
import re
import subprocess
import sys

import pytest

from conftest import kill_tree, wait_for
from dlwatch.collect import procfs, syscalls

# Where Linux's uapi headers put each architecture's numbers (linux-libc-dev).  aarch64 uses the
# generic table; a few of its names are spelled __NR3264_<name> there (sendfile).
HEADERS = {
    "x86_64": ("/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h"),
    "aarch64": ("/usr/include/asm-generic/unistd.h",),
}


def _header_numbers(arch: str) -> dict[str, int]:
    path = next((p for p in HEADERS[arch] if os.path.exists(p)), None)
    if path is None:
        pytest.skip(f"no kernel header for {arch} here (install linux-libc-dev); numbers not cross-checked")
    out: dict[str, int] = {}
    with open(path) as f:
        for m in re.finditer(r"^#define __NR(?:3264)?_(\w+)\s+(\d+)\s*$", f.read(), re.M):
            out.setdefault(m.group(1), int(m.group(2)))
    return out


@pytest.mark.parametrize("arch", sorted(syscalls.NUMBERS))
def test_numbers_are_the_kernels(arch: str) -> None:
    kernel = _header_numbers(arch)
    wrong = {name: (nr, kernel.get(name)) for name, nr in syscalls.NUMBERS[arch].items() if kernel.get(name) != nr}
    assert not wrong, f"{arch}: ours vs the kernel's: {wrong}"


def test_every_grouped_name_exists_somewhere_and_aarch64_lacks_only_what_the_kernel_lacks() -> None:
    known = set().union(*(set(t) for t in syscalls.NUMBERS.values()))
    assert set(syscalls.CATEGORIES) <= known
    # the legacy calls aarch64 never had; everything else the groups name it has too
    assert known - set(syscalls.NUMBERS["aarch64"]) == {"open", "poll", "select", "pause", "epoll_wait"}
    assert known == set(syscalls.NUMBERS["x86_64"])


@pytest.mark.parametrize(
    "machine,name,nr",
    [
        ("x86_64", "futex", 202),
        ("aarch64", "futex", 98),
        ("x86_64", "poll", 7),
        ("aarch64", "poll", None),
        ("aarch64", "ppoll", 73),
        ("arm64", "futex", 98),
        ("AMD64", "futex", 202),
        ("x64", "ppoll", 271),
        ("armv8", "sendfile", 71),
        ("riscv64", "futex", None),
    ],
)
def test_number_and_aliases(machine: str, name: str, nr: int | None) -> None:
    assert syscalls.number(name, machine) == nr


def test_groups_are_the_same_names_on_both_arches() -> None:
    # the fd-first set of procfs.read_io once lacked sendfile on aarch64 only
    for name in ("sendfile", "flock", "read", "connect", "accept4", "fsync"):
        for machine in ("x86_64", "aarch64"):
            assert syscalls.is_fd_first(syscalls.number(name, machine), machine), (name, machine)
    assert not syscalls.is_fd_first(syscalls.number("futex", "aarch64"), "aarch64")
    assert not syscalls.is_fd_first(None) and not syscalls.is_fd_first(-1)
    for machine in ("x86_64", "aarch64"):
        assert syscalls.is_send(syscalls.number("sendmsg", machine), machine)
        assert syscalls.is_connect(syscalls.number("connect", machine), machine)
        assert syscalls.is_file_read(syscalls.number("pread64", machine), machine)
        assert not syscalls.is_file_read(syscalls.number("write", machine), machine)
        assert syscalls.category(syscalls.number("sendfile", machine), machine) == "io"
        assert syscalls.category(syscalls.number("msgrcv", machine), machine) == "queue get"
    # 202 is futex on x86_64 but accept on aarch64
    assert syscalls.category(202, "x86_64") == "lock acquire" and syscalls.category(202, "aarch64") == "io"


def test_a_live_read_reads_as_read_on_this_machine() -> None:
    """The table for this machine, checked against the kernel at work: a child blocked reading a pipe."""
    if syscalls.arch() not in syscalls.NUMBERS:
        pytest.skip(f"no syscall table for {platform.machine()}")
    r, w = os.pipe()
    child = subprocess.Popen([sys.executable, "-c", f"import os; os.read({r}, 1)"], pass_fds=(r,))
    try:
        os.close(r)
        nr = syscalls.number("read")
        wait_for(lambda: procfs.read_proc(child.pid).syscall == nr, timeout=30)
        io = procfs.read_io(child.pid)
        main = next(t for t in io.threads if t.tid == child.pid)
        assert main.syscall == nr and syscalls.category(nr) == "io"
        assert main.fd is not None and main.fd_target is not None and main.fd_target.startswith("pipe:")
    finally:
        os.close(w)
        kill_tree(child.pid)
        child.wait(timeout=10)
