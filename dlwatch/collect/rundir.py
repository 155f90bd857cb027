"""Read another process's run directory without trusting it: ``dlwatch attach`` on someone else's job.

``dlwatch attach`` finds a watched run's directory through the target's memory
maps, so the directory, and everything in it, is whatever the target's user
made it.  An operator typically runs attach as root.  This module is the one
place attach reads that directory, and it reads it

- with the target's rights: when attach runs as another uid (root, or a uid
  with CAP_SYS_PTRACE), a short-lived child drops to the target's uid, gid and
  groups (and is made non-dumpable) before it opens anything, and sends the
  bytes back over a pipe, bounded in size and time.  What the target's user
  cannot read, attach cannot be made to read.  Where the drop is not permitted
  (no CAP_SETUID), the directory is not read at all and the caller says so;
- without following links: the directory is opened with O_NOFOLLOW, and every
  component below it is opened relative to its parent with O_NOFOLLOW, so a
  symbolic link anywhere below the run directory is refused;
- regular files only, owned by the target's uid, inside the directory (names
  are relative, without ``..``), opened O_NONBLOCK (a FIFO cannot block it) and
  read up to a cap;
- read-only: nothing here creates, truncates or writes a file.
"""

from __future__ import annotations

import ctypes
import errno
import os
import select
import signal
import stat
import struct
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

__all__ = ["Creds", "RunDirReader", "target_creds"]

HELPER_TIMEOUT_S = 5.0
PR_SET_DUMPABLE = 4
_HEADER = struct.Struct("<iQ")  # per file: status (0 ok, else an errno), length


@dataclass(frozen=True)
class Creds:
    uid: int
    gid: int
    groups: tuple[int, ...]


def target_creds(pid: int) -> Creds | None:
    """The effective uid and gid and the supplementary groups of ``pid`` (None if unreadable)."""
    uid = gid = None
    groups: tuple[int, ...] = ()
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                key, _, value = line.decode("ascii", "replace").partition(":")
                fields = value.split()
                if key == "Uid" and len(fields) >= 2:
                    uid = int(fields[1])
                elif key == "Gid" and len(fields) >= 2:
                    gid = int(fields[1])
                elif key == "Groups":
                    groups = tuple(int(g) for g in fields)
    except (OSError, ValueError):
        return None
    if uid is None or gid is None:
        return None
    return Creds(uid, gid, groups)


class RefusedError(Exception):
    """The run directory cannot be read safely; the message says why and what to do."""


