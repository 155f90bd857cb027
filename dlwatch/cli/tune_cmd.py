"""Measure DataLoader settings on a script's own data: run it to its DataLoader, tune that loader, end it.

  dlwatch tune [--budget S] [--step-ms MS] [--loader N] [--json FILE] [--html FILE] script.py [ARGS...]
  dlwatch tune [OPTIONS] -m module [ARGS...]

The script runs unchanged, as `python script.py ARGS` would, until it first iterates its
first DataLoader (or its N-th, with --loader N).  That loader is tuned right there, before
its first batch: candidate configurations (num_workers, prefetch_factor, persistent_workers,
pin_memory on a CUDA host) run over the same dataset, sampler, batch size and collate_fn,
each in a forked copy of the script's process, measured (steady batches/s and its spread,
time to first batch, CPU cores, workers' RSS/USS, /dev/shm, fds) and stopped at a stall, a
death or a limit.  Then the table and the recommended DataLoader(...) keywords are printed
and the script ends: no training step runs.  A progress line on stderr shows the candidate
and the time left; Ctrl-C stops the search and prints the best so far (exit 130).

  dlwatch tune train.py --data /scratch/imagenet
  dlwatch tune --budget 120 --step-ms 85 --json tune.json --html tune.html train.py
  dlwatch tune --loader 2 train.py          # the second loader the script iterates (validation)

Exit status: 0 tuned; 1 the tune failed; 2 usage; 3 no such script, or the script ended
without iterating its N-th DataLoader; 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from dlwatch.errors import NotFoundError, UsageError

ENV = "DLWATCH_TUNE"  # read by dlwatch/tuning/hook.py (and _boot, for the package and PYTHONPATH)
BOOT_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tuning", "_boot")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", default="60", metavar="SECONDS", help="seconds for the whole tune (default 60)")
    parser.add_argument(
        "--step-ms",
        default=None,
        metavar="MS",
        help="the training step's time per batch: recommend the cheapest configuration that keeps it fed "
        "(a dlwatch run summary prints the command with its measured loop body per batch)",
    )
    parser.add_argument(
        "--loader", default="1", metavar="N", help="tune the N-th DataLoader the script iterates (default 1)"
    )
    parser.add_argument("--json", default=None, metavar="FILE", help="write the result as JSON")
    parser.add_argument(
        "--html", default=None, metavar="FILE", help="write the tune report (charts against num_workers)"
    )
    parser.add_argument("--max-workers", default=None, metavar="N", help="the most workers tried")
    parser.add_argument(
        "--memory-budget",
        default=None,
        metavar="BYTES",
        help="memory the candidates may use (e.g. 8G), besides MemAvailable and the cgroup's limit",
    )
    parser.add_argument(
        "--stall-timeout",
        default=None,
        metavar="SECONDS",
        help="seconds without a batch that stop a candidate as stalled (default: adaptive)",
    )
    parser.add_argument(
        "--iterable-ok",
        action="store_true",
        help="an IterableDataset that only generates random data: do not restrict num_workers",
    )
    parser.add_argument(
        "-m",
        dest="module",
        nargs=argparse.REMAINDER,
        default=None,
        metavar="MODULE [ARGS]",
        help="run a library module as a script, like python -m",
    )
    parser.add_argument(
        "program", nargs=argparse.REMAINDER, metavar="script.py [ARGS...]", help="the script and its arguments"
    )


def _number(flag: str, text: str, *, minimum: float, integer: bool = False) -> float:
    try:
        value = int(text) if integer else float(text)
    except (TypeError, ValueError):
        kind = "a whole number" if integer else "a number"
        raise UsageError(f"{flag} must be {kind}, got {text!r}") from None
    if value != value or value in (float("inf"), float("-inf")) or value < minimum:
        raise UsageError(f"{flag} must be >= {minimum:g}, got {text!r}")
    return value


_SIZE = re.compile(r"([0-9]+(?:\.[0-9]+)?)\s*([kKmMgGtT]?)(i?[bB])?")


def parse_bytes(text: str) -> int:
    m = _SIZE.fullmatch(text.strip())
    if not m:
        raise UsageError(f"--memory-budget must be a size such as 8G or 512M, got {text!r}")
    scale = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}[m.group(2).lower()]
    value = int(float(m.group(1)) * scale)
    if value <= 0:
        raise UsageError(f"--memory-budget must be more than 0, got {text!r}")
    return value


def _output(flag: str, path: str | None) -> str | None:
    if path is None:
        return None
    full = os.path.abspath(path)
    parent = os.path.dirname(full)
    if not os.path.isdir(parent):
        raise NotFoundError(f"{flag}: no such directory: {parent}", help="create it first")
    if os.path.isdir(full):
        raise UsageError(f"{flag} must name a file, {path!r} is a directory")
    return full


def options(args: argparse.Namespace) -> dict[str, object]:
    step = _number("--step-ms", args.step_ms, minimum=0.0) / 1000.0 if args.step_ms is not None else None
    return {
        "budget_s": _number("--budget", args.budget, minimum=2.0),
        "step_s": step or None,
        "loader": int(_number("--loader", args.loader, minimum=1, integer=True)),
        "json": _output("--json", args.json),
        "html": _output("--html", args.html),
        "max_workers": int(_number("--max-workers", args.max_workers, minimum=1, integer=True))
        if args.max_workers is not None
        else None,
        "memory_budget": parse_bytes(args.memory_budget) if args.memory_budget is not None else None,
        "stall_s": _number("--stall-timeout", args.stall_timeout, minimum=0.1)
        if args.stall_timeout is not None
        else None,
        "iterable_ok": bool(args.iterable_ok),
    }


def program_argv(args: argparse.Namespace) -> list[str]:
    rest = list(args.program or ())
    if rest and rest[0] == "--":
        rest = rest[1:]
    if args.module is not None:
        if rest:
            raise UsageError("give a script or -m MODULE, not both")
        if not args.module or not args.module[0] or args.module[0].startswith("-"):
            raise UsageError("-m needs a module name: dlwatch tune -m module [ARGS...]")
        return [sys.executable, "-m", *args.module]
    if not rest:
        raise UsageError("no program given: dlwatch tune script.py [ARGS...] or dlwatch tune -m module [ARGS...]")
    if rest[0].startswith("-"):
        raise UsageError(f"unknown option {rest[0]!r} for dlwatch tune (options go before the script)")
    if not os.path.exists(rest[0]):
        raise NotFoundError(f"no such script: {rest[0]}", help="check the path, or use -m for a module")
    return [sys.executable, rest[0], *rest[1:]]


def program_env(opts: dict[str, object], environ: dict[str, str] | os._Environ[str]) -> dict[str, str]:
    env = dict(environ)
    original = env.get("PYTHONPATH")
    env[ENV] = json.dumps({**opts, "pid": os.getpid()})  # execve keeps the pid: the hook acts only there
    env[ENV + "_PYTHONPATH"] = original or ""
    env[ENV + "_PACKAGE"] = os.path.dirname(os.path.dirname(BOOT_DIR))
    path = [p for p in (original or "").split(os.pathsep) if p and os.path.abspath(p) != BOOT_DIR]
    env["PYTHONPATH"] = os.pathsep.join([BOOT_DIR, *path])
    return env


def run(args: argparse.Namespace) -> int:
    opts = options(args)
    argv = program_argv(args)
    env = program_env(opts, os.environ)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, argv, env)
    except OSError as exc:
        raise UsageError(f"could not start {sys.executable}: {exc.strerror or exc}") from None
    return 1  # not reached
