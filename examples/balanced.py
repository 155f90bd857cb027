"""A balanced run: loading keeps up with the step, persistent workers, default prefetch. No advice.

Two workers (~20 ms of CPU a batch each) feed a 30 ms step (a GPU-bound model stands
in as a sleep) for three epochs; set_epoch on the sampler is not relevant here (a
plain shuffle). dlwatch's run summary has the figures and no advice.

    python examples/balanced.py [--report-dir DIR]
"""

import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports, print_summary
from input_bound import cpu_work


class Samples(Dataset):
    def __len__(self):
        return 8 * 60

    def __getitem__(self, i):
        cpu_work(0.02 / 8)
        return torch.randn(3, 32, 32), i % 10


def main():
    args = parse_args(__doc__.splitlines()[0])
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
    before = incidents(args.report_dir)
    loader = DataLoader(Samples(), batch_size=8, shuffle=True, num_workers=2, persistent_workers=True)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as watched:
        for epoch in range(3):
            for images, labels in watched:
                time.sleep(0.03)  # the training step
    print_summary(watched)
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
