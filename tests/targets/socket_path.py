"""A loader run whose temp directory (TMPDIR, set by the test) may be too long for multiprocessing's
Unix socket.  argv: form (plain: watch(), bare: under `dlwatch run`), case, report dir.

Cases: tensors (a batch of tensors: the workers' fd passing binds the socket), file_system (the same
under the file_system strategy: no socket), no_tensors (batches of strings, collated as lists: no fd to
send, the run goes on) and no_tensors_then_slow (the same, then a slow item: a stall of its own after
batches arrived).  A hang ends by torch's own DataLoader timeout (15 s), well after dlwatch's stall (3 s) and its forensics."""

import sys
import tempfile
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch

form, case, report_dir = sys.argv[1], sys.argv[2], sys.argv[3]
print("TEMPDIR", len(tempfile.gettempdir()), flush=True)
if case == "file_system":
    torch.multiprocessing.set_sharing_strategy("file_system")


class Items(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        if case == "no_tensors_then_slow" and i == 8:
            time.sleep(8)  # a slow read: the loop waits, batches had arrived before it
        return f"item-{i}" if case.startswith("no_tensors") else torch.full((4,), float(i))


def keep(batch):
    return list(batch)


loader = DataLoader(
    Items(),
    batch_size=4,
    num_workers=2,
    timeout=15,
    collate_fn=keep if case.startswith("no_tensors") else None,
    multiprocessing_context="fork",
)
n = 0
try:
    if form == "plain":
        with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2, stall_timeout=3):
            for _ in loader:
                n += 1
    else:
        for _ in loader:
            n += 1
finally:
    print("BATCHES", n, flush=True)
