"""What every example shares: the --report-dir option and printing where the reports went.

Each example prints one line ``REPORT <path>`` per incident it caused (none for
the healthy ones); ``dlwatch demo`` and the tests read those lines.
"""

from __future__ import annotations

import argparse
import os


def parse_args(description: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--report-dir",
        default=os.environ.get("DLWATCH_DIR", "./dlwatch-reports"),
        help="where dlwatch writes incidents (default: $DLWATCH_DIR or ./dlwatch-reports)",
    )
    args = parser.parse_args()
    args.report_dir = os.path.abspath(args.report_dir)
    return args


def rank_or_supervise(description: str, train, supervise) -> None:
    """A DDP example's entry point: ``train(report_dir)`` in a rank that torchrun started (RANK and
    WORLD_SIZE set), else ``supervise(report_dir)``, which starts the job itself."""
    args = parse_args(description)
    if os.environ.get("RANK") is not None and os.environ.get("WORLD_SIZE") is not None:
        train(args.report_dir)
    else:
        supervise(args.report_dir)


def incidents(report_dir: str) -> set[str]:
    """Incident directories: every entry not starting with '.' (those are runs and half-written ones)."""
    try:
        names = os.listdir(report_dir)
    except FileNotFoundError:
        return set()
    return {
        os.path.join(report_dir, n)
        for n in names
        if not n.startswith(".") and os.path.isfile(os.path.join(report_dir, n, "report.json"))
    }


def print_reports(report_dir: str, before: set[str]) -> int:
    """Print ``REPORT <path>`` for each incident that appeared since ``before``; return how many."""
    # oldest first: ids carry the time only to the second, the file's mtime tells them apart
    new = sorted(incidents(report_dir) - before, key=lambda p: os.stat(os.path.join(p, "report.json")).st_mtime)
    for path in new:
        print(f"REPORT {path}", flush=True)
    if not new:
        print(f"no incident (nothing written to {report_dir})", flush=True)
    return len(new)


def print_summary(watch) -> list[str]:
    """Print ``SUMMARY <path>`` and ``ADVICE <id>`` lines for the run summary of a finished block."""
    summary = watch.summary
    if not summary:
        print("no run summary", flush=True)
        return []
    path = os.path.join(watch.report_dir, "runs", summary["id"])
    print(f"SUMMARY {path}", flush=True)
    loop = summary.get("loop") or {}
    print(
        f"loop: {loop.get('batches')} batches, {loop.get('epochs')} epochs, steady data wait "
        f"{loop.get('steady_data_wait_share')} of the loop",
        flush=True,
    )
    ids = [f["playbook"] for f in summary.get("advice") or ()]
    for f in summary.get("advice") or ():
        print(f"ADVICE {f['playbook']}", flush=True)
    if not ids:
        print("no advice", flush=True)
    return ids


IN_CGROUP = "DLWATCH_EXAMPLE_IN_CGROUP"


def skip(reason: str) -> None:
    print(f"SKIP: {reason}", flush=True)
    raise SystemExit(0)


def _memory_cgroup_root() -> tuple[str, str] | None:
    """(directory, limit file) of a writable memory cgroup hierarchy: v1 or v2."""
    v1 = "/sys/fs/cgroup/memory"
    if os.path.isfile(os.path.join(v1, "memory.limit_in_bytes")) and os.access(v1, os.W_OK):
        return v1, "memory.limit_in_bytes"
    v2 = "/sys/fs/cgroup"
    try:
        with open(os.path.join(v2, "cgroup.subtree_control")) as f:
            if "memory" in f.read().split() and os.access(v2, os.W_OK):
                return v2, "memory.max"
    except OSError:
        pass
    return None


def rerun_in_memory_cgroup(limit_bytes: int) -> None:
    """Run this script again inside a new memory cgroup limited to ``limit_bytes``; exit with its status.

    Returns (does nothing) when already inside.  Needs a writable cgroup hierarchy (root,
    or a delegated subtree); where there is none, prints SKIP with the reason and exits 0.
    """
    import subprocess
    import sys
    import time

    if os.environ.get(IN_CGROUP) == "1":
        return
    root = _memory_cgroup_root()
    if root is None:
        skip("no writable memory cgroup (v1 or v2) here: creating one needs root or a delegated subtree")
    base, limit_file = root
    cg = os.path.join(base, f"dlwatch-example-{os.getpid()}")
    try:
        os.mkdir(cg)
    except OSError as exc:
        skip(f"cannot create a memory cgroup ({exc.strerror})")
    try:
        with open(os.path.join(cg, limit_file), "w") as f:
            f.write(str(limit_bytes))
        env = dict(os.environ, **{IN_CGROUP: "1"})
        script = f'echo $$ > "{cg}/cgroup.procs" && exec "$0" "$@"'
        code = subprocess.call(["sh", "-c", script, sys.executable, *sys.argv], env=env)
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the cgroup can only go once it is empty
            try:
                with open(os.path.join(cg, "cgroup.procs")) as f:
                    left = [int(x) for x in f.read().split()]
            except OSError:
                left = []
            for pid in left:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
            try:
                os.rmdir(cg)
                break
            except OSError:
                time.sleep(0.1)
    raise SystemExit(code)


