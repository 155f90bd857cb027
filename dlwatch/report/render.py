"""Renderers: report data in, text out.  They never probe the system.

``markdown_lines`` is for report.md (people on a ticket); ``terminal_lines`` is
the shorter view of ``dlwatch report ID``; ``list_lines`` the incident table.
"""

from __future__ import annotations

import os
import re
from typing import Any, Iterable, Iterator, Mapping, Sequence, TextIO

from dlwatch.report import display, runview, schema
from dlwatch.report.schema import Finding, Frame, Incident, RunSummary, Stack

# C0 controls (ESC among them), DEL, C1 controls, and the bidirectional overrides that
# reorder what a terminal shows: a report's text comes from the training program and
# must not drive the terminal of whoever reads it.
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]")
# ... and, for one line of terminal output, the line breaks and the tab too: a newline in a
# process name or a frame would start a line of the target's own ("finding: all-clear")
_UNSAFE_IN_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069\u2028\u2029]")
_NAMED = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_BACKTICKS = re.compile("`+")


def terminal_safe(text: Any) -> str:
    """``text`` with every control character shown as an escape (``\\x1b``), so it prints as text."""
    text = str(text)
    return _UNSAFE.sub(
        lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text
    )


def _escape(m: re.Match[str]) -> str:
    c = m.group()
    return _NAMED.get(c) or (f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")


def terminal_line(text: Any) -> str:
    """``text`` as exactly one line of terminal output: every control character, newlines and tabs
    included, shown as an escape (``\\n``, ``\\t``, ``\\x1b``).  The one helper every line that
    ``dlwatch attach``, ``report`` and ``top`` print goes through: whatever part of it came from a
    target (a process name, a frame, an exception, a path) cannot start a line of its own."""
    return _UNSAFE_IN_LINE.sub(_escape, str(text))


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


human_bytes = display.human_bytes


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3g}"
    return str(v)


def _frame_line(f: Frame) -> str:
    if f.filename and f.line is not None:
        return f"{f.function} ({f.filename}:{f.line})"
    if f.filename:
        return f"{f.function} ({os.path.basename(str(f.filename))})"
    return str(f.function)


def _stack_lines(
    stack: Stack | None, *, max_frames: int = 12, python_only: bool = False, max_threads: int = 64
) -> Iterator[str]:
    if not stack:
        return
    if stack.error and not stack.threads:
        yield f"    (no stack: {stack.error})"
        return
    for t in stack.main_first()[:max_threads]:
        label = t.name or t.thread_id
        yield f"    thread {label}" + (" [GIL]" if t.owns_gil else "") + ":"
        frames = [f for f in t.frames or () if not (python_only and f.native)]
        for f in frames[:max_frames]:
            yield f"      {_frame_line(f)}"
        # an int in what dlwatch writes; the loader leaves it unchecked
        omitted = t.frames_omitted if isinstance(t.frames_omitted, int) else 0
        if len(frames) > max_frames or omitted:
            yield f"      ... {len(frames) - min(max_frames, len(frames)) + omitted} more frames" + (
                f" ({omitted} left out of the report)" if omitted else ""
            )
    if isinstance(stack.threads_omitted, int) and stack.threads_omitted:
        yield f"    ... {stack.threads_omitted} more threads left out of the report"


def _md_text(v: Any) -> str:
    """A display string in Markdown: as is when it holds no markup, else as inline code."""
    text = _one_line(v)
    return text if display._plain_safe(text) else code(text)


def _md_value(label: str, value: Any) -> Iterator[str]:
    if isinstance(value, display.Table):
        if not value.rows:
            yield f"- {label}: none"
            return
        yield f"- {label}:"
        yield ""
        for line in display.md_table(value, code):
            yield "  " + line
        yield ""
    elif isinstance(value, list):
        yield f"- {label}:"
        for line in value:
            yield f"  - {_md_text(line)}"
    else:
        yield f"- {label}: {_md_text(value)}"


def _progress_line(prog: Mapping[str, Any]) -> str:
    text = (
        f"{progress_words(prog)}; "
        f"waiting for data {display.human_seconds(prog.get('data_wait_s'))}, "
        f"in the loop body {display.human_seconds(prog.get('step_s'))}"
    )
    if prog.get("stall_s"):
        text += f"; no progress for {display.human_seconds(prog.get('stall_s'))}"
        if prog.get("stall_timeout_s"):
            text += f" (allowance {display.human_seconds(prog.get('stall_timeout_s'))})"
    return text


