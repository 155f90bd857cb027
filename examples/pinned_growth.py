"""Pinned (locked) host memory that piles up: a training loop keeps a locked staging buffer per step.

Pinned memory is locked memory (`mlock`): never swapped, never reclaimed. This loop
allocates a 2 MiB locked buffer every batch and keeps them all (what a list of
`pin_memory=True` batches kept across steps does on a GPU host; on this CPU-only
machine torch ignores pin_memory, so the script locks real memory with mlock). It runs
in a memory cgroup limited to 1.5 GiB (locked pages count there too); dlwatch writes a
`threshold` incident with playbook pinned-memory-growth when Mlocked climbs steadily
toward that limit, and the script stops before the OOM killer acts.

Locking more than RLIMIT_MEMLOCK needs CAP_IPC_LOCK (or a raised limit), and a cgroup
needs root or a delegated subtree; where either is missing, the script says why and exits 0.

    python examples/pinned_growth.py [--report-dir DIR]
"""

import ctypes
import mmap
import resource
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports, rerun_in_memory_cgroup, skip

LIMIT = 1536 << 20
LOCK_MAX = 768 << 20
STEP = 2 << 20


class Samples(Dataset):
    def __len__(self):
        return 4000

    def __getitem__(self, i):
        time.sleep(0.02)
        return torch.zeros(16)


def locked_buffer(libc, size):
    buf = mmap.mmap(-1, size)
    buf.write(b"\x01" * size)  # touch every page
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if libc.mlock(ctypes.c_void_p(addr), ctypes.c_size_t(size)) != 0:
        return None
    return buf


def main():
    args = parse_args(__doc__.splitlines()[0])
    rerun_in_memory_cgroup(LIMIT)
    try:
        resource.setrlimit(resource.RLIMIT_MEMLOCK, (LOCK_MAX, LOCK_MAX))
    except (ValueError, OSError):
        pass  # CAP_IPC_LOCK ignores the limit anyway
    libc = ctypes.CDLL(None, use_errno=True)
    probe = locked_buffer(libc, 16 << 20)
    if probe is None:
        skip("cannot lock 16 MiB here (RLIMIT_MEMLOCK too low and no CAP_IPC_LOCK)")
    probe.close()
    before = incidents(args.report_dir)
    loader = DataLoader(Samples(), batch_size=2, num_workers=1)
    kept = []
    deadline = time.monotonic() + 40
    with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
        for _ in batches:
            buf = locked_buffer(libc, STEP) if len(kept) * STEP < LOCK_MAX else None
            if buf is not None:
                kept.append(buf)  # the "pinned batch" kept across steps
            if incidents(args.report_dir) - before or time.monotonic() > deadline:
                break
    print(f"locked {len(kept) * STEP >> 20} MiB")
    for buf in kept:
        buf.close()  # munmap drops the lock
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
