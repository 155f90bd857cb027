"""RNG fingerprints: a short hash of each random generator's state, taken inside each worker.

The worker hook takes a :func:`snapshot` of the worker's copy of the dataset
after the user's ``worker_init_fn`` has run, and a second one after the worker's
first batch; :func:`drawn` compares the two (which generators the worker drew
from, which it bound anew), and the monitor's detector (``dlwatch.detect.rng``)
judges the streams across workers and across epochs.  Only hashes and attribute
paths leave the worker, never a state.

Runs inside DataLoader workers, so it is bounded (attribute depth, node count,
items per container), reads instance ``__dict__`` only (never calls properties,
which may do I/O), imports nothing (numpy.random and torch are looked at only where the worker already has them),
and never raises.
"""

from __future__ import annotations

import hashlib
import itertools
import random
import sys
from typing import Any, Mapping, NamedTuple

__all__ = ["Snapshot", "drawn", "duplicates", "fingerprint", "snapshot", "state_hash"]

# The failure these fingerprints find, and the threshold the training process reads from that playbook
# (the default here): how deep attributes are walked for generators.  The watch reads it for the check
# (dlwatch.inproc.agent.settings) and fingerprints nothing when the id is ignored.
PLAYBOOK = "rng-duplication"
ATTRIBUTE_DEPTH = 2
THRESHOLDS = {"attribute_depth": ATTRIBUTE_DEPTH}
MAX_NODES = 256  # objects visited per call
MAX_ATTRS = 64  # attributes read per object
MAX_ITEMS = 32  # items read per list, tuple or dict
_TRANSPARENT_ATTRS = ("transforms",)  # Compose(...).transforms does not count as a level
_LEAF_TYPES = (str, bytes, bytearray, int, float, complex, bool, type(None), range, memoryview)


class Snapshot(NamedTuple):
    """One look at a worker's generators: hashes, the generator objects themselves, and
    whether the walk saw everything (it stops at :data:`MAX_NODES`)."""

    prints: dict[str, str]  # attribute path -> state hash (globals included)
    objects: dict[str, Any]  # attribute path -> the generator object (dataset paths only)
    complete: bool


def fingerprint(dataset: Any, depth: int = 2) -> dict[str, str]:
    """Attribute path -> short hash of every RNG reachable from ``dataset``, plus the globals.

    Paths look like ``dataset.rng``, ``dataset.transform.transforms[0].rng`` or
    ``dataset.params["gen"]``; globals are ``global:random``, ``global:numpy`` and
    ``global:torch`` (numpy and torch only when already imported).
    """
    return snapshot(dataset, depth).prints


def snapshot(dataset: Any, depth: int = 2) -> Snapshot:
    """:func:`fingerprint`, keeping the generator objects (to tell a generator bound anew from
    one that advanced) and whether the bounded walk was complete.  Never raises."""
    out: dict[str, str] = {}
    objects: dict[str, Any] = {}
    budget = [0]
    complete = True
    try:
        _walk(dataset, "dataset", depth, out, set(), budget, objects)
    except Exception:  # a dataset whose attributes misbehave costs us coverage, never the worker
        complete = False
    if budget[0] >= MAX_NODES:
        complete = False
    for name, read in (
        ("global:random", _global_random),
        ("global:numpy", _global_numpy),
        ("global:torch", _global_torch),
    ):
        try:
            h = read()
        except Exception:
            h = None
        if h is not None:
            out[name] = h
    return Snapshot(out, objects, complete)


def drawn(start: Snapshot, after: Snapshot) -> tuple[list[str], list[str]]:
    """(drawn, rebound): the paths a worker drew from between two snapshots, and those of them
    bound to another generator object than at the start (re-created, or created in the worker).

    A path drew when its state changed.  A path absent at the start drew (it was created in
    the worker) only for dataset paths, and only if the first walk saw everything: a global
    first imported later, or a generator the bounded walk did not reach, proves nothing.
    """
    drew, rebound = [], []
    for path, h in after.prints.items():
        before = start.prints.get(path)
        if before is None:
            if path.startswith("global:") or not start.complete:
                continue
            drew.append(path)
            rebound.append(path)
        elif before != h:
            drew.append(path)
            if not path.startswith("global:") and after.objects.get(path) is not start.objects.get(path):
                rebound.append(path)
    return sorted(drew), sorted(rebound)


def duplicates(fingerprints_by_worker: Mapping[int, Mapping[str, str]]) -> list[dict[str, Any]]:
    """Per attribute path, the workers (two or more) whose RNG state hashes are identical.

    One entry per group: ``{"attribute", "workers", "kind"}``, kind ``object`` or
    ``global``; objects first, then globals, each by path.
    """
    groups: dict[tuple[str, str], list[int]] = {}
    for worker_id, prints in fingerprints_by_worker.items():
        for path, h in (prints or {}).items():
            groups.setdefault((str(path), str(h)), []).append(worker_id)
    out = []
    for (path, _h), workers in groups.items():
        if len(set(workers)) >= 2:
            out.append(
                {
                    "attribute": path,
                    "workers": sorted(set(workers)),
                    "kind": "global" if path.startswith("global:") else "object",
                }
            )
    out.sort(key=lambda d: (d["kind"] == "global", d["attribute"], d["workers"]))
    return out


# --------------------------------------------------------------------------- state hashing


