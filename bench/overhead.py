"""Overhead in the training loop: bare vs dlwatch.watch vs torch.profiler, alternating in one process.

Each round runs one epoch of each arm, in a balanced order, over identical loaders
(same kind of dataset): two bare (an A/A pair that shows the noise floor) and one
watched for the whole experiment (one ``with`` block, so the monitor polls in the
background during every arm).  torch.profiler is compared with a bare loader in a
rotation of its own afterwards (see PROFILER_ORDERS for why).
Only the loop is timed; ratios and added microseconds per batch are taken per
round and then the median over rounds, so drift and noise from other processes
on the machine hit all arms alike.  The fixed cost of entering and leaving the
block is measured apart.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import time
from typing import Any, Callable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from bench._common import median

ARMS = ("bare", "bare_again", "watch")  # bare_again: an A/A arm, the noise floor
# Every order of the 3 arms once per 6 rounds: each arm runs as often in each position and after
# each other arm, so what an epoch leaves behind (workers still exiting) lands on every arm alike.
ORDERS = ((0, 1, 2), (1, 2, 0), (2, 0, 1), (0, 2, 1), (1, 0, 2), (2, 1, 0))
# torch.profiler is compared in a rotation of its own (bare, profiler), never in the one above:
# an epoch run right after a profiled one was measured slower by 0.3 to 1.9 µs a batch for the
# watched loop but not for the bare one (bench/README.md), which put the profiler's aftermath
# into dlwatch's figure.
PROFILER_ORDERS = ((0, 1), (1, 0))


class Images(Dataset):
    """A realistic sample: a seeded 3x32x32 image, normalised (about 0.1 ms of CPU)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x = torch.rand(3, 32, 32, generator=torch.Generator().manual_seed(i))
        return (x - x.mean()) / (x.std() + 1e-6), i % 10


def _first(batch: list[Any]) -> Any:
    return batch[0]


def fast_loader(n: int) -> DataLoader:
    # batch_size=1 and a trivial collate: what is left per batch is the DataLoader's own machinery
    return DataLoader(list(range(n)), batch_size=1, collate_fn=_first)


def realistic_loader(n_batches: int) -> DataLoader:
    return DataLoader(Images(32 * n_batches), batch_size=32, num_workers=2, multiprocessing_context="fork")


@contextlib.contextmanager
def _quiet_stderr() -> Iterator[None]:
    """Kineto prints 'USDT: profiler_start' lines on fd 2; keep them out of the table."""
    saved = os.dup(2)
    try:
        with open(os.devnull, "wb") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def _epoch(loader: DataLoader) -> tuple[float, int, float, float]:
    """(loop seconds, batches, seconds to the first batch: worker start-up and dlwatch's worker hook,
    CPU seconds of this thread: with num_workers=0 the whole loop, and blind to the time the
    thread waits for a CPU on a loaded machine)."""
    n = 0
    first = 0.0
    c0 = time.thread_time()
    t0 = time.perf_counter()
    for _ in loader:
        if not n:
            first = time.perf_counter() - t0
        n += 1
    return time.perf_counter() - t0, n, first, time.thread_time() - c0


def _profiled_epoch(loader: DataLoader) -> tuple[float, int, float, float]:
    from torch.profiler import ProfilerActivity, profile

    with _quiet_stderr(), profile(activities=[ProfilerActivity.CPU]):
        return _epoch(loader)


class _CpuTimedHook:
    """Wraps dlwatch's worker hook; each worker writes the hook's CPU time (ms) to a pipe."""

    def __init__(self, hook: Any, fd: int) -> None:
        self.hook, self.fd = hook, fd

    def __call__(self, worker_id: int) -> None:
        c0 = time.process_time()
        self.hook(worker_id)
        os.write(self.fd, f"{(time.process_time() - c0) * 1e3:.4f}\n".encode())


