"""A multiprocessing lock shared by the dataset's workers and the training process (a shared index file's
lock), and who holds it when the loop stops.

    python shared_lock.py main|other REPORT_DIR

``main``: the training process takes the lock (``with ds.lock:``) after the workers started and
iterates the loader inside it: the workers wait for the lock, the loop for their batches.
``other``: a helper process of the job takes the same lock and never lets go; the training process
holds nothing (it does hold a threading lock named ``lock`` of its own, which no worker shares).
Prints ``READY`` before the loop; a stall incident follows after ``stall_timeout`` (3 s).
"""

import multiprocessing as mp
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch


class Shared(Dataset):
    def __init__(self, lock):
        self.lock = lock

    def __len__(self):
        return 64

    def __getitem__(self, i):
        with self.lock:
            time.sleep(0.01)
        return torch.tensor([i])


def hold_forever(lock):
    lock.acquire()
    time.sleep(3600)


def main():
    mode, report_dir = sys.argv[1], sys.argv[2]
    ds = Shared(mp.Lock())
    loader = DataLoader(ds, batch_size=4, num_workers=2)
    with dlwatch.watch(loader, report_dir=report_dir, stall_timeout=3, poll_interval=0.5):
        it = iter(loader)
        next(it)
        if mode == "main":
            print("READY", flush=True)
            with ds.lock:  # taken after the workers forked, held across the loop: the bug
                for _ in it:
                    pass
        else:
            holder = mp.Process(target=hold_forever, args=(ds.lock,), daemon=True)
            holder.start()
            time.sleep(0.5)
            print("READY", flush=True)
            lock = threading.Lock()  # the training process's own lock of the same name: not the workers'
            with lock:
                for _ in it:
                    pass


if __name__ == "__main__":
    main()
