"""Batches that join samples on purpose stay quiet; torch.cat of same-shaped samples is still caught.

Every test runs a real DataLoader with real worker processes under ``dlwatch.watch``
and reads the run's own event log before the block ends: a healthy layout must give
no ``batch_shape`` event and no incident at all; the seed case (``(C, H, W)``
samples concatenated into ``(B*C, H, W)``) must give exactly one
``batch-dim-mismatch`` incident, in a tuple, a dict or alone, with nothing raised.
"""

from __future__ import annotations

import functools
import json
import os

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

import dlwatch
from conftest import incidents, load

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")

EPOCHS = 2


def watched_run(loader, report_dir, epochs: int = EPOCHS, **kw) -> tuple[int, list[dict], object]:
    """Iterate ``loader`` under watch; return (batches seen, the run's events, the shape probe)."""
    n = 0
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.1, **kw) as batches:
        for _ in range(epochs):
            for _batch in batches:
                n += 1
        probe = batches._probes.shape_probe
        with open(batches._session.events_path) as f:
            events = [json.loads(line) for line in f if line.strip()]
    return n, events, probe


def assert_quiet(report_dir, events, probe, *, probe_expected: bool = True) -> None:
    assert [e for e in events if e.get("event") == "batch_shape"] == []
    assert incidents(str(report_dir)) == []
    if probe_expected:
        assert probe is not None and not probe.found and probe._last_index >= 0  # it did check batches


# --------------------------------------------------------------------------- detection


class Detection(Dataset):
    """Images with a varying number of boxes (0 to 4), as a detection dataset returns them."""

    COUNTS = [2, 2, 2, 2, 1, 3, 2, 2, 0, 4, 2, 3, 2, 2, 2, 2, 4, 1, 0, 2, 3, 3, 1, 1]

    def __len__(self) -> int:
        return 48

    def __getitem__(self, i: int):
        n = self.COUNTS[i % len(self.COUNTS)]
        boxes = torch.rand(n, 4)
        classes = torch.full((n,), i % 5, dtype=torch.long)
        return torch.rand(3, 32, 32), {"boxes": boxes, "labels": classes}, f"img{i:04d}.jpg"


def yolo_collate(samples):
    """Images stacked; targets concatenated as rows of [image index in batch, class, x, y, w, h]."""
    images = torch.stack([s[0] for s in samples])
    targets = torch.cat(
        [
            torch.cat([torch.full((len(t["boxes"]), 1), float(b)), t["labels"][:, None].float(), t["boxes"]], dim=1)
            for b, (_, t, _) in enumerate(samples)
        ]
    )
    return images, targets, [s[2] for s in samples]


def ultralytics_collate(samples):
    """The dict layout of ultralytics' YOLO: one row per box in batch_idx, cls and bboxes."""
    images, targets, files = yolo_collate(samples)
    return {
        "img": images,
        "batch_idx": targets[:, 0],
        "cls": targets[:, 1:2],
        "bboxes": targets[:, 2:],
        "im_file": files,
        "ori_shape": [(32, 32)] * len(files),
    }


def torchvision_collate(samples):
    return tuple(zip(*samples))


@pytest.mark.parametrize("collate", [yolo_collate, ultralytics_collate, torchvision_collate])
def test_detection_targets_with_batch_index(collate, tmp_path, no_leftovers):
    # the first batch has 8 boxes for 4 images (a multiple of B, as a cat would give); later ones vary
    loader = DataLoader(Detection(), batch_size=4, num_workers=2, collate_fn=collate)
    n, events, probe = watched_run(loader, tmp_path)
    assert n == EPOCHS * 12
    assert_quiet(tmp_path, events, probe)


# --------------------------------------------------------------------------- packed sequences


