"""The training program the transparency harness runs: loader shapes users write, each printing its trace.

usage: program.py MODE SHAPE [SHAPE...]

MODE says how the program's own code watches its loaders:
  bare      not at all (``dlwatch run program.py bare ...`` runs this same code under the run hook)
  watch     ``with dlwatch.watch(loader): for b in loader``
  watch_as  ``with dlwatch.watch(loader) as batches: for b in batches``

Each shape starts from the same seeds, runs, and prints one line ``TRACE {json}``: every batch's
digest (bytes, dtypes and shapes of its tensors, and the values the workers drew), the calls into
user code counted in the main process and, through files, in the workers (worker_init_fn), the
main process's RNG states afterwards, any exception with its frames, and how many DataLoader
workers are still alive once the shape's loaders are gone.  Nothing in a trace depends on time,
pids or addresses, so the traces of one shape are equal in every mode or something differs.

A shape that lets an exception escape (a divergence, e.g. a crash only one mode has) is recorded
as such and the next shape still runs.  Shapes named ``uncaught-*`` let theirs end the program.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
import random
import sys
import threading
import traceback
from collections import Counter
from typing import Any, Callable, Iterator

import numpy as np
import torch
from tracefmt import normalised
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    Sampler,
    default_collate,
    get_worker_info,
)

MODE = sys.argv[1] if __name__ == "__main__" and len(sys.argv) > 1 else "bare"
CALLS: Counter[str] = Counter()  # calls into user code made in this (the main) process, per shape
COUNT_DIR = os.environ.get("TRANSPARENCY_COUNT_DIR", "")  # worker-side calls go to files here
SHAPE_ENV = "TRANSPARENCY_SHAPE"  # the shape running now: names the count files (spawned workers read it too)


# ---------------------------------------------------------------- the modes


def watch(loader: Any) -> Any:
    """What the program's code puts around its loop: nothing (bare, and under `dlwatch run`) or dlwatch.watch."""
    if MODE in ("watch", "watch_as"):
        import dlwatch

        return dlwatch.watch(loader)
    return contextlib.nullcontext(loader)


def pick(loader: Any, batches: Any) -> Any:
    """What the loop iterates: the loader itself (plain form) or the watched object (``as`` form)."""
    return batches if MODE == "watch_as" else loader


# ---------------------------------------------------------------- user code, counted


def _worker_count(what: str) -> None:
    """A call in a worker process: one line in a file of its own (workers share no memory with us)."""
    if not COUNT_DIR:
        return
    info = get_worker_info()
    wid = info.id if info is not None else -1
    fd = os.open(
        os.path.join(COUNT_DIR, f"{os.environ.get(SHAPE_ENV, '')}.{what}"),
        os.O_WRONLY | os.O_APPEND | os.O_CREAT,
        0o600,
    )
    try:
        os.write(fd, f"{wid}\n".encode())
    finally:
        os.close(fd)


def _worker_counts(shape: str) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    if not COUNT_DIR:
        return out
    for name in sorted(os.listdir(COUNT_DIR)):
        stem, _, what = name.rpartition(".")
        if stem == shape and not what.startswith("gate"):
            with open(os.path.join(COUNT_DIR, name)) as f:
                out[what] = sorted(int(x) for x in f.read().split())
    return out


def open_gate(gate: str = "gate") -> None:
    """The main process has every batch before the failing one (see gate_wait)."""
    if COUNT_DIR:
        os.close(
            os.open(os.path.join(COUNT_DIR, f"{os.environ.get(SHAPE_ENV, '')}.{gate}"), os.O_WRONLY | os.O_CREAT, 0o600)
        )


def gate_wait(gate: str = "gate") -> None:
    """Called by a worker before it raises: wait until the main process has every earlier batch.

    Where the main process meets a worker's exception decides the traceback's frames (torch takes a
    result that came early from a buffer, one that came in order straight from the queue), so an
    exception that could arrive early would make the frames differ from run to run, bare too.
    """
    import time

    path = os.path.join(COUNT_DIR, f"{os.environ.get(SHAPE_ENV, '')}.{gate}")
    deadline = time.monotonic() + 60
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError("the main process never opened the gate")
        time.sleep(0.01)


