"""Which thread of the training process held the lock the deadlocked workers wait on.

The record (:mod:`dlwatch.inproc.forkthreads`) says where every other thread of the
training process was at each worker's fork: name, innermost Python frames, and whether it
was idle (waiting on an Event, a Condition, a queue).  The workers' stacks say where they
wait: the *acquire site*, the innermost frame of the program's code, a ``with X:`` line or
an ``X.acquire()`` call (a wrapper such as ``def acquire(self): self.lock.acquire()`` is
looked through to its caller).

A thread is named as the holder only on evidence: one of its frames at the fork sat inside
a region of *the same lock expression in the same file*: the body of ``with X:``, or
between ``X.acquire()`` and the ``X.release()`` of its ``try/finally``.  A thread idle at
the fork *inside* such a region still held the lock (the seed's refresher waits on an Event
inside ``with self.lock``).  Threads that were elsewhere are listed as alive at the fork,
never named; with no thread in a region, or two, the holder is ``unknown``.  Pure: the
source text comes through ``read_source``.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

__all__ = ["Holder", "acquire_site", "find_holder", "held_in_stack"]

_WRAPPERS = {"acquire", "__enter__", "lock", "_acquire", "_lock"}


@dataclass(frozen=True)
class Region:
    expr: str  # the lock expression, as written ("self.lock")
    start: int  # first line of the region (the with / acquire line)
    end: int  # last line of it


@dataclass(frozen=True)
class Holder:
    name: str
    function: str
    filename: str
    line: int
    lock: str  # the lock expression
    region_line: int  # where the region opens
    idle: str | None  # what it was waiting on inside the region, if anything


def _lock_expr(node: ast.AST) -> str | None:
    try:
        return ast.unparse(node)
    except Exception:
        return None


def _acquire_call(node: ast.AST) -> str | None:
    """``X`` of a statement ``X.acquire(...)``."""
    if isinstance(node, ast.Expr):
        node = node.value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "acquire":
        return _lock_expr(node.func.value)
    return None


def _release_in(stmts: Sequence[ast.stmt], expr: str) -> bool:
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


def _site_expr(tree: ast.AST, line: int) -> str | None:
    """The lock expression acquired on ``line``: ``with X:`` opening there, or ``X.acquire()`` on it."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.With, ast.AsyncWith)) and node.lineno == line:
            return _lock_expr(node.items[0].context_expr) if node.items else None
        if isinstance(node, ast.Call) and getattr(node, "lineno", None) == line:
            if isinstance(node.func, ast.Attribute) and node.func.attr == "acquire":
                return _lock_expr(node.func.value)
    return None


def _parse(path: str, read_source: Callable[[str], str | None], cache: dict[str, Any]) -> ast.AST | None:
    if path not in cache:
        text = read_source(path)
        try:
            cache[path] = ast.parse(text) if text is not None else None
        except (SyntaxError, ValueError, RecursionError, MemoryError):
            cache[path] = None
    return cache[path]


def acquire_site(
    frames: Sequence[Mapping[str, Any]], read_source: Callable[[str], str | None], cache: dict[str, Any] | None = None
) -> dict[str, Any] | None:
    """{"expr", "exprs", "filename", "line", "function"} of the lock a worker waits on, from its stack
    (innermost frame first; native frames skipped); None when no frame shows it."""
    cache = {} if cache is None else cache
    py = [f for f in frames if f.get("filename") and isinstance(f.get("line"), int) and f["line"] > 0]
    for i, f in enumerate(py[:8]):
        tree = _parse(str(f["filename"]), read_source, cache)
        if tree is None:
            continue
        expr = _site_expr(tree, int(f["line"]))
        if expr is None:
            continue
        site = {
            "expr": expr,
            "exprs": [expr],
            "filename": f["filename"],
            "line": f["line"],
            "function": f.get("function"),
        }
        if str(f.get("function") or "").rsplit(".", 1)[-1] in _WRAPPERS and i + 1 < len(py):
            # a wrapper (``def acquire(self): self._lock.acquire()``): its caller's ``self.acquire()``
            # takes the same lock; a holder may be inside a region of either expression
            outer = acquire_site(py[i + 1 :], read_source, cache)
            if outer is not None and outer["filename"] == f["filename"]:
                site["exprs"] = [expr, *[e for e in outer["exprs"] if e != expr]]
                site["caller"] = {"line": outer["line"], "function": outer["function"]}
        return site
    return None


