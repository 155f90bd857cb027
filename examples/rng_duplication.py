"""An RNG created in Dataset.__init__: every forked worker gets a copy in the same state.

torch seeds the global `random`, `numpy` and `torch` generators differently in
each worker, but not generator objects the dataset holds. Here both workers draw
the same "random" augmentation parameters, and every epoch repeats the last one
(the workers' copies advance, the original in the main process never does).
The loop finishes normally; dlwatch
fingerprints each worker's generators at its start and after its first batch, sees
streams the workers draw from end alike in both, and writes a `threshold` incident
with playbook rng-duplication.

    python examples/rng_duplication.py [--report-dir DIR]
"""

import random

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports


try:
    import numpy as np
except ImportError:  # torch runs without numpy; the bug is the same with random.Random alone
    np = None


class Augmented(Dataset):
    def __init__(self):
        # BUG: one state, copied into every worker
        self.rng = np.random.default_rng(0) if np is not None else random.Random(1)
        self.py_rng = random.Random(0)  # same problem with random.Random

    def __len__(self):
        return 16

    def __getitem__(self, i):
        # a "random" crop offset
        shift = self.rng.integers(0, 100) if np is not None else self.rng.randrange(100)
        flip = self.py_rng.random() < 0.5
        return torch.tensor([i, int(shift), int(flip)])


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(Augmented(), batch_size=4, num_workers=2)
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
        for epoch in range(2):
            shifts = [batch[:, 1].tolist() for batch in batches]
            # batches 0 and 1 come from workers 0 and 1: the same "random" shifts in both
            print(f"epoch {epoch}: shifts per batch {shifts}")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
