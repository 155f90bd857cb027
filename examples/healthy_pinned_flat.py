"""Healthy: a fixed pinned (locked) staging buffer, allocated once and reused: locked memory stays flat.

The training process locks one 64 MiB buffer before the loop (what a reused
`torch.empty(..., pin_memory=True)` staging buffer is on a GPU host) and copies each
batch through it for 15 s. Mlocked and VmLck do not move: no pinned-memory-growth.
(Where 64 MiB cannot be locked, it locks what RLIMIT_MEMLOCK allows.)

    python examples/healthy_pinned_flat.py [--report-dir DIR]
"""

import ctypes
import mmap
import resource
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports

SIZE = 64 << 20


class Samples(Dataset):
    def __len__(self):
        return 100_000

    def __getitem__(self, i):
        time.sleep(0.01)
        return torch.full((1024,), float(i))


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    libc = ctypes.CDLL(None, use_errno=True)
    buf = mmap.mmap(-1, SIZE)
    buf.write(b"\x00" * SIZE)
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(SIZE)) != 0 and soft > 0:
        libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(min(SIZE, soft // 2)))
    staging = torch.frombuffer(buf, dtype=torch.float32)
    loader = DataLoader(Samples(), batch_size=4, num_workers=1)
    deadline = time.monotonic() + 15
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.5) as batches:
        for batch in batches:
            staging[: batch.numel()].copy_(batch.flatten())  # the reused pinned buffer
            if time.monotonic() > deadline:
                break
    del staging
    buf.close()
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
