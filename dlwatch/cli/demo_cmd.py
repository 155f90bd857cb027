"""Make a DataLoader failure happen for real, and show the report dlwatch wrote about it.

  dlwatch demo              run the default example (deadlock: a lock held across fork)
  dlwatch demo NAME         run one example and show its report
  dlwatch demo --list       list the examples
  dlwatch demo all          run every example; print expected vs found, one line each
  dlwatch demo ddp          two ranks under torchrun (gloo, CPU): rank 1's workers deadlock, rank 0
                            blocks in all_reduce; shows `dlwatch report --job` (alias of ddp_deadlock)

Each example is a short script (see `dlwatch demo --list` for where they are) that
runs a real DataLoader under dlwatch.watch, ends by itself, and prints `REPORT <path>`
for each incident. Needs torch. Exit status: 0 when every example run gave what it
was expected to give (its playbook as the top finding, or no incident for a healthy
one, or a skip), 1 otherwise.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Iterable, Iterator, Sequence, TextIO

from dlwatch.wire.config import DEFAULT_REPORT_DIR
from dlwatch.errors import DlwatchError, NotFoundError, UsageError
from dlwatch.redact import outbound
from dlwatch.report import render, store
from dlwatch.report import summary as summary_render

# The healthy examples and those of the advice playbooks: no incident at all.  The examples of a
# failure (the playbook each must yield as top finding) are declared by the failure's module
# (``FAILURE.examples``, see dlwatch.detect.registry); :func:`examples` lists both.
HEALTHY: dict[str, None] = {
    "healthy_fast": None,
    "healthy_slow": None,
    "healthy_workers0": None,
    "healthy_eval_pause": None,
    "healthy_detection_collate": None,
    "healthy_numpy_dataset": None,
    "healthy_warmup": None,
    "healthy_pinned_flat": None,
    "input_bound": None,
    "slow_epoch_start": None,
    "prefetch_too_deep": None,
    "too_many_workers": None,
    "pin_memory_cpu": None,
    "sampler_no_set_epoch": None,
    "balanced": None,
}
# example -> the advice its run summary must hold (None: a balanced run, no advice at all).
# These runs make no incident: advice is never one.
ADVICE: dict[str, str | None] = {
    "input_bound": "input-bound",
    "slow_epoch_start": "slow-epoch-start",
    "prefetch_too_deep": "prefetch-too-deep",
    "too_many_workers": "too-many-workers",
    "pin_memory_cpu": "pin-memory-without-cuda",
    "sampler_no_set_epoch": "sampler-epoch-not-set",
    "balanced": None,
}
ALIASES = {"ddp": "ddp_deadlock"}
STRAGGLER = "straggler-rank"  # judged on the job view (its stragglers), not on an incident's findings
# examples of a multi-rank job: judged by the job view's origin (the rank that stalled first),
# and a waiting rank must be named too
JOB_EXAMPLES = frozenset({"ddp_deadlock", "ddp_straggler"})
DEFAULT = "deadlock"  # shows the most (a silent hang, stacks of every process) in about 6 s
TIMEOUT_S = 90.0  # each example ends itself within 60 s
PACKAGE = "dlwatch._examples"  # examples/ shipped as package data (pyproject.toml package-dir)


@functools.lru_cache(maxsize=1)
def examples() -> dict[str, str | None]:
    """Example -> the playbook it must yield as top finding (None: a healthy run, no incident at all).

    The failures' examples first, in the registry's order, then the healthy and advice ones.
    Built on first use: finding the failures imports every detector module, which the other
    commands (and ``dlwatch demo --help``) do not need.
    """
    from dlwatch.detect import registry

    return {**registry.examples(), **HEALTHY}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", nargs="?", default=DEFAULT, help=f"example to run, or `all` (default: {DEFAULT})")
    parser.add_argument("--list", action="store_true", help="list the examples and exit")
    parser.add_argument(
        "--report-dir",
        default=None,
        help="where the examples write incidents (default: $DLWATCH_DIR or ./dlwatch-reports)",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=TIMEOUT_S,
        help=f"seconds an example may run before it is killed (default: {TIMEOUT_S:g})",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="show the report's quiet notes too (e.g. no NVML without a GPU)"
    )


# --------------------------------------------------------------------------- finding the scripts


def _has_examples(path: str) -> bool:
    return all(os.path.isfile(os.path.join(path, f"{n}.py")) for n in (*examples(), "_common"))


def examples_dir() -> str:
    """The directory of example scripts: the installed package data, else examples/ of a checkout."""
    candidates = []
    try:
        spec = importlib.util.find_spec(PACKAGE)
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.submodule_search_locations:
        candidates.extend(spec.submodule_search_locations)
    pkg_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    candidates.append(os.path.join(pkg_parent, "examples"))  # a source checkout: <repo>/examples
    for path in candidates:
        if _has_examples(path):
            return path
    raise NotFoundError(
        "the example scripts are not installed (looked in: " + ", ".join(candidates) + ")",
        help="reinstall dlwatch (`pip install .` ships examples/ as dlwatch._examples), or run from a source checkout",
    )


def describe(script: str) -> str:
    """The first line of a script's docstring, read without running it."""
    try:
        with open(script, encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()))
    except (OSError, SyntaxError, ValueError):
        doc = None
    return (doc or "").strip().splitlines()[0] if doc else ""


