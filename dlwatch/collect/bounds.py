"""Bounds on the stack evidence taken from one process, and the trimming that keeps to them.

A target decides how deep its stacks are, how many threads it runs, how long its names are
and, for the faulthandler fallback, what it writes into its dump file.  `dlwatch attach` runs
as root next to other users' jobs, and a stall report is written by the monitor inside the
job's memory budget: neither may do work or keep evidence in proportion to what a target
chooses.  So every dump is read up to a byte cap and trimmed to these limits as it is parsed
(``trim_thread``/``trim_dump``), and the trimmed dump says what it left out:
``ThreadStack.frames_omitted`` (frames taken out of the middle: the innermost
``MAX_FRAMES_PER_THREAD - KEEP_OUTERMOST`` and the outermost ``KEEP_OUTERMOST`` stay, so both
where it waits and how it got there are seen), ``StackDump.threads_omitted`` and
``StackDump.cut_at_bytes``.

Measured here (py-spy 0.4.3): a worker recursing 4,000 frames deep gives ~0.75 MB of report
JSON untrimmed, ~40 KB trimmed; py-spy itself fails at ~15,000 frames.  faulthandler writes at
most 100 frames per thread and 100 threads (CPython's own limits), so an honest dump file stays
far below ``MAX_DUMP_READ_BYTES``.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Iterable, Sequence

from dlwatch.model import Frame, StackDump, ThreadStack

__all__ = [
    "KEEP_OUTERMOST",
    "MAX_DUMP_BYTES_PER_PROCESS",
    "MAX_DUMP_READ_BYTES",
    "MAX_FRAMES_PER_THREAD",
    "MAX_NAME_CHARS",
    "MAX_PATH_CHARS",
    "MAX_PY_SPY_MEMORY_BYTES",
    "MAX_PY_SPY_OUTPUT_BYTES",
    "MAX_RAW_DUMP_BYTES",
    "MAX_THREADS_PER_PROCESS",
    "limits",
    "trim_dump",
    "trim_frames",
    "trim_thread",
]

MAX_FRAMES_PER_THREAD = 200
KEEP_OUTERMOST = 50  # of those: the entry points (main, _worker_loop, the dataset's __getitem__ ...)
MAX_THREADS_PER_PROCESS = 64
MAX_NAME_CHARS = 512  # a function or thread name (faulthandler itself cuts at 500)
MAX_PATH_CHARS = 4096  # a file name (PATH_MAX)
MAX_PY_SPY_OUTPUT_BYTES = 4 << 20  # py-spy's JSON for one process: 4,000 frames are ~1 MB
# py-spy's own heap (RLIMIT_DATA: its private writable memory, not the target's libraries it maps
# for --native, 440 MB of address space for a torch process): py-spy builds its whole answer before
# writing any of it, and an honest dump needs a few MB
MAX_PY_SPY_MEMORY_BYTES = 256 << 20
MAX_DUMP_READ_BYTES = 1 << 20  # one read of a faulthandler dump file
MAX_DUMP_BYTES_PER_PROCESS = 4 << 20  # every read of one process's dump file, in one request
MAX_RAW_DUMP_BYTES = 256 << 10  # the copy of a faulthandler dump kept in the incident (stacks/<pid>.txt)


def limits() -> dict[str, int]:
    """The limits as report.json's ``truncated.limits`` states them."""
    return {
        "frames_per_thread": MAX_FRAMES_PER_THREAD,
        "outermost_frames_kept": KEEP_OUTERMOST,
        "threads_per_process": MAX_THREADS_PER_PROCESS,
        "name_chars": MAX_NAME_CHARS,
        "path_chars": MAX_PATH_CHARS,
        "py_spy_output_bytes": MAX_PY_SPY_OUTPUT_BYTES,
        "py_spy_memory_bytes": MAX_PY_SPY_MEMORY_BYTES,
        "dump_read_bytes": MAX_DUMP_READ_BYTES,
        "dump_bytes_per_process": MAX_DUMP_BYTES_PER_PROCESS,
        "raw_dump_bytes": MAX_RAW_DUMP_BYTES,
    }


def _cut(text: str | None, cap: int) -> str | None:
    if text is None or len(text) <= cap:
        return text
    return text[: cap - 1] + "\u2026"


def _frame(f: Frame) -> Frame:
    if len(f.function) <= MAX_NAME_CHARS and (f.filename is None or len(f.filename) <= MAX_PATH_CHARS):
        return f
    return replace(f, function=_cut(f.function, MAX_NAME_CHARS) or "", filename=_cut(f.filename, MAX_PATH_CHARS))


def trim_frames(
    frames: Sequence[Frame], keep: int = MAX_FRAMES_PER_THREAD, outer: int = KEEP_OUTERMOST
) -> tuple[tuple[Frame, ...], int]:
    """(kept frames, how many were left out of the middle); frames are innermost first."""
    if len(frames) <= keep:
        return tuple(_frame(f) for f in frames), 0
    outer = min(outer, keep // 2)
    inner = keep - outer
    kept = list(frames[:inner]) + (list(frames[len(frames) - outer :]) if outer else [])
    return tuple(_frame(f) for f in kept), len(frames) - keep


def trim_thread(t: ThreadStack, keep: int = MAX_FRAMES_PER_THREAD, outer: int = KEEP_OUTERMOST) -> ThreadStack:
    """The thread with at most ``keep`` frames (the rest counted in ``frames_omitted``) and bounded names."""
    frames, omitted = trim_frames(t.frames, keep, outer)
    name = _cut(t.name, MAX_NAME_CHARS)
    if not omitted and frames == t.frames and name == t.name:
        return t
    total = t.frames_omitted + omitted
    after = t.frames_omitted_after
    if omitted:  # the gap is right after the innermost frames kept (an earlier gap is inside the one made now)
        after = len(frames) - min(outer, keep // 2)
    return replace(t, name=name, frames=frames, frames_omitted=total, frames_omitted_after=after if total else None)


def _rank(t: ThreadStack) -> int:
    return 0 if t.owns_gil else 1 if t.active else 2


def trim_threads(
    threads: Iterable[ThreadStack], keep: int = MAX_THREADS_PER_PROCESS
) -> tuple[tuple[ThreadStack, ...], int]:
    """(at most ``keep`` threads in their order, preferring the GIL holder and active ones; how many were left out)."""
    threads = tuple(threads)
    if len(threads) <= keep:
        return threads, 0
    chosen = set(sorted(range(len(threads)), key=lambda i: (_rank(threads[i]), i))[:keep])
    return tuple(t for i, t in enumerate(threads) if i in chosen), len(threads) - keep


def trim_dump(d: StackDump, *, cut_at_bytes: int | None = None) -> StackDump:
    """``d`` within the limits; ``cut_at_bytes``: its input was cut there (the read cap was reached)."""
    threads, omitted = trim_threads(d.threads)
    threads = tuple(trim_thread(t) for t in threads)
    cut = cut_at_bytes if cut_at_bytes is not None else d.cut_at_bytes
    if not omitted and threads == d.threads and cut == d.cut_at_bytes:
        return d
    return replace(d, threads=threads, threads_omitted=d.threads_omitted + omitted, cut_at_bytes=cut)
