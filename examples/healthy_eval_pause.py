"""Healthy: an evaluation and a checkpoint in the middle of an epoch. dlwatch must stay silent.

Every few steps the loop evaluates on a validation loader (watched in its own,
nested block), then saves a checkpoint (fsync'd) and waits on a "slow upload" — about
7 s spent in the loop body while the train iterator waits, with a tight
`stall_timeout=2` for the data. `stall_timeout` is the allowance for *waiting for
data*; the loop body has its own (`body_timeout`, by default 30 minutes while the
job is busy), and the nested validation loop's progress is the outer loop's progress.

    python examples/healthy_eval_pause.py [--report-dir DIR]
"""

import os
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports


class Samples(Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.randn(3, 16, 16), i % 10


def evaluate(model, val_loader, report_dir):
    correct = 0
    with dlwatch.watch(val_loader, report_dir=report_dir, poll_interval=0.2) as batches:
        for x, y in batches:
            t = time.monotonic()
            while time.monotonic() - t < 0.15:  # a forward pass
                correct += int((model(x.flatten(1)).argmax(1) == y).sum())
    return correct


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    train = DataLoader(Samples(256), batch_size=16, num_workers=2)
    val = DataLoader(Samples(96), batch_size=4, num_workers=1)
    model = torch.nn.Linear(3 * 16 * 16, 10)
    with (
        tempfile.TemporaryDirectory() as ckpt_dir,
        dlwatch.watch(train, report_dir=args.report_dir, poll_interval=0.2, stall_timeout=2) as batches,
    ):
        for step, (x, y) in enumerate(batches):
            model(x.flatten(1)).sum().backward()
            if step == 6:  # mid-epoch: evaluate (~4 s, nested watch), checkpoint, upload (~3 s)
                t0 = time.monotonic()
                evaluate(model, val, args.report_dir)
                path = os.path.join(ckpt_dir, "ckpt.pt")
                torch.save({"model": model.state_dict(), "step": step}, path)
                with open(path, "rb+") as f:
                    os.fsync(f.fileno())
                time.sleep(3.0)  # waiting for a slow upload
                print(f"evaluation + checkpoint took {time.monotonic() - t0:.1f} s")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
