"""`dlwatch tune` against an exhaustive grid, on six reference pipelines: ``python bench/tune.py [--quick]``.

For each pipeline, in a process of its own (the memory-heavy one in a memory cgroup of its
own where one can be made), ``dlwatch.tune`` runs with its budget, then an exhaustive grid
measures every ``num_workers`` from 0 to the tune's maximum with every ``prefetch_factor`` of
1, 2 and 4, each configuration twice, with the same per-run measurement as the tune (the same
guard, window and limits).  Printed per pipeline, side by side:

- the recommendation's throughput over the grid's best (among the configurations that finished
  and fitted the limits; goal >= 0.95): measured head to head, the two alternating three runs
  each right after the grid with a steady window of ``PAIRED_WINDOW_S`` (3 s: what a long loop
  gets; the tune and the grid run minutes apart on a shared machine, whose load moves between
  them), and as the grid's own pass measured them (the tune's short windows);
- the tune's wall time over the grid's (goal <= 0.25);
- whether the configuration recommended failed or broke a limit, in the tune or in the grid
  (goal: never).

Pipelines: CPU-bound decode; I/O-latency bound; tiny items (moving a batch between processes
costs more than making it); large tensors (/dev/shm and the copy dominate); heavy worker start-up
(1 s per worker); memory-heavy near a limit (each worker holds 300 MiB, in a 1.5 GiB memory
cgroup; where no cgroup can be made, a 1.1 GiB ``memory_budget`` stands in and the row says so).

  python bench/tune.py                     # about 15 minutes on 2 cores
  python bench/tune.py --quick             # about 4 minutes: a smaller grid, once each, 15 s budgets
  python bench/tune.py --only io_latency   # one pipeline
  python bench/tune.py --table-from bench/tune_results.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "tune_results.json")
CGROUP_LIMIT = 1536 << 20
FALLBACK_BUDGET = 1100 << 20
WORKER_HOLDS = 300 << 20
PAIRED_RUNS = 3
# the head-to-head runs' steady window: what a program iterating for minutes gets.  The tune's own
# windows (budget / 40, 0.75 s here) catch the bursts in which many workers started together hand
# over their batches: CPU-bound decode read 62 batches/s with 10 workers and 54 with 2 in them,
# where a plain loop over 6 s read 56 and 54 (10 and 2 workers, twice each, 2026-12-03)
PAIRED_WINDOW_S = 3.0

PIPELINES = {
    "cpu_decode": "CPU-bound decode (4 ms of CPU a sample)",
    "io_latency": "I/O-latency bound (15 ms wait a sample)",
    "tiny_items": "tiny items (an int a sample, batch_size 1): IPC dominates",
    "large_tensors": "large tensors (4 MiB a sample, batch 4): /dev/shm and copies dominate",
    "heavy_startup": "heavy worker start-up (1 s in worker_init_fn)",
    "memory_heavy": "memory-heavy: 300 MiB per worker near a 1.5 GiB cgroup limit",
}


# --------------------------------------------------------------------------- the pipelines (run in the child)


def _datasets() -> dict[str, Any]:
    import time as _t

    import torch
    from torch.utils.data import Dataset

    def cpu_work(seconds: float) -> None:
        end = _t.thread_time() + seconds
        while _t.thread_time() < end:
            pass

    class CpuDecode(Dataset):
        def __len__(self) -> int:
            return 1_000_000

        def __getitem__(self, i: int) -> Any:
            cpu_work(0.004)
            return torch.zeros(3, 32, 32), i % 10

    class IoLatency(Dataset):
        def __len__(self) -> int:
            return 1_000_000

        def __getitem__(self, i: int) -> Any:
            _t.sleep(0.015)
            return torch.zeros(3, 32, 32), i % 10

    class Tiny(Dataset):
        def __len__(self) -> int:
            return 10_000_000

        def __getitem__(self, i: int) -> Any:
            return i

    class Large(Dataset):
        def __len__(self) -> int:
            return 1_000_000

        def __getitem__(self, i: int) -> Any:
            return torch.full((1 << 20,), float(i))  # 4 MiB of float32

    class SlowStart(Dataset):
        def __len__(self) -> int:
            return 1_000_000

        def __getitem__(self, i: int) -> Any:
            cpu_work(0.002)
            return torch.zeros(64), i

    class MemoryHeavy(Dataset):
        def __len__(self) -> int:
            return 1_000_000

        def __getitem__(self, i: int) -> Any:
            _t.sleep(0.01)
            return torch.zeros(64), i

    return {
        "cpu_decode": (CpuDecode(), 8, None),
        "io_latency": (IoLatency(), 8, None),
        "tiny_items": (Tiny(), 1, None),
        "large_tensors": (Large(), 4, None),
        "heavy_startup": (SlowStart(), 8, _slow_init),
        "memory_heavy": (MemoryHeavy(), 8, _hold_memory),
    }


def _slow_init(worker_id: int) -> None:
    time.sleep(1.0)  # a tokenizer, a database connection, an index loaded per worker


_HELD: list[Any] = []


def _hold_memory(worker_id: int) -> None:
    block = bytearray(WORKER_HOLDS)  # a per-worker cache, every page written: really resident
    block[::4096] = b"\x01" * len(range(0, WORKER_HOLDS, 4096))
    _HELD.append(block)


def run_one(name: str, budget: float, max_workers: int, repeats: int, prefetches: list[int]) -> dict[str, Any]:
    from torch.utils.data import DataLoader

    import dlwatch
    from dlwatch.tuning.search import Search
    from dlwatch.tuning.space import Config, read_loader
    from dlwatch.wire.playbooks import load_playbooks

    dataset, batch_size, init = _datasets()[name]
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=0, worker_init_fn=init)
    in_cgroup = os.environ.get("DLWATCH_BENCH_CGROUP") == "1"
    mem_budget = FALLBACK_BUDGET if name == "memory_heavy" and not in_cgroup else None
    load_before = os.getloadavg()[0]
    t0 = time.monotonic()
    res = dlwatch.tune(loader, budget_s=budget, max_workers=max_workers, memory_budget=mem_budget)
    tune_s = time.monotonic() - t0
    grid = Search(
        loader,
        read_loader(loader),
        budget_s=1e6,
        step_s=None,
        max_workers=max_workers,
        memory_budget=mem_budget,
        stall_s=None,
        iterable_ok=False,
        progress=None,
        playbooks=load_playbooks(()),
    )
    grid.window = float(res.extra.get("window_s") or grid.window)  # the tune's own per-run measurement
    configs = [Config.make(0)] + [Config.make(n, pf) for n in range(1, max_workers + 1) for pf in prefetches]
    t1 = time.monotonic()
    try:
        for _ in range(repeats):
            for cfg in configs:
                grid.measure(cfg, "grid", force=True)
    finally:
        grid.probe.close()
    grid_s = time.monotonic() - t1
    rows = {c: grid.row(c) for c in configs}
    ok = {c: r for c, r in rows.items() if r.eligible}
    best_cfg = max(ok, key=lambda c: ok[c].batches_per_s or 0.0) if ok else None
    rec = res.recommended
    rec_key = Config.make(rec.num_workers, rec.prefetch_factor) if rec is not None else None
    rec_row = rows.get(rec_key) if rec_key is not None else None
    # head to head: the recommendation and the grid's best, alternating, right after the grid. The
    # tune and the grid ran minutes apart on a machine other jobs share: the cores it lends move
    # between them, and the grid's best is the highest of 37 noisy figures; alternating runs of the
    # two compare them under the same load
    paired: dict[str, float | None] = {}
    if rec_key is not None and best_cfg is not None and rec_key != best_cfg:
        pair = Search(
            loader,
            read_loader(loader),
            budget_s=1e6,
            step_s=None,
            max_workers=max_workers,
            memory_budget=mem_budget,
            stall_s=None,
            iterable_ok=False,
            progress=None,
            playbooks=load_playbooks(()),
        )
        pair.window = max(grid.window, PAIRED_WINDOW_S)
        try:
            for _ in range(PAIRED_RUNS):
                for cfg in (rec_key, best_cfg):
                    pair.measure(cfg, "paired", force=True)
        finally:
            pair.probe.close()
        a, b = pair.row(rec_key), pair.row(best_cfg)
        paired = {"recommended": a.batches_per_s, "grid_best": b.batches_per_s, "window_s": pair.window}
        if a.status != "ok" or a.limits:
            paired["recommended_status"] = f"{a.status} {','.join(a.limits)}".strip()  # type: ignore[assignment]
    elif rec_key is not None and rec_key == best_cfg:
        paired = {"recommended": 1.0, "grid_best": 1.0}
    tune_row = next((r for r in res.rows if r.recommended), None)
    broke = []
    if rec_row is not None and not rec_row.eligible:
        broke.append(f"grid: {rec_row.status} {','.join(rec_row.limits)}".strip())
    if tune_row is not None and not tune_row.eligible:
        broke.append(f"tune: {tune_row.status} {','.join(tune_row.limits)}".strip())
    best_rate = ok[best_cfg].batches_per_s if best_cfg is not None else None
    rec_rate = rec_row.batches_per_s if rec_row is not None else None
    return {
        "pipeline": name,
        "what": PIPELINES[name],
        "budget_s": budget,
        "tune_s": round(tune_s, 1),
        "grid_s": round(grid_s, 1),
        "time_share": round(tune_s / grid_s, 3) if grid_s else None,
        "tune_runs": res.extra.get("runs"),
        "grid_runs": grid.runs,
        "recommended": rec.to_dict() if rec is not None else None,
        "best": res.best,
        "why": list(res.why),
        "grid_best": best_cfg.to_dict() if best_cfg is not None else None,
        "grid_best_rate": best_rate,
        "recommended_grid_rate": rec_rate,
        "throughput_share": round(rec_rate / best_rate, 3) if rec_rate and best_rate else None,
        "paired": paired,
        "paired_share": round(paired["recommended"] / paired["grid_best"], 3)
        if paired.get("recommended") and paired.get("grid_best")
        else None,
        "broke": broke,
        "grid_failed_or_unfit": sorted(
            f"{c.label()}: {r.status} {','.join(r.limits)}".strip()
            for c, r in rows.items()
            if r.status != "skipped" and not r.eligible
        )[:16],
        "memory_limit": "cgroup 1.5 GiB" if in_cgroup else ("memory_budget 1.1 GiB" if mem_budget else None),
        "load_before": round(load_before, 2),
        "load_after": round(os.getloadavg()[0], 2),
        "tune_table": res.table(),
    }


# --------------------------------------------------------------------------- the driver (this process)


def _memory_cgroup() -> str | None:
    for base, limit in (("/sys/fs/cgroup/memory", "memory.limit_in_bytes"), ("/sys/fs/cgroup", "memory.max")):
        if os.path.isdir(base) and os.access(base, os.W_OK) and os.path.exists(os.path.join(base, limit)):
            path = os.path.join(base, f"dlwatch-bench-tune-{os.getpid()}")
            try:
                os.mkdir(path)
                with open(os.path.join(path, limit), "w") as f:
                    f.write(str(CGROUP_LIMIT))
                return path
            except OSError:
                try:
                    os.rmdir(path)
                except OSError:
                    pass
    return None


def _remove_cgroup(path: str) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                for pid in f.read().split():
                    try:
                        os.kill(int(pid), 9)
                    except OSError:
                        pass
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)


def _child(name: str, args: argparse.Namespace) -> dict[str, Any]:
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--child",
        name,
        "--budget",
        str(args.budget),
        "--max-workers",
        str(args.max_workers),
        "--repeats",
        str(args.repeats),
        "--prefetch",
        args.prefetch,
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")]))
    cgroup = _memory_cgroup() if name == "memory_heavy" else None
    if cgroup is not None:
        env["DLWATCH_BENCH_CGROUP"] = "1"
        cmd = ["sh", "-c", f'echo $$ > "{cgroup}/cgroup.procs" && exec "$0" "$@"', *cmd]
    try:
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
    finally:
        if cgroup is not None:
            _remove_cgroup(cgroup)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        return {"pipeline": name, "what": PIPELINES[name], "error": (out.stderr or out.stdout)[-1500:]}
    return json.loads(lines[-1][7:])


def _cfg(d: dict[str, Any] | None) -> str:
    if not d:
        return "-"
    text = f"nw={d['num_workers']}"
    if d["num_workers"]:
        text += f" pf={d['prefetch_factor']}"
        if d.get("persistent_workers"):
            text += " persistent"
    return text


def table(results: list[dict[str, Any]]) -> list[str]:
    out = [
        "| Pipeline | tune recommends | grid's best | throughput: recommended / grid best, head to head "
        f"({PAIRED_WINDOW_S:g} s windows; goal >= 0.95) | ... in the grid's own pass | time: tune / grid (goal <= 0.25) "
        "| recommended failed or broke a limit (goal: never) | load (1 min) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if "error" in r:
            out.append(f"| {r['what']} | error: {r['error'].splitlines()[-1] if r['error'] else '?'} | | | | | | |")
            continue
        share = r.get("throughput_share")
        tshare = r.get("time_share")
        limit = f" ({r['memory_limit']})" if r.get("memory_limit") else ""
        paired = r.get("paired") or {}
        head = (
            "1.0 (the same configuration)"
            if r.get("paired_share") == 1.0 and paired.get("recommended") == 1.0
            else f"{r.get('paired_share')} ({_rate(paired.get('recommended'))} / {_rate(paired.get('grid_best'))} "
            f"batches/s, {PAIRED_RUNS} runs each, alternating)"
        )
        out.append(
            f"| {r['what']}{limit} | {_cfg(r['recommended'])} | {_cfg(r['grid_best'])} | {head} | "
            f"{share if share is not None else '-'} ({_rate(r.get('recommended_grid_rate'))} / "
            f"{_rate(r.get('grid_best_rate'))} batches/s) | {tshare} ({r['tune_s']} s / {r['grid_s']} s; "
            f"{r['tune_runs']} / {r['grid_runs']} runs) | {'; '.join(r['broke'] + ([paired['recommended_status']] if paired.get('recommended_status') else [])) or 'no'} "
            f"| {r.get('load_before')} to {r.get('load_after')} |"
        )
    return out


def _rate(x: float | None) -> str:
    return "-" if x is None else (f"{x:,.0f}" if x >= 100 else f"{x:.3g}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="budget 15 s, workers 0-8, prefetch 2 only, grid once")
    ap.add_argument("--budget", type=float, default=30.0)
    ap.add_argument("--max-workers", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prefetch", default="1,2,4")
    ap.add_argument("--only", default=None, help="comma-separated pipeline names")
    ap.add_argument("--json", default=RESULTS)
    ap.add_argument("--table-from", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.quick:
        args.budget, args.max_workers, args.repeats, args.prefetch = 15.0, 8, 1, "2"
    if args.child:
        result = run_one(
            args.child, args.budget, args.max_workers, args.repeats, [int(x) for x in args.prefetch.split(",")]
        )
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    if args.table_from:
        with open(args.table_from, encoding="utf-8") as f:
            saved = json.load(f)
        print("\n".join(table(saved["results"])))
        return 0
    names = args.only.split(",") if args.only else list(PIPELINES)
    started = time.time()
    load0 = os.getloadavg()
    results = []
    for name in names:
        print(f"bench/tune.py: {name} ...", file=sys.stderr, flush=True)
        results.append(_child(name, args))
    load1 = os.getloadavg()
    meta = {
        "started": time.strftime("%Y-%m-%d %H:%M", time.gmtime(started)),
        "wall_s": round(time.time() - started),
        "load_before": [round(x, 2) for x in load0],
        "load_after": [round(x, 2) for x in load1],
        "cpus": os.cpu_count(),
        "args": {k: v for k, v in vars(args).items() if k not in ("child", "table_from", "json")},
    }
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump({"meta": meta, "results": results}, f, indent=1)
    print("\n".join(table(results)))
    print(
        f"\n({meta['wall_s']} s, {meta['cpus']} CPUs, load average {load0[0]:.2f} before / {load1[0]:.2f} after; "
        f"raw figures and each tune's table: {os.path.relpath(args.json, REPO)})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
