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

import os
import signal
import subprocess
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports

CHILD = "DLWATCH_EXAMPLE_TRAINING_CHILD"
GIVE_UP_S = 45.0


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


def supervise(report_dir):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` below still kills the child
    before = incidents(report_dir)
    child = subprocess.Popen(
        [sys.executable, *sys.argv], env=dict(os.environ, **{CHILD: "1"}), start_new_session=True
    )  # its own process group: one kill takes all of it
    deadline = time.monotonic() + GIVE_UP_S
    try:
        while child.poll() is None and time.monotonic() < deadline and not (incidents(report_dir) - before):
            time.sleep(0.2)
        time.sleep(0.3)  # let the monitor finish its one-line notice on stderr
        if child.poll() is None:
            print("training is hung and the report is written: killing it (as a scheduler's time limit would)")
    finally:
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        child.wait()
    print_reports(report_dir, before)


def main():
    args = parse_args(__doc__.splitlines()[0])
    if os.environ.get(CHILD) == "1":
        train(args.report_dir)
    else:
        supervise(args.report_dir)


if __name__ == "__main__":
    main()
