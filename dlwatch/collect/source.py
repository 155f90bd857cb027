"""Read a program's own source files, named by its stacks, without trusting the names.

A stack frame's filename is whatever the target's code object says: a frame can name any
path on the machine (a root-only file, a device node, a 1 GiB file).  The lock-owner
judgement (:mod:`dlwatch.detect.lockowner`) needs only the *outline* of a source file: the
lock expression acquired on each ``with X:`` / ``X.acquire()`` line, and the regions where
each lock is held.  This module is the one place those files are read, and it reads them

- **with the target's rights, in a child**: :class:`SourceReader` forks a short-lived child
  that (when the reader runs as another uid: root's ``dlwatch attach``) takes the target's
  uid, gid and groups and makes itself non-dumpable before it opens anything, caps its own
  address space, reads and parses the files, and sends back only the outlines over a pipe;
  the parent checks what it sends, reads at most a fixed number of bytes and kills it when
  the time is up.  No parse tree of a target's file ever lives in the reader's process;
- **only a regular file owned by the target's uid** (as another uid; a reader running as
  the target's own uid also takes root's files, which it may read anyway).  The file is
  first opened ``O_PATH | O_NOFOLLOW`` (that opens nothing: no driver or FIFO sees it) and
  ``fstat``-ed: a link, a FIFO, a device node, a directory or another user's file is refused
  before anything is opened for reading.  The regular file is then reopened through that
  descriptor (``O_RDONLY | O_NONBLOCK | O_NOCTTY``), checked again to be the same inode, and
  read up to the cap;
- **within one budget** (:class:`SourceBudget`): at most so many files, bytes per file and in
  all, and seconds, for one reader.  One reader serves one judgement (one ``dlwatch attach``,
  one incident of the monitor) and keeps nothing after it: the outlines it returns are the
  caller's, and it keeps no cache.

:func:`outline` (pure: text in, outline out) is also what the child runs.
"""

from __future__ import annotations

import ast
import ctypes
import errno
import json
import os
import resource
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping

from dlwatch.collect.rundir import Creds, collect_child

__all__ = [
    "MAX_SOURCE_BYTES",
    "Creds",
    "Outline",
    "Region",
    "SourceBudget",
    "SourceReader",
    "creds_of",
    "open_source",
    "outline",
    "read_source",
    "text_outlines",
]

MAX_SOURCE_BYTES = 256 << 10  # one source file: a program's own module, not generated data
MAX_EXPR_CHARS = 200  # a lock expression as written ("self._cache_lock")
MAX_ENTRIES = 4096  # acquire sites and regions kept of one file
PR_SET_DUMPABLE = 4
_HEADER = struct.Struct("<Q")  # the child's answer: its length, then JSON


# --------------------------------------------------------------------------- the outline (pure)


@dataclass(frozen=True)
class Region:
    expr: str  # the lock expression, as written ("self.lock")
    start: int  # first line of the region (the with / acquire line)
    end: int  # last line of it


