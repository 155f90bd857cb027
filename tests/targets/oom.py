"""Under watch, the loop body hoards memory until the cgroup's OOM killer takes the process."""

import sys

from torch.utils.data import DataLoader

import dlwatch
from datasets import Squares

if __name__ == "__main__":
    dl = DataLoader(Squares(100_000), batch_size=4, num_workers=1)
    hoard = []
    with dlwatch.watch(dl, report_dir=sys.argv[1], poll_interval=0.1):
        for i, _ in enumerate(dl):
            if i == 3:
                print("READY", flush=True)
            if i > 10:
                hoard.append(b"\x01" * (16 << 20))  # 16 MiB a batch, every page touched
