"""A worker killed from outside with SIGKILL, far from any memory limit: not called an OOM kill.

A scheduler, a watchdog or a person (`kill -9`, `pkill`) ends one DataLoader worker.
torch raises `DataLoader worker (pid(s) N) exited unexpectedly` (or, when its SIGCHLD
handler sees the death first, `DataLoader worker (pid N) is killed by signal: Killed.`);
dlwatch's `exception` incident names playbook worker-killed with cause external-kill:
the exit code says SIGKILL, memory was far from its limit and no OOM kill was counted.

    python examples/worker_killed.py [--report-dir DIR]
"""

import os
import signal
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports


class Slow(Dataset):
    def __len__(self):
        return 4000

    def __getitem__(self, i):
        time.sleep(0.005)
        return torch.full((4,), float(i))


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(Slow(), batch_size=4, num_workers=2)
    try:
        with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2):
            it = iter(loader)
            for i, _ in enumerate(it):
                if i == 100:  # the "outside" kill: what `kill -9 <worker pid>` does
                    os.kill(it._workers[0].pid, signal.SIGKILL)
    except Exception as exc:  # RuntimeError from torch, or a ConnectionResetError when the crash cut a transfer
        print(f"training loop failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
