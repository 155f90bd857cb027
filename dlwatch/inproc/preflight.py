"""Preflight: cheap checks of a DataLoader and its process before its workers start.

Run by the agent in the training process when an epoch's iterator is created (the
workers are forked right after), and once more on the first batch for the checks that
need its size.  Each check is a pure function of facts gathered here; a finding is an
advice signal ``{"event": "advice", "stage": "preflight", "playbook": ID, ...}`` that
goes to the run summary's ``preflight`` list, and one :class:`~dlwatch.inproc.agent.DlwatchWarning`
line per finding (``warnings.warn``, so users filter it the usual way).

Nothing here starts a thread, imports torch, or initialises CUDA: CUDA is only asked
about when ``pin_memory=True``, where torch asks the same when it builds the iterator.
"""

from __future__ import annotations

import os
import resource
import sys
import itertools
import threading
import weakref
from typing import Any, Iterable, Mapping

__all__ = ["start_facts", "start_checks", "first_batch_facts", "first_batch_checks", "thread_info"]

MAX_THREADS = 16  # threads named in a finding
# Start findings that are also a fact of the whole run, not only of its start: each is sent once more,
# as plain advice (the run summary's advice, beside its preflight list).
RUN_FACTS = frozenset({"pin-memory-without-cuda"})
# The failure judged (by the monitor) from :func:`sampler_state`'s ``sampler_epoch`` event: not sent when ignored.
SAMPLER_EPOCH_PLAYBOOK = "sampler-epoch-not-set"


def _where(fn: Any) -> str | None:
    code = getattr(fn, "__code__", None)
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None)
    module = getattr(fn, "__module__", None)
    if code is None:
        return f"{module}.{name}" if module and name else None
    return f"{module}.{name} ({code.co_filename}:{code.co_firstlineno})"


def thread_info(t: threading.Thread) -> dict[str, Any]:
    """A live thread as a finding names it: name, daemon, the function it runs and where that is defined."""
    target = getattr(t, "_target", None)
    if target is None and type(t).run is not threading.Thread.run:
        target = type(t).run
    return {"name": t.name, "daemon": t.daemon, "ident": t.ident, "runs": _where(target) if target else None}


# Threads that are safe across fork: multiprocessing's queue feeder threads (a Queue resets its
# locks in the child, register_after_fork), and the DataLoader's own threads (a previous
# epoch's pin-memory thread), which torch stops and manages itself; and dlwatch's own
# "dlwatch-html-reaper", which waits (at most a minute) for the child that renders the
# report.html of an incident or run summary written in this process.  It is not the user's: a finding about
# it would be dlwatch accusing itself, and a worker forked beside it never touches it.
_FORK_SAFE_TARGETS = (
    "multiprocessing.queues.Queue._feed",
    "torch.utils.data.",
    "dlwatch.report.html.spawn_render.",
)


def _run_returned(t: threading.Thread) -> bool:
    """A thread whose ``run()`` has returned and that is only finishing its exit.

    ``Thread.run`` deletes ``_target`` when it returns; the thread stays in ``enumerate()`` a moment
    longer.  Its function is then unknown (a previous iterator's queue feeder, exiting as the next
    iterator forks, was named as a user's thread), and it holds nothing of the program's any more."""
    return type(t).run is threading.Thread.run and not hasattr(t, "_target")


def _other_threads() -> list[dict[str, Any]]:
    me = threading.current_thread()
    main = threading.main_thread()
    out = []
    for t in threading.enumerate():
        if t is me or t is main or not t.is_alive() or _run_returned(t):
            continue
        info = thread_info(t)
        if info["runs"] and info["runs"].startswith(_FORK_SAFE_TARGETS):
            continue
        out.append(info)
    return out


