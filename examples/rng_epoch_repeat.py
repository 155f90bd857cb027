"""A worker_init_fn that seeds from the worker id alone: the same augmentations every epoch.

torch seeds the global `random`, `numpy` and `torch` generators anew in each worker and
each epoch. Here `worker_init_fn` re-seeds `random` with the worker id, a habit copied
from many training scripts: the two workers draw different jitters, but without
`persistent_workers` new workers start every epoch, from the same seed, so every epoch
draws exactly the jitters of the first. The loop finishes normally; dlwatch sees the
workers of the second epoch start a stream they draw from in the very state of the
first epoch's, and writes a `threshold` incident with playbook rng-duplication.

    python examples/rng_epoch_repeat.py [--report-dir DIR]
"""

import random

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports


class Jittered(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return torch.tensor([i, random.randrange(100)])  # a "random" jitter per sample


def seed_worker(worker_id):
    random.seed(worker_id)  # BUG: the same seed for this worker every epoch


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(Jittered(), batch_size=4, num_workers=2, worker_init_fn=seed_worker)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
        for epoch in range(2):
            jitters = [batch[:, 1].tolist() for batch in batches]
            print(f"epoch {epoch}: jitters per batch {jitters}")  # the same list both epochs
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
