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
from torch.utils.data import DataLoader, Dataset, default_collate, get_worker_info

from dlwatch.inproc.rngcheck import duplicates, fingerprint, state_hash

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
    loader = DataLoader(
        RngDataset(),
        batch_size=2,
        num_workers=num_workers,
        multiprocessing_context=ctx,
        worker_init_fn=Collect(q, user_fn),
        timeout=30,
    )
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
        left = [
            p
            for p in psutil.Process().children(recursive=True)
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE and p.name() == "pt_data_worker"
        ]
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
    prints = {
        0: {"dataset.rng": "a", "global:numpy": "g"},
        1: {"dataset.rng": "a", "global:numpy": "g"},
        2: {"dataset.rng": "b", "global:numpy": "h"},
        3: {"dataset.rng": "b", "global:numpy": "i"},
    }
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
    assert {
        "dataset.transform.transforms[0].rng",
        "dataset.transform.transforms[1].rng",
        "dataset.params['rng']",
        "dataset.inner.gen",
    } <= set(prints)
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
    code = (
        "import sys, dlwatch.inproc.rngcheck as r; p = r.fingerprint(object()); "
        "assert 'numpy' not in sys.modules and 'torch' not in sys.modules; "
        "assert set(p) == {'global:random'}, p"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# --------------------------------------------------------------------------- streams drawn from, under dlwatch.watch
#
# Real DataLoaders with forked workers under dlwatch.watch and its real monitor: each worker
# fingerprints its generators after worker_init_fn and again after its first batch; the monitor's
# detector judges only streams the workers draw from.  Healthy habits must stay quiet (no
# incident, and no finding when the fingerprints are judged again from the events); the
# failures must make rng-duplication the top finding.

import json
import os

import dlwatch
from conftest import incidents, load
from dlwatch.detect.match import match
from dlwatch.detect.rng import fingerprints_of, judge
from dlwatch.wire.playbooks import load_playbooks

N = 16


class ShuffledOnce(Dataset):
    """(a) a generator kept on the dataset but used only in __init__, to shuffle an index once."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.order = self.rng.permutation(N)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([int(self.order[i])])


class PerItemRng(Dataset):
    """(b) a generator re-created per item from the index (deterministic per-sample augmentation)."""

    def __init__(self, seed: int = 1234) -> None:
        self.seed = seed
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        self.rng = np.random.default_rng(self.seed + i)
        return torch.tensor([i, int(self.rng.integers(0, 1 << 30))])


class LazySeeded(Dataset):
    """(c) a generator made on first use inside the worker, from the seed torch made for it."""

    def __init__(self) -> None:
        self.rng = None

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.rng is None:
            info = get_worker_info()
            self.rng = np.random.default_rng(info.seed if info is not None else 0)
        return torch.tensor([i, int(self.rng.integers(0, 1 << 30))])


class InitRng(Dataset):
    """(d) the shipped bug: generators made in __init__ and drawn from in __getitem__."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)
        self.py_rng = random.Random(0)

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(self.rng.integers(0, 1 << 30)), int(self.py_rng.random() < 0.5)])


