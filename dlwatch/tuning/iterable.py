"""The IterableDataset rule: more workers must not mean the same samples more than once.

Every worker iterates its own copy of an IterableDataset; unless ``__iter__`` shards by
``torch.utils.data.get_worker_info()``, N workers yield every sample N times.  The tune looks
before it varies ``num_workers``: it fingerprints the samples of the first batches with no
workers and with two, and compares how often a sample repeats.  Two workers that repeat each
other's samples (about half of them, where one stream repeats none) duplicate data: the search
is restricted to ``num_workers`` 0 and 1, and says why.  Random augmentation can hide that (two
copies of the same sample differ), so when two workers look distinct a second look seeds every
worker's ``random``, numpy and torch generators alike: samples that repeat then differ only by
their seeds, which a dataset that does not shard cannot tell apart from one that only generates
random data, so the search is restricted too unless the caller vouches for the dataset
(``iterable_ok=True``, ``--iterable-ok``).

A sample's fingerprint is a hash of its row of every tensor and array in the batch (and of
its item in a collated list), so batches of any size compare sample by sample.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

PROBE_BATCHES = 8
DUP_MARGIN = 0.25  # two workers' repeat share over one stream's: duplication (unsharded: about 0.5)
MAX_LEAVES = 256


def _leaves(obj: Any, depth: int = 0) -> Iterator[Any]:
    if depth > 6:
        yield obj
        return
    if isinstance(obj, dict):
        for k in obj:
            yield from _leaves(obj[k], depth + 1)
    elif isinstance(obj, (list, tuple)) and not _is_row_list(obj):
        for v in obj:
            yield from _leaves(v, depth + 1)
    else:
        yield obj


def _is_row_list(obj: Any) -> bool:
    """A collated list of plain items (strings, numbers): one item per sample."""
    return bool(obj) and all(isinstance(v, (str, bytes, int, float)) for v in obj)


def _rows_of(leaf: Any) -> int | None:
    shape = getattr(leaf, "shape", None)
    if shape is not None and len(shape) >= 1:
        return int(shape[0])
    if isinstance(leaf, (list, tuple)) and _is_row_list(leaf):
        return len(leaf)
    return None


def _bytes(leaf: Any) -> bytes:
    if hasattr(leaf, "detach") and hasattr(leaf, "cpu"):  # a torch tensor
        t = leaf.detach().cpu().contiguous()
        return f"{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes() if _numpy_ok(t) else repr(t).encode()
    if hasattr(leaf, "tobytes") and hasattr(leaf, "dtype"):  # a numpy array or scalar
        return f"{leaf.dtype}{getattr(leaf, 'shape', ())}".encode() + leaf.tobytes()
    return repr(leaf).encode("utf-8", "replace")


def _numpy_ok(t: Any) -> bool:
    try:
        t.numpy()
        return True
    except Exception:  # bfloat16 and other dtypes numpy has not
        return False


def fingerprint_rows(batch: Any) -> list[bytes]:
    """One fingerprint per sample of ``batch`` (16 bytes each); one for the whole batch if it has no rows."""
    leaves = list(_leaves(batch))[:MAX_LEAVES]
    counts = [n for n in (_rows_of(leaf) for leaf in leaves) if n]
    rows = max(set(counts), key=counts.count) if counts else 0
    if rows <= 0:
        h = hashlib.blake2b(digest_size=16)
        for leaf in leaves:
            h.update(_bytes(leaf))
        return [h.digest()]
    out = []
    for i in range(rows):
        h = hashlib.blake2b(digest_size=16)
        for leaf in leaves:
            if _rows_of(leaf) == rows:
                h.update(_bytes(leaf[i]))
            else:
                h.update(_bytes(leaf))
        out.append(h.digest())
    return out


def repeat_share(batches: Sequence[Sequence[bytes]]) -> float | None:
    """The share of samples that repeat an earlier one in the same stream."""
    flat = [fp for rows in batches for fp in rows]
    if len(flat) < 2:
        return None
    return 1.0 - len(set(flat)) / len(flat)


@dataclass(frozen=True)
class Verdict:
    duplicates: bool
    reason: str
    one_stream: float | None
    two_workers: float | None
    seeded: bool  # the repeats showed only with every worker seeded alike

    def to_dict(self) -> dict[str, Any]:
        return {
            "duplicates": self.duplicates,
            "reason": self.reason,
            "repeat_share_one_stream": self.one_stream,
            "repeat_share_two_workers": self.two_workers,
            "seeded_alike": self.seeded,
            "allowed_num_workers": [0, 1] if self.duplicates else None,
        }


def judge(
    dataset: str,
    one: Sequence[Sequence[bytes]],
    two: Sequence[Sequence[bytes]],
    *,
    seeded: bool,
    current_workers: int,
) -> Verdict | None:
    """Whether two workers repeat each other's samples; None when they do not (the dataset shards)."""
    a, b = repeat_share(one), repeat_share(two)
    if b is None:
        return Verdict(True, f"{dataset}: two workers yielded too few samples to compare", a, b, seeded)
    if a is not None and a >= 0.5:
        return Verdict(
            True,
            f"{dataset} repeats its own samples ({a:.0%} of the first batches): the tune cannot tell whether "
            "more workers duplicate them",
            a,
            b,
            seeded,
        )
    if b - (a or 0.0) < DUP_MARGIN:
        return None
    times = (
        f"; your num_workers={current_workers} yields each sample {current_workers} times"
        if current_workers > 1
        else ""
    )
    if seeded:
        reason = (
            f"{dataset} is an IterableDataset whose workers yield the same samples once their random "
            f"generators are seeded alike ({b:.0%} of two workers' samples repeat): it does not shard by "
            "torch.utils.data.get_worker_info(), or it only generates random data (then pass iterable_ok=True / "
            f"--iterable-ok){times}"
        )
    else:
        reason = (
            f"{dataset} is an IterableDataset that does not shard by torch.utils.data.get_worker_info(): "
            f"with two workers {b:.0%} of the samples repeat (one stream: {a or 0:.0%}), so every worker "
            f"yields the same data{times}"
        )
    return Verdict(True, reason, a, b, seeded)
