"""Private, atomic files: every directory dlwatch creates is 0700, every file 0600.

Reports leave the machine on tickets; run directories hold stack dumps.  Both
are private to the user by construction, not by umask luck, and dlwatch runs
next to other users (and as root on their jobs): it never writes through a
link it did not make, never opens a file another user could have prepared,
and uses an existing directory only when no other user can change it.

- ``make_private_dir`` creates each missing level 0700 and checks every level
  after creating it (a directory, ours, 0700); a failed chmod is an error.
- ``check_report_dir`` says whether an existing directory may hold reports.
- ``create_private`` creates a file with O_CREAT|O_EXCL|O_NOFOLLOW;
  ``open_private`` appends to one only when it is a regular file of ours.
- ``replace_private`` (a file) and ``publish_private_dir`` (a directory) are the one
  write-temporary-then-rename: readers see the old or the new whole, never a part.
- Everything written goes through ``dlwatch.redact.outbound`` on its way out.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import stat
import tempfile
from typing import Any, Callable, Iterable

from dlwatch.redact import outbound, outbound_bytes

DIR_MODE = 0o700
FILE_MODE = 0o600
_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class UnsafeDirError(PermissionError):
    """A directory another user could change: dlwatch does not write there."""


def _who(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (KeyError, ImportError):
        return f"uid {uid}"


def _trusted_owner(st: os.stat_result) -> bool:
    return st.st_uid in (os.geteuid(), 0)


def _sticky_shared(st: os.stat_result) -> bool:
    """/tmp-like: world-writable with the sticky bit (nobody can move another user's entries)."""
    return bool(st.st_mode & stat.S_ISVTX) and bool(st.st_mode & stat.S_IWOTH)


def _check_ancestors(real: str) -> None:
    """Every directory above ``real`` (a resolved path) is one no other user can rename things in."""
    head = os.path.dirname(real)
    while True:
        st = os.lstat(head)
        if not _trusted_owner(st) or (st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX):
            raise UnsafeDirError(
                f"{head} is owned by {_who(st.st_uid)} or writable by others "
                f"(mode {stat.S_IMODE(st.st_mode):o}): another user could replace what is below it"
            )
        parent = os.path.dirname(head)
        if parent == head:
            return
        head = parent


def check_links(path: str) -> None:
    """Every symbolic link on the way to ``path`` is ours or root's, in a directory no other user can
    change: otherwise its owner could point it elsewhere between our check and our write."""
    cur = os.sep
    for part in os.path.abspath(path).split(os.sep):
        if not part:
            continue
        cur = os.path.join(cur, part)
        try:
            st = os.lstat(cur)
        except FileNotFoundError:
            return
        if stat.S_ISLNK(st.st_mode):
            if not _trusted_owner(st):
                raise UnsafeDirError(f"{cur} is a symbolic link owned by {_who(st.st_uid)}, not by you")
            _check_ancestors(os.path.join(os.path.realpath(os.path.dirname(cur)), "x"))


def check_report_dir(path: str) -> str:
    """``path`` (an existing directory) if reports may go there; raises UnsafeDirError otherwise.

    It must be ours (the effective uid) and not writable by group or others.  A
    symlink to such a directory (a scratch disk) is fine when the link is ours
    or root's.  A sticky world-writable directory (``/tmp``) is not used
    itself: ``sticky_parent`` is True for it and the caller makes a private
    child.  Every directory above it must be ours or root's, and not writable by
    others unless sticky.
    """
    st = _real_dir(path)
    if st.st_uid != os.geteuid():
        raise UnsafeDirError(f"{path} is owned by {_who(st.st_uid)}, not by you")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeDirError(f"{path} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")
    return path


def _real_dir(path: str) -> os.stat_result:
    """The stat of the directory ``path`` names, after checking the links on the way and every directory
    above it (see check_links and _check_ancestors)."""
    check_links(path)
    real = os.path.realpath(path)
    st = os.stat(real)
    if not stat.S_ISDIR(st.st_mode):
        raise NotADirectoryError(f"{path} is not a directory")
    _check_ancestors(real)
    return st


def check_shared_dir(path: str) -> str:
    """``path`` (an existing directory, not a link) if dlwatch may put files there that a service of the
    machine reads (node_exporter's textfile directory); raises UnsafeDirError otherwise.

    The report-directory rules, with root as a trusted owner too: owned by the effective uid or root;
    not writable by group or others unless sticky (``/tmp``: nobody can rename another's entries);
    not a symbolic link itself, links above it ours or root's, every directory above it safe.
    """
    if stat.S_ISLNK(os.lstat(path).st_mode):
        raise UnsafeDirError(f"{path} is a symbolic link: give the directory itself")
    st = _real_dir(path)
    if not _trusted_owner(st):
        raise UnsafeDirError(f"{path} is owned by {_who(st.st_uid)}, not by you or root")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
        raise UnsafeDirError(
            f"{path} is writable by group or others without the sticky bit (mode {stat.S_IMODE(st.st_mode):o})"
        )
    return path


def sticky_parent(path: str) -> bool:
    """True for an existing sticky world-writable directory such as /tmp."""
    try:
        return _sticky_shared(os.stat(path))
    except OSError:
        return False


def verify_created(path: str) -> None:
    """A level we just made: a real directory (no link), ours, and exactly 0700 (chmod must work)."""
    fd = os.open(path, _DIR_OPEN)
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise UnsafeDirError(f"{path} was replaced by a directory of {_who(st.st_uid)}")
        if stat.S_IMODE(st.st_mode) != DIR_MODE:
            os.fchmod(fd, DIR_MODE)  # whatever the umask; an error here is an error
    finally:
        os.close(fd)


def make_private_dir(path: str) -> str:
    """Create ``path`` and any missing parents, each 0700 and checked; an existing ``path`` must pass
    :func:`check_report_dir` (existing parents only the ancestor check).

    (os.makedirs gives only the leaf its mode: the parents it creates would be 0777 & ~umask.)
    """
    missing = []
    head = os.path.abspath(path)
    while not os.path.lexists(head):
        missing.append(head)
        parent = os.path.dirname(head)
        if parent == head:
            break
        head = parent
    if not missing:
        check_report_dir(path)
        return path
    check_links(head)
    _check_ancestors(os.path.join(os.path.realpath(head), "x"))
    for d in reversed(missing):
        try:
            os.mkdir(d, DIR_MODE)
        except FileExistsError:
            # someone made it between our look and our mkdir: another rank of the same job sharing
            # the report dir, usually. It is used only on the terms of a directory that was there
            # before: ours, not writable by group or others, no link of another user (else raises)
            check_report_dir(d)
            continue
        verify_created(d)
    return path


def make_private_child(parent: str, name: str) -> str:
    """Create ``parent/name`` exclusively (it must not exist), 0700, checked; the parent must be safe."""
    path = os.path.join(parent, name)
    os.mkdir(path, DIR_MODE)
    verify_created(path)
    return path


def _check_file(fd: int, path: str) -> None:
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_nlink != 1:
        raise UnsafeDirError(f"{path} is not a private regular file of yours")
    if stat.S_IMODE(st.st_mode) != FILE_MODE:
        os.fchmod(fd, FILE_MODE)  # an error here is an error, not ignored


def create_private(path: str, flags: int = os.O_WRONLY, *, dir_fd: int | None = None) -> int:
    """A new file, 0600: O_CREAT|O_EXCL|O_NOFOLLOW (an existing file or link is an error).

    ``dir_fd``: ``path`` is a name in that open directory (never re-resolved through a path)."""
    fd = os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    try:
        _check_file(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


_NEW_APPEND = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def append_new_or_private(path: str) -> int:
    """``open_private(path)`` (append), with its common case, a new file, in one syscall.

    O_CREAT|O_EXCL|O_NOFOLLOW made the file: it is ours, regular, with one link, so the stat
    that checks an existing file is not needed (the fchmod stays: the umask must not narrow
    0600 so far that the monitor cannot read it).  For the dump files every DataLoader worker
    makes as it starts: a process that has just forked pays a copy-on-write fault for each
    page the check's Python touches.  An existing file (a pid used again in the same run) is
    checked as ``open_private`` checks it."""
    try:
        fd = os.open(path, _NEW_APPEND, FILE_MODE)
    except FileExistsError:
        return open_private(path)
    try:
        os.fchmod(fd, FILE_MODE)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_private(path: str, flags: int = os.O_WRONLY | os.O_APPEND | os.O_CREAT) -> int:
    """Create ``path`` as :func:`create_private` does, or open the existing one when it is a private
    regular file of ours (O_NOFOLLOW: never through a link).  For files several processes append to."""
    if flags & os.O_CREAT:
        try:
            return create_private(path, flags & ~(os.O_CREAT | os.O_EXCL | os.O_TRUNC))
        except FileExistsError:
            pass
    fd = os.open(path, (flags & ~(os.O_CREAT | os.O_EXCL)) | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        _check_file(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_private(path: str, data: bytes | str, *, dir_fd: int | None = None) -> None:
    """A new private file holding ``data`` (text, redacted on the way out)."""
    fd = create_private(path, dir_fd=dir_fd)
    try:
        _write_all(fd, outbound_bytes(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def write_json(path: str, obj: Any) -> None:
    data = json.dumps(outbound(obj), indent=2, sort_keys=False) + "\n"
    fd = create_private(path)
    try:
        _write_all(fd, data.encode("utf-8", "surrogateescape"))
        os.fsync(fd)
    finally:
        os.close(fd)


_encode_str: Callable[[str], str] = json.encoder.encode_basestring_ascii
_FLOAT_FORMS = {float("inf"): "Infinity", float("-inf"): "-Infinity"}


class _NotPlain(Exception):
    pass


def _plain_json(obj: Any, out: list[str]) -> None:
    t = type(obj)
    if t is str:
        out.append(_encode_str(obj))
    elif obj is None:
        out.append("null")
    elif obj is True:
        out.append("true")
    elif obj is False:
        out.append("false")
    elif t is int:
        out.append(int.__repr__(obj))
    elif t is float:
        out.append(float.__repr__(obj) if obj == obj and obj not in _FLOAT_FORMS else _FLOAT_FORMS.get(obj, "NaN"))
    elif t is dict:
        if not obj:
            out.append("{}")
            return
        sep = "{"
        for k, v in obj.items():
            if type(k) is not str:
                raise _NotPlain
            out.append(sep)
            out.append(_encode_str(k))
            out.append(": ")
            _plain_json(v, out)
            sep = ", "
        out.append("}")
    elif t is list:
        if not obj:
            out.append("[]")
            return
        sep = "["
        for v in obj:
            out.append(sep)
            _plain_json(v, out)
            sep = ", "
        out.append("]")
    else:
        raise _NotPlain


def dumps(obj: Any) -> str:
    """``json.dumps(obj)``, the same text, for what ``outbound`` returns (str, numbers, None, dict, list).

    Written out here rather than by json's encoder: the encoder builds its state anew for every
    call and touches a hundred memory pages doing it, which in a process that has just forked
    (the training process as its DataLoader workers start, a worker itself) is a hundred
    copy-on-write faults, about 0.4 ms.  A value of another type (or a key that is not a str)
    goes to ``json.dumps`` whole.
    """
    out: list[str] = []
    try:
        _plain_json(obj, out)
    except (_NotPlain, RecursionError):
        return json.dumps(obj)
    return "".join(out)


def json_line(record: Any) -> bytes:
    """One redacted JSON line, for the append-only files (events, timeline)."""
    return (dumps(outbound(record)) + "\n").encode("utf-8", "surrogateescape")


def write_jsonl(path: str, records: Iterable[Any], *, dir_fd: int | None = None) -> None:
    fd = create_private(path, dir_fd=dir_fd)
    try:
        _write_all(fd, b"".join(json_line(r) for r in records))
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_private(name: str, data: bytes, *, dir_fd: int | None = None, fsync: bool = True) -> None:
    """Put ``data`` at ``name`` atomically: a new private file next to it, renamed over it.

    The temporary is made like every file here (``create_private``: a fresh random name,
    O_EXCL|O_NOFOLLOW, 0600), so nothing planted in advance is written through; rename(2)
    replaces whatever is at ``name`` (a link included: the link itself, never its target) and
    a reader sees the old or the new file, never a partial one.  On any failure the temporary
    is removed and the error raised.  ``dir_fd``: ``name`` is a name in that open directory
    (never re-resolved through a path).  ``data`` is written as given: callers redact it
    (``outbound_bytes``, ``json_line``).  ``fsync=False`` for files rewritten every few
    seconds whose loss in a crash costs nothing (rank figures, metrics): a sync on a busy
    disk would stall the monitor's loop.
    """
    head, base = os.path.split(name)
    tmp = os.path.join(head, f".{base}.tmp-{secrets.token_hex(4)}")
    fd = create_private(tmp, dir_fd=dir_fd)
    try:
        try:
            _write_all(fd, data)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except OSError:
            pass
        raise


def publish_private_dir(parent: str, name: str, fill: Callable[[str], None], *, tmp_prefix: str) -> str:
    """Create ``parent/name`` whole: ``fill`` writes into a fresh private directory that is then renamed.

    The staging directory is ``mkdtemp``'s (``tmp_prefix`` + ``name`` + random: listings skip the
    prefix), 0700 and checked.  rename(2) onto an existing non-empty directory fails (EEXIST or
    ENOTEMPTY), so nothing already published is overwritten; the caller picks another name.  On
    any failure the staging directory is removed and the error raised.  Returns the final path.
    """
    final = os.path.join(parent, name)
    tmp = tempfile.mkdtemp(prefix=tmp_prefix + name + "-", dir=parent)
    try:
        verify_created(tmp)
        fill(tmp)
        os.rename(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final
