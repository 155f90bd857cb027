"""The batch shape probe: does each batch's leading dimension match the loader's batch_size?

Runs in the training loop's hot path, so it costs almost nothing: the caller asks
:meth:`BatchShapeProbe.should_check` (a few integer comparisons) and calls
:meth:`~BatchShapeProbe.check` only on the first ``check_first`` batches of each
epoch and then one in ``sample_every``.  It never imports torch: anything with a
``.shape`` (torch tensors, numpy arrays) is a tensor here.  The walk over nested
dicts, tuples and lists is bounded in depth and in leaves.

A returned dict is the evidence of a ``batch_shape`` signal; the agent emits it
as ``{"event": "threshold", **evidence}`` once per run.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = ["BatchShapeProbe", "batch_nbytes", "leaves"]

CHECK_FIRST = 8
SAMPLE_EVERY = 64
MAX_DEPTH = 4
MAX_LEAVES = 64
_PER_SAMPLE_MIN = 4  # a top-level sequence this long (== batch size) is a list of samples, not fields


def _shape(obj: Any) -> tuple[int, ...] | None:
    if isinstance(obj, (str, bytes, Mapping, list, tuple)):
        return None
    shape = getattr(obj, "shape", None)
    if shape is None:
        return None
    try:
        dims = tuple(int(d) for d in shape)
    except Exception:  # symbolic or odd shapes: not a tensor we can judge
        return None
    return dims


def leaves(batch: Any, expected: int, batch_size: int, max_depth: int = MAX_DEPTH,
           max_leaves: int = MAX_LEAVES) -> list[tuple[str, tuple[int, ...]]]:
    """(path, shape) of the tensors in ``batch`` whose leading dimension is the batch dimension.

    Skipped, because their leading dimension is not the batch's: 0-d tensors,
    time-major tensors (dim 1 is the batch, e.g. ``pad_sequence`` without
    ``batch_first``), and per-sample sequences (a list of one tensor per sample,
    as detection-style ``collate_fn=lambda b: tuple(zip(*b))`` returns).
    """
    out: list[tuple[str, tuple[int, ...]]] = []
    sizes = {expected, batch_size}

    def visit(obj: Any, path: str, depth: int) -> None:
        if len(out) >= max_leaves:
            return
        shape = _shape(obj)
        if shape is not None:
            if len(shape) == 0:
                return
            if len(shape) >= 2 and shape[0] not in sizes and shape[1] in sizes:
                return  # time-major
            out.append((path, shape))
            return
        if depth >= max_depth:
            return
        if isinstance(obj, Mapping):
            for i, (k, v) in enumerate(obj.items()):
                if i >= max_leaves:
                    break
                visit(v, f"{path}[{k!r}]", depth + 1)
        elif isinstance(obj, (list, tuple)):
            if _is_per_sample(obj, depth, sizes):
                return
            for i, v in enumerate(obj[:max_leaves]):
                visit(v, f"{path}[{i}]", depth + 1)
        # anything else (str, int, None, custom objects) carries no batch dimension we can read

    visit(batch, "batch", 0)
    return out


def _is_per_sample(seq: Any, depth: int, sizes: set[int]) -> bool:
    n = len(seq)
    if n == 0:
        return True
    if n in sizes and (depth >= 1 or n >= _PER_SAMPLE_MIN):
        return True
    if all(isinstance(x, (Mapping, list, tuple)) for x in seq):
        return depth >= 1 or n in sizes  # default_collate never nests samples in a list
    if depth >= 1:
        dims = [s[0] for s in (_shape(x) for x in seq) if s]
        if len(set(dims)) > 1:  # default_collate gives one batch dim; varying dims are per-sample items
            return True
    return False


def batch_nbytes(batch: Any, max_depth: int = MAX_DEPTH, max_leaves: int = MAX_LEAVES) -> int:
    """Bytes of the tensors in a batch (``.nbytes``, or numel × element size); bounded walk."""
    total = 0
    count = 0

    def visit(obj: Any, depth: int) -> None:
        nonlocal total, count
        if count >= max_leaves or depth > max_depth:
            return
        if _shape(obj) is not None:
            count += 1
            n = getattr(obj, "nbytes", None)
            if n is None:
                try:
                    n = obj.numel() * obj.element_size()
                except Exception:
                    n = 0
            total += int(n or 0)
        elif isinstance(obj, Mapping):
            for v in list(obj.values())[:max_leaves]:
                visit(v, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for v in obj[:max_leaves]:
                visit(v, depth + 1)

    try:
        visit(batch, 0)
    except Exception:
        return total
    return total


class BatchShapeProbe:
    """Checks the leading dimensions of sampled batches; reports the first wrong one.

    ``index`` is the batch's index within the current epoch (0 for the first batch
    of each ``iter(loader)``).  ``dataset_len`` is the number of samples per epoch
    as the sampler yields them: pass ``len(loader.sampler)`` when it has one (a
    DistributedSampler gives each rank only its share).  It predicts the size of
    the last batch; a smaller batch of any other size is accepted only if it turns
    out to be the last of its epoch (no later batch in the same epoch), so a
    ``dataset_len`` that is not what the sampler yields costs no false alarm.
    A tensor with more rows than ``batch_size``, or tensors that disagree on
    their leading dimension, are found at once.
    """

    def __init__(self, batch_size: int | None, drop_last: bool, dataset_len: int | None = None,
                 collate_fn_name: str = "", *, check_first: int = CHECK_FIRST,
                 sample_every: int = SAMPLE_EVERY) -> None:
        self.batch_size = batch_size if isinstance(batch_size, int) and batch_size > 0 else None
        self.drop_last = bool(drop_last)
        self.dataset_len = dataset_len if isinstance(dataset_len, int) and dataset_len >= 0 else None
        self.collate_fn_name = collate_fn_name
        self.check_first = max(0, int(check_first))
        self.sample_every = max(1, int(sample_every))
        self.found = False  # one finding per run is enough: stop checking after it
        self._pending: dict[str, Any] | None = None  # a small batch that must prove to be the last
        self._last_index = -1
        self.num_batches: int | None = None
        self.last_size: int | None = None
        if self.batch_size and self.dataset_len is not None:
            if self.drop_last:
                self.num_batches = self.dataset_len // self.batch_size
                self.last_size = self.batch_size
            else:
                self.num_batches = -(-self.dataset_len // self.batch_size)
                self.last_size = self.dataset_len - self.batch_size * (self.num_batches - 1) if self.num_batches else 0

    @property
    def enabled(self) -> bool:
        return self.batch_size is not None and not self.found

    def should_check(self, index: int) -> bool:
        if self.batch_size is None or self.found:
            return False
        if index < self.check_first or index % self.sample_every == 0:
            return True
        if self._pending is not None:
            return True  # the batch after a small one decides whether it was the last
        return self.num_batches is not None and index == self.num_batches - 1

    def next_check(self, index: int) -> int:
        """The first batch index >= ``index`` that ``should_check`` accepts; -1 for none.

        The hot path asks this once per checked batch instead of calling should_check on
        every batch (a Python call costs as much as the rest of the per-batch work).
        """
        if self.batch_size is None or self.found:
            return -1
        if index < self.check_first or self._pending is not None:
            return index
        every = self.sample_every
        nxt = -(-index // every) * every
        if self.num_batches is not None and index <= self.num_batches - 1 < nxt:
            nxt = self.num_batches - 1
        return nxt

    def expected(self, index: int) -> int | None:
        """The leading dimension batch ``index`` must have; None when only the epoch's end can tell."""
        if self.batch_size is None:
            return None
        if self.num_batches is not None and index == self.num_batches - 1:
            return self.last_size
        return self.batch_size

    def check(self, batch: Any, index: int) -> dict[str, Any] | None:
        """Evidence for a wrong batch, or None.  Never raises."""
        if self.batch_size is None or self.found:
            return None
        try:
            return self._check(batch, index)
        except Exception:
            return None

    def _check(self, batch: Any, index: int) -> dict[str, Any] | None:
        assert self.batch_size is not None
        if index <= self._last_index:  # a new epoch: a pending small batch was the last of the old one
            self._pending = None
        self._last_index = index
        if self._pending is not None and index > self._pending["batch_index"]:
            pending, self._pending = self._pending, None
            return self._found(pending)
        expected = self.expected(index)
        found = leaves(batch, expected or self.batch_size, self.batch_size)
        if not found:
            return None
        dims = {path: shape[0] for path, shape in found}
        distinct = set(dims.values())
        evidence = self._evidence(found, index, expected)
        if len(distinct) > 1:
            return self._found({**evidence, "reason": "inconsistent_leading_dims"})
        (lead,) = distinct
        if lead == expected or lead == self.batch_size:
            # a full batch is never wrong: a sampler may yield more samples than len(dataset)
            return None
        if lead < self.batch_size and not self.drop_last:
            # could be the last batch of the epoch (dataset_len may not be what the sampler
            # yields: a subset or distributed sampler); only a later batch of this epoch can tell
            self._pending = {**evidence, "reason": "small_batch_not_last"}
            return None
        return self._found({**evidence, "reason": "leading_dim_mismatch"})

    def end_epoch(self) -> None:
        """The epoch ended: a pending smaller batch was its last, and fine."""
        self._pending = None
        self._last_index = -1

    def _evidence(self, found: list[tuple[str, tuple[int, ...]]], index: int, expected: int | None) -> dict[str, Any]:
        return {
            "signal": "batch_shape",
            "batch_index": index,
            "batch_size": self.batch_size,
            "expected_batch_size": expected if expected is not None else self.batch_size,
            "shapes": {path: list(shape) for path, shape in found},
            "leading_dims": {path: shape[0] for path, shape in found},
            "collate_fn": self.collate_fn_name,
            "drop_last": self.drop_last,
            "dataset_len": self.dataset_len,
            "is_last_batch": (index == self.num_batches - 1) if self.num_batches is not None else None,
        }

    def _found(self, evidence: dict[str, Any]) -> dict[str, Any]:
        self.found = True
        return evidence