def _is_relative_name(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and not name.startswith("/") and all(p not in ("", ".", "..") for p in parts)


def _read_one(dir_fd: int, name: str, uid: int, cap: int) -> tuple[int, bytes]:
    """(0, bytes) or (errno, b"") for one file below dir_fd, never following a link."""
    parts = name.split("/")
    fds: list[int] = []
    try:
        parent = dir_fd
        for part in parts[:-1]:
            fd = os.open(part, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
            fds.append(fd)
            st = os.fstat(fd)
            if st.st_uid != uid:
                return errno.EPERM, b""
            parent = fd
        fd = os.open(parts[-1], os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=parent)
        fds.append(fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return errno.EINVAL, b""
        if st.st_uid != uid:
            return errno.EPERM, b""
        chunks, total = [], 0
        while total < cap:
            chunk = os.read(fd, min(1 << 20, cap - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        return 0, b"".join(chunks)
    except OSError as exc:
        return exc.errno or errno.EIO, b""
    finally:
        for fd in fds:
            os.close(fd)


def _read_all(
    run_dir: str, names: Iterable[str], uid: int, caps: Mapping[str, int], default_cap: int
) -> dict[str, tuple[int, bytes]]:
    try:
        dir_fd = os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        code = exc.errno or errno.EIO
        return {name: (code, b"") for name in names}
    try:
        if os.fstat(dir_fd).st_uid != uid:
            return {name: (errno.EPERM, b"") for name in names}
        return {
            name: _read_one(dir_fd, name, uid, caps.get(name, default_cap))
            if _is_relative_name(name)
            else (errno.EINVAL, b"")
            for name in names
        }
    finally:
        os.close(dir_fd)


_WHY = {
    errno.ELOOP: "a symbolic link (not followed)",
    errno.ENOTDIR: "a symbolic link or a file where a directory belongs (not followed)",
    errno.EPERM: "not owned by the target's user (not read)",
    errno.EINVAL: "not a regular file inside the run directory (not read)",
    errno.ENOENT: "missing",
    errno.EACCES: "the target's user cannot read it (not read)",
}


def _explain(name: str, code: int) -> str:
    return f"{name}: {_WHY.get(code) or os.strerror(code)}"


class RunDirReader:
    """Reads named files of one run directory with the target's rights (see the module docstring)."""

    def __init__(
        self, run_dir: str, creds: Creds, *, caps: Mapping[str, int] | None = None, default_cap: int = 1 << 20
    ) -> None:
        self.run_dir = run_dir
        self.creds = creds
        self.caps = dict(caps or {})
        self.default_cap = default_cap
        self.refusals: list[str] = []  # one line per file not read, for the report's notes
        self.privileged = os.geteuid() != creds.uid

    def read(self, names: Iterable[str]) -> dict[str, bytes]:
        """The files that could be read safely; the others are explained in ``refusals``.

        Raises RefusedError when the directory cannot be read with the target's rights at all.
        """
        names = list(dict.fromkeys(names))
        if not self.privileged:
            results = _read_all(self.run_dir, names, self.creds.uid, self.caps, self.default_cap)
        else:
            results = self._read_as_target(names)
        out: dict[str, bytes] = {}
        for name in names:
            code, data = results.get(name, (errno.EIO, b""))
            if code == 0:
                out[name] = data
            elif code != errno.ENOENT:
                self.refusals.append(_explain(name, code))
        return out

    def read_one(self, name: str) -> bytes | None:
        return self.read([name]).get(name)

    # ------------------------------------------------------------------ the helper

    def _read_as_target(self, names: list[str]) -> dict[str, tuple[int, bytes]]:
        budget = sum(self.caps.get(n, self.default_cap) + _HEADER.size for n in names)
        try:  # resolved before the fork: the child runs no import and no loader
            prctl = ctypes.CDLL(None, use_errno=True).prctl
        except (OSError, AttributeError):
            prctl = None
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop to the target's rights, read, report, exit without cleanup
            code = 0
            try:
                os.close(rfd)
                if prctl is not None:  # not traceable by the target's user once it has their uid
                    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
                try:
                    os.setgroups(list(self.creds.groups))
                    os.setresgid(self.creds.gid, self.creds.gid, self.creds.gid)
                    os.setresuid(self.creds.uid, self.creds.uid, self.creds.uid)
                except OSError as exc:
                    os.write(wfd, _HEADER.pack(-(exc.errno or errno.EPERM), 0))
                    os._exit(3)
                if os.geteuid() != self.creds.uid or os.getegid() != self.creds.gid:
                    os._exit(4)
                results = _read_all(self.run_dir, names, self.creds.uid, self.caps, self.default_cap)
                for name in names:
                    status, data = results[name]
                    view = memoryview(_HEADER.pack(status, len(data)) + data)
                    while view:
                        view = view[os.write(wfd, view) :]
            except BaseException:
                code = 1
            os._exit(code)
        os.close(wfd)
        try:
            raw = self._collect(rfd, pid, budget)
        finally:
            os.close(rfd)
        results: dict[str, tuple[int, bytes]] = {}
        offset = 0
        if len(raw) >= _HEADER.size and _HEADER.unpack_from(raw, 0)[0] < 0:
            code = -_HEADER.unpack_from(raw, 0)[0]
            raise RefusedError(
                f"attach runs as uid {os.geteuid()} and cannot take the target's uid {self.creds.uid} to read "
                f"its run directory ({os.strerror(code)}); its files were not read. Run dlwatch attach as "
                f"uid {self.creds.uid}, or as root"
            )
        for name in names:  # the child is the target's user: check every length it sends
            if offset + _HEADER.size > len(raw):
                break
            status, length = _HEADER.unpack_from(raw, offset)
            offset += _HEADER.size
            cap = self.caps.get(name, self.default_cap)
            if length > cap or offset + length > len(raw):
                break
            results[name] = (status, raw[offset : offset + length]) if status == 0 else (status, b"")
            offset += length
        if len(results) < len(names):
            for name in names:
                results.setdefault(name, (errno.EIO, b""))
            self.refusals.append(
                "the helper reading the run directory with the target's rights did not "
                f"finish within {HELPER_TIMEOUT_S:g} s or sent malformed data"
            )
        return results

    @staticmethod
    def _collect(rfd: int, pid: int, budget: int) -> bytes:
        return collect_child(rfd, pid, budget, HELPER_TIMEOUT_S)


def collect_child(rfd: int, pid: int, cap: int, timeout_s: float) -> bytes:
    """What a helper child writes to ``rfd`` (a little past ``cap`` at most, within ``timeout_s``); the
    child is killed and reaped whatever it did (the target's user may stop or slow it)."""
    chunks, total = [], 0
    deadline = time.monotonic() + timeout_s
    try:
        while total <= cap:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([rfd], [], [], left)[0]:
                break
            chunk = os.read(rfd, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        os.waitpid(pid, 0)
    return b"".join(chunks)
