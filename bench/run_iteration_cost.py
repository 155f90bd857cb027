"""What `dlwatch run` adds per DataLoader iteration, and at a program's start and exit, installed as users install it.

  python bench/run_iteration_cost.py cost [--iterations 40] [--rounds 3] [--before DIR]   # about 4 minutes
  python bench/run_iteration_cost.py alternate [--iterations 100] [--rounds 3]           # about a minute
  python bench/run_iteration_cost.py suite [--rounds 3]                                  # about a minute
  python bench/run_iteration_cost.py teardown [--runs 50]                                # about 5 minutes

Every side runs in a scratch virtualenv with a normal install (``pip install .`` of the tree, not
editable; torch 2.13.0 and numpy, which torch's workers seed when it is there), made by
``bench._common.normal_install`` (``--venv DIR``; made once, dlwatch installed anew each run).
``--code DIR`` measures another tree instead of this checkout; ``--before DIR`` (``cost`` only)
adds a third side, a tree exported from an older commit in a venv of its own, for a before/after
in the same rounds.  ``--editable`` runs this interpreter's dlwatch instead (what the figures used
to be: it is not what users run).

``cost`` (the figure judged): one script iterates a small DataLoader (32 items, batch 8) once,
sleeps ``--pause`` seconds (under ``dlwatch run`` the monitor started at that first iteration:
its start is not the iterations' cost), then times N more iterations: wall time and CPU time
(``os.times()``: the process and its reaped children, each iteration's workers) per iteration.
Run as ``python script.py`` twice (an A/A pair: the noise of the same rounds) and as ``dlwatch
run script.py``, each a process of its own, in a rotating order, num_workers 2 and 0.  Before the
timed loop each process runs one ``gc.collect()``: the collector is then in the same state on
every side.  Without it, what an iteration costs depends on where the training process's
collector stands: once a full collection is due (ten young collections since the last, and a
quarter more objects than it found), each worker forked before the training process's next
collection runs it instead, on the heap it inherited: here about 100 ms of CPU and 10,000
copy-on-write page faults per worker.  Any allocation brings that moment forward; dlwatch's start
(its modules and its watch: about 5,000 objects) brought it into the timed loop, and a loop that
allocates as little as this one (a few objects an iteration) stays there for tens of iterations
(a training step ends it within a few batches).  So the same script is also run without the
collect (the row "collector as it stands"), with the workers' full collections counted (the
script's ``gc.callbacks``, which forked workers inherit, write one byte per full collection).
Beside it, the start and exit a short program pays: interpreter start to the script's first
line, the first iteration (under ``dlwatch run``: importing dlwatch, the monitor's start), and
the script's last line to the process's end (the monitor's summary), wall and CPU (the whole
process tree).

``alternate`` (a diagnostic, the figure this file used to judge): the same iterations in one
``dlwatch run`` process, alternating ``DLWATCH_DISABLE`` (read at each ``iter()``): watched and
unwatched side by side; bare, an A/A pair.  It hides whatever is paid in both arms once dlwatch
is loaded.

``suite``: a PyTorch-test-suite-like program: 120 loaders created and iterated (whole, a first
batch only, ``next(iter(loader))``, two at once), with 0 and 2 workers; the whole process's
wall time bare and under ``dlwatch run``, alternating.

``teardown``: TestDataLoaderPersistentWorkers::test_multiple_dataloaders's shape (two persistent
loaders per start method, fork and forkserver, iterated in turns, then both dropped), run RUNS
times bare and RUNS times under ``dlwatch run``, alternating; each run prints how long each
``del`` (the workers' teardown) took.  The figure is the longest teardown of each side.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench._common import normal_install  # noqa: E402

COST = """
import gc, os, sys, time
print(repr(time.time()), flush=True)  # the script's first line: the interpreter's (and dlwatch run's) start is done
import torch
from torch.utils.data import DataLoader
n, workers, pause, align, counts = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3]), sys.argv[4] == "1", sys.argv[5]
loader = DataLoader(list(range(32)), batch_size=8, num_workers=workers)
c = os.times()
t = time.perf_counter()
for batch in loader:  # torch's first use; under dlwatch run, dlwatch's import and the monitor's start
    pass
