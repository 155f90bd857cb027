"""What the RNG fingerprints cost inside DataLoader workers: ``python bench/rng_cost.py [--quick]``.

Each worker of a watched loader fingerprints its generators twice (after worker_init_fn, and
after its first batch, from the collate hook).  This measures, in real forked workers, the CPU
time of each fingerprint (``time.thread_time`` around dlwatch's own step, written to a pipe),
for a dataset without generators and for one with the generators of a typical augmentation
pipeline; and the collate hook's cost per batch once both fingerprints are taken (in-process,
the hook around a collate that does nothing, against that collate alone).

Prints a Markdown table; the raw figures go to ``bench/rng_cost.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
import timeit
from typing import Any

# the checkout, for bench._common: last, so that an installed dlwatch comes first
sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from torch.utils.data import DataLoader, Dataset  # noqa: E402

import dlwatch  # noqa: E402
from bench._common import HERE, add_install_option, dlwatch_under_test, median  # noqa: E402
from dlwatch.inproc import worker_hook  # noqa: E402


class Plain(Dataset):
    """No generator of its own: only the three globals are fingerprinted."""

    def __init__(self) -> None:
        self.paths = [f"/data/img_{i:06d}.jpg" for i in range(10_000)]

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((8,), float(i))


class Crop:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.RandomState(seed)  # MT19937: 2.5 KB of state to hash


class Compose:
    def __init__(self, transforms: list) -> None:
        self.transforms = transforms


class Augmented(Plain):
    """A typical pipeline's generators: a Generator, a random.Random, three RandomStates in transforms."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = np.random.default_rng(0)
        self.py_rng = random.Random(0)
        self.transform = Compose([Crop(1), Crop(2), Crop(3)])
        self.meta = {"classes": list(range(1000)), "gen": torch.Generator().manual_seed(0)}


def _timed(method: Any, fd: int, tag: str) -> Any:
    def wrapper(self: Any, *args: Any) -> Any:
        t0 = time.thread_time()
        try:
            return method(self, *args)
        finally:
            os.write(fd, f"{tag} {(time.thread_time() - t0) * 1e3:.4f}\n".encode())

    return wrapper


def worker_cost(dataset: Dataset, report_dir: str) -> dict[str, list[float]]:
    """CPU ms of the start and after-first-batch fingerprints, one figure per worker start."""
    rfd, wfd = os.pipe()
    saved = worker_hook.WorkerHook._fingerprint, worker_hook.CollateHook._after_first_batch
    worker_hook.WorkerHook._fingerprint = _timed(saved[0], wfd, "start")  # type: ignore[method-assign]
    worker_hook.CollateHook._after_first_batch = _timed(saved[1], wfd, "after")  # type: ignore[method-assign]
    try:
        loader = DataLoader(dataset, batch_size=8, num_workers=2)
        with dlwatch.watch(loader, report_dir=report_dir, poll_interval=1.0) as batches:
            for _ in range(2):  # fingerprints are taken in the first two generations only
                for _ in batches:
                    pass
    finally:
        worker_hook.WorkerHook._fingerprint, worker_hook.CollateHook._after_first_batch = saved
        os.close(wfd)
    raw = b""
    os.set_blocking(rfd, False)
    try:
        while chunk := os.read(rfd, 65536):
            raw += chunk
    except BlockingIOError:
        pass
    os.close(rfd)
    out: dict[str, list[float]] = {"start": [], "after": []}
    for line in raw.decode().splitlines():
        tag, ms = line.split()
        out[tag].append(float(ms))
    return out


def per_batch_cost(number: int) -> dict[str, float]:
    """µs the collate hook adds to one batch once its worker's fingerprints are taken."""

    def nothing(batch: Any) -> Any:
        return batch

    hook = worker_hook.CollateHook(nothing, "/nonexistent/events")
    assert not worker_hook._start  # as in a worker after its first batch
    batch = [1, 2, 3]
    bare = min(timeit.repeat(lambda: nothing(batch), number=number, repeat=7)) / number
    hooked = min(timeit.repeat(lambda: hook(batch), number=number, repeat=7)) / number
    return {"bare_us": bare * 1e6, "hooked_us": hooked * 1e6, "added_us": (hooked - bare) * 1e6}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions")
    add_install_option(ap)
    args = ap.parse_args()
    dlwatch_under_test(editable=args.editable)
    rounds = 2 if args.quick else 6
    results: dict[str, Any] = {"rounds": rounds, "torch": torch.__version__, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        for name, make in (("plain", Plain), ("augmented", Augmented)):
            start: list[float] = []
            after: list[float] = []
            for _ in range(rounds):
                got = worker_cost(make(), tmp)
                start += got["start"]
                after += got["after"]
            results[name] = {
                "start_ms": median(start),
                "after_first_batch_ms": median(after),
                "n": len(start),
                "start_raw": start,
                "after_raw": after,
            }
    results["per_batch"] = per_batch_cost(200_000 if not args.quick else 50_000)
    with open(os.path.join(HERE, "rng_cost.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("| Figure | dlwatch | Context |")
    print("|---|---|---|")
    for name, what in (
        ("plain", "dataset without generators (the 3 globals)"),
        ("augmented", "dataset with 6 generators (Generator, Random, 3 RandomState, torch)"),
    ):
        r = results[name]
        print(
            f"| RNG fingerprint at worker start, {what} | {r['start_ms']:.2f} ms CPU | "
            f"per worker start, first 2 generations; median of {r['n']} |"
        )
        print(
            f"| RNG fingerprint after the first batch, {what} | {r['after_first_batch_ms']:.2f} ms CPU | "
            f"once per worker, first 2 generations; median of {r['n']} |"
        )
    pb = results["per_batch"]
    print(
        f"| Collate hook per batch, after both fingerprints | {pb['added_us']:.3f} µs | "
        f"a collate that does nothing: {pb['bare_us']:.3f} µs bare, {pb['hooked_us']:.3f} µs hooked |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
