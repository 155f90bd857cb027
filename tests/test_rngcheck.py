"""RNG fingerprints: unit cases, and a real forked DataLoader with an RNG made in Dataset.__init__."""

from __future__ import annotations

import multiprocessing as mp
import queue
import random
import subprocess
import sys
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from dlwatch.rngcheck import duplicates, fingerprint, state_hash

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class Crop:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.RandomState(seed)


class Compose:
    def __init__(self, transforms: list) -> None:
        self.transforms = transforms


class RngDataset(Dataset):
    """The bug: RNG objects created in __init__ are copied into every forked worker."""

    def __init__(self, n: int = 12) -> None:
        self.n = n
        self.np_rng = np.random.default_rng(0)
        self.py_rng = random.Random(0)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def reseed(worker_id: int) -> None:
    info = get_worker_info()
    info.dataset.np_rng = np.random.default_rng(info.seed % 2**32)
    info.dataset.py_rng = random.Random(info.seed)


class Collect:
    """worker_init_fn that runs the user's function first, then fingerprints, like dlwatch's hook."""

    def __init__(self, q: Any, user_fn: Any = None) -> None:
        self.q, self.user_fn = q, user_fn

    def __call__(self, worker_id: int) -> None:
        if self.user_fn is not None:
            self.user_fn(worker_id)
        self.q.put((worker_id, fingerprint(get_worker_info().dataset)))


def fingerprints_from_workers(user_fn: Any = None, num_workers: int = 3) -> dict[int, dict[str, str]]:
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    loader = DataLoader(RngDataset(), batch_size=2, num_workers=num_workers, multiprocessing_context=ctx,
                        worker_init_fn=Collect(q, user_fn), timeout=30)
    it = iter(loader)
    try:
        out: dict[int, dict[str, str]] = {}
        for _ in range(num_workers):
            wid, prints = q.get(timeout=30)
            out[wid] = prints
        assert sum(len(b) for b in it) == 12
        return out
    except queue.Empty:
        pytest.fail("workers did not report their fingerprints within 30 s")
    finally:
        # shut the workers down (joins them; terminates any that hang) whatever happened
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        q.close()
        q.join_thread()
        left = [p for p in psutil.Process().children(recursive=True) if p.is_running()
                and p.status() != psutil.STATUS_ZOMBIE and p.name() == "pt_data_worker"]
        for p in left:
            p.kill()
        assert not left, f"workers left behind: {left}"


def test_real_dataloader_rng_in_init_is_duplicated() -> None:
    prints = fingerprints_from_workers()
    assert set(prints) == {0, 1, 2}
    assert {"dataset.np_rng", "dataset.py_rng", "global:random", "global:numpy", "global:torch"} <= set(prints[0])
    dups = duplicates(prints)
    flagged = {d["attribute"]: d for d in dups}
    assert set(flagged) == {"dataset.np_rng", "dataset.py_rng"}
    assert flagged["dataset.np_rng"]["workers"] == [0, 1, 2] and flagged["dataset.np_rng"]["kind"] == "object"
    # torch seeds the globals apart in each worker
    assert len({p["global:random"] for p in prints.values()}) == 3
    assert len({p["global:numpy"] for p in prints.values()}) == 3
    assert len({p["global:torch"] for p in prints.values()}) == 3


def test_real_dataloader_reseeded_in_worker_init_fn_is_not_flagged() -> None:
    prints = fingerprints_from_workers(user_fn=reseed)
    assert duplicates(prints) == []


def test_one_worker_has_no_duplicates() -> None:
    assert duplicates({0: {"dataset.rng": "abc", "global:random": "x"}}) == []


def test_duplicates_groups_and_globals() -> None:
    prints = {0: {"dataset.rng": "a", "global:numpy": "g"}, 1: {"dataset.rng": "a", "global:numpy": "g"},
              2: {"dataset.rng": "b", "global:numpy": "h"}, 3: {"dataset.rng": "b", "global:numpy": "i"}}
    assert duplicates(prints) == [
        {"attribute": "dataset.rng", "workers": [0, 1], "kind": "object"},
        {"attribute": "dataset.rng", "workers": [2, 3], "kind": "object"},
        {"attribute": "global:numpy", "workers": [0, 1], "kind": "global"},
    ]


def test_reaches_two_levels_and_transforms() -> None:
    class Inner:
        def __init__(self) -> None:
            self.gen = torch.Generator().manual_seed(1)
            self.deeper = Crop(3)  # three attribute levels down: not reached

    class DS:
        def __init__(self) -> None:
            self.transform = Compose([Crop(1), Crop(2)])
            self.params = {"rng": random.Random(5)}
            self.inner = Inner()
            self.data = np.zeros(1000)  # arrays are not walked

    prints = fingerprint(DS())
    assert {"dataset.transform.transforms[0].rng", "dataset.transform.transforms[1].rng",
            "dataset.params['rng']", "dataset.inner.gen"} <= set(prints)
    assert "dataset.inner.deeper.rng" not in prints
    assert prints["dataset.transform.transforms[0].rng"] != prints["dataset.transform.transforms[1].rng"]
    assert all(len(h) == 16 for h in prints.values())


def test_same_state_same_hash_and_no_state_leaks() -> None:
    a, b = np.random.default_rng(7), np.random.default_rng(7)
    assert state_hash(a) == state_hash(b)
    b.random()
    assert state_hash(a) != state_hash(b)
    assert state_hash(np.random.RandomState(1)) == state_hash(np.random.RandomState(1))
    assert state_hash(object()) is None
    # MT19937 states are arrays: the hash must see every word, not numpy's elided repr
    s1, s2 = np.random.RandomState(0), np.random.RandomState(0)
    st = s2.get_state()
    keys = st[1].copy()
    keys[300] ^= 1
    s2.set_state((st[0], keys, st[2], st[3], st[4]))
    assert state_hash(s1) != state_hash(s2)


def test_never_raises_and_is_bounded() -> None:
    class Hostile:
        def __getattribute__(self, name: str) -> Any:
            raise RuntimeError("nope")

    class Prop:
        @property
        def rng(self) -> Any:  # properties are never called (they may do I/O)
            raise AssertionError("called")

    class Cyclic:
        def __init__(self) -> None:
            self.me = self
            self.items = [self] * 10_000
            self.rng = random.Random(1)

    assert "global:random" in fingerprint(Hostile())
    assert "global:random" in fingerprint(Prop())
    assert "dataset.rng" in fingerprint(Cyclic())
    assert "global:random" in fingerprint(None)


def test_no_numpy_or_torch_import() -> None:
    code = ("import sys, dlwatch.rngcheck as r; p = r.fingerprint(object()); "
            "assert 'numpy' not in sys.modules and 'torch' not in sys.modules; "
            "assert set(p) == {'global:random'}, p")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