first = time.perf_counter() - t
e = os.times()
first_cpu = (e.user + e.system + e.children_user + e.children_system) - (c.user + c.system + c.children_user + c.children_system)
time.sleep(pause)  # the monitor's start-up (imports) done: its CPU is not the iterations' cost
me = os.getpid()
fd = os.open(counts, os.O_WRONLY | os.O_APPEND)  # one byte per full collection in a forked worker


def note(phase, info):
    if phase == "start" and info["generation"] == 2 and os.getpid() != me:
        os.write(fd, b"2")


gc.callbacks.append(note)
if align:
    gc.collect()
c = os.times()
t0 = time.perf_counter()
for _ in range(n):
    for batch in loader:
        pass
wall = time.perf_counter() - t0
e = os.times()
cpu = (e.user + e.system + e.children_user + e.children_system) - (c.user + c.system + c.children_user + c.children_system)
gc.callbacks.remove(note)
print(wall / n, cpu / n, first, first_cpu, os.fstat(fd).st_size)
print(repr(time.time()), flush=True)  # the script's last line: what follows is the interpreter's exit
"""

ALTERNATE = """
import os, statistics, sys, time, torch
from torch.utils.data import DataLoader
n, workers = int(sys.argv[1]), int(sys.argv[2])
loader = DataLoader(list(range(32)), batch_size=8, num_workers=workers)
for batch in loader:  # torch's first-use costs, and under dlwatch run the monitor's start, out of the timing
    pass
time.sleep(1.5)  # the monitor's start-up (imports) done: its CPU is not the iterations' cost
# the same iterations alternating with DLWATCH_DISABLE=1 (read at each iter()): under dlwatch run,
# watched and unwatched iterations side by side in one process at the same moments; bare, an A/A pair
arms = {"0": [], "1": []}
cpu = {"0": 0.0, "1": 0.0}  # CPU of this process and of its reaped children (each iteration's forked workers)
for i in range(2 * n):
    flag = "1" if i % 2 else "0"
    os.environ["DLWATCH_DISABLE"] = flag
    c = os.times()
    t = time.perf_counter()
    for batch in loader:
        pass
    arms[flag].append(time.perf_counter() - t)
    e = os.times()
    cpu[flag] += (e.user + e.system + e.children_user + e.children_system) - (c.user + c.system + c.children_user + c.children_system)
print(statistics.median(arms["0"]), statistics.median(arms["1"]), (cpu["0"] - cpu["1"]) / n)
"""

SUITE = """
import itertools, torch
from torch.utils.data import DataLoader, TensorDataset
data = TensorDataset(torch.arange(64.0).reshape(32, 2))
for i in range(30):
    for workers in (0, 2):
        loader = DataLoader(data, batch_size=4, num_workers=workers, shuffle=i % 2 == 0)
        assert sum(1 for _ in loader) == 8
        first = next(iter(DataLoader(data, batch_size=8, num_workers=workers)))
        a = iter(DataLoader(data, batch_size=4, num_workers=workers))
        b = iter(DataLoader(data, batch_size=4, num_workers=workers))
        for x, y in zip(a, b):
            pass
        del a, b
"""

TEARDOWN = """
import time, torch
from torch.utils.data import DataLoader, TensorDataset


def main():
    data = TensorDataset(torch.arange(100.0).reshape(50, 2))
    out = []
    for ctx in ("fork", "forkserver"):
        l1 = iter(DataLoader(data, batch_size=2, num_workers=1, persistent_workers=True))
        l2 = iter(DataLoader(data, batch_size=2, num_workers=2, persistent_workers=True, multiprocessing_context=ctx))
        next(l1); next(l1); next(l2); next(l2); next(l1); next(l2)
        t0 = time.perf_counter()
        del l1
        del l2
        out.append(time.perf_counter() - t0)
    print(" ".join(f"{x:.3f}" for x in out))


if __name__ == "__main__":  # forkserver's workers import the main module
    main()
"""


class Side:
    """One way of running the script: a name, the command before the script, its environment."""

    def __init__(self, name: str, prefix: list[str], env: dict[str, str]) -> None:
        self.name, self.prefix, self.env = name, prefix, env


def _run(cmd: list[str], env: dict[str, str], cwd: str, timeout: float = 300) -> tuple[float, str, float, float]:
    """(wall s, stdout, CPU s of the whole process tree, time.time() when it ended)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    ended = time.time()
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return wall, p.stdout, cpu, ended


