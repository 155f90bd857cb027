"""The run summary: schema, assembly and renderers (summary.json, summary.md, the terminal).

One summary per watched block, written when the block ends (cleanly, with an
exception, or with the training process gone) to ``<report_dir>/runs/<run-id>/``
(see :mod:`dlwatch.report.store`), and handed to the user as ``Watch.summary``.
It is never an incident: its findings are advice (measured tuning findings) and
preflight (configuration checks made before the workers started).  The keys are
documented in docs/report-schema.md ("Run summary"); ``schema_version`` is separate
from report.json's.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import socket
from typing import Any, Iterable, Iterator, Mapping, Sequence

from dlwatch._version import __version__

from dlwatch.report import display, runview, schema
from dlwatch.report.schema import RunSummary
from dlwatch.report.store import SUMMARY_KIND as KIND, SUMMARY_SCHEMA_VERSION


def _iso(ts: float | None) -> str | None:
    if not isinstance(ts, (int, float)) or ts <= 0:
        return None
    return _dt.datetime.fromtimestamp(ts, _dt.timezone.utc).isoformat(timespec="seconds")


def new_summary(*, run_id: str, pid: int, now: float, started_at: float | None = None) -> RunSummary:
    """A new run summary: every top-level key of summary schema 1, in documented order, with empty
    values (the monitor and the finisher fill it with ``replace``)."""
    from dlwatch.wire.job import rank_info

    return RunSummary(
        schema_version=SUMMARY_SCHEMA_VERSION,
        kind=KIND,
        id=run_id,
        created_at=_iso(now),
        started_at=_iso(started_at),
        dlwatch_version=__version__,
        host=socket.gethostname(),
        pid=pid,
        rank=rank_info(),
        ended="clean",  # clean, exception, interrupted, vanished
        loader=None,
        cpus=None,
        accelerator=None,
        loop={},
        workers=[],
        main=None,
        peaks={},
        advice=(),
        preflight=(),
        incidents=[],
        notes=[],
    )


def skeleton(*, run_id: str, pid: int, now: float, started_at: float | None = None) -> dict[str, Any]:
    """:func:`new_summary` as the JSON object."""
    return new_summary(run_id=run_id, pid=pid, now=now, started_at=started_at).to_dict()


# --------------------------------------------------------------------------- renderers


def human_bytes(n: Any) -> str:
    from dlwatch.report.render import human_bytes as hb

    return hb(n)


def _pct(x: Any) -> str:
    return f"{100 * x:.0f}%" if isinstance(x, (int, float)) else "-"


def _num(x: Any, fmt: str = ".3g") -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return format(x, fmt)
    return str(x)


# advice that a measured tune answers: the summary points to `dlwatch tune` with the command to run
TUNE_ADVICE = ("input-bound", "too-many-workers", "prefetch-too-deep", "slow-epoch-start")


def step_ms(s: RunSummary) -> float | None:
    """The run's measured step (the loop body per batch, in ms), what ``dlwatch tune --step-ms`` takes."""
    loop = s.loop or {}
    body, batches = loop.get("body_s"), loop.get("batches")
    if isinstance(body, (int, float)) and isinstance(batches, int) and batches > 0 and body > 0:
        return 1000.0 * body / batches
    return None


def tune_command(s: RunSummary) -> str:
    """``dlwatch tune`` for this run: its measured step, and which loader when the program had several."""
    words = ["dlwatch tune"]
    ms = step_ms(s)
    if ms is not None:
        words.append(f"--step-ms {ms:.3g}")
    if len(runview.loaders(s)) > 1:
        words.append("--loader N")
    words.append("SCRIPT.py [ARGS...]")
    return " ".join(words)


def tune_hint(s: RunSummary, f: Any) -> str | None:
    """The line under an advice finding that measuring the DataLoader's settings answers; None for others."""
    if str(getattr(f, "playbook", "")) not in TUNE_ADVICE:
        return None
    return f"measure the settings on this pipeline instead of guessing: {tune_command(s)}"


def loop_line(s: RunSummary) -> str:
    loop = s.loop or {}
    first = loop.get("first_batch_s") or {}
    counted = runview.loop_words(s) or (  # a program of several loaders: its epochs per loader
        f"{display.count(loop.get('batches', 0), 'batch')}, {display.count(loop.get('epochs', 0), 'epoch')}"
    )
    return (
        f"{counted} in {_num(loop.get('wall_s'))} s; "
        f"data wait {_pct(loop.get('data_wait_share'))} of the loop (steady {_pct(loop.get('steady_data_wait_share'))}), "
        f"body {_pct(loop.get('body_share'))}; steady batch {_num(loop.get('steady_batch_s'))} s, "
        f"first batch of an epoch {_num(first.get('mean_s'))} s"
    )


