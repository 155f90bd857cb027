"""A lock taken by hand in one method and released in another: the workers deadlock, the holder is unknown.

A prefetcher thread pauses the dataset while it swaps in the next shard: `pause()` takes
the dataset's lock with a bare `acquire()`, the swap runs elsewhere, and `resume()`
releases it later. The workers fork while it is paused. Every worker inherits the lock
held and waits on it forever.

dlwatch recorded every other thread of the training process at each worker fork, but no
thread was inside a region of that lock (a `with` block, or `acquire()` ... `finally:
release()`): the report says `worker-deadlock`, lists the threads alive at the fork, and
says the holder is unknown rather than guess.

Like examples/deadlock.py, this script plays the job scheduler.

    python examples/lock_unknown_holder.py [--report-dir DIR]
"""

import threading

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import run_hung_training


class Shards(Dataset):
    def __init__(self):
        self.lock = threading.Lock()
        self.shard = 0

    def pause(self):
        self.lock.acquire()  # released by resume(), from wherever the swap ends

    def resume(self):
        self.lock.release()

    def __len__(self):
        return 64

    def __getitem__(self, i):
        with self.lock:  # in a worker: a copy taken while locked, never released
            return torch.full((4,), float(self.shard * 100 + i))


def swap_shards(ds, paused, stop):
    ds.pause()
    paused.set()
    stop.wait()  # the next shard never arrives in this run
    ds.shard += 1
    ds.resume()


def train(report_dir):
    ds = Shards()
    paused, stop = threading.Event(), threading.Event()
    threading.Thread(target=swap_shards, args=(ds, paused, stop), name="prefetcher", daemon=True).start()
    paused.wait()
    loader = DataLoader(ds, batch_size=4, num_workers=2, multiprocessing_context="fork")
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2, stall_timeout=3) as batches:
        for _ in batches:
            pass


if __name__ == "__main__":
    run_hung_training(__doc__.splitlines()[0], train)
