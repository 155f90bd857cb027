"""Targets for tests/test_trust.py: healthy and hung loop bodies, nested watches, repeated stalls.

Usage: trust.py MODE REPORT_DIR.  Prints "ready ..." lines the tests wait for; modes that
hang are killed by the test.
"""

import os
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from datasets import Squares


class SlowAt(Dataset):
    """Every sample is quick except index SLOW, which sleeps: one slow batch per epoch, same line."""

    SLOW = 8

    def __len__(self):
        return 16

    def __getitem__(self, i):
        if i == self.SLOW:
            time.sleep(4.0)
        return torch.tensor([float(i)])


def body_blocked(report_dir):
    lock = threading.Lock()
    lock.acquire()  # never released: the loop body blocks on it for good
    loader = DataLoader(Squares(40), batch_size=4, num_workers=2)
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2, stall_timeout=30, body_timeout=2) as batches:
        for i, _ in enumerate(batches):
            if i == 2:
                print("ready", flush=True)
                lock.acquire()


def nested_progress(report_dir):
    train = DataLoader(Squares(40), batch_size=4, num_workers=2)
    val = DataLoader(Squares(60, sleep_s=0.05), batch_size=2, num_workers=1)
    with dlwatch.watch(train, report_dir=report_dir, poll_interval=0.2, body_timeout=2.5) as batches:
        for i, _ in enumerate(batches):
            if i == 1:  # a ~6 s validation pass under its own watch: progress all along
                with dlwatch.watch(val, report_dir=report_dir, poll_interval=0.2) as vb:
                    n = sum(1 for _ in vb)
                print(f"validated {n}", flush=True)
    print("done", flush=True)


def foreign_workers(report_dir):
    train = DataLoader(Squares(40), batch_size=4, num_workers=2)
    val = DataLoader(Squares(40), batch_size=4, num_workers=2, persistent_workers=True)
    val_it = iter(val)  # an unwatched validation loader whose workers stay alive
    next(val_it)
    print("val", " ".join(str(w.pid) for w in val_it._workers), flush=True)
    with dlwatch.watch(train, report_dir=report_dir, poll_interval=0.2) as batches:
        it = iter(batches)
        next(it)
        print("train", " ".join(str(w.pid) for w in it._workers), flush=True)
        time.sleep(1.5)  # the monitor scans the process tree and sees both loaders' workers
        raise RuntimeError("stop here")


def nested_exception(report_dir):
    train = DataLoader(Squares(40), batch_size=4, num_workers=1)
    val = DataLoader(Squares(40), batch_size=4, num_workers=1)
    try:
        with dlwatch.watch(train, report_dir=report_dir, poll_interval=0.2) as batches:
            for _ in batches:
                with dlwatch.watch(val, report_dir=report_dir, poll_interval=0.2) as vb:
                    for _ in vb:
                        raise KeyError("bad label")
    except KeyError as exc:
        print("caught", repr(exc), flush=True)


def repeated_stall(report_dir):
    loader = DataLoader(SlowAt(), batch_size=4, num_workers=1)
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2, stall_timeout=1.5) as w:
        for _epoch in range(2):
            for _ in w:
                pass
        with open(os.path.join(w.run_dir, "timeline.jsonl")) as f:
            stalls = sum(1 for line in f if '"event": "stall"' in line)
    print(f"stalls in timeline {stalls}", flush=True)


if __name__ == "__main__":
    globals()[sys.argv[1]](sys.argv[2])
