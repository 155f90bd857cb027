"""A worker crashes in native code called from __getitem__ (SIGSEGV); the report shows the dataset line.

torch only says `DataLoader worker (pid(s) N) exited unexpectedly` (or "killed by
signal: Segmentation fault"). dlwatch's worker hook enabled faulthandler in every
worker, so the worker wrote its Python stack before it died; the `exception` incident
names playbook worker-killed, cause native-crash, and the frame in `__getitem__`.

    python examples/worker_segfault.py [--report-dir DIR]
"""

import ctypes

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports


class NativeDecoder(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if i == 21:
            ctypes.string_at(0)  # a native decoder reading a NULL pointer: SIGSEGV
        return torch.full((4,), float(i))


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    loader = DataLoader(NativeDecoder(), batch_size=4, num_workers=2)
    try:
        with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
            for _ in batches:
                pass
    except Exception as exc:  # RuntimeError from torch, or a ConnectionResetError when the crash cut a transfer
        print(f"training loop failed: {type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[-1]}")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
