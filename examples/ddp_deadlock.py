"""Two ranks (torchrun, gloo, CPU): rank 1's DataLoader workers deadlock, rank 0 then blocks in all_reduce.

Rank 1's dataset holds a lock (taken by a background thread) at the moment its
workers fork: every worker waits on it forever (as in deadlock.py). Rank 0's data
is fine: it gets its first batch and calls `all_reduce`, which waits for rank 1
forever (gloo's timeout is minutes). Each rank's dlwatch writes its own incident:
rank 1 `deadlock` -> worker-deadlock; rank 0 `main-blocked`, waiting in the
collective all_reduce, with no DataLoader finding of its own. Then

    dlwatch report --job DIR

names rank 1 as the rank that stalled first, and rank 0 as waiting for it.

Run plainly, this script plays the job scheduler: it starts
`python -m torch.distributed.run --standalone --nproc_per_node 2` on itself, and
once both ranks have written their incident (or after 60 s) kills torchrun, the
ranks, their workers and monitors. Run under torchrun yourself, it is one rank
(and ends when gloo's 120 s timeout fails rank 0 and torchrun stops the job).

    python examples/ddp_deadlock.py [--report-dir DIR]
    torchrun --nproc_per_node 2 examples/ddp_deadlock.py [--report-dir DIR]
"""

import datetime
import threading

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, print_reports, rank_or_supervise, run_torchrun

GIVE_UP_S = 60.0
GLOO_TIMEOUT_S = 120


class Samples(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((4,), float(i))


class CachedSamples(Samples):
    """A cache guarded by a lock that a background thread holds while the workers fork."""

    def __init__(self):
        self.lock = threading.Lock()
        self.cache = {}

    def __getitem__(self, i):
        with self.lock:  # in a worker: a copy taken while locked, never released
            return self.cache.setdefault(i, torch.full((4,), float(i)))

    def refresh_in_background(self, started, release):
        with self.lock:
            started.set()
            release.wait()
            self.cache.clear()


def train(report_dir):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=GLOO_TIMEOUT_S))
    rank = dist.get_rank()
    if rank == 1:
        dataset = CachedSamples()
        started, release = threading.Event(), threading.Event()
        threading.Thread(target=dataset.refresh_in_background, args=(started, release), daemon=True).start()
        started.wait()
    else:
        dataset = Samples()
    loader = DataLoader(dataset, batch_size=4, num_workers=2, multiprocessing_context="fork")
    # stall_timeout/body_timeout of 3 s: the demo should not take minutes (the defaults are
    # 300 s for a first batch and 5 min for a loop body blocked in a collective)
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2, stall_timeout=3, body_timeout=3) as batches:
        for batch in batches:
            total = batch.sum()
            dist.all_reduce(total)  # rank 0 waits here for rank 1, which never gets a batch
    dist.destroy_process_group()


def supervise(report_dir):
    before = incidents(report_dir)
    job_id = run_torchrun(__file__, report_dir, until_incidents=2, give_up_s=GIVE_UP_S)
    print(f"JOB {job_id}", flush=True)
    if print_reports(report_dir, before):
        print(f"the whole job: dlwatch report --job {report_dir}", flush=True)


def main():
    rank_or_supervise(__doc__.splitlines()[0], train, supervise)


if __name__ == "__main__":
    main()
