"""pin_memory=True on a machine without CUDA: a preflight warning and advice, nothing else.

python examples/pin_memory_cpu.py [--report-dir DIR]
"""

import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports, print_summary


class Samples(Dataset):
    def __len__(self):
        return 16 * 30

    def __getitem__(self, i):
        return torch.randn(3, 32, 32), i % 10


def main():
    args = parse_args(__doc__.splitlines()[0])
    if torch.cuda.is_available():
        print("SKIP: this machine has a CUDA device; the example needs one without")
        return
    before = incidents(args.report_dir)
    loader = DataLoader(Samples(), batch_size=16, num_workers=2, pin_memory=True)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as watched:
        for images, labels in watched:
            time.sleep(0.01)
    print_summary(watched)
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
