"""A healthy loader without worker processes (num_workers=0): everything runs in the main process.

python examples/healthy_workers0.py [--report-dir DIR]
"""

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports


class Samples(Dataset):
    def __len__(self):
        return 500

    def __getitem__(self, i):
        return {"x": torch.randn(4, 4), "y": torch.tensor(i % 3)}  # a dict batch is checked too


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(Samples(), batch_size=32, num_workers=0, shuffle=True)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2):
        n = sum(1 for _ in loader)  # the loader itself is watched as well
    print(f"{n} batches")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
