"""A DataLoader run next to another tenant's files in /dev/shm (run in a private mount namespace).

    python shm_tenant.py REPORT_DIR MODE

MODE:
  workers0     8 MiB batches, num_workers=0: batches never go through /dev/shm
  file_system  256 KiB batches, 2 workers, file_system strategy: 1 MiB in flight
  tight        512 KiB batches, 2 workers, prefetch_factor=16, file_system: 16 MiB in flight
Prints BATCHES n, BATCH_BYTES b (as the watch measured it) and SHM total free.
"""

import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch


class Rows(Dataset):
    def __init__(self, n: int, rows: int, sleep_s: float) -> None:
        self.n, self.rows, self.sleep_s = n, rows, sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.sleep_s)
        return torch.full((self.rows, 1024), float(i)), i  # rows x 4 KiB


def main() -> None:
    report_dir, mode = sys.argv[1], sys.argv[2]
    if mode == "workers0":
        loader = DataLoader(Rows(48, 512, 0.01), batch_size=4, num_workers=0)  # 2 MiB a sample
    elif mode == "file_system":
        torch.multiprocessing.set_sharing_strategy("file_system")
        loader = DataLoader(Rows(64, 16, 0.01), batch_size=4, num_workers=2)
    elif mode == "tight":
        torch.multiprocessing.set_sharing_strategy("file_system")
        loader = DataLoader(Rows(64, 32, 0.01), batch_size=4, num_workers=2, prefetch_factor=16)
    else:
        raise SystemExit(f"unknown mode {mode}")
    n = 0
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.1) as batches:
        for _ in range(2):
            for _batch in batches:
                n += 1
        time.sleep(0.5)  # a few more polls with the need known
        with open(batches._session.events_path) as f:
            sizes = [e["batch_bytes"] for e in map(json.loads, f) if e.get("event") == "batch_bytes"]
    st = os.statvfs("/dev/shm")
    print(f"BATCHES {n}")
    print(f"BATCH_BYTES {sizes[0] if sizes else 0}")
    print(f"SHM {st.f_blocks * st.f_frsize} {st.f_bavail * st.f_frsize}", flush=True)


if __name__ == "__main__":
    main()
