"""An incident's size bound: report.json stays under MAX_REPORT_JSON_BYTES and says what was cut.

collect/bounds.py bounds the stacks of each process as they are read; a job of many processes,
a long timeline of wide samples or a huge exception message can still add up.  ``bound_report``
runs on every incident before it is written (build.write): it fills ``truncated`` (what the
stack bounds left out, and each step taken here) and, only while report.json would be larger
than the cap, takes the steps of ``_STEPS`` in order, least useful evidence first.
"""

from __future__ import annotations

import json
from typing import Any, Callable

from dlwatch.collect import bounds

__all__ = ["MAX_REPORT_JSON_BYTES", "bound_report"]

MAX_REPORT_JSON_BYTES = 4 << 20
_MAX_STRING_CHARS = 16 << 10  # the last step: any one string (an exception message of megabytes)


def _size(report: dict[str, Any]) -> int:
    return len(json.dumps(report, default=str, separators=(",", ":")).encode("utf-8", "surrogateescape"))


def _stacks(report: dict[str, Any]) -> list[dict[str, Any]]:
    out = []
    for p in report.get("processes") or ():
        if isinstance(p, dict):
            if isinstance(p.get("stack"), dict):
                out.append(p["stack"])
            crash = p.get("crash")
            if isinstance(crash, dict) and isinstance(crash.get("stack"), dict):
                out.append(crash["stack"])
    return out


def _threads(report: dict[str, Any]) -> list[dict[str, Any]]:
    return [t for s in _stacks(report) for t in s.get("threads") or () if isinstance(t, dict)]


def _retrim_frames(keep: int, outer: int) -> Callable[[dict[str, Any]], str | None]:
    def step(report: dict[str, Any]) -> str | None:
        left = 0
        for t in _threads(report):
            frames = t.get("frames")
            if not isinstance(frames, list) or len(frames) <= keep:
                continue
            t["frames"] = frames[: keep - outer] + frames[len(frames) - outer :]
            left += len(frames) - keep
            # an earlier gap (after the innermost frames kept then) lies inside the one made now
            t["frames_omitted"] = (t.get("frames_omitted") or 0) + len(frames) - keep
            t["frames_omitted_after"] = keep - outer
        return f"stack frames: at most {keep} per thread ({left} more left out)" if left else None

    return step


def _retrim_threads(keep: int) -> Callable[[dict[str, Any]], str | None]:
    def step(report: dict[str, Any]) -> str | None:
        left = 0
        for s in _stacks(report):
            threads = s.get("threads")
            if isinstance(threads, list) and len(threads) > keep:
                gil = [i for i, t in enumerate(threads) if isinstance(t, dict) and t.get("owns_gil")]
                chosen = set((gil + [i for i in range(len(threads)) if i not in gil])[:keep])
                s["threads"] = [t for i, t in enumerate(threads) if i in chosen]
                s["threads_omitted"] = (s.get("threads_omitted") or 0) + len(threads) - keep
                left += len(threads) - keep
        return f"threads: at most {keep} per process ({left} more left out)" if left else None

    return step