def _accelerator(pin_memory: bool) -> dict[str, Any] | None:
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    facts: dict[str, Any] = {}
    try:
        facts["cuda_initialized"] = bool(torch.cuda.is_initialized())
    except Exception:
        facts["cuda_initialized"] = None
    if pin_memory:  # torch asks the same when it builds a pinning iterator: no new side effect
        try:
            facts["cuda_available"] = bool(torch.cuda.is_available())
        except Exception:
            facts["cuda_available"] = None
        try:
            acc = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
            facts["accelerator"] = str(acc.type) if acc is not None else None
        except Exception:
            facts["accelerator"] = None
        # what torch itself asks before it pins (a CUDA build on a machine without a GPU names "cuda"
        # as its accelerator, yet has none to pin for): asked as torch asks it, no new side effect
        try:
            facts["accelerator_available"] = (
                bool(torch.accelerator.is_available()) if hasattr(torch, "accelerator") else None
            )
        except Exception:
            facts["accelerator_available"] = None
        facts["torch_warns_pin_memory"] = _torch_warns_pin_memory(torch)
    return facts


def torch_worker_limit() -> int | None:
    """The worker count above which torch itself warns "This DataLoader will create N worker processes".

    torch compares ``num_workers`` with ``torch._utils.cpu_count()`` (the affinity) in
    ``DataLoader.check_worker_number_rationality``; where that check exists, the same figure is
    read here (nothing is called that torch would not call; no warning filter touched).
    """
    torch = sys.modules.get("torch")
    try:
        if torch is None or not hasattr(torch.utils.data.DataLoader, "check_worker_number_rationality"):
            return None
        count = torch._utils.cpu_count() if hasattr(torch._utils, "cpu_count") else None
        if count is None and hasattr(os, "sched_getaffinity"):
            count = len(os.sched_getaffinity(0))
        return int(count) if count else None
    except Exception:
        return None


_TORCH_PIN_WARNING = "'pin_memory' argument is set as true but no accelerator is found"


def _torch_warns_pin_memory(torch: Any) -> bool:
    """Whether this torch warns by itself, as it builds an iterator, that pin_memory has no device.

    Read from the constants of its iterator's ``__init__`` (the message is one literal there since
    torch 2.x): exact for the torch that runs, nothing called, no warning filter touched."""
    try:
        init = torch.utils.data.dataloader._BaseDataLoaderIter.__init__
        return any(isinstance(c, str) and c.startswith(_TORCH_PIN_WARNING) for c in init.__code__.co_consts)
    except Exception:
        return False


def start_facts(cfg: Mapping[str, Any], cpus: Mapping[str, Any] | None) -> dict[str, Any]:
    """What the start checks judge: the loader's configuration, the threads, CUDA, the usable CPUs."""
    pin = bool(cfg.get("pin_memory"))
    return {
        "num_workers": cfg.get("num_workers") or 0,
        "start_method": cfg.get("multiprocessing_context"),
        "pin_memory": pin,
        "threads": _other_threads() if (cfg.get("num_workers") or 0) > 0 else [],
        "accelerator": _accelerator(pin),
        "cpus": dict(cpus or {}),
        "torch_worker_limit": torch_worker_limit() if (cfg.get("num_workers") or 0) > 0 else None,
    }


def _signal(playbook: str, confidence: float, **evidence: Any) -> dict[str, Any]:
    return {"event": "advice", "stage": "preflight", "playbook": playbook, "confidence": confidence, **evidence}


