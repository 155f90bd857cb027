"""A loader with no workers fed by a decoder thread of the training process (a DALI-style pipeline).

    python producer_thread.py dies|alive|side REPORT_DIR

``dies``: the decoder raises after ten items; the loop then waits in ``queue.get()`` forever.
``alive``: the decoder waits forever on an event nobody sets (alive, no exception): a stall with
nothing dead to name.  ``side``: an unrelated thread dies with an exception while the decoder keeps
the loop fed; 40 batches, no stall.  Prints ``READY`` once the loop has its first batch.
"""

import queue
import sys
import threading

import torch
from torch.utils.data import DataLoader, IterableDataset

import dlwatch


class Decoded(IterableDataset):
    def __init__(self, mode):
        self.mode = mode
        self.q = queue.Queue(maxsize=4)
        self.never = threading.Event()
        threading.Thread(target=self.decode, name="decoder", daemon=True).start()

    def decode(self):
        for i in range(10 if self.mode != "side" else 80):
            self.q.put(torch.tensor([i]))
        if self.mode == "dies":
            raise RuntimeError("corrupt JPEG in shard 7")
        if self.mode == "alive":
            self.never.wait()

    def __iter__(self):
        n = 80 if self.mode == "side" else None
        while n is None or n > 0:
            yield self.q.get()
            n = None if n is None else n - 1


def side_job():
    raise ValueError("metrics upload failed")


def main():
    mode, report_dir = sys.argv[1], sys.argv[2]
    loader = DataLoader(Decoded(mode), batch_size=2, num_workers=0)
    with dlwatch.watch(loader, report_dir=report_dir, stall_timeout=3, poll_interval=0.5) as w:
        for i, _ in enumerate(w):
            if i == 0:
                print("READY", flush=True)
            if mode == "side" and i == 5:
                t = threading.Thread(target=side_job, name="uploader")
                t.start()
                t.join()
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