class GlobalNumpyAug(Dataset):
    """An augmentation drawn from numpy's global generator (as many older pipelines do)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(np.random.randint(0, 1 << 30))])


class NoRandomness(Dataset):
    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i])


def seed_by_worker_id(worker_id: int) -> None:
    np.random.seed(worker_id)  # the bug: the same seed for this worker every epoch


def seed_constant(worker_id: int) -> None:
    np.random.seed(0)  # "reproducible" validation workers: harmless when nothing draws


def seed_from_torch(worker_id: int) -> None:
    np.random.seed(torch.initial_seed() % 2**32)  # the remediation: new per worker and per epoch
    random.seed(torch.initial_seed())


def watched_epochs(tmp_path: Any, loader: DataLoader, epochs: int = 2) -> tuple[list, list[dict], list[dict]]:
    """(batches of each epoch, the run's events, the incidents written) for a loader under watch."""
    with dlwatch.watch(loader, report_dir=str(tmp_path), poll_interval=0.1) as batches:
        seen = [[b.tolist() for b in batches] for _ in range(epochs)]
        with open(os.path.join(batches.run_dir, "events.jsonl")) as f:
            events = [json.loads(line) for line in f]
    return seen, events, [load(p) for p in incidents(str(tmp_path))]


def fingerprint_events(events: list[dict], stage: str) -> list[dict]:
    return [e for e in events if e["event"] == "rng_fingerprint" and e.get("stage") == stage]


def assert_quiet(events: list[dict], reports: list[dict]) -> None:
    assert reports == [], [r["summary"] for r in reports]
    assert judge(events) == ([], [])
    derived = match({"events": events, "loader": {}}, load_playbooks())  # the matcher's own reading agrees
    assert derived == [], derived


def after_batch(events: list[dict]) -> dict[tuple[int, int], dict]:
    return {(e["epoch"], e["worker_id"]): e for e in fingerprint_events(events, "after_first_batch")}


def test_watch_generator_used_only_in_init_is_quiet(tmp_path, no_leftovers) -> None:
    _, events, reports = watched_epochs(tmp_path, DataLoader(ShuffledOnce(), batch_size=4, num_workers=2))
    assert_quiet(events, reports)
    after = after_batch(events)
    assert set(after) == {(1, 0), (1, 1), (2, 0), (2, 1)}
    for e in after.values():  # seen in every worker, identical in all, but never drawn from
        assert "dataset.rng" in fingerprints_of(e) and "dataset.rng" not in e["drawn"]
    assert len({fingerprints_of(e)["dataset.rng"] for e in after.values()}) == 1
    # the old rule (identical state at worker start) would have flagged it
    starts = {e["worker_id"]: fingerprints_of(e) for e in fingerprint_events(events, "start") if e["epoch"] == 1}
    assert {d["attribute"] for d in duplicates(starts)} == {"dataset.rng"}


def test_watch_generator_recreated_per_item_is_quiet(tmp_path, no_leftovers) -> None:
    seen, events, reports = watched_epochs(tmp_path, DataLoader(PerItemRng(), batch_size=4, num_workers=2))
    assert_quiet(events, reports)
    assert seen[0] == seen[1]  # by design: the same draw for the same index in every epoch
    for e in after_batch(events).values():
        assert "dataset.rng" in e["drawn"] and "dataset.rng" in e["rebound"]


def test_watch_generator_seeded_on_first_use_from_worker_seed_is_quiet(tmp_path, no_leftovers) -> None:
    seen, events, reports = watched_epochs(tmp_path, DataLoader(LazySeeded(), batch_size=4, num_workers=2))
    assert_quiet(events, reports)
    assert seen[0] != seen[1]
    starts = fingerprint_events(events, "start")
    assert starts and all("dataset.rng" not in fingerprints_of(e) for e in starts)  # None at worker start
    for e in after_batch(events).values():
        assert "dataset.rng" in e["drawn"] and "dataset.rng" in e["rebound"]


def test_watch_worker_aware_seeding_of_the_globals_is_quiet(tmp_path, no_leftovers) -> None:
    loader = DataLoader(GlobalNumpyAug(), batch_size=4, num_workers=2, worker_init_fn=seed_from_torch)
    seen, events, reports = watched_epochs(tmp_path, loader)
    assert_quiet(events, reports)
    assert seen[0] != seen[1]
    assert all("global:numpy" in e["drawn"] for e in after_batch(events).values())


def test_watch_validation_loader_seeded_alike_but_drawing_nothing_is_quiet(tmp_path, no_leftovers) -> None:
    loader = DataLoader(NoRandomness(), batch_size=4, num_workers=2, worker_init_fn=seed_constant)
    _, events, reports = watched_epochs(tmp_path, loader)
    assert_quiet(events, reports)
    after = after_batch(events)
    assert len(after) == 4 and all(e["drawn"] == [] for e in after.values())


def test_watch_loader_generator_and_shuffle_is_quiet(tmp_path, no_leftovers) -> None:
    # torch's own generator= drives the sampler in the training process and the workers' base seed
    loader = DataLoader(
        GlobalNumpyAug(), batch_size=4, num_workers=2, shuffle=True, generator=torch.Generator().manual_seed(0)
    )
    _, events, reports = watched_epochs(tmp_path, loader)
    assert_quiet(events, reports)


def test_watch_generator_made_in_init_is_the_top_finding(tmp_path, no_leftovers) -> None:
    seen, events, reports = watched_epochs(tmp_path, DataLoader(InitRng(), batch_size=4, num_workers=2))
    draws = [b[0][1] for b in seen[0]]
    assert draws[0] == draws[1]  # workers 0 and 1 drew the same "random" value for their first items
    assert len(reports) == 1 and reports[0]["trigger"] == "threshold"
    top = reports[0]["findings"][0]
    assert top["playbook"] == "rng-duplication" and top["confidence"] == 0.9
    dups = {d["attribute"]: d for d in top["evidence"]["duplicates"]}
    assert set(dups) == {"dataset.rng", "dataset.py_rng"}
    assert all(d["workers"] == [0, 1] and d["kind"] == "object" and d["epoch"] == 1 for d in dups.values())
    assert "Every worker draws from its own copy" in top["remediation"]
    # the workers restart each epoch from the training process's copy: the epoch repeats as well
    _, repeats = judge(events)
    assert {r["attribute"] for r in repeats} == {"dataset.rng", "dataset.py_rng"}


def test_watch_numpy_seeded_by_worker_id_repeats_every_epoch(tmp_path, no_leftovers) -> None:
    loader = DataLoader(GlobalNumpyAug(), batch_size=4, num_workers=2, worker_init_fn=seed_by_worker_id)
    seen, events, reports = watched_epochs(tmp_path, loader)
    assert seen[0] == seen[1]  # the same augmentations, epoch after epoch
    assert seen[0][0] != seen[0][1]  # though not the same in the two workers
    assert len(reports) == 1 and reports[0]["trigger"] == "threshold"
    top = reports[0]["findings"][0]
    assert top["playbook"] == "rng-duplication" and top["confidence"] == 0.85
    ev = top["evidence"]
    assert ev["repeats"] == [{"attribute": "global:numpy", "workers": [0, 1], "epochs": [1, 2], "kind": "global"}]
    assert "duplicates" not in ev and ev["persistent_workers"] is False
    assert ev["sampler"].endswith("SequentialSampler")
    assert ev["worker_init_fn"].endswith("seed_by_worker_id")
    assert (
        "torch.initial_seed()" in top["remediation"]
        and "The workers start the same stream every epoch" in top["remediation"]
    )


def test_watch_one_worker_seeded_by_id_repeats_every_epoch(tmp_path, no_leftovers) -> None:
    loader = DataLoader(GlobalNumpyAug(), batch_size=4, num_workers=1, worker_init_fn=seed_by_worker_id)
    _, _, reports = watched_epochs(tmp_path, loader)
    assert len(reports) == 1
    top = reports[0]["findings"][0]
    assert top["playbook"] == "rng-duplication"
    assert top["evidence"]["repeats"] == [
        {"attribute": "global:numpy", "workers": [0], "epochs": [1, 2], "kind": "global"}
    ]


def test_watch_numpy_seeded_by_worker_id_with_persistent_workers_is_quiet(tmp_path, no_leftovers) -> None:
    loader = DataLoader(
        GlobalNumpyAug(), batch_size=4, num_workers=2, worker_init_fn=seed_by_worker_id, persistent_workers=True
    )
    seen, events, reports = watched_epochs(tmp_path, loader)
    assert seen[0] != seen[1]  # the same workers go on drawing: a new stretch of the stream each epoch
    assert_quiet(events, reports)
    assert {e["epoch"] for e in fingerprint_events(events, "start")} == {1}


# --------------------------------------------------------------------------- the collate hook


def pairs_collate(samples: list) -> dict:
    return {"x": torch.stack(samples), "n": len(samples)}


class FailingCollate:
    def __call__(self, samples: list) -> Any:
        raise ValueError(f"collate failed on {len(samples)} samples")


def test_collate_hook_returns_the_same_object_and_raises_the_same_error() -> None:
    from dlwatch.inproc.worker_hook import CollateHook

    out = object()
    assert CollateHook(lambda batch: out, "/nonexistent/events")([1, 2]) is out
    boom = KeyError("mine")

    def fails(batch: Any) -> Any:
        raise boom

    with pytest.raises(KeyError) as info:
        CollateHook(fails, "/nonexistent/events")([1])
    assert info.value is boom


def test_watch_custom_collate_same_batches_errors_and_restored(tmp_path, no_leftovers) -> None:
    loader = DataLoader(InitRng(), batch_size=4, num_workers=2, collate_fn=pairs_collate)
    bare = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in loader]
    with dlwatch.watch(loader, report_dir=str(tmp_path), poll_interval=0.1):
        watched = [{k: (v.tolist() if isinstance(v, torch.Tensor) else v) for k, v in b.items()} for b in loader]
    assert watched == bare  # the generators in this dataset restart from the same state each epoch
    assert loader.collate_fn is pairs_collate
    (report,) = [load(p) for p in incidents(str(tmp_path))]
    assert report["loader"]["collate_fn"].endswith("pairs_collate")  # the user's, not dlwatch's hook

    def error_of(watched: bool) -> tuple[type, str]:
        failing = DataLoader(NoRandomness(), batch_size=4, num_workers=2, collate_fn=FailingCollate())
        try:
            if watched:
                with dlwatch.watch(failing, report_dir=str(tmp_path / "r2"), poll_interval=0.1):
                    list(failing)
            else:
                list(failing)
        except BaseException as exc:  # noqa: BLE001 - we compare exactly what escaped
            exc.__traceback__ = None  # free the iterator and its workers now
            return type(exc), str(exc)
        raise AssertionError("the failing collate_fn raised nothing")

    bare_err, watched_err = error_of(False), error_of(True)
    assert bare_err[0] is watched_err[0] is ValueError
    assert bare_err[1].splitlines()[0] == watched_err[1].splitlines()[0]
    assert bare_err[1].splitlines()[-1] == watched_err[1].splitlines()[-1] == "ValueError: collate failed on 4 samples"


