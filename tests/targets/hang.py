"""Hangs for real: `deadlock` (a lock held by another thread at fork), `slow` (workers burn CPU).

usage: hang.py MODE REPORT_DIR [--unwatched] [--stall-timeout S]
Prints READY once its workers run; then blocks (deadlock) or crawls (slow).
"""

import argparse
import contextlib
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch

LOCK = threading.Lock()


class LockedDataset(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        with LOCK:  # held by the main process's holder thread when the workers forked
            return torch.zeros(4)


class BusyDataset(Dataset):
    def __init__(self, busy_s, n=3):
        self.busy_s = busy_s
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        end = time.process_time() + self.busy_s
        x = 0
        while time.process_time() < end:  # CPU work, not sleep: alive, just slow
            x += 1
        return torch.full((2,), float(i))


def hold_lock_forever():
    with LOCK:
        time.sleep(3600)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["deadlock", "slow"])
    ap.add_argument("report_dir")
    ap.add_argument("--unwatched", action="store_true")
    ap.add_argument("--stall-timeout", type=float, default=1.5)
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args()
    if args.mode == "deadlock":
        threading.Thread(target=hold_lock_forever, daemon=True).start()
        while not LOCK.locked():
            time.sleep(0.001)
        dl = DataLoader(LockedDataset(), batch_size=4, num_workers=args.workers, multiprocessing_context="fork")
    else:
        dl = DataLoader(BusyDataset(busy_s=2.0), batch_size=1, num_workers=args.workers)
    ctx = (
        contextlib.nullcontext()
        if args.unwatched
        else dlwatch.watch(dl, report_dir=args.report_dir, stall_timeout=args.stall_timeout, poll_interval=0.2)
    )
    with ctx:
        it = iter(dl)
        print("READY", flush=True)
        for _ in it:
            pass
    print("DONE", flush=True)
