"""Watch a running DataLoader job live: each process's state, wait, CPU, fds, memory and shm.

  dlwatch top PID [--interval SECONDS] [--out DIR] [--once]

PID is the training process (watched by dlwatch or not). Each refresh reads /proc for
it and its DataLoader workers: state, what it waits in (from its syscall), CPU%,
open fds against the limit, RSS and USS, /dev/shm mapped; when the job runs under
dlwatch (watch or run), also the batch rate and the share of time spent waiting
for data, from its heartbeat. Keys: q quits; s writes an attach incident on the spot
(as `dlwatch attach PID` would, to --out or $DLWATCH_DIR). Fits an 80x24 terminal.
--once prints one frame (two /proc reads, --interval apart) and exits, for scripts
and terminals without keys. Exit 0 when you quit or the process ends.
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, TextIO

from dlwatch.collect import procfs
from dlwatch.collect.syscalls import category as syscall_category
from dlwatch.wire.config import DEFAULT_REPORT_DIR
from dlwatch.errors import UsageError
from dlwatch.report import display
from dlwatch.report.render import terminal_line

_CLEAR = "\x1b[H\x1b[2J"
_HIDE_CURSOR, _SHOW_CURSOR = "\x1b[?25l", "\x1b[?25h"
MAX_ROWS = 14  # processes shown: 24 lines less header, table header, footer and messages


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("pid", help="the training process (the DataLoader's main process)")
    parser.add_argument(
        "--interval", type=float, default=1.0, metavar="SECONDS", help="seconds between refreshes (default %(default)s)"
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="where `s` writes its attach incident (default: $DLWATCH_DIR or ./dlwatch-reports)",
    )
    parser.add_argument("--once", action="store_true", help="print one frame and exit")


@dataclass
class Row:
    # one line of the screen: formatted figures of a tracked process (model.TrackedProcess), not one
    pid: int
    role: str
    state: str
    waiting: str
    cpu_pct: float | None
    num_fds: int | None
    fd_limit: int | None
    rss: int | None
    uss: int | None
    shm: int | None


@dataclass
class Frame:
    """One refresh: the rows, and the heartbeat figures when the job is watched."""

    rows: list[Row]
    watched: bool
    batches: int | None = None
    batch_rate: float | None = None
    wait_share: float | None = None
    hb_state: str | None = None
    epochs: int | None = None


def _waiting(sample: Any) -> str:
    if sample.state == "R":
        return "running"
    if sample.state == "D":
        return "disk (D)"
    kind = syscall_category(sample.syscall)
    if kind:
        return kind
    return display.one_line(sample.wchan or "-", 16)


class Sampler:
    """Reads the job each refresh; keeps the previous read for rates."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.prev_cpu: dict[int, tuple[float, float]] = {}
        self.prev_hb: tuple[float, Any] | None = None
        self.roles: dict[int, str] = {}

    def _processes(self) -> tuple[list[tuple[int, str]], Any]:
        from dlwatch.cli.attach_cmd import gather  # the same discovery as attach: run dir, registrations, children

        procs, run = gather(self.pid)
        out = []
        for p in sorted(procs.values(), key=lambda p: (p.role != "main", p.role != "worker", p.worker_id or 0, p.pid)):
            role = p.role + (f" {p.worker_id}" if p.worker_id is not None else "")
            if p.role == "other" and "dlwatch.monitor" in " ".join(procfs.cmdline(p.pid) or ()):
                role = "monitor"  # dlwatch's own, started by watch: shown, but named
            out.append((p.pid, role))
        return out, run

    def frame(self) -> Frame:
        procs, run = self._processes()
        now = time.monotonic()
        rows = []
        for pid, role in procs:
            s = procfs.read_proc(pid, mem_detail=True)
            if s.gone:
                continue
            cpu_pct = None
            if s.cpu_s is not None:
                prev = self.prev_cpu.get(pid)
                if prev is not None and now > prev[0]:
                    cpu_pct = 100.0 * (s.cpu_s - prev[1]) / (now - prev[0])
                self.prev_cpu[pid] = (now, s.cpu_s)
            rows.append(
                Row(
                    pid,
                    role,
                    s.state or "?",
                    _waiting(s),
                    cpu_pct,
                    s.num_fds,
                    s.fd_limit,
                    s.rss,
                    s.uss,
                    s.shm_map_bytes,
                )
            )
        frame = Frame(rows, watched="run_dir" in run)
        hb = run.get("heartbeat")
        if hb is not None:
            frame.batches, frame.epochs, frame.hb_state = hb.batches, hb.epochs, hb.state_name
            if self.prev_hb is not None:
                t0, old = self.prev_hb
                dt = now - t0
                if dt > 0:
                    frame.batch_rate = (hb.batches - old.batches) / dt
                dw = hb.total_wait_s - old.total_wait_s
                ds = hb.total_step_s - old.total_step_s
                if dw + ds > 0:
                    frame.wait_share = max(0.0, dw) / (max(0.0, dw) + max(0.0, ds))
            self.prev_hb = (now, hb)
        return frame


def _num(v: Any, unit: str = "") -> str:
    return "-" if v is None else f"{v}{unit}"