def test_no_collate_hook_without_workers_or_when_ignored(tmp_path, no_leftovers) -> None:
    loader = DataLoader(NoRandomness(), batch_size=4, num_workers=0)
    with dlwatch.watch(loader, report_dir=str(tmp_path), poll_interval=0.1):
        assert loader.collate_fn is default_collate
    loader = DataLoader(NoRandomness(), batch_size=4, num_workers=2)
    with dlwatch.watch(loader, report_dir=str(tmp_path), poll_interval=0.1, ignore="rng-duplication"):
        assert loader.collate_fn is default_collate
    with dlwatch.watch(loader, report_dir=str(tmp_path), poll_interval=0.1):
        assert loader.collate_fn is not default_collate
    assert loader.collate_fn is default_collate


# --------------------------------------------------------------------------- the judgement, by hand


def fp(
    pid: int, wid: int, epoch: int | None, stage: str = "start", drawn: tuple = (), rebound: tuple = (), **prints: str
) -> dict:
    ev = {
        "event": "rng_fingerprint",
        "pid": pid,
        "worker_id": wid,
        "stage": stage,
        "fingerprints": {
            k.replace("dataset_", "dataset.").replace("global__", "global:"): v for k, v in prints.items()
        },
    }
    if epoch is not None:
        ev["epoch"] = epoch
    if stage == "after_first_batch":
        ev["drawn"], ev["rebound"] = list(drawn), list(rebound)
    return ev


