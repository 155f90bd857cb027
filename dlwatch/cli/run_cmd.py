"""Run a Python program unchanged, with every DataLoader iteration in it watched.

  dlwatch run [OPTIONS] script.py [ARGS...]
  dlwatch run [OPTIONS] -m module [ARGS...]

The program runs as `python script.py ARGS` (or `python -m module ARGS`) would: the same
interpreter (this dlwatch's), the same sys.argv, __main__, stdout, stderr, tracebacks
and exit code; dlwatch replaces itself with it.  A bootstrap on PYTHONPATH hooks
torch.utils.data.DataLoader.__iter__ in every Python process the program starts
(torchrun's ranks too): each process that iterates a loader gets one watch (one monitor)
for its life, every iteration of every loader a segment of it, and at exit one run summary
with a row per iteration; every process's run carries one program-run id.  Incidents go to the
report directory as with dlwatch.watch.  DLWATCH_DISABLE=1 runs the program unwatched.

  dlwatch run train.py --epochs 3
  dlwatch run --stall-timeout 120 -m torch.distributed.run --nproc_per_node 2 train.py
  dlwatch run --keep-runs 50 train.py      # each process writes one run summary at exit: keep the newest 50
"""

from __future__ import annotations

import argparse
import os
import sys

from dlwatch.wire import config
from dlwatch.errors import NotFoundError, UsageError

PACKAGE_ENV = "DLWATCH_RUN_PACKAGE"  # read by the bootstrap (dlwatch/inproc/_boot/sitecustomize.py)
BOOT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "inproc", "_boot")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--report-dir",
        default=None,
        metavar="DIR",
        help="where incidents go (default: $DLWATCH_DIR or ./dlwatch-reports)",
    )
    parser.add_argument(
        "--stall-timeout",
        default=None,
        metavar="SECONDS",
        help="seconds without a batch that count as a stall (default: adaptive)",
    )
    parser.add_argument(
        "--body-timeout",
        default=None,
        metavar="SECONDS",
        help="seconds the loop body may run between two batches (default: adaptive)",
    )
    parser.add_argument(
        "--poll-interval", default=None, metavar="SECONDS", help="seconds between monitor polls (default 1.0)"
    )
    parser.add_argument(
        "--ignore",
        default=None,
        metavar="IDS",
        help="comma-separated playbook ids to silence (and batch-dim-mismatch:KEY)",
    )
    parser.add_argument(
        "--keep-runs",
        default=None,
        metavar="N",
        help="run summaries to keep in the report directory, oldest removed first "
        "(default: $DLWATCH_KEEP_RUNS or 200; 0 keeps all)",
    )
    # like python's -m, it ends dlwatch's options: everything after it is the module's
    parser.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        default=None,
        metavar="MODULE [ARGS]",
        help="run a library module as a script, like python -m",
    )
    parser.add_argument(
        "program",
        nargs=argparse.REMAINDER,
        metavar="script.py [ARGS...]",
        help="the script and its arguments (or, with -m, the module's arguments)",
    )


def program_env(args: argparse.Namespace, environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    """The environment the program runs with: dlwatch's options, and the bootstrap first on PYTHONPATH.

    The options given here are checked now (a bad one is a usage error, one line, before the
    program starts); a bad DLWATCH_* value of the environment is not: the program runs with the
    default, and its watch warns once (fail open, see dlwatch/wire/config.py)."""
    env = dict(environ)
    options = {
        "report_dir": args.report_dir,
        "stall_timeout": args.stall_timeout,
        "body_timeout": args.body_timeout,
        "poll_interval": args.poll_interval,
        "ignore": args.ignore,
        "keep_runs": args.keep_runs,
    }
    given = {name: value for name, value in options.items() if value is not None}
    try:
        resolved = config.resolve(**given, environ=env, labels={name: "--" + name.replace("_", "-") for name in given})
    except (ValueError, TypeError) as exc:
        raise UsageError(str(exc).replace("dlwatch.watch: ", "")) from None
    if "ignore" in given and resolved.ignored_playbooks:
        from dlwatch.wire.playbooks import load_playbooks

        known = {pb.id for pb in load_playbooks(resolved.playbooks)}
        unknown = sorted(set(resolved.ignored_playbooks) - known)
        if unknown:
            raise UsageError(f"--ignore names no known playbook: {', '.join(unknown)} (see `dlwatch playbooks`)")
    for name, value in given.items():
        if name == "report_dir":  # ranks and helpers may run in another directory
            value = _absolute(value)
        env[config.ENV[name]] = str(value)
    if env.get(config.ENV["report_dir"]) is None:  # the default, fixed here: ranks may chdir
        default = _absolute(config.DEFAULT_REPORT_DIR)
        if os.path.isabs(default):  # else the working directory is gone: the watch falls back, with its warning
            env[config.ENV["report_dir"]] = default
    path = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and _absolute(p) != BOOT_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *path])
    # the bootstrap acts only where `import dlwatch` finds this package (another Python is left alone)
    env[PACKAGE_ENV] = os.path.dirname(os.path.dirname(BOOT_DIR))  # the dlwatch package directory
    from dlwatch.inproc.runhook import PROGRAM_RUN_ENV

    from dlwatch.wire.reportdir import new_run_id

    env.setdefault(PROGRAM_RUN_ENV, new_run_id())  # the shape (and UTC) of a run id
    return env


def _absolute(path: str) -> str:
    """``os.path.abspath``, or ``path`` as it is where the working directory was removed (as python does)."""
    try:
        return os.path.abspath(path)
    except OSError:
        return path


def program_argv(args: argparse.Namespace) -> list[str]:
    rest = list(args.program or ())
    if rest and rest[0] == "--":
        rest = rest[1:]
    if args.module is not None:
        if rest:
            raise UsageError("give a script or -m MODULE, not both")
        if not args.module or not args.module[0] or args.module[0].startswith("-"):
            raise UsageError("-m needs a module name: dlwatch run -m module [ARGS...]")
        return [sys.executable, "-m", *args.module]
    if not rest:
        raise UsageError("no program given: dlwatch run script.py [ARGS...] or dlwatch run -m module [ARGS...]")
    script = rest[0]
    if script.startswith("-"):
        raise UsageError(f"unknown option {script!r} for dlwatch run (options go before the script)")
    if not os.path.exists(script):
        raise NotFoundError(f"no such script: {script}", help="check the path, or use -m for a module")
    return [sys.executable, script, *rest[1:]]


def run(args: argparse.Namespace) -> int:
    argv = program_argv(args)
    env = program_env(args, os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)  # the program is this process from here on: same pid, signals, exit code
    except OSError as exc:
        raise UsageError(f"could not start {sys.executable}: {exc.strerror or exc}") from None
    return 1  # not reached
