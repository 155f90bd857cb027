"""Processes the benchmarks start: real DataLoaders with real workers (fork).

Usage: targets.py MODE ARGS...; each prints one line "ready ..." on stdout when set up.

  idle N                        N persistent workers, idle after the first batch;
                                prints "ready MAIN W1 .. WN"
  busy N                        N persistent workers kept busy (about 2 ms of CPU an item, the
                                loop taking every batch): every poll finds them changed;
                                prints "ready MAIN W1 .. WN"
  hang N                        N workers blocked for good on a lock held across fork;
                                prints "ready MAIN W1 .. WN"
  watched-hang N DIR STALL POLL  under dlwatch.watch: one healthy epoch, a random pause of up
                                to POLL, then an epoch whose workers block on a fork-held lock;
                                prints "ready HANG_TS" (time.time() just before that epoch's
                                loop starts, so worker start-up counts as part of the hang)
  train N SECONDS DIR           under dlwatch.watch (default poll interval): a healthy loop,
                                5 ms of "step" per batch, for SECONDS; prints
                                "ready MONITOR_PID RUN_DIR" after the first batch
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

LOCK = threading.Lock()


class Small(Dataset):
    def __len__(self) -> int:
        return 1_000_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((4,), float(i))


class Busy(Small):
    def __getitem__(self, i: int) -> torch.Tensor:
        end = time.process_time() + 0.002
        while time.process_time() < end:
            pass
        return torch.full((4,), float(i))


class Locked(Small):
    def __getitem__(self, i: int) -> torch.Tensor:
        with LOCK:  # in a child forked while another thread held it: blocks forever (futex)
            return torch.full((4,), float(i))


def hold_lock() -> None:
    held = threading.Event()

    def run() -> None:
        with LOCK:
            held.set()
            threading.Event().wait()

    threading.Thread(target=run, name="lock-holder", daemon=True).start()
    held.wait(10)


def ready(*words: object) -> None:
    sys.stdout.write(" ".join(["ready", *map(str, words)]) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> None:
    mode, n = argv[0], int(argv[1])
    if mode in ("idle", "busy"):
        loader = DataLoader(
            Small() if mode == "idle" else Busy(),
            batch_size=1,
            num_workers=n,
            persistent_workers=True,
            multiprocessing_context="fork",
        )
        it = iter(loader)
        next(it)
        ready(os.getpid(), *(w.pid for w in it._workers))
        if mode == "idle":
            threading.Event().wait()
        while True:  # busy: persistent workers, the same processes epoch after epoch
            for _ in it:
                pass
            it = iter(loader)
    elif mode == "hang":
        hold_lock()
        loader = DataLoader(Locked(), batch_size=1, num_workers=n, multiprocessing_context="fork")
        it = iter(loader)
        ready(os.getpid(), *(w.pid for w in it._workers))
        next(it)  # never returns
    elif mode == "watched-hang":
        import dlwatch

        report_dir, stall, poll = argv[2], float(argv[3]), float(argv[4])
        loader = DataLoader(Locked(), batch_size=1, num_workers=n, multiprocessing_context="fork", sampler=range(4 * n))
        with dlwatch.watch(loader, report_dir=report_dir, stall_timeout=stall, poll_interval=poll):
            for _ in loader:  # healthy: the lock is free when these workers fork
                pass
            time.sleep(random.random() * poll)  # a random phase against the monitor's polls
            hold_lock()
            ready(repr(time.time()))
            for _ in loader:  # never gets a batch
                pass
    elif mode == "train":
        import dlwatch

        seconds, report_dir = float(argv[2]), argv[3]
        loader = DataLoader(Small(), batch_size=8, num_workers=n, multiprocessing_context="fork")
        with dlwatch.watch(loader, report_dir=report_dir) as w:
            end = None
            for _ in loader:
                if end is None:
                    end = time.monotonic() + seconds
                    ready(w.monitor_pid, w.run_dir)
                time.sleep(0.005)
                if time.monotonic() >= end:
                    break
    else:
        raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
