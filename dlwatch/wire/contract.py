"""The event contract: every event the training process or a DataLoader worker sends, declared once.

Each declaration names the event, who sends it, and its fields with their kinds; both sides use
it.  The senders (``dlwatch/inproc``) write ``events.emit(path, contract.STOP.name, ...)`` (or
the name the declaration holds), and the per-iteration events keep their %-templates
(``events.LineFormat``); the monitor's handler table (``dlwatch/monitor/loop.py``), the reader's
checks of the watch's own events (``events.normalize``) and a failure's event schemas
(``dlwatch.detect.registry``: ``Failure.events``) are keyed by these declarations.

Nothing here runs on the hot path: a declaration is data.  An event that is not declared is
still written and read (``emit`` never raises into the training process, and the monitor passes
an unknown event to the timeline), but ``tests/test_contract.py`` fails on it: it checks the
lines of real runs (both ``watch()`` forms and ``dlwatch run``) against these declarations,
every emit site of ``inproc`` by reading its source, and that every event the monitor handles
is one somebody sends.

Every line also carries ``ts`` (a float, ``time.time()``), ``event`` and ``pid`` (the sender's),
added by ``events.emit``: they are not listed per event.
"""

from __future__ import annotations

from typing import Any, Mapping

__all__ = [
    "ADVICE",
    "AF_UNIX_PATH",
    "BATCH_BYTES",
    "BATCH_SHAPE",
    "COMMON",
    "EVENTS",
    "EXCEPTION",
    "Event",
    "FORK_THREADS",
    "Field",
    "INTERRUPT",
    "KINDS",
    "LOADER_ITER",
    "LOADER_ITER_END",
    "LOADER_WORKERS",
    "NESTED_WATCH",
    "RNG_FINGERPRINT",
    "SAMPLER_EPOCH",
    "STOP",
    "THREAD_DIED",
    "EPOCH_ENDED",
    "TRAINING",
    "WORKER",
    "WORKER_EXITS",
    "WORKER_REGISTERED",
    "by_name",
    "problems",
]

TRAINING = "training"  # the training process (its main thread, or a thread of it)
WORKER = "worker"  # a DataLoader worker process

# What a field's value may be, as JSON gives it back: "int" (not a bool), "number" (int or float,
# not a bool), "bool", "str", "key" (an int or a str: an identifier), "ints" (a list of ints),
# "list", "object" (a JSON object), "any".
KINDS = frozenset({"int", "number", "bool", "str", "key", "ints", "list", "object", "any"})


class Field:
    """One field of an event: its name, its kind, whether it may be absent or null."""

    __slots__ = ("name", "kind", "optional", "nullable")

    def __init__(self, name: str, kind: str, optional: bool = False, nullable: bool = False) -> None:
        self.name, self.kind, self.optional, self.nullable = name, kind, optional, nullable

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.nullable
        return _is(self.kind, value)

    def __repr__(self) -> str:
        return f"Field({self.name!r}, {self.kind!r}, optional={self.optional}, nullable={self.nullable})"


class Event:
    """One event: its name, who sends it, its fields (beyond ``COMMON``) and what it is for.

    A declaration is made once, here, and compared by identity (the handler tables are keyed by
    it).  Plain slotted classes, not dataclasses: the training process imports this module, and
    a dataclass's generated methods cost a millisecond there for nothing.
    """

    __slots__ = ("name", "senders", "fields", "about", "extra")

    def __init__(
        self, name: str, senders: tuple[str, ...], fields: tuple[Field, ...], about: str, extra: bool = False
    ) -> None:
        self.name, self.senders, self.fields, self.about = name, senders, fields, about
        self.extra = extra  # carries further keys beyond those declared (a probe's evidence)

    def field(self, name: str) -> Field | None:
        return next((f for f in self.fields if f.name == name), None)

    def __repr__(self) -> str:
        return f"<event {self.name}>"


def _f(name: str, kind: str, *, optional: bool = False, nullable: bool = False) -> Field:
    return Field(name, kind, optional, nullable)


def _is(kind: str, value: Any) -> bool:
    if kind == "any":
        return True
    if kind == "bool":
        return type(value) is bool
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "key":
        return isinstance(value, str) or (isinstance(value, int) and not isinstance(value, bool))
    if kind == "ints":
        return isinstance(value, list) and all(_is("int", v) for v in value)
    if kind == "list":
        return isinstance(value, list)
    return isinstance(value, dict)  # "object"


