"""`dlwatch attach` on the two cases of issue 18 item 4: wall time, peak RSS, report size.

Run alone: ``python bench/attach_bounds.py flood [--workers 8] [--mib 4] [--as-nobody] [--code DIR]``
or ``python bench/attach_bounds.py deep [--workers 4] [--depth 4000] [--code DIR]`` (10-40 s each).
``flood``: fake workers answer the dump signal with MIB MiB of frames each (py-spy disabled, so
the faulthandler files are read).  ``deep``: a real DataLoader whose workers hang DEPTH frames
deep, attached with real py-spy (--native first).  ``--code DIR`` runs the attach of another checkout of dlwatch (a tree
exported from an older commit) for a before/after comparison; ``--as-nobody`` runs the job as
uid 65534 so that root's attach reads the run directory through its helper (the path of the
issue's measurement).  Prints one JSON object: attach wall time, the attach's peak RSS (its
own and its children's: RUSAGE_CHILDREN of a wrapper that only starts it), report.json's size,
the incident's total size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
TARGET = os.path.join(REPO, "tests", "stack_targets", "fake_workers.py")
DEEP = os.path.join(REPO, "tests", "stack_targets", "deep_loader.py")
WRAP = (
    "import resource, subprocess, sys, time; t = time.monotonic(); rc = subprocess.run(sys.argv[1:]).returncode; "
    "print('WALL', time.monotonic() - t, 'MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
    "'RC', rc, file=sys.stderr)"
)


def measure(workers: int, mib: int, code: str, as_nobody: bool) -> dict:
    shared = tempfile.mkdtemp(prefix="dlwatch-flood-", dir="/tmp")
    out_dir = tempfile.mkdtemp(prefix="dlwatch-flood-out-")
    os.chmod(shared, 0o755)
    argv = [sys.executable, TARGET, shared, str(workers), str(mib)]
    if as_nobody:
        os.chown(shared, 65534, 65534)
        argv = [
            "setpriv",
            "--reuid=65534",
            "--regid=65534",
            "--clear-groups",
            "/usr/bin/python3",
            TARGET,
            shared,
            str(workers),
            str(mib),
        ]
    job = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, start_new_session=True, cwd="/")
    try:
        main_pid = int(job.stdout.readline().split()[1])
        env = dict(os.environ, DLWATCH_PY_SPY="", DLWATCH_PLAYBOOKS="")
        return {
            "workers": workers,
            "mib_per_worker": mib,
            "as_nobody": as_nobody,
            "code": code,
            **_attach(main_pid, out_dir, code, env),
        }
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()
        job.stdout.close()
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)


def _attach(main_pid: int, out_dir: str, code: str, env: dict) -> dict:
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            WRAP,
            sys.executable,
            "-m",
            "dlwatch",
            "attach",
            str(main_pid),
            "--out",
            out_dir,
            "--duration",
            "0.2",
        ],
        env=dict(env, PYTHONPATH=code),
        capture_output=True,
        text=True,
        timeout=600,
        cwd="/",
    )
    fields = done.stderr.strip().splitlines()[-1].split()
    incident = os.path.join(out_dir, next(n for n in os.listdir(out_dir) if not n.startswith(".")))
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _d, files in os.walk(incident) for f in files)
    return {
        "attach_wall_s": round(float(fields[1]), 2),
        "attach_peak_rss_mb": round(int(fields[3]) / 1024, 1),
        "report_json_bytes": os.path.getsize(os.path.join(incident, "report.json")),
        "incident_bytes": total,
        "attach_rc": int(fields[5]),
    }


def measure_deep(workers: int, depth: int, code: str) -> dict:
    job_dir = tempfile.mkdtemp(prefix="dlwatch-deep-")
    out_dir = tempfile.mkdtemp(prefix="dlwatch-deep-out-")
    job = subprocess.Popen(
        [sys.executable, DEEP, job_dir, str(depth), str(workers)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env=dict(os.environ, PYTHONPATH=REPO),
    )
    try:
        pids = [int(p) for p in job.stdout.readline().split()[1:]]
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(
            open(f"/proc/{p}/syscall").read().split()[0] in ("202", "98") for p in pids
        ):
            time.sleep(0.1)  # every worker down its frames, at the lock
        return {"workers": workers, "depth": depth, "code": code, **_attach(job.pid, out_dir, code, dict(os.environ))}
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()
        job.stdout.close()
        shutil.rmtree(job_dir, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["flood", "deep"])
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4000)
    ap.add_argument("--code", default=REPO, help="the dlwatch checkout whose attach runs (default: this one)")
    ap.add_argument("--as-nobody", action="store_true")
    a = ap.parse_args()
    if a.case == "flood":
        print(json.dumps(measure(a.workers or 8, a.mib, os.path.abspath(a.code), a.as_nobody)))
    else:
        print(json.dumps(measure_deep(a.workers or 4, a.depth, os.path.abspath(a.code))))


if __name__ == "__main__":
    main()
