"""A bucketing batch sampler whose __len__ counts every bucket, though it drops the incomplete ones.

The program sizes its progress bar from len(loader) (as a LR schedule or Lightning would); the
sampler's __len__ says 16 batches, its __iter__ yields 12 (each bucket's short last batch is dropped).
No error: the epoch simply ends early. dlwatch writes a `threshold` incident, playbook
sampler-exhausted-early, naming the epoch, the batches it gave and the length asked.

    python examples/sampler_exhausted_early.py [--report-dir DIR]
"""

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

import dlwatch
from _common import incidents, parse_args, print_reports

SIZES = [3, 5, 7, 9]  # four buckets of 30 items each, by length


class Lengths(Dataset):
    def __len__(self):
        return 120

    def __getitem__(self, i):
        return torch.zeros(SIZES[i // 30])


class BucketBatchSampler(Sampler):
    """Batches of 8 items of one bucket; the incomplete batch of each bucket is dropped."""

    def __init__(self, batch_size=8):
        self.batch_size = batch_size

    def __iter__(self):
        for b in range(len(SIZES)):
            items = list(range(b * 30, (b + 1) * 30))
            for i in range(0, len(items) - self.batch_size + 1, self.batch_size):
                yield items[i : i + self.batch_size]

    def __len__(self):
        per_bucket = -(-30 // self.batch_size)  # BUG: counts each bucket's short batch too (4, not 3)
        return per_bucket * len(SIZES)


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(Lengths(), batch_sampler=BucketBatchSampler(), num_workers=2)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
        total = len(batches)  # what a progress bar asks
        seen = sum(1 for _ in batches)
    print(f"asked {total} batches, got {seen}")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
