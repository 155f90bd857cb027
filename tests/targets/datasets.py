"""Datasets shared by test targets; importable by spawn/forkserver workers."""

import os
import time

import torch
from torch.utils.data import Dataset


class Squares(Dataset):
    def __init__(self, n: int = 40, sleep_s: float = 0.0) -> None:
        self.n = n
        self.sleep_s = sleep_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if self.sleep_s:
            time.sleep(self.sleep_s)
        return torch.tensor([i, i * i], dtype=torch.float32), i


class FailsAt(Squares):
    def __init__(self, at: int, n: int = 40) -> None:
        super().__init__(n)
        self.at = at

    def __getitem__(self, i: int):
        if i == self.at:
            raise ValueError(f"bad sample {i}")
        return super().__getitem__(i)


def record_init(path: str):
    """A worker_init_fn that appends 'pid worker_id' to a file: counts calls across processes."""
    return _RecordInit(path)


class _RecordInit:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, worker_id: int) -> None:
        with open(self.path, "a") as f:
            f.write(f"{os.getpid()} {worker_id}\n")


class FailingInit:
    def __call__(self, worker_id: int) -> None:
        raise RuntimeError(f"init failed in worker {worker_id}")
