"""report.json and summary.json stay byte-compatible: real runs against what the dict-based builder wrote.

The fixtures in tests/golden/ were written by the code as it was before the typed schema
(dlwatch/report/schema.py), from the same real runs: an exception with the monitor running, an
exception after the monitor was killed (the finisher writes it), the training process SIGKILLed
(an exit incident and a `vanished` summary), a real deadlock (a stall incident with py-spy stacks)
and `dlwatch attach` on it.  What differs from run to run (ids, times, pids, measured figures,
how many samples the timeline holds) is normalised away; every key, the order of the keys at
every level, and every value that does not depend on the run are compared.

Regenerate (only when the report layout is extended on purpose, in the same commit as the docs):
``DLWATCH_WRITE_GOLDEN=1 python -m pytest -q tests/test_schema_golden.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import sys

import pytest

from conftest import REPO, incidents, wait_for

GOLDEN = os.path.join(os.path.dirname(__file__), "golden")
WRITE = bool(os.environ.get("DLWATCH_WRITE_GOLDEN"))

# numbers that do not depend on the run (configuration, verdicts); every other number is "<num>"
STABLE_NUMBERS = {
    "schema_version",
    "worker_id",
    "batch_size",
    "num_workers",
    "prefetch_factor",
    "timeout",
    "confidence",
    "errno",
    "poll_interval",
    "stall_timeout",
    "rank",
    "local_rank",
    "world_size",
    "local_world_size",
    "dataset_len",
}
# present, null or of another shape depending on when the process was last sampled (a worker
# just started, a process gone): their shape is the collector's, passed through by the builder
TIMING = {"cmdline", "name", "sample", "workers", "main"}
# measured per run: kept as the sorted set of their keys (a key appears or not with the sample)
SHAPE_ONLY = {"system", "stack", "io_wait", "cpus", "loop", "peaks", "main", "evidence"}


def _text(s: str, ctx: dict[str, str]) -> str:
    for old, new in ctx.items():
        if old:
            s = s.replace(old, new)
    s = re.sub(r"[0-9]{8}T[0-9]{6}Z?-[A-Za-z0-9_-]+", "<ID>", s)  # incident and run ids
    s = re.sub(r"0x[0-9a-f]+", "0xH", s)
    s = re.sub(r"[0-9]+", "N", s)
    return re.sub(r"\[N(, N)*\]", "[N...]", s)  # lists of pids


# where a SIGKILL sent as READY is read lands: still in the body that printed it, or already waiting
KILLED_STATES = ("waiting_for_data", "in_loop_body")


def normalise(obj, ctx: dict[str, str], key: str | None = None, states: tuple[str, ...] = ()):
    """``obj`` with what varies between runs replaced by placeholders; key order kept.

    ``states``: the loop states any of which the run may have ended in (one placeholder for all).
    """
    if key == "state" and obj in states:
        return "<" + " or ".join(states) + ">"
    if key in TIMING:
        return f"<{key}>"
    if key == "status" and obj in (None, "gone"):  # whether a worker outlived its SIGKILLed parent
        return "<gone or null>"
    if key in ("timeline", "events"):  # passed through untouched by the builder: their shape only
        kinds = sorted({str(r.get("kind")) + ":" + str(r.get("event", "")) for r in obj or () if isinstance(r, dict)})
        return {"type": type(obj).__name__, "kinds": kinds}
    if key in SHAPE_ONLY and isinstance(obj, dict):
        return {"type": "dict", "keys": sorted(obj)}
    if key == "gpus":
        return type(obj).__name__
    if isinstance(obj, dict):
        return {k: normalise(v, ctx, k, states) for k, v in obj.items()}
    if isinstance(obj, list):
        items = [normalise(v, ctx, key, states) for v in obj]
        if key == "processes":
            items.sort(key=lambda p: (str(p.get("role")), str(p.get("worker_id"))))
            for p in items:
                if p.get("role") != "worker" and "status" in p:
                    # the hung main process and the monitor poll with a timeout: caught asleep or awake
                    p.update({k: f"<{k}>" for k in ("status", "waiting_in", "alive_by") if k in p})
        if key == "notes":
            items = sorted(set(items))
        return items
    if isinstance(obj, bool) or obj is None:
        return obj
    if isinstance(obj, (int, float)):
        return obj if key in STABLE_NUMBERS else "<num>"
    if isinstance(obj, str):
        if key in ("id", "created_at", "started_at", "host", "dlwatch_version", "job_id", "cmdline"):
            return "<" + key + ">"
        return _text(obj, ctx)
    return obj


def _context(tmp: str) -> dict[str, str]:
    return {
        tmp: "<tmp>",
        REPO: "<repo>",
        sys.prefix: "<venv>",
        sys.base_prefix: "<python>",
        socket.gethostname(): "<host>",
    }


def _env(tmp: str) -> dict[str, str]:
    targets = os.path.join(REPO, "tests", "targets")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, targets]), DLWATCH_HTML="0")
    env.pop("DLWATCH_DIR", None)
    return env


def _documents(report_dir: str) -> dict[str, dict]:
    """report.json of each incident (by trigger) and summary.json of each run in ``report_dir``."""
    out: dict[str, dict] = {}
    for inc in incidents(report_dir):
        with open(os.path.join(inc, "report.json")) as f:
            doc = json.load(f)
        out[f"report-{doc['trigger']}"] = doc
    runs = os.path.join(report_dir, "runs")
    for name in sorted(os.listdir(runs)) if os.path.isdir(runs) else ():
        if name.startswith("."):
            continue  # a summary being written
        with open(os.path.join(runs, name, "summary.json")) as f:
            out["summary"] = json.load(f)
    return out


def _scrub(obj, ctx: dict[str, str]):
    """``obj`` with this machine's paths and host name replaced (a valid document still)."""
    if isinstance(obj, dict):
        return {k: _scrub(v, ctx) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_scrub(v, ctx) for v in obj]
    if isinstance(obj, str):
        for old, new in ctx.items():
            if old:
                obj = obj.replace(old, new)
    return obj


