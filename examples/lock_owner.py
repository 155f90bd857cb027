"""A metrics thread inside its lock when the workers fork: dlwatch names the thread and its line.

The dataset counts what it serves in a small stats object; a background thread named
"metrics-flusher" sends the counts somewhere every so often, holding the stats lock
(`acquire()` ... `finally: release()`) while it does. Its send is slow: the workers fork
while it is inside. Every worker inherits the lock held, by a thread that does not exist
in the worker, and waits on it forever at its first sample. A second thread,
"heartbeat", merely waits on an Event: alive at the fork, never named.

dlwatch recorded where every other thread of the training process was at each worker
fork. The stall incident's top finding is `lock-held-at-fork`: thread "metrics-flusher"
was at lock_owner.py in flush(), inside the region of `self._lock`, when the workers
forked; `worker-deadlock` follows with the workers' stacks.

Like examples/deadlock.py, this script plays the job scheduler: it runs the training in
a child process and kills the child's whole process group once the report is written.

    python examples/lock_owner.py [--report-dir DIR]
"""

import threading

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import run_hung_training


class Stats:
    """Counts per label, guarded by a lock; a wrapper's acquire/release, as metrics clients have."""

    def __init__(self):
        self._lock = threading.Lock()
        self.counts = {}

    def acquire(self):
        self._lock.acquire()

    def release(self):
        self._lock.release()

    def add(self, label):
        self.acquire()
        try:
            self.counts[label] = self.counts.get(label, 0) + 1
        finally:
            self.release()

    def flush(self, send):
        self._lock.acquire()
        try:
            send(dict(self.counts))  # a slow network send, under the lock
            self.counts.clear()
        finally:
            self._lock.release()


class Counted(Dataset):
    def __init__(self, stats):
        self.stats = stats

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.stats.add(i % 10)  # in a worker: the copy of a lock taken while held, never released
        return torch.full((4,), float(i))


def train(report_dir):
    stats = Stats()
    inside, stop = threading.Event(), threading.Event()

    def slow_send(counts):
        inside.set()
        stop.wait()  # the send that never returns in this run (a peer that does not answer)

    threading.Thread(target=lambda: stats.flush(slow_send), name="metrics-flusher", daemon=True).start()
    threading.Thread(target=stop.wait, name="heartbeat", daemon=True).start()
    inside.wait()  # the flusher holds the lock from here on
    loader = DataLoader(Counted(stats), batch_size=4, num_workers=2, multiprocessing_context="fork")
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2, stall_timeout=3) as batches:
        for _ in batches:
            pass


if __name__ == "__main__":
    run_hung_training(__doc__.splitlines()[0], train)
