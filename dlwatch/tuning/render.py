"""The tune for a terminal: its table, the recommended ``DataLoader(...)`` keywords, and the progress line.

Renderers take the result and give lines; nothing here measures.  Text that came from the
program (an exception's message in a failed row's reason, a dataset's class name) is made
terminal-safe and redacted on the way out, as everything dlwatch prints.
"""

from __future__ import annotations

import time
from typing import IO, TYPE_CHECKING, Any, Iterator

from dlwatch.redact import outbound
from dlwatch.report.display import human_bytes
from dlwatch.report.render import terminal_safe

if TYPE_CHECKING:
    from dlwatch.tuning.result import Row, TuneResult


def _rate(r: Row) -> str:
    if r.batches_per_s is None:
        return "-"
    x = r.batches_per_s
    text = f"{x:,.0f}" if x >= 100 else f"{x:.3g}"
    if r.batches_per_s_sd:
        sd = r.batches_per_s_sd
        text += f" ±{sd:,.0f}" if sd >= 100 else f" ±{sd:.2g}"
    return text


def _s(x: float | None) -> str:
    return "-" if x is None else (f"{x:.2f} s" if x < 10 else f"{x:.0f} s")


def _b(x: int | None) -> str:
    return "-" if x is None else human_bytes(x)


def _fits(r: Row) -> str:
    if r.limits:
        return "no: " + ",".join(r.limits)
    return {True: "yes", False: "no", None: "-"}[r.fits]


def _flag(r: Row) -> str:
    return ("*" if r.recommended else " ") + ("=" if r.current else " ")


HEAD = (
    ("", 2),
    ("workers", 7),
    ("prefetch", 8),
    ("persist", 7),
    ("pin", 3),
    ("batches/s", 12),
    ("1st batch", 9),
    ("epoch start", 11),
    ("cores", 5),
    ("worker RSS", 10),
    ("worker USS", 10),
    ("shm peak", 9),
    ("fds", 5),
    ("fits", 6),
    ("status", 6),
)


def _cells(r: Row) -> list[str]:
    c = r.config
    return [
        _flag(r),
        str(c.num_workers),
        str(c.prefetch_factor) if c.prefetch_factor is not None else "-",
        "yes" if c.persistent_workers else "no",
        "yes" if c.pin_memory else "no",
        _rate(r),
        _s(r.first_batch_s),
        _s(r.epoch_start_s) if c.persistent_workers else "-",
        f"{r.cpu_cores:g}" if r.cpu_cores is not None else "-",
        _b(r.worker_rss_total),
        _b(r.worker_uss_total),
        _b(r.shm_peak),
        str(r.fds_peak) if r.fds_peak is not None else "-",
        _fits(r),
        r.status,
    ]


def table_lines(rows: tuple[Row, ...]) -> Iterator[str]:
    widths = [w for _, w in HEAD]
    shown = [r for r in rows if not (r.status == "skipped" and (r.reason or "").startswith("not run"))]
    body = [_cells(r) for r in sorted(shown, key=lambda r: (r.config.num_workers, r.config.key(), r.phase))]
    for cells in body:
        widths = [max(w, len(c)) for w, c in zip(widths, cells)]
    yield "  ".join(h.ljust(w) for (h, _), w in zip(HEAD, widths)).rstrip()
    for cells in body:
        yield "  ".join(c.ljust(w) for c, w in zip(cells, widths)).rstrip()


def kwargs_text(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items())


def result_lines(result: TuneResult, width: int = 100) -> Iterator[str]:
    loader = result.loader
    head = (
        f"dlwatch tune: {loader.dataset} (batch_size={loader.batch_size}), {result.elapsed_s:.0f} s of a "
        f"{result.budget_s:g} s budget"
    )
    if result.step_s:
        head += f", step {result.step_s * 1000:g} ms"
    cpus = result.machine.usable_cpus
    if cpus:
        head += f", {cpus:g} usable CPUs"
    if result.interrupted:
        head += "  [interrupted: the best so far]"
    yield _safe(head)
    yield ""
    yield from table_lines(result.rows)
    yield "  (* recommended, = the loader's own; batches/s: steady, ± the spread of its windows; shm: /dev/shm above the start)"
    notes = [r for r in result.rows if r.status != "ok" and r.reason]
    if notes:
        yield ""
        for r in notes:
            reason = f"{r.reason} [{r.playbook}]" if r.playbook else r.reason
            yield _safe(f"  {r.config.label()}: {r.status}: {reason}")
    yield ""
    if result.recommended is None:
        yield "No recommendation."
    elif result.best:
        yield _safe(f"Recommended: DataLoader(..., {kwargs_text(result.best)})")
    else:
        yield "Recommended: keep the loader as it is."
    for line in result.why:
        yield _safe(f"  - {line}")
    for line in result.advice:
        yield _safe(f"  - {line}")
    for line in result.notes:
        yield _safe(f"  note: {line}")


def _safe(text: str) -> str:
    return terminal_safe(outbound(text))


class Progress:
    """The progress line on stderr: the candidate running and the budget left; plain lines when not a TTY."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        try:
            self.tty = stream.isatty()
        except Exception:
            self.tty = False
        self.count = 0
        self.started = time.monotonic()
        self.open = False

    def __call__(self, label: str, left_s: float) -> None:
        self.count += 1
        text = _safe(f"dlwatch tune: [{self.count}] {label}, {max(0.0, left_s):.0f} s left")
        try:
            if self.tty:
                self.stream.write("\r\x1b[K" + text)
                self.open = True
            else:
                self.stream.write(text + "\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def close(self) -> None:
        if self.open:
            try:
                self.stream.write("\r\x1b[K")
                self.stream.flush()
            except (OSError, ValueError):
                pass
            self.open = False