def _first_remediation(f: Finding, limit: int = 160) -> str:
    """The remediation's first paragraph, as plain words, cut at a sentence near ``limit``."""
    para: list[str] = []
    for line in str(f.remediation or "").splitlines():
        line = line.strip()
        if line.startswith(("```", "#")) or (not line and para):
            break
        if line:
            para.append(line.lstrip("-").strip())
    text = " ".join(para).replace("**", "")
    if len(text) <= limit:
        return text
    cut = text.rfind(". ", 0, limit)
    return text[: cut + 1] if cut > 40 else display.cut_words(text, limit)


def finding_md(i: int, f: Finding) -> Iterator[str]:
    """One finding in Markdown: title, evidence for people (tables, units, stacks), what to do.

    The same for an incident's findings and a run summary's advice and preflight."""
    yield f"### {i}. {_one_line(f.title)} ({code(f.playbook)}, confidence {display.percent(f.confidence)})"
    yield ""
    items = display.evidence_items(f.evidence or {})
    if items:
        yield "Evidence:"
        yield ""
        for label, value in items:
            yield from _md_value(label, value)
        yield ""
    if f.remediation:
        yield "What to do:"
        yield ""
        yield from str(f.remediation).rstrip().splitlines()
        yield ""


def evidence_terminal(evidence: Any, *, width: int, indent: str = "  ", max_rows: int = 8) -> Iterator[str]:
    """Evidence for the terminal: a label a line, tables and stacks below their label, long text
    wrapped and cut at a word after about three lines (report.md has every word)."""
    for label, value in display.evidence_items(evidence or {}, plumbing=False):
        if isinstance(value, display.Table):
            yield f"{indent}{label}:"
            for line in display.text_table(value, width=width - len(indent) - 2, max_rows=max_rows):
                yield f"{indent}  {line}"
        elif isinstance(value, list):
            yield f"{indent}{label}:"
            for line in value[:max_rows]:
                yield f"{indent}  {line}"
        else:
            room = max(20, 3 * (width - len(indent) - 4) - len(str(label)) - 2)  # about three lines
            yield from wrap(f"{label}: {display.cut_words(str(value), room)}", width, indent, indent + "    ")


