"""Renderers: report data in, text out.  They never probe the system.

``markdown_lines`` is for report.md (people on a ticket); ``terminal_lines`` is
the shorter view of ``dlwatch report ID``; ``list_lines`` the incident table.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Iterator, Mapping, Sequence, TextIO

# C0 controls (ESC among them), DEL, C1 controls, and the bidirectional overrides that
# reorder what a terminal shows: a report's text comes from the training program and
# must not drive the terminal of whoever reads it.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_BACKTICKS = re.compile("`+")


def terminal_safe(text: Any) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``), so it prints as text."""
    text = str(text)
    return _UNSAFE.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100
                       else f"\\u{ord(m.group()):04x}", text)


def fence(text: str) -> str:
    """A Markdown code fence longer than any run of backticks in ``text`` (at least three)."""
    longest = max((len(m.group()) for m in _BACKTICKS.finditer(text)), default=0)
    return "`" * max(3, longest + 1)


def code(value: Any) -> str:
    """``value`` as Markdown inline code on one line, whatever backticks it holds."""
    text = " ".join(str(value).splitlines())
    ticks = "`" * (max((len(m.group()) for m in _BACKTICKS.finditer(text)), default=0) + 1)
    pad = " " if text.startswith("`") or text.endswith("`") else ""
    return f"{ticks}{pad}{text}{pad}{ticks}"


def _one_line(value: Any) -> str:
    return " ".join(str(value).splitlines())


def _fenced(lines: Iterable[str]) -> Iterator[str]:
    lines = list(lines)
    mark = fence("\n".join(lines))
    yield mark
    yield from lines
    yield mark


def human_bytes(n: Any) -> str:
    if not isinstance(n, (int, float)):
        return "?"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _proc_line(p: Mapping[str, Any]) -> str:
    s = p.get("sample") or {}
    who = str(p.get("role") or "?") + (f" {p['worker_id']}" if p.get("worker_id") is not None else "")
    parts = [f"pid {p.get('pid')} ({who})"]
    if p.get("status"):
        parts.append(str(p["status"]) + (f" in {p['waiting_in']}" if p.get("waiting_in") else ""))
    if s.get("gone"):
        parts.append("gone")
    else:
        parts.append(f"state {_fmt(s.get('state'))}")
        parts.append(f"fds {_fmt(s.get('num_fds'))}/{_fmt(s.get('fd_limit'))}")
        parts.append(f"rss {human_bytes(s.get('rss'))}")
        if s.get("uss") is not None:
            parts.append(f"uss {human_bytes(s.get('uss'))}")
        parts.append(f"cpu {_fmt(s.get('cpu_s'))} s")
        if s.get("syscall") not in (None, -1):
            parts.append(f"syscall {s.get('syscall')}")
    return ", ".join(parts)


