"""An ordinary training script that knows nothing of dlwatch (for `dlwatch run`).

usage: plain_train.py MODE [ARGS...]
  ok        two epochs of a train loader (2 workers) and a validation loader inside; prints argv and __name__
  deadlock  workers block on a lock held in the main process at fork; prints READY first
  exit3     trains one epoch, then sys.exit(3)
  raise     the loop body raises ValueError after two batches
  loader-raise  the dataset raises in a worker
"""

import sys
import threading
import time
import traceback

import torch
from torch.utils.data import DataLoader, Dataset

LOCK = threading.Lock()


class Squares(Dataset):
    def __init__(self, n=16, locked=False, fail_at=None):
        self.n, self.locked, self.fail_at = n, locked, fail_at

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if self.fail_at is not None and i == self.fail_at:
            raise KeyError(f"sample {i} is missing")
        if self.locked:
            with LOCK:
                pass
        return torch.tensor([float(i)]), torch.tensor(i * i)


def hold_lock():
    with LOCK:
        time.sleep(3600)


def main():
    mode = sys.argv[1]
    print(f"ARGV {sys.argv!r} NAME {__name__}", flush=True)
    if mode == "deadlock":
        threading.Thread(target=hold_lock, daemon=True).start()
        while not LOCK.locked():
            time.sleep(0.01)
        loader = DataLoader(Squares(locked=True), batch_size=4, num_workers=2)
        it = iter(loader)
        print("READY", flush=True)
        next(it)
        return
    if mode == "loader-catch":  # the program catches the loader's exception and prints its traceback
        loader = DataLoader(Squares(fail_at=5), batch_size=4, num_workers=1)
        try:
            for _ in loader:
                pass
        except KeyError:
            print("CAUGHT", traceback.format_exc(), flush=True)
        return
    fail_at = 5 if mode == "loader-raise" else None
    # one worker when it fails: batches then arrive in order, so torch raises from the same line every run
    train = DataLoader(Squares(fail_at=fail_at), batch_size=4, num_workers=1 if fail_at is not None else 2)
    val = DataLoader(Squares(8), batch_size=4, num_workers=1)
    total = 0
    rank = __import__("os").environ.get("RANK", "-")
    for epoch in range(2):
        it = iter(train)
        print(f"ITER rank {rank} train {type(it).__name__}", flush=True)  # what the program's iterator is
        for step, (x, y) in enumerate(it):
            total += int(y.sum())
            if mode == "raise" and step == 2:
                raise ValueError("bad batch in the loop body")
        it = iter(val)
        print(f"ITER rank {rank} val {type(it).__name__}", flush=True)
        for x, y in it:
            total += int(y.sum())
        if mode == "exit3":
            print(f"TOTAL {total}", flush=True)
            sys.exit(3)
    print(f"TOTAL {total}", flush=True)
    print("to stderr", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
