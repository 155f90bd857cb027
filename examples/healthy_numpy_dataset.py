"""Healthy: the dataset loads one large numpy array before the workers fork; they share it, nothing is copied.

The same 6 million floats as copy_on_read.py, held in one numpy array instead of a
list: reading slices writes no reference counts into the shared pages, so every
worker's USS stays flat. No incident (in particular no worker-memory-growth).

    python examples/healthy_numpy_dataset.py [--report-dir DIR]
"""

import time

import numpy as np
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports

N = 6_000_000
SLICE = 5_000


class FloatArray(Dataset):
    def __init__(self):
        self.values = np.arange(N, dtype=np.float64)  # one buffer: shared by forked workers

    def __len__(self):
        return N // SLICE

    def __getitem__(self, i):
        time.sleep(0.005)
        return float(self.values[i * SLICE : (i + 1) * SLICE].sum())


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(FloatArray(), batch_size=4, num_workers=2, shuffle=True, persistent_workers=True)
    deadline = time.monotonic() + 20  # longer than copy_on_read.py needs to be caught
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.5) as batches:
        while time.monotonic() < deadline:
            for _ in batches:
                if time.monotonic() > deadline:
                    break
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