def frame_lines(pid: int, frame: Frame, *, width: int = 80, message: str = "", keys: bool = True) -> list[str]:
    """The screen: at most 24 lines of at most ``width`` characters."""
    rows = frame.rows
    lines = [f"dlwatch top - pid {pid} - {time.strftime('%H:%M:%S', time.gmtime())} UTC - {len(rows)} processes"]
    if frame.watched:
        rate = "-" if frame.batch_rate is None else f"{frame.batch_rate:.1f}/s"
        share = "-" if frame.wait_share is None else f"{frame.wait_share:.0%}"
        lines.append(
            f"watched: {_num(frame.batches)} batches, epoch {_num(frame.epochs)}, {rate}, "
            f"waiting for data {share}, now {frame.hb_state or '-'}"
        )
    else:
        lines.append("not watched by dlwatch: no batch rate (run it under `dlwatch run` for that)")
    lines.append("")
    table = display.Table(
        ("PID", "ROLE", "ST", "WAITING IN", "CPU%", "FDS/LIMIT", "RSS", "USS", "SHM"),
        tuple(
            (
                str(r.pid),
                r.role,
                r.state,
                r.waiting,
                "-" if r.cpu_pct is None else f"{r.cpu_pct:.0f}",
                f"{_num(r.num_fds)}/{_num(r.fd_limit)}",
                _mem(r.rss),
                _mem(r.uss),
                _mem(r.shm) if r.shm else "-",
            )
            for r in rows[:MAX_ROWS]
        ),
    )
    lines.extend(display.text_table(table, width=width))
    if len(rows) > MAX_ROWS:
        lines.append(f"... {len(rows) - MAX_ROWS} more processes")
    lines.append("")
    lines = [terminal_line(line)[:width] for line in lines]
    if message:  # a path may be longer than the screen is wide: wrapped, never cut
        safe = terminal_line(message)
        lines.extend(safe[i : i + width] for i in range(0, len(safe), width))
    if keys:
        lines.append("q quit   s write an attach incident now")
    return lines


def _mem(n: int | None) -> str:
    """Sizes in four or five characters: the columns fit 80."""
    if n is None:
        return "-"
    for unit in ("B", "K", "M", "G", "T"):
        if n < 1024 or unit == "T":
            return f"{n:.0f}{unit}" if unit in ("B", "K") or n >= 100 else f"{n:.1f}{unit}"
        n /= 1024  # type: ignore[assignment]
    return "-"


class _Keys:
    """Single keys from a terminal (cbreak, no echo), restored on exit; nothing without a TTY."""

    def __init__(self, stream: TextIO) -> None:
        self.fd: int | None = None
        self.saved: Any = None
        try:
            if stream.isatty():
                import termios
                import tty

                self.fd = stream.fileno()
                self.saved = termios.tcgetattr(self.fd)
                tty.setcbreak(self.fd)
        except Exception:
            self.fd = None

    def read(self, timeout: float) -> str | None:
        if self.fd is None:
            time.sleep(timeout)
            return None
        ready, _, _ = select.select([self.fd], [], [], max(0.0, timeout))
        if not ready:
            return None
        data = os.read(self.fd, 32)
        return data.decode("latin-1")[:1] if data else None

    def close(self) -> None:
        if self.fd is not None and self.saved is not None:
            import termios

            termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)


def run(args: argparse.Namespace) -> int:
    from dlwatch.cli.attach_cmd import check_target, write_attach_incident

    try:
        pid = int(args.pid)
    except ValueError:
        raise UsageError(f"PID must be a number, got {args.pid!r}") from None
    if not (0.1 <= args.interval <= 60):
        raise UsageError("--interval must be between 0.1 and 60 seconds")
    check_target(pid)
    out_dir = args.out or os.environ.get("DLWATCH_DIR") or DEFAULT_REPORT_DIR
    sampler = Sampler(pid)
    out = sys.stdout
    if args.once:
        sampler.frame()
        time.sleep(args.interval)
        for line in frame_lines(pid, sampler.frame(), width=80, keys=False):
            print(line, file=out)
        return 0
    keys = _Keys(sys.stdin)
    message = ""
    out.write(_HIDE_CURSOR)
    try:
        while True:
            if not os.path.exists(f"/proc/{pid}"):
                out.write(_CLEAR)
                print(f"pid {pid} has exited", file=out)
                return 0
            width = max(40, min(shutil.get_terminal_size((80, 24)).columns, 200))
            frame = sampler.frame()
            out.write(_CLEAR + "\r\n".join(frame_lines(pid, frame, width=width, message=message)) + "\r\n")
            out.flush()
            deadline = time.monotonic() + args.interval
            while (left := deadline - time.monotonic()) > 0:
                key = keys.read(left)
                if key in ("q", "Q"):
                    return 0
                if key in ("s", "S"):
                    message = _snapshot(pid, out_dir, write_attach_incident, out)
                    break
    finally:
        keys.close()
        out.write(_SHOW_CURSOR)
        out.flush()


def _snapshot(pid: int, out_dir: str, write: Callable[..., tuple[dict[str, Any], str]], out: TextIO) -> str:
    out.write("\r\nwriting an attach incident, this takes a few seconds...\r\n")
    out.flush()
    try:
        report, path = write(pid, out_dir)
    except Exception as exc:
        return f"attach failed: {type(exc).__name__}: {exc}"
    from dlwatch.redact import outbound

    verdict = report.get("classification") or "?"
    return f"wrote an attach incident ({verdict}): {outbound(path)}"
