"""Two epochs of a loader whose workers are not persistent; the second epoch's workers block for good.

    python epoch_hang.py REPORT_DIR

Prints ``READY`` when the second epoch begins; a stall incident follows after 3 s.
"""

import sys
import threading

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch

EPOCH = [0]
NEVER = threading.Event()


class Items(Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        if EPOCH[0] == 1:
            NEVER.wait()  # the second epoch's workers (forked with EPOCH[0] == 1) wait for good
        return torch.tensor([i])


def main():
    loader = DataLoader(Items(), batch_size=2, num_workers=2)
    with dlwatch.watch(loader, report_dir=sys.argv[1], stall_timeout=3, poll_interval=0.5) as w:
        for epoch in range(2):
            EPOCH[0] = epoch
            if epoch == 1:
                print("READY", flush=True)
            for _ in w:
                pass


if __name__ == "__main__":
    main()
