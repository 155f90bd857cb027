"""Look-alikes of real failures, and the failures themselves, as seen on PyTorch's own DataLoader tests.

    python false_findings.py MODE REPORT_DIR

Modes (each run under ``dlwatch.watch``; the exception, if any, leaves the block as in a real job):

- ``timeout-starting``: a ``timeout=1`` spawn loader whose workers are still starting (a fresh
  interpreter importing torch, then a worker_init_fn and samples that sleep) when torch raises
  ``DataLoader timed out`` (PyTorch's ``test_timeout``): not a deadlock.
- ``timeout-deadlock-fork``: a lock held by a thread of the main process when the fork workers
  start; once every worker waits on it, ``next()`` with ``timeout=2`` raises: a deadlock.
- ``timeout-deadlock-spawn``: spawn workers that take their own non-reentrant lock twice; once
  they wait on it, ``timeout=2`` raises: a deadlock, on a loader that already uses spawn.
- ``short-spawn``: 6 batches from spawn workers whose start-up grows their memory steadily for
  ~12 s (a slow import on a loaded machine) before the first batch: start-up, not growth.
- ``fd-leak``: a dataset that keeps every file it opens, under ``ulimit -n 128``: the fd climb is
  seen (a threshold incident) before the worker's ``Too many open files`` (the exception incident).
- ``segfault-own-faulthandler``: the program enables faulthandler itself (as PyTorch's
  ``test_segfault`` does), then a worker dies of SIGSEGV in ``__getitem__``.
"""

import ctypes
import faulthandler
import multiprocessing
import os
import resource
import sys
import tempfile
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch

WAIT_S = 90  # the bound on waiting for the workers to reach their lock (the test's own bound is larger)


class SleepDataset(Dataset):
    def __len__(self):
        return 10

    def __getitem__(self, i):
        time.sleep(3)
        return torch.tensor([i])


def sleepy_init(worker_id):
    time.sleep(2)


class HeldAtFork(Dataset):
    """Every worker waits forever on a lock a main-process thread held when they forked."""

    def __init__(self, reached):
        self.lock = threading.Lock()
        self.reached = reached

    def __len__(self):
        return 64

    def __getitem__(self, i):
        self.reached.release()
        with self.lock:
            return torch.tensor([i])


class TakesItsLockTwice(Dataset):
    """Spawn workers: the lock is the worker's own, taken again while held (a re-entrance bug)."""

    def __init__(self, reached):
        self.reached = reached
        self.lock = None

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if self.lock is None:
            self.lock = threading.Lock()
        with self.lock:
            self.reached.release()
            with self.lock:
                return torch.tensor([i])


class SlowStart:
    """A worker_init_fn whose memory grows steadily for ~12 s, like torch's import on a loaded machine."""

    def __call__(self, worker_id):
        self.chunks = []
        for _ in range(24):
            self.chunks.append(bytearray(12 << 20))  # 12 MiB every 0.5 s, written: private pages
            time.sleep(0.5)


class LeakyFiles(Dataset):
    def __init__(self, path):
        self.path = path
        self.handles = {}  # BUG: never closed

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        f = self.handles[i] = open(self.path, "rb")
        time.sleep(0.05)  # a climb of several seconds: the monitor sees it before the error
        return torch.tensor(len(f.read()))


class Segfaults(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 5:
            ctypes.string_at(0)
        return torch.tensor([i])


def wait_workers_blocked(it_batches, reached, n):
    """Start the workers (iter), then wait until each is about to block on its lock."""
    it = iter(it_batches)
    for _ in range(n):
        if not reached.acquire(timeout=WAIT_S):
            raise SystemExit("the workers never reached their lock")
    time.sleep(0.5)  # from "about to take the lock" to waiting on it: a handful of bytecodes
    print("BLOCKED", flush=True)
    return it


def main(mode, report_dir):
    if mode == "timeout-starting":
        dl = DataLoader(
            SleepDataset(),
            batch_size=2,
            num_workers=2,
            timeout=1,
            multiprocessing_context="spawn",
            worker_init_fn=sleepy_init,
        )
        with dlwatch.watch(dl, report_dir=report_dir) as batches:
            next(iter(batches))
    elif mode == "timeout-deadlock-fork":
        ctx = multiprocessing.get_context("fork")
        reached = ctx.Semaphore(0)
        ds = HeldAtFork(reached)
        holding, release = threading.Event(), threading.Event()

        def refresh():
            with ds.lock:
                holding.set()
                release.wait()

        threading.Thread(target=refresh, daemon=True).start()
        holding.wait()
        dl = DataLoader(ds, batch_size=2, num_workers=2, timeout=2, multiprocessing_context=ctx)
        with dlwatch.watch(dl, report_dir=report_dir) as batches:
            next(wait_workers_blocked(batches, reached, 2))
    elif mode == "timeout-deadlock-spawn":
        ctx = multiprocessing.get_context("spawn")
        reached = ctx.Semaphore(0)
        dl = DataLoader(TakesItsLockTwice(reached), batch_size=2, num_workers=2, timeout=2, multiprocessing_context=ctx)
        with dlwatch.watch(dl, report_dir=report_dir) as batches:
            next(wait_workers_blocked(batches, reached, 2))
    elif mode == "short-spawn":
        dl = DataLoader(
            torch.arange(12.0), batch_size=2, num_workers=2, multiprocessing_context="spawn", worker_init_fn=SlowStart()
        )
        with dlwatch.watch(dl, report_dir=report_dir, poll_interval=0.2) as batches:
            n = sum(1 for _ in batches)
        print(f"BATCHES {n}", flush=True)
    elif mode == "fd-leak":
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
        torch.multiprocessing.set_sharing_strategy("file_system")
        with tempfile.NamedTemporaryFile() as sample:
            sample.write(b"x" * 64)
            sample.flush()
            dl = DataLoader(LeakyFiles(sample.name), batch_size=4, num_workers=2)
            with dlwatch.watch(dl, report_dir=report_dir, poll_interval=0.2) as batches:
                for _ in batches:
                    pass
    elif mode == "segfault-own-faulthandler":
        faulthandler.enable()  # the program's own choice, to its stderr: the fork workers inherit it
        dl = DataLoader(Segfaults(), batch_size=2, num_workers=2)
        with dlwatch.watch(dl, report_dir=report_dir, poll_interval=0.2) as batches:
            for _ in batches:
                pass
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(sys.argv[1], sys.argv[2])
