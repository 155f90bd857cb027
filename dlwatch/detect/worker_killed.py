"""The ``worker-killed`` failure: what dlwatch saw when a DataLoader worker vanished.

torch says a worker "exited unexpectedly" or "is killed by signal: X" and nothing
else; whether it raises at once or the loop hangs, the report is written later
(``exception`` or ``stall``).  This detector keeps the evidence of the moment, as an
``observation`` event that every later report carries: the worker's memory up to the
end, the memory limit, the OOM-kill counters before and after, /dev/shm, its exit
status when seen (a zombie's, or the exit codes the training process read after
torch raised) and the Python stack a fatal signal left in its crash file.  It notes
only a worker that ended abnormally; workers shut down at an epoch's end stay quiet.
The cause is judged by :func:`exit_cause` (pure), and again on the report by this
module's enricher, which also shows the memory, the limits and the crash stack.
"""

from __future__ import annotations

import collections
import signal as _signal
from typing import Any, Iterable, Mapping

from dlwatch.detect.base import Detector, View
from dlwatch.detect.evidence import Context, MAX_FRAMES, frame_str, is_user_frame, samples_of, strip_event, threads
from dlwatch.detect.registry import Failure
from dlwatch.wire import contract
from dlwatch.wire.playbooks import Playbook
from dlwatch.model import SystemSample

__all__ = ["WorkerKilled", "exit_cause", "signal_name", "torch_worker_exit", "wait_status_signal"]

CRASH = ("SIGSEGV", "SIGABRT", "SIGFPE", "SIGILL")
NEAR_LIMIT_SHARE = 0.9  # memory at this share of its limit: the OOM killer's territory
HISTORY_SHOWN = 12


TORCH_SIGNALS = {
    "Killed": "SIGKILL",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Aborted": "SIGABRT",
    "Floating point exception": "SIGFPE",
    "Terminated": "SIGTERM",
    "Illegal instruction": "SIGILL",
    "Interrupt": "SIGINT",
    "Hangup": "SIGHUP",
    "Quit": "SIGQUIT",
}


def torch_worker_exit(text: str) -> tuple[list[int], str | None]:
    """(worker pids, signal) from torch's messages, found with plain string search (no regex on
    untrusted text): "DataLoader worker (pid N) is killed by signal: Killed." and
    "DataLoader worker (pid(s) N, M) exited unexpectedly"."""
    head = "DataLoader worker (pid "
    killed = " is killed by signal: "
    i = text.find(head)
    while i >= 0:
        j = text.find(")", i + len(head))
        if j < 0:
            break
        inner = text[i + len(head) : j]
        if text.startswith(killed, j + 1) and inner.isascii() and inner.isdigit():
            rest = text[j + 1 + len(killed) : j + 1 + len(killed) + 40]
            name = rest.split(".", 1)[0].split("\n", 1)[0].strip()
            return [int(inner)], TORCH_SIGNALS.get(name, name or None)
        i = text.find(head, j)
    head_s = "DataLoader worker (pid(s) "
    i = text.find(head_s)
    if i >= 0:
        j = text.find(")", i + len(head_s))
        if j > 0 and text.startswith(" exited unexpectedly", j + 1):
            pids = [int(x) for x in text[i + len(head_s) : j].replace(",", " ").split() if x.isascii() and x.isdigit()]
            return pids, None
    return [], None


def signal_name(num: int | None) -> str | None:
    if not num:
        return None
    try:
        return _signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def wait_status_signal(status: int | None) -> int | None:
    """The terminating signal in a wait status (/proc/<pid>/stat field 52), None for a normal exit."""
    if status is None:
        return None
    sig = status & 0x7F
    return sig or None


