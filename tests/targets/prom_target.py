"""A watched DataLoader loop that runs until STOP_FILE exists (or 60 s), for test_prom.py.

    python prom_target.py REPORT_DIR STOP_FILE

Prints READY once the first batches are through. The Prometheus options come from the
environment (DLWATCH_PROM_FILE, DLWATCH_PROM_PORT), as a user would set them.
"""

import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch


class Samples(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        time.sleep(0.002)
        return torch.full((4,), float(i))


def main():
    report_dir, stop_file = sys.argv[1], sys.argv[2]
    loader = DataLoader(Samples(), batch_size=4, num_workers=2)
    deadline = time.monotonic() + 60
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2) as batches:
        for n, _ in enumerate(batches):
            if n == 5:
                print("READY", flush=True)
            time.sleep(0.01)
            if os.path.exists(stop_file) or time.monotonic() > deadline:
                break
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