# --------------------------------------------------------------------------- running one


@dataclass
class Outcome:
    name: str
    expected: str | None
    reports: list[str] = field(default_factory=list)
    top_findings: list[str | None] = field(default_factory=list)  # one per report, in order
    skipped: str | None = None
    error: str | None = None  # exit status, timeout, unreadable report
    seconds: float = 0.0
    output: list[str] = field(default_factory=list)
    job: dict | None = None  # the job view, for a multi-rank example
    job_top: str | None = None  # what the job view found: the origin's top finding, or straggler-rank
    summary: str | None = None  # the run summary's directory (SUMMARY line)
    advice: list[str] = field(default_factory=list)  # its advice ids (ADVICE lines)

    @property
    def is_advice_example(self) -> bool:
        return self.name in ADVICE

    @property
    def matched(self) -> bool | None:
        """None for a skip; else whether the run gave exactly what the example is for."""
        if self.skipped is not None:
            return None
        if self.error is not None:
            return False
        if self.job is not None:
            return self.job_top == self.expected
        if self.is_advice_example:
            want = ADVICE[self.name]
            return (
                not self.reports
                and self.summary is not None
                and (want in self.advice if want is not None else not self.advice)
            )
        if self.expected is None:
            return not self.reports
        return bool(self.reports) and all(t == self.expected for t in self.top_findings)

    @property
    def top(self) -> str:
        if self.skipped is not None:
            return f"skipped: {self.skipped}"
        if self.error is not None:
            return f"error: {self.error}"
        if self.job is not None:
            return self.job_top or "-"
        if not self.reports:
            if self.is_advice_example:
                return "advice: " + (", ".join(self.advice) or "none")
            return "-"
        return ", ".join(dict.fromkeys(t or "no playbook matched" for t in self.top_findings))


# torch imported without numpy warns (twice, at import) that it could not initialise NumPy; the
# examples never hand torch a numpy array, so on a newcomer's first screen that is noise before the
# report.  Silenced for the examples only: -W for the isolated example (-I
# ignores PYTHONWARNINGS), the variable for the Python processes it starts (torchrun's ranks).
NUMPY_WARNING = "ignore:Failed to initialize NumPy:UserWarning"


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONWARNINGS"] = ",".join(w for w in (env.get("PYTHONWARNINGS"), NUMPY_WARNING) if w)
    return env


def _example_argv(script: str, report_dir: str) -> list[str]:
    """The example runs isolated (-I): nothing from the working directory or PYTHONPATH is imported;
    this dlwatch is loaded by location and the examples folder (ours) comes first for ``_common``."""
    from dlwatch._spawn import MONITOR_DEPS, python_argv

    argv = python_argv(
        script=script,
        args=["--report-dir", report_dir],
        first=[os.path.dirname(script)],
        deps=(*MONITOR_DEPS, "torch", "numpy"),
    )
    return [argv[0], "-W", NUMPY_WARNING, *argv[1:]]


def _stop_group(proc: "subprocess.Popen[str]") -> None:
    """SIGTERM the example's process group (its supervisor cleans up), then SIGKILL what is left."""
    for sig, grace in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            proc.wait(grace)
            return
        except subprocess.TimeoutExpired:
            continue


