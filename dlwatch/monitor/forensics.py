"""Hang forensics: sample /proc across a window, dump every stack, classify, and fill the report.

Shared by the monitor (a stall under watch) and ``dlwatch attach`` (a process
that is already stuck), so a stall report and an attach report hold the same
evidence in the same shape.  Order matters: /proc is read before py-spy
attaches, because a ptrace attach turns a sleeping poll into restart_syscall
and wakes every thread it stops (a context switch and a little CPU time that
would read as a sign of life).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

from dlwatch.collect import bounds, faultdump, procfs, stacks
from dlwatch.detect.classify import ProcessObservation, classify_stall
from dlwatch.model import Frame, ProcSample, StackDump, ThreadStack, TrackedProcess
from dlwatch.report.schema import Incident, ProcessEntry, Stack

# The window over which a process must show a sign of life (state R in any read, run
# delay, CPU time, a wake-up, bytes moved) not to count as stuck.  1 s: sixteen
# CPU-bound workers on two cores get ~1/8 core each, and some gain under 5 clock ticks
# in half a second; a thread that polls a lock or a queue with a 1 s timeout wakes
# inside it.  Read before the stack dumper attaches: an attach wakes a sleeping
# thread (a context switch, a little CPU) and turns its poll into restart_syscall.
SECOND_READ_AFTER_S = 1.0
WINDOW_READS = 5  # reads across the window, evenly spaced (state R is an instant's fact)
DUMP_TIMEOUT_S = 5.0


def _raw_copy(text: bytes) -> bytes:
    """The faulthandler text kept in the incident, cut at bounds.MAX_RAW_DUMP_BYTES with a line saying so."""
    if len(text) <= bounds.MAX_RAW_DUMP_BYTES:
        return text
    return (
        text[: bounds.MAX_RAW_DUMP_BYTES]
        + (f"\n[dlwatch: cut here: {len(text)} bytes read, the first {bounds.MAX_RAW_DUMP_BYTES} kept]\n").encode()
    )


def with_main_frames(
    dump: StackDump | None, pid: int, frames: Sequence[Mapping[str, Any]], omitted: int = 0
) -> StackDump:
    """``dump`` with its main thread's frames replaced by ``frames`` (added when the dump has none)."""
    stack = tuple(
        Frame(function=str(f.get("function")), filename=f.get("filename"), line=f.get("line")) for f in frames
    )
    cut = {"frames_omitted": omitted, "frames_omitted_after": len(stack) * 3 // 4 if omitted else None}
    threads = tuple(dump.threads) if dump is not None else ()
    main = next((i for i, t in enumerate(threads) if t.native_tid == pid), None)
    if main is None:
        main = next((i for i, t in enumerate(threads) if t.native_tid is None and t.name == "MainThread"), None)
    if main is None:
        threads = (ThreadStack(thread_id=None, name="MainThread", native_tid=pid, frames=stack, **cut), *threads)
    else:
        threads = (*threads[:main], dataclasses.replace(threads[main], frames=stack, **cut), *threads[main + 1 :])
    if dump is None or not dump.threads:
        return StackDump(pid=pid, source="traceback", threads=threads, error=dump.error if dump is not None else None)
    return dataclasses.replace(dump, threads=threads)


_EXITED = ("Z", "X", "x")  # /proc states of a process that has ended (a zombie waits for its parent)


def investigate(
    report: Incident,
    procs: Mapping[int, TrackedProcess],
    *,
    main_waiting_for_data: bool | None,
    expected_workers: int | None,
    native: bool = True,
    interval_s: float = SECOND_READ_AFTER_S,
    read_dump: Callable[[str], bytes | None] | None = None,
    allow: Callable[[int], bool] | None = None,
    uid: int | None = None,
    main_thread: tuple[int, Sequence[Mapping[str, Any]], int] | None = None,
    exited: Mapping[int, tuple[ProcSample, ProcSample]] | None = None,
    at_signal: Callable[[int], StackDump | None] | None = None,
) -> tuple[Incident, dict[str, bytes]]:
    """``report`` with ``classification``, ``processes[].status/waiting_in/cpu_progress_s/stack`` and notes.

    /proc is read ``WINDOW_READS`` times across ``interval_s``, each process's
    threads and sockets (``procfs.read_io``) at both ends, then the stacks.
    Returns it with the extra files for the incident directory (raw fallback dumps).  ``read_dump``
    and ``allow`` are for attach (see faultdump.request_dumps): dump files are then read
    through ``read_dump`` only, never emptied, and a pid is dumped only if ``allow(pid)``;
    ``uid`` is the target's: no process of another uid is signalled (default: our own).
    ``main_thread`` (pid, frames innermost first, frames left out): the main thread's stack as the
    process itself gave it (a Ctrl-C's traceback, see dlwatch.wire.interrupt), in place of the one
    the dumper sees now.  ``exited`` (pid -> two reads before the signal): for a process that is
    gone when the window opens or by its end (a worker that a Ctrl-C ended), the monitor's last
    reads of it before then; it is judged on those and on ``at_signal(pid)``, the stacks it wrote
    as the signal arrived, read once the window has closed (a worker the scheduler runs late may
    still be writing them when the training process reports the Ctrl-C).
    """
    notes: list[str] = []  # added to the report's, in the order found
    live = {
        pid: t for pid, t in procs.items() if (not t.gone or pid in (exited or {})) and (allow is None or allow(pid))
    }
    started = time.monotonic()
    before = {pid: procfs.read_proc(pid, sched_detail=True) for pid in live}
    # threads' syscalls and schedstat at both ends: a thread waiting on a socket that woke
    # in between got data (recv() bytes are not in /proc/<pid>/io)
    io_before = {pid: procfs.read_io(pid) for pid, s in before.items() if not s.gone}
    between: dict[int, list[ProcSample]] = {pid: [] for pid in live}
    steps = max(1, WINDOW_READS - 1)
    for i in range(1, steps):
        delay = started + interval_s * i / steps - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        for pid in live:
            if not before[pid].gone:
                between[pid].append(procfs.read_proc(pid, sched_detail=True))
    remaining = interval_s - (time.monotonic() - started)
    if remaining > 0:
        time.sleep(remaining)
    after = {pid: procfs.read_proc(pid, sched_detail=True) for pid in live}
    judged_before: dict[int, StackDump | None] = {}  # exited: judged on the monitor's reads before it
    for pid, (last_before, last) in (exited or {}).items():
        now, end = before.get(pid), after.get(pid)
        if now is None or end is None or last.gone:
            continue
        # gone when the window opened, or (still on its way out of the KeyboardInterrupt then) by its end:
        # either way the signal ended it, and what it did before is in the monitor's earlier reads
        gone_at_open = now.gone or now.state in _EXITED
        if gone_at_open or end.gone or end.state in _EXITED:
            before[pid], after[pid], between[pid] = last_before, last, []
            io_before.pop(pid, None)
            written = at_signal(pid) if at_signal is not None else None
            judged_before[pid] = written
            notes.append(
                f"pid {pid} had exited {'when the window opened' if gone_at_open else 'by the end of the window'}; "
                f"judged on the monitor's last reads before the interrupt ({last.ts - last_before.ts:.1f} s apart)"
                + ("" if written is None else " and the stacks it wrote as SIGINT arrived")
            )
    for pid, sample in after.items():  # (the ones judged above now end on a read before the signal)
        seen = [r for r in between[pid] if not r.gone]
        if sample.gone and not before[pid].gone and seen:
            # it ran while watched and exited before the window closed (the epoch ended, the
            # loader shut its workers down): judge it on what it did, and say so
            after[pid] = seen[-1]
            between[pid] = seen[:-1]
            notes.append(
                f"pid {pid} exited during the {interval_s:g} s observation window; judged on the reads before it exited"
            )
    io = {pid: procfs.read_io(pid) for pid, s in after.items() if not s.gone and pid not in judged_before}
    dumps = stacks.dump_stacks(
        [pid for pid, s in after.items() if not s.gone and pid not in judged_before],
        native=native,
        timeout_s=DUMP_TIMEOUT_S,
    )
    dumps.update({pid: d for pid, d in judged_before.items() if d is not None})
    extra: dict[str, bytes] = {}
    failed = {pid: d for pid, d in dumps.items() if d.source == "none" or not d.threads}
    if failed:
        fallback = {pid: live[pid].dump_path for pid in failed if live[pid].dump_path}
        if fallback:
            raw: dict[int, bytes] = {}
            got = faultdump.request_dumps(fallback, read=read_dump, allow=allow, raw=raw, uid=uid)  # type: ignore[arg-type]
            for pid, dump in got.items():
                if dump.threads:
                    why = failed[pid].error
                    dumps[pid] = dataclasses.replace(dump, error=why)
                    if pid in raw:  # the text that was parsed, not a second open of the file
                        extra[f"stacks/{pid}.txt"] = _raw_copy(raw[pid])
            refused = [f"pid {pid}: {d.error}" for pid, d in sorted(got.items()) if not d.threads and d.error]
            for why in refused[:3]:  # why a process got no signal (gone, another uid, a recycled pid) is evidence
                notes.append(f"faulthandler stacks missing for {why}")
        reasons = sorted({d.error for d in failed.values() if d.error})
        for reason in reasons[:3]:
            notes.append(f"py-spy stacks missing for {len(failed)} process(es): {reason}")
        if any(dumps[p].source == "faulthandler" for p in failed):
            notes.append("Python stacks of those processes come from faulthandler (no native frames, no thread names)")
    if main_thread is not None:
        pid, frames, omitted = main_thread
        dumps[pid] = with_main_frames(dumps.get(pid), pid, frames, omitted)
        notes.append(
            f"the main thread's stack of pid {pid} is where the KeyboardInterrupt landed (its traceback); "
            "the other threads' are the stack dumper's"
        )
    observations = [
        ProcessObservation(
            pid=pid,
            role=t.role,
            before=before[pid],
            after=after[pid],
            stack=dumps.get(pid),
            worker_id=t.worker_id,
            reads=tuple(between[pid]),
            io=io.get(pid),
            io_before=io_before.get(pid),
        )
        for pid, t in live.items()
    ]
    verdict = classify_stall(
        observations, main_waiting_for_data=main_waiting_for_data, expected_workers=expected_workers
    )
    by_pid = {v.pid: v for v in verdict.processes}

    def judged(entry: ProcessEntry) -> ProcessEntry:
        pid = entry.pid
        v = by_pid.get(pid) if pid is not None else None
        if v is not None:
            entry = entry.replace(
                status=v.status,
                waiting_in=v.waiting_in,
                cpu_progress_s=v.cpu_progress_s,
                where=v.where,
                alive_by=list(v.alive_by),
                io_wait=v.io_wait.to_dict() if v.io_wait is not None else None,
            )
        if pid in after and not after[pid].gone:
            # the last read before py-spy attached (an attach turns a sleeping poll into
            # restart_syscall), keeping the slow-cadence figures of the last poll
            slow = {
                k: val
                for k, val in (entry.sample or {}).items()
                if k in ("fds", "uss", "pss", "shm_maps", "shm_map_bytes")
            }
            sample = {k: val for k, val in after[pid].to_dict().items() if val is not None}
            sample.update(slow)
            entry = entry.replace(sample=sample)
        if pid in dumps:
            entry = entry.replace(stack=Stack.from_dict(dumps[pid].to_dict()))
        return entry

    report = report.with_notes(*notes).replace(
        classification=verdict.classification,
        classification_reason=verdict.reason,
        processes=tuple(judged(p) for p in report.processes or ()),
    )
    return report, extra
