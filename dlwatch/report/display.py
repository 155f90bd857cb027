"""Display forms: report values as people read them (units, tables, stack excerpts), never a repr.

Pure functions from report data to strings and :class:`Table` s; the Markdown, terminal
and HTML renderers lay them out.  Every evidence key of the shipped playbooks has a
form (tests check it): its failure module declares it (see :func:`evidence_forms`),
or ``EVIDENCE_FORMS`` here for the keys failures share; a key a user's playbook adds is shown by
its name's unit suffix (``_bytes``, ``_s``) or its shape (a list of records is a table).
Values are untrusted and of any type: every function here accepts anything.
"""

from __future__ import annotations

import functools
import os
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from dlwatch.report.schema import ProcessEntry


@dataclass(frozen=True)
class Table:
    headers: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]


# ---------------------------------------------------------------------------- scalars


def human_bytes(n: Any) -> str:
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        return "?" if n is not None else "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def human_seconds(s: Any) -> str:
    if isinstance(s, bool) or not isinstance(s, (int, float)):
        return "?" if s is not None else "-"
    s = float(s)
    if s != s:  # NaN
        return "?"
    if abs(s) < 10:
        return f"{s:.2f} s"
    if abs(s) < 120:
        return f"{s:.1f} s"
    if abs(s) < 7200:
        return f"{s / 60:.1f} min"
    return f"{s / 3600:.1f} h"


def human_number(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.3g}" if abs(v) < 1e6 else f"{v:.4g}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 100000 else str(v)
    return one_line(v)


def one_line(v: Any, limit: int = 300) -> str:
    text = " ".join(str(v).split()) if not isinstance(v, str) else " ".join(v.splitlines())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def cut_words(text: str, limit: int) -> str:
    """``text`` within ``limit`` characters, cut between two words and marked ``...`` where it is
    longer (a single word longer than the limit is cut inside: nothing else is)."""
    if len(text) <= limit:
        return text
    room = max(1, limit - 3)
    head = text[: room + 1]
    cut = head.rfind(" ")
    head = head[:cut] if cut > room // 2 else text[:room]
    return head.rstrip(" ,;:-") + "..."


def count(n: Any, noun: str, plural: str | None = None) -> str:
    """``1 epoch``, ``2 epochs``, ``1 batch``, ``3 batches``: a number and its noun, the plural right."""
    if isinstance(n, bool) or not isinstance(n, (int, float)):
        return f"{human_number(n)} {plural or _plural(noun)}"
    return f"{human_number(n)} {noun if n == 1 else plural or _plural(noun)}"


def _plural(noun: str) -> str:
    return noun + "es" if noun.endswith(("s", "sh", "tch", "x")) else noun + "s"  # batches; epochs


def percent(v: Any) -> str:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return "-"
    return f"{v:.0%}" if v <= 1 else f"{v:.0f}%"


BYTES_KEYS = {
    "rss",
    "uss",
    "pss",
    "shm_free",
    "shm_total",
    "mem_available",
    "mlocked",
    "memory_used",
    "memory_total",
    "cgroup_memory_limit",
    "cgroup_memory_usage",
    "vm_lck",
    "memlock_limit",
}
# nested figures named only "first"/"last" take their unit from the key above them
_BYTES_PARENTS = BYTES_KEYS | {"growth", "memory"}


def _is_bytes_key(key: str) -> bool:
    return key.endswith("_bytes") or key in BYTES_KEYS or key.startswith(("rss_", "uss_", "vm_lck_"))


