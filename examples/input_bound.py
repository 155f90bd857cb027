"""Input-bound: each batch costs its worker ~60 ms of CPU (decode + augment), the step 10 ms.

One worker on a 2-CPU budget (the script pins itself to at most 2 CPUs, as a cluster's
cpuset would): the training loop waits for data most of its time, and the worker runs
flat out. dlwatch's run summary says `input-bound` (cause: the worker is saturated on
CPU), with the data-wait share and the worker's CPU figures. No incident.

    python examples/input_bound.py [--report-dir DIR]
"""

import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports, print_summary


def cpu_work(seconds):
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:  # CPU time, not wall time: a busy machine cannot make it sleep
        x += 1
    return x


class Decoded(Dataset):
    """Stands in for JPEG decoding plus random augmentation: CPU-bound per sample."""

    def __len__(self):
        return 8 * 120

    def __getitem__(self, i):
        cpu_work(0.06 / 8)  # 8 samples a batch: ~60 ms of CPU per batch
        return torch.randn(3, 32, 32), i % 10


def main():
    args = parse_args(__doc__.splitlines()[0])
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])
    before = incidents(args.report_dir)
    loader = DataLoader(Decoded(), batch_size=8, num_workers=1)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as watched:
        for images, labels in watched:
            time.sleep(0.01)  # the training step: far shorter than a batch's loading
    print_summary(watched)
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
