"""Real runs for the texts a newcomer reads (tests/test_texts.py).

usage: texts_runs.py MODE REPORT_DIR
  fork-threads-as     a thread alive when the workers fork, under `with watch(loader) as batches`
  fork-threads-plain  the same under `with watch(loader): for batch in loader`
  fork-threads-bare   the same with no watch (run it under `dlwatch run`)
  stuck-after-batches 4 batches, then the loader waits for data forever (num_workers=0)
  pinned              pin_memory=True with no accelerator: advice, and the pointer line to the summary
  two-loaders         2 loaders x 3 epochs, with a little memory locked for the first half (run it
                      under `dlwatch run`)
REPORT_DIR "-" means the default directory.
"""

import ctypes
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch


class Squares(Dataset):
    def __init__(self, n, delay_s=0.0):
        self.n, self.delay_s = n, delay_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.delay_s:
            time.sleep(self.delay_s)
        return torch.full((4,), float(i * i))


class StuckAfter(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i >= 16:
            threading.Event().wait()  # the data never comes
        return torch.zeros(4)


def fork_threads(form, report_dir):
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="refresher", daemon=True).start()
    loader = DataLoader(Squares(8), batch_size=2, num_workers=2, multiprocessing_context="fork")
    if form == "as":
        with dlwatch.watch(loader, report_dir=report_dir) as batches:
            for _ in batches:  # LINE-AS
                pass
    elif form == "plain":
        with dlwatch.watch(loader, report_dir=report_dir):
            for _ in loader:  # LINE-PLAIN
                pass
    else:
        for _ in loader:  # LINE-BARE
            pass
    stop.set()


def locked(nbytes):
    """``nbytes`` of this process's memory locked (Mlocked moves), or None where mlock is refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(nbytes)
    return buf if libc.mlock(buf, ctypes.c_size_t(nbytes)) == 0 else None


if __name__ == "__main__":
    mode, report_dir = sys.argv[1], sys.argv[2]
    report_dir = None if report_dir == "-" else report_dir
    if mode.startswith("fork-threads-"):
        fork_threads(mode.rsplit("-", 1)[1], report_dir)
    elif mode == "stuck-after-batches":
        loader = DataLoader(StuckAfter(), batch_size=4, num_workers=0)
        with dlwatch.watch(loader, report_dir=report_dir, stall_timeout=2, poll_interval=0.2):
            for i, _ in enumerate(loader):
                if i == 3:
                    print("READY", flush=True)
    elif mode == "pinned":
        loader = DataLoader(Squares(16), batch_size=4, num_workers=0, pin_memory=True)
        with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.1):
            for _ in loader:
                pass
    elif mode == "two-loaders":
        train = DataLoader(Squares(48, delay_s=0.01), batch_size=4, num_workers=2)
        val = DataLoader(Squares(16, delay_s=0.01), batch_size=4, num_workers=1)
        held = locked(256 * 1024)
        for epoch in range(3):
            for _ in train:
                pass
            for _ in val:
                pass
            if epoch == 1:
                held = None  # unlocked with its buffer: Mlocked falls
        print("DONE", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")
