"""What recording the other threads at each worker fork costs: ``python bench/forkthreads_cost.py``.

Side by side in one run, medians of many rounds:

- per fork: one ``forkthreads.snapshot()`` (what the at-fork hook does) with 1, 4 and 16 other
  threads alive (each a few frames deep, as a refresher or a metrics thread is), against one
  bare ``os.fork()`` of this process (fork, child ``_exit``, ``waitpid``);
- per epoch: the record of W worker forks (W snapshots with 4 other threads alive) against
  building the iterator of a bare fork DataLoader with W = 2 and 8 workers (torch starts them
  all in ``iter()``).  The armed-minus-bare difference of two iter() timings is below the
  noise of a fork on a shared machine, so the record's part is its measured snapshot times W.

Prints a Markdown table; the README's benchmark table quotes it.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time

# the checkout, for bench._common: last, so that an installed dlwatch comes first
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

from bench._common import dlwatch_under_test  # noqa: E402
from dlwatch.inproc import forkthreads  # noqa: E402


class Tiny(Dataset):
    def __len__(self) -> int:
        return 1 << 20

    def __getitem__(self, i: int):
        return torch.zeros(1)


def _park(stop: threading.Event, depth: int) -> None:
    if depth:
        _park(stop, depth - 1)
    else:
        stop.wait()


def _threads(n: int) -> tuple[threading.Event, list[threading.Thread]]:
    stop = threading.Event()
    ts = [threading.Thread(target=_park, args=(stop, 4), daemon=True) for _ in range(n)]
    for t in ts:
        t.start()
    return stop, ts


def _median_us(fn, rounds: int) -> float:
    out = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(out)


def _fork_once() -> None:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _epoch(workers: int) -> None:
    dl = DataLoader(Tiny(), batch_size=1, num_workers=workers, multiprocessing_context="fork")
    it = iter(dl)
    it._shutdown_workers()


def main() -> None:
    import warnings

    dlwatch_under_test(editable="--editable" in sys.argv[1:])

    warnings.filterwarnings("ignore", message="This DataLoader will create")
    rows = []
    for n in (1, 4, 16):
        stop, ts = _threads(n)
        try:
            snap = _median_us(forkthreads.snapshot, 400)
            fork = _median_us(_fork_once, 60)
        finally:
            stop.set()
            for t in ts:
                t.join()
        rows.append((f"one fork, {n} other thread(s)", snap, fork))
    four = rows[1][1]
    for w in (2, 8):
        bare = _median_us(lambda: _epoch(w), 5)
        rows.append((f"an epoch's iter() of a fork loader, {w} workers, 4 other threads", w * four, bare))
    print(f"load average {os.getloadavg()[0]:.1f}, {os.cpu_count()} CPUs")
    print("| figure | record | baseline | record / baseline |")
    print("|---|---|---|---|")
    for name, rec, base in rows:
        print(f"| {name} | {rec:.1f} µs | {base:.0f} µs | {rec / base * 100:.2f}% |")


if __name__ == "__main__":
    main()
