"""The batch shape probe: cat-instead-of-stack, last partial batches, nested batches, cost."""

from __future__ import annotations

import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from dlwatch.shapes import BatchShapeProbe, batch_nbytes, leaves


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


def test_cat_collate_is_found_on_first_batch() -> None:
    probe = BatchShapeProbe(4, False, dataset_len=40, collate_fn_name="train.cat_collate")
    ev = probe.check(catted(4), 0)
    assert ev is not None
    assert ev["reason"] == "inconsistent_leading_dims"
    assert ev["shapes"] == {"batch[0]": [12, 8, 8], "batch[1]": [4]}
    assert ev["leading_dims"] == {"batch[0]": 12, "batch[1]": 4}
    assert ev["expected_batch_size"] == 4 and ev["batch_index"] == 0 and ev["collate_fn"] == "train.cat_collate"
    assert ev["signal"] == "batch_shape"
    # one finding per run: the probe stops
    assert not probe.should_check(1) and probe.check(catted(4), 1) is None


def test_single_tensor_wrong_leading_dim() -> None:
    probe = BatchShapeProbe(4, True)
    ev = probe.check(torch.zeros(12, 8), 0)
    assert ev["reason"] == "leading_dim_mismatch" and ev["leading_dims"] == {"batch": 12}


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


def test_small_batch_mid_epoch_with_known_len() -> None:
    probe = BatchShapeProbe(4, False, dataset_len=40)
    assert probe.check(stacked(3), 4) is None  # pending: only the next batch can tell
    ev = probe.check(stacked(4), 5)
    assert ev["reason"] == "small_batch_not_last" and ev["batch_index"] == 4 and ev["is_last_batch"] is False


def test_larger_batch_on_the_last_index_is_found() -> None:
    probe = BatchShapeProbe(4, False, dataset_len=10)
    ev = probe.check(torch.zeros(6, 3), 2)
    assert ev["reason"] == "leading_dim_mismatch" and ev["expected_batch_size"] == 2 and ev["is_last_batch"] is True


def test_last_batch_checked_even_when_sparse() -> None:
    # 1000 batches, the last is partial; sampling would skip index 999 but the probe asks for it
    probe = BatchShapeProbe(4, False, dataset_len=3999, check_first=2, sample_every=64)
    assert probe.should_check(999) and not probe.should_check(998)


def test_small_batch_accepted_only_as_last_when_len_unknown() -> None:
    probe = BatchShapeProbe(4, False)
    # the small batch ends the epoch, then a new epoch starts at index 0: fine
    assert run(probe, [stacked(4), stacked(4), stacked(2)], only_sampled=False) is None
    assert probe.check(stacked(4), 0) is None
    # a small batch in the middle of an epoch is found when the next batch comes
    probe = BatchShapeProbe(4, False)
    assert probe.check(stacked(4), 0) is None
    assert probe.check(stacked(2), 1) is None
    assert probe.should_check(2)
    ev = probe.check(stacked(4), 2)
    assert ev is not None and ev["reason"] == "small_batch_not_last" and ev["batch_index"] == 1


def test_small_batch_pending_cleared_by_end_epoch() -> None:
    probe = BatchShapeProbe(4, False)
    probe.check(stacked(2), 5)
    probe.end_epoch()
    assert probe.check(stacked(4), 6) is None


def test_drop_last_rejects_small_batch_at_once() -> None:
    probe = BatchShapeProbe(4, True)
    assert probe.check(stacked(2), 3)["reason"] == "leading_dim_mismatch"


def test_one_sample_dataset() -> None:
    probe = BatchShapeProbe(4, False, dataset_len=1)
    assert probe.check(stacked(1), 0) is None


def test_nested_dicts_and_lists() -> None:
    probe = BatchShapeProbe(4, False)
    good = {"image": torch.zeros(4, 3, 8, 8), "meta": {"label": torch.zeros(4), "box": torch.zeros(4, 4)},
            "path": ["a", "b", "c", "d"], "aux": [torch.zeros(4, 2), torch.zeros(4, 5)]}
    assert probe.check(good, 0) is None
    bad = {"image": torch.zeros(12, 8, 8), "meta": {"label": torch.zeros(4)}}
    ev = probe.check(bad, 1)
    assert ev["leading_dims"] == {"batch['image']": 12, "batch['meta']['label']": 4}


def test_numpy_batches() -> None:
    probe = BatchShapeProbe(4, False)
    assert probe.check((np.zeros((4, 3)), np.zeros(4)), 0) is None
    assert probe.check((np.zeros((12,)), np.zeros(4)), 1)["reason"] == "inconsistent_leading_dims"


def test_not_flagged_layouts() -> None:
    # detection-style collate: tuples of per-sample tensors of varying size
    det = (tuple(torch.zeros(3, 10 + i, 12) for i in range(4)),
           tuple({"boxes": torch.zeros(i + 1, 4)} for i in range(4)))
    # time-major padded sequences (pad_sequence without batch_first) next to labels
    seq = (torch.zeros(37, 4, 16), torch.zeros(4))
    # scalars and strings ride along
    misc = {"x": torch.zeros(4, 2), "epoch": torch.tensor(3), "name": "run", "n": 7}
    # collate_fn=lambda b: b (a list of samples)
    raw = [(torch.zeros(3, 8, 8), 1) for _ in range(4)]
    probe = BatchShapeProbe(4, False)
    for i, b in enumerate([det, seq, misc, raw]):
        assert probe.check(b, i) is None, i


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
    code = "import sys, dlwatch.shapes; assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
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
        for epoch in range(2):
            found = None
            for i, batch in enumerate(loader):
                if probe.should_check(i):
                    found = found or probe.check(batch, i)
            if expect_found:
                assert found is not None and found["shapes"] == {"batch[0]": [12, 8, 8], "batch[1]": [4]}
                assert found["collate_fn"].endswith("cat_collate")
                break
            assert found is None


@pytest.mark.parametrize("check_first,every,n,drop_last", [(8, 64, 1000, False), (0, 1, 10, True), (3, 5, 37, False), (2, 7, None, False)])
def test_next_check_agrees_with_should_check(check_first, every, n, drop_last):
    from dlwatch.shapes import BatchShapeProbe

    probe = BatchShapeProbe(4, drop_last, n, check_first=check_first, sample_every=every)
    want = [i for i in range(300) if probe.should_check(i)]
    got, i = [], probe.next_check(0)
    while 0 <= i < 300:
        got.append(i)
        i = probe.next_check(i + 1)
    assert got == want
