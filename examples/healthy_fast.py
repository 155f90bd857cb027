"""A healthy loader: two workers, default collate, a quick epoch. dlwatch must stay silent.

python examples/healthy_fast.py [--report-dir DIR]
"""

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports


class Samples(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        return torch.randn(3, 16, 16), i % 10


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(Samples(), batch_size=16, num_workers=2)  # last batch: 1000 % 16 = 8 samples
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
        for epoch in range(2):
            n = sum(1 for _ in batches)
    print(f"2 epochs of {n} batches")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
