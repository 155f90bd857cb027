"""A real DataLoader job whose dataset recurses DEPTH frames deep, then hangs for good, under dlwatch.watch.

Usage: deep_loader.py REPORT_DIR DEPTH WORKERS

Each worker's __getitem__ descends DEPTH frames and then waits on a lock that a thread of the
main process held when the workers forked (never released in a worker).  Prints
"READY <worker pids...>" once every worker is that deep (its dump handler registered and its
stack at the lock), then the main process waits for data for good.
"""

import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch

LOCK = threading.Lock()


class DeepDataset(Dataset):
    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i):
        return self.descend(self.depth, i)

    def descend(self, n: int, i: int):
        if n <= 0:
            with LOCK:  # held in the main process at fork: never released in the worker
                return torch.zeros(2)
        return self.descend(n - 1, i)


def hold_lock_forever() -> None:
    with LOCK:
        time.sleep(3600)


if __name__ == "__main__":
    report_dir, depth, workers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sys.setrecursionlimit(depth + 1000)
    threading.Thread(target=hold_lock_forever, daemon=True).start()
    while not LOCK.locked():
        time.sleep(0.001)
    dl = DataLoader(DeepDataset(depth), batch_size=2, num_workers=workers, multiprocessing_context="fork")
    with dlwatch.watch(dl, report_dir=report_dir, stall_timeout=600, poll_interval=0.2):
        it = iter(dl)
        print("READY", *(w.pid for w in it._workers), flush=True)
        for _ in it:
            pass
