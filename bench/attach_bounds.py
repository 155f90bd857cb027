"""`dlwatch attach` on the two cases of issue 18 item 4, and issue 29's source and listing cases:
wall time, peak RSS, report size.

Run alone: ``python bench/attach_bounds.py flood [--workers 8] [--mib 4] [--as-nobody] [--code DIR]``
or ``python bench/attach_bounds.py deep [--workers 4] [--depth 4000] [--code DIR]`` (10-40 s each),
``python bench/attach_bounds.py source [--frames 2] [--kib 1024] [--before DIR]`` (root's attach on a
uid-2001 job whose deadlocked worker's frames name FRAMES files of KIB KiB of its own, dense code:
the lock-owner judgement's source reading), ``python bench/attach_bounds.py listing [--mib 60]
[--before DIR]`` (``dlwatch report DIR`` listing one incident whose report.json is padded to MIB MiB),
``python bench/attach_bounds.py pyspy [--threads 100] [--depth 1000] [--name-chars 2000] [--before DIR]``
(root's attach, real py-spy, on one process whose stacks make py-spy's answer huge).
``--before DIR`` runs the same case with another checkout (a tree exported from an older commit) too
and prints both side by side with the ratios.
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


LOCK_JOB = os.path.join(REPO, "tests", "stack_targets", "lock_source_job.py")
VICTIM = 2001


def measure_source(frames: int, kib: int, code: str) -> dict:
    """Root's attach on a uid-2001 deadlocked job whose worker's frames name FRAMES big files of its own."""
    shared = tempfile.mkdtemp(prefix="dlwatch-src-", dir="/tmp")
    out_dir = tempfile.mkdtemp(prefix="dlwatch-src-out-")
    os.chmod(shared, 0o755)
    os.chown(shared, VICTIM, VICTIM)
    line = "a = b + c * d - e\n"
    paths = []
    for i in range(frames):
        path = os.path.join(shared, f"f{i}.py")
        with open(path, "w") as f:
            f.write(line * ((kib << 10) // len(line)))
        os.chown(path, VICTIM, VICTIM)
        paths.append(path)
    spec = {"frames": [[p, 10 + i] for i, p in enumerate(paths)], "holder": [[paths[-1], 11]]}
    py = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else sys.executable
    job = subprocess.Popen(
        ["setpriv", f"--reuid={VICTIM}", f"--regid={VICTIM}", "--clear-groups", py, LOCK_JOB, shared, json.dumps(spec)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd="/",
    )
    try:
        main_pid = int(job.stdout.readline().split()[1])
        time.sleep(0.5)  # the worker on its lock
        env = dict(os.environ, DLWATCH_PLAYBOOKS="")
        return {"frames": frames, "kib": kib, "code": code, **_attach(main_pid, out_dir, code, env)}
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()
        job.stdout.close()
        shutil.rmtree(shared, ignore_errors=True)
        shutil.rmtree(out_dir, ignore_errors=True)


def measure_listing(mib: int, code: str) -> dict:
    """``dlwatch report DIR`` over one incident whose report.json is padded to MIB MiB (after its keys)."""
    rdir = tempfile.mkdtemp(prefix="dlwatch-list-")
    try:
        made = subprocess.run(
            [sys.executable, "-c", MAKE_BIG_REPORT, rdir, str(mib)],
            env=dict(os.environ, PYTHONPATH=REPO),
            capture_output=True,
            text=True,
            check=True,
        )
        size = int(made.stdout.split()[-1])
        done = subprocess.run(
            [sys.executable, "-c", WRAP, sys.executable, "-m", "dlwatch", "report", rdir],
            env=dict(os.environ, PYTHONPATH=code),
            capture_output=True,
            text=True,
            timeout=600,
            cwd="/",
        )
        fields = done.stderr.strip().splitlines()[-1].split()
        return {
            "report_json_bytes": size,
            "code": code,
            "list_wall_s": round(float(fields[1]), 2),
            "list_peak_rss_mb": round(int(fields[3]) / 1024, 1),
            "list_rc": int(fields[5]),
        }
    finally:
        shutil.rmtree(rdir, ignore_errors=True)


MAKE_BIG_REPORT = r"""
import json, os, sys, time
from dlwatch.report import build, store
rdir, mib = sys.argv[1], int(sys.argv[2])
store.prepare_report_dir(rdir)
r = store.skeleton(trigger="stall", pid=100, now=time.time())
r["findings"] = [{"playbook": "worker-deadlock", "title": "DataLoader workers deadlocked", "confidence": 0.9,
                  "evidence": {}, "remediation": ""}]