class Sentences(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.arange(5 + (i * 7) % 11)  # token ids, 5 to 15 of them


def pack_collate(samples):
    """Padding-free packing (flash-attention varlen): one (1, T) row, cu_seqlens of length B+1."""
    lengths = torch.tensor([len(s) for s in samples], dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    input_ids = torch.cat(samples)[None]
    position_ids = torch.cat([torch.arange(len(s)) for s in samples])[None]
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "labels": input_ids.clone(),
        "cu_seqlens": cu_seqlens,
        "max_seqlen": int(lengths.max()),
    }


def test_packed_sequences(tmp_path, no_leftovers):
    loader = DataLoader(Sentences(), batch_size=4, num_workers=2, collate_fn=pack_collate)
    n, events, probe = watched_run(loader, tmp_path)
    assert n == EPOCHS * 10
    assert_quiet(tmp_path, events, probe)


# --------------------------------------------------------------------------- graphs


class Molecules(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        nodes = 4 + (i * 5) % 9
        ring = torch.arange(nodes)
        edges = torch.stack([ring, (ring + 1) % nodes])
        return {"x": torch.rand(nodes, 11), "edge_index": edges, "y": torch.tensor(float(i % 2))}


def graph_collate(samples):
    """The layout of a PyG Batch as a dict: node features concatenated, a batch vector and ptr."""
    sizes = torch.tensor([len(s["x"]) for s in samples])
    ptr = torch.nn.functional.pad(torch.cumsum(sizes, 0), (1, 0))
    return {
        "x": torch.cat([s["x"] for s in samples]),
        "edge_index": torch.cat([s["edge_index"] + ptr[b] for b, s in enumerate(samples)], dim=1),
        "batch": torch.repeat_interleave(torch.arange(len(samples)), sizes),
        "ptr": ptr,
        "y": torch.stack([s["y"] for s in samples]),
    }


def graph_collate_without_ptr(samples):
    batch = graph_collate(samples)
    del batch["ptr"]
    return batch


@pytest.mark.parametrize("collate", [graph_collate, graph_collate_without_ptr])
def test_graph_batches(collate, tmp_path, no_leftovers):
    loader = DataLoader(Molecules(), batch_size=4, num_workers=2, collate_fn=collate)
    n, events, probe = watched_run(loader, tmp_path)
    assert n == EPOCHS * 10
    assert_quiet(tmp_path, events, probe)


class PointClouds(Dataset):
    """Every sample has the same number of points (a fixed-size point cloud, a fixed mesh)."""

    POINTS = 64

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return {"pos": torch.rand(self.POINTS, 3), "y": torch.tensor(i % 5)}


def points_collate(samples, with_ptr=False):
    """PyG's layout for point clouds: (B*N, 3) positions next to the batch vector (and ptr)."""
    sizes = torch.tensor([len(s["pos"]) for s in samples])
    batch = {
        "pos": torch.cat([s["pos"] for s in samples]),
        "batch": torch.repeat_interleave(torch.arange(len(samples)), sizes),
        "y": torch.stack([s["y"] for s in samples]),
    }
    if with_ptr:
        batch["ptr"] = torch.nn.functional.pad(torch.cumsum(sizes, 0), (1, 0))
    return batch


@pytest.mark.parametrize("with_ptr", [False, True], ids=["batch-vector", "batch-vector-and-ptr"])
def test_fixed_size_point_clouds_with_a_batch_vector(with_ptr, tmp_path, no_leftovers):
    # every batch is (B*64, 3) next to B labels: the concatenation's shape exactly, made on purpose
    collate = functools.partial(points_collate, with_ptr=with_ptr)
    loader = DataLoader(PointClouds(), batch_size=4, num_workers=2, collate_fn=collate)
    n, events, probe = watched_run(loader, tmp_path)
    assert n == EPOCHS * 10
    assert_quiet(tmp_path, events, probe)


def cat_with_a_fake_batch_vector(samples):
    # the seed bug next to a 1-D integer leaf that is NOT a batch vector (it does not run 0..B-1)
    images = torch.cat([s[0] for s in samples])
    return images, torch.tensor([s[1] for s in samples]), torch.arange(len(images)) % 7


def test_a_vector_that_is_no_batch_vector_does_not_hide_the_seed_case(tmp_path, no_leftovers):
    loader = DataLoader(Images(), batch_size=4, num_workers=2, collate_fn=cat_with_a_fake_batch_vector)
    watched_run(loader, tmp_path)
    found = [r for r in (load(p) for p in incidents(tmp_path)) if r["findings"]]
    assert [r["findings"][0]["playbook"] for r in found] == ["batch-dim-mismatch"]


# --------------------------------------------------------------------------- pre-batched datasets


class Prebatched(Dataset):
    """Each item is already a batch of 64 (a sharded or cached dataset)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int):
        return torch.rand(64, 3, 8, 8), torch.arange(64)


def test_prebatched_batch_size_none(tmp_path, no_leftovers):
    loader = DataLoader(Prebatched(), batch_size=None, num_workers=2)
    n, events, probe = watched_run(loader, tmp_path)
    assert n == EPOCHS * 6
    assert_quiet(tmp_path, events, probe, probe_expected=False)  # no batch_size: nothing to check against


def test_prebatched_batch_size_one_first_item(tmp_path, no_leftovers):
    loader = DataLoader(Prebatched(), batch_size=1, num_workers=2, collate_fn=lambda b: b[0])
    n, events, probe = watched_run(loader, tmp_path)
    assert n == EPOCHS * 6
    assert_quiet(tmp_path, events, probe)


# --------------------------------------------------------------------------- IterableDataset


class Stream(IterableDataset):
    """Each worker streams its own shard of 10 samples: every worker ends with a batch of 2."""

    def __iter__(self):
        info = get_worker_info()
        wid = info.id if info is not None else 0
        for i in range(10):
            yield torch.rand(3, 8, 8), wid * 100 + i


def test_iterable_workers_end_with_partial_batches(tmp_path, no_leftovers):
    loader = DataLoader(Stream(), batch_size=4, num_workers=2)
    sizes: list[int] = []
    with dlwatch.watch(loader, report_dir=tmp_path, poll_interval=0.1) as batches:
        for _ in range(EPOCHS):
            sizes.extend(len(labels) for _, labels in batches)
        probe = batches._probes.shape_probe
        with open(batches._session.events_path) as f:
            events = [json.loads(line) for line in f if line.strip()]
    # torch interleaves the workers: 4, 4, 4, 4, 2, 2; the first partial batch is not the epoch's last
    assert sorted(sizes) == sorted([4, 4, 4, 4, 2, 2] * EPOCHS) and sizes[4] == 2
    assert_quiet(tmp_path, events, probe)


# --------------------------------------------------------------------------- padding


def pad_collate(samples):
    """DataCollatorWithPadding's dict: input_ids and attention_mask padded to the longest, labels (B,)."""
    longest = max(len(s) for s in samples)
    ids = torch.zeros(len(samples), longest, dtype=torch.long)
    mask = torch.zeros(len(samples), longest, dtype=torch.long)
    for b, s in enumerate(samples):
        ids[b, : len(s)] = s
        mask[b, : len(s)] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([len(s) % 2 for s in samples])}


def time_major_collate(samples):
    """pad_sequence without batch_first: (T, B) next to lengths (B,)."""
    return torch.nn.utils.rnn.pad_sequence(samples), torch.tensor([len(s) for s in samples])


@pytest.mark.parametrize("collate", [pad_collate, time_major_collate])
def test_padded_variable_length(collate, tmp_path, no_leftovers):
    loader = DataLoader(Sentences(), batch_size=4, num_workers=2, collate_fn=collate)
    n, events, probe = watched_run(loader, tmp_path)
    assert n == EPOCHS * 10
    assert_quiet(tmp_path, events, probe)


# --------------------------------------------------------------------------- the seed case


class Images(Dataset):
    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.full((3, 8, 8), float(i)), i


def cat_tuple(samples):
    return torch.cat([s[0] for s in samples]), torch.tensor([s[1] for s in samples])


def cat_dict(samples):
    images, labels = cat_tuple(samples)
    return {"image": images, "label": labels}


def cat_alone(samples):
    return torch.cat([s[0] for s in samples])


@pytest.mark.parametrize(
    "collate,path,others",
    [
        (cat_tuple, "batch[0]", {"batch[1]": [4]}),
        (cat_dict, "batch['image']", {"batch['label']": [4]}),
        (cat_alone, "batch", {}),
    ],
)
def test_seed_case_is_caught(collate, path, others, tmp_path, no_leftovers):
    loader = DataLoader(Images(), batch_size=4, num_workers=2, collate_fn=collate)
    n, events, probe = watched_run(loader, tmp_path, epochs=1)  # 10 batches: found in the first epoch
    assert n == 10
    shape_events = [e for e in events if e.get("event") == "batch_shape"]
    assert len(shape_events) == 1 and shape_events[0]["leaf"] == path
    (found,) = incidents(str(tmp_path))
    r = load(found)
    assert r["trigger"] == "threshold" and r["exception"] is None
    top = r["findings"][0]
    assert top["playbook"] == "batch-dim-mismatch"
    assert top["evidence"]["shapes"] == {path: [12, 8, 8], **others}
    assert top["evidence"]["batch_index"] == 0 and top["evidence"]["multiple"] == 3


# --------------------------------------------------------------------------- time-major, only when marked


class SmallImages(Dataset):
    """Three 4x4 images per sample (views, frames) and a class label."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.full((3, 4, 4), float(i)), i % 10


def test_images_whose_dim_1_equals_the_batch_size_are_caught(tmp_path, no_leftovers):
    """(12, 4, 4) next to 4 labels: dim 1 is the batch size by chance, nothing marks it time-major."""
    loader = DataLoader(SmallImages(), batch_size=4, num_workers=2, collate_fn=cat_tuple)
    n, events, probe = watched_run(loader, tmp_path, epochs=1)
    assert n == 10
    (found,) = incidents(str(tmp_path))
    top = load(found)["findings"][0]
    assert top["playbook"] == "batch-dim-mismatch"
    assert top["evidence"]["shapes"] == {"batch[0]": [12, 4, 4], "batch[1]": [4]}
    assert top["evidence"]["leaf"] == "batch[0]" and top["evidence"]["multiple"] == 3


class FixedLongest(Dataset):
    """Token ids, 2 to 12 of them; every batch of 4 holds one of 12, so T is always 12 = 3 x 4."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int):
        return torch.arange(12 if i % 4 == 0 else 2 + i % 9)


def time_major_with_lengths(samples):
    """An RNN batch: (T, B) from pad_sequence without batch_first, and lengths (B,)."""
    return torch.nn.utils.rnn.pad_sequence(samples), torch.tensor([len(s) for s in samples])


def time_major_with_labels(samples, batch_first=True):
    """(T, B) tokens padded to 12 (or (B, T)), next to (B,) labels: no lengths in the batch."""
    padded = torch.nn.utils.rnn.pad_sequence(
        [torch.nn.functional.pad(s, (0, 12 - len(s))) for s in samples], batch_first=batch_first
    )
    return padded, torch.tensor([len(s) % 2 for s in samples])


@pytest.mark.parametrize(
    "collate",
    [time_major_with_lengths, functools.partial(time_major_with_labels, batch_first=False)],
    ids=["lengths-vector", "batch_first-False-collate"],
)
def test_real_time_major_batches_stay_quiet(collate, tmp_path, no_leftovers):
    """A healthy look-alike: (12, 4) every batch, marked time-major by its lengths or by its collate."""
    loader = DataLoader(FixedLongest(), batch_size=4, num_workers=2, collate_fn=collate)
    first = next(iter(DataLoader(FixedLongest(), batch_size=4, collate_fn=collate)))
    assert tuple(first[0].shape) == (12, 4)  # the precondition: shaped exactly like the caught case
    n, events, probe = watched_run(loader, tmp_path)
    assert n == EPOCHS * 10
    assert_quiet(tmp_path, events, probe)


# --------------------------------------------------------------------------- the ignore option


def test_ignore_playbook_silences_the_seed_case(tmp_path, no_leftovers):
    loader = DataLoader(Images(), batch_size=4, num_workers=2, collate_fn=cat_tuple)
    n, events, probe = watched_run(loader, tmp_path, ignore=["batch-dim-mismatch"])
    assert n == EPOCHS * 10 and probe is None
    assert [e for e in events if e.get("event") == "batch_shape"] == []
    assert incidents(str(tmp_path)) == []


def test_ignore_from_the_environment(tmp_path, monkeypatch, no_leftovers):
    monkeypatch.setenv("DLWATCH_IGNORE", "rng-duplication, batch-dim-mismatch:0")
    loader = DataLoader(Images(), batch_size=4, num_workers=2, collate_fn=cat_tuple)
    n, events, probe = watched_run(loader, tmp_path)
    assert probe is not None and probe.ignore_keys == ("0",)
    assert_quiet(tmp_path, events, probe)


def test_unknown_ignore_id_raises_at_the_call(tmp_path, monkeypatch):
    loader = DataLoader(Images(), batch_size=4)
    with pytest.raises(ValueError, match="ignore names no known playbook: batch-dim-mismatches"):
        dlwatch.watch(loader, report_dir=tmp_path, ignore=["batch-dim-mismatches"])
    with pytest.raises(ValueError, match="only batch-dim-mismatch takes a key"):
        dlwatch.watch(loader, report_dir=tmp_path, ignore=["fd-exhaustion:boxes"])
    assert not os.path.exists(tmp_path / ".runs")  # nothing started
    # in the variable, the environment fails open (issue 29): one warning, the known ids still apply
    monkeypatch.setenv("DLWATCH_IGNORE", "shm-exhaustion,no-such-playbook")
    with pytest.warns(dlwatch.DlwatchWarning, match="DLWATCH_IGNORE names no known playbook: no-such-playbook"):
        w = dlwatch.watch(loader, report_dir=tmp_path)
    assert w.options.ignore == ("shm-exhaustion",)


def test_ignored_cat_key_is_quiet_and_other_keys_still_checked(tmp_path, no_leftovers):
    loader = DataLoader(Images(), batch_size=4, num_workers=2, collate_fn=cat_dict)
    n, events, probe = watched_run(loader, tmp_path, ignore=["batch-dim-mismatch:image"])
    assert_quiet(tmp_path, events, probe)

    def two_cats(samples):
        batch = cat_dict(samples)
        batch["depth"] = torch.cat([torch.zeros(2, 8, 8) for _ in samples])  # (4*2, 8, 8)
        return batch

    loader = DataLoader(Images(), batch_size=4, num_workers=2, collate_fn=two_cats)
    report_dir = tmp_path / "two"
    n, events, probe = watched_run(loader, report_dir, epochs=1, ignore=["batch-dim-mismatch:image"])
    (found,) = incidents(str(report_dir))
    ev = load(found)["findings"][0]["evidence"]
    assert ev["leaf"] == "batch['depth']" and ev["multiple"] == 2 and "batch['image']" not in ev["shapes"]