def _threads_main_first(stack: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    threads = list(stack.get("threads") or ())
    return sorted(threads, key=lambda t: t.get("name") != "MainThread")


def _frame_line(f: Mapping[str, Any]) -> str:
    if f.get("filename") and f.get("line") is not None:
        return f"{f.get('function')} ({f.get('filename')}:{f.get('line')})"
    if f.get("filename"):
        return f"{f.get('function')} ({os.path.basename(str(f['filename']))})"
    return str(f.get("function"))


def _stack_lines(stack: Mapping[str, Any] | None, *, max_frames: int = 12, python_only: bool = False,
                 max_threads: int = 64) -> Iterator[str]:
    if not stack:
        return
    if stack.get("error") and not stack.get("threads"):
        yield f"    (no stack: {stack['error']})"
        return
    for t in _threads_main_first(stack)[:max_threads]:
        label = t.get("name") or t.get("thread_id")
        yield f"    thread {label}" + (" [GIL]" if t.get("owns_gil") else "") + ":"
        frames = [f for f in t.get("frames") or () if not (python_only and f.get("native"))]
        for f in frames[:max_frames]:
            yield f"      {_frame_line(f)}"
        if len(frames) > max_frames:
            yield f"      ... {len(frames) - max_frames} more frames"


def markdown_lines(r: Mapping[str, Any]) -> Iterator[str]:
    yield f"# dlwatch incident {r.get('id')}"
    yield ""
    yield f"**{_one_line(r.get('summary') or r.get('trigger'))}**"
    yield ""
    rank = r.get("rank") or {}
    rank_txt = "" if rank.get("rank") is None else f", rank {rank.get('rank')}/{rank.get('world_size')}"
    yield f"- trigger: {code(r.get('trigger'))}; created {r.get('created_at')} on {r.get('host')}, pid {r.get('pid')}{rank_txt}"
    if r.get("classification"):
        yield f"- stall classification: {code(r['classification'])}"
    job = r.get("job") or {}
    if job.get("job_id") or job.get("role") == "waiting":
        waits = f"; this rank waits in {code(job.get('waiting_in'))}" if job.get("role") == "waiting" else ""
        yield f"- job: {code(job.get('job_id'))}{waits}; the whole job: {code(job.get('view'))}"
    prog = r.get("progress") or {}
    if prog:
        yield (f"- progress: {prog.get('batches', 0)} batches, {prog.get('epochs', 0)} epochs; "
               f"data wait {_fmt(prog.get('data_wait_s'))} s, step {_fmt(prog.get('step_s'))} s"
               + (f"; no progress for {_fmt(prog.get('stall_s'))} s" if prog.get("stall_s") else ""))
    exc = r.get("exception")
    if exc:
        yield ""
        yield "## Exception"
        yield ""
        yield code(exc.get("type")) + (f" (errno {exc['errno']})" if exc.get("errno") is not None else "")
        yield ""
        yield from _fenced(str(exc.get("message") or "").splitlines()[:40])
        if exc.get("traceback"):
            yield ""
            yield "<details><summary>traceback</summary>"
            yield ""
            yield from _fenced(str(exc["traceback"]).rstrip().splitlines()[-60:])
            yield "</details>"
    findings = r.get("findings") or []
    yield ""
    yield "## Findings"
    yield ""
    if not findings:
        yield "No playbook matched. The evidence below is what dlwatch saw."
    for i, f in enumerate(findings, 1):
        yield f"### {i}. {_one_line(f.get('title'))} ({code(f.get('playbook'))}, confidence {_fmt(f.get('confidence'))})"
        yield ""
        ev = f.get("evidence") or {}
        if ev:
            yield "Evidence:"
            yield ""
            for k, v in ev.items():
                yield f"- {_one_line(k)}: {code(v)}"
            yield ""
        if f.get("remediation"):
            yield "What to do:"
            yield ""
            yield from str(f["remediation"]).rstrip().splitlines()
            yield ""
    procs = r.get("processes") or []
    if procs:
        yield ""
        yield "## Processes"
        yield ""
        for p in procs:
            yield f"- {_proc_line(p)}"
            s = p.get("sample") or {}
            fds = s.get("fds")
            if fds:
                yield (f"  - fds: {fds.get('file')} files, {fds.get('shm')} shm ({human_bytes(fds.get('shm_bytes'))}), "
                       f"{fds.get('socket')} sockets, {fds.get('pipe')} pipes, {fds.get('other')} other")
        if any(p.get("stack") for p in procs):
            yield ""
            yield "## Stacks"
            for p in procs:
                if p.get("stack"):
                    yield ""
                    yield f"pid {p.get('pid')} ({p.get('role')}), from {p['stack'].get('source')}:"
                    yield ""
                    yield from _fenced(_stack_lines(p["stack"], max_frames=40))
    sysd = r.get("system") or {}
    if sysd:
        yield ""
        yield "## System"
        yield ""
        yield (f"- /dev/shm: {human_bytes(sysd.get('shm_free'))} free of {human_bytes(sysd.get('shm_total'))}; "
               f"MemAvailable {human_bytes(sysd.get('mem_available'))}; Mlocked {human_bytes(sysd.get('mlocked'))}")
        if sysd.get("cgroup_memory_limit") is not None or sysd.get("cgroup_oom_kills"):
            yield (f"- cgroup memory: {human_bytes(sysd.get('cgroup_memory_usage'))} of "
                   f"{human_bytes(sysd.get('cgroup_memory_limit'))}, OOM kills {_fmt(sysd.get('cgroup_oom_kills'))}")
    for g in r.get("gpus") or ():
        yield f"- GPU {g.get('index')} {g.get('name')}: util {_fmt(g.get('util_percent'))}%, memory {human_bytes(g.get('memory_used'))} of {human_bytes(g.get('memory_total'))}"
    loader = r.get("loader")
    if loader:
        yield ""
        yield "## Loader"
        yield ""
        for k, v in loader.items():
            yield f"- {_one_line(k)}: {code(v)}"
    if r.get("notes"):
        yield ""
        yield "## Notes"
        yield ""
        for n in r["notes"]:
            yield f"- {_one_line(n)}"
    yield ""
    yield f"Timeline: {len(r.get('timeline') or [])} records in timeline.jsonl."


def render_markdown(report: Mapping[str, Any]) -> str:
    return "\n".join(markdown_lines(report)) + "\n"


def terminal_lines(r: Mapping[str, Any]) -> Iterator[str]:
    yield f"incident {r.get('id')}  [{r.get('trigger')}]  {r.get('created_at')}  pid {r.get('pid')}"
    yield f"  {r.get('summary') or ''}"
    if r.get("classification"):
        yield f"  classification: {r['classification']}"
    job = r.get("job") or {}
    if job.get("role") == "waiting":
        yield f"  job: this rank waits in {job.get('waiting_in')}; the whole job: {job.get('view')}"
    elif job.get("job_id"):
        yield f"  job: {job.get('job_id')}; the whole job: {job.get('view')}"
    exc = r.get("exception")
    if exc:
        first = (str(exc.get("message") or "").splitlines() or [""])[-1]
        yield f"  exception: {exc.get('type')}: {first[:200]}"
    for i, f in enumerate(r.get("findings") or ()):
        yield f"  finding: {f.get('playbook')} ({_fmt(f.get('confidence'))}) {f.get('title')}"
        if i == 0:  # the evidence of the most likely finding, briefly; report.md has all of it
            shown = [(k, v) for k, v in (f.get("evidence") or {}).items() if k not in _PLUMBING_KEYS][:6]
            for k, v in shown:
                text = str(v)
                yield f"    {k}: {text[:117] + '...' if len(text) > 120 else text}"
        rem = str(f.get("remediation") or "").strip().splitlines()
        if rem:
            yield f"    -> {rem[0]}"
    if not r.get("findings"):
        yield "  no playbook matched"
    for p in r.get("processes") or ():
        yield "  " + _proc_line(p)
        if p.get("where"):
            yield f"    at {p['where']}"
        for line in _stack_lines(p.get("stack"), max_frames=6, python_only=True, max_threads=1):
            yield "  " + line
    for n in r.get("notes") or ():
        yield f"  note: {n}"


_PLUMBING_KEYS = {"matched", "ts", "pid", "signal", "event"}


def render_terminal(report: Mapping[str, Any], file: TextIO) -> None:
    for line in terminal_lines(report):
        print(terminal_safe(line), file=file)


def list_lines(summaries: Sequence[Any]) -> Iterable[str]:
    if not summaries:
        yield "no incidents"
        return
    yield f"{'ID':<44} {'CREATED':<25} {'TRIGGER':<9} TOP FINDING"
    for s in summaries:
        if getattr(s, "damaged", None):
            yield terminal_safe(f"{s.id:<44} {'-':<25} {'DAMAGED':<9} {s.damaged}")
        else:
            yield terminal_safe(f"{s.id:<44} {s.created_at:<25} {s.trigger:<9} {s.top_finding or '-'}")