def compare(make: Callable[[], DataLoader], rounds: int, report_dir: str) -> dict[str, Any]:
    bare, bare_again, watched, profiled = make(), make(), make(), make()
    times: dict[str, list[float]] = {a: [] for a in ARMS + ("profiler", "profiler_bare")}
    firsts: dict[str, list[float]] = {a: [] for a in ARMS}
    cpus: dict[str, list[float]] = {a: [] for a in ARMS}
    batches = 0
    rfd, wfd = os.pipe()
    with dlwatch.watch(watched, report_dir=report_dir):
        hook = watched.worker_init_fn
        if watched.num_workers:
            watched.worker_init_fn = _CpuTimedHook(hook, wfd)
        run = {"bare": lambda: _epoch(bare), "bare_again": lambda: _epoch(bare_again), "watch": lambda: _epoch(watched)}
        for arm in ARMS:  # warm-up: first forks, caches
            run[arm]()
        for r in range(rounds):
            for arm in [ARMS[i] for i in ORDERS[r % len(ORDERS)]]:
                dt, batches, first, cpu = run[arm]()
                times[arm].append(dt)
                firsts[arm].append(first)
                cpus[arm].append(cpu)
        watched.worker_init_fn = hook
        # the profiler's rotation, after dlwatch's, still inside the block (the monitor polls on)
        prof_arms = {"profiler_bare": lambda: _epoch(bare), "profiler": lambda: _profiled_epoch(profiled)}
        _profiled_epoch(profiled)  # warm-up: the first profiler start
        for r in range(max(4, rounds // 2)):
            for arm in [("profiler_bare", "profiler")[i] for i in PROFILER_ORDERS[r % 2]]:
                times[arm].append(prof_arms[arm]()[0])
    os.close(wfd)
    os.set_blocking(rfd, False)  # forked workers of the other loaders hold the write end too: no EOF wait
    raw = b""
    try:
        while chunk := os.read(rfd, 65536):
            raw += chunk
    except BlockingIOError:
        pass
    os.close(rfd)
    hook_ms = [float(x) for x in raw.split()]
    bare_t, watch_t = times["bare"], times["watch"]
    pbare_t, prof_t = times["profiler_bare"], times["profiler"]
    return {
        "batches_per_epoch": batches,
        "rounds": rounds,
        "profiler_rounds": len(prof_t),
        "bare_batches_per_s": batches / median(bare_t),
        "watch_batches_per_s": batches / median(watch_t),
        "profiler_batches_per_s": batches / median(prof_t),
        # throughput ratio = t_bare / t_arm, per round
        "watch_ratio": median([b / w for b, w in zip(bare_t, watch_t)]),
        "aa_ratio": median([b / a for b, a in zip(bare_t, times["bare_again"])]),  # 1.0 but for noise
        "aa_spread": _spread([b / a for b, a in zip(bare_t, times["bare_again"])]),
        "profiler_ratio": median([b / p for b, p in zip(pbare_t, prof_t)]),
        "watch_added_us_per_batch": median([(w - b) / batches * 1e6 for b, w in zip(bare_t, watch_t)]),
        # the same in CPU time of the loop's thread (num_workers=0: all of the loop), and its A/A figure
        "watch_added_cpu_us_per_batch": median([(w - b) / batches * 1e6 for b, w in zip(cpus["bare"], cpus["watch"])]),
        "aa_added_cpu_us_per_batch": median(
            [(a - b) / batches * 1e6 for b, a in zip(cpus["bare"], cpus["bare_again"])]
        ),
        # the same without each epoch's first batch (worker start-up, where dlwatch's worker hook runs)
        "watch_ratio_after_first_batch": median(
            [(b - fb) / (w - fw) for b, w, fb, fw in zip(bare_t, watch_t, firsts["bare"], firsts["watch"])]
        ),
        "watch_added_ms_first_batch": median([(fw - fb) * 1e3 for fb, fw in zip(firsts["bare"], firsts["watch"])]),
        "profiler_added_us_per_batch": median([(p - b) / batches * 1e6 for b, p in zip(pbare_t, prof_t)]),
        "worker_hook_cpu_ms": median(hook_ms),  # per worker start (each epoch without persistent_workers)
        "epoch_s": {a: [round(t, 5) for t in ts] for a, ts in times.items()},
    }


def _spread(ratios: list[float]) -> float:
    """Half the interquartile range of per-round ratios: how far one round's ratio wanders."""
    q = statistics.quantiles(ratios, n=4) if len(ratios) >= 2 else [1.0, 1.0, 1.0]
    return (q[2] - q[0]) / 2


def _wait_for(path: str, timeout: float) -> float | None:
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        if os.path.exists(path):
            return time.perf_counter() - t0
        time.sleep(0.002)
    return None


def block_costs(reps: int, report_dir: str) -> dict[str, Any]:
    """Enter and leave ``watch`` on a DataLoader, with an empty block and once the monitor polls.

    Also the monitor's start-up: from entering the block to its first sample on disk.
    """
    enter, exit_empty, exit_running, startup = [], [], [], []
    for _ in range(reps):
        loader = fast_loader(10)
        t0 = time.perf_counter()
        w = dlwatch.watch(loader, report_dir=report_dir)
        w.__enter__()
        t1 = time.perf_counter()
        w.__exit__(None, None, None)
        exit_empty.append(time.perf_counter() - t1)
        enter.append(t1 - t0)

        w = dlwatch.watch(loader, report_dir=report_dir)
        t0 = time.perf_counter()
        w.__enter__()
        entered = time.perf_counter() - t0
        first = _wait_for(os.path.join(w.run_dir or "", "timeline.jsonl"), 10.0)
        if first is not None:
            startup.append(first + entered)
        time.sleep(0.2)
        t1 = time.perf_counter()
        w.__exit__(None, None, None)
        exit_running.append(time.perf_counter() - t1)
    return {
        "reps": reps,
        "enter_s": median(enter),
        "exit_empty_block_s": median(exit_empty),
        "exit_monitor_running_s": median(exit_running),
        "monitor_startup_s": median(startup),
        "enter_s_all": [round(x, 4) for x in enter],
        "exit_monitor_running_s_all": [round(x, 4) for x in exit_running],
        "monitor_startup_s_all": [round(x, 4) for x in startup],
    }


def python_startup(reps: int) -> float | None:
    """Popen to exit of a bare ``python -c pass``: the floor for any separate monitor process."""
    import subprocess
    import sys

    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        out.append(time.perf_counter() - t0)
    return median(out)


def run(quick: bool) -> dict[str, Any]:
    torch.set_num_threads(1)  # same for all arms; intra-op threads only add noise on 2 cores
    with tempfile.TemporaryDirectory(prefix="dlwatch-bench-") as tmp:
        fast_n = 20_000 if quick else 50_000
        fast = compare(lambda: fast_loader(fast_n), 6 if quick else 18, tmp)  # rounds: whole turns of ORDERS
        real = compare(lambda: realistic_loader(100 if quick else 300), 6 if quick else 12, tmp)
        block = block_costs(3 if quick else 6, tmp)
        block["python_startup_s"] = python_startup(3 if quick else 6)
        leftovers = [n for n in os.listdir(tmp) if not n.startswith(".") and n != "runs"]  # runs/: summaries
    return {"fast": fast, "realistic": real, "block": block, "incidents_written": leftovers}