def start_checks(f: Mapping[str, Any]) -> list[dict[str, Any]]:
    """fork-with-threads, fork-after-cuda, pin-memory-without-cuda, too-many-workers (pure)."""
    out = []
    nw = f.get("num_workers") or 0
    fork = f.get("start_method") == "fork"
    acc = f.get("accelerator") or {}
    if nw > 0 and fork and f.get("threads"):
        threads = list(f["threads"])
        out.append(
            _signal(
                "fork-with-threads", 0.7, start_method="fork", num_threads=len(threads), threads=threads[:MAX_THREADS]
            )
        )
    if nw > 0 and fork and acc.get("cuda_initialized"):
        out.append(_signal("fork-after-cuda", 0.9, start_method="fork", cuda_initialized=True))
    no_device = acc.get("accelerator_available") is False or (
        acc.get("accelerator_available") is None and acc.get("cuda_available") is False and not acc.get("accelerator")
    )
    if f.get("pin_memory") and no_device:
        sig = _signal(
            "pin-memory-without-cuda",
            0.9,
            pin_memory=True,
            cuda_available=acc.get("cuda_available"),
            accelerator=acc.get("accelerator"),  # "cuda" on a CUDA build of torch without a GPU
        )
        if acc.get("torch_warns_pin_memory"):
            sig["torch_warns"] = True  # torch prints its own warning for this: no second one (the finding stays)
        out.append(sig)
    usable = (f.get("cpus") or {}).get("usable")
    if nw > 0 and isinstance(usable, (int, float)) and nw > usable:
        cpus = f.get("cpus") or {}
        sig = _signal(
            "too-many-workers",
            0.6,
            num_workers=nw,
            usable_cpus=usable,
            affinity_cpus=cpus.get("affinity"),
            cgroup_cpu_quota=cpus.get("cgroup_quota"),
            cpu_count=cpus.get("cpu_count"),
            suggested_num_workers=max(1, int(usable)),
        )
        limit = f.get("torch_worker_limit")
        if isinstance(limit, int) and nw > limit:
            # torch warns "This DataLoader will create N worker processes" itself (a cgroup quota it does
            # not see is dlwatch's to say): the finding stays, no second warning
            sig["torch_warns"] = True
        out.append(sig)
    return out


# --------------------------------------------------------------------------- first batch


def tensors_in(batch: Any, max_depth: int = 6, max_leaves: int = 10_000) -> int:
    """Torch tensors in a batch (each travels with its own shared-memory segment); bounded walk."""
    count = 0
    stack: list[tuple[Any, int]] = [(batch, 0)]
    while stack and count < max_leaves:
        obj, depth = stack.pop()
        if hasattr(obj, "untyped_storage") and hasattr(obj, "shape"):
            count += 1
        elif depth < max_depth and isinstance(obj, Mapping):
            stack.extend((v, depth + 1) for v in list(obj.values())[:max_leaves])
        elif depth < max_depth and isinstance(obj, (list, tuple)):
            stack.extend((v, depth + 1) for v in obj[:max_leaves])
    return count


def _num_fds() -> int | None:
    try:
        size = os.stat("/proc/self/fd").st_size
        return size if size > 0 else len(os.listdir("/proc/self/fd"))
    except OSError:
        return None


def first_batch_facts(cfg: Mapping[str, Any], batch: Any, batch_bytes: int | None) -> dict[str, Any]:
    try:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        fd_limit = None if soft == resource.RLIM_INFINITY else int(soft)
    except (OSError, ValueError):
        fd_limit = None
    try:
        st = os.statvfs("/dev/shm")
        shm_total, shm_free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    except OSError:
        shm_total = shm_free = None
    return {
        "num_workers": cfg.get("num_workers") or 0,
        "prefetch_factor": cfg.get("prefetch_factor") or 0,
        "sharing_strategy": cfg.get("sharing_strategy"),
        "tensors_per_batch": tensors_in(batch),
        "batch_bytes": batch_bytes,
        "num_fds": _num_fds(),
        "fd_limit": fd_limit,
        "shm_total": shm_total,
        "shm_free": shm_free,
    }


