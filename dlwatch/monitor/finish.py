"""The end of a block whose monitor is gone: ``python -I … dlwatch.monitor.finish RUN_DIR``.

When the monitor died (killed, out of memory) the training process still owes the user
the run summary and, if the block raised, the exception incident.  It does not write them
itself: judging and rendering code never runs in the training process (see
docs/design.md, "Process map").  It writes ``finish.json`` into its private run directory
(what only it knows: the pending exception, how the block ended, the preflight findings)
and starts this short-lived child, which builds both the way the monitor would, from the
run directory's heartbeat, config and timeline, and leaves the summary's path in
``RUN_DIR/summary`` as the monitor does (``Watch.summary`` reads it).

Exit status: 0 when everything owed was written; 1 when something could not be (the
training process then warns once, naming what was lost).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

FINISH_FILE = "finish.json"


def finish(run_dir: str) -> int:
    from dlwatch._fs import write_private
    from dlwatch.collect.runstats import RunStats
    from dlwatch.detect.advice import to_finding
    from dlwatch.report import summary as sm
    from dlwatch.report.build import exception_report_from_run, write_run_summary
    from dlwatch.report.schema import Finding
    from dlwatch.wire import heartbeat as hbmod
    from dlwatch.wire.playbooks import load_playbooks

    with open(os.path.join(run_dir, FINISH_FILE), "rb") as f:
        state: dict[str, Any] = json.loads(f.read())
    try:
        with open(os.path.join(run_dir, "config.json"), "rb") as f:
            opts = json.loads(f.read()).get("options") or {}
    except (OSError, ValueError, AttributeError):
        opts = {}
    report_dir = state["report_dir"]
    pending = state.get("pending")
    ok = True
    try:
        advice_pbs = {pb.id: pb for pb in load_playbooks(opts.get("playbooks") or ()) if pb.is_advice}
    except Exception:
        advice_pbs = {}
    now = time.time()
    s = sm.new_summary(
        run_id=os.path.basename(os.path.normpath(run_dir)),
        pid=int(state["pid"]),
        now=now,
        started_at=state.get("started_at"),
    ).replace(
        ended=state["ended"],
        cpus=state.get("cpus"),
        loop=RunStats(state.get("started_at")).loop(hbmod.read(os.path.join(run_dir, "heartbeat")), now),
        preflight=tuple(Finding.from_dict(to_finding(sig, advice_pbs)) for sig in state.get("preflight") or ()),
        notes=[
            "the monitor process was not running at the end of the block: this summary was "
            "written by the training process and has no per-process figures and no advice"
        ],
    )
    path = write_run_summary(s, report_dir, keep_runs=int(state.get("keep_runs", 200)), timeline_dir=run_dir)
    if path is None:
        ok = False
    else:
        try:
            write_private(os.path.join(run_dir, "summary"), path + "\n")
        except OSError:
            pass
    if pending is not None:  # nothing is lost: the exception incident the monitor would have written
        try:
            exception_report_from_run(run_dir, report_dir, pending, pid=int(state["pid"]))
        except Exception as err:
            print(f"dlwatch: could not write the exception report: {type(err).__name__}: {err}", file=sys.stderr)
            ok = False
    return 0 if ok else 1


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m dlwatch.monitor.finish RUN_DIR (started by dlwatch.watch)", file=sys.stderr)
        return 2
    try:
        return finish(argv[0])
    except Exception as exc:
        print(f"dlwatch: could not finish the run: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