def run_example(name: str, directory: str, report_dir: str, *, timeout: float, echo: TextIO | None = None) -> Outcome:
    """Run one example script as a subprocess, bounded in time, and read the reports it names."""
    out = Outcome(name, examples()[name])
    script = os.path.join(directory, f"{name}.py")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        _example_argv(script, report_dir),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        errors="replace",
        env=_child_env(),
        start_new_session=True,
    )

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            out.output.append(line.rstrip("\n"))
            if echo is not None:
                print(outbound(f"  | {line.rstrip()}"), file=echo, flush=True)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        out.error = f"still running after {timeout:g} s; killed"
    finally:
        if proc.poll() is None:
            _stop_group(proc)
        reader.join(5.0)
        out.seconds = time.monotonic() - t0
    for line in out.output:
        if line.startswith("REPORT "):
            out.reports.append(line[len("REPORT ") :].strip())
        elif line.startswith("SKIP: "):
            out.skipped = line[len("SKIP: ") :].strip()
        elif line.startswith("SUMMARY "):
            out.summary = line[len("SUMMARY ") :].strip()
        elif line.startswith("ADVICE "):
            out.advice.append(line[len("ADVICE ") :].strip())
    if out.error is None and proc.returncode != 0:
        out.error = f"exit status {proc.returncode}"
    for path in out.reports:
        try:
            findings = store.load_report(path).get("findings") or []
        except DlwatchError as exc:
            out.error = out.error or str(exc)
            out.top_findings.append(None)
            continue
        top = findings[0] if findings and isinstance(findings[0], dict) else {}
        out.top_findings.append(top.get("playbook"))
    if name in JOB_EXAMPLES and out.error is None and out.skipped is None:
        _judge_job(out, report_dir)
    return out


def _judge_job(out: Outcome, report_dir: str) -> None:
    """A multi-rank example is judged on its job view (the job id is its ``JOB <id>`` line):
    the rank that stalled first and a rank waiting for it, or a straggler and no incident."""
    from dlwatch.report.jobview import job_view

    job_id = next((line[len("JOB ") :].strip() for line in out.output if line.startswith("JOB ")), None)
    if job_id is None:
        out.error = "the example printed no JOB line"
        return
    try:
        out.job = job_view(report_dir, job_id)
    except DlwatchError as exc:
        out.error = f"no job view: {exc}"
        return
    if out.expected == STRAGGLER:
        out.job_top = STRAGGLER if out.job.get("stragglers") else None
        if out.reports:
            out.error = f"a healthy job wrote {len(out.reports)} incident(s)"
        return
    out.job_top = (out.job.get("origin") or {}).get("top_finding")
    if not out.job.get("waiting"):
        out.error = "no rank was found waiting in a collective"


# --------------------------------------------------------------------------- rendering


def list_lines(directory: str) -> Iterator[str]:
    width = max(len(n) for n in examples())
    for name, expected in examples().items():
        tag = expected or (
            f"advice {ADVICE[name]}" if ADVICE.get(name) else "no advice" if name in ADVICE else "no incident"
        )
        default = "  (default)" if name == DEFAULT else ""
        yield f"{name:<{width}}  {tag:<34} {describe(os.path.join(directory, name + '.py'))}{default}"
    yield ""
    yield f"scripts: {directory}"


def table_lines(outcomes: Sequence[Outcome]) -> Iterator[str]:
    """The `dlwatch demo all` table, then the two numbers the README quotes."""
    width = max([18, *(len(o.name) + 1 for o in outcomes)])  # a long example name keeps the columns
    yield f"{'EXAMPLE':<{width}} {'EXPECTED':<20} {'TOP FINDING':<30} {'MATCHED':<8} TIME"
    for o in outcomes:
        matched = {True: "yes", False: "NO", None: "skipped"}[o.matched]
        expected = o.expected or (f"advice {ADVICE[o.name] or 'none'}" if o.is_advice_example else "(no incident)")
        yield f"{o.name:<{width}} {expected:<20} {o.top:<30} {matched:<8} {o.seconds:.1f} s"
    failing = [o for o in outcomes if o.expected is not None and o.matched is not None]
    healthy = [o for o in outcomes if o.expected is None and o.matched is not None and not o.is_advice_example]
    advised = [o for o in outcomes if o.is_advice_example and ADVICE[o.name] and o.matched is not None]
    balanced = [o for o in outcomes if o.is_advice_example and not ADVICE[o.name] and o.matched is not None]
    yield ""
    yield f"failures matched right: {sum(bool(o.matched) for o in failing)}/{len(failing)}"
    yield (
        f"healthy runs that raised a finding: {sum(bool(o.reports) or o.error is not None for o in healthy)}"
        f"/{len(healthy)}"
    )
    if advised or balanced:
        yield f"advice earned right: {sum(bool(o.matched) for o in advised)}/{len(advised)}"
        yield (f"balanced runs that got advice or an incident: {sum(not o.matched for o in balanced)}/{len(balanced)}")
    skipped = [o.name for o in outcomes if o.matched is None]
    if skipped:
        yield f"skipped: {', '.join(skipped)}"