path = build.write(r, rdir)
doc = json.load(open(os.path.join(path, "report.json")))
n = (mib << 20) // 10
with open(os.path.join(path, "report.json"), "w") as f:
    f.write(json.dumps(doc)[:-1] + ', "padding": [' + ", ".join(['{"k": 0}'] * n) + "]}")
print(os.path.getsize(os.path.join(path, "report.json")))
"""


FLOOD = r"""
import sys, threading, time
sys.setrecursionlimit(5000)
threading.stack_size(32 << 20)
threads, depth, chars = map(int, sys.argv[1:4])
name = "f" * chars
ns = {}
exec(compile(f"def {name}(n):\n    if n == 0:\n        import time; time.sleep(600)\n    {name}(n - 1)\n",
             "/srv/" + "d" * 200 + ".py", "exec"), ns)
for i in range(threads):
    threading.Thread(target=ns[name], args=(depth,), daemon=True).start()
time.sleep(2)
print("READY", flush=True)
time.sleep(600)
"""


def measure_pyspy(threads: int, depth: int, chars: int, code: str) -> dict:
    """Root's attach (real py-spy, --no-native) on one process of THREADS threads DEPTH frames deep in a
    function with a CHARS-character name: py-spy's answer is huge before any of it is written."""
    out_dir = tempfile.mkdtemp(prefix="dlwatch-pyspy-out-")
    job = subprocess.Popen(
        [sys.executable, "-c", FLOOD, str(threads), str(depth), str(chars)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        job.stdout.readline()
        done = subprocess.run(
            [
                sys.executable,
                "-c",
                WRAP,
                sys.executable,
                "-m",
                "dlwatch",
                "attach",
                str(job.pid),
                "--out",
                out_dir,
                "--duration",
                "0.2",
                "--no-native",
            ],
            env=dict(os.environ, PYTHONPATH=code, DLWATCH_PLAYBOOKS=""),
            capture_output=True,
            text=True,
            timeout=600,
            cwd="/",
        )
        fields = done.stderr.strip().splitlines()[-1].split()
        return {
            "threads": threads,
            "depth": depth,
            "name_chars": chars,
            "code": code,
            "attach_wall_s": round(float(fields[1]), 2),
            "attach_peak_rss_mb": round(int(fields[3]) / 1024, 1),  # the largest of attach and its py-spy
        }
    finally:
        try:
            os.killpg(job.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        job.wait()
        job.stdout.close()
        shutil.rmtree(out_dir, ignore_errors=True)


def _side_by_side(case: str, before: dict, after: dict) -> dict:
    keys = {
        "source": ("attach_wall_s", "attach_peak_rss_mb"),
        "pyspy": ("attach_wall_s", "attach_peak_rss_mb"),
        "listing": ("list_wall_s", "list_peak_rss_mb"),
    }[case]
    ratios = {k: round(before[k] / after[k], 1) if after.get(k) else None for k in keys}
    return {"before": before, "after": after, "before/after": ratios}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=["flood", "deep", "source", "listing", "pyspy"])
    ap.add_argument("--threads", type=int, default=100)
    ap.add_argument("--name-chars", type=int, default=2000)
    ap.add_argument("--frames", type=int, default=2)
    ap.add_argument("--kib", type=int, default=1024)
    ap.add_argument("--before", default=None, help="another checkout to measure too, side by side")
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--mib", type=int, default=4)
    ap.add_argument("--depth", type=int, default=4000)
    ap.add_argument("--code", default=REPO, help="the dlwatch checkout whose attach runs (default: this one)")
    ap.add_argument("--as-nobody", action="store_true")
    a = ap.parse_args()
    if a.case in ("source", "listing", "pyspy"):
        run = {
            "source": lambda code: measure_source(a.frames, a.kib, code),
            "listing": lambda code: measure_listing(a.mib if a.mib != 4 else 60, code),
            "pyspy": lambda code: measure_pyspy(a.threads, a.depth if a.depth != 4000 else 1000, a.name_chars, code),
        }[a.case]
        after = run(os.path.abspath(a.code))
        if a.before:
            print(json.dumps(_side_by_side(a.case, run(os.path.abspath(a.before)), after)))
        else:
            print(json.dumps(after))
        return
    if a.case == "flood":
        print(json.dumps(measure(a.workers or 8, a.mib, os.path.abspath(a.code), a.as_nobody)))
    else:
        print(json.dumps(measure_deep(a.workers or 4, a.depth, os.path.abspath(a.code))))


if __name__ == "__main__":
    main()
