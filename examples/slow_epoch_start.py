"""Slow epoch start: each worker loads a 1.5 s index when it starts, and workers restart every epoch.

`persistent_workers=False` (the default): every epoch forks new workers, and each one
opens its shard index again (`worker_init_fn`) before its first batch. Steady batches
take ~15 ms. dlwatch's run summary says `slow-epoch-start`, with the first-batch wait
of each epoch and what persistent workers would save. No incident.

    python examples/slow_epoch_start.py [--report-dir DIR]
"""

import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports, print_summary


class Sharded(Dataset):
    def __len__(self):
        return 16 * 20

    def __getitem__(self, i):
        return torch.randn(3, 32, 32), i % 10


def open_index(worker_id):
    time.sleep(1.5)  # stands in for loading a shard index / opening a database in each worker


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(Sharded(), batch_size=16, num_workers=2, worker_init_fn=open_index)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as watched:
        for epoch in range(3):
            for images, labels in watched:
                time.sleep(0.015)  # the training step
    print_summary(watched)
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
