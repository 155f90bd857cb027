"""What dlwatch reads of a loader: its configuration, its start method, a length it may know.

Only attributes are read, and lengths that run no code of the program's (see :func:`known_len`):
dlwatch never calls a dataset's or sampler's own ``__len__``.  Nothing here imports torch.
"""

from __future__ import annotations

import multiprocessing
import sys
from typing import Any

from dlwatch.inproc.worker_hook import CollateHook, WorkerHook


def qualname(obj: Any) -> str | None:
    if obj is None:
        return None
    target = obj if isinstance(obj, type) or callable(obj) and hasattr(obj, "__qualname__") else type(obj)
    module = getattr(target, "__module__", None)
    name = getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or repr(target)
    return f"{module}.{name}" if module else str(name)


def is_dataloader(obj: Any) -> bool:
    torch_data = sys.modules.get("torch.utils.data")
    return torch_data is not None and isinstance(obj, torch_data.DataLoader)


def adapted_loader(obj: Any) -> Any:
    """The DataLoader a wrapper holds and delegates to, where it is one (accelerate's DataLoaderAdapter and
    DataLoaderShard keep it as ``base_dataloader`` and answer ``__class__`` with its class); else ``obj``.

    Read from the instance's own ``__dict__``: no attribute lookup that the wrapper could answer itself."""
    inner = getattr(obj, "__dict__", {}).get("base_dataloader") if not is_dataloader_type(type(obj)) else None
    return inner if inner is not None and is_dataloader_type(type(inner)) else obj


def is_dataloader_type(cls: type) -> bool:
    torch_data = sys.modules.get("torch.utils.data")
    return torch_data is not None and issubclass(cls, torch_data.DataLoader)


def start_method(loader: Any) -> str | None:
    ctx = getattr(loader, "multiprocessing_context", None)
    if isinstance(ctx, str):
        return ctx
    if ctx is not None:
        try:
            return str(ctx.get_start_method())
        except Exception:
            return None
    # allow_none=True: asking without it would fix the process-wide default as a side effect
    method = multiprocessing.get_start_method(allow_none=True)
    if method:
        return method
    if sys.platform == "linux":
        return "forkserver" if sys.version_info >= (3, 14) else "fork"
    return "spawn"


def sharing_strategy() -> str | None:
    """torch.multiprocessing's sharing strategy, if torch's multiprocessing is imported (never imports it)."""
    tmp = sys.modules.get("torch.multiprocessing")
    if tmp is not None:
        try:
            return tmp.get_sharing_strategy()
        except Exception:
            pass
    return None


def known_len(obj: Any) -> int | None:
    """``len(obj)`` where that runs no code of the program's, else None.

    A dataset's or sampler's own ``__len__`` is the program's code (it may list a bucket, open a
    database in the main process before the workers fork, or count calls): dlwatch never calls it.
    Built-in containers and torch's own samplers and datasets over them are read; a
    DistributedSampler's length is the attribute torch computed at its construction.
    """
    if type(obj) in (list, tuple, range, dict, str, bytes):
        return len(obj)
    data = sys.modules.get("torch.utils.data")
    if data is None:
        return None
    try:
        kind = type(obj)
        if kind is data.DistributedSampler:
            n = obj.__dict__.get("num_samples")
            return n if isinstance(n, int) else None
        if kind is data.RandomSampler:
            n = obj.__dict__.get("_num_samples")
            return n if isinstance(n, int) else known_len(obj.__dict__.get("data_source"))
        if kind is data.SequentialSampler:
            return known_len(obj.__dict__.get("data_source"))
        if kind is data.TensorDataset:
            return len(obj)  # torch's: the first tensor's size
        if kind is data.Subset:
            return known_len(obj.__dict__.get("indices"))
    except Exception:
        return None
    return None


def loader_config(loader: Any) -> dict[str, Any] | None:
    """The DataLoader's configuration for the report; None for a plain iterable."""
    if not is_dataloader(loader):
        return None
    strategy = sharing_strategy()
    dataset = getattr(loader, "dataset", None)
    dataset_len = known_len(dataset)
    user_init = loader.worker_init_fn
    if isinstance(user_init, WorkerHook):
        user_init = user_init.user_fn
    collate = loader.collate_fn
    if isinstance(collate, CollateHook):
        collate = collate.user_fn
    return {
        "class": qualname(type(loader)),
        "batch_size": loader.batch_size,
        "num_workers": loader.num_workers,
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory": loader.pin_memory,
        "drop_last": loader.drop_last,
        "timeout": loader.timeout,
        "multiprocessing_context": start_method(loader) if loader.num_workers > 0 else None,
        "sharing_strategy": strategy,
        "collate_fn": qualname(collate),
        "worker_init_fn": qualname(user_init),
        "sampler": qualname(type(loader.sampler)) if getattr(loader, "sampler", None) is not None else None,
        "dataset": qualname(type(dataset)),
        "dataset_len": dataset_len,
    }