def _thin_timeline(keep: int) -> Callable[[dict[str, Any]], str | None]:
    def step(report: dict[str, Any]) -> str | None:
        records = report.get("timeline")
        if not isinstance(records, list) or len(records) <= keep:
            return None
        # evenly, the newest always: the charts keep their span
        k = -(-len(records) // keep)
        kept = records[::-1][::k][::-1]
        report["timeline"] = kept
        return f"timeline: {len(kept)} of its {len(records)} records kept (every {k}th, the newest last)"

    return step


def _newest_events(keep: int) -> Callable[[dict[str, Any]], str | None]:
    def step(report: dict[str, Any]) -> str | None:
        events = report.get("events")
        if not isinstance(events, list) or len(events) <= keep:
            return None
        report["events"] = events[-keep:]
        return f"events: the newest {keep} of {len(events)} kept"

    return step


def _drop_worker_stacks(report: dict[str, Any]) -> str | None:
    dropped = []
    for p in report.get("processes") or ():
        if (
            isinstance(p, dict)
            and p.get("role") != "main"
            and isinstance(p.get("stack"), dict)
            and p["stack"].get("threads")
        ):
            n = len(p["stack"]["threads"])
            p["stack"]["threads"] = []
            p["stack"]["threads_omitted"] = (p["stack"].get("threads_omitted") or 0) + n
            dropped.append(p.get("pid"))
    return f"stacks of {len(dropped)} processes other than the main one left out" if dropped else None


def _cut_strings(report: dict[str, Any]) -> str | None:
    cut = 0

    def walk(v: Any) -> Any:
        nonlocal cut
        if isinstance(v, str) and len(v) > _MAX_STRING_CHARS:
            cut += 1
            return v[:_MAX_STRING_CHARS] + f"\u2026 [{len(v) - _MAX_STRING_CHARS} characters cut]"
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    for key in list(report):
        if key != "truncated":
            report[key] = walk(report[key])
    return f"{cut} strings cut at {_MAX_STRING_CHARS} characters" if cut else None


# Least useful first; each runs only while report.json is over the cap.
_STEPS: tuple[Callable[[dict[str, Any]], str | None], ...] = (
    _retrim_frames(40, 10),
    _thin_timeline(30),
    _retrim_frames(10, 3),
    _retrim_threads(8),
    _newest_events(20),
    _drop_worker_stacks,
    _thin_timeline(5),
    _cut_strings,
)


def _stack_pids(report: dict[str, Any], key: str) -> list[Any]:
    """The pids whose stack has ``key`` set (py-spy stopped by its memory limit, or never run)."""
    return sorted(
        {
            p.get("pid")
            for p in report.get("processes") or ()
            if isinstance(p, dict) and isinstance(p.get("stack"), dict) and p["stack"].get(key)
        },
        key=str,
    )


def bound_report(report: dict[str, Any]) -> None:
    """Bound ``report`` in place and set ``report["truncated"]`` (None when nothing was cut); never raises."""
    try:
        steps: list[str] = []
        size = _size(report)
        for step in _STEPS:
            if size <= MAX_REPORT_JSON_BYTES:
                break
            what = step(report)
            if what:
                steps.append(what)
                size = _size(report)
        threads = _threads(report)
        stacks = _stacks(report)
        cut_pids = sorted(
            {
                p.get("pid")
                for p in report.get("processes") or ()
                if isinstance(p, dict) and isinstance(p.get("stack"), dict) and p["stack"].get("cut_at_bytes")
            },
            key=str,
        )
        memory_pids = _stack_pids(report, "memory_cut_bytes")
        not_run_pids = _stack_pids(report, "not_run")
        truncated = {
            "frames_omitted": sum(int(t.get("frames_omitted") or 0) for t in threads),
            "threads_omitted": sum(int(s.get("threads_omitted") or 0) for s in stacks),
            "dumps_cut": cut_pids,
            "report": steps,
        }
        if memory_pids:  # keys of an older report unless something was cut this way
            truncated["py_spy_memory_cut"] = memory_pids
        if not_run_pids:
            truncated["stacks_not_run"] = not_run_pids
        if not any(truncated.values()):
            report["truncated"] = None
            return
        truncated["limits"] = dict(bounds.limits(), report_json_bytes=MAX_REPORT_JSON_BYTES)
        report["truncated"] = truncated
        parts = [
            f"{truncated['frames_omitted']} stack frames" if truncated["frames_omitted"] else "",
            f"{truncated['threads_omitted']} threads" if truncated["threads_omitted"] else "",
            f"the dumps of pids {', '.join(map(str, cut_pids))} past their read cap" if cut_pids else "",
            f"the stacks of pids {', '.join(map(str, memory_pids))} (py-spy reached its memory limit)"
            if memory_pids
            else "",
            f"the stacks of pids {', '.join(map(str, not_run_pids))} (no time left for their py-spy)"
            if not_run_pids
            else "",
        ]
        what = ", ".join(p for p in parts if p)
        note = (
            "evidence left out to keep the report bounded: "
            + "; ".join(x for x in [what, *steps] if x)
            + " (see `truncated` in report.json)"
        )
        if isinstance(report.get("notes"), list):
            report["notes"].append(note)
    except Exception as exc:  # a bound must never cost the report itself
        report["truncated"] = {"error": f"{type(exc).__name__}: {exc}"}
