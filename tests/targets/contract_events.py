"""Every event the training process and its workers send, from real runs, copied as written.

usage: contract_events.py CAPTURE REPORT_DIR MODE

Each line ``dlwatch.wire.events`` appends to a run's events file (``append_line``: the general
path, the %-templates and the worker's ``worker_registered`` line all end there) is also appended
to CAPTURE; forked workers inherit the copy.  MODE ``watch`` runs, under ``dlwatch.watch``: a
loader with two forked workers, pin_memory on a host without CUDA (advice), a DistributedSampler
never given set_epoch, an RNG object in the dataset, a thread alive at fork, a collate that
concatenates samples (the batch check), a watch nested in the loop body, a thread that dies with an
exception, a len(loader) the program asks; then a worker killed by
SIGKILL (the exception and the workers' exit codes, the ``as`` form); then a temp directory too long
for the workers' socket, over batches without a tensor (af_unix_path); then a Ctrl-C while the loop
waits for a slow batch (the interrupt).  MODE ``run`` is a program for ``dlwatch run``: two
iterations of a loader with workers, then an exception it catches.  Prints DONE at the end.
"""

import os
import random
import signal
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset
from torch.utils.data.distributed import DistributedSampler

from dlwatch.wire import events

CAPTURE = sys.argv[1]
_append = events.append_line


def _copy(path: str, line: bytes) -> bool:
    ok = _append(path, line)
    fd = os.open(CAPTURE, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    try:
        os.write(fd, line)
    finally:
        os.close(fd)
    return ok


events.append_line = _copy


class Noisy(Dataset):
    """Draws from an RNG object made here (copied into every worker); sleeps or dies when told."""

    def __init__(self, n: int = 48, die_at: int | None = None, slow_from: int | None = None) -> None:
        self.n, self.die_at, self.slow_from = n, die_at, slow_from
        self.rng = random.Random(0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.die_at is not None and i == self.die_at:
            os.kill(os.getpid(), signal.SIGKILL)
        if self.slow_from is not None and i >= self.slow_from:
            time.sleep(1.5)
        return torch.tensor([float(i), self.rng.random()])


def decode() -> None:
    raise ValueError("corrupt frame")


def cat_collate(samples: list) -> torch.Tensor:
    return torch.cat(samples)  # 2 x batch_size rows: the batch check's k x B


def watch_mode(report_dir: str) -> None:
    import dlwatch

    # a thread of the main process alive at each worker's fork (fork_threads)
    stop = threading.Event()
    threading.Thread(target=stop.wait, name="cache-refresher", daemon=True).start()
    ds = Noisy()
    dl = DataLoader(
        ds,
        batch_size=4,
        num_workers=2,
        pin_memory=True,
        collate_fn=cat_collate,
        sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True, seed=3),
    )
    inner = DataLoader(Noisy(8), batch_size=4, num_workers=0)
    with dlwatch.watch(dl, report_dir=report_dir, poll_interval=0.2):
        len(dl)  # a progress bar's total: each epoch's end is told with it (epoch_ended)
        for epoch in range(2):
            for n, _batch in enumerate(dl):
                if epoch == 0 and n == 0:
                    with dlwatch.watch(inner, report_dir=report_dir, poll_interval=0.2):
                        for _ in inner:
                            pass
                if epoch == 0 and n == 1:  # a producer thread that dies with an exception
                    died = threading.Thread(target=decode, name="decoder")
                    died.start()
                    died.join()
    stop.set()

    # a worker killed from outside: the exception and the exit codes of the iterator's workers.
    # It dies on its first sample: a worker killed after it put a batch on the queue takes that
    # batch's shared-memory fd with it, and the main process's fetch of it then fails with
    # ConnectionResetError instead of torch's RuntimeError (a real race of torch's, not dlwatch's).
    killed = DataLoader(Noisy(32, die_at=0), batch_size=4, num_workers=2)
    try:
        with dlwatch.watch(killed, report_dir=report_dir, poll_interval=0.2) as batches:
            for _ in batches:
                pass
    except RuntimeError as exc:
        print(f"CAUGHT {type(exc).__name__}", flush=True)

    # a temp directory too long for the workers' socket (af_unix_path), over batches without a
    # tensor: no fd to send, so the loop runs; the check as the iterator starts is told all the same
    import shutil
    import tempfile

    top = tempfile.mkdtemp(prefix="dlwatch-c-", dir="/tmp")
    deep = os.path.join(top, "d" * 90)
    os.makedirs(deep)
    saved, tempfile.tempdir = tempfile.tempdir, deep
    try:
        words = DataLoader([f"w{i}" for i in range(8)], batch_size=4, num_workers=2, collate_fn=list)
        with dlwatch.watch(words, report_dir=report_dir, poll_interval=0.2):
            for _ in words:
                pass
    finally:
        tempfile.tempdir = saved
        shutil.rmtree(top, ignore_errors=True)

    # a Ctrl-C while the loop waits for a slow batch, past a quarter of the explicit allowance
    slow = DataLoader(Noisy(32, slow_from=8), batch_size=4, num_workers=2)
    try:
        with dlwatch.watch(slow, report_dir=report_dir, poll_interval=0.2, stall_timeout=2.0):
            for n, _batch in enumerate(slow):
                if n == 1:
                    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    except KeyboardInterrupt:
        print("CAUGHT KeyboardInterrupt", flush=True)


def run_mode() -> None:
    dl = DataLoader(Noisy(24), batch_size=4, num_workers=2)
    for _epoch in range(2):
        for _batch in dl:
            pass
    bad = DataLoader(Noisy(16, die_at=5), batch_size=4, num_workers=2)
    try:
        for _batch in bad:
            pass
    except RuntimeError as exc:
        print(f"CAUGHT {type(exc).__name__}", flush=True)


if __name__ == "__main__":
    if sys.argv[3] == "watch":
        watch_mode(sys.argv[2])
    else:
        run_mode()
    print("DONE", flush=True)