@dataclass(frozen=True)
class Outline:
    """What the lock-owner judgement needs of one file (and nothing else of it)."""

    sites: Mapping[int, str]  # line -> the lock expression acquired there (``with X:``, ``X.acquire()``)
    regions: tuple[Region, ...]  # every ``with X:`` body and ``X.acquire(); try: ... finally: X.release()``
    # names the module makes threading locks (``lock = threading.Lock()``, ``Lock()`` imported from
    # threading): each process's own copy, never a lock shared with the workers
    thread_locks: frozenset[str] = frozenset()

    def site(self, line: int) -> str | None:
        return self.sites.get(line)

    def to_json(self) -> dict[str, Any]:
        return {
            "sites": [[k, v] for k, v in self.sites.items()],
            "regions": [[r.expr, r.start, r.end] for r in self.regions],
            "thread_locks": sorted(self.thread_locks),
        }

    @classmethod
    def from_json(cls, data: Any) -> Outline | None:
        """An outline the child sent (the target's user may have tampered with it): checked, bounded."""
        if not isinstance(data, dict):
            return None
        sites: dict[int, str] = {}
        regions: list[Region] = []
        for item in (data.get("sites") or [])[:MAX_ENTRIES] if isinstance(data.get("sites"), list) else ():
            if _is_pair(item) and _is_line(item[0]) and isinstance(item[1], str):
                sites.setdefault(item[0], item[1][:MAX_EXPR_CHARS])
        for item in (data.get("regions") or [])[:MAX_ENTRIES] if isinstance(data.get("regions"), list) else ():
            if (
                isinstance(item, list)
                and len(item) == 3
                and isinstance(item[0], str)
                and _is_line(item[1])
                and _is_line(item[2])
            ):
                regions.append(Region(item[0][:MAX_EXPR_CHARS], item[1], item[2]))
        names = data.get("thread_locks") if isinstance(data.get("thread_locks"), list) else []
        locks = frozenset(n[:MAX_EXPR_CHARS] for n in names[:MAX_ENTRIES] if isinstance(n, str))
        return cls(sites, tuple(regions), locks)


def _is_pair(item: Any) -> bool:
    return isinstance(item, list) and len(item) == 2


def _is_line(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value < 1 << 31


def _lock_expr(node: ast.AST) -> str | None:
    try:
        text = ast.unparse(node)
    except Exception:
        return None
    return text if len(text) <= MAX_EXPR_CHARS else None


def _acquire_call(node: ast.AST) -> str | None:
    """``X`` of a statement ``X.acquire(...)``."""
    if isinstance(node, ast.Expr):
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "acquire":
        return _lock_expr(node.func.value)
    return None


def _release_in(stmts: Iterable[ast.stmt], expr: str) -> bool:
    for s in stmts:
        for n in ast.walk(s):
            if (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "release"
                and _lock_expr(n.func.value) == expr
            ):
                return True
    return False


def regions(tree: ast.AST) -> list[Region]:
    """Every ``with X:`` body and ``X.acquire(); try: ... finally: X.release()`` span in a module."""
    out: list[Region] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)):
            for item in node.items:
                expr = _lock_expr(item.context_expr)
                if expr:
                    out.append(Region(expr, node.lineno, node.end_lineno or node.lineno))
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for i, stmt in enumerate(body):
                expr = _acquire_call(stmt)
                if expr is None:
                    continue
                nxt = body[i + 1] if i + 1 < len(body) else None
                if isinstance(nxt, ast.Try) and _release_in(nxt.finalbody, expr):
                    out.append(Region(expr, stmt.lineno, nxt.end_lineno or nxt.lineno))
    return out


def _sites(tree: ast.AST) -> dict[int, str]:
    """line -> the lock expression acquired on it: the first ``with X:`` opening there or ``X.acquire()``
    call on it, in the order ``ast.walk`` meets them."""
    out: dict[int, str] = {}
    decided: set[int] = set()
    for node in ast.walk(tree):
        line = getattr(node, "lineno", None)
        if line is None or line in decided:
            continue
        if isinstance(node, (ast.With, ast.AsyncWith)):
            decided.add(line)
            expr = _lock_expr(node.items[0].context_expr) if node.items else None
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "acquire":
            decided.add(line)
            expr = _lock_expr(node.func.value)
        else:
            continue
        if expr is not None:
            out[line] = expr
    return out


_THREAD_LOCKS = ("threading.Lock", "threading.RLock", "threading.Semaphore", "threading.BoundedSemaphore")


def _thread_locks(tree: ast.AST) -> set[str]:
    """The names the module assigns a threading lock to (``lock = threading.Lock()``, or ``Lock()`` when
    imported from threading)."""
    from_threading = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "threading"
        for a in n.names
    }
    out: set[str] = set()
    for n in ast.walk(tree):
        if not isinstance(n, (ast.Assign, ast.AnnAssign)) or not isinstance(n.value, ast.Call):
            continue
        made_by = _lock_expr(n.value.func) or ""
        if made_by in _THREAD_LOCKS or made_by in from_threading:
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            out.update(e for e in (_lock_expr(tg) for tg in targets) if e)
    return out


