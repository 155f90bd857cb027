"""Too many workers: 8 CPU-bound workers on a 2-CPU budget (the script pins itself to 2 CPUs).

Each worker gets about a quarter of a core; they spend their time runnable, waiting
for a CPU. torch itself warns ("This DataLoader will create 8 worker processes"), so
dlwatch's preflight finding (`too-many-workers`, from the affinity and the cgroup CPU quota,
not os.cpu_count()) goes to the run summary without a second warning; dlwatch warns only
where torch cannot see the limit (a cgroup CPU quota). The run summary says
`too-many-workers` with each worker's CPU share. No incident.

    python examples/too_many_workers.py [--report-dir DIR]
"""

import os
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports, print_summary
from input_bound import cpu_work


class Augmented(Dataset):
    def __len__(self):
        return 4 * 240  # ~5 s of loop on 2 quiet cores: the advisor needs 3 s observed per worker

    def __getitem__(self, i):
        cpu_work(0.04 / 4)  # 40 ms of CPU a batch
        return torch.randn(3, 32, 32), i % 10


def main():
    args = parse_args(__doc__.splitlines()[0])
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # as a cluster's cpuset would
    before = incidents(args.report_dir)
    loader = DataLoader(Augmented(), batch_size=4, num_workers=8)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as watched:
        for images, labels in watched:
            time.sleep(0.002)
    print_summary(watched)
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
