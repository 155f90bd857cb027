"""Slow but fine: every batch takes 0.3 s to load. No stall: the default stall timeout adapts.

The adaptive timeout is the larger of 60 s and ten times the slowest recent batch
interval, so a steady slow pipeline never counts as a hang.

    python examples/healthy_slow.py [--report-dir DIR]
"""

import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports


class SlowSamples(Dataset):
    def __len__(self):
        return 40

    def __getitem__(self, i):
        time.sleep(0.3 / 4)  # 4 samples a batch: 0.3 s per batch per worker
        return torch.randn(8), i


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(SlowSamples(), batch_size=4, num_workers=1)
    t0 = time.monotonic()
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
        for _ in batches:
            time.sleep(0.05)  # the "training step"
    print(f"10 batches in {time.monotonic() - t0:.1f} s")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
