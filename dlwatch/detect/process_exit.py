"""How the training process ended when it left no word: killed by the OOM killer, or vanished.

The monitor sees the training process gone (it is reparented) without the block's ``stop``
event.  It cannot read the exit status (it is not the parent); what it can read is the
cgroup's OOM-kill count, once at its first poll and again now (through its own cgroup: the
dead process's ``/proc/<pid>/cgroup`` is gone, and the monitor, its child, shares it).  A count
that rose is the OOM killer's work; anything else (SIGKILL from outside, ``os._exit``) is
``vanished``.  The host's count (/proc/vmstat) is not used: on a shared host it counts every
job's kills.

Pure: the samples in, the verdict out (the ``exit`` incident's ``exit_cause`` and summary).
"""

from __future__ import annotations

from dataclasses import dataclass

from dlwatch.model import SystemSample

__all__ = ["ExitVerdict", "judge_exit"]

OOM_KILL = "oom-kill"
VANISHED = "vanished"


@dataclass(frozen=True)
class ExitVerdict:
    cause: str  # the incident's exit_cause: "oom-kill" or "vanished"
    text: str  # what happened, after "the training process (pid N) "


def judge_exit(first: SystemSample | None, now: SystemSample | None) -> ExitVerdict:
    """``first``: the system at the monitor's first poll; ``now``: read after the process died."""
    before = first.cgroup_oom_kills if first is not None else None
    after = now.cgroup_oom_kills if now is not None else None
    if before is not None and after is not None and after > before:
        return ExitVerdict(
            OOM_KILL, f"killed by the OOM killer (the cgroup's oom_kill count rose from {before} to {after})"
        )
    return ExitVerdict(
        VANISHED,
        "ended without leaving the watch block: killed by a signal (e.g. SIGKILL) "
        "or os._exit; the monitor cannot read its exit status",
    )
