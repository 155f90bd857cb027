"""A dataset that keeps a file open per sample it reads, under `ulimit -n 128`.

Each worker's fd count climbs by one per sample until it hits the soft
RLIMIT_NOFILE. dlwatch sees the climb (a `threshold` incident, fd-exhaustion)
and then the error itself (an `exception` incident: OSError [Errno 24] Too many
open files, raised from the worker in the training loop).

Why the `file_system` sharing strategy: under torch's default `file_descriptor`
strategy, a worker at its fd limit usually fails inside its queue feeder thread
(the error goes to stderr only) and the loop hangs, or the main process gets a
bare EOFError: a race. With `file_system` the worker itself raises, every time:
either the dataset's open() (OSError [Errno 24]) or, when the limit falls between
two batches, torch's own shared-memory open in collate ("unable to open shared
memory object ... Too many open files (24)"). Both are the same failure.

    python examples/fd_exhaustion.py [--report-dir DIR]
"""

import resource
import tempfile
import time

import torch
import torch.multiprocessing
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports

FD_LIMIT = 128


class LeakyFiles(Dataset):
    def __init__(self, path):
        self.path = path
        self.handles = {}  # BUG: a cache of open files that is never closed nor evicted

    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        f = self.handles[i] = open(self.path, "rb")  # `with open(...) as f:` would close it
        time.sleep(0.01)  # slow enough that the climb is visible before the crash
        return torch.tensor(len(f.read()))


def main():
    args = parse_args(__doc__.splitlines()[0])
    before = incidents(args.report_dir)
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (FD_LIMIT, hard))  # like `ulimit -n 128`
    torch.multiprocessing.set_sharing_strategy("file_system")
    with tempfile.NamedTemporaryFile() as sample:
        sample.write(b"x" * 64)
        sample.flush()
        loader = DataLoader(LeakyFiles(sample.name), batch_size=4, num_workers=2)
        try:
            with dlwatch.watch(loader, report_dir=args.report_dir, poll_interval=0.2) as batches:
                for _ in batches:
                    pass
        except (OSError, RuntimeError) as exc:  # the worker's exception, re-raised by the DataLoader
            print(f"training loop failed: {type(exc).__name__}: {str(exc).strip().splitlines()[-1]}")
    print_reports(args.report_dir, before)


if __name__ == "__main__":
    main()