def first_batch_checks(
    f: Mapping[str, Any], thresholds: Mapping[str, Mapping[str, float]] | None = None
) -> list[dict[str, Any]]:
    """fd-limit-low, shm-too-small (pure)."""
    th = thresholds or {}
    out = []
    nw, pf = f.get("num_workers") or 0, f.get("prefetch_factor") or 0
    if nw <= 0:
        return out  # no workers: batches never travel through shared memory
    batches_in_flight = nw * pf + 1  # every worker's prefetched batches and the one the loop holds
    tensors = f.get("tensors_per_batch") or 0
    limit, open_fds = f.get("fd_limit"), f.get("num_fds")
    if f.get("sharing_strategy") == "file_descriptor" and tensors and limit and open_fds is not None:
        need = batches_in_flight * tensors
        share = float((th.get("fd-limit-low") or {}).get("share", 0.8))
        if open_fds + need > share * limit:
            out.append(
                _signal(
                    "fd-limit-low",
                    0.8,
                    fd_limit=limit,
                    num_fds=open_fds,
                    tensors_per_batch=tensors,
                    num_workers=nw,
                    prefetch_factor=pf,
                    fds_in_flight=need,
                    sharing_strategy="file_descriptor",
                )
            )
    bb, free = f.get("batch_bytes"), f.get("shm_free")
    if isinstance(bb, int) and bb > 0 and isinstance(free, int):
        need_b = batches_in_flight * bb
        factor = float((th.get("shm-too-small") or {}).get("need_factor", 1.0))
        if need_b * factor > free:
            out.append(
                _signal(
                    "shm-too-small",
                    0.8,
                    batch_bytes=bb,
                    num_workers=nw,
                    prefetch_factor=pf,
                    inflight_bytes=need_b,
                    shm_free=free,
                    shm_total=f.get("shm_total"),
                )
            )
    return out


def warning_text(sig: Mapping[str, Any], title: str) -> str:
    """The one warning line of a preflight finding."""
    keys = [k for k in sig if k not in ("event", "stage", "playbook", "confidence", "threads")]
    figures = ", ".join(f"{k}={sig[k]}" for k in keys[:5])
    if sig.get("threads"):
        names = ", ".join(f"{t.get('name')}" + (f" [{t['runs']}]" if t.get("runs") else "") for t in sig["threads"][:4])
        figures = f"threads: {names}" + (f"; {figures}" if figures else "")
    return (
        f"{sig.get('playbook')}: {title}"
        + (f" ({figures})" if figures else "")
        + f"; see `dlwatch playbooks {sig.get('playbook')}`"
    )


_DATASETS: dict[int, tuple[Any, int]] = {}  # id(dataset) -> (a weak reference to it, its number)
_NUMBERS = itertools.count(1)


def dataset_ref(dataset: Any) -> int | str:
    """A number for one dataset object for this process's life: equal for the same object, never for two.

    The sampler advice groups epoch starts by the data they order.  A bare ``id()`` would be
    reused by a dataset made after another was freed (a validation loop building one loader
    after another): that would pool different data.  A weak reference tells a reused id
    apart without keeping any dataset alive; an object that takes no weak reference falls
    back to its ``id()``.
    """
    key = id(dataset)
    known = _DATASETS.get(key)
    if known is not None and known[0]() is dataset:
        return known[1]
    try:
        ref = weakref.ref(dataset)
    except TypeError:
        return f"id:{key}"
    number = next(_NUMBERS)
    if len(_DATASETS) > 4096:  # forget the freed ones (their ids may be reused)
        for k in [k for k, (r, _) in _DATASETS.items() if r() is None]:
            del _DATASETS[k]
    _DATASETS[key] = (ref, number)
    return number


def sampler_state(loader: Any) -> dict[str, Any] | None:
    """The epoch of a sampler that has ``set_epoch`` (DistributedSampler and the like); None otherwise.

    Only attributes are read: iterating a sampler could change a stateful sampler's order.
    """
    sampler = getattr(loader, "sampler", None)
    candidates: Iterable[Any] = (sampler, getattr(getattr(loader, "batch_sampler", None), "sampler", None))
    for s in candidates:
        if s is None or not callable(getattr(s, "set_epoch", None)):
            continue
        epoch = getattr(s, "epoch", None)
        if not isinstance(epoch, int) or isinstance(epoch, bool):
            return None
        cls = type(s)
        return {
            "sampler": f"{cls.__module__}.{cls.__qualname__}",
            "sampler_epoch": epoch,
            "dataset_ref": dataset_ref(getattr(loader, "dataset", None)),
            "shuffle": getattr(s, "shuffle", None) if isinstance(getattr(s, "shuffle", None), bool) else None,
            "seed": getattr(s, "seed", None) if isinstance(getattr(s, "seed", None), int) else None,
            "num_replicas": getattr(s, "num_replicas", None)
            if isinstance(getattr(s, "num_replicas", None), int)
            else None,
        }
    return None
