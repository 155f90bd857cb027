"""What `dlwatch run` adds per DataLoader iteration, and at persistent workers' teardown.

  python bench/run_iteration_cost.py cost [--iterations 100] [--rounds 3]     # about a minute
  python bench/run_iteration_cost.py suite [--rounds 3]                       # about a minute
  python bench/run_iteration_cost.py teardown [--runs 50]                     # about 5 minutes
  ... [--code DIR]: the `dlwatch run` side uses another checkout's dlwatch (a tree exported
  from an older commit), for a before/after

``cost``: one script iterates a small DataLoader N times (num_workers 0, then 2) and times its
own loop; run as ``python script.py`` and as ``dlwatch run script.py``, alternating in one run.
The added time per iteration is the difference of the loops' medians over N.  On a shared machine
that difference wanders by more than the cost itself, so each process then runs 2N more
iterations alternating ``DLWATCH_DISABLE`` (which the hook reads at each ``iter()``): under
``dlwatch run`` watched and unwatched iterations side by side (the figure judged), bare an A/A
pair (its noise).  The whole process's wall time (interpreter start, the monitor's start at the
first iteration, its summary at exit) is printed beside it.

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
import statistics
import subprocess
import sys
import tempfile
import time

COST = """
import os, statistics, sys, time, torch
from torch.utils.data import DataLoader
n, workers = int(sys.argv[1]), int(sys.argv[2])
loader = DataLoader(list(range(32)), batch_size=8, num_workers=workers)
for batch in loader:  # torch's first-use costs, and under dlwatch run the monitor's start, out of the timing
    pass
time.sleep(1.5)  # the monitor's start-up (imports) done: its CPU is not the iterations' cost
t0 = time.perf_counter()
for _ in range(n):
    for batch in loader:
        pass
loop = time.perf_counter() - t0
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
print(loop, statistics.median(arms["0"]), statistics.median(arms["1"]), (cpu["0"] - cpu["1"]) / n)
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


def _run(cmd: list[str], env: dict[str, str], cwd: str, timeout: float = 300) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return wall, p.stdout


def _sides(d: str, code: str | None) -> tuple[dict[str, str], list[str]]:
    env = dict(os.environ, DLWATCH_DIR=os.path.join(d, "reports"), DLWATCH_QUIET="1")
    env.pop("DLWATCH_DISABLE", None)
    if code:
        env["PYTHONPATH"] = os.path.abspath(code)
    return env, [sys.executable, "-m", "dlwatch", "run"]


def cost(args: argparse.Namespace, d: str) -> dict[str, object]:
    script = os.path.join(d, "cost.py")
    with open(script, "w") as f:
        f.write(COST)
    env, run = _sides(d, args.code)
    out: dict[str, object] = {}
    for workers in (0, 2):
        loops: dict[str, list[float]] = {"bare": [], "run": []}
        walls: dict[str, list[float]] = {"bare": [], "run": []}
        pairs: dict[str, list[float]] = {"bare": [], "run": []}  # per round: arm "0" less arm "1", seconds
        cpus: dict[str, list[float]] = {"bare": [], "run": []}  # the same in CPU seconds (workers' included)
        for _ in range(args.rounds):
            for side, prefix in (("bare", [sys.executable]), ("run", run)):
                wall, stdout = _run([*prefix, script, str(args.iterations), str(workers)], env, d)
                loop, on, off, cpu = (float(x) for x in stdout.split()[-4:])
                cpus[side].append(cpu)
                loops[side].append(loop)
                walls[side].append(wall)
                pairs[side].append(on - off)
        lb, lr = statistics.median(loops["bare"]), statistics.median(loops["run"])
        wb, wr = statistics.median(walls["bare"]), statistics.median(walls["run"])
        added = 1000 * (lr - lb) / args.iterations
        paired = 1000 * statistics.median(pairs["run"])
        aa = 1000 * statistics.median(pairs["bare"])
        cpu_run, cpu_aa = 1000 * statistics.median(cpus["run"]), 1000 * statistics.median(cpus["bare"])
        print(
            f"num_workers={workers}: per iteration bare {1000 * lb / args.iterations:.2f} ms, "
            f"dlwatch run {1000 * lr / args.iterations:.2f} ms (separate processes, {args.iterations} iterations, "
            f"median of {args.rounds}): added {added:.2f} ms; in one dlwatch-run process, watched vs unwatched "
            f"iterations alternating: added {paired:.2f} ms per iteration (bare A/A {aa:+.2f} ms; target <= 5 ms), "
            f"CPU added {cpu_run:.2f} ms per iteration, workers' included (bare A/A {cpu_aa:+.2f} ms); "
            f"whole process bare {wb:.2f} s, dlwatch run {wr:.2f} s",
            flush=True,
        )
        out[f"workers{workers}"] = {
            "loops": loops,
            "walls": walls,
            "pairs": pairs,
            "added_ms_separate": round(added, 3),
            "added_ms_paired": round(paired, 3),
            "aa_ms": round(aa, 3),
            "cpu_ms_paired": round(cpu_run, 3),
            "cpu_aa_ms": round(cpu_aa, 3),
            "bare_ms_per_iteration": round(1000 * lb / args.iterations, 3),
        }
    return out


def suite(args: argparse.Namespace, d: str) -> dict[str, object]:
    script = os.path.join(d, "suite.py")
    with open(script, "w") as f:
        f.write(SUITE)
    env, run = _sides(d, args.code)
    walls: dict[str, list[float]] = {"bare": [], "run": []}
    for _ in range(args.rounds):
        for side, prefix in (("bare", [sys.executable]), ("run", run)):
            walls[side].append(_run([*prefix, script], env, d)[0])
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
    env, run = _sides(d, args.code)
    blocks: dict[str, list[float]] = {"bare": [], "run": []}
    walls: dict[str, list[float]] = {"bare": [], "run": []}
    for i in range(args.runs):
        for side, prefix in (("bare", [sys.executable]), ("run", run)):
            wall, stdout = _run([*prefix, script], env, d)
            blocks[side].extend(float(x) for x in stdout.split())
            walls[side].append(wall)
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
    ap.add_argument("what", choices=("cost", "suite", "teardown"))
    ap.add_argument("--iterations", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--code", default=None, help="a dlwatch tree to run `dlwatch run` from (before/after)")
    ap.add_argument("--json", default=None, help="write the raw figures here")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        result = {"cost": cost, "suite": suite, "teardown": teardown}[args.what](args, d)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
