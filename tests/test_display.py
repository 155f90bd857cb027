"""report.md and the terminal view are for people: tables, units, short stacks; never a repr or JSON."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys
import time

from dlwatch.wire.playbooks import load_playbooks
from dlwatch.report import build, display, render, store

try:
    import tomllib
except ModuleNotFoundError:  # pragma: no cover
    import tomli as tomllib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what a repr or a JSON dump looks like inside text: a dict or list opened with a quote or a brace
REPR = re.compile(r"[\[{]\s*['\"{]|['\"]\s*:\s*[\[{'\"]|\bNone\b|\bTrue\b|\bFalse\b")


def deadlock_report() -> dict:
    """A stall report with the evidence shapes the worker-deadlock and fd-exhaustion matchers produce."""
    r = store.skeleton(trigger="stall", pid=31492, now=time.time())
    r["classification"] = "deadlock"
    r["progress"] = {
        "batches": 120,
        "epochs": 1,
        "data_wait_s": 4.5,
        "step_s": 130.0,
        "stall_s": 301.2,
        "stall_timeout_s": 300.0,
    }
    frames = [
        "0x7f1c4be44f16 (/usr/lib/x86_64-linux-gnu/libc.so.6)",
        "PyThread_acquire_lock_timed (/usr/lib/libpython3.11.so.1.0)",
        "select_poll_poll_impl (/build/Python-3.11.7/Modules/selectmodule.c:655)",
        "CachedSamples.__getitem__ (/home/u/proj/data/deadlock.py:46)",
        "_MapDatasetFetcher.fetch (/venv/lib/python3.11/site-packages/torch/utils/data/_utils/fetch.py:54)",
    ]
    r["findings"] = [
        {
            "playbook": "worker-deadlock",
            "title": "DataLoader workers deadlocked",
            "confidence": 0.9,
            "evidence": {
                "matched": [{"signal": "stall-deadlock", "confidence": 0.9, "description": "workers blocked"}],
                "workers": [
                    {
                        "pid": 31516 + i,
                        "worker_id": i,
                        "status": "blocked",
                        "state": "S",
                        "syscall": 202,
                        "wchan": "futex_do_wait",
                        "waiting_in": "lock acquire",
                        "cpu_progress_s": 0.0,
                        "frames": frames,
                    }
                    for i in range(2)
                ],
                "main": {
                    "pid": 31492,
                    "status": "idle",
                    "waiting_in": "queue get",
                    "cpu_progress_s": 0.0,
                    "frames": frames[2:],
                },
                "multiprocessing_context": "fork",
                "timeout": 0,
                "fds": {"file": 116, "shm": 2, "socket": 1, "pipe": 9, "other": 2, "shm_bytes": 3 << 20},
                "top_files": [["/data/shard-00.tar", 113], ["/data/shard-01.tar", 2]],
                "need_bytes": 5 << 30,
                "shm_free": 1 << 29,
                "stall_s": 301.2,
                "ignored_keys": [],
            },
            "remediation": "**The workers wait on a lock.** A lock held at fork is held forever.\n\n- Use spawn.\n",
        }
    ]
    r["processes"] = [
        build.process_entry(
            31492,
            "main",
            sample={
                "state": "S",
                "num_fds": 17,
                "fd_limit": 1024,
                "rss": 236646400,
                "uss": 14909440,
                "cpu_s": 1.4,
                "fds": {"file": 3, "shm": 0, "socket": 0, "pipe": 13, "other": 1, "shm_bytes": 0},
            },
        )
    ]
    w = build.process_entry(
        31516,
        "worker",
        worker_id=0,
        sample={"state": "S", "num_fds": 1021, "fd_limit": 1024, "rss": 171814912, "uss": 13271040},
    )
    w.update(
        status="blocked",
        waiting_in="lock acquire",
        cpu_progress_s=0.0,
        stack={
            "source": "py-spy",
            "threads": [
                {
                    "name": "MainThread",
                    "frames": [
                        {"function": "__getitem__", "filename": "/home/u/proj/ds.py", "line": 46, "native": False},
                        {
                            "function": "fetch",
                            "filename": "/venv/torch/utils/data/_utils/fetch.py",
                            "line": 54,
                            "native": False,
                        },
                    ],
                }
            ],
        },
    )
    r["processes"].append(w)
    return r


def test_every_shipped_evidence_key_has_a_display_form():
    for path in glob.glob(os.path.join(REPO, "playbooks", "*.toml")):
        with open(path, "rb") as f:
            keys = set((tomllib.load(f).get("evidence") or {}).keys())
        missing = keys - set(display.evidence_forms())
        assert not missing, f"{os.path.basename(path)}: no display form for {sorted(missing)}"
    assert load_playbooks(())  # the shipped set loads (the files checked above are the ones used)


def test_markdown_is_tables_and_units_not_reprs():
    md = render.render_markdown(deadlock_report())
    assert not REPR.search(md), REPR.search(md)
    assert "| pid | worker id | status | state | waiting in | cpu progress | at |" in md
    assert "| 31516 | 0 | blocked | S | lock acquire | 0.00 s | `CachedSamples.__getitem__ (deadlock.py:46)` |" in md
    assert "| 31516 | worker 0 | blocked | lock acquire | 0.00 s | 1021/1024 | 163.9 MiB | 12.7 MiB |" in md
    assert "- need: 5.0 GiB" in md and "- shm free: 512.0 MiB" in md and "- stall: 5.0 min" in md
    assert "- fds: 116 files, 2 shm (3.0 MiB), 1 sockets, 9 pipes, 2 other" in md
    assert "- top files: /data/shard-00.tar x113, /data/shard-01.tar x2" in md
    assert "- timeout: 0 (none)" in md and "- ignored keys: none" in md
    assert "- what to do: The workers wait on a lock. A lock held at fork is held forever. (details below)" in md
    # the stack excerpt: Python frames only, innermost first, short file names
    assert "- pid 31516 (worker 0): `__getitem__ (ds.py:46)` <- `fetch (fetch.py:54)`" in md


def test_terminal_headline_first_then_detail():
    lines = list(render.terminal_view(deadlock_report(), color=False))
    head = lines[: render.HEADLINE_LINES]
    assert head[0].startswith("STALL (deadlock):")
    assert any(line.startswith("  finding: worker-deadlock (90%) DataLoader workers deadlocked") for line in head)
    assert any(line.startswith("  -> The workers wait on a lock.") for line in head)
    assert any("no progress for 5.0 min" in line for line in head)
    text = "\n".join(lines)
    assert not REPR.search(text) and "\x1b" not in text
    assert "signals" not in text  # plumbing stays in report.md
    row = next(line for line in lines if line.strip().startswith("31516  worker 0"))
    assert row.split() == [
        "31516",
        "worker",
        "0",
        "blocked",
        "lock",
        "acquire",
        "0.00",
        "s",
        "1021/1024",
        "163.9",
        "MiB",
        "12.7",
        "MiB",
    ]
    assert all(len(line) <= 100 for line in lines)


def test_colour_only_on_a_tty_and_never_with_no_color(tmp_path):
    import pty

    inc = build.write(deadlock_report(), str(tmp_path))

    def show(env_extra, tty):
        env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM")}
        env.update(env_extra)
        if not tty:
            return subprocess.run(
                [sys.executable, "-m", "dlwatch", "report", inc], capture_output=True, env=env, timeout=60
            ).stdout
        master, slave = pty.openpty()
        try:
            p = subprocess.Popen([sys.executable, "-m", "dlwatch", "report", inc], stdout=slave, stderr=slave, env=env)
            os.close(slave)
            out = b""
            while True:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            p.wait(timeout=60)
            return out
        finally:
            os.close(master)

    assert b"\x1b[" in show({}, tty=True)
    assert b"\x1b[" not in show({"NO_COLOR": "1"}, tty=True)
    assert b"\x1b[" not in show({}, tty=False)
    assert show({}, tty=False).startswith(b"STALL (deadlock): ")


def test_hostile_strings_in_tables_stay_text():
    r = deadlock_report()
    r["findings"][0]["evidence"]["workers"][0]["waiting_in"] = "a | b `c` [x](http://e.invalid)\x1b[31m"
    md = render.render_markdown(r)
    row = next(line for line in md.splitlines() if line.startswith("  | 31516 |"))
    assert len(re.split(r"(?<!\\)\|", row.strip())) - 2 == 7  # the pipe inside did not make an eighth column
    assert "``a \\| b `c` [x](http://e.invalid)\x1b[31m``" in row
    term = "\n".join(render.terminal_view(r, color=True))
    assert "\\x1b[31m" in term and "\x1b[31m" not in term.replace("\x1b[1;31m", "")


def test_memory_evidence_reads_as_sizes_rates_and_shares():
    """The shapes of the memory-growth, pinned-memory and worker-killed evidence (hand-built)."""
    fit = {
        "rate_bytes_per_s": 1 << 20,
        "late_rate_bytes_per_s": 1 << 20,
        "rise_bytes": 300 << 20,
        "window_s": 300.0,
        "points": 30,
        "first": 100 << 20,
        "last": 400 << 20,
    }
    ev = {
        "rate_bytes_per_s": 3 << 20,
        "headroom_bytes": 5 << 30,
        "limit": "cgroup memory limit",
        "limit_in_s": 1800.0,
        "copy_on_read": True,
        "memory_share": 0.93,
        "growth": [{"pid": 11, "worker_id": 0, "uss": fit, "rss_first": 1 << 30, "rss_last": 1 << 30}],
        "memory": [{"ts": 1.0, "rss": 1 << 30, "uss": 1 << 28}, {"ts": 2.0, "rss": 2 << 30, "uss": 1 << 29}],
        "lockers": [{"pid": 3, "vm_lck": 1 << 30, "memlock_limit": 2 << 30, "memlock_share": 0.5}],
    }
    items = dict(display.evidence_items(ev))
    assert items["rate"] == "3.0 MiB/s" and items["headroom"] == "5.0 GiB" and items["time to limit"] == "30.0 min"
    assert items["copy on read"] == "yes" and items["memory share"] == "93%"
    assert items["memory"] == "RSS 1.0 GiB -> 2.0 GiB, USS 256.0 MiB -> 512.0 MiB (2 samples)"
    assert items["growth"].rows[0] == (
        "11",
        "0",
        "+300.0 MiB over 5.0 min at 1.0 MiB/s (lately 1.0 MiB/s) from 100.0 MiB to 400.0 MiB",
        "1.0 GiB",
        "1.0 GiB",
    )
    assert items["lockers"].headers == ("pid", "VmLck", "RLIMIT_MEMLOCK", "memlock share")
    assert items["lockers"].rows[0] == ("3", "1.0 GiB", "2.0 GiB", "50%")
    md = render.render_markdown(
        {
            **deadlock_report(),
            "findings": [{"playbook": "worker-memory-growth", "title": "t", "confidence": 0.8, "evidence": ev}],
        }
    )
    assert not REPR.search(md)


def test_run_summary_evidence_is_for_people_too():
    """summary.md and `dlwatch report RUN-ID` render advice and preflight evidence as the incident
    documents do: tables for lists of records, units for sizes and shares, no repr."""
    import threading

    from dlwatch.inproc import preflight
    from dlwatch.report import summary as sm

    stop = threading.Event()
    t = threading.Thread(target=stop.wait, name="uploader", daemon=True)
    t.start()
    try:
        thread = preflight.thread_info(t)
    finally:
        stop.set()
        t.join(5)
    s = sm.skeleton(run_id="20261201T101010-42-abcdef", pid=42, now=time.time())
    s["advice"] = [
        {
            "playbook": "input-bound",
            "title": "The loop waits for data",
            "confidence": 0.8,
            "evidence": {
                "steady_data_wait_share": 0.8377,
                "cause": "cpu-saturated",
                "num_workers": 2,
                "workers": [{"pid": 7, "worker_id": 0, "cpu_util": 0.98}],
            },
            "remediation": "**The workers are saturated on CPU.** Make each sample cheaper.\n",
        }
    ]
    s["preflight"] = [
        {
            "playbook": "fork-with-threads",
            "title": "Workers forked beside threads",
            "confidence": 0.7,
            "evidence": {"start_method": "fork", "num_threads": 1, "threads": [thread]},
            "remediation": "Start threads after the workers.\n",
        }
    ]
    md = sm.render_markdown(s)
    term = "\n".join(sm.terminal_lines(s))
    for text in (md, term):
        found = REPR.search(text)
        assert not found, text[max(0, found.start() - 80) : found.end() + 80]
        assert "steady data wait share: 84%" in text and "uploader" in text
    assert "| name | daemon | ident | runs |" in md  # the threads as a table
    assert any(line.split()[:2] == ["name", "daemon"] for line in term.splitlines())


def test_words_are_never_cut_inside_and_plurals_agree():
    assert display.cut_words("the workers' lock when they forked", 20) == "the workers' lock..."
    assert display.cut_words("short", 20) == "short"
    assert display.cut_words("x" * 30, 10) == "x" * 7 + "..."  # one word longer than the room: cut inside it
    assert [display.count(n, "epoch") for n in (0, 1, 2)] == ["0 epochs", "1 epoch", "2 epochs"]
    assert [display.count(n, "batch") for n in (1, 3)] == ["1 batch", "3 batches"]
    lines = render.wrap("no progress for 3.06 s; 0 batches, data wait 3.06 s, loop body 0.00 s", 64, "  ", "    ")
    assert lines == ["  no progress for 3.06 s; 0 batches, data wait 3.06 s, loop body", "    0.00 s"]


def test_a_summary_says_why_a_worker_has_no_figures_and_why_no_advice():
    from dlwatch.report import runview

    seen = {"worker_id": 1, "pid": 9, "cpu_util": 0.5, "state_share": {"running": 0.5, "io": 0.5}, "polls": 4}
    assert runview.worker_words(seen).startswith("cpu 0.5 cores; running 50%, io 50%; RSS peak -")
    assert runview.worker_words({"worker_id": 0, "pid": 8, "polls": 0}) == (
        "not sampled: it started and ended between two polls"
    )
    assert runview.worker_words({"worker_id": 0, "pid": 8, "polls": 1, "rss_peak": 1 << 20}).endswith(
        "sampled by one poll: cpu and states need two"
    )
    s = {"loop": {}, "advice": []}
    assert runview.no_advice_line(s) == "No advice: nothing in this run's figures called for a change."
    s["advice_not_judged"] = [
        {
            "playbook": "input-bound",
            "unmet": [
                {"figure": "steady_batches", "needs": 20, "value": 12},
                {"figure": "steady_loop_s", "needs": 5.0, "value": 0.8},
            ],
        }
    ]
    assert runview.no_advice_line(s) == (
        "No advice: too short to judge input-bound (needs at least 20 steady batches, this run 12; "
        "at least 5.00 s of steady loop time, this run 0.80 s); nothing else in this run's figures called for a change."
    )
