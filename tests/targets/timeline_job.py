"""A real watched DataLoader that stays up, with user text where the monitor's samples carry it.

usage: timeline_job.py REPORT_DIR SECRET_DIR
The main process names itself (comm) "pw=hunter2"; it and its 2 forked workers hold a file
under SECRET_DIR (a directory whose name holds a token).  Prints "READY RUN_DIR" after the
first batch, then waits inside the watch block until it is killed.
"""

import ctypes
import os
import sys
import threading

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch

PR_SET_NAME = 15


class Small(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return torch.zeros(2)


if __name__ == "__main__":
    report_dir, secret_dir = sys.argv[1], sys.argv[2]
    held = open(os.path.join(secret_dir, "data.bin"), "wb")  # inherited by the forked workers
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_NAME, b"pw=hunter2", 0, 0, 0) != 0:
        raise SystemExit(f"prctl(PR_SET_NAME) failed: errno {ctypes.get_errno()}")
    loader = DataLoader(Small(), batch_size=1, num_workers=2, persistent_workers=True, multiprocessing_context="fork")
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2) as w:
        it = iter(loader)
        next(it)
        print("READY", w.run_dir, flush=True)
        threading.Event().wait()