def markdown_lines(report: Incident | Mapping[str, Any]) -> Iterator[str]:
    r = schema.incident(report)
    yield f"# dlwatch incident {_one_line(r.id)}"
    yield ""
    yield f"**{_one_line(r.summary or r.trigger)}**"
    yield ""
    findings = r.findings or ()
    verdict = r.classification
    yield f"- what happened: {_md_text(r.trigger)}" + (f", verdict {_md_text(verdict)}" if verdict else "")
    if findings:
        top = findings[0]
        yield (
            f"- top finding: {_md_text(top.title)} ({code(top.playbook)}, confidence {display.percent(top.confidence)})"
        )
        todo = _first_remediation(top)
        if todo:
            yield f"- what to do: {_md_text(todo)} (details below)"
    rank = r.rank
    rank_txt = "" if rank is None or rank.rank is None else f", rank {rank.rank}/{rank.world_size}"
    yield (
        f"- when and where: {_md_text(r.created_at)} on {_md_text(r.host)}, pid {display.human_number(r.pid)}{rank_txt}"
    )
    job = r.job
    if job is not None and (job.job_id or job.role == "waiting"):  # multi-rank jobs (issue 13's `job` key)
        waits = f"; this rank waits in {code(job.waiting_in)}" if job.role == "waiting" else ""
        yield f"- job: {code(job.job_id)}{waits}; the whole job: {code(job.view)}"
    prog = r.progress or {}
    if prog:
        yield f"- progress: {_progress_line(prog)}"
    exc = r.exception
    if exc:
        yield ""
        yield "## Exception"
        yield ""
        yield code(exc.type) + (f" (errno {exc.errno})" if exc.errno is not None else "")
        yield ""
        yield from _fenced(str(exc.message or "").splitlines()[:40])
        if exc.traceback:
            yield ""
            yield "<details><summary>traceback</summary>"
            yield ""
            yield from _fenced(str(exc.traceback).rstrip().splitlines()[-60:])
            yield "</details>"
    yield ""
    yield "## Findings"
    yield ""
    if not findings:
        yield "No playbook matched. The evidence below is what dlwatch saw."
    for i, f in enumerate(findings, 1):
        yield from finding_md(i, f)
    procs = r.processes or ()
    if procs:
        yield ""
        yield "## Processes"
        yield ""
        yield from display.md_table(display.process_table(procs), code)
        fd_rows = []
        for p in procs:
            fds = p.fds
            if fds is not None:
                fd_rows.append(
                    (
                        display.human_number(p.pid),
                        display.human_number(fds.get("file")),
                        display.human_number(fds.get("shm")),
                        display.human_bytes(fds.get("shm_bytes")),
                        display.human_number(fds.get("socket")),
                        display.human_number(fds.get("pipe")),
                        display.human_number(fds.get("other")),
                    )
                )
        if fd_rows:
            yield ""
            yield "Open file descriptors:"
            yield ""
            yield from display.md_table(
                display.Table(("pid", "files", "shm", "shm size", "sockets", "pipes", "other"), tuple(fd_rows)), code
            )
        excerpts = display.process_excerpts(procs)
        if excerpts:
            yield ""
            yield "## Stacks"
            yield ""
            yield "Innermost Python frames of each process's main thread:"
            yield ""
            for who, frames in excerpts:
                yield f"- {who}: " + " <- ".join(code(fr) for fr in frames)
            for p in procs:
                if p.stack:
                    yield ""
                    yield (
                        f"<details><summary>pid {display.human_number(p.pid)} "
                        f"({_md_text(p.role)}), full stack from {_md_text(p.stack.source)}</summary>"
                    )
                    yield ""
                    yield from _fenced(_stack_lines(p.stack, max_frames=40))
                    yield "</details>"
    sysd = r.system or {}
    if sysd:
        yield ""
        yield "## System"
        yield ""
        yield (
            f"- /dev/shm: {human_bytes(sysd.get('shm_free'))} free of {human_bytes(sysd.get('shm_total'))}; "
            f"MemAvailable {human_bytes(sysd.get('mem_available'))}; Mlocked {human_bytes(sysd.get('mlocked'))}"
        )
        if sysd.get("cgroup_memory_limit") is not None or sysd.get("cgroup_oom_kills"):
            yield (
                f"- cgroup memory: {human_bytes(sysd.get('cgroup_memory_usage'))} of "
                f"{human_bytes(sysd.get('cgroup_memory_limit'))}, OOM kills {_fmt(sysd.get('cgroup_oom_kills'))}"
            )
    for g in r.gpus or ():
        yield (
            f"- GPU {_md_text(g.get('index'))} {_md_text(g.get('name'))}: util {_fmt(g.get('util_percent'))}%, "
            f"memory {human_bytes(g.get('memory_used'))} of {human_bytes(g.get('memory_total'))}"
        )
    yield from loader_and_notes_md(r)
    yield ""
    yield (
        f"Timeline: {len(r.timeline or [])} records in timeline.jsonl; "
        "report.html draws them (`dlwatch report ID --html`)."
    )


def render_markdown(report: Incident | Mapping[str, Any]) -> str:
    return "\n".join(markdown_lines(report)) + "\n"


HEADLINE_LINES = 6  # what happened, verdict, top finding, what to do: the first lines, before any detail


def wrap(text: str, width: int, indent: str = "", hang: str | None = None) -> list[str]:
    """``text`` (made terminal-safe, on one line: ``terminal_line``) as lines of at most ``width`` characters, broken between words:
    the first line starts with ``indent``, the others with ``hang`` (default: ``indent`` and two spaces).
    A word longer than a line (a path) is the only thing ever broken inside."""
    import textwrap

    hang = indent + "  " if hang is None else hang
    lines = textwrap.wrap(
        _NUMBER_UNIT.sub("\\1\u00a0\\2", terminal_line(text)),  # "0.00 s" stays on one line
        width=max(20, width),
        initial_indent=indent,
        subsequent_indent=hang,
        break_on_hyphens=False,
    )
    return [line.replace("\u00a0", " ") for line in lines] or [indent.rstrip()]


_NUMBER_UNIT = re.compile(r"(\d) (s|ms|min|h|B|KiB|MiB|GiB|TiB|cores?|%)(?=\W|$)")


