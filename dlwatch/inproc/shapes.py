"""The batch shape probe: did a collate_fn concatenate samples where it meant to stack them?

Runs in the training loop's hot path, so it costs almost nothing: the caller asks
:meth:`BatchShapeProbe.next_check` (a few integer comparisons) and calls
:meth:`~BatchShapeProbe.check` only on the first ``check_first`` batches of each
epoch and then one in ``sample_every`` (and on every batch while a suspicion is
open, see below).  It never imports torch: anything with a ``.shape`` (torch
tensors, numpy arrays) is a tensor here.  The walk over nested dicts, tuples and
lists is bounded in depth and in leaves.

The rule
--------
``torch.cat`` of B same-shaped samples ``(C, H, W)`` gives ``(B*C, H, W)``: a
leading dimension that is an exact multiple ``k*B`` (k >= 2), with the *same* k in
every batch, because k is a per-sample dimension (channels).  Leading dimensions
that differ from B are otherwise normal: real collates join samples on purpose
(detection targets ``(N, 6)`` with a batch-index column, graph node features
``(N, F)``, packed sequences ``(1, T)`` with ``cu_seqlens`` of length B+1, a
pre-batched dataset with ``batch_size=1``, the partial last batch of every
IterableDataset worker, a collate that drops bad samples).  So a batch is judged
only when its sample count n is known, and a leaf is a *suspect* only when:

- n is at least 2, and it is proved by an *anchor*: another leaf whose leading
  dimension is the expected batch size (e.g. labels of length B), or the leaf is
  the batch's only tensor (n is then the expected batch size);
- no 1-D leaf has length n+1: such a leaf is an offsets vector (``cu_seqlens``,
  PyG's ``ptr``), which only a collate that joins samples on purpose builds;
- no 1-D leaf is a batch-assignment vector: integers, non-decreasing, from 0 to n-1,
  of a length that is a multiple of n (PyG's ``batch``: which sample each node or point
  came from).  Graphs and point clouds whose samples all have the same number of nodes
  or points concatenate ``(B*N, F)`` features next to it, on purpose;
- its leading dimension is ``k*n`` for a whole k >= 2.

A finding needs the same leaf with the same k in ``confirm_batches`` judged
batches in a row (8 by default; the probe checks every batch while a suspicion is
open, so that is the first 8 batches of a run that has the bug).  A judged batch
whose sample count is proved (an anchor, or a known number of batches, or
``drop_last``) in which that leaf is *not* a multiple of n with that k clears the
leaf for the run: its leading dimension varies with the data, so it is joined on
purpose.  Detection targets with varying counts per image, graph node counts and
packed token counts clear within a few batches, or never become suspects.

Time-major batches (``(T, B, ...)``: ``pad_sequence`` without ``batch_first``) have
the batch in dim 1, so their leading dimension says nothing about concatenation.  A
tensor is taken as time-major, and left out, only when something marks it: the
loader's collate says ``batch_first=False`` (an attribute of a collator object, or a
keyword bound with ``functools.partial``; :func:`marks_time_major`), or the batch
holds a lengths vector for it: a 1-D integer leaf of length B whose largest value is
T (padding to the longest), or whose dict key names lengths (``lengths``,
``seq_len``, ...) with every value in ``[0, T]``.  The shape alone marks nothing: a
``(12, 4, 4)`` leaf next to 4 labels (three 4x4 images per sample, concatenated) has
B in dim 1 too.  A fixed-length time-major batch with neither mark (``(512, 8)``
tokens next to 8 labels) looks like the bug; leave its key out (below).

What the rule cannot tell apart, and why: a leaf that is a constant multiple of B
by design (two augmented views concatenated, ``(2B, C, H, W)`` next to B labels;
exactly the same number of boxes in every image) has the very shapes of the bug.
Leave such a key out of the check with ``ignore=["batch-dim-mismatch:KEY"]``.

Leaving keys out (``ignore_keys``)
----------------------------------
A KEY names a leaf, or everything below it, in one of three ways:

- a dict key, ``boxes``: matches ``batch['boxes']`` at any depth (and a non-string
  dict key by its ``str``);
- a whole number, ``1``: matches the top-level position ``batch[1]`` of a tuple or
  list batch (and a dict key ``1`` or ``'1'``);
- a full path as the evidence prints it, ``batch['targets'][0]``: exactly that one
  (double quotes are accepted for single ones).

A returned dict is the evidence of a ``batch_shape`` signal; the agent emits it
as ``{"event": "threshold", **evidence}`` once per run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

__all__ = ["BatchShapeProbe", "IgnoreKeys", "batch_nbytes", "leaves", "marks_time_major"]

CHECK_FIRST = 8
SAMPLE_EVERY = 64
CONFIRM_BATCHES = 8  # judged batches in a row with the same multiple before a finding
# The failure this probe finds, and the thresholds it reads from that playbook (these are the defaults):
# the watch reads them for it (dlwatch.inproc.agent.settings) and leaves the probe out when the id is ignored.
PLAYBOOK = "batch-dim-mismatch"
THRESHOLDS = {"check_first": CHECK_FIRST, "sample_every": SAMPLE_EVERY, "confirm_batches": CONFIRM_BATCHES}
MAX_DEPTH = 4
MAX_LEAVES = 64
MAX_CLEARED = 1024  # leaves remembered as cleared (a batch whose dict keys change every time stays bounded)
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


@dataclass(frozen=True)
class IgnoreKeys:
    """Keys of a batch left out of the check (see the module docstring for how a KEY names a leaf)."""

    names: frozenset[str] = frozenset()  # dict keys, at any depth
    indexes: frozenset[int] = frozenset()  # top-level positions
    paths: frozenset[str] = frozenset()  # full paths, "batch['a'][0]"

    @classmethod
    def parse(cls, keys: Iterable[str]) -> "IgnoreKeys":
        names, indexes, paths = set(), set(), set()
        for key in keys:
            key = str(key).strip()
            if not key:
                continue
            if key.startswith("batch[") and key.endswith("]"):
                paths.add(key.replace('"', "'"))
                continue
            names.add(key)
            if key.isascii() and key.isdigit():
                indexes.add(int(key))
        return cls(frozenset(names), frozenset(indexes), frozenset(paths))

    def __bool__(self) -> bool:
        return bool(self.names or self.indexes or self.paths)

    def skips_key(self, key: Any, path: str) -> bool:
        return str(key) in self.names or path in self.paths

    def skips_index(self, index: int, path: str, depth: int) -> bool:
        return (depth == 0 and index in self.indexes) or path in self.paths


_NO_IGNORE = IgnoreKeys()


def leaves(
    batch: Any,
    expected: int,
    batch_size: int,
    max_depth: int = MAX_DEPTH,
    max_leaves: int = MAX_LEAVES,
    ignore: IgnoreKeys = _NO_IGNORE,
    time_major: bool = False,
    vectors_out: dict[str, Any] | None = None,
) -> list[tuple[str, tuple[int, ...]]]:
    """(path, shape) of the tensors in ``batch`` whose leading dimension is the batch dimension.

    Skipped, because their leading dimension is not the batch's: 0-d tensors,
    time-major tensors (dim 1 is the batch) when something marks them (``time_major``:
    the collate says so; or a lengths vector for them in the batch; see the module
    docstring), per-sample sequences (a list of one tensor per sample, as
    detection-style ``collate_fn=lambda b: tuple(zip(*b))`` returns), and whatever
    ``ignore`` names.  ``vectors_out``, when given, receives the 1-D leaves themselves by path
    (the probe reads a few values of those that could be batch-assignment vectors).
    """
    out: list[tuple[str, tuple[int, ...]]] = []
    sizes = {expected, batch_size}
    # (index in out, T) of leaves shaped like time-major ones: dropped below only if marked
    candidates: list[tuple[int, int]] = []
    vectors: list[tuple[Any, Any]] = []  # (dict key or None, tensor) of 1-D leaves of a batch size

    def visit(obj: Any, path: str, depth: int, key: Any = None) -> None:
        if len(out) >= max_leaves:
            return
        shape = _shape(obj)
        if shape is not None:
            if len(shape) == 0:
                return
            if len(shape) >= 2 and shape[0] not in sizes and shape[1] in sizes:
                if time_major:
                    return  # the collate says dim 1 is the batch
                candidates.append((len(out), shape[0]))
            elif len(shape) == 1 and shape[0] in sizes:
                vectors.append((key, obj))
            if len(shape) == 1 and vectors_out is not None:
                vectors_out[path] = obj
            out.append((path, shape))
            return
        if depth >= max_depth:
            return
        if isinstance(obj, Mapping):
            for i, (k, v) in enumerate(obj.items()):
                if i >= max_leaves:
                    break
                sub = f"{path}[{k!r}]"
                if ignore and ignore.skips_key(k, sub):
                    continue
                visit(v, sub, depth + 1, k)
        elif isinstance(obj, (list, tuple)):
            if _is_per_sample(obj, depth, sizes):
                return
            for i, v in enumerate(obj[:max_leaves]):
                sub = f"{path}[{i}]"
                if ignore and ignore.skips_index(i, sub, depth):
                    continue
                visit(v, sub, depth + 1)
        # anything else (str, int, None, custom objects) carries no batch dimension we can read

    try:
        visit(batch, "batch", 0)
    finally:
        # visit refers to itself through its closure: a reference cycle that would keep the batch's
        # tensors (and every container in here) alive until the garbage collector ran, and would add to
        # the training process's collector counts at each checked batch
        visit = None  # type: ignore[assignment]
    if candidates and vectors:
        spans = [span for span in (_lengths_span(key, obj) for key, obj in vectors) if span is not None]
        marked = {i for i, t in candidates if any(high == t or named and high <= t for high, named in spans)}
        if marked:
            out = [leaf for i, leaf in enumerate(out) if i not in marked]
    return out


def _is_batch_vector(obj: Any, n: int) -> bool:
    """Whether a 1-D tensor says which of n samples each row came from: integers, non-decreasing,
    from 0 to n-1 (``torch.repeat_interleave(torch.arange(n), sizes)``).  Three reductions of one
    vector, only in a judged batch that holds a multiple-of-n 1-D leaf; never raises."""
    try:
        if "int" not in str(getattr(obj, "dtype", "")):
            return False
        if int(obj.min()) != 0 or int(obj.max()) != n - 1:
            return False
        return bool((obj[1:] >= obj[:-1]).all())
    except Exception:  # an odd tensor: no proof of a deliberate join
        return False


_LENGTHS_WORD = "len"  # lengths, lens, seq_len, src_lengths, ...


def _lengths_span(key: Any, obj: Any) -> tuple[int, bool] | None:
    """(largest value, whether its dict key says lengths) of a 1-D integer tensor with no negative
    value, which could be sequence lengths; else None.  Reads two values of a small (B,) tensor,
    only in a batch that holds a time-major look-alike."""
    try:
        if "int" not in str(getattr(obj, "dtype", "")):
            return None
        low, high = int(obj.min()), int(obj.max())
    except Exception:  # an odd or unreadable tensor: no lengths we can tell
        return None
    if low < 0:
        return None
    return high, isinstance(key, str) and _LENGTHS_WORD in key.lower()


def marks_time_major(collate_fn: Any) -> bool:
    """Whether a collate says its batches are time-major: ``batch_first=False`` as an attribute
    (a collator object) or as a keyword bound with ``functools.partial``, on it or on what it
    wraps (``func``, ``user_fn``).  Never raises."""
    fn = collate_fn
    try:
        for _ in range(4):
            if fn is None:
                return False
            if getattr(fn, "batch_first", None) is False:
                return True
            keywords = getattr(fn, "keywords", None)
            if isinstance(keywords, Mapping) and keywords.get("batch_first") is False:
                return True
            fn = getattr(fn, "func", None) or getattr(fn, "user_fn", None)
    except Exception:  # a collate object whose attributes raise: no mark
        return False
    return False


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
    finally:
        visit = None  # type: ignore[assignment]  # a self-referring closure: no cycle left behind (see leaves)
    return total


@dataclass
class _Suspect:
    """One leaf whose leading dimension was k × the sample count in consecutive judged batches."""

    k: int
    count: int
    evidence: dict[str, Any] = field(default_factory=dict)  # of the first batch of the streak


class BatchShapeProbe:
    """Checks the leading dimensions of sampled batches; reports the first concatenated leaf.

    ``index`` is the batch's index within the current epoch (0 for the first batch
    of each ``iter(loader)``).  ``dataset_len`` is the number of samples per epoch
    as the sampler yields them: pass ``len(loader.sampler)`` when it has one (a
    DistributedSampler gives each rank only its share).  It predicts the size of
    the last batch.  ``ignore_keys`` leaves keys of the batch out of the check
    (see the module docstring for how a key names a leaf).  ``time_major``: the
    collate says its batches are time-major (:func:`marks_time_major`).  The rule, and what it
    stays quiet on, is in the module docstring.
    """

    def __init__(
        self,
        batch_size: int | None,
        drop_last: bool,
        dataset_len: int | None = None,
        collate_fn_name: str = "",
        *,
        check_first: int = CHECK_FIRST,
        sample_every: int = SAMPLE_EVERY,
        confirm_batches: int = CONFIRM_BATCHES,
        ignore_keys: tuple[str, ...] = (),
        time_major: bool = False,
    ) -> None:
        self.batch_size = batch_size if isinstance(batch_size, int) and batch_size > 0 else None
        self.drop_last = bool(drop_last)
        self.dataset_len = dataset_len if isinstance(dataset_len, int) and dataset_len >= 0 else None
        self.collate_fn_name = collate_fn_name
        self.check_first = max(0, int(check_first))
        self.sample_every = max(1, int(sample_every))
        self.confirm_batches = max(1, int(confirm_batches))
        self.ignore_keys = tuple(str(k) for k in ignore_keys)
        self._ignore = IgnoreKeys.parse(self.ignore_keys)
        self.time_major = bool(time_major)
        self.found = False  # one finding per run is enough: stop checking after it
        self._suspects: dict[str, _Suspect] = {}
        self._cleared: set[str] = set()  # leaves whose leading dimension varies with the data
        self._maybe_last: tuple[int, tuple[str, ...]] | None = None  # (index, leaves) of a possibly-last batch
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

    @property
    def suspicious(self) -> bool:
        """A suspicion is open (or a possibly-last batch waits for the next): check every batch."""
        return bool(self._suspects) or self._maybe_last is not None

    def should_check(self, index: int) -> bool:
        if self.batch_size is None or self.found:
            return False
        if index < self.check_first or index % self.sample_every == 0 or self.suspicious:
            return True
        return self.num_batches is not None and index == self.num_batches - 1

    def next_check(self, index: int) -> int:
        """The first batch index >= ``index`` that ``should_check`` accepts; -1 for none.

        The hot path asks this once per checked batch instead of calling should_check on
        every batch (a Python call costs as much as the rest of the per-batch work).
        """
        if self.batch_size is None or self.found:
            return -1
        if index < self.check_first or self.suspicious:
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
        """Evidence for a concatenated leaf, confirmed; or None.  Never raises."""
        if self.batch_size is None or self.found:
            return None
        try:
            return self._check(batch, index)
        except Exception:
            return None

    def _check(self, batch: Any, index: int) -> dict[str, Any] | None:
        assert self.batch_size is not None
        same_epoch = index > self._last_index
        self._last_index = index
        if self._maybe_last is not None:
            at, paths = self._maybe_last
            self._maybe_last = None
            if same_epoch and index > at:  # it was not the last batch: its sizes were real
                self._clear(paths)
        expected = self.expected(index)
        one_d: dict[str, Any] = {}
        found = leaves(
            batch,
            expected or self.batch_size,
            self.batch_size,
            ignore=self._ignore,
            time_major=self.time_major,
            vectors_out=one_d,
        )
        if not found:
            return None
        dims = {path: shape[0] for path, shape in found}
        n, anchored = self._sample_count(found, expected)
        if n is None:
            return None  # the sample count is not proved: nothing to judge against
        if any(len(shape) == 1 and shape[0] == n + 1 for _, shape in found):
            return None  # an offsets vector (cu_seqlens, ptr): samples joined on purpose
        if any(
            dims[path] > n and dims[path] % n == 0 and _is_batch_vector(obj, n)
            for path, obj in one_d.items()
            if path not in self._cleared
        ):
            return None  # a batch-assignment vector (PyG's batch): samples joined on purpose
        proved = anchored or self.drop_last or self.num_batches is not None
        evidence: dict[str, Any] | None = None
        unproved: list[str] = []
        for path, lead in dims.items():
            if path in self._cleared:
                continue
            k, rem = divmod(lead, n)
            suspect = self._suspects.get(path)
            if rem == 0 and k >= 2:
                if suspect is not None and suspect.k == k:
                    suspect.count += 1
                else:
                    reason = "inconsistent_leading_dims" if anchored else "leading_dim_mismatch"
                    suspect = self._suspects[path] = _Suspect(
                        k,
                        1,
                        {
                            **self._evidence(found, index, expected),
                            "reason": reason,
                            "leaf": path,
                            "multiple": k,
                            "sample_count": n,
                        },
                    )
                if suspect.count >= self.confirm_batches and evidence is None:
                    evidence = {**suspect.evidence, "confirmed_batches": suspect.count, "confirmed_at_index": index}
            elif proved:
                self._clear((path,))
            elif suspect is not None and lead > suspect.k * n:
                self._clear((path,))  # a partial last batch is smaller, never larger
            elif suspect is not None:
                unproved.append(path)
        if unproved:
            self._maybe_last = (index, tuple(unproved))
        if evidence is not None:
            return self._found(evidence)
        return None

    def _sample_count(self, found: list[tuple[str, tuple[int, ...]]], expected: int | None) -> tuple[int | None, bool]:
        """(n, anchored): the batch's proved sample count, and whether a leaf of that length proves it."""
        leads = [shape[0] for _, shape in found]
        for n in (expected, self.batch_size):
            if n is not None and n >= 2 and n in leads and len(leads) > 1:
                return n, True
        if len(leads) == 1:
            n = expected if expected is not None else self.batch_size
            if n is not None and n >= 2:
                return n, False
        return None, False

    def _clear(self, paths: Iterable[str]) -> None:
        for p in paths:
            self._suspects.pop(p, None)
            if len(self._cleared) < MAX_CLEARED:
                self._cleared.add(p)

    def end_epoch(self) -> None:
        """The epoch ended: a batch that might have been its last was."""
        self._maybe_last = None
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
            "ignored_keys": list(self.ignore_keys),
        }

    def _found(self, evidence: dict[str, Any]) -> dict[str, Any]:
        self.found = True
        self._suspects.clear()
        self._maybe_last = None
        return evidence