def test_drawn_tells_advanced_rebound_and_unknown_apart() -> None:
    from dlwatch.inproc.rngcheck import Snapshot, drawn

    kept, old, new = object(), object(), object()
    start = Snapshot(
        {"dataset.a": "1", "dataset.b": "1", "dataset.c": "1", "global:numpy": "g"},
        {"dataset.a": kept, "dataset.b": old, "dataset.c": kept},
        True,
    )
    after = Snapshot(
        {
            "dataset.a": "2",
            "dataset.b": "2",
            "dataset.c": "1",
            "dataset.lazy": "5",
            "global:numpy": "h",
            "global:torch": "t",
        },
        {"dataset.a": kept, "dataset.b": new, "dataset.c": kept, "dataset.lazy": new},
        True,
    )
    assert drawn(start, after) == (
        ["dataset.a", "dataset.b", "dataset.lazy", "global:numpy"],
        ["dataset.b", "dataset.lazy"],
    )
    # a path the first (truncated) walk did not reach proves nothing; nor does a global first seen later
    partial = start._replace(complete=False)
    assert drawn(partial, after) == (["dataset.a", "dataset.b", "global:numpy"], ["dataset.b"])


def test_snapshot_keeps_objects_and_knows_when_it_was_cut_short() -> None:
    from dlwatch.inproc.rngcheck import MAX_NODES, snapshot

    class DS:
        def __init__(self) -> None:
            self.rng = random.Random(0)

    ds = DS()
    snap = snapshot(ds)
    assert snap.complete and snap.objects == {"dataset.rng": ds.rng}
    assert snap.prints == fingerprint(ds)

    class Holder:
        def __init__(self) -> None:
            self.__dict__.update({f"a{i}": DS() for i in range(10)})

    class Big:
        def __init__(self) -> None:
            self.parts = [Holder() for _ in range(32)]  # 1 + 32 + 320 objects > MAX_NODES
            self.rng = random.Random(0)

    assert 1 + 32 + 320 > MAX_NODES and not snapshot(Big()).complete