def wait_for_incident(report_dir: str, before: set[str], timeout_s: float) -> bool:
    """Whether an incident appeared in report_dir since ``before`` (polled, at most timeout_s)."""
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if incidents(report_dir) - before:
            return True
        time.sleep(0.2)
    return bool(incidents(report_dir) - before)


def run_torchrun(
    script: str, report_dir: str, *, nproc: int = 2, until_incidents: int | None = None, give_up_s: float = 60.0
) -> str:
    """Play the job scheduler for a multi-rank example: start ``torchrun --standalone`` on ``script``,
    wait until it ends (or ``until_incidents`` new incidents are written, or ``give_up_s``), then kill
    torchrun and everything under it. Returns the job id the ranks ran under (DLWATCH_JOB_ID)."""
    import secrets
    import signal
    import subprocess
    import sys
    import time

    import dlwatch

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` below still kills the job
    job_id = f"example-{time.strftime('%Y%m%dT%H%M%S')}-{secrets.token_hex(3)}"
    before = incidents(report_dir)
    here = os.path.dirname(os.path.abspath(script))
    package_parent = os.path.dirname(os.path.dirname(os.path.abspath(dlwatch.__file__)))
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        DLWATCH_JOB_ID=job_id,
        PYTHONPATH=os.pathsep.join(p for p in (here, package_parent, os.environ.get("PYTHONPATH")) if p),
    )
    for var in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"):
        env.pop(var, None)
    child = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            str(nproc),
            os.path.abspath(script),
            "--report-dir",
            report_dir,
        ],
        env=env,
        start_new_session=True,
    )
    deadline = time.monotonic() + give_up_s
    try:
        while (
            child.poll() is None
            and time.monotonic() < deadline
            and (until_incidents is None or len(incidents(report_dir) - before) < until_incidents)
        ):
            time.sleep(0.2)
        time.sleep(0.3)  # let the monitors finish their one-line notices on stderr
        if child.poll() is None:
            print(
                "the job is hung and the reports are written: killing it (as a scheduler's time limit would)",
                flush=True,
            )
    finally:
        _kill_job(child.pid)
        child.wait()
    return job_id


def _kill_job(root_pid: int) -> None:
    """SIGKILL torchrun and everything under it: torchrun runs each rank in a session of its own."""
    import signal

    import psutil

    try:
        procs = psutil.Process(root_pid).children(recursive=True)
    except psutil.NoSuchProcess:
        procs = []
    groups = {root_pid}
    for p in procs:
        try:
            groups.add(os.getpgid(p.pid))
        except ProcessLookupError:
            pass
    for g in groups:
        try:
            os.killpg(g, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=5)


HUNG_CHILD = "DLWATCH_EXAMPLE_TRAINING_CHILD"


def run_hung_training(description: str, train, give_up_s: float = 45.0) -> None:
    """A hang example's entry point: ``train(report_dir)`` in a child process that hangs for real,
    and this process as the job scheduler: once the report is written (or after ``give_up_s``), it
    kills the child's whole process group (training process, workers, dlwatch's monitor) with
    SIGKILL, then prints the reports."""
    import signal
    import subprocess
    import sys
    import time

    args = parse_args(description)
    if os.environ.get(HUNG_CHILD) == "1":
        train(args.report_dir)
        return
    report_dir = args.report_dir
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` below still kills the child
    before = incidents(report_dir)
    child = subprocess.Popen(
        [sys.executable, *sys.argv], env=dict(os.environ, **{HUNG_CHILD: "1"}), start_new_session=True
    )  # its own process group: one kill takes all of it
    deadline = time.monotonic() + give_up_s
    try:
        while child.poll() is None and time.monotonic() < deadline and not (incidents(report_dir) - before):
            time.sleep(0.2)
        time.sleep(0.3)  # let the monitor finish its one-line notice on stderr
        if child.poll() is None:
            print("training is hung and the report is written: killing it (as a scheduler's time limit would)")
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()
    print_reports(report_dir, before)