def outline(text: str) -> Outline | None:
    """The outline of one module's source; None when it does not parse (or is too big to)."""
    try:
        tree = ast.parse(text)
        sites = _sites(tree)
        spans = regions(tree)
        locks = _thread_locks(tree)
    except (SyntaxError, ValueError, RecursionError, MemoryError, OverflowError):
        return None
    del tree
    return Outline(
        dict(list(sites.items())[:MAX_ENTRIES]), tuple(spans[:MAX_ENTRIES]), frozenset(sorted(locks)[:MAX_ENTRIES])
    )


def text_outlines(read: Callable[[str], str | None]) -> Callable[[str], Outline | None]:
    """Outlines parsed in this process from ``read``'s text: for tests and for source that is not a
    target's (a file this process wrote itself).  Each file is parsed once per returned function."""
    memo: dict[str, Outline | None] = {}

    def get(path: str) -> Outline | None:
        if path not in memo:
            text = read(path)
            memo[path] = outline(text) if text is not None else None
        return memo[path]

    return get


# --------------------------------------------------------------------------- opening one file


NOT_A_FILE = "not an absolute path"  # "<string>", "<frozen ...>": code without a file
MISSING = "no such file"
_QUIET = (NOT_A_FILE, MISSING)  # no file to speak of: not worth a line in the judgement's basis


class Refused(Exception):
    """A source file not read; the message says why (it goes into the judgement's basis)."""


class TooBig(Refused):
    """A source file larger than what may be read of it."""