def _worker_line(w: Mapping[str, Any]) -> str:
    return f"{runview.worker_label(w)}: {runview.worker_words(w)}"


TERMINAL_WORKER_LINES = 24  # summary.md has every worker of every iteration


def _peak_lines(s: RunSummary) -> Iterator[str]:
    p = s.peaks or {}
    fds = p.get("fds") or {}
    if fds:
        yield f"fds: {fds.get('num_fds')} of {fds.get('fd_limit')} ({fds.get('role')} pid {fds.get('pid')})"
    shm = p.get("shm") or {}
    if shm.get("total"):
        yield f"/dev/shm: {human_bytes(shm.get('used_peak'))} used at most of {human_bytes(shm.get('total'))}"
    ml = p.get("mlocked") or {}
    if ml.get("change") is not None:
        yield f"Mlocked: changed by {human_bytes(ml.get('change'))} (peak {human_bytes(ml.get('peak'))})"
    ma = p.get("mem_available") or {}
    if ma.get("low") is not None:
        yield f"MemAvailable: low point {human_bytes(ma.get('low'))} (at start {human_bytes(ma.get('first'))})"
    cg = p.get("cgroup_memory") or {}
    if cg.get("limit") is not None:
        yield f"cgroup memory: peak {human_bytes(cg.get('usage_peak'))} of {human_bytes(cg.get('limit'))}"
    for g in p.get("gpus") or ():
        yield f"GPU {g.get('index')} {g.get('name') or ''}: util mean {_num(g.get('util_mean'))}%, low {_num(g.get('util_low'))}%"


def markdown_lines(summary: RunSummary | Mapping[str, Any]) -> Iterator[str]:
    s = schema.run_summary(summary)
    yield f"# dlwatch run summary {s.id}"
    yield ""
    yield f"- {loop_line(s)}"
    yield f"- ended: `{s.ended or '-'}`; started {s.started_at or '-'}, written {s.created_at or '-'} on {s.host or '-'}, pid {s.pid}"
    cpus = s.cpus or {}
    if cpus:
        yield (
            f"- CPUs this process may use: {_num(cpus.get('usable'))} (affinity {_num(cpus.get('affinity'))}, "
            f"cgroup quota {_num(cpus.get('cgroup_quota'))}, machine {_num(cpus.get('cpu_count'))})"
        )
    if s.incidents:
        yield f"- incidents in this run: {', '.join(f'`{i}`' for i in s.incidents)}"
    for title, key, found in (("Advice", "advice", s.advice), ("Preflight", "preflight", s.preflight)):
        findings = found or ()
        yield ""
        yield f"## {title}"
        yield ""
        if not findings:
            yield runview.no_advice_line(s) if key == "advice" else "No preflight finding."
        elif key == "advice" and runview.not_judged_words(s):
            yield f"Too short to judge {md_cell(runview.not_judged_words(s))}."
            yield ""
        from dlwatch.report.render import finding_md  # one renderer for findings, escaped, for both documents

        for i, f in enumerate(findings, 1):
            yield from finding_md(i, f)
            hint = tune_hint(s, f) if key == "advice" else None
            if hint:
                yield f"Or {md_cell(hint.split(': ', 1)[0])}: `{tune_command(s)}`"
                yield ""
    workers = s.workers or []
    yield ""
    yield "## Workers"
    yield ""
    each = runview.worker_table(s)  # `dlwatch run`: every worker of every iteration, named
    if each is not None:
        from dlwatch.report.render import code

        yield from display.md_table(each, code) if each.rows else ["No worker processes were started."]
        yield ""
    elif not workers:
        yield "No worker processes were observed."
    for w in workers if each is None else ():
        yield f"- {md_cell(_worker_line(w))}"
    main = s.main or {}
    if main:
        yield (
            f"- training process (pid {main.get('pid')}): cpu {_num(main.get('cpu_util'))} cores, "
            f"rss peak {human_bytes(main.get('rss_peak'))}"
        )
    yield from _iteration_md(s)
    peaks = list(_peak_lines(s))
    if peaks:
        yield ""
        yield "## Peaks"
        yield ""
        for line in peaks:
            yield f"- {line}"
    from dlwatch.report.render import loader_and_notes_md  # one renderer, escaped, for both documents

    yield from loader_and_notes_md(s)


def _loader_line(e: Mapping[str, Any]) -> str:
    return runview.loader_line(e)