def headline(r: Incident) -> str:
    """``TRIGGER (verdict): summary``, the verdict said once: the summary of a stall or an interrupt
    ends its first part with ``(verdict)``, which moves to the front; one that names it otherwise
    (``attached to pid N: deadlock``) keeps it there."""
    summary = _one_line(r.summary or "")
    trigger = str(r.trigger or "?").upper()
    verdict = str(r.classification) if r.classification else ""
    if not verdict:
        return f"{trigger}: {summary}"
    if f" ({verdict})" in summary:
        return f"{trigger} ({verdict}): {summary.replace(f' ({verdict})', '', 1)}"
    if re.search(rf"(^|\W){re.escape(verdict)}(\W|$)", summary):
        return f"{trigger}: {summary}"
    return f"{trigger} ({verdict}): {summary}"


def progress_words(prog: Mapping[str, Any]) -> str:
    """Where the loop was: ``in epoch 1, 3 batches into it (19 batches in all)``.

    The heartbeat counts the epochs *started* (``epochs``); the epoch the loop is in is the last of
    them, numbered from 0 as a program's ``for epoch in range(...)`` numbers it (a count next to an
    index read as "2 epochs" where the program was in epoch 1)."""
    batches = display.count(prog.get("batches", 0), "batch")
    epochs = prog.get("epochs")
    if not isinstance(epochs, int) or isinstance(epochs, bool) or epochs <= 0:
        return f"{batches}, before the first epoch"
    into = prog.get("epoch_batches")
    where = f"in epoch {epochs - 1}"
    if isinstance(into, int) and not isinstance(into, bool):
        where += f", {display.count(into, 'batch')} into it"
    return f"{where} ({batches} in all)"


def terminal_lines(report: Incident | Mapping[str, Any], width: int = 100, *, verbose: bool = False) -> Iterator[str]:
    """The terminal view: the headline first (what happened, the verdict, the top finding, what to
    do), then the evidence of the top finding, the processes as a table, and short stacks.

    Sentences (the headline, findings, what to do, the exception, notes) are wrapped between words
    to ``width``; tables and evidence values are cut to it (report.md has every word).  Notes the
    report marks as quiet (``quiet_notes``: facts that explain nothing on that machine, such as no
    NVML where no NVIDIA device exists) are shown with ``verbose`` only."""
    r = schema.incident(report)
    findings = r.findings or ()
    yield from wrap(headline(r), width, "", "    ")
    yield from wrap(f"incident {r.id}, {r.created_at}, pid {r.pid}", width, "  ", "    ")
    job = r.job
    if job is not None and job.role == "waiting":
        yield from wrap(f"job: this rank waits in {job.waiting_in}; the whole job: {job.view}", width, "  ")
    elif job is not None and job.job_id:
        yield from wrap(f"job: {job.job_id}; the whole job: {job.view}", width, "  ")
    exc = r.exception
    if exc:
        first = (str(exc.message or "").splitlines() or [""])[-1]
        yield from wrap(f"exception: {exc.type}: {display.cut_words(first, 200)}", width, "  ", "    ")
    if findings:
        top = findings[0]
        yield from wrap(
            f"finding: {top.playbook} ({display.percent(top.confidence)}) {_one_line(top.title)}", width, "  ", "    "
        )
        todo = _first_remediation(top)
        if todo:  # a paragraph that introduces a list ends with ":": the list is in report.md
            yield from wrap(f"-> {todo} see report.md" if todo.endswith(":") else f"-> {todo}", width, "  ", "     ")
    else:
        yield "  no playbook matched"
    prog = r.progress or {}
    if prog:
        stalled = f"no progress for {display.human_seconds(prog.get('stall_s'))}; " if prog.get("stall_s") else ""
        yield from wrap(
            f"{stalled}{display.count(prog.get('batches', 0), 'batch')}, "
            f"data wait {display.human_seconds(prog.get('data_wait_s'))}, "
            f"loop body {display.human_seconds(prog.get('step_s'))}",
            width,
            "  ",
            "    ",
        )
    if findings:
        lines = list(evidence_terminal(findings[0].evidence, width=width))
        if lines:
            yield ""
            yield "evidence:"
        yield from lines
        for f in findings[1:]:
            yield from wrap(
                f"also: {f.playbook} ({display.percent(f.confidence)}) {_one_line(f.title)}", width, "  ", "    "
            )
    procs = r.processes or ()
    if procs:
        yield ""
        yield "processes:"
        for line in display.text_table(display.process_table(procs), width=width - 2):
            yield "  " + line
        excerpts = display.process_excerpts(procs, n=3)
        if excerpts:
            yield ""
            yield "stacks (innermost first):"
            for who, frames in excerpts:
                yield f"  {who}: {frames[0]}"
                for fr in frames[1:]:
                    yield f"      <- {fr}"
    for n in shown_notes(r, verbose=verbose):
        yield from wrap(f"note: {_one_line(n)}", width, "  ", "    ")