def _python(args: argparse.Namespace, tree: str | None, venv: str) -> str:
    if args.editable and tree is None:
        return sys.executable
    print(
        f"installing {tree or 'this checkout'} into {venv} (pip install ., not editable) ...",
        file=sys.stderr,
        flush=True,
    )
    kwargs = {"checkout": os.path.abspath(tree)} if tree else {}
    return normal_install(venv, extra=("numpy",), **kwargs)


def _sides(args: argparse.Namespace, d: str) -> tuple[Side, Side, Side | None]:
    """bare, dlwatch run (the tree measured) and, with --before, dlwatch run of the older tree."""
    env = dict(os.environ, DLWATCH_DIR=os.path.join(d, "reports"), DLWATCH_QUIET="1")
    env.pop("DLWATCH_DISABLE", None)
    env.pop("PYTHONPATH", None)
    venv = args.venv or os.path.join(tempfile.gettempdir(), "dlwatch-bench-venv")
    python = _python(args, args.code, venv)
    bare = Side("bare", [python], env)
    run = Side("run", [python, "-m", "dlwatch", "run"], env)
    before = None
    if getattr(args, "before", None):
        old = _python(args, args.before, venv + "-before")
        before = Side("before", [old, "-m", "dlwatch", "run"], env)
    return bare, run, before