def scalar(key: str, v: Any, parent: str = "") -> str:
    """One value by its key's unit: sizes with units, rates per second, durations in s/min, shares in %."""
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        if key.endswith("_bytes_per_s"):
            return f"{human_bytes(v)}/s"
        if _is_bytes_key(key) or (key in ("first", "last") and parent in _BYTES_PARENTS):
            return human_bytes(v)
        if key.endswith("_ts") or key == "ts":
            try:
                return time.strftime("%H:%M:%S", time.gmtime(float(v))) + " UTC"
            except (OverflowError, ValueError, OSError):
                return human_number(v)
        if key.endswith("_s") or key in ("timeout",):
            return human_seconds(v) if v or key != "timeout" else "0 (none)"
        if key == "confidence" or key.endswith("_share"):
            return percent(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return human_number(v)
    return inline(v)


def inline(v: Any, depth: int = 0, parent: str = "") -> str:
    """A nested value on one line, as words: ``a 1, b 2``; lists comma-separated."""
    if depth > 3:
        return "..."
    if isinstance(v, Mapping) and "rate_bytes_per_s" in v and "first" in v:
        return str(_growth(v))  # a growth fit reads as a sentence
    if isinstance(v, Mapping):
        parts = [
            f"{label(str(k))} {scalar(str(k), x, parent) if not isinstance(x, (Mapping, list, tuple)) else inline(x, depth + 1, str(k))}"
            for k, x in list(v.items())[:12]
        ]
        return ", ".join(parts) + (", ..." if len(v) > 12 else "")
    if isinstance(v, (list, tuple)):
        if v and all(isinstance(x, (list, tuple)) and len(x) == 2 for x in v[:12]):
            return ", ".join(f"{one_line(a, 120)} x{human_number(b)}" for a, b in v[:12]) + (
                ", ..." if len(v) > 12 else ""
            )
        return ", ".join(
            inline(x, depth + 1) if isinstance(x, (Mapping, list, tuple)) else scalar("", x) for x in v[:12]
        ) + (", ..." if len(v) > 12 else "")
    return scalar("", v)


# ---------------------------------------------------------------------------- stacks

_PY_FRAME = re.compile(r"\.pyw?(:\d+)?\)$")


def _is_native(frame: str) -> bool:
    """py-spy's native frames name a .so, a .c file or an address; Python ones a .py file."""
    return not _PY_FRAME.search(frame.strip())


def frame_excerpt(frames: Any, n: int = 4) -> tuple[str, ...]:
    """The innermost Python frames of a frame list (strings or frame records), innermost first."""
    if not isinstance(frames, (list, tuple)):
        return ()
    out: list[str] = []
    for f in frames:
        if isinstance(f, Mapping):
            if f.get("native"):
                continue
            name = f.get("filename")
            where = (
                f"{os.path.basename(str(name))}:{f.get('line')}"
                if name and f.get("line") is not None
                else (os.path.basename(str(name)) if name else "")
            )
            text = f"{one_line(f.get('function'), 80)} ({where})" if where else one_line(f.get("function"), 80)
        elif isinstance(f, str):
            if _is_native(f):
                continue
            text = _short_frame(f)
        else:
            continue
        out.append(text)
        if len(out) >= n:
            break
    return tuple(out)


def _short_frame(text: str) -> str:
    """``fn (/long/path/file.py:12)`` -> ``fn (file.py:12)``."""
    text = one_line(text, 200)
    if text.endswith(")") and " (" in text:
        fn, _, where = text[:-1].rpartition(" (")
        return f"{fn} ({os.path.basename(where)})"
    return text


def thread_frames(stack: Any) -> list[Any]:
    """The main thread's frames (else the first thread's) of a StackDump record."""
    if not isinstance(stack, Mapping):
        return []
    threads = (
        [t for t in stack.get("threads") or () if isinstance(t, Mapping)]
        if isinstance(stack.get("threads"), (list, tuple))
        else []
    )
    if not threads:
        return []
    main = next((t for t in threads if t.get("name") == "MainThread"), threads[0])
    frames = main.get("frames")
    return list(frames) if isinstance(frames, (list, tuple)) else []


# ---------------------------------------------------------------------------- processes

PROCESS_HEADERS = ("pid", "role", "state", "waiting in", "CPU progress", "fds/limit", "RSS", "USS")


def _get(m: Any, key: str) -> Any:
    return m.get(key) if isinstance(m, Mapping) else None


def process_row(p: ProcessEntry) -> tuple[str, ...]:
    s = p.sample or {}
    role = one_line(p.role or "?", 20)
    if p.worker_id is not None:
        role += f" {one_line(p.worker_id, 6)}"
    state = p.status or _get(s, "state") or "-"
    if _get(s, "gone"):
        state = f"{state}, gone" if p.status and p.status != "gone" else "gone"
    progress = p.cpu_progress_s
    cpu = (
        human_seconds(progress)
        if progress is not None
        else (f"{human_seconds(_get(s, 'cpu_s'))} total" if _get(s, "cpu_s") is not None else "-")
    )
    fds = (
        f"{human_number(_get(s, 'num_fds'))}/{human_number(_get(s, 'fd_limit'))}"
        if _get(s, "num_fds") is not None
        else "-"
    )
    return (
        human_number(p.pid),
        role,
        one_line(state, 20),
        one_line(p.waiting_in or "-", 40),
        cpu,
        fds,
        human_bytes(_get(s, "rss")),
        human_bytes(_get(s, "uss")),
    )


def process_table(procs: Sequence[ProcessEntry]) -> Table:
    return Table(PROCESS_HEADERS, tuple(process_row(p) for p in procs))


def process_excerpts(procs: Sequence[ProcessEntry], n: int = 4) -> list[tuple[str, tuple[str, ...]]]:
    """Per process with a stack: its label and its innermost Python frames."""
    out = []
    for p in procs:
        threads = p.stack.main_first() if p.stack is not None else []
        frames = frame_excerpt([f.to_dict() for f in threads[0].frames or ()] if threads else [], n)
        if frames:
            who = one_line(p.role or "?", 20) + (f" {p.worker_id}" if p.worker_id is not None else "")
            out.append((f"pid {human_number(p.pid)} ({who})", frames))
    return out


# ---------------------------------------------------------------------------- evidence

# Columns of a per-process evidence record, in this order; other keys follow.
_RECORD_ORDER = (
    "pid",
    "worker_id",
    "role",
    "status",
    "state",
    "waiting_in",
    "wait",
    "kind",
    "thread",
    "peer",
    "tcp_state",
    "file",
    "cpu_progress_s",
    "num_fds",
    "fd_limit",
    "rss",
    "uss",
    "stall_s",
)
_RECORD_SKIP = {"frames", "syscall", "wchan", "sockets", "ts"}


def records_table(records: Sequence[Any]) -> Table:
    """A list of records as a table: known columns first, frames as the innermost Python frame."""
    recs = [r for r in records if isinstance(r, Mapping)]
    keys: list[str] = [k for k in _RECORD_ORDER if any(k in r for r in recs)]
    for r in recs:
        keys.extend(str(k) for k in r if str(k) not in keys and str(k) not in _RECORD_SKIP)
    has_frames = any(isinstance(r.get("frames"), (list, tuple)) for r in recs) and not any("frame" in k for k in keys)
    headers = tuple(label(k) for k in keys) + (("at",) if has_frames else ())
    rows = []
    for r in recs[:64]:
        row = [
            (_short_frame(r[k]) if "frame" in k and isinstance(r.get(k), str) else scalar(k, r.get(k)))
            if not isinstance(r.get(k), (Mapping, list, tuple))
            else inline(r.get(k), 0, k)
            for k in keys
        ]
        if has_frames:
            row.append((frame_excerpt(r.get("frames"), 1) or ("-",))[0])
        rows.append(tuple(one_line(c, 120) for c in row))
    return Table(headers, tuple(rows))


_LABELS = {
    "limit_bytes": "limit size",
    "limit_in_s": "time to limit",
    "rate_bytes_per_s": "rate",
    "late_rate_bytes_per_s": "late rate",
    "vm_lck": "VmLck",
    "memlock_limit": "RLIMIT_MEMLOCK",
    "rss": "RSS",
    "uss": "USS",
    "rss_first": "RSS first",
    "rss_last": "RSS last",
}


def label(key: str) -> str:
    """``cpu_progress_s`` -> ``cpu progress``: the unit is in the value."""
    key = str(key)
    if key in _LABELS:
        return _LABELS[key]
    if key.endswith("_bytes_per_s"):
        key = key[: -len("_bytes_per_s")] + "_rate"
    for suffix in ("_bytes", "_s"):
        if key.endswith(suffix) and len(key) > len(suffix):
            key = key[: -len(suffix)]
    return key.replace("_", " ")


def _fds(v: Any) -> str:
    if not isinstance(v, Mapping):
        return inline(v)
    parts = [
        f"{human_number(v.get('file'))} files",
        f"{human_number(v.get('shm'))} shm" + (f" ({human_bytes(v.get('shm_bytes'))})" if v.get("shm_bytes") else ""),
        f"{human_number(v.get('socket'))} sockets",
        f"{human_number(v.get('pipe'))} pipes",
        f"{human_number(v.get('other'))} other",
    ]
    return ", ".join(parts)


def _signals(v: Any) -> list[str]:
    out = []
    for m in v if isinstance(v, (list, tuple)) else ():
        if isinstance(m, Mapping):
            out.append(
                f"{one_line(m.get('signal'), 60)} ({percent(m.get('confidence'))}): {one_line(m.get('description') or '', 200)}"
            )
    return out


def _process(v: Any) -> Table | str:
    if isinstance(v, Mapping):
        return records_table([v])
    return inline(v)


def _stack(v: Any) -> list[str]:
    if isinstance(v, str):  # a faulthandler dump as text: its innermost lines
        return [one_line(line, 200) for line in v.strip().splitlines()[-8:]] or ["-"]
    if isinstance(v, Mapping):
        return list(frame_excerpt(thread_frames(v), 8)) or [inline(v)]
    return list(frame_excerpt(v, 8)) if isinstance(v, (list, tuple)) else [inline(v)]


def _growth(v: Any) -> str | Table:
    """A steady-growth fit: the rise, over how long, at what rate, from what to what."""
    if isinstance(v, (list, tuple)):
        return records_table(v) if v else "none"
    if not isinstance(v, Mapping):
        return scalar("growth", v)
    parts = []
    if v.get("rise_bytes") is not None:
        parts.append(f"+{human_bytes(v.get('rise_bytes'))}")
    if v.get("window_s") is not None:
        parts.append(f"over {human_seconds(v.get('window_s'))}")
    if v.get("rate_bytes_per_s") is not None:
        parts.append(f"at {human_bytes(v.get('rate_bytes_per_s'))}/s")
    if v.get("late_rate_bytes_per_s") is not None:
        parts.append(f"(lately {human_bytes(v.get('late_rate_bytes_per_s'))}/s)")
    if v.get("first") is not None and v.get("last") is not None:
        parts.append(f"from {human_bytes(v.get('first'))} to {human_bytes(v.get('last'))}")
    return " ".join(parts) or inline(v, 0, "growth")


def _memory_history(v: Any) -> str:
    """RSS/USS samples up to the end: the first and the last, and how many."""
    recs = [r for r in v if isinstance(r, Mapping)] if isinstance(v, (list, tuple)) else []
    if not recs:
        return inline(v, 0, "memory") if v else "none"
    first, last = recs[0], recs[-1]
    text = f"RSS {human_bytes(first.get('rss'))} -> {human_bytes(last.get('rss'))}"
    if first.get("uss") is not None or last.get("uss") is not None:
        text += f", USS {human_bytes(first.get('uss'))} -> {human_bytes(last.get('uss'))}"
    return text + f" ({len(recs)} samples)"


# key -> form: "bytes", "seconds", "count", "text", "table" (records), "lines", or a function.
# The keys of one failure's evidence are declared by its module (``evidence_forms`` in
# dlwatch/detect/<failure>.py, by name: see dlwatch.detect.registry.FORM_NAMES); these are
# the keys every failure shares, and those of the advice playbooks and preflight checks.
EVIDENCE_FORMS: dict[str, Any] = {
    "matched": _signals,
    "points_at": "table",
    "frames": _stack,  # stacks in evidence
    # shared by several failures
    "workers": "table",
    "timeout": "seconds",
    "pid": "text",
    "role": "text",
    "worker_id": "text",
    "cause": "text",
    "cause_basis": "text",
    "pressure": "text",
    "errno": "text",
    "loader": "text",
    "text": "text",
    # advice playbooks (the run summary) and preflight checks
    "steady_data_wait_share": "text",
    "steady_data_wait_s": "seconds",
    "steady_batch_s": "seconds",
    "num_workers": "count",
    "usable_cpus": "text",
    "worker_cpu_util_mean": "text",
    "worker_state_share": "text",
    "suggested_num_workers": "count",
    "affinity_cpus": "count",
    "cgroup_cpu_quota": "text",
    "worker_running_share": "text",
    "epochs": "count",
    "first_batch_mean_s": "seconds",
    "first_batch_per_epoch_s": "text",
    "first_batch_factor": "text",
    "cost_per_epoch_s": "seconds",
    "cost_total_s": "seconds",
    "prefetch_factor": "count",
    "batch_bytes": "bytes",
    "inflight_bytes": "bytes",
    "blocked_put_share": "text",
    "saves_bytes": "bytes",
    "shm_used_peak": "bytes",
    "pin_memory": "text",
    "cuda_available": "text",
    "accelerator": "text",
    "epochs_started": "count",
    "datasets_ordered": "count",
    "sampler_epoch_each_epoch": "text",
    "shuffle": "text",
    "seed": "text",
    "num_replicas": "count",
    "worker_uss_peak_median": "bytes",
    "workers_private_bytes": "bytes",
    "share_of_limit": "text",
    "tensors_per_batch": "count",
    "fds_in_flight": "count",
    "start_method": "text",
    "cuda_initialized": "text",
    "threads": "table",
}

# the display functions a failure module names in its evidence_forms
_FORM_FUNCTIONS: dict[str, Callable[[Any], Any]] = {
    "process": _process,
    "fds": _fds,
    "growth": _growth,
    "memory_history": _memory_history,
    "stack": _stack,
    "signals": _signals,
}


@functools.lru_cache(maxsize=1)
def evidence_forms() -> dict[str, Any]:
    """Every evidence key's form: the shared ones above and each failure's own (dlwatch.detect.registry)."""
    from dlwatch.detect import registry

    forms: dict[str, Any] = {k: _FORM_FUNCTIONS.get(v, v) for k, v in registry.evidence_forms().items()}
    forms.update(EVIDENCE_FORMS)
    return forms


PLUMBING_KEYS = {"matched", "ts", "event", "signal"}


def evidence_value(key: str, v: Any) -> str | Table | list[str]:
    """One evidence value: a line of text, a table, or lines (stack excerpt, signals)."""
    form = evidence_forms().get(key)
    if callable(form):
        return form(v)
    if isinstance(v, (list, tuple)) and v and all(isinstance(x, Mapping) for x in v):
        return records_table(v)
    if isinstance(v, Mapping) and v and all(isinstance(x, Mapping) for x in v.values()):
        return records_table([{"key": k, **x} for k, x in v.items()])
    if form == "bytes":
        return human_bytes(v) if isinstance(v, (int, float)) else inline(v)
    if form == "seconds":
        return scalar(key if key.endswith("_s") or key == "timeout" else key + "_s", v)
    if isinstance(v, (Mapping, list, tuple)):
        return inline(v) if v else "none"
    return scalar(key, v)


def evidence_items(evidence: Any, *, plumbing: bool = True) -> list[tuple[str, str | Table | list[str]]]:
    if not isinstance(evidence, Mapping):
        return [("evidence", inline(evidence))] if evidence else []
    items = []
    for k, v in evidence.items():
        key = str(k)
        if not plumbing and key in PLUMBING_KEYS:
            continue
        name = "signals" if key == "matched" else label(key)
        items.append((one_line(name, 60), evidence_value(key, v)))
    return items


# ---------------------------------------------------------------------------- layout helpers


def text_table(table: Table, width: int = 80, max_rows: int | None = None) -> list[str]:
    """Plain columns for a terminal, cut to ``width``."""
    rows = list(table.rows[:max_rows] if max_rows is not None else table.rows)
    cols = len(table.headers)
    widths = [len(h) for h in table.headers]
    for r in rows:
        for i, c in enumerate(r[:cols]):
            widths[i] = max(widths[i], len(c))
    widths = [min(w, 40) for w in widths]

    def fmt(cells: Sequence[str]) -> str:
        parts = []
        for i in range(cols):
            c = cells[i] if i < len(cells) else ""
            c = c if len(c) <= widths[i] else c[: widths[i] - 1] + "~"
            parts.append(c.ljust(widths[i]))
        line = "  ".join(parts).rstrip()
        return line if len(line) <= width else line[: width - 1] + "~"

    out = [fmt(table.headers)]
    out.extend(fmt(r) for r in rows)
    if max_rows is not None and len(table.rows) > max_rows:
        out.append(f"... {len(table.rows) - max_rows} more")
    return out


def md_cell(text: str, code_fn: Callable[[Any], str] | None = None) -> str:
    """A Markdown table cell: one line, pipes escaped; untrusted text as inline code."""
    text = one_line(text, 300)
    if code_fn is not None and text not in ("-", "") and not _plain_safe(text):
        text = code_fn(text)
    return text.replace("|", "\\|")


def _plain_safe(text: str) -> bool:
    # digits, units and simple words need no code span; anything with markup characters does
    return all(ch.isalnum() or ch in " .,:;%/-+~()'" for ch in text)


def md_table(table: Table, code_fn: Callable[[Any], str]) -> list[str]:
    if not table.rows:
        return []
    out = [
        "| " + " | ".join(md_cell(h) for h in table.headers) + " |",
        "|" + "|".join("---" for _ in table.headers) + "|",
    ]
    for r in table.rows:
        cells = list(r) + [""] * (len(table.headers) - len(r))
        out.append("| " + " | ".join(md_cell(c, code_fn) for c in cells[: len(table.headers)]) + " |")
    return out