def find_holder(
    site: Mapping[str, Any] | None,
    threads: Sequence[Mapping[str, Any]],
    read_source: Callable[[str], str | None],
    cache: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """{"holder": Holder-as-dict or None, "candidates": [...], "alive": [...], "basis": str}.

    ``threads``: one fork's record (name, frames innermost first, idle)."""
    cache = {} if cache is None else cache
    alive = [
        {
            "name": t.get("name"),
            "where": _where(t.get("frames") or ()),
            "idle": t.get("idle"),
        }
        for t in threads
    ]
    if site is None:
        return {"holder": None, "candidates": [], "alive": alive, "basis": "the workers' wait shows no lock site"}
    expr, path = site["expr"], site["filename"]
    exprs = set(site.get("exprs") or (expr,))
    tree = _parse(str(path), read_source, cache)
    spans = [r for r in regions(tree) if r.expr in exprs] if tree is not None else []
    found: list[Holder] = []
    for t in threads:
        for f in t.get("frames") or ():
            if f.get("filename") != path or not isinstance(f.get("line"), int):
                continue
            inside = [r for r in spans if r.start <= f["line"] <= r.end]
            if inside:
                r = max(inside, key=lambda r: r.start)  # the innermost region
                found.append(
                    Holder(
                        name=str(t.get("name")),
                        function=str(f.get("function")),
                        filename=str(path),
                        line=int(f["line"]),
                        lock=r.expr,
                        region_line=r.start,
                        idle=t.get("idle"),
                    )
                )
                break
    if len(found) == 1:
        return {"holder": found[0].__dict__, "candidates": [], "alive": alive, "basis": "inside the lock's region"}
    basis = (
        f"{len(found)} threads were inside a region of {expr}"
        if found
        else f"no thread was inside a region of {expr} at the fork"
    )
    return {"holder": None, "candidates": [h.__dict__ for h in found], "alive": alive, "basis": basis}


def _last_name(expr: str) -> str:
    """The name a lock expression ends in: ``lock`` of ``self.lock``, ``ds.lock`` and ``lock``."""
    return expr.rsplit(".", 1)[-1].strip()


_THREAD_LOCKS = ("threading.Lock", "threading.RLock", "threading.Semaphore", "threading.BoundedSemaphore")


def _thread_lock(tree: ast.AST, expr: str) -> bool:
    """Whether the module makes ``expr`` a threading lock (``lock = threading.Lock()``, or ``Lock()``
    imported from threading): a lock each process has its own copy of, never the workers' shared one."""
    from_threading = {
        a.asname or a.name
        for n in ast.walk(tree)
        if isinstance(n, ast.ImportFrom) and n.module == "threading"
        for a in n.names
    }
    for n in ast.walk(tree):
        if not isinstance(n, (ast.Assign, ast.AnnAssign)) or not isinstance(n.value, ast.Call):
            continue
        targets = n.targets if isinstance(n, ast.Assign) else [n.target]
        if not any(_lock_expr(tg) == expr for tg in targets):
            continue
        made_by = _lock_expr(n.value.func) or ""
        if made_by in _THREAD_LOCKS or made_by in from_threading:
            return True
    return False


def held_in_stack(
    site: Mapping[str, Any],
    frames: Sequence[Mapping[str, Any]],
    read_source: Callable[[str], str | None],
    cache: dict[str, Any] | None = None,
) -> dict[str, Any] | None:
    """The frame of a live stack (innermost first) that sits inside a region of the lock the workers wait
    on, or None: {"function", "filename", "line", "lock", "region_line"}.

    For a lock shared across processes (a ``multiprocessing`` lock handed to the dataset), the program
    writes it under two names: ``self.lock`` where the workers take it, ``ds.lock`` or ``lock`` where
    the training process does.  A region matches when its expression is the workers' own or ends in
    the same name, unless the module makes that name a threading lock (each process's own: never
    the one the workers share); the caller says which frames are the program's."""
    cache = {} if cache is None else cache
    names = {_last_name(e) for e in (site.get("exprs") or (site.get("expr"),)) if e}
    for f in frames:
        if not isinstance(f.get("line"), int) or not f.get("filename"):
            continue
        tree = _parse(str(f["filename"]), read_source, cache)
        if tree is None:
            continue
        inside = [
            r
            for r in regions(tree)
            if _last_name(r.expr) in names and r.start <= f["line"] <= r.end and not _thread_lock(tree, r.expr)
        ]
        if inside:
            r = max(inside, key=lambda r: r.start)
            return {
                "function": f.get("function"),
                "filename": f["filename"],
                "line": f["line"],
                "lock": r.expr,
                "region_line": r.start,
            }
    return None


_PLUMBING = ("/threading.py", "/queue.py", "/selectors.py", "/socket.py", "/multiprocessing/connection.py")


def _where(frames: Sequence[Mapping[str, Any]]) -> str | None:
    """The innermost frame outside the waiting machinery (threading, queue, selectors), else the innermost."""
    named = [f for f in frames if f.get("filename")]
    own = next((f for f in named if not str(f["filename"]).endswith(_PLUMBING)), None)
    f = own or (named[0] if named else None)
    if f is None:
        return None
    return f"{f.get('function')} ({str(f['filename']).rsplit('/', 1)[-1]}:{f.get('line')})"