class Samples(Dataset):
    """Tens of samples; each draws from the three global RNGs of the process that loads it."""

    def __init__(self, n: int = 20, fail_at: int | None = None) -> None:
        self.n, self.fail_at = n, fail_at

    def __len__(self) -> int:
        if get_worker_info() is None:
            CALLS["Dataset.__len__"] += 1
        return self.n

    def __getitem__(self, i: int) -> dict[str, Any]:
        if i == self.fail_at:
            gate_wait()
            raise ValueError(f"sample {i} is unreadable")
        drawn = [random.random(), float(np.random.rand()), float(torch.rand(1))]
        return {
            "x": torch.arange(3, dtype=torch.float32) + i,
            "i": i,
            "drawn": torch.tensor(drawn, dtype=torch.float64),
        }


_collated = Counter()  # per process: how many batches this process's collate_fn made


def collate(samples: Any) -> Any:
    """The user's collate_fn: default_collate, plus who collated (worker id) and how many so far."""
    info = get_worker_info()
    if info is None:
        CALLS["collate_fn"] += 1
    _collated["n"] += 1
    batch = default_collate(samples)
    if isinstance(batch, dict):
        batch["worker"] = torch.tensor(info.id if info is not None else -1)
        batch["collated"] = torch.tensor(_collated["n"])
    return batch


def bad_collate(samples: Any) -> Any:
    if get_worker_info() is not None and _collated["n"] >= 1:
        gate_wait()
        raise RuntimeError("collate_fn cannot stack these samples")
    return collate(samples)


def convert(sample: Any) -> Any:
    """The collate_fn of a loader without batching (batch_size=None): one sample at a time."""
    if get_worker_info() is None:
        CALLS["collate_fn"] += 1
    return torch.as_tensor(sample)


def worker_init(worker_id: int) -> None:
    """The user's worker_init_fn: the common numpy reseeding, counted through a file."""
    _worker_count("worker_init_fn")
    np.random.seed((torch.initial_seed() + worker_id) % 2**32)


def bad_worker_init(worker_id: int) -> None:
    _worker_count("worker_init_fn")
    if worker_id != 0:
        open_gate("gate-init")
    else:  # its error is the answer to the first batch: no earlier batch to wait for
        gate_wait("gate-init")  # but the other worker's init has run (the error shuts it down: it might not have)
        raise OSError("worker_init_fn could not open the shard index")


def loader(dataset: Any = None, **kw: Any) -> DataLoader:
    kw.setdefault("batch_size", 4)
    kw.setdefault("num_workers", 2)
    kw.setdefault("collate_fn", collate)
    if kw["num_workers"]:
        kw.setdefault("worker_init_fn", worker_init)
    return DataLoader(Samples() if dataset is None else dataset, **kw)


# ---------------------------------------------------------------- the trace


def digest(obj: Any) -> str:
    h = hashlib.sha256()

    def feed(o: Any) -> None:
        if isinstance(o, torch.Tensor):
            h.update(f"T{o.dtype}{tuple(o.shape)}".encode())
            h.update(o.detach().cpu().contiguous().numpy().tobytes())
        elif isinstance(o, dict):
            h.update(f"D{len(o)}".encode())
            for k in sorted(o, key=repr):
                feed(k)
                feed(o[k])
        elif isinstance(o, (list, tuple)):
            h.update(f"{type(o).__name__}{len(o)}".encode())
            for v in o:
                feed(v)
        else:
            h.update(f"{type(o).__name__}:{o!r}".encode())

    feed(obj)
    return h.hexdigest()[:16]


def exception_trace(exc: BaseException) -> dict[str, Any]:
    """Type, message and every frame (file, function, line) of an exception and its chain."""
    out: dict[str, Any] = {
        "type": f"{type(exc).__module__}.{type(exc).__qualname__}",
        "message": normalised(str(exc)),
        "frames": [[os.path.basename(f.filename), f.name, f.lineno] for f in traceback.extract_tb(exc.__traceback__)],
    }
    chained = exc.__cause__ or (None if exc.__suppress_context__ else exc.__context__)
    if chained is not None:
        out["chained"] = exception_trace(chained)
    return out


def rng_states() -> dict[str, str]:
    return {
        "torch": digest(torch.get_rng_state()),
        "random": digest(random.getstate()),
        "numpy": digest(list(np.random.get_state())),
    }


def _where(path: str) -> str:
    """A path of sys.path or argv as the same in every mode: the program's directory and the working
    directory (the harness's temporary one) by name, the rest as it is."""
    if not isinstance(path, str):
        return repr(path)
    here = os.path.dirname(os.path.abspath(__file__))
    for name, place in (("<program dir>", here), ("<cwd>", os.getcwd())):
        if path == place or path.startswith(place + os.sep):
            return name + path[len(place) :]
    return path


