"""Syscall numbers: what the first field of /proc/<pid>/syscall means, per architecture.

This module owns the one table of syscall numbers dlwatch knows (``NUMBERS``: the
kernel's own names, ``__NR_<name>`` in its unistd headers, per architecture), the
one map from ``platform.machine()`` spellings to those architectures
(``ARCH_ALIASES``), and the groups built on the names: the kind of wait a
number means (``category``), the syscalls whose first argument is an fd
(``fd_first``), and the sends, connects and file reads the I/O-wait verdict
tells apart.  Groups are defined by name once, so a number can only be wrong in
one place, and an architecture can only lack a syscall the kernel lacks there
(aarch64 has no poll, select, pause or open: only ppoll, pselect6, openat).

Numbers are those of a 64-bit process on the monitor's own architecture: the
monitor and the watched job run on one machine.
"""

from __future__ import annotations

import platform
from typing import Mapping

__all__ = [
    "ARCH_ALIASES",
    "CATEGORIES",
    "NUMBERS",
    "arch",
    "category",
    "is_connect",
    "is_fd_first",
    "is_file_read",
    "is_lock_wait",
    "is_open",
    "is_send",
    "open_path_arg",
    "number",
]

# Linux's own names (include/uapi/asm-generic/unistd.h for aarch64,
# arch/x86/entry/syscalls/syscall_64.tbl for x86_64); tests check them against the installed headers.
NUMBERS: Mapping[str, Mapping[str, int]] = {
    "x86_64": {
        "read": 0,
        "write": 1,
        "open": 2,
        "poll": 7,
        "pread64": 17,
        "pwrite64": 18,
        "readv": 19,
        "writev": 20,
        "select": 23,
        "pause": 34,
        "nanosleep": 35,
        "sendfile": 40,
        "connect": 42,
        "accept": 43,
        "sendto": 44,
        "recvfrom": 45,
        "sendmsg": 46,
        "recvmsg": 47,
        "wait4": 61,
        "msgrcv": 70,
        "fcntl": 72,
        "flock": 73,
        "fsync": 74,
        "fdatasync": 75,
        "futex": 202,
        "io_getevents": 208,
        "semtimedop": 220,
        "clock_nanosleep": 230,
        "epoll_wait": 232,
        "waitid": 247,
        "openat": 257,
        "pselect6": 270,
        "ppoll": 271,
        "epoll_pwait": 281,
        "accept4": 288,
        "preadv": 295,
        "pwritev": 296,
        "io_uring_enter": 426,
        "openat2": 437,
        "epoll_pwait2": 441,
        "futex_waitv": 449,
    },
    "aarch64": {
        "io_getevents": 4,
        "epoll_pwait": 22,
        "fcntl": 25,
        "flock": 32,
        "openat": 56,
        "read": 63,
        "write": 64,
        "readv": 65,
        "writev": 66,
        "pread64": 67,
        "pwrite64": 68,
        "preadv": 69,
        "pwritev": 70,
        "sendfile": 71,
        "pselect6": 72,
        "ppoll": 73,
        "fsync": 82,
        "fdatasync": 83,
        "waitid": 95,
        "futex": 98,
        "nanosleep": 101,
        "clock_nanosleep": 115,
        "msgrcv": 188,
        "semtimedop": 192,
        "accept": 202,
        "connect": 203,
        "sendto": 206,
        "recvfrom": 207,
        "sendmsg": 211,
        "recvmsg": 212,
        "accept4": 242,
        "wait4": 260,
        "io_uring_enter": 426,
        "openat2": 437,
        "epoll_pwait2": 441,
        "futex_waitv": 449,
    },
}

# platform.machine() spellings of the same architectures (Windows/BSD-style names, as some tools print them)
ARCH_ALIASES: Mapping[str, str] = {"amd64": "x86_64", "x64": "x86_64", "arm64": "aarch64", "armv8": "aarch64"}

# Kinds of wait by syscall name.  restart_syscall is deliberately absent: it is what a
# sleeping poll/nanosleep reads as after a ptrace attach (py-spy) interrupted it, so it
# says nothing about the kind of wait.
CATEGORIES: Mapping[str, str] = {
    **dict.fromkeys(("futex", "futex_waitv", "semtimedop"), "lock acquire"),
    **dict.fromkeys(("poll", "select", "pselect6", "ppoll", "epoll_wait", "epoll_pwait", "epoll_pwait2"), "poll"),
    **dict.fromkeys(("nanosleep", "clock_nanosleep", "pause"), "sleep"),
    **dict.fromkeys(
        (
            "read",
            "write",
            "pread64",
            "pwrite64",
            "readv",
            "writev",
            "preadv",
            "pwritev",
            "recvfrom",
            "sendto",
            "recvmsg",
            "sendmsg",
            "accept",
            "accept4",
            "connect",
            "open",
            "openat",
            "openat2",
            "fsync",
            "fdatasync",
            "io_getevents",
            "io_uring_enter",
            "sendfile",
        ),
        "io",
    ),
    **dict.fromkeys(("wait4", "waitid"), "child wait"),
    **dict.fromkeys(("flock", "fcntl"), "file lock"),  # a thread that waits in fcntl waits for F_SETLKW
    "msgrcv": "queue get",
}

