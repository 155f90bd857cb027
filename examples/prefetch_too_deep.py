"""Prefetch too deep: prefetch_factor=8 with 9.4 MiB batches, and a step slower than loading.

The step (80 ms, a GPU-bound model stands in as a sleep) is slower than a batch's
loading (~10 ms per worker), so the two workers finish their 8 batches each and idle
behind the full queue: 150 MiB of batches in shared memory that the loop never needed.
dlwatch's run summary says `prefetch-too-deep`, with the bytes in flight and what
prefetch_factor=2 saves. No incident.

    python examples/prefetch_too_deep.py [--report-dir DIR]
"""

import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports, print_summary


class Images(Dataset):
    def __len__(self):
        return 16 * 70

    def __getitem__(self, i):
        return torch.rand(3, 224, 224), i % 10  # 588 KiB a sample, 9.2 MiB a batch of 16


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(Images(), batch_size=16, num_workers=2, prefetch_factor=8)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as watched:
        for images, labels in watched:
            time.sleep(0.08)  # the training step
    print_summary(watched)
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
