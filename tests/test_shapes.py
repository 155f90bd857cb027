"""The batch shape probe: cat-instead-of-stack, last partial batches, nested batches, cost."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dlwatch.inproc.shapes import CONFIRM_BATCHES, BatchShapeProbe, IgnoreKeys, batch_nbytes, leaves, marks_time_major


def stacked(n: int, c: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n, c, 8, 8), torch.zeros(n, dtype=torch.long)


def catted(n: int, c: int = 3) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(n * c, 8, 8), torch.zeros(n, dtype=torch.long)


def run(probe: BatchShapeProbe, batches: list, *, only_sampled: bool = True) -> dict | None:
    for i, b in enumerate(batches):
        if only_sampled and not probe.should_check(i):
            continue
        ev = probe.check(b, i)
        if ev is not None:
            return ev
    return None


def test_cat_collate_is_found_once_confirmed() -> None:
    probe = BatchShapeProbe(4, False, dataset_len=40, collate_fn_name="train.cat_collate")
    assert CONFIRM_BATCHES == 8
    for i in range(CONFIRM_BATCHES - 1):
        assert probe.should_check(i) and probe.check(catted(4), i) is None
    ev = probe.check(catted(4), CONFIRM_BATCHES - 1)
    assert ev is not None
    assert ev["reason"] == "inconsistent_leading_dims"
    # the evidence is the first wrong batch
    assert ev["shapes"] == {"batch[0]": [12, 8, 8], "batch[1]": [4]}
    assert ev["leading_dims"] == {"batch[0]": 12, "batch[1]": 4}
    assert ev["expected_batch_size"] == 4 and ev["batch_index"] == 0 and ev["collate_fn"] == "train.cat_collate"
    assert ev["leaf"] == "batch[0]" and ev["multiple"] == 3 and ev["sample_count"] == 4
    assert ev["confirmed_batches"] == 8 and ev["confirmed_at_index"] == 7
    assert ev["signal"] == "batch_shape"
    assert not {"path", "event"} & set(ev)  # the agent sends it as events.emit(path, "batch_shape", **ev)
    # one finding per run: the probe stops
    assert not probe.should_check(8) and probe.check(catted(4), 8) is None


def _seed(layout: str, n: int, c: int = 3):
    images, labels = catted(n, c)
    return {"tuple": (images, labels), "dict": {"image": images, "label": labels}, "alone": images}[layout]


@pytest.mark.parametrize("layout", ["tuple", "dict", "alone"])
@pytest.mark.parametrize("dataset_len", [40, 38, None])
def test_seed_case_caught_in_every_layout(layout, dataset_len) -> None:
    """(B*C, H, W) next to B labels, in a tuple, a dict, or alone; with or without a partial last batch."""
    probe = BatchShapeProbe(4, False, dataset_len=dataset_len)
    sizes = [4] * 9 + [2 if dataset_len == 38 else 4]
    found = None
    for epoch in range(3):
        for i, n in enumerate(sizes):
            if probe.should_check(i):
                found = found or probe.check(_seed(layout, n), i)
        probe.end_epoch()
    assert found is not None
    assert found["batch_index"] == 0 and found["multiple"] == 3
    assert found["reason"] == ("leading_dim_mismatch" if layout == "alone" else "inconsistent_leading_dims")


def test_seed_case_alone_unknown_len_partial_last_batches() -> None:
    """Epochs of 3 batches (12, 12, 6 rows): the small last one neither confirms nor clears."""
    probe = BatchShapeProbe(4, False)
    found = None
    for epoch in range(4):
        for i, n in enumerate((4, 4, 2)):
            if probe.should_check(i):
                found = found or probe.check(_seed("alone", n), i)
    assert found is not None and found["leading_dims"] == {"batch": 12}


def test_single_tensor_wrong_leading_dim() -> None:
    probe = BatchShapeProbe(4, True)
    evs = [probe.check(torch.zeros(12, 8), i) for i in range(CONFIRM_BATCHES)]
    assert evs[:-1] == [None] * (CONFIRM_BATCHES - 1)
    assert evs[-1]["reason"] == "leading_dim_mismatch" and evs[-1]["leading_dims"] == {"batch": 12}


def test_healthy_epoch_with_last_partial_batch_known_len() -> None:
    # 10 samples, batch 4: 4, 4, 2
    probe = BatchShapeProbe(4, False, dataset_len=10)
    assert run(probe, [stacked(4), stacked(4), stacked(2)], only_sampled=False) is None
    assert probe.expected(2) == 2 and probe.expected(1) == 4


def test_wrong_dataset_len_costs_no_false_alarm() -> None:
    # the agent may pass len(dataset) while a subset sampler yields 10 samples: 4, 4, 2
    probe = BatchShapeProbe(4, False, dataset_len=1000)
    assert run(probe, [stacked(4), stacked(4), stacked(2)], only_sampled=False) is None
    probe.end_epoch()
    # a sampler with replacement yielding more than len(dataset): full batches at the "last" index
    probe = BatchShapeProbe(4, False, dataset_len=10)
    assert run(probe, [stacked(4)] * 5, only_sampled=False) is None


def test_small_batches_are_never_a_finding() -> None:
    """Smaller batches are not torch.cat: IterableDataset workers each end with a partial batch, a
    collate drops bad samples; every tensor agrees on the smaller size."""
    for dataset_len, drop_last in ((40, False), (None, False), (None, True), (40, True)):
        probe = BatchShapeProbe(4, drop_last, dataset_len=dataset_len)
        sizes = [4, 4, 3, 4, 2, 2, 4, 1, 4, 4]
        for i, n in enumerate(sizes * 3):
            assert probe.check(stacked(n), i) is None, (dataset_len, drop_last, i)
        probe = BatchShapeProbe(4, drop_last, dataset_len=dataset_len)
        for i, n in enumerate(sizes * 3):
            assert probe.check(torch.zeros(n, 5), i) is None, (dataset_len, drop_last, i)


def test_larger_batch_that_all_tensors_agree_on() -> None:
    # a collate that appends flipped copies of every sample: (2B, ...) images and 2B labels
    probe = BatchShapeProbe(4, False, dataset_len=40)
    for i in range(20):
        assert probe.check(stacked(8), i) is None


def test_last_batch_checked_even_when_sparse() -> None:
    # 1000 batches, the last is partial; sampling would skip index 999 but the probe asks for it
    probe = BatchShapeProbe(4, False, dataset_len=3999, check_first=2, sample_every=64)
    assert probe.should_check(999) and not probe.should_check(998)


def test_every_batch_checked_while_suspicious() -> None:
    probe = BatchShapeProbe(4, False, dataset_len=4000, check_first=2, sample_every=64)
    assert probe.next_check(2) == 64
    assert probe.check(catted(4), 64) is None  # a suspicion opens
    assert probe.suspicious and probe.next_check(65) == 65 and probe.should_check(65)
    assert probe.check(stacked(4), 65) is None  # the leaf had B rows: it varies, cleared
    assert not probe.suspicious and probe.next_check(66) == 128


def test_one_sample_dataset() -> None:
    probe = BatchShapeProbe(4, False, dataset_len=1)
    assert probe.check(stacked(1), 0) is None


def test_nested_dicts_and_lists() -> None:
    probe = BatchShapeProbe(4, False)
    good = {
        "image": torch.zeros(4, 3, 8, 8),
        "meta": {"label": torch.zeros(4), "box": torch.zeros(4, 4)},
        "path": ["a", "b", "c", "d"],
        "aux": [torch.zeros(4, 2), torch.zeros(4, 5)],
    }
    assert probe.check(good, 0) is None
    bad = {"image": torch.zeros(12, 8, 8), "meta": {"label": torch.zeros(4)}}
    ev = run(BatchShapeProbe(4, False), [bad] * CONFIRM_BATCHES, only_sampled=False)
    assert ev["leading_dims"] == {"batch['image']": 12, "batch['meta']['label']": 4}


def test_numpy_batches() -> None:
    probe = BatchShapeProbe(4, False)
    assert probe.check((np.zeros((4, 3)), np.zeros(4)), 0) is None
    bad = (np.zeros((12,)), np.zeros(4))
    assert run(BatchShapeProbe(4, False), [bad] * CONFIRM_BATCHES)["reason"] == "inconsistent_leading_dims"


def test_not_flagged_layouts() -> None:
    # detection-style collate: tuples of per-sample tensors of varying size
    det = (
        tuple(torch.zeros(3, 10 + i, 12) for i in range(4)),
        tuple({"boxes": torch.zeros(i + 1, 4)} for i in range(4)),
    )
    # time-major padded sequences (pad_sequence without batch_first) next to their lengths
    seq = (torch.zeros(36, 4, 16), torch.tensor([36, 20, 9, 31]))
    # scalars and strings ride along
    misc = {"x": torch.zeros(4, 2), "epoch": torch.tensor(3), "name": "run", "n": 7}
    # collate_fn=lambda b: b (a list of samples)
    raw = [(torch.zeros(3, 8, 8), 1) for _ in range(4)]
    probe = BatchShapeProbe(4, False)
    for i, b in enumerate([det, seq, misc, raw]):
        assert probe.check(b, i) is None, i


# --------------------------------------------------------------------------- time-major: only when marked


def images_in_dim0(n: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """Three 4x4 images per sample, concatenated: (3n, 4, 4), dim 1 equal to the batch size by chance."""
    return torch.zeros(3 * n, 4, 4), torch.tensor([1, 0, 3, 2][:n])


def test_dim1_equal_to_the_batch_size_is_no_excuse_without_a_mark() -> None:
    """(12, 4, 4) next to 4 labels: dim 1 is the batch size, yet nothing says time-major."""
    assert leaves(images_in_dim0(), 4, 4) == [("batch[0]", (12, 4, 4)), ("batch[1]", (4,))]
    ev = run(BatchShapeProbe(4, False), [images_in_dim0()] * CONFIRM_BATCHES)
    assert ev is not None and ev["leaf"] == "batch[0]" and ev["multiple"] == 3
    # a labels vector is no lengths vector: float, negative, or largest value not T (and not named so)
    for labels in (torch.tensor([12.0, 1.0, 2.0, 3.0]), torch.tensor([12, -1, 2, 3]), torch.tensor([11, 1, 2, 3])):
        assert [p for p, _ in leaves((torch.zeros(12, 4, 4), labels), 4, 4)] == ["batch[0]", "batch[1]"], labels


def test_a_lengths_vector_marks_time_major() -> None:
    # pad_sequence pads to the longest: the largest length is T
    batch = (torch.zeros(12, 4, dtype=torch.long), torch.tensor([12, 3, 7, 5]))
    assert leaves(batch, 4, 4) == [("batch[1]", (4,))]
    assert run(BatchShapeProbe(4, False), [batch] * 20) is None
    # padded to a fixed length: a key that says lengths, every value within T
    fixed = {
        "src": torch.zeros(16, 4, 8),
        "src_lengths": torch.tensor([3, 9, 16, 2], dtype=torch.int32),
        "label": torch.tensor([0, 1, 1, 0]),
    }
    assert [p for p, _ in leaves(fixed, 4, 4)] == ["batch['src_lengths']", "batch['label']"]
    assert run(BatchShapeProbe(4, False), [fixed] * 20) is None
    # a named lengths vector longer than T is not this tensor's
    fixed["src_lengths"] = torch.tensor([3, 9, 17, 2])
    assert "batch['src']" in [p for p, _ in leaves(fixed, 4, 4)]
    # numpy works the same (anything with .shape, .dtype, .min(), .max())
    assert leaves((np.zeros((12, 4)), np.array([12, 3, 7, 5])), 4, 4) == [("batch[1]", (4,))]


def test_a_batch_first_false_collate_marks_time_major() -> None:
    import functools

    def collate(samples, batch_first=True):
        return samples

    class Collator:
        batch_first = False

        def __call__(self, samples):
            return samples

    assert marks_time_major(functools.partial(collate, batch_first=False))
    assert marks_time_major(Collator())
    assert marks_time_major(functools.partial(functools.partial(collate, batch_first=False), 1))
    for fn in (collate, functools.partial(collate, batch_first=True), None, len, object()):
        assert not marks_time_major(fn), fn

    class Hostile:
        def __getattr__(self, name):
            raise RuntimeError("no")

    assert not marks_time_major(Hostile())
    tokens = (torch.zeros(12, 4, dtype=torch.long), torch.tensor([1, 0, 3, 2]))  # fixed T, labels, no lengths
    assert run(BatchShapeProbe(4, False, time_major=True), [tokens] * 20) is None
    assert run(BatchShapeProbe(4, False), [tokens] * 20)["leaf"] == "batch[0]"  # the same batch, unmarked


def _yolo(counts: list[int]) -> tuple:
    """YOLO-style collate: images stacked, targets (sum of boxes, 6) = [batch index, class, box]."""
    return torch.zeros(len(counts), 3, 16, 16), torch.zeros(sum(counts), 6), [f"img{i}.jpg" for i in counts]


def _ultralytics(counts: list[int]) -> dict:
    n = sum(counts)
    return {
        "img": torch.zeros(len(counts), 3, 16, 16),
        "batch_idx": torch.zeros(n),
        "cls": torch.zeros(n, 1),
        "bboxes": torch.zeros(n, 4),
        "im_file": [f"{i}.jpg" for i in counts],
        "ori_shape": [(16, 16)] * len(counts),
    }


def _packed(lengths: list[int]) -> dict:
    t = sum(lengths)
    return {
        "input_ids": torch.zeros(1, t, dtype=torch.long),
        "position_ids": torch.zeros(1, t, dtype=torch.long),
        "labels": torch.zeros(1, t, dtype=torch.long),
        "cu_seqlens": torch.zeros(len(lengths) + 1),
        "max_seqlen": max(lengths),
    }


def _graph(nodes: list[int], *, ptr: bool = True) -> dict:
    n = sum(nodes)
    g = {
        "x": torch.zeros(n, 7),
        "edge_index": torch.zeros(2, 3 * n, dtype=torch.long),
        "batch": torch.zeros(n, dtype=torch.long),
        "y": torch.zeros(len(nodes)),
    }
    if ptr:
        g["ptr"] = torch.zeros(len(nodes) + 1, dtype=torch.long)
    return g


# boxes per image over 12 batches of 4: the first three batches total 8 boxes each (a multiple of 4, k=2)
COUNTS = [
    [2, 2, 2, 2],
    [1, 3, 2, 2],
    [4, 0, 2, 2],
    [2, 2, 2, 3],
    [0, 1, 5, 2],
    [2, 2, 2, 2],
    [3, 3, 3, 3],
    [1, 1, 1, 1],
    [2, 2, 2, 2],
    [7, 1, 0, 0],
    [2, 2, 2, 2],
    [2, 2, 2, 2],
]


@pytest.mark.parametrize(
    "make",
    [_yolo, _ultralytics, _packed, _graph, lambda c: _graph(c, ptr=False)],
    ids=["yolo", "ultralytics", "packed", "graph", "graph-no-ptr"],
)
@pytest.mark.parametrize("dataset_len", [48, None])
def test_batches_that_join_samples_on_purpose(make, dataset_len) -> None:
    probe = BatchShapeProbe(4, False, dataset_len=dataset_len)
    for epoch in range(3):
        for i, counts in enumerate(COUNTS):
            assert probe.check(make(counts), i) is None, (epoch, i)
    assert not probe.found


def test_coincidence_then_variation_clears_the_leaf() -> None:
    probe = BatchShapeProbe(4, False)
    for i in range(3):
        probe.check(_yolo([2, 2, 2, 2]), i)  # targets (8, 6) next to 4 images: a suspect, k=2
    assert probe.suspicious
    probe.check(_yolo([2, 2, 2, 3]), 3)  # 9 rows: the count follows the data
    assert not probe.suspicious and "batch[1]" in probe._cleared
    for i in range(4, 40):
        assert probe.check(_yolo([2, 2, 2, 2]), i) is None


def test_pre_batched_dataset_batch_size_one() -> None:
    # batch_size=1, collate_fn=lambda b: b[0]: each "sample" is already a batch of 64
    probe = BatchShapeProbe(1, False, dataset_len=10)
    for i in range(30):
        assert probe.check((torch.zeros(64, 3, 8, 8), torch.zeros(64)), i % 10) is None
        assert probe.check(torch.zeros(64, 3, 8, 8), i % 10) is None


def test_padded_variable_length_batches() -> None:
    probe = BatchShapeProbe(4, False)
    for i, length in enumerate([8, 12, 16, 24, 32, 8, 4, 12] * 3):
        hf = {
            "input_ids": torch.zeros(4, length),
            "attention_mask": torch.zeros(4, length),
            "labels": torch.zeros(4, length),
        }  # token classification pads labels too
        assert probe.check(hf, i) is None
        assert probe.check((torch.zeros(length, 4, 16), torch.zeros(4), torch.tensor([length] * 4)), i) is None


def test_constant_multiple_by_design_needs_an_ignore_key() -> None:
    """Two augmented views concatenated, (2B, C, H, W) next to B labels: the shapes of the bug."""
    batch = {"views": torch.zeros(8, 3, 8, 8), "label": torch.zeros(4)}
    assert run(BatchShapeProbe(4, False), [batch] * 20)["leaf"] == "batch['views']"
    probe = BatchShapeProbe(4, False, ignore_keys=("views",))
    assert run(probe, [batch] * 20, only_sampled=False) is None


def test_ignore_keys_name_leaves_three_ways() -> None:
    nested = {"images": torch.zeros(4, 3, 8, 8), "targets": {"boxes": torch.zeros(12, 4), "labels": torch.zeros(4)}}
    keys = lambda b, ign: [p for p, _ in leaves(b, 4, 4, ignore=IgnoreKeys.parse(ign))]  # noqa: E731
    assert keys(nested, ["boxes"]) == ["batch['images']", "batch['targets']['labels']"]  # at any depth
    assert keys(nested, ["targets"]) == ["batch['images']"]  # a whole subtree
    assert keys(nested, ["batch['targets']['boxes']"]) == ["batch['images']", "batch['targets']['labels']"]
    assert keys(nested, ['batch["targets"]["boxes"]']) == ["batch['images']", "batch['targets']['labels']"]
    assert keys(nested, ["batch['boxes']"]) == keys(nested, [])  # a full path must be the full path
    flat = (torch.zeros(12, 8, 8), torch.zeros(4), (torch.zeros(4), torch.zeros(4, 2)))
    assert keys(flat, ["0"]) == ["batch[1]", "batch[2][0]", "batch[2][1]"]  # a top-level position
    assert keys(flat, ["1"]) == ["batch[0]", "batch[2][0]", "batch[2][1]"]  # not batch[2][1]: top level only
    assert keys(flat, ["batch[2][1]"]) == ["batch[0]", "batch[1]", "batch[2][0]"]
    assert keys({1: torch.zeros(4), "a": torch.zeros(4)}, ["1"]) == ["batch['a']"]  # a dict key by its str


def test_ignored_key_leaves_the_others_checked() -> None:
    batch = {"image": torch.zeros(12, 8, 8), "label": torch.zeros(4), "boxes": torch.zeros(8, 4)}
    ev = run(BatchShapeProbe(4, False, ignore_keys=("boxes",)), [batch] * 10, only_sampled=False)
    assert ev["leaf"] == "batch['image']" and "batch['boxes']" not in ev["shapes"]
    assert ev["ignored_keys"] == ["boxes"]


def test_batch_size_none_skips() -> None:
    probe = BatchShapeProbe(None, False)
    assert not probe.should_check(0) and probe.check(torch.zeros(12), 0) is None and not probe.enabled


def test_sampling_schedule() -> None:
    probe = BatchShapeProbe(4, False, check_first=8, sample_every=64)
    checked = [i for i in range(1000) if probe.should_check(i)]
    assert checked[:8] == list(range(8)) and 64 in checked and 65 not in checked
    assert len(checked) == 8 + len(range(64, 1000, 64))


def test_check_never_raises() -> None:
    class Weird:
        @property
        def shape(self) -> tuple:
            raise RuntimeError("no")

    probe = BatchShapeProbe(4, False)
    assert probe.check(Weird(), 0) is None
    assert probe.check((Weird(), torch.zeros(4)), 1) is None


def test_bounded_walk() -> None:
    deep: object = torch.zeros(12)
    for _ in range(50):
        deep = [deep, 1]
    assert leaves(deep, 4, 4) == []  # below max depth: not reached, not a recursion error
    wide = {str(i): torch.zeros(4) for i in range(10_000)}
    assert len(leaves(wide, 4, 4)) == 64


def test_cost_is_small() -> None:
    probe = BatchShapeProbe(32, False, check_first=8, sample_every=64)
    batch = {"x": torch.zeros(32, 3, 4, 4), "y": torch.zeros(32), "m": {"a": torch.zeros(32, 2)}}
    n = 20_000
    t0 = time.perf_counter()
    for i in range(n):
        if probe.should_check(i):
            probe.check(batch, i)
    per_batch = (time.perf_counter() - t0) / n
    assert per_batch < 20e-6, per_batch  # generous on a loaded 2-core box; typically < 1 µs
    t0 = time.perf_counter()
    for i in range(200):
        probe.check(batch, 0)
    assert (time.perf_counter() - t0) / 200 < 500e-6


def test_batch_nbytes() -> None:
    assert batch_nbytes((torch.zeros(4, 3, dtype=torch.float32), np.zeros(4, dtype=np.int64), "x")) == 48 + 32


def test_module_does_not_import_torch() -> None:
    code = "import sys, dlwatch.inproc.shapes; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_real_dataloader_cat_vs_stack() -> None:
    from torch.utils.data import DataLoader, TensorDataset

    ds = TensorDataset(torch.zeros(10, 3, 8, 8), torch.zeros(10, dtype=torch.long))

    def cat_collate(samples: list) -> tuple:
        return torch.cat([s[0] for s in samples]), torch.stack([s[1] for s in samples])

    for collate, expect_found in ((None, False), (cat_collate, True)):
        loader = DataLoader(ds, batch_size=4, collate_fn=collate)
        name = f"{cat_collate.__module__}.{cat_collate.__qualname__}" if collate else "default_collate"
        probe = BatchShapeProbe(loader.batch_size, loader.drop_last, len(loader.sampler), name)
        found = None
        for epoch in range(4):  # 3 batches an epoch (4, 4, 2): confirmed in the third epoch
            for i, batch in enumerate(loader):
                if probe.should_check(i):
                    found = found or probe.check(batch, i)
        if expect_found:
            assert found is not None and found["shapes"] == {"batch[0]": [12, 8, 8], "batch[1]": [4]}
            assert found["collate_fn"].endswith("cat_collate")
        else:
            assert found is None


@pytest.mark.parametrize(
    "check_first,every,n,drop_last", [(8, 64, 1000, False), (0, 1, 10, True), (3, 5, 37, False), (2, 7, None, False)]
)
def test_next_check_agrees_with_should_check(check_first, every, n, drop_last):
    from dlwatch.inproc.shapes import BatchShapeProbe

    probe = BatchShapeProbe(4, drop_last, n, check_first=check_first, sample_every=every)
    want = [i for i in range(300) if probe.should_check(i)]
    got, i = [], probe.next_check(0)
    while 0 <= i < 300:
        got.append(i)
        i = probe.next_check(i + 1)
    assert got == want


def test_the_walks_leave_no_reference_cycle_behind():
    """leaves() and batch_nbytes() recurse through a nested function: once they return, nothing of theirs
    (the closure, the batch's tensors) waits for the garbage collector, in the training process's every
    checked batch.  Watched with the collector's DEBUG_SAVEALL: whatever only the collector could free
    lands in gc.garbage."""
    import gc

    batch = {"image": torch.zeros(4, 3, 2, 2), "meta": [torch.zeros(4), {"ids": torch.arange(4)}], "n": 4}
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        found = leaves(batch, 4, 4, vectors_out={})
        nbytes = batch_nbytes(batch)
        gc.collect()
        garbage = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        if enabled:
            gc.enable()
    assert [path for path, _ in found] == ["batch['image']", "batch['meta'][0]", "batch['meta'][1]['ids']"]
    assert nbytes == 4 * 3 * 2 * 2 * 4 + 4 * 4 + 4 * 8
    assert garbage == [], sorted({type(o).__name__ for o in garbage})