# syscalls whose first argument is an fd (sendfile's is the fd written to)
_FD_FIRST = frozenset(
    {
        "read",
        "write",
        "pread64",
        "pwrite64",
        "readv",
        "writev",
        "preadv",
        "pwritev",
        "recvfrom",
        "sendto",
        "recvmsg",
        "sendmsg",
        "connect",
        "accept",
        "accept4",
        "fsync",
        "fdatasync",
        "flock",
        "fcntl",
        "sendfile",
    }
)
_SEND = frozenset({"write", "writev", "sendto", "sendmsg"})
_CONNECT = frozenset({"connect"})
_FILE_READ = frozenset({"read", "pread64", "readv", "preadv"})
_OPEN = frozenset({"open", "openat", "openat2"})


_HOST_MACHINE = platform.machine() or ""  # uname: read once, not on every poll


def arch(machine: str | None = None) -> str:
    """The canonical architecture name of ``machine`` (default: this machine's), lower case."""
    m = (machine or _HOST_MACHINE).lower()
    return ARCH_ALIASES.get(m, m)


def _by_number(names: frozenset[str] | Mapping[str, str]) -> dict[str, dict[int, str]]:
    return {a: {nr: name for name, nr in table.items() if name in names} for a, table in NUMBERS.items()}


_NAMES = _by_number(frozenset(n for t in NUMBERS.values() for n in t))
_CATEGORY = {
    a: {nr: CATEGORIES[name] for nr, name in names.items() if name in CATEGORIES} for a, names in _NAMES.items()
}
_HOST_CATEGORY = _CATEGORY.get(arch(), {})
_GROUPS = {
    g: {a: frozenset(_by_number(names)[a]) for a in NUMBERS}
    for g, names in (("fd", _FD_FIRST), ("send", _SEND), ("connect", _CONNECT), ("read", _FILE_READ), ("open", _OPEN))
}


def number(name: str, machine: str | None = None) -> int | None:
    """The number of syscall ``name`` on ``machine`` (default: this one); None where it has none."""
    return NUMBERS.get(arch(machine), {}).get(name)


def category(nr: int | None, machine: str | None = None) -> str | None:
    """The kind of wait a /proc/<pid>/syscall number means on this (or the given) arch.

    None for -1 (running in user space), unknown numbers and unknown arches.
    """
    if nr is None or nr < 0:
        return None
    if machine is None:  # this machine's (every poll, for each process): its table found once
        return _HOST_CATEGORY.get(nr)
    return _CATEGORY.get(arch(machine), {}).get(nr)


def _in(group: str, nr: int | None, machine: str | None) -> bool:
    return nr is not None and nr in _GROUPS[group].get(arch(machine), frozenset())


def is_fd_first(nr: int | None, machine: str | None = None) -> bool:
    """Whether syscall ``nr``'s first argument is an fd (read, send, connect, fsync, flock, ...)."""
    return _in("fd", nr, machine)


def is_send(nr: int | None, machine: str | None = None) -> bool:
    """write, writev, sendto or sendmsg."""
    return _in("send", nr, machine)


def is_connect(nr: int | None, machine: str | None = None) -> bool:
    return _in("connect", nr, machine)


def is_file_read(nr: int | None, machine: str | None = None) -> bool:
    """read, pread64, readv or preadv: what a file read waits in."""
    return _in("read", nr, machine)


def is_open(nr: int | None, machine: str | None = None) -> bool:
    """open, openat or openat2: a wait there has no fd yet (a FIFO with no partner, a hung mount)."""
    return _in("open", nr, machine)


def open_path_arg(nr: int | None, machine: str | None = None) -> int | None:
    """Which argument of an open syscall is the path's address (open: 0; openat, openat2: 1)."""
    if not is_open(nr, machine):
        return None
    return 0 if nr == number("open", machine) else 1


F_SETLKW = 7  # fcntl commands that wait for a lock (asm-generic/fcntl.h; the same on x86_64 and aarch64)
F_OFD_SETLKW = 38


def is_lock_wait(nr: int | None, args: tuple[int, ...], machine: str | None = None) -> bool:
    """flock, or fcntl with F_SETLKW / F_OFD_SETLKW: a wait for a file lock another process holds."""
    name = _NAMES.get(arch(machine), {}).get(nr) if nr is not None else None
    if name == "flock":
        return True
    return name == "fcntl" and len(args) > 1 and args[1] in (F_SETLKW, F_OFD_SETLKW)
