"""A lock held by another thread at the moment the workers fork: every worker waits on it forever.

fork copies the lock in its locked state, but not the thread that would release
it. The workers block in Dataset.__getitem__ (a futex wait, no CPU time), the
training loop waits for a batch that never comes, and nothing raises.
`watch(stall_timeout=3)` turns the silence into a `stall` incident after 3 s:
py-spy stacks of every process, classification `deadlock`, playbook
worker-deadlock.

A real hang never ends by itself, so this script plays the job scheduler: it
runs the training in a child process and, once the report is written (or after
45 s), kills the child's whole process group (training process, workers and
dlwatch's monitor) with SIGKILL.

    python examples/deadlock.py [--report-dir DIR]
"""

import threading

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import run_hung_training


class CachedSamples(Dataset):
    """A dataset with a cache guarded by a lock, which a background thread refreshes."""

    def __init__(self):
        self.lock = threading.Lock()
        self.cache = {}

    def __len__(self):
        return 64

    def __getitem__(self, i):
        with self.lock:  # in a worker: a copy taken while locked, never released
            return self.cache.setdefault(i, torch.full((4,), float(i)))

    def refresh_in_background(self, started, release):
        with self.lock:
            started.set()
            release.wait()  # a slow refresh: the workers fork while it holds the lock
            self.cache.clear()


def train(report_dir):
    dataset = CachedSamples()
    started, release = threading.Event(), threading.Event()
    threading.Thread(target=dataset.refresh_in_background, args=(started, release), daemon=True).start()
    started.wait()  # the refresh holds the lock from here until `release` (never, in this run)
    # fork is the Linux default before Python 3.14; 'spawn' or 'forkserver' would not copy the held lock
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2, stall_timeout=3) as batches:
        for _ in batches:
            pass


if __name__ == "__main__":
    run_hung_training(__doc__.splitlines()[0], train)
