"""A map-style dataset over a memory-mapped file, as `datasets` (Arrow) and np.load(mmap_mode="r") datasets are.

    python mapped_memory.py mmap|leak REPORT_DIR DATA_DIR

Runs in a 2 GiB memory cgroup (re-runs itself inside one; prints ``SKIP: why`` where none
can be made) with two workers.  Each worker reads its own rows of a 1 GiB array on disk
through one read-only mapping, touching every page: its USS rises by ~512 MiB of file pages
that it alone maps (private, clean, page cache the kernel reclaims; huggingface/datasets#4883).
``leak`` also keeps half of every row it reads as a private copy in a list, ~256 MiB per
worker: a real leak in the same program.  The loop stops at the first incident or after 40 s,
prints ``REPORT <path>`` for each incident and ``SUMMARY <run summary as JSON>``, and exits 0.
"""

import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, os.pardir, os.pardir, "examples"))

from _common import incidents, rerun_in_memory_cgroup  # noqa: E402

ROW_FLOATS = 128 * 1024  # 1 MiB a row
ROWS = 1024
LIMIT = 2048 << 20


def main() -> None:
    mode, report_dir, data_dir = sys.argv[1], sys.argv[2], sys.argv[3]
    rerun_in_memory_cgroup(LIMIT)
    import numpy as np
    from torch.utils.data import DataLoader, Dataset

    import dlwatch

    path = os.path.join(data_dir, "rows.npy")
    if not os.path.exists(path):  # written inside the cgroup: its page cache is the job's, as in a real one
        arr = np.lib.format.open_memmap(path, mode="w+", dtype=np.float64, shape=(ROWS, ROW_FLOATS))
        arr[:] = 1.0
        arr.flush()
        del arr

    class Rows(Dataset):
        def __init__(self) -> None:
            self.rows = None  # opened in each worker, after the fork
            self.kept: list = []

        def __len__(self) -> int:
            return ROWS

        def __getitem__(self, i: int) -> float:
            if self.rows is None:
                self.rows = np.load(path, mmap_mode="r")
            row = self.rows[i]
            total = float(row[::512].sum())  # one float a page: every page of the row is touched
            if mode == "leak":
                self.kept.append(np.array(row[: ROW_FLOATS // 2]))  # a private copy, kept for good
            time.sleep(0.045)  # a decode: the first epoch takes ~23 s, the pages mapped all along
            return total

    before = incidents(report_dir)
    # batches of 8 consecutive rows: each worker maps its own 8 MiB runs (page-cache folios can be larger than
    # a page, and a fault maps the whole folio: rows handed out one by one would share folios)
    loader = DataLoader(Rows(), batch_size=8, num_workers=2, persistent_workers=True)
    deadline = time.monotonic() + 40
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.5) as w:
        while time.monotonic() < deadline:
            for _ in w:
                if incidents(report_dir) - before or time.monotonic() > deadline:
                    deadline = 0
                    break
    for name in sorted(incidents(report_dir) - before):
        print(f"REPORT {os.path.join(report_dir, name)}")
    print("SUMMARY " + json.dumps(w.summary), flush=True)


if __name__ == "__main__":
    main()