def _tail(lines: Iterable[str], n: int = 15) -> list[str]:
    return list(lines)[-n:]


# --------------------------------------------------------------------------- the command


def _require_torch() -> None:
    if importlib.util.find_spec("torch") is None:
        raise NotFoundError(
            "the examples need torch, which is not installed in this Python",
            help=f"pip install torch (into {sys.prefix})",
        )


def run(args: argparse.Namespace) -> int:
    directory = examples_dir()
    if args.list:
        for line in list_lines(directory):
            print(line)
        return 0
    args.name = ALIASES.get(args.name, args.name)
    if args.name != "all" and args.name not in examples():
        raise UsageError(f"no example named {args.name!r}", help="choose one of: " + ", ".join(examples()) + ", or all")
    if not args.timeout > 0:
        raise UsageError(f"--timeout must be a positive number of seconds, got {args.timeout:g}")
    _require_torch()
    report_dir = os.path.abspath(args.report_dir or os.environ.get("DLWATCH_DIR") or DEFAULT_REPORT_DIR)
    if args.name == "all":
        outcomes = []
        for name in examples():
            print(f"running {name} ...", file=sys.stderr, flush=True)
            o = run_example(name, directory, report_dir, timeout=args.timeout)
            if o.matched is False:
                print(f"  {name} did not give what it should; its last output:", file=sys.stderr)
                for line in _tail(o.output):
                    print(outbound(f"  | {line}"), file=sys.stderr)
            outcomes.append(o)
        print()
        for line in table_lines(outcomes):
            print(line)
        print(f"\nreports: {report_dir} (list them with `dlwatch report {report_dir}`)")
        return 0 if all(o.matched is not False for o in outcomes) else 1
    return _show_one(args.name, directory, report_dir, args.timeout, verbose=args.verbose)


def _show_one(name: str, directory: str, report_dir: str, timeout: float, *, verbose: bool = False) -> int:
    script = os.path.join(directory, f"{name}.py")
    print(f"dlwatch demo: {name}: {describe(script)}")
    print(f"  $ {os.path.basename(sys.executable)} {script} --report-dir {report_dir}")
    o = run_example(name, directory, report_dir, timeout=timeout, echo=sys.stdout)
    print()
    if o.skipped is not None:
        print(f"skipped: {o.skipped}")
        return 0
    if o.error is not None:
        print(f"the example failed: {o.error}")
    if not o.reports and o.summary is not None and o.is_advice_example:
        try:
            data = store.load_summary(o.summary)
        except DlwatchError as exc:
            print(f"cannot show {o.summary}: {exc}")
            return 1
        for line in summary_render.terminal_lines(outbound(data), verbose=verbose):
            print(render.terminal_line(line))
        return _trailer(
            o.summary,
            "summary",
            None if o.matched else f"expected advice {ADVICE[o.name] or 'none'}, found {', '.join(o.advice) or 'none'}",
        )
    if not o.reports and o.job is None:
        print(
            "no incident: dlwatch found nothing wrong"
            if o.expected is None
            else f"no incident was written (expected {o.expected})"
        )
        return 0 if o.matched else 1
    if o.job is not None:
        from dlwatch.report.jobview import job_lines

        for line in job_lines(outbound(o.job)):
            print(render.terminal_line(line))
        print()
        print(f"see it again: dlwatch report --job {report_dir}")
        if not o.matched:
            print(f"expected {o.expected} in the job view, found {o.top}")
            return 1
        return 0
    for path in o.reports[:-1]:  # earlier incidents of the same run (e.g. a threshold before the crash)
        print(f"earlier incident: {path}")
    last = o.reports[-1]  # the failure itself: the most complete report
    try:
        render.render_terminal(
            outbound(store.load_report(last)), sys.stdout, color=render.use_color(sys.stdout), verbose=verbose
        )
    except DlwatchError as exc:
        print(f"cannot show {last}: {exc}")
        return 1
    return _trailer(last, "report", None if o.matched else f"expected {o.expected or 'no incident'}, found {o.top}")


def _trailer(path: str, document: str, mismatch: str | None) -> int:
    """Where the whole document is, how to see it and its charts again; the exit code (1 on a mismatch)."""
    print()
    print(f"full {document}: {os.path.join(path, document + '.md')}")
    print(f"see it again: dlwatch report {path}")
    print(f"charts: dlwatch report {path} --html")
    if mismatch:
        print(mismatch)
        return 1
    return 0