def test_judge_needs_a_stream_drawn_from_and_alike_after_the_first_batch() -> None:
    start = [fp(101, 0, 1, dataset_rng="s"), fp(102, 1, 1, dataset_rng="s")]
    # identical at the start, never drawn from (used in __init__ only): quiet
    assert judge(
        start
        + [fp(101, 0, 1, "after_first_batch", dataset_rng="s"), fp(102, 1, 1, "after_first_batch", dataset_rng="s")]
    ) == ([], [])
    # drawn from, ending apart (re-created per item, or seeded in the worker): quiet
    assert judge(
        start
        + [
            fp(101, 0, 1, "after_first_batch", ("dataset.rng",), ("dataset.rng",), dataset_rng="x"),
            fp(102, 1, 1, "after_first_batch", ("dataset.rng",), ("dataset.rng",), dataset_rng="y"),
        ]
    ) == ([], [])
    # drawn from, alike: duplicated
    dups, repeats = judge(
        start
        + [
            fp(101, 0, 1, "after_first_batch", ("dataset.rng",), dataset_rng="t"),
            fp(102, 1, 1, "after_first_batch", ("dataset.rng",), dataset_rng="t"),
        ]
    )
    assert dups == [{"attribute": "dataset.rng", "workers": [0, 1], "kind": "object", "epoch": 1}]
    assert repeats == []
    # the start alone (events from an older dlwatch) proves nothing
    assert judge(start) == ([], [])