def process_state() -> dict[str, Any]:
    """What a library could change in the process behind the program's back: signal handlers,
    faulthandler, the start method, torch's threads and sharing strategy."""
    import faulthandler
    import multiprocessing
    import signal

    def name(handler: Any) -> str:
        return getattr(handler, "__qualname__", None) or str(handler)

    return {
        "signals": {
            sig.name: name(signal.getsignal(sig))
            for sig in (
                signal.SIGINT,
                signal.SIGTERM,
                signal.SIGCHLD,
                signal.SIGUSR1,
                signal.SIGUSR2,
                signal.SIGALRM,
                signal.SIGPIPE,
                signal.SIGHUP,
            )
        },
        "faulthandler": faulthandler.is_enabled(),
        # where the program imports from, as Python set it up (`python -m` puts the working directory first)
        "import_path": [_where(p) for p in sys.path],
        "main": getattr(sys.modules["__main__"].__spec__, "name", None),
        "argv0": _where(sys.argv[0]),
        "start_method": multiprocessing.get_start_method(allow_none=True),
        "torch_threads": torch.get_num_threads(),
        "sharing_strategy": torch.multiprocessing.get_sharing_strategy(),
    }


def workers_alive() -> int:
    """DataLoader worker processes still running below this process (the shape's loaders are gone)."""
    import psutil

    n = 0
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and p.name() == "pt_data_worker":
                n += 1
        except psutil.NoSuchProcess:
            pass
    return n


class Trace:
    def __init__(self) -> None:
        self.batches: list[str] = []
        self.notes: list[Any] = []

    def batch(self, b: Any) -> None:
        self.batches.append(digest(b))

    def note(self, *what: Any) -> None:
        self.notes.append(list(what))

    def caught(self, exc: BaseException) -> None:
        """Record a caught exception, then free what its traceback holds now: torch's reraise keeps the
        exception in a frame of its own traceback, a cycle that would hold the loader's iterator until
        the next collection, which then waits seconds per worker to shut it down."""
        self.notes.append(["caught", exception_trace(exc)])
        self.notes.append(["format_exc", normalised("".join(traceback.format_exception(exc)))])
        exc.__traceback__ = None


SHAPES: dict[str, Callable[[Trace], Any]] = {}


def shape(fn: Callable[[Trace], Any]) -> Callable[[Trace], Any]:
    SHAPES[fn.__name__.replace("_", "-")] = fn
    return fn


def run_shape(name: str) -> None:
    os.environ[SHAPE_ENV] = name
    CALLS.clear()
    _collated.clear()
    torch.manual_seed(0)
    random.seed(0)
    np.random.seed(0)
    trace = Trace()
    escaped = None
    try:
        SHAPES[name](trace)
    except Exception as exc:  # a shape's own code catches what it expects: anything else is recorded
        escaped = exception_trace(exc)
        del exc
    gc.collect()
    record = {
        "shape": name,
        "batches": trace.batches,
        "notes": trace.notes,
        "calls": dict(sorted(CALLS.items())),
        "worker_calls": _worker_counts(name),
        "rng": rng_states(),
        "escaped": escaped,
        "workers_alive": workers_alive(),
        "process": process_state(),
    }
    print("TRACE " + json.dumps(record, sort_keys=True), flush=True)


# ---------------------------------------------------------------- the shapes


class LoggingLoader(DataLoader):
    """Wraps super().__iter__() (to count steps, move batches, drive set_epoch) and logs each call."""

    def __iter__(self) -> Iterator[Any]:
        CALLS["LoggingLoader.__iter__"] += 1
        print(f"LoggingLoader.__iter__ call {CALLS['LoggingLoader.__iter__']}", flush=True)
        for b in super().__iter__():
            CALLS["LoggingLoader.step"] += 1
            yield b


@shape
def super_iter_subclass(t: Trace) -> None:
    dl = LoggingLoader(Samples(), batch_size=4, num_workers=2, collate_fn=collate, worker_init_fn=worker_init)
    with watch(dl) as batches:
        for epoch in range(2):
            for b in pick(dl, batches):
                t.batch(b)


class LenLoader(DataLoader):
    def __len__(self) -> int:
        CALLS["LenLoader.__len__"] += 1
        return super().__len__()


@shape
def len_override(t: Trace) -> None:
    dl = LenLoader(Samples(18), batch_size=4, num_workers=2, collate_fn=collate, worker_init_fn=worker_init)
    with watch(dl) as batches:
        source = pick(dl, batches)
        for i, b in enumerate(source):
            t.note("progress", f"{i + 1}/{len(source)}")  # what a progress bar (tqdm) asks of what it wraps
            t.batch(b)