COMMON = (_f("ts", "number"), _f("event", "str"), _f("pid", "int"))

# ---------------------------------------------------------------------------- the watch's own

STOP = Event(
    "stop",
    (TRAINING,),
    (_f("clean", "bool"), _f("interrupted", "bool"), _f("ended", "str", optional=True)),
    "the block (or, under `dlwatch run`, the program) ends; `ended` only under `dlwatch run`",
)
EXCEPTION = Event(
    "exception",
    (TRAINING,),
    (_f("exception", "object"),),
    "an exception left the block or a loader iteration: type, message, errno, traceback, from_loader",
)
INTERRUPT = Event(
    "interrupt",
    (TRAINING,),
    (
        _f("seq", "int"),
        _f("where", "str"),
        _f("first_batch", "bool"),
        _f("waited_s", "number"),
        _f("thread", "str"),
        _f("frames", "list"),
        _f("frames_omitted", "int"),
    ),
    "a Ctrl-C after a long wait (dlwatch.wire.interrupt): the training process waits for the monitor's answer",
)
NESTED_WATCH = Event(
    "nested_watch",
    (TRAINING,),
    (_f("run_dir", "str"), _f("monitor_pid", "int", nullable=True)),
    "a watch started in this watch's loop body: its heartbeat's progress is this loop's",
)
LOADER_WORKERS = Event(
    "loader_workers",
    (TRAINING,),
    (_f("pids", "ints"), _f("iteration", "int", optional=True), _f("loader", "str", optional=True)),
    "the pids of the watched iterator's workers, as they start (iteration and loader under `dlwatch run`)",
)
LOADER_ITER = Event(
    "loader_iter",
    (TRAINING,),
    (
        _f("iteration", "int"),
        _f("loader", "str"),
        _f("name", "str", nullable=True),
        _f("config", "object", nullable=True),
    ),
    "`dlwatch run`: a loader iteration (a segment of the program) begins, before its workers start",
)
LOADER_ITER_END = Event(
    "loader_iter_end",
    (TRAINING,),
    (
        _f("iteration", "int"),
        _f("loader", "str"),
        _f("batches", "int"),
        _f("data_wait_s", "number"),
        _f("first_batch_s", "number"),
        _f("active_s", "number"),
        _f("wall_s", "number"),
        _f("worker_pids", "ints"),
    ),
    "`dlwatch run`: a loader iteration ends, with its figures (a %-template: events.LineFormat)",
)
BATCH_BYTES = Event(
    "batch_bytes",
    (TRAINING,),
    (_f("batch_bytes", "int"),),
    "the size of the first batch measured (the need of /dev/shm and fds is judged on it)",
)
ADVICE = Event(
    "advice",
    (TRAINING,),
    (
        _f("playbook", "str"),
        _f("confidence", "number", optional=True),
        _f("stage", "str", optional=True),
    ),
    "a finding for the run summary, never an incident (preflight checks: stage `preflight`), with its evidence",
    extra=True,
)
WORKER_REGISTERED = Event(
    "worker_registered",
    (WORKER,),
    (
        _f("worker_id", "int"),
        _f("start_method", "str", nullable=True),
        _f("ppid", "int"),
        _f("dump_path", "str", nullable=True),
        _f("crash_output", "str", nullable=True),
    ),
    "a worker started (the worker hook): where its stacks go on a signal and on a fatal one",
)

# ---------------------------------------------------------------------------- a failure's own
# (the module of dlwatch/detect/ that judges it declares its schema: registry.Failure.events)

