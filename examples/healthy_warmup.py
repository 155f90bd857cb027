"""Healthy: each worker's memory grows at start-up (imports, a cache warming), then stays flat.

Each worker fills a bounded cache of decoded samples during its first seconds (about
200 MiB over 4 s), then serves from it for 16 s more. Growth that stops is not
worker-memory-growth: no incident.

    python examples/healthy_warmup.py [--report-dir DIR]
"""

import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports

CACHE_ITEMS = 50  # 4 MiB each: 200 MiB per worker, then full


class WarmCache(Dataset):
    def __init__(self):
        self.cache = {}

    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        key = i % CACHE_ITEMS
        if key not in self.cache:
            time.sleep(0.08)  # "decoding": the cache fills over the first seconds
            self.cache[key] = bytearray(b"\x01" * (4 << 20))
        time.sleep(0.01)
        return torch.tensor(float(self.cache[key][0]))


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(WarmCache(), batch_size=4, num_workers=2)
    deadline = time.monotonic() + 20
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.5) as batches:
        for _ in batches:
            if time.monotonic() > deadline:
                break
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