class Fetcher:
    """Lightning's fetcher in miniature: iter() on the loader, len(loader) next() calls, never a
    StopIteration from the loader's iterator, which is kept until the next iter()."""

    def __init__(self, dl: DataLoader) -> None:
        self.dl, self.it, self.done = dl, None, 0

    def __iter__(self) -> "Fetcher":
        self.it = iter(self.dl)
        self.done = 0
        return self

    def __next__(self) -> Any:
        if self.done >= len(self.dl):
            raise StopIteration
        self.done += 1
        return next(self.it)


@shape
def lightning_style_fetcher(t: Trace) -> None:
    dl = loader()
    fetcher = Fetcher(dl)
    with watch(dl):  # the fetcher owns the iteration: only the plain form exists here
        for epoch in range(3):
            for b in fetcher:
                t.batch(b)
    fetcher.it = None


class _RepeatSampler:
    """YOLOv5's: a sampler that repeats forever."""

    def __init__(self, sampler: Any) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[Any]:
        while True:
            yield from iter(self.sampler)


class InfiniteDataLoader(DataLoader):
    """YOLOv5 / ultralytics (timm's MultiEpochsDataLoader is the same): workers live across epochs."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        object.__setattr__(self, "batch_sampler", _RepeatSampler(self.batch_sampler))
        self.iterator = super().__iter__()

    def __len__(self) -> int:
        return len(self.batch_sampler.sampler)

    def __iter__(self) -> Iterator[Any]:
        for _ in range(len(self)):
            yield next(self.iterator)


@shape
def infinite_loader(t: Trace) -> None:
    dl = InfiniteDataLoader(Samples(), batch_size=4, num_workers=2, collate_fn=collate, worker_init_fn=worker_init)
    try:
        with watch(dl) as batches:
            for epoch in range(3):
                for b in pick(dl, batches):
                    t.batch(b)
    finally:
        dl.iterator = None  # its workers end with it


class CountingDistributedSampler(DistributedSampler):
    def set_epoch(self, epoch: int) -> None:
        CALLS["set_epoch"] += 1
        super().set_epoch(epoch)

    def __iter__(self) -> Iterator[int]:
        CALLS["sampler.__iter__"] += 1
        return super().__iter__()


@shape
def distributed_sampler(t: Trace) -> None:
    ds = Samples(22)
    sampler = CountingDistributedSampler(ds, num_replicas=2, rank=0, shuffle=True, seed=7)
    dl = loader(ds, sampler=sampler)
    with watch(dl) as batches:
        for epoch in range(3):
            sampler.set_epoch(epoch)
            for b in pick(dl, batches):
                t.batch(b)


class PairBatches(Sampler):
    """A custom batch_sampler: odd-sized batches, reversed every other call."""

    def __init__(self, n: int) -> None:
        self.n, self.calls = n, 0

    def __iter__(self) -> Iterator[list[int]]:
        CALLS["batch_sampler.__iter__"] += 1
        self.calls += 1
        idx = list(range(self.n))[:: 1 if self.calls % 2 else -1]
        for i in range(0, self.n, 3):
            yield idx[i : i + 3]

    def __len__(self) -> int:
        CALLS["batch_sampler.__len__"] += 1
        return (self.n + 2) // 3


@shape
def custom_batch_sampler(t: Trace) -> None:
    dl = loader(batch_sampler=PairBatches(17), batch_size=1)
    with watch(dl) as batches:
        for epoch in range(2):
            for b in pick(dl, batches):
                t.batch(b)
            t.note("len", len(dl))


class Prebatched(Dataset):
    def __len__(self) -> int:
        if get_worker_info() is None:
            CALLS["Dataset.__len__"] += 1
        return 6

    def __getitem__(self, i: int) -> Any:
        return torch.full((4, 2), float(i)) + torch.rand(4, 2)


@shape
def batch_size_none(t: Trace) -> None:
    dl = loader(Prebatched(), batch_size=None, collate_fn=convert)
    with watch(dl) as batches:
        for b in pick(dl, batches):
            t.batch(b)


class Shards(IterableDataset):
    """Sharded by worker, unevenly: worker 0 gets 11 samples, worker 1 gets 4."""

    def __iter__(self) -> Iterator[Any]:
        info = get_worker_info()
        wid = info.id if info is not None else 0
        count = 11 if wid == 0 else 4
        for k in range(count):
            yield {"x": torch.tensor([wid, k]), "drawn": torch.rand(2)}


@shape
def iterable_uneven_shards(t: Trace) -> None:
    dl = loader(Shards(), batch_size=3)
    with watch(dl) as batches:
        for epoch in range(2):
            for b in pick(dl, batches):
                t.batch(b)


class Augment:
    def __init__(self) -> None:
        self.rng = np.random.default_rng(2)


class StatefulSamples(Samples):
    """RNG objects made in __init__ (each worker gets a copy with the same state) and a lazily
    opened resource behind a property: dlwatch's RNG fingerprints must read, never draw or open."""

    def __init__(self) -> None:
        super().__init__(16)
        self.py_rng = random.Random(1)
        self.np_state = np.random.RandomState(3)
        self.gen = torch.Generator().manual_seed(4)
        self.aug = Augment()

    @property
    def handle(self) -> str:
        _worker_count("handle")  # counted wherever it happens
        return "opened"

    def __getitem__(self, i: int) -> dict[str, Any]:
        sample = super().__getitem__(i)
        own = [
            self.py_rng.random(),
            float(self.np_state.rand()),
            float(torch.rand(1, generator=self.gen)),
            float(self.aug.rng.random()),
        ]
        sample["own"] = torch.tensor(own, dtype=torch.float64)
        return sample