def _digest(feed: Any) -> str:
    h = hashlib.blake2b(digest_size=8)
    _feed(h, feed, 0)
    return h.hexdigest()


def _feed(h: Any, obj: Any, level: int) -> None:
    if level > 6:
        h.update(b"<deep>")
        return
    tobytes = getattr(obj, "tobytes", None)  # numpy arrays (repr() would elide their middle)
    if callable(tobytes) and not isinstance(obj, (bytes, bytearray)):
        h.update(tobytes())
        return
    if isinstance(obj, Mapping):
        for k in sorted(obj, key=str):
            h.update(str(k).encode())
            _feed(h, obj[k], level + 1)
        return
    if isinstance(obj, (list, tuple)):
        h.update(b"[")
        for x in obj:
            _feed(h, x, level + 1)
        h.update(b"]")
        return
    if isinstance(obj, (bytes, bytearray)):
        h.update(obj)
        return
    h.update(repr(obj).encode())
    h.update(b",")


def _random_digest(state: Any) -> str:
    """A ``random.Random`` state, (version, 625 ints, gauss), hashed through its repr: one C call
    instead of a Python step per int (which cost a worker about 3 ms per look, and the look is
    taken twice in each worker of a loader's first two generations).  repr of ints, a tuple,
    a float and None is exact, so equal hashes still mean equal states."""
    h = hashlib.blake2b(digest_size=8)
    h.update(repr(state).encode())
    return h.hexdigest()


def state_hash(obj: Any) -> str | None:
    """The short hash of one generator's state, or None if ``obj`` is not a known RNG."""
    if isinstance(obj, random.Random):
        return _random_digest(obj.getstate())
    # numpy.random as the process has it: never ``numpy.random`` by attribute, which imports it
    # (numpy loads it lazily) where nobody had (torch's workers have: torch seeds it in each)
    nprandom = sys.modules.get("numpy.random")
    if nprandom is not None:
        if isinstance(obj, nprandom.RandomState):
            return _digest(obj.get_state(legacy=False))
        if isinstance(obj, nprandom.Generator):
            return _digest(obj.bit_generator.state)
        if isinstance(obj, nprandom.BitGenerator):
            return _digest(obj.state)
    torch = sys.modules.get("torch")
    if torch is not None:
        gen_type = getattr(torch, "Generator", None)
        if gen_type is not None and isinstance(obj, gen_type):
            return _digest(_torch_state_bytes(obj.get_state()))
    return None


def _torch_state_bytes(state: Any) -> bytes:
    try:
        return state.numpy().tobytes()
    except Exception:
        return bytes(state.tolist())


def _global_random() -> str:
    return _random_digest(random.getstate())


def _global_numpy() -> str | None:
    nprandom = sys.modules.get("numpy.random")  # imported by the program, not by us (see state_hash)
    get_state = getattr(nprandom, "get_state", None)
    if get_state is None:
        return None
    return _digest(get_state(legacy=False))


def _global_torch() -> str | None:
    torch = sys.modules.get("torch")
    get = getattr(getattr(torch, "random", None), "get_rng_state", None) if torch is not None else None
    if get is None:
        return None
    return _digest(_torch_state_bytes(get()))


# --------------------------------------------------------------------------- the bounded walk


def _walk(
    obj: Any, path: str, depth: int, out: dict[str, str], seen: set[int], budget: list[int], objects: dict[str, Any]
) -> None:
    if budget[0] >= MAX_NODES or id(obj) in seen or isinstance(obj, _LEAF_TYPES):
        return
    seen.add(id(obj))
    budget[0] += 1
    try:
        h = state_hash(obj)
    except Exception:
        h = None
    if h is not None:
        out[path] = h
        objects[path] = obj
        return
    if _is_opaque(obj):
        return
    if isinstance(obj, dict):
        for key, value in itertools.islice(obj.items(), MAX_ITEMS):
            _walk(value, f"{path}[{key!r}]", depth, out, seen, budget, objects)
        return
    if isinstance(obj, (list, tuple)):
        for i, value in enumerate(itertools.islice(obj, MAX_ITEMS)):
            _walk(value, f"{path}[{i}]", depth, out, seen, budget, objects)
        return
    if depth <= 0:
        return
    attrs = _instance_dict(obj)
    if attrs is None:
        return
    for name, value in itertools.islice(list(attrs.items()), MAX_ATTRS):
        if not isinstance(name, str):
            continue
        transparent = name in _TRANSPARENT_ATTRS and isinstance(value, (list, tuple))
        _walk(value, f"{path}.{name}", depth if transparent else depth - 1, out, seen, budget, objects)


def _instance_dict(obj: Any) -> Mapping[str, Any] | None:
    try:
        d = object.__getattribute__(obj, "__dict__")
    except Exception:
        return None
    return d if isinstance(d, Mapping) else None


def _is_opaque(obj: Any) -> bool:
    """Objects not to look inside: modules, classes, functions, arrays and tensors (big, no RNGs)."""
    if isinstance(obj, type) or type(obj).__name__ in (
        "module",
        "function",
        "builtin_function_or_method",
        "method",
        "code",
        "frame",
    ):
        return True
    mod = type(obj).__module__ or ""
    if mod.startswith(("numpy", "torch._C", "pandas")) or type(obj).__name__ in ("Tensor", "Parameter"):
        return True
    return hasattr(type(obj), "__array__") and not isinstance(obj, (list, tuple, dict))