def open_source(path: str, uid: int, *, allow_root: bool = False, cap: int = MAX_SOURCE_BYTES) -> bytes:
    """The bytes of ``path``: a regular file owned by ``uid`` (or root, with ``allow_root``) of at most
    ``cap`` bytes.  Refused (raised) for anything else, before anything is opened for reading."""
    if not path or not os.path.isabs(path) or "\0" in path:
        raise Refused(NOT_A_FILE)
    try:
        # O_PATH opens nothing: a FIFO, a device node or a socket is only looked at
        pfd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            raise Refused(MISSING) from None
        raise Refused(
            "a symbolic link (not followed)" if exc.errno == errno.ELOOP else exc.strerror or "unreadable"
        ) from None
    try:
        st = os.fstat(pfd)
        if stat.S_ISLNK(st.st_mode):  # O_PATH | O_NOFOLLOW gives the link itself
            raise Refused("a symbolic link (not followed)")
        if not stat.S_ISREG(st.st_mode):
            raise Refused("not a regular file (not opened)")
        if st.st_uid != uid and not (allow_root and st.st_uid == 0):
            raise Refused(f"owned by uid {st.st_uid}, not by the target's uid {uid} (not opened)")
        if st.st_size > cap:
            raise TooBig(f"{st.st_size} bytes, more than the {cap} read of a source file")
        try:
            fd = os.open(f"/proc/self/fd/{pfd}", os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
        except OSError as exc:
            raise Refused(exc.strerror or "unreadable") from None
    finally:
        os.close(pfd)
    try:
        again = os.fstat(fd)
        if (again.st_dev, again.st_ino) != (st.st_dev, st.st_ino) or not stat.S_ISREG(again.st_mode):
            raise Refused("changed while it was opened")
        chunks, total = [], 0
        while total <= cap:
            chunk = os.read(fd, min(1 << 16, cap + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
        if total > cap:
            raise TooBig(f"grew past the {cap} bytes read of a source file")
        return b"".join(chunks)
    except OSError as exc:
        raise Refused(exc.strerror or "unreadable") from None
    finally:
        os.close(fd)


def read_source(path: str, uid: int | None = None) -> str | None:
    """The text of ``path`` read in this process (:func:`open_source`'s checks, for ``uid`` or this
    process's own: then root's files too), or None.  For readers of their own files: a reader for a
    target's is :class:`SourceReader`."""
    own = os.geteuid() if uid is None else uid
    try:
        data = open_source(path, own, allow_root=own == os.geteuid())
    except Refused:
        return None
    return data.decode("utf-8", "replace")


# --------------------------------------------------------------------------- the reader


@dataclass(frozen=True)
class SourceBudget:
    """What one reader may spend in all (one ``dlwatch attach``, one incident)."""

    files: int = 8
    file_bytes: int = MAX_SOURCE_BYTES
    total_bytes: int = 1 << 20
    seconds: float = 5.0
    parse_memory_bytes: int = 256 << 20  # address space the child may add to parse what it read
    answer_bytes: int = 4 << 20  # the outlines sent back


def _prctl() -> Any:
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def _vm_size() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _child_work(
    paths: list[str], uid: int, allow_root: bool, budget: SourceBudget, started: float, spent: int
) -> dict[str, Any]:
    """In the child, with the target's rights: each file's outline and size, or why it was not read
    (``spent``: the bytes earlier calls of the same reader read)."""
    out: dict[str, Any] = {}
    for path in paths:
        if time.monotonic() - started > budget.seconds:
            out[path] = {"refused": f"not read: the source budget's {budget.seconds:g} s were spent"}
            continue
        left = budget.total_bytes - spent
        spent_why = f"not read: the source budget's {budget.total_bytes} bytes were spent"
        if left <= 0:
            out[path] = {"refused": spent_why}
            continue
        try:
            data = open_source(path, uid, allow_root=allow_root, cap=min(budget.file_bytes, left))
        except TooBig as exc:
            out[path] = {"refused": spent_why if left < budget.file_bytes else str(exc)}
            continue
        except Refused as exc:
            out[path] = {"refused": str(exc)}
            continue
        spent += len(data)
        got = outline(data.decode("utf-8", "replace"))
        answer = got.to_json() if got is not None else {"refused": "does not parse (or not within the memory limit)"}
        out[path] = {**answer, "bytes": len(data)}
        del data
    return out


@dataclass
class SourceReader:
    """Outlines of a target's source files, read with its rights in a child (see the module docstring).

    ``creds``: the target's uid, gid and groups (None: this process's own).  One reader is one
    budget: :meth:`outlines` may be called more than once, and stops when the budget is spent.
    """

    creds: Creds | None = None
    budget: SourceBudget = field(default_factory=SourceBudget)
    disabled: str | None = None  # why nothing may be read at all (the target's uid is unknown)
    refusals: dict[str, str] = field(default_factory=dict)  # path -> why it gave no outline
    files_read: int = 0
    bytes_read: int = 0
    seconds_spent: float = 0.0

    @property
    def uid(self) -> int:
        return os.geteuid() if self.creds is None else self.creds.uid

    @property
    def privileged(self) -> bool:
        return self.uid != os.geteuid()

    def outlines(self, paths: Iterable[str]) -> dict[str, Outline | None]:
        """``{path: Outline or None}`` for each path (None: not read; ``refusals`` says why)."""
        wanted = [p for p in dict.fromkeys(paths) if isinstance(p, str)]
        out: dict[str, Outline | None] = {p: None for p in wanted}
        if self.disabled is not None:
            self.refusals.update({p: self.disabled for p in wanted})
            return out
        room = self.budget.files - self.files_read
        left_s = self.budget.seconds - self.seconds_spent
        for p in wanted[max(room, 0) :]:
            self.refusals[p] = f"not read: the source budget of {self.budget.files} files was spent"
        wanted = wanted[: max(room, 0)]
        if not wanted:
            return out
        if left_s <= 0:
            for p in wanted:
                self.refusals[p] = f"not read: the source budget of {self.budget.seconds:g} s was spent"
            return out
        self.files_read += len(wanted)
        t0 = time.monotonic()
        try:
            answer = self._in_child(wanted, left_s)
        except OSError as exc:  # no pipe or no fork (EMFILE, EAGAIN): nothing read, never raised
            answer = {p: {"refused": f"not read: the reader could not start ({exc.strerror or exc})"} for p in wanted}
        finally:
            self.seconds_spent += time.monotonic() - t0
        for p in wanted:
            got = answer.get(p) if isinstance(answer, dict) else None
            size = got.get("bytes") if isinstance(got, dict) else None
            if _is_line(size) or size == 0:  # (the child's count: bounded by what it may read)
                self.bytes_read += min(int(size), self.budget.file_bytes)  # type: ignore[arg-type]
            if isinstance(got, dict) and "refused" not in got:
                out[p] = Outline.from_json(got)
            if out[p] is None:
                why = got.get("refused") if isinstance(got, dict) else None
                self.refusals[p] = str(why)[:200] if isinstance(why, str) else "not read (the reader gave no answer)"
        return out

    def _in_child(self, paths: list[str], left_s: float) -> Any:
        creds = self.creds
        privileged = self.privileged
        uid = self.uid
        budget = self.budget
        spent = self.bytes_read
        prctl = _prctl() if privileged else None  # resolved before the fork: the child loads nothing
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: drop to the target's rights, cap memory, read, parse, answer, exit
            code = 0
            try:
                os.close(rfd)
                started = time.monotonic()
                if privileged and creds is not None:
                    if prctl is not None:  # not traceable by the target's user once it has their uid
                        prctl(PR_SET_DUMPABLE, 0, 0, 0, 0)
                    os.setgroups(list(creds.groups))
                    os.setresgid(creds.gid, creds.gid, creds.gid)
                    os.setresuid(creds.uid, creds.uid, creds.uid)
                    if os.geteuid() != creds.uid or os.getegid() != creds.gid:
                        os._exit(4)
                limit = _vm_size() + budget.parse_memory_bytes
                try:
                    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
                except (ValueError, OSError):
                    pass
                work = _child_work(paths, uid, not privileged, budget, started, spent)
                body = json.dumps(work).encode()
                view = memoryview(_HEADER.pack(len(body)) + body)
                while view:
                    view = view[os.write(wfd, view) :]
            except BaseException:
                code = 1
            os._exit(code)
        os.close(wfd)
        try:
            raw = collect_child(rfd, pid, budget.answer_bytes + _HEADER.size, max(left_s, 0.05))
        finally:
            os.close(rfd)
        if len(raw) < _HEADER.size:
            return {p: {"refused": f"not read: the reader did not answer within {left_s:.1f} s"} for p in paths}
        (length,) = _HEADER.unpack_from(raw, 0)
        if length != len(raw) - _HEADER.size:
            return {p: {"refused": "not read: the reader's answer was cut or malformed"} for p in paths}
        try:
            return json.loads(raw[_HEADER.size :])
        except (ValueError, RecursionError):
            return {}

    def basis(self) -> str | None:
        """One line on the files that gave no outline, for the judgement's basis; None when all did."""
        told = [(p, why) for p, why in self.refusals.items() if why not in _QUIET]
        if not told:
            return None
        shown = "; ".join(f"{os.path.basename(p)}: {why}" for p, why in told[:3])
        more = f" (and {len(told) - 3} more)" if len(told) > 3 else ""
        return f"source not read: {shown}{more}"


def creds_of(pid: int) -> Creds | None:
    """The target's credentials to read its files with: None when unreadable or when its real,
    effective, saved and filesystem uids (or gids) differ (a setuid program: whose files are those?)."""
    uids = gids = None
    groups: tuple[int, ...] = ()
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                key, _, value = line.decode("ascii", "replace").partition(":")
                if key == "Uid":
                    uids = [int(v) for v in value.split()]
                elif key == "Gid":
                    gids = [int(v) for v in value.split()]
                elif key == "Groups":
                    groups = tuple(int(g) for g in value.split())
    except (OSError, ValueError):
        return None
    if not uids or not gids or len(set(uids)) != 1 or len(set(gids)) != 1:
        return None
    return Creds(uids[0], gids[0], groups)