@shape
def dataset_rng_objects(t: Trace) -> None:
    dl = loader(StatefulSamples())
    with watch(dl) as batches:
        for epoch in range(2):
            for b in pick(dl, batches):
                t.batch(b)


@shape
def persistent_workers(t: Trace) -> None:
    dl = loader(persistent_workers=True)
    with watch(dl) as batches:
        for epoch in range(3):
            for b in pick(dl, batches):
                t.batch(b)
    del dl


@shape
def zipped_loaders(t: Trace) -> None:
    a, b = loader(Samples(20)), loader(Samples(13), batch_size=2)
    with watch(a) as ba, watch(b) as bb:
        for epoch in range(2):
            for x, y in zip(pick(a, ba), pick(b, bb)):
                t.batch([x, y])


@shape
def background_thread(t: Trace) -> None:
    dl = loader()
    errors: list[BaseException] = []

    def consume(source: Any) -> None:
        try:
            for epoch in range(2):
                for b in source:
                    t.batch(b)
        except BaseException as exc:  # reported below, in the main thread
            errors.append(exc)

    with watch(dl) as batches:
        th = threading.Thread(target=consume, args=(pick(dl, batches),))
        th.start()
        th.join()
    for exc in errors:
        t.caught(exc)


@shape
def break_after_n(t: Trace) -> None:
    dl = loader(Samples(40))
    with watch(dl) as batches:
        for epoch in range(2):
            for i, b in enumerate(pick(dl, batches)):
                t.batch(b)
                if i == 2:
                    break


@shape
def peek_then_train(t: Trace) -> None:
    dl = loader()
    with watch(dl) as batches:
        first = next(iter(pick(dl, batches)))
        t.note("peek", digest(first))
        for epoch in range(2):
            for b in pick(dl, batches):
                t.batch(b)


@shape
def while_true_epochs(t: Trace) -> None:
    dl = loader(Samples(12))
    epoch = 0
    with watch(dl) as batches:
        while True:
            for b in pick(dl, batches):
                t.batch(b)
            epoch += 1
            if epoch == 4:
                break


@shape
def pin_memory(t: Trace) -> None:
    dl = loader(pin_memory=True)
    with watch(dl) as batches:
        for b in pick(dl, batches):
            t.batch(b)
            t.note("pinned", bool(b["x"].is_pinned()))


@shape
def worker_exception_caught(t: Trace) -> None:
    dl = loader(Samples(20, fail_at=9))  # the third batch (worker 0's second)
    with watch(dl) as batches:
        try:
            for i, b in enumerate(pick(dl, batches)):
                t.batch(b)
                if i == 1:
                    open_gate()
        except ValueError as exc:
            t.caught(exc)


@shape
def body_exception_caught(t: Trace) -> None:
    """The loop body raises; the program catches it outside the with block (the watch sees it leave)."""
    dl = loader()
    try:
        with watch(dl) as batches:
            for i, b in enumerate(pick(dl, batches)):
                t.batch(b)
                if i == 2:
                    raise KeyError("label 7 is not in the vocabulary")
    except KeyError as exc:
        t.caught(exc)