def test_judge_repeats_across_generations_of_one_worker_id() -> None:
    gen1 = [
        fp(101, 0, 1, global__numpy="s0"),
        fp(101, 0, 1, "after_first_batch", ("global:numpy",), global__numpy="t0"),
    ]
    again = fp(201, 0, 2, global__numpy="s0")
    assert judge(gen1 + [again]) == (
        [],
        [{"attribute": "global:numpy", "workers": [0], "epochs": [1, 2], "kind": "global"}],
    )
    # torch's own per-epoch seed: a new start state, quiet
    assert judge(gen1 + [fp(201, 0, 2, global__numpy="s1")]) == ([], [])
    # the same worker process (persistent workers) is one generation: quiet
    assert judge(gen1 + [fp(101, 0, 1, global__numpy="s0")]) == ([], [])
    # not drawn from in the previous generation (a validation loader seeded alike): quiet
    idle = [fp(101, 0, 1, global__numpy="s0"), fp(101, 0, 1, "after_first_batch", global__numpy="s0")]
    assert judge(idle + [again]) == ([], [])
    # re-created per item (rebound): by design the same per index, quiet
    per_item = [
        fp(101, 0, 1, dataset_rng="i"),
        fp(101, 0, 1, "after_first_batch", ("dataset.rng",), ("dataset.rng",), dataset_rng="j"),
    ]
    assert judge(per_item + [fp(201, 0, 2, dataset_rng="i")]) == ([], [])
    # without epoch stamps the generations are counted by pid
    unstamped = [dict(e) for e in gen1 + [again]]
    for e in unstamped:
        e.pop("epoch")
    assert judge(unstamped)[1] == [
        {"attribute": "global:numpy", "workers": [0], "generations": [1, 2], "kind": "global"}
    ]


def test_detector_waits_for_the_whole_generation_then_names_every_worker() -> None:
    from dlwatch.detect.base import View
    from dlwatch.detect.rng import EVIDENCE_WAIT_S, RngDuplication

    def view(now: float, workers: int = 3) -> View:
        return View(
            now=now, procs={}, loader={"num_workers": workers}, loader_pids=frozenset(), system=None, heartbeat=None
        )

    det = RngDuplication()
    for w in range(3):
        assert list(det.on_event(fp(100 + w, w, 1, dataset_rng="s"), view(1.0))) == []
    for w in range(2):
        assert (
            list(det.on_event(fp(100 + w, w, 1, "after_first_batch", ("dataset.rng",), dataset_rng="t"), view(2.0)))
            == []
        )
    assert list(det.on_poll(view(2.0 + EVIDENCE_WAIT_S / 2))) == []  # worker 2 not in yet
    (sig,) = det.on_event(fp(102, 2, 1, "after_first_batch", ("dataset.rng",), dataset_rng="t"), view(3.0))
    assert sig["event"] == "rng_duplicate" and sig["duplicates"][0]["workers"] == [0, 1, 2]
    assert (
        list(det.on_event(fp(102, 2, 1, "after_first_batch", ("dataset.rng",), dataset_rng="t"), view(3.5))) == []
    )  # handed back once

    # a worker that never gets a batch: the signal comes after the wait, or at the block's end
    for flush in ("poll", "stop"):
        det = RngDuplication()
        for w in range(3):
            det.on_event(fp(100 + w, w, 1, dataset_rng="s"), view(1.0))
        for w in range(2):
            det.on_event(fp(100 + w, w, 1, "after_first_batch", ("dataset.rng",), dataset_rng="t"), view(2.0))
        if flush == "poll":
            (sig,) = det.on_poll(view(2.0 + EVIDENCE_WAIT_S))
        else:
            (sig,) = det.on_event({"event": "stop"}, view(2.1))
        assert sig["duplicates"][0]["workers"] == [0, 1]


