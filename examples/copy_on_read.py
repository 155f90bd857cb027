"""Copy-on-read: forked workers touching a list of millions of Python floats copy it page by page.

The dataset holds 6 million Python floats in a list, built before the workers fork.
Each sample sums a slice of them, which writes every touched object's reference count
and turns the parent's shared pages into private copies: each worker's USS climbs
while its RSS stays flat. The script runs in a memory cgroup (1.5 GiB) so that the
projected time to the limit is short; dlwatch writes a `threshold` incident with
playbook worker-memory-growth (copy_on_read: true) before the OOM killer acts, and the
script stops there.

A cgroup needs root or a delegated subtree; where none can be made, the script says
why and exits 0.

    python examples/copy_on_read.py [--report-dir DIR]
"""

import threading
import time

from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports, rerun_in_memory_cgroup

N = 6_000_000
SLICE = 5_000
LIMIT = 1536 << 20


class FloatList(Dataset):
    def __init__(self):
        self.values = [float(i) for i in range(N)]  # 6M objects: the copy-on-read trap

    def __len__(self):
        return N // SLICE

    def __getitem__(self, i):
        time.sleep(0.02)  # a decode: the copy spreads over the epoch (~15 s), as in a real one
        return sum(self.values[i * SLICE : (i + 1) * SLICE])


def main():
    args = parse_args(__doc__.splitlines()[0])
    rerun_in_memory_cgroup(LIMIT)
    before = incidents(args.report_dir)
    loader = DataLoader(FloatList(), batch_size=4, num_workers=2, shuffle=True, persistent_workers=True)
    done = threading.Event()
    deadline = time.monotonic() + 45
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.5) as batches:
        while not done.is_set() and time.monotonic() < deadline:
            for _ in batches:
                if incidents(args.report_dir) - before or time.monotonic() > deadline:
                    done.set()  # dlwatch saw it coming: stop before the OOM killer acts
                    break
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
