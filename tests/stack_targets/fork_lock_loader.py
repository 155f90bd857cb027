"""Target: a DataLoader (num_workers=2, fork) whose workers block forever on a fork-held lock.

A helper thread holds a threading.Lock while the workers are forked; in each
child the lock stays held (the holder thread does not exist there), so every
__getitem__ blocks in futex.  The main process then waits for data in poll.
Usage: fork_lock_loader.py FIFO  -- writes "ready MAIN W0 W1\n" to FIFO.
"""

import sys
import threading

import torch
from torch.utils.data import DataLoader, Dataset

LOCK = threading.Lock()
HELD = threading.Event()


class LockedDataset(Dataset):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        with LOCK:  # held forever in a forked child
            return torch.zeros(2)


def hold() -> None:
    with LOCK:
        HELD.set()
        threading.Event().wait()  # hold it for the life of the process


def main() -> None:
    threading.Thread(target=hold, name="lock-holder", daemon=True).start()
    HELD.wait(10)
    loader = DataLoader(LockedDataset(), batch_size=2, num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    pids = " ".join(str(w.pid) for w in it._workers)
    import os

    with open(sys.argv[1], "w") as fifo:
        fifo.write(f"ready {os.getpid()} {pids}\n")
    next(it)  # never returns


if __name__ == "__main__":
    main()