def md_cell(value: Any) -> str:
    """Text for a Markdown table cell or list item: one line, no markup, no cell separator."""
    from dlwatch.report.render import _md_text  # the one escaping of display text in Markdown

    return _md_text(str(value).replace("|", "/"))


def _iteration_md(s: RunSummary | Mapping[str, Any]) -> Iterator[str]:
    """``dlwatch run``: the program's loaders, and a row per loader iteration (epoch)."""
    from dlwatch.report.render import code

    loaders = runview.loaders(s)
    rows = runview.iterations_table(s)
    if not loaders and not rows.rows:
        return
    yield ""
    yield "## Loaders and iterations"
    yield ""
    for e in loaders:
        yield f"- {md_cell(_loader_line(e))}"
    if rows.rows:
        yield ""
        yield from display.md_table(rows, code)


def render_markdown(summary: RunSummary | Mapping[str, Any]) -> str:
    return "\n".join(markdown_lines(summary)) + "\n"


def terminal_lines(summary: RunSummary | Mapping[str, Any], *, verbose: bool = False) -> Iterator[str]:
    """The terminal view of a run summary (``verbose``: the quiet notes too, see ``render.shown_notes``)."""
    s = schema.run_summary(summary)
    yield f"run {s.id}  [summary, {s.ended or '-'}]  {s.created_at or '-'}  pid {s.pid}"
    yield f"  {loop_line(s)}"
    for key, found in (("advice", s.advice), ("preflight", s.preflight)):
        for f in found or ():
            yield f"  {key}: {f.playbook} ({_num(f.confidence)}) {f.title}"
            from dlwatch.report.render import evidence_terminal

            yield from itertools.islice(evidence_terminal(f.evidence, width=100, indent="    "), 12)
            rem = str(f.remediation or "").strip().splitlines()
            if rem:
                yield f"    -> {rem[0]}"
            hint = tune_hint(s, f) if key == "advice" else None
            if hint:
                yield f"    -> {hint}"
    if not s.advice:
        yield f"  {runview.no_advice_line(s)[0].lower()}{runview.no_advice_line(s)[1:]}"
    for e in runview.loaders(s):
        yield f"  {_loader_line(e)}"

    each = runview.worker_lines(s)  # `dlwatch run`: every worker of every iteration
    lines = each if each is not None else [_worker_line(w) for w in s.workers or ()]
    for line in lines[:TERMINAL_WORKER_LINES]:
        yield f"  {line}"
    if len(lines) > TERMINAL_WORKER_LINES:
        yield f"  ... {len(lines) - TERMINAL_WORKER_LINES} more workers in summary.md"
    for line in _peak_lines(s):
        yield f"  {line}"
    if s.incidents:
        yield f"  incidents: {', '.join(s.incidents)}"
    from dlwatch.report.render import shown_notes

    for n in shown_notes(s, verbose=verbose):
        yield f"  note: {n}"


def list_lines(runs: Sequence[Any]) -> Iterable[str]:
    if not runs:
        yield "no runs"
        return
    yield f"{'RUN':<32} {'CREATED':<25} {'BATCHES':>8} {'WAIT':>5} {'INC':>3}  ADVICE"
    for r in runs:
        wait = _pct(r.data_wait_share)
        yield (f"{r.id:<32} {r.created_at:<25} {r.batches:>8} {wait:>5} {r.incidents:>3}  {', '.join(r.advice) or '-'}")


def pointer_line(s: RunSummary, path: str) -> str | None:
    """The one stderr line at the end of a block with advice; None when there is none."""
    ids = [str(f.playbook) for f in s.advice or ()]
    if not ids:
        return None
    return f"dlwatch: run summary with advice ({', '.join(ids)}): {path} ({show_command(s.id, path)})"


def show_command(run_id: str, path: str) -> str:
    """``dlwatch report RUN-ID``, runnable as printed: with ``--dir`` where the summary at ``path``
    (``<report_dir>/runs/<id>``) is not in the directory the command reads by default (./dlwatch-reports
    here, with no DLWATCH_DIR: a variable set for the program may not be set where the line is read)."""
    import os
    import shlex

    from dlwatch.wire.config import DEFAULT_REPORT_DIR

    report_dir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    try:
        default = not os.environ.get("DLWATCH_DIR") and os.path.samefile(report_dir, DEFAULT_REPORT_DIR)
    except OSError:
        default = False
    return f"dlwatch report {run_id}" if default else f"dlwatch report {run_id} --dir {shlex.quote(report_dir)}"