def exit_cause(
    sig: str | None,
    *,
    oom_rose: bool,
    memory_share: float | None,
    crash_signal: str | None,
    near_share: float = NEAR_LIMIT_SHARE,
) -> tuple[str, str]:
    """(cause, basis): ``oom-kill``, ``sigbus``, ``native-crash``, ``external-kill`` or ``unknown``."""
    sig = crash_signal or sig
    if sig == "SIGBUS":
        return "sigbus", "SIGBUS: a page of a shared-memory mapping could not be backed"
    if sig in CRASH:
        return "native-crash", f"{sig}{' (its crash stack was written)' if crash_signal else ''}"
    if oom_rose:
        return "oom-kill", "the OOM-kill counter rose when the worker died"
    near = memory_share is not None and memory_share >= near_share
    if sig == "SIGKILL" and near:
        return "oom-kill", f"SIGKILL with memory at {memory_share:.0%} of its limit"
    if sig in ("SIGKILL", "SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT"):
        where = (
            f"memory at {memory_share:.0%} of its cgroup limit"
            if memory_share is not None
            else "no cgroup memory limit"
        )
        return "external-kill", f"{sig} from outside the process: {where}, no OOM kill counted"
    if near:
        return "oom-kill", f"memory at {memory_share:.0%} of its limit when the worker died"
    return "unknown", "no exit status, OOM-kill count or crash stack tells"


def memory_share(system: SystemSample | None) -> float | None:
    """How full the cgroup's memory limit was (usage / limit); None without a limit."""
    if system is None:
        return None
    if system.cgroup_memory_limit and system.cgroup_memory_usage is not None:
        return round(system.cgroup_memory_usage / system.cgroup_memory_limit, 4)
    return None


def _max_share(systems: Iterable[SystemSample]) -> float | None:
    shares = [x for x in (memory_share(s) for s in systems) if x is not None]
    return max(shares) if shares else None


def _rose(before: SystemSample | None, after: SystemSample | None, key: str) -> bool | None:
    a = getattr(before, key, None) if before is not None else None
    b = getattr(after, key, None) if after is not None else None
    return None if a is None or b is None else b > a


def oom_rose(before: SystemSample | None, after: SystemSample | None) -> bool:
    """The OOM-kill counter rose: the cgroup's when it has one; the host's only without (on a
    shared host it counts every other job's OOM kills too)."""
    cg = _rose(before, after, "cgroup_oom_kills")
    return bool(cg) if cg is not None else bool(_rose(before, after, "vm_oom_kills"))


class WorkerKilled(Detector):
    playbook = "worker-killed"
    defaults = {"near_limit_share": NEAR_LIMIT_SHARE}

    def __init__(self, thresholds: Mapping[str, float] | None = None) -> None:
        super().__init__(thresholds)
        self.systems: collections.deque[SystemSample] = collections.deque(maxlen=4)
        self.first: SystemSample | None = None
        self.seen_gone: set[int] = set()

    def on_event(self, ev: Mapping[str, Any], view: View) -> Iterable[dict[str, Any]]:
        if ev.get("event") != contract.WORKER_EXITS.name or not isinstance(ev.get("exitcodes"), Mapping):
            return ()
        out = []
        for pid, code in ev["exitcodes"].items():
            if not isinstance(code, int) or code == 0:
                continue
            try:
                pid = int(pid)
            except (TypeError, ValueError):
                continue
            sig = signal_name(-code) if code < 0 else None
            out.append(
                self._observe(
                    view,
                    pid,
                    sig=sig,
                    exit_status=None if code < 0 else code,
                    source="exit code read by the training process",
                )
            )
        return out

    def on_poll(self, view: View) -> Iterable[dict[str, Any]]:
        if view.system is not None:
            self.first = self.first or view.system
            self.systems.append(view.system)
        out = []
        for p in view.procs.values():
            if p.role != "worker" or not p.gone or p.pid in self.seen_gone:
                continue
            self.seen_gone.add(p.pid)
            status = next((s.exit_code for s in reversed(p.history) if s.exit_code is not None), None)
            sig = signal_name(wait_status_signal(status))
            crash = p.crash or None
            before = self.systems[0] if self.systems else None
            oom = oom_rose(before, view.system)
            share = _max_share(self.systems)
            if not (
                sig
                or crash
                or oom
                or (share is not None and share >= self.thresholds["near_limit_share"])
                or (status is not None and status != 0)
            ):
                continue  # an ordinary exit as far as dlwatch can tell (epoch end, shutdown)
            out.append(
                self._observe(
                    view,
                    p.pid,
                    sig=sig,
                    exit_status=(status >> 8) & 0xFF if status is not None and not sig else None,
                    source="zombie's wait status" if status is not None else "monitor",
                )
            )
        return out

    def _observe(
        self, view: View, pid: int, *, sig: str | None, exit_status: int | None, source: str
    ) -> dict[str, Any]:
        p = view.procs.get(pid)
        before = self.systems[0] if self.systems else None
        after = view.system
        crash = getattr(p, "crash", None) if p is not None else None
        share = _max_share(self.systems)
        oom = oom_rose(before, after)
        cause, basis = exit_cause(
            sig,
            oom_rose=oom,
            memory_share=share,
            crash_signal=(crash or {}).get("signal"),
            near_share=self.thresholds["near_limit_share"],
        )
        hist = [s for s in (p.history if p is not None else ()) if not s.gone][-HISTORY_SHOWN:]
        ev: dict[str, Any] = {
            "ts": view.now,
            "event": "observation",
            "signal": "worker_exit",
            "pid": pid,
            "worker_id": p.worker_id if p is not None else None,
            "exit_signal": sig,
            "exit_status": exit_status,
            "exit_source": source,
            "cause": cause,
            "cause_basis": basis,
            "last_seen_ts": hist[-1].ts if hist else None,
            "memory": [{"ts": round(s.ts, 3), "rss": s.rss, "uss": s.uss} for s in hist if s.rss is not None],
            "memory_share": share,
        }
        for key, src in (("before", before), ("after", after), ("at_start", self.first)):
            if src is not None:
                ev[f"oom_kills_{key}"] = {"cgroup": src.cgroup_oom_kills, "host": src.vm_oom_kills}
        if after is not None:
            ev.update(
                cgroup_memory_limit=after.cgroup_memory_limit,
                cgroup_memory_usage=after.cgroup_memory_usage,
                mem_available=after.mem_available,
                shm_total=after.shm_total,
                shm_free=after.shm_free,
            )
        if crash:
            ev["crash"] = {k: crash.get(k) for k in ("signal", "fatal_error")}
        return ev


