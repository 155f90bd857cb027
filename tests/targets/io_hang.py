"""Stalls that are not deadlocks, for real: starved CPU, a socket that never answers, a lock that wakes.

usage: io_hang.py MODE REPORT_DIR [--port P] [--stall-timeout S] [--workers N] [--unwatched]

  starved  N CPU-bound workers (default 16) on however few cores: each gets a sliver of a CPU
  socket   each worker connects to 127.0.0.1:P and recv()s with a 600 s socket timeout (poll)
  pool     each worker fetches through a ThreadPoolExecutor: the main thread waits in
           Future.result, a pool thread in recv() with no timeout (recvfrom)
  wakes    each worker waits on a threading.Condition with a 1 s timeout, in a loop, for
           something that never comes: it wakes every second
  trickle  each worker reads a 400-byte sample from 127.0.0.1:P, which sends a byte every
           0.1 s (a slow store, healthy): through a thread pool, with a 600 s socket timeout
  fifo     each worker opens a named pipe (--path) for reading; no writer ever comes
  fifo-write  each worker writes 1 MiB into a named pipe (--path) that the test holds open for
           reading and never reads: the pipe fills and the write blocks
  flock    each worker takes an exclusive flock on --path, which the test holds

Prints READY once the loader is iterating; then stalls.  The listener on P (socket, pool)
is the test's: it accepts and never answers.
"""

import argparse
import concurrent.futures
import contextlib
import socket
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch


class Burn(Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        end = time.process_time() + 1.0  # one CPU second a sample: minutes of wall time when starved
        x = 0
        while time.process_time() < end:
            x += 1
        return torch.full((2,), float(i))


class Remote(Dataset):
    """Samples from a remote store at 127.0.0.1:port that never answers."""

    def __init__(self, port, via_pool, whole=False):
        self.port = port
        self.via_pool = via_pool
        self.whole = whole
        self.pool = None

    def __len__(self):
        return 64

    def fetch(self, i, timeout):
        with socket.create_connection(("127.0.0.1", self.port), timeout=timeout) as s:
            s.sendall(b"GET /shard-%d HTTP/1.0\r\n\r\n" % i)
            s.settimeout(timeout)
            if not self.whole:
                return s.recv(65536)
            data = b""
            while len(data) < 400:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
            return data

    def __getitem__(self, i):
        if self.via_pool:
            if self.pool is None:  # created in the worker, after the fork
                self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="fetch")
            data = self.pool.submit(self.fetch, i, 600.0 if self.whole else None).result()
        else:
            data = self.fetch(i, 600.0)
        return torch.tensor(len(data))


class Waits(Dataset):
    """Waits for a ready flag nobody sets, polling a Condition with a timeout."""

    def __init__(self):
        self.cond = threading.Condition()
        self.ready = False

    def __len__(self):
        return 64

    def __getitem__(self, i):
        with self.cond:
            while not self.ready:
                self.cond.wait(timeout=1.0)
        return torch.zeros(2)


class Files(Dataset):
    """Samples behind a named pipe or a locked file (mode: fifo, fifo-write, flock)."""

    def __init__(self, mode, path):
        self.mode = mode
        self.path = path

    def __len__(self):
        return 64

    def __getitem__(self, i):
        if self.mode == "fifo":
            with open(self.path, "rb") as f:  # blocks in open(): no writer
                return torch.tensor(len(f.read()))
        if self.mode == "fifo-write":
            with open(self.path, "wb") as f:  # the test's reader is there: the open returns
                f.write(b"x" * (1 << 20))  # the reader never reads: the pipe fills, write blocks
            return torch.zeros(2)
        import fcntl

        with open(self.path, "rb") as f:
            fcntl.flock(f, fcntl.LOCK_EX)  # the test holds it
            return torch.zeros(2)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["starved", "socket", "pool", "wakes", "trickle", "fifo", "fifo-write", "flock"])
    ap.add_argument("--path", default="")
    ap.add_argument("report_dir")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--stall-timeout", type=float, default=1.5)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--unwatched", action="store_true")
    args = ap.parse_args()
    if args.mode == "starved":
        ds = Burn()
    elif args.mode in ("socket", "pool"):
        ds = Remote(args.port, via_pool=args.mode == "pool")
    elif args.mode == "trickle":
        ds = Remote(args.port, via_pool=True, whole=True)
    elif args.mode in ("fifo", "fifo-write", "flock"):
        ds = Files(args.mode, args.path)
    else:
        ds = Waits()
    dl = DataLoader(ds, batch_size=1, num_workers=args.workers, multiprocessing_context="fork")
    ctx = (
        contextlib.nullcontext()
        if args.unwatched
        else dlwatch.watch(dl, report_dir=args.report_dir, stall_timeout=args.stall_timeout, poll_interval=0.2)
    )
    with ctx:
        it = iter(dl)
        print("READY", flush=True)
        for _ in it:
            pass
    print("DONE", flush=True)