def _med(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def _cost_rows(
    sides: list[Side], script: str, d: str, args: argparse.Namespace, workers: int, align: bool
) -> dict[str, dict[str, list[float]]]:
    """Per side: per-iteration wall and CPU, the workers' full collections, start, first iteration, exit."""
    names = ["bare", "bare A/A", *[s.name for s in sides[1:]]]
    arms = [sides[0], sides[0], *sides[1:]]
    got: dict[str, dict[str, list[float]]] = {n: {} for n in names}
    for r in range(args.rounds):
        order = list(range(len(arms)))
        order = order[r % len(order) :] + order[: r % len(order)]  # a rotating order: drift lands on every side
        for i in order:
            side, name = arms[i], names[i]
            counts = os.path.join(d, "fullcollections")
            with open(counts, "wb"):
                pass
            launched = time.time()
            wall, stdout, tree_cpu, ended = _run(
                [
                    *side.prefix,
                    script,
                    str(args.iterations),
                    str(workers),
                    str(args.pause),
                    "1" if align else "0",
                    counts,
                ],
                side.env,
                d,
            )
            lines = stdout.split("\n")
            first_line = float(lines[0])
            it_wall, it_cpu, first, first_cpu, full = (float(x) for x in lines[1].split())
            last_line = float(lines[2])
            row = got[name]
            for key, value in (
                ("wall_ms", 1000 * it_wall),
                ("cpu_ms", 1000 * it_cpu),
                ("worker_full_collections", full),
                ("start_ms", 1000 * (first_line - launched)),
                ("first_iteration_ms", 1000 * first),
                ("first_iteration_cpu_ms", 1000 * first_cpu),
                ("exit_ms", 1000 * (ended - last_line)),
                ("process_wall_s", wall),
                ("process_cpu_s", tree_cpu),
            ):
                row.setdefault(key, []).append(value)
    return got


def cost(args: argparse.Namespace, d: str) -> dict[str, object]:
    script = os.path.join(d, "cost.py")
    with open(script, "w") as f:
        f.write(COST)
    bare, run, before = _sides(args, d)
    sides = [bare, run, *([before] if before else [])]
    out: dict[str, object] = {}
    what = (
        f"{args.iterations} iterations of a 32-item loader (batch 8) after a {args.pause:g} s pause, separate processes, "
        f"median of {args.rounds} rounds, {'editable' if args.editable else 'normal'} install"
    )
    print(f"dlwatch run, per loader iteration ({what}):", flush=True)
    for workers, align in ((2, True), (0, True), (2, False)):
        rows = _cost_rows(sides, script, d, args, workers, align)
        med = {name: {k: _med(v) for k, v in row.items()} for name, row in rows.items()}
        b, aa = med["bare"], med["bare A/A"]
        label = f"num_workers={workers}" + ("" if align else ", collector as it stands (no gc.collect() first)")
        parts = [
            f"wall bare {b['wall_ms']:.2f} ms (A/A {aa['wall_ms'] - b['wall_ms']:+.2f})",
            f"CPU bare {b['cpu_ms']:.2f} ms (A/A {aa['cpu_ms'] - b['cpu_ms']:+.2f})",
        ]
        for name in [s.name for s in sides[1:]]:
            m = med[name]
            added_wall, added_cpu = m["wall_ms"] - b["wall_ms"], m["cpu_ms"] - b["cpu_ms"]
            judged = align and name == "run"
            verdict = (
                f" (target <= 5 ms each: {'met' if added_wall <= 5 and added_cpu <= 5 else 'NOT met'})"
                if judged
                else ""
            )
            parts.append(
                f"{'dlwatch run' if name == 'run' else 'before'}: wall {m['wall_ms']:.2f} ms, added {added_wall:+.2f}; "
                f"CPU {m['cpu_ms']:.2f} ms, added {added_cpu:+.2f}{verdict}"
            )
        if not align or workers:
            parts.append(
                "workers' full collections per run: "
                + ", ".join(f"{name} {med[name]['worker_full_collections']:.0f}" for name in med)
            )
        print(f"  {label}: " + "; ".join(parts), flush=True)
        if align and workers:
            once = [
                f"start (launch to the script's first line) bare {b['start_ms']:.0f} ms",
                f"first iteration bare {b['first_iteration_ms']:.0f} ms (CPU {b['first_iteration_cpu_ms']:.0f})",
                f"exit (last line to the process's end) bare {b['exit_ms']:.0f} ms",
                f"whole process bare {b['process_wall_s']:.2f} s, CPU {b['process_cpu_s']:.2f} s",
            ]
            for name in [s.name for s in sides[1:]]:
                m = med[name]
                who = "dlwatch run" if name == "run" else "before"
                once.append(
                    f"{who}: start {m['start_ms']:.0f} ms ({m['start_ms'] - b['start_ms']:+.0f}), first iteration "
                    f"{m['first_iteration_ms']:.0f} ms ({m['first_iteration_ms'] - b['first_iteration_ms']:+.0f}; CPU "
                    f"{m['first_iteration_cpu_ms'] - b['first_iteration_cpu_ms']:+.0f}), exit {m['exit_ms']:.0f} ms "
                    f"({m['exit_ms'] - b['exit_ms']:+.0f}), whole process {m['process_wall_s']:.2f} s, CPU "
                    f"{m['process_cpu_s']:.2f} s ({m['process_cpu_s'] - b['process_cpu_s']:+.2f}, the monitor's included)"
                )
            print("  once per program (num_workers=2): " + "; ".join(once), flush=True)
        out[f"workers{workers}{'' if align else '_unaligned'}"] = {"rows": rows, "medians": med}
    return out


def alternate(args: argparse.Namespace, d: str) -> dict[str, object]:
    script = os.path.join(d, "alternate.py")
    with open(script, "w") as f:
        f.write(ALTERNATE)
    bare, run, _ = _sides(args, d)
    out: dict[str, object] = {}
    for workers in (0, 2):
        pairs: dict[str, list[float]] = {"bare": [], "run": []}  # per round: arm "0" less arm "1", seconds
        cpus: dict[str, list[float]] = {"bare": [], "run": []}  # the same in CPU seconds (workers' included)
        for _ in range(args.rounds):
            for side in (bare, run):
                stdout = _run([*side.prefix, script, str(args.iterations), str(workers)], side.env, d)[1]
                on, off, cpu = (float(x) for x in stdout.split()[-3:])
                pairs[side.name].append(on - off)
                cpus[side.name].append(cpu)
        paired, aa = 1000 * _med(pairs["run"]), 1000 * _med(pairs["bare"])
        cpu_run, cpu_aa = 1000 * _med(cpus["run"]), 1000 * _med(cpus["bare"])
        print(
            f"num_workers={workers}: in one dlwatch-run process, watched vs unwatched iterations alternating "
            f"(a diagnostic: what both arms pay once dlwatch is loaded is not in it): added {paired:.2f} ms per "
            f"iteration (bare A/A {aa:+.2f} ms), CPU {cpu_run:.2f} ms, workers' included (bare A/A {cpu_aa:+.2f} ms)",
            flush=True,
        )
        out[f"workers{workers}"] = {"pairs": pairs, "cpus": cpus}
    return out


def suite(args: argparse.Namespace, d: str) -> dict[str, object]:
    script = os.path.join(d, "suite.py")
    with open(script, "w") as f:
        f.write(SUITE)
    bare, run, _ = _sides(args, d)
    walls: dict[str, list[float]] = {"bare": [], "run": []}
    for _ in range(args.rounds):
        for side in (bare, run):
            walls[side.name].append(_run([*side.prefix, script], side.env, d)[0])
    b, r = statistics.median(walls["bare"]), statistics.median(walls["run"])
    print(
        f"test-suite-like program (120 loaders, 240 iterations): bare {b:.2f} s, dlwatch run {r:.2f} s "
        f"(median of {args.rounds}): ratio {r / b:.3f} (target <= 1.10)",
        flush=True,
    )
    return {"walls": walls, "ratio": round(r / b, 4)}


def teardown(args: argparse.Namespace, d: str) -> dict[str, object]:
    script = os.path.join(d, "teardown.py")
    with open(script, "w") as f:
        f.write(TEARDOWN)
    bare, run, _ = _sides(args, d)
    blocks: dict[str, list[float]] = {"bare": [], "run": []}
    walls: dict[str, list[float]] = {"bare": [], "run": []}
    for i in range(args.runs):
        for side in (bare, run):
            wall, stdout = _run([*side.prefix, script], side.env, d)[:2]
            blocks[side.name].extend(float(x) for x in stdout.split())
            walls[side.name].append(wall)
        if (i + 1) % 10 == 0:
            print(
                f"  {i + 1} runs: longest teardown bare {max(blocks['bare']):.2f} s, run {max(blocks['run']):.2f} s",
                flush=True,
            )
    worst_b, worst_r = max(blocks["bare"]), max(blocks["run"])
    print(
        f"persistent workers' teardown, {args.runs} runs each (fork and forkserver): longest bare {worst_b:.2f} s, "
        f"dlwatch run {worst_r:.2f} s (limit: bare's worst + 1 s = {worst_b + 1:.2f} s: "
        f"{'met' if worst_r <= worst_b + 1 else 'NOT met'}); whole run median bare {statistics.median(walls['bare']):.2f} s, "
        f"dlwatch run {statistics.median(walls['run']):.2f} s, longest {max(walls['bare']):.2f} s / {max(walls['run']):.2f} s",
        flush=True,
    )
    return {"blocks": blocks, "walls": walls, "worst_bare_s": worst_b, "worst_run_s": worst_r}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("cost", "alternate", "suite", "teardown"))
    ap.add_argument("--iterations", type=int, default=None, help="timed iterations (cost: 40, alternate: 100)")
    ap.add_argument("--pause", type=float, default=2.0, help="seconds between the first iteration and the timed ones")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--venv", default=None, help="the scratch venv of the normal install (made once, kept)")
    ap.add_argument("--code", default=None, help="measure this tree instead of the checkout")
    ap.add_argument("--before", default=None, help="cost: a third side, this older tree (in a venv of its own)")
    ap.add_argument("--editable", action="store_true", help="this interpreter's dlwatch, not a normal install")
    ap.add_argument("--json", default=None, help="write the raw figures here")
    args = ap.parse_args()
    if args.iterations is None:
        args.iterations = 100 if args.what == "alternate" else 40
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M"),
        "what": args.what,
        "rounds": args.rounds,
        "iterations": args.iterations,
        "install": "editable" if args.editable else "normal",
        "cpus": os.cpu_count(),
        "load_before": round(os.getloadavg()[0], 2),
    }
    with tempfile.TemporaryDirectory() as d:
        result = {"cost": cost, "alternate": alternate, "suite": suite, "teardown": teardown}[args.what](args, d)
    meta["load_after"] = round(os.getloadavg()[0], 2)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"meta": meta, **result}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