CAUSES = ("oom-kill", "native-crash", "sigbus", "external-kill")
# torch's DataLoader worker installs its own handler for these (torch/csrc/DataLoader.cpp), over a
# faulthandler inherited from the program; dlwatch's crash file is installed after it, and chains to it
TORCH_WORKER_SIGNALS = frozenset({"SIGSEGV", "SIGBUS", "SIGFPE"})


def _enrich(pb: Playbook, ctx: Context, ev: dict[str, Any]) -> str | tuple[str, ...] | None:
    obs = [e for e in ctx.signal_events("worker_exit") if e.get("event") == "observation"]
    pids, sig_text = torch_worker_exit(ctx.text)
    crashed = [p for p in ctx.processes if p.get("role") == "worker" and p.get("crash")]
    gone = [p for p in ctx.processes if p.get("role") == "worker" and p.get("status") == "gone"]
    pid = (
        (pids[0] if pids else None)
        or next((e.get("pid") for e in obs), None)
        or next((p.get("pid") for p in crashed + gone), None)
    )
    if pid is None:
        return CAUSES
    mine = [e for e in obs if e.get("pid") == pid]
    merged: dict[str, Any] = {}
    for e in mine:  # later observations add what earlier ones lacked (an exit code read after torch raised)
        merged.update({k: v for k, v in e.items() if v is not None})
    proc = next((p for p in ctx.processes if p.get("pid") == pid), None)
    crash = (proc or {}).get("crash") or merged.get("crash") or {}
    sig = merged.get("exit_signal") or sig_text or crash.get("signal")
    share = merged.get("memory_share")
    before, after = merged.get("oom_kills_before") or {}, merged.get("oom_kills_after") or {}
    cg_b, cg_a = before.get("cgroup"), after.get("cgroup")
    if cg_b is not None and cg_a is not None:
        oom = cg_a > cg_b
    else:
        oom = before.get("host") is not None and after.get("host") is not None and after["host"] > before["host"]
    cause, basis = exit_cause(
        sig,
        oom_rose=oom,
        memory_share=share,
        crash_signal=crash.get("signal"),
        near_share=pb.threshold("near_limit_share", 0.9),
    )
    ev.update(
        {
            "pid": pid,
            "worker_id": (proc or {}).get("worker_id", merged.get("worker_id")),
            "exit_signal": sig,
            "cause": cause,
            "cause_basis": basis,
        }
    )
    if merged.get("exit_status") is not None:
        ev["exit_status"] = merged["exit_status"]
    if merged.get("last_seen_ts") is not None:
        ev["last_seen_ts"] = merged["last_seen_ts"]
    memory = (
        merged.get("memory")
        or [{"ts": s.get("ts"), "rss": s.get("rss"), "uss": s.get("uss")} for s in samples_of(ctx.report, pid)][-12:]
    )
    if memory:
        ev["memory"] = memory
    limits = {
        k: merged.get(k, ctx.system.get(k)) for k in ("cgroup_memory_limit", "cgroup_memory_usage", "mem_available")
    }
    ev["memory_limit"] = {k: v for k, v in limits.items() if v is not None}
    if share is not None:
        ev["memory_share"] = share
    if before or after:
        ev["oom_kills"] = {
            "before": before or None,
            "after": after or None,
            "at_start": merged.get("oom_kills_at_start"),
        }
    shm = {k: merged.get(k, ctx.system.get(k)) for k in ("shm_total", "shm_free")}
    if any(v is not None for v in shm.values()):
        ev["shm"] = shm
    if crash:
        ev["crash"] = {"signal": crash.get("signal"), "fatal_error": crash.get("fatal_error")}
    if proc is not None and crash:
        stacks = threads(proc)  # the thread that crashed in the dataset's code first
        stacks.sort(key=lambda t: not any(is_user_frame(f) for f in t))
        frames = stacks[0] if stacks else []
        ev["crash_stack"] = [frame_str(f) for f in frames[:MAX_FRAMES]]
        user = next((f for f in frames if is_user_frame(f)), None)
        if user is not None:
            ev["crash_frame"] = frame_str(user)
    # unknown: every cause's text, but not the variants that say where a crash stack went
    variant: str | tuple[str, ...] = cause if cause != "unknown" else CAUSES
    if cause == "native-crash":
        variant = _crash_stack_at(ctx, pid, ev)
    if cause == "sigbus":
        ev["see_also"] = "shm-exhaustion"
    growth = ctx.signal_events("worker_memory_growth") + [
        e for e in ctx.events if e.get("event") == "advice" and e.get("playbook") == "worker-memory-growth"
    ]
    if growth:
        ev["memory_growth_before"] = strip_event(growth[-1])
    return variant