class GlobalReseededPerItem(Dataset):
    """np.random.seed(index) in __getitem__: deterministic per sample, through the global generator."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        np.random.seed(1000 + i)
        return torch.tensor([i, int(np.random.randint(0, 1 << 30))])


def test_watch_global_reseeded_per_item_is_quiet(tmp_path, no_leftovers) -> None:
    seen, events, reports = watched_epochs(tmp_path, DataLoader(GlobalReseededPerItem(), batch_size=4, num_workers=2))
    assert seen[0] == seen[1]
    assert_quiet(events, reports)  # each epoch's workers start where torch seeded them: apart
    assert all("global:numpy" in e["drawn"] for e in after_batch(events).values())


class MaskingTokenizer:
    """An NLP habit: the tokenizer masks tokens at random, re-seeding per item from the index."""

    def __init__(self) -> None:
        self.rng = random.Random(0)

    def mask(self, i: int) -> int:
        self.rng = random.Random(i)
        return self.rng.randrange(512)


class MaskedText(Dataset):
    def __init__(self) -> None:
        self.tokenizer = MaskingTokenizer()

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, self.tokenizer.mask(i)])


def test_watch_generator_under_a_secret_looking_name_is_judged_on_its_real_state(tmp_path, no_leftovers) -> None:
    # "tokenizer" is a secret-looking name to the redactor: the hashes must not all become '***'
    _, events, reports = watched_epochs(tmp_path, DataLoader(MaskedText(), batch_size=4, num_workers=2))
    assert_quiet(events, reports)
    after = after_batch(events)
    for epoch in (1, 2):  # real hashes, apart in the two workers (the same items every epoch: no shuffle)
        assert (
            fingerprints_of(after[epoch, 0])["dataset.tokenizer.rng"]
            != fingerprints_of(after[epoch, 1])["dataset.tokenizer.rng"]
        )
    # and a duplicated stream under such a name is still caught (its hash was '***' in every worker before)
    shared = MaskedText()
    shared.tokenizer.mask = lambda i: shared.tokenizer.rng.randrange(512)  # draws, no longer re-seeds
    _, _, reports = watched_epochs(tmp_path / "dup", DataLoader(shared, batch_size=4, num_workers=2))
    assert [d["attribute"] for d in reports[0]["findings"][0]["evidence"]["duplicates"]] == ["dataset.tokenizer.rng"]


class Stream(torch.utils.data.IterableDataset):
    """A streaming dataset sharded by worker; noise from a generator made in __init__ or in __iter__."""

    def __init__(self, seed_in_worker: bool) -> None:
        self.seed_in_worker = seed_in_worker
        self.rng = np.random.default_rng(0)

    def __iter__(self) -> Any:
        info = get_worker_info()
        if self.seed_in_worker:
            self.rng = np.random.default_rng(info.seed)
        for i in range(info.id, N, info.num_workers):
            yield torch.tensor([i, int(self.rng.integers(0, 1 << 30))])


def test_watch_iterable_dataset_unbatched(tmp_path, no_leftovers) -> None:
    # batch_size=None: torch's collate_fn is default_convert, called per sample
    _, events, reports = watched_epochs(tmp_path / "ok", DataLoader(Stream(True), batch_size=None, num_workers=2))
    assert_quiet(events, reports)
    assert len(after_batch(events)) == 4
    _, _, reports = watched_epochs(tmp_path / "bug", DataLoader(Stream(False), batch_size=None, num_workers=2))
    top = reports[0]["findings"][0]
    assert top["playbook"] == "rng-duplication"
    assert [d["attribute"] for d in top["evidence"]["duplicates"]] == ["dataset.rng"]


def test_fingerprints_of_prefers_the_unredacted_states() -> None:
    from dlwatch.detect.rng import fingerprints_of

    ev = {
        "fingerprints": {"dataset.tokenizer.rng": "***", "dataset.rng": "a"},
        "states": [["dataset.tokenizer.rng", "b"], ["dataset.rng", "a"]],
    }
    assert fingerprints_of(ev) == {"dataset.tokenizer.rng": "b", "dataset.rng": "a"}
    ev.pop("states")  # an older event: a masked hash says nothing about the state
    assert fingerprints_of(ev) == {"dataset.rng": "a"}
    assert fingerprints_of({"fingerprints": None}) is None
