"""A candidate's CPU over time, and what it was in the steady window.

Two running traces, a point per sample of the candidate (``guard.CandidateRun``): the CPU seconds
of all its processes, and the workers' schedstat (ns on a CPU, ns runnable and waiting for one,
seconds of workers watched). Over the steady window they give ``cpu_cores`` and the workers' busy
share and run-queue wait, which tell CPU-bound workers on a shared machine (they wait for a core)
from I/O-bound ones (they sleep): docs/tune.md, "The recommendation".
"""

from __future__ import annotations

from typing import Any, Sequence

SAMPLE_S = 0.1  # the candidate's sampling period: a point this far outside the window still counts


class CpuUsage:
    """The traces of one candidate run."""

    def __init__(self) -> None:
        self.cpu: list[tuple[float, float]] = []  # (monotonic, CPU seconds of every process so far)
        # (monotonic, the workers' ns on a CPU, ns runnable and waiting, seconds of workers watched; all so far)
        self.sched: list[tuple[float, int, int, float]] = []
        self._sums = (0, 0, 0.0)
        self._last: dict[int, tuple[float, int, int]] = {}  # a worker's (monotonic, run ns, run-delay ns) last read

    def worker(self, pid: int, now: float, run: int, delay: int) -> None:
        """A worker's schedstat since its last read into the sums (its first read only marks it)."""
        last = self._last.get(pid)
        if last is not None:
            t0, run0, delay0 = last
            ran, waited, seen = self._sums
            self._sums = (ran + max(0, run - run0), waited + max(0, delay - delay0), seen + (now - t0))
        self._last[pid] = (now, run, delay)

    def point(self, now: float, cpu_s: float) -> None:
        """The end of a sample: every process's CPU seconds so far, and the workers' sums."""
        self.cpu.append((now, cpu_s))
        self.sched.append((now, *self._sums))

    def in_window(self, begin: Any, end: Any) -> tuple[float | None, float | None, float | None]:
        """(cpu_cores, worker_busy_share, wait_cores) over the steady window ``[begin, end]``; None where
        the window is too short, there were no workers, or no schedstat (a kernel without CONFIG_SCHED_INFO)."""
        cores = busy = wait = None
        ends = _ends(self.cpu, begin, end)
        if ends is not None:
            (t0, c0), (t1, c1) = ends
            cores = round(max(0.0, (c1 - c0) / (t1 - t0)), 2)
        ends = _ends(self.sched, begin, end)
        if ends is not None:
            (t0, ran0, waited0, seen0), (t1, ran1, waited1, seen1) = ends
            if seen1 - seen0 >= 0.05:
                ran, waited = (ran1 - ran0) / 1e9, (waited1 - waited0) / 1e9
                busy = round(min(1.0, (ran + waited) / (seen1 - seen0)), 2)
                wait = round(waited / (t1 - t0), 2)
        return cores, busy, wait


def _ends(trace: Sequence[Any], begin: Any, end: Any) -> tuple[Any, Any] | None:
    """The first and last points of a trace within the window (a sample's width either side)."""
    if not isinstance(begin, float) or not isinstance(end, float) or end <= begin:
        return None
    inside = [p for p in trace if begin - SAMPLE_S <= p[0] <= end + SAMPLE_S]
    if len(inside) < 2 or inside[-1][0] - inside[0][0] < 0.05:
        return None
    return inside[0], inside[-1]
