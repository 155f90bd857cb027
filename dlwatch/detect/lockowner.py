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
never named; with no thread in a region, or two, the holder is ``unknown``.  Pure: what it
needs of a source file comes as its *outline* (:mod:`dlwatch.collect.source`: the acquire sites
and lock regions, read with the target's rights and within a budget), never as the file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from dlwatch.collect.source import Outline, Region, regions

__all__ = ["Holder", "Outlines", "Region", "acquire_site", "find_holder", "held_in_stack", "regions"]

_WRAPPERS = {"acquire", "__enter__", "lock", "_acquire", "_lock"}

# the outline of a source file by its path (dlwatch.collect.source): None when it was not read
Outlines = Callable[[str], "Outline | None"]


@dataclass(frozen=True)
class Holder:
    name: str
    function: str
    filename: str
    line: int
    lock: str  # the lock expression
    region_line: int  # where the region opens
    idle: str | None  # what it was waiting on inside the region, if anything


MAX_SITE_FRAMES = 8  # frames of a worker's stack looked at for its acquire site, innermost first


def site_files(frames: Sequence[Mapping[str, Any]]) -> list[str]:
    """The files :func:`acquire_site` may need the outline of, innermost first."""
    return list(dict.fromkeys(str(f["filename"]) for f in _python_frames(frames)[:MAX_SITE_FRAMES]))


def _python_frames(frames: Sequence[Mapping[str, Any]]) -> list[Mapping[str, Any]]:
    return [
        f
        for f in frames
        if f.get("filename") and isinstance(f.get("line"), int) and not isinstance(f["line"], bool) and f["line"] > 0
    ]


def acquire_site(frames: Sequence[Mapping[str, Any]], outlines: Outlines) -> dict[str, Any] | None:
    """{"expr", "exprs", "filename", "line", "function"} of the lock a worker waits on, from its stack
    (innermost frame first; native frames skipped); None when no frame shows it."""
    py = _python_frames(frames)
    for i, f in enumerate(py[:MAX_SITE_FRAMES]):
        got = outlines(str(f["filename"]))
        if got is None:
            continue
        expr = got.site(int(f["line"]))
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
            outer = acquire_site(py[i + 1 :], outlines)
            if outer is not None and outer["filename"] == f["filename"]:
                site["exprs"] = [expr, *[e for e in outer["exprs"] if e != expr]]
                site["caller"] = {"line": outer["line"], "function": outer["function"]}
        return site
    return None


def find_holder(
    site: Mapping[str, Any] | None, threads: Sequence[Mapping[str, Any]], outlines: Outlines
) -> dict[str, Any]:
    """{"holder": Holder-as-dict or None, "candidates": [...], "alive": [...], "basis": str}.

    ``threads``: one fork's record (name, frames innermost first, idle)."""
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
    got = outlines(str(path))
    spans = [r for r in got.regions if r.expr in exprs] if got is not None else []
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


def held_in_stack(
    site: Mapping[str, Any], frames: Sequence[Mapping[str, Any]], outlines: Outlines
) -> dict[str, Any] | None:
    """The frame of a live stack (innermost first) that sits inside a region of the lock the workers wait
    on, or None: {"function", "filename", "line", "lock", "region_line"}.

    For a lock shared across processes (a ``multiprocessing`` lock handed to the dataset), the program
    writes it under two names: ``self.lock`` where the workers take it, ``ds.lock`` or ``lock`` where
    the training process does.  A region matches when its expression is the workers' own or ends in
    the same name, unless the module makes that name a threading lock (each process's own: never
    the one the workers share); the caller says which frames are the program's."""
    names = {_last_name(e) for e in (site.get("exprs") or (site.get("expr"),)) if e}
    for f in frames:
        if not isinstance(f.get("line"), int) or not f.get("filename"):
            continue
        got = outlines(str(f["filename"]))
        if got is None:
            continue
        inside = [
            r
            for r in got.regions
            if _last_name(r.expr) in names and r.start <= f["line"] <= r.end and r.expr not in got.thread_locks
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
