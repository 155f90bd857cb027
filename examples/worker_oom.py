"""A worker killed by the OOM killer: its per-worker cache outgrows the cgroup's memory limit.

The dataset caches every decoded sample (16 MiB each) in the worker, without a bound.
The script runs in a memory cgroup limited to 1 GiB; the kernel's OOM killer ends
the worker, torch raises `DataLoader worker (pid N) is killed by signal: Killed` (or
"exited unexpectedly"), and dlwatch's `exception` incident names playbook
worker-killed with cause oom-kill: the cgroup's OOM-kill counter rose as the worker died.
(A `threshold` incident for worker-memory-growth may come first: the growth was seen.)

A cgroup needs root or a delegated subtree; where none can be made, the script says
why and exits 0.

    python examples/worker_oom.py [--report-dir DIR]
"""

import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports, rerun_in_memory_cgroup

LIMIT = 1 << 30


class CachingDecoder(Dataset):
    def __init__(self):
        self.cache = {}

    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        time.sleep(0.05)
        if i not in self.cache:
            self.cache[i] = bytearray(16 << 20)  # every page written: really resident
            self.cache[i][::4096] = b"\x01" * len(range(0, 16 << 20, 4096))
        return torch.tensor(float(i))


def main():
    args = parse_args(__doc__.splitlines()[0])
    rerun_in_memory_cgroup(LIMIT)
    before = incidents(args.report_dir)
    loader = DataLoader(CachingDecoder(), batch_size=2, num_workers=1)
    try:
        with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
            for _ in batches:
                pass
    except Exception as exc:
        print(f"training loop failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
