"""A training loop the user stops with Ctrl-C.  usage: interrupt.py MODE WHERE

MODE: bare, plain (watch, iterate the loader), as (watch, iterate the watched object); under
`dlwatch run` use bare.  WHERE: body (the interrupt lands in the loop body's sleep), next (in the
wait for a batch whose sample takes long) or deadlock (in the wait for a batch that never comes: the
samples take a lock that a thread of the main process held when the workers forked).  Prints READY when the test should press Ctrl-C; the
KeyboardInterrupt is not caught: it ends the program as Python ends it.
"""

import contextlib
import sys
import threading
import time

from torch.utils.data import DataLoader, Dataset


LOCK = threading.Lock()


class SlowAfter(Dataset):
    def __init__(self, locked: bool = False) -> None:
        self.locked = locked

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> int:
        if i >= 12 and self.locked:
            with LOCK:  # held by "cache-refresher" at fork: never free in the worker
                return i
        if i >= 12:
            time.sleep(30)  # the loop waits here for a batch when WHERE is next
        return i


def refresh_cache() -> None:
    with LOCK:
        time.sleep(3600)


if __name__ == "__main__":
    mode, where = sys.argv[1], sys.argv[2]
    if where == "deadlock":
        threading.Thread(target=refresh_cache, name="cache-refresher", daemon=True).start()
        while not LOCK.locked():
            time.sleep(0.01)
    dl = DataLoader(SlowAfter(locked=where == "deadlock"), batch_size=4, num_workers=2)
    if mode == "bare":
        ctx = contextlib.nullcontext(dl)
    else:
        import dlwatch

        ctx = dlwatch.watch(dl, poll_interval=0.2)
    with ctx as watched:
        it = watched if mode == "as" else dl
        for n, batch in enumerate(it):
            print(f"batch {n} {batch.tolist()}", flush=True)
            if where == "body" and n == 1:
                print("READY", flush=True)
                time.sleep(30)
            if where in ("next", "deadlock") and n == 2:
                print("READY", flush=True)
