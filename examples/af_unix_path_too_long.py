"""A TMPDIR too long for a Unix socket: the workers can never send a batch, and the loop waits forever.

Job schedulers and shared clusters often set TMPDIR to a per-job scratch directory deep in a
project tree.  Under torch's default `file_descriptor` sharing strategy each worker hands its
batch's tensors over as fds through a Unix socket that multiprocessing binds under
`$TMPDIR/pymp-XXXXXXXX/`; Linux keeps at most 107 bytes of a socket path.  Here the temp
directory is 90 bytes long: each worker's queue feeder thread dies with `OSError: AF_UNIX path
too long` (on stderr), the workers live on, and the loop waits for its first batch forever.

The stall incident's top finding is `af-unix-path-too-long`, with the path's length, the
limit and the directory.

Like examples/deadlock.py, this script plays the job scheduler.

    python examples/af_unix_path_too_long.py [--report-dir DIR]
"""

import os
import shutil
import tempfile

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import HUNG_CHILD, run_hung_training


class Images(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        return torch.full((3, 8, 8), float(i))


SCRATCH = "DLWATCH_EXAMPLE_SCRATCH"


def train(report_dir):
    tempfile.tempdir = os.environ[SCRATCH]  # as TMPDIR would, for this process and the workers it forks
    loader = DataLoader(Images(), batch_size=8, num_workers=2, multiprocessing_context="fork")
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2, stall_timeout=3) as batches:
        for _ in batches:
            pass


if __name__ == "__main__":
    if os.environ.get(HUNG_CHILD) == "1":
        run_hung_training(__doc__.splitlines()[0], train)
    else:  # the scheduler makes the job's scratch directory (90 bytes) and removes it after the job
        top = tempfile.mkdtemp(prefix="dlwatch-example-")
        os.environ[SCRATCH] = os.path.join(top, "j" * max(1, 90 - len(top) - 1))
        os.makedirs(os.environ[SCRATCH])
        try:
            run_hung_training(__doc__.splitlines()[0], train)
        finally:
            shutil.rmtree(top, ignore_errors=True)