def shown_notes(r: Incident | RunSummary, *, verbose: bool = False) -> list[str]:
    """The notes to show people: all of them with ``verbose``, else those not marked quiet."""
    notes = [str(n) for n in r.notes or ()]
    if verbose:
        return notes
    quiet = r.extra.get("quiet_notes")
    hidden = {str(n) for n in quiet} if isinstance(quiet, list) else set()
    return [n for n in notes if n not in hidden]


_STYLES = {"bold_red": "\x1b[1;31m", "yellow": "\x1b[33m", "green": "\x1b[32m", "bold": "\x1b[1m", "dim": "\x1b[2m"}
_RESET = "\x1b[0m"


def use_color(stream: Any, environ: Mapping[str, str] | None = None) -> bool:
    """Colour only on a terminal, never with NO_COLOR set (any value) or TERM=dumb."""
    env = os.environ if environ is None else environ
    if "NO_COLOR" in env or env.get("TERM") == "dumb":
        return False
    try:
        return bool(stream.isatty())
    except Exception:
        return False


def terminal_view(
    r: Incident | Mapping[str, Any], *, color: bool = False, width: int = 100, verbose: bool = False
) -> Iterator[str]:
    """``terminal_lines`` made safe to print (controls escaped, one line each), then coloured when asked.

    A line indented deeper than the line it continues (a wrapped sentence) keeps that line's colour."""
    style = ""
    for i, line in enumerate(terminal_lines(r, width=width, verbose=verbose)):
        safe = terminal_line(line)
        if len(safe) > width:  # a table row: one screen wide; report.md has every word
            safe = safe[: width - 1] + "~"
        if not safe.startswith("    "):
            if i == 0:
                style = "bold_red"
            elif safe.startswith("  finding:") or safe.startswith("  -> "):
                style = "yellow"
            elif safe.endswith(":") and not safe.startswith(" "):
                style = "bold"
            else:
                style = ""
        yield _STYLES[style] + safe + _RESET if color and style else safe


def render_terminal(
    report: Incident | Mapping[str, Any], file: TextIO, *, color: bool = False, verbose: bool = False
) -> None:
    for line in terminal_view(report, color=color, verbose=verbose):
        print(line, file=file)


def list_lines(summaries: Sequence[Any]) -> Iterable[str]:
    if not summaries:
        yield "no incidents"
        return
    yield f"{'ID':<44} {'CREATED':<25} {'TRIGGER':<9} TOP FINDING"
    for s in summaries:
        if getattr(s, "damaged", None):
            yield terminal_line(f"{s.id:<44} {'-':<25} {'DAMAGED':<9} {s.damaged}")
        else:
            yield terminal_line(f"{s.id:<44} {s.created_at:<25} {s.trigger:<9} {s.top_finding or '-'}")


def loader_and_notes_md(r: Incident | RunSummary) -> Iterator[str]:
    """The "Loader" table and "Notes" list of report.md and summary.md (values from a report: escaped)."""
    loader = r.loader
    each = runview.settings_table(r) if isinstance(r, RunSummary) else None  # `dlwatch run`: every loader's
    if each is not None:
        yield ""
        yield "## Loaders' settings"
        yield ""
        yield "| " + " | ".join(display.md_cell(h, code) for h in each.headers) + " |"
        yield "|" + "---|" * len(each.headers)
        for row in each.rows:  # a setting's name as is, its values escaped
            yield "| " + " | ".join([display.md_cell(row[0]), *(display.md_cell(c, code) for c in row[1:])]) + " |"
    elif isinstance(loader, Mapping) and loader:  # a summary's loader is not checked when it is loaded
        yield ""
        yield "## Loader"
        yield ""
        yield "| setting | value |"
        yield "|---|---|"
        for k, v in loader.items():
            yield f"| {display.md_cell(str(k))} | {display.md_cell(display.scalar(str(k), v), code)} |"
    notes = shown_notes(r)
    if notes:
        yield ""
        yield "## Notes"
        yield ""
        for n in notes:
            yield f"- {_one_line(n)}"
