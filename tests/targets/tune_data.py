"""Datasets for the tune tests: each stands for a kind of pipeline, small enough for a few-second budget."""

from __future__ import annotations

import os
import signal
import time

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def cpu_work(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:  # CPU time, not wall time: a busy machine cannot make it sleep
        pass


class CpuBound(Dataset):
    """Decode-like: each sample costs CPU time."""

    def __init__(self, n: int = 100_000, cost_s: float = 0.002) -> None:
        self.n, self.cost_s = n, cost_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        cpu_work(self.cost_s)
        return torch.full((8,), float(i))


class IoBound(Dataset):
    """Storage-latency-like: each sample waits, using no CPU."""

    def __init__(self, n: int = 100_000, wait_s: float = 0.005) -> None:
        self.n, self.wait_s = n, wait_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.wait_s)
        return torch.full((8,), float(i))


class KillsItsWorker(IoBound):
    """A worker of a loader with at least ``kill_at`` workers dies (SIGKILL, as the OOM killer would)."""

    def __init__(self, kill_at: int = 3, **kw) -> None:
        super().__init__(**kw)
        self.kill_at = kill_at

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        if info is not None and info.num_workers >= self.kill_at and info.id == 0:
            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(i)


class HangsWithTwo(IoBound):
    """Every worker of a loader with exactly two workers blocks for good (a lock that never comes)."""

    def __getitem__(self, i: int) -> torch.Tensor:
        info = get_worker_info()
        if info is not None and info.num_workers == 2:
            time.sleep(3600)
        return super().__getitem__(i)


class Unsharded(IterableDataset):
    """An IterableDataset that ignores get_worker_info(): every worker yields the same stream."""

    def __init__(self, n: int = 100_000, wait_s: float = 0.002) -> None:
        self.n, self.wait_s = n, wait_s

    def __iter__(self):
        for i in range(self.n):
            time.sleep(self.wait_s)
            yield torch.full((4,), float(i))


class Sharded(Unsharded):
    """The same stream, split between the workers (the healthy look-alike)."""

    def __iter__(self):
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            time.sleep(self.wait_s)
            yield torch.full((4,), float(i))


class RandomOnly(IterableDataset):
    """Generates random samples only (no source to shard): distinct per worker by torch's own seeding."""

    def __iter__(self):
        for _ in range(100_000):
            time.sleep(0.002)
            yield torch.rand(4)


class BigTensors(Dataset):
    """Large samples: each batch travels through /dev/shm."""

    def __init__(self, n: int = 10_000, mib: float = 1.0) -> None:
        self.n, self.numel = n, int(mib * (1 << 20)) // 4

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(0.002)
        return torch.full((self.numel,), float(i))
