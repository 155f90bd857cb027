"""Two healthy ranks (torchrun, gloo, CPU) in lock-step through all_reduce; rank 1's data is 3x slower.

Nothing hangs and nothing raises: both ranks finish their 160 batches and no incident
is written. The job runs at rank 1's pace, and rank 0 spends the difference waiting in
all_reduce (its loop body). `dlwatch report --job DIR` compares the ranks' figures and
names rank 1 a `straggler-rank`: it waits for data most of its loop time, rank 0 hardly.

Run plainly, this script starts `python -m torch.distributed.run --standalone
--nproc_per_node 2` on itself and waits for it (at most 60 s).

    python examples/ddp_straggler.py [--report-dir DIR]
    torchrun --nproc_per_node 2 examples/ddp_straggler.py [--report-dir DIR]
"""

import datetime
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, print_reports, rank_or_supervise, run_torchrun

BATCHES = 160  # ~4 s: 20 polls of 2 workers, twice the reads straggler-rank needs (min_worker_reads)
SAMPLE_S = 0.004  # rank 0; rank 1 takes three times this


class Samples(Dataset):
    def __init__(self, per_sample_s):
        self.per_sample_s = per_sample_s

    def __len__(self):
        return BATCHES * 4

    def __getitem__(self, i):
        time.sleep(self.per_sample_s)  # a read from a slower disk or store
        return torch.full((4,), float(i))


def train(report_dir):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    rank = dist.get_rank()
    loader = DataLoader(Samples(SAMPLE_S * (3 if rank == 1 else 1)), batch_size=4, num_workers=2)
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2) as batches:
        for batch in batches:
            total = batch.sum()
            dist.all_reduce(total)  # lock-step, as DDP's gradient all-reduce
            time.sleep(0.005)  # the "training step"
    dist.barrier()
    dist.destroy_process_group()


def supervise(report_dir):
    before = incidents(report_dir)
    job_id = run_torchrun(__file__, report_dir, give_up_s=60.0)
    print(f"JOB {job_id}", flush=True)
    print_reports(report_dir, before)
    print(f"the whole job: dlwatch report --job {report_dir} --job-id {job_id}", flush=True)


def main():
    rank_or_supervise(__doc__.splitlines()[0], train, supervise)


if __name__ == "__main__":
    main()