@shape
def collate_exception_caught(t: Trace) -> None:
    dl = loader(collate_fn=bad_collate)  # fails on each worker's second batch: the third and fourth
    with watch(dl) as batches:
        try:
            for i, b in enumerate(pick(dl, batches)):
                t.batch(b)
                if i == 1:
                    open_gate()
        except RuntimeError as exc:
            t.caught(exc)


@shape
def worker_init_exception_caught(t: Trace) -> None:
    dl = loader(worker_init_fn=bad_worker_init)
    with watch(dl) as batches:
        try:
            for b in pick(dl, batches):
                t.batch(b)
        except OSError as exc:
            t.caught(exc)


@shape
def nested_eval_loader(t: Trace) -> None:
    train, val = loader(Samples(16)), loader(Samples(8), batch_size=2)
    with watch(train) as batches:
        for i, b in enumerate(pick(train, batches)):
            t.batch(b)
            if i % 2 == 1:
                with watch(val) as vbatches:
                    for v in pick(val, vbatches):
                        t.batch(v)


@shape
def num_workers_0(t: Trace) -> None:
    dl = loader(num_workers=0)
    with watch(dl) as batches:
        for epoch in range(2):
            for b in pick(dl, batches):
                t.batch(b)


class LazyImports(Dataset):
    """Imports modules of the program's own directory lazily, as datasets do (see local_payload, local_helper)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> Any:
        CALLS["getitem"] += get_worker_info() is None
        if get_worker_info() is not None:
            import local_payload

            return local_payload.Value(i)
        import local_helper

        return local_helper.triple(i)


@shape
def lazy_local_imports(t: Trace) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    for workers in (2, 0):  # workers first: the main process has imported neither module yet
        dl = DataLoader(LazyImports(), batch_size=3, num_workers=workers, collate_fn=list)
        with watch(dl) as batches:
            for b in pick(dl, batches):
                t.batch(b)
    for name in ("local_payload", "local_helper"):
        module = sys.modules.get(name)
        t.note(name, os.path.relpath(module.__file__, here) if module is not None else None)


def _start_method(t: Trace, method: str) -> None:
    dl = loader(Samples(12), multiprocessing_context=method)
    with watch(dl) as batches:
        for b in pick(dl, batches):
            t.batch(b)


@shape
def spawn_context(t: Trace) -> None:
    _start_method(t, "spawn")


@shape
def forkserver_context(t: Trace) -> None:
    _start_method(t, "forkserver")


@shape
def accelerate_shard(t: Trace) -> None:
    """The real accelerate DataLoaderShard from Accelerator.prepare() (what HF Trainer iterates)."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)
    dl = acc.prepare(loader(Samples(18)))
    t.note("class", type(dl).__name__)
    with watch(dl) as batches:
        for epoch in range(2):
            for b in pick(dl, batches):
                t.batch(b)
                t.note("end_of_dataloader", acc.gradient_state.end_of_dataloader)
    t.note("iteration", dl.iteration)


@shape
def lightning_fit(t: Trace) -> None:
    """A real Lightning Trainer.fit on the CPU; Lightning iterates the loader itself (plain form only)."""
    import lightning as L

    class Tiny(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(3, 1)

        def training_step(self, batch: Any, index: int) -> Any:
            t.batch(batch)
            return self.lin(batch["x"]).pow(2).mean()

        def validation_step(self, batch: Any, index: int) -> None:
            t.note("val", digest(batch))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01)

    model = Tiny()
    dl = loader(Samples(16), persistent_workers=True)  # Lightning shuts these down itself at the end
    val = loader(Samples(6), batch_size=3)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with watch(dl):
        trainer.fit(model, dl, val)
    t.note("global_step", trainer.global_step)
    t.note("weights", digest(model.state_dict()))


@shape
def uncaught_worker_exception(t: Trace) -> None:
    dl = loader(Samples(20, fail_at=6))  # the second batch (worker 1's first)
    print("before the loop", flush=True)
    with watch(dl) as batches:
        for b in pick(dl, batches):
            print("batch", digest(b), flush=True)
            open_gate()


def main() -> None:
    names = sys.argv[2:]
    for name in names:
        if name.startswith("uncaught-"):
            os.environ[SHAPE_ENV] = name
            torch.manual_seed(0)
            SHAPES[name](Trace())  # lets the exception end the program
        else:
            run_shape(name)


if __name__ == "__main__":
    if MODE not in ("bare", "watch", "watch_as"):
        sys.exit(f"program.py: unknown mode {MODE!r} (bare, watch or watch_as)")
    main()
