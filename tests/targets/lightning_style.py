"""A Lightning-style loop that knows nothing of dlwatch (for `dlwatch run`).

usage: lightning_style.py EPOCHS STALL_EPOCHS STALL_S

Each epoch takes ``len(loader)`` batches with ``next()`` (no StopIteration) from an iterator
that is kept until the next epoch's ``iter()`` (as Lightning's fetcher does), then runs a
validation loader the same way.  In each epoch named in STALL_EPOCHS (comma-separated), a
worker sleeps STALL_S seconds in ``__getitem__`` of sample 9: a real worker stall.
Prints ``EPOCH n`` as each epoch starts, and ``DONE`` at the end.
"""

import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset


class Slow(Dataset):
    def __init__(self, n, stall_epochs=(), stall_s=0.0):
        self.n, self.stall_epochs, self.stall_s = n, stall_epochs, stall_s
        self.epoch = 0  # set before each epoch's iter(): forked workers copy it

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i == 9 and self.epoch in self.stall_epochs:
            time.sleep(self.stall_s)
        return torch.tensor([float(i)])


def main():
    epochs = int(sys.argv[1])
    stall_epochs = {int(e) for e in sys.argv[2].split(",") if e}
    stall_s = float(sys.argv[3])
    train_set = Slow(16, stall_epochs, stall_s)
    train = DataLoader(train_set, batch_size=2, num_workers=2)
    val = DataLoader(Slow(8), batch_size=2, num_workers=1)
    train_it = val_it = None
    for epoch in range(epochs):
        print(f"EPOCH {epoch}", flush=True)
        train_set.epoch = epoch
        train_it = iter(train)  # the previous epoch's iterator goes only now
        for _ in range(len(train)):
            next(train_it)
        val_it = iter(val)
        for _ in range(len(val)):
            next(val_it)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
