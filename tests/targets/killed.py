"""A slow training loop under watch that prints READY; the test SIGKILLs it."""

import sys

from torch.utils.data import DataLoader

import dlwatch
from datasets import Squares

if __name__ == "__main__":
    dl = DataLoader(Squares(10_000, sleep_s=0.01), batch_size=4, num_workers=2)
    with dlwatch.watch(dl, report_dir=sys.argv[1], poll_interval=0.1) as batches:
        for i, _ in enumerate(batches):
            if i == 5:
                w = batches
                print(f"READY {w.monitor_pid}", flush=True)
