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