def renderings(kind: str, doc) -> dict[str, str]:
    """What people see of a document: report.md/summary.md, the terminal view, report.html."""
    from dlwatch.report import html, render, summary

    def page(text: str) -> str:  # the vendored chart library and drawing code are not the document's
        for i, script in enumerate(html._scripts()):
            text = text.replace(script, f"<script {i}>")
        return text

    if kind == "summary":
        return {
            "md": summary.render_markdown(doc),
            "terminal": "\n".join(summary.terminal_lines(doc)) + "\n",
            "html": page(html.render_summary_html(doc, [])),
        }
    return {
        "md": render.render_markdown(doc),
        "terminal": "\n".join(render.terminal_view(doc)) + "\n",
        "html": page(html.render_html(doc)),
    }


def _check(name: str, docs: dict[str, dict], tmp: str, states: tuple[str, ...] = ()) -> None:
    got = {k: normalise(v, _context(tmp), states=states) for k, v in sorted(docs.items())}
    path = os.path.join(GOLDEN, f"{name}.json")
    text = json.dumps(got, indent=1, ensure_ascii=False) + "\n"
    if WRITE:
        os.makedirs(os.path.join(GOLDEN, "raw"), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        # the documents themselves and what the renderers made of them, for test_schema.py
        for key, doc in docs.items():
            raw = _scrub(doc, _context(tmp))
            base = os.path.join(GOLDEN, "raw", f"{name}-{key}")
            with open(base + ".json", "w") as f:
                json.dump(raw, f, indent=1, ensure_ascii=False)
            for ext, out in renderings("summary" if key == "summary" else "report", raw).items():
                with open(f"{base}.{ext}", "w") as f:
                    f.write(out)
        return
    with open(path) as f:
        want = f.read()
    assert text == want, f"{name}: report layout changed (diff against tests/golden/{name}.json)"


def _run(argv: list[str], tmp: str, timeout: float = 120) -> tuple[int, str, str]:
    from conftest import run_bounded

    return run_bounded([sys.executable, *argv], env=_env(tmp), cwd=tmp, timeout=timeout)


@pytest.mark.parametrize("mode", ["exception", "finish"])
def test_exception_reports_keep_their_layout(tmp_path, mode):
    tmp = str(tmp_path)
    rc, out, err = _run([os.path.join(REPO, "tests", "targets", "schema_runs.py"), mode, tmp + "/r"], tmp)
    assert rc == 1, err[-2000:]
    docs = _documents(tmp + "/r")
    assert set(docs) == {"report-exception", "summary"}, (sorted(docs), err[-2000:])
    _check(mode, docs, tmp)


def test_exit_report_keeps_its_layout(tmp_path, target):
    tmp = str(tmp_path)
    t = target("schema_runs.py", "killed", tmp + "/r", env={"DLWATCH_HTML": "0"}, cwd=tmp)
    t.wait_line("READY", timeout=60)
    os.kill(t.pid, signal.SIGKILL)
    t.proc.wait(timeout=10)
    assert wait_for(lambda: "summary" in _documents(tmp + "/r") and incidents(tmp + "/r"), timeout=30)
    docs = _documents(tmp + "/r")
    assert set(docs) == {"report-exit", "summary"}, sorted(docs)
    _check("killed", docs, tmp, states=KILLED_STATES)


def test_stall_and_attach_reports_keep_their_layout(tmp_path, target):
    from dlwatch.cli import main

    tmp = str(tmp_path)
    t = target("hang.py", "deadlock", tmp + "/r", env={"DLWATCH_HTML": "0"}, cwd=tmp)
    t.wait_line("READY", timeout=60)
    assert wait_for(lambda: incidents(tmp + "/r"), timeout=30), "no stall incident"
    t.remember()
    old = os.environ.get("DLWATCH_HTML")
    os.environ["DLWATCH_HTML"] = "0"
    try:
        assert main(["attach", str(t.pid), "--out", tmp + "/a"]) == 0
    finally:
        if old is None:
            del os.environ["DLWATCH_HTML"]
        else:
            os.environ["DLWATCH_HTML"] = old
    docs = _documents(tmp + "/r")
    docs.update(_documents(tmp + "/a"))
    assert set(docs) == {"report-stall", "report-attach"}, sorted(docs)
    _check("hang", docs, tmp)