def _crash_stack_at(ctx: Context, pid: Any, ev: dict[str, Any]) -> str:
    """Where a native crash's Python stack is (evidence ``crash_stack_at``), and the variant that says so.

    The worker's registration tells whose faulthandler was on (``crash_output``): dlwatch's
    crash file (its stack is then in this report), or the program's own, which writes to the
    worker's stderr and which dlwatch leaves alone.
    """
    output = next((e.get("crash_output") for e in ctx.signal_events("worker_registered") if e.get("pid") == pid), None)
    if ev.get("crash_stack"):
        ev["crash_stack_at"] = "this report (crash stack, from dlwatch's crash file)"
        return "native-crash"
    if output == "program":
        if ev.get("exit_signal") in TORCH_WORKER_SIGNALS:
            ev["crash_stack_at"] = (
                "the worker's stderr, without a Python stack: the program enabled faulthandler itself "
                "(dlwatch leaves it alone), but in a DataLoader worker torch's handler takes "
                f'{ev["exit_signal"]} and prints only "ERROR: Unexpected ... encountered in worker."'
            )
        else:
            ev["crash_stack_at"] = (
                "the worker's stderr: the program enabled faulthandler itself (dlwatch leaves it alone), "
                "which wrote the stack there"
            )
        return "native-crash-stderr"
    ev["crash_stack_at"] = {
        "dlwatch": "nowhere: dlwatch's crash file stayed empty",
        "none": "nowhere: faulthandler was off in the worker",
    }.get(output, "not in this report (the worker did not say where its crash output went)")
    return "native-crash-no-stack"


FAILURE = Failure(
    playbook=WorkerKilled.playbook,
    detectors=(WorkerKilled,),
    enrich=_enrich,
    evidence_forms={
        "exit_signal": "text",
        "memory": "memory_history",
        "memory_limit": "text",
        "oom_kills": "text",
        "shm": "text",
        "crash_stack": "stack",
        "crash_frame": "text",
        "crash_stack_at": "text",
    },
    examples=("worker_segfault", "worker_killed", "worker_oom"),
)