RNG_FINGERPRINT = Event(
    "rng_fingerprint",
    (WORKER,),
    (
        _f("worker_id", "int"),
        _f("epoch", "int"),
        _f("stage", "str"),
        _f("fingerprints", "object"),
        _f("states", "list"),
        _f("drawn", "list", optional=True),
        _f("rebound", "list", optional=True),
    ),
    "a worker's RNG states by path, after worker_init_fn and after its first batch",
)
FORK_THREADS = Event(
    "fork_threads",
    (TRAINING,),
    (_f("pids", "ints"), _f("forks", "list")),
    "the other threads alive (and their frames) as each worker forked",
)
WORKER_EXITS = Event(
    "worker_exits",
    (TRAINING,),
    (_f("exitcodes", "object"),),
    "{pid: exit code} of the workers of the iterators in an exception's traceback",
)
SAMPLER_EPOCH = Event(
    "sampler_epoch",
    (TRAINING,),
    (
        _f("sampler", "str"),
        _f("sampler_epoch", "int"),
        _f("dataset_ref", "key"),  # the same number for the same dataset object (preflight.dataset_ref)
        _f("shuffle", "bool", nullable=True),
        _f("seed", "int", nullable=True),
        _f("num_replicas", "int", nullable=True),
    ),
    "an epoch's iterator is made over a sampler with set_epoch: the epoch it holds",
)
BATCH_SHAPE = Event(
    "batch_shape",
    (TRAINING,),
    (_f("signal", "str"), _f("batch_index", "int"), _f("leaf", "str"), _f("multiple", "int")),
    "the batch check found a tensor whose leading dim is a multiple of the batch size, with its evidence",
    extra=True,
)

THREAD_DIED = Event(
    "thread_died",
    (TRAINING,),
    (
        _f("thread", "str"),
        _f("daemon", "bool"),
        _f("exc_type", "str"),
        _f("message", "str"),
        _f("frames", "list"),
    ),
    "a thread of the training process died with an exception (threading.excepthook): a producer thread",
)

EPOCH_ENDED = Event(
    "epoch_ended",
    (TRAINING,),
    (
        _f("batches", "int"),
        _f("asked_len", "int"),  # what the program's own len(loader) returned (dlwatch never asks it)
        _f("iterable", "bool"),
        _f("drop_last", "bool"),
        _f("epoch", "int", nullable=True),
    ),
    "an epoch's iterator ended (StopIteration) and the program had asked len(loader): the batches it gave",
)

AF_UNIX_PATH = Event(
    "af_unix_path",
    (TRAINING,),
    (
        _f("socket", "str"),  # whose: multiprocessing (its listener) or torch_shm_manager
        _f("path_len", "int"),
        _f("path_max", "int"),
        _f("base", "str"),
        _f("sharing_strategy", "str", nullable=True),
        _f("start_method", "str", nullable=True),
        _f("batches", "int", nullable=True),  # the run's batches when the iterator started
    ),
    "as an iterator starts its workers: the socket path they will bind to send a batch is too long for Linux",
)

EVENTS: Mapping[str, Event] = {
    e.name: e
    for e in (
        STOP,
        EXCEPTION,
        INTERRUPT,
        NESTED_WATCH,
        LOADER_WORKERS,
        LOADER_ITER,
        LOADER_ITER_END,
        BATCH_BYTES,
        ADVICE,
        WORKER_REGISTERED,
        RNG_FINGERPRINT,
        FORK_THREADS,
        WORKER_EXITS,
        SAMPLER_EPOCH,
        BATCH_SHAPE,
        THREAD_DIED,
        EPOCH_ENDED,
        AF_UNIX_PATH,
    )
}


def by_name(name: str) -> Event | None:
    return EVENTS.get(name)


def problems(record: Mapping[str, Any]) -> list[str]:
    """What in one event's line does not keep the contract (empty when it does): an undeclared
    event, a declared field missing or of another kind, a field the declaration does not name."""
    out = [f"{f.name}: {record.get(f.name)!r} is not {f.kind}" for f in COMMON if not f.accepts(record.get(f.name))]
    name = record.get("event")
    decl = EVENTS.get(name) if isinstance(name, str) else None
    if decl is None:
        return [*out, f"event {name!r} is not declared in dlwatch.wire.contract"]
    for f in decl.fields:
        if f.name not in record:
            if not f.optional:
                out.append(f"{name}: field {f.name!r} missing")
        elif not f.accepts(record[f.name]):
            out.append(f"{name}: field {f.name!r} = {record[f.name]!r:.80} is not {f.kind}")
    if not decl.extra:
        known = {f.name for f in COMMON} | {f.name for f in decl.fields}
        out += [f"{name}: field {k!r} is not declared" for k in record if k not in known]
    return out
