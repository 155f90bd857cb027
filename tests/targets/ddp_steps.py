"""A two-rank DDP-like loop for test_ddp.py, run under torchrun (gloo, CPU): both ranks healthy.

    torchrun --nproc_per_node 2 ddp_steps.py REPORT_DIR SLOW_RANK_FACTOR

Each step: a batch from the rank's own DataLoader, then all_reduce (so the ranks run in
lock-step, as DDP does). The dataset of rank 1 is SLOW_RANK_FACTOR times slower per sample
(1 = both alike). Prints DONE <rank> <batches> at the end.
"""

import datetime
import sys
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import dlwatch

SAMPLE_S = 0.01
BATCHES = 120


class Samples(Dataset):
    def __init__(self, per_sample_s):
        self.per_sample_s = per_sample_s

    def __len__(self):
        return BATCHES * 4

    def __getitem__(self, i):
        time.sleep(self.per_sample_s)  # I/O-like: a read that takes time without CPU
        return torch.full((4,), float(i))


def main():
    report_dir, factor = sys.argv[1], float(sys.argv[2])
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    per_sample = SAMPLE_S * (factor if rank == 1 else 1.0)
    loader = DataLoader(Samples(per_sample), batch_size=4, num_workers=2)
    n = 0
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2) as batches:
        for batch in batches:
            total = batch.sum()
            dist.all_reduce(total)
            time.sleep(0.005)  # the "training step"
            n += 1
    dist.barrier()
    print(f"DONE {rank} {n}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
