"""DistributedSampler without set_epoch: three epochs, the same order each time.

A real process group of one (gloo, world_size 1, a file:// store in a temporary
directory) and a shuffling DistributedSampler; the loop never calls
`sampler.set_epoch(epoch)`. The script checks the orders itself; dlwatch's run summary
says `sampler-epoch-not-set`. No incident.

    python examples/sampler_no_set_epoch.py [--report-dir DIR]
"""

import os
import tempfile
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

import dlwatch
from _common import incidents, parse_args, print_reports, print_summary


class Indexed(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((4,), float(i)), i


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            sampler = DistributedSampler(Indexed(), shuffle=True, seed=0)
            loader = DataLoader(Indexed(), batch_size=8, sampler=sampler, num_workers=2)
            orders = []
            with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as watched:
                for epoch in range(3):
                    # BUG: sampler.set_epoch(epoch) is missing
                    order = []
                    for x, idx in watched:
                        order.extend(idx.tolist())
                        time.sleep(0.01)
                    orders.append(order)
        finally:
            dist.destroy_process_group()
    print(f"the same order every epoch: {all(o == orders[0] for o in orders)}")
    print_summary(watched)
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
