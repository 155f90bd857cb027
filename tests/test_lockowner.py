"""The holder of the lock the deadlocked workers wait on, from the fork record (pure judgement).

Real shapes as source files: a dataset's cache refresher inside ``with self.lock`` (idle on an
Event inside it: still the holder), a metrics thread with ``acquire()/try/finally release()``,
a wrapper method (``def acquire(self): self._lock.acquire()``), and the look-alikes that must
give ``unknown``: threads merely idle elsewhere, two threads in regions of the same lock, a lock
whose source cannot be read.
"""

from __future__ import annotations

import textwrap

from dlwatch.collect.source import read_source, text_outlines
from dlwatch.detect.lockowner import acquire_site, find_holder, regions

OUTLINES = text_outlines(read_source)  # the files below are this test's own: parsed in-process

DATASET = textwrap.dedent(
    """\
    import threading

    class CachedSamples:
        def __init__(self):
            self.lock = threading.Lock()
            self.cache = {}

        def __getitem__(self, i):
            with self.lock:
                return self.cache.setdefault(i, i)

        def refresh(self, release):
            with self.lock:
                release.wait()
                self.cache.clear()

        def idle_elsewhere(self, stop):
            stop.wait()
    """
)

METRICS = textwrap.dedent(
    """\
    import threading

    class Metrics:
        def __init__(self):
            self._lock = threading.Lock()
            self.values = []

        def acquire(self):
            self._lock.acquire()

        def release(self):
            self._lock.release()

        def add(self, v):
            self.acquire()
            try:
                self.values.append(v)
            finally:
                self.release()

        def flush(self, sink):
            self._lock.acquire()
            try:
                sink.send(list(self.values))
            finally:
                self._lock.release()
    """
)


def frame(path, line, function):
    return {"filename": str(path), "line": line, "function": function}


def thread(name, *frames, idle=None):
    return {"name": name, "frames": list(frames), "idle": idle}


def test_the_refresher_idle_inside_the_lock_is_named(tmp_path):
    ds = tmp_path / "dataset.py"
    ds.write_text(DATASET)
    worker = [frame(ds, 9, "CachedSamples.__getitem__"), frame("/usr/lib/python3/torch/x.py", 1, "fetch")]
    site = acquire_site(worker, OUTLINES)
    assert site == {
        "expr": "self.lock",
        "exprs": ["self.lock"],
        "filename": str(ds),
        "line": 9,
        "function": "CachedSamples.__getitem__",
    }
    threads = [
        thread(
            "cache-refresher",
            frame("/usr/lib/python3.11/threading.py", 320, "wait"),
            frame(ds, 14, "refresh"),
            idle="wait (threading.py)",
        ),
        thread(
            "heartbeat",
            frame("/usr/lib/python3.11/threading.py", 320, "wait"),
            frame(ds, 18, "idle_elsewhere"),
            idle="wait (threading.py)",
        ),
    ]
    got = find_holder(site, threads, OUTLINES)
    h = got["holder"]
    assert h["name"] == "cache-refresher" and h["line"] == 14 and h["function"] == "refresh"
    assert h["lock"] == "self.lock" and h["region_line"] == 13
    assert [a["name"] for a in got["alive"]] == ["cache-refresher", "heartbeat"]


def test_acquire_try_finally_release_and_a_wrapper_are_regions(tmp_path):
    m = tmp_path / "metrics.py"
    m.write_text(METRICS)
    kinds = {(r.expr, r.start) for r in regions(__import__("ast").parse(METRICS))}
    assert ("self", 15) in kinds or ("self._lock", 22) in kinds
    # the worker waits inside the wrapper acquire(): its caller's `self.acquire()` takes the same lock
    worker = [frame(m, 9, "Metrics.acquire"), frame(m, 15, "Metrics.add")]
    site = acquire_site(worker, OUTLINES)
    assert site["expr"] == "self._lock" and site["exprs"] == ["self._lock", "self"] and site["caller"]["line"] == 15
    got = find_holder(site, [thread("metrics-flusher", frame(m, 17, "add"))], OUTLINES)
    assert got["holder"]["name"] == "metrics-flusher" and got["holder"]["lock"] == "self"
    # ... and a holder inside the direct form's region of the wrapped lock is found from the same site
    got = find_holder(site, [thread("flusher", frame(m, 24, "flush"))], OUTLINES)
    assert got["holder"]["name"] == "flusher" and got["holder"]["lock"] == "self._lock"
    # the direct form: _lock.acquire() ... finally: _lock.release()
    site = acquire_site([frame(m, 22, "Metrics.flush")], OUTLINES)
    assert site["expr"] == "self._lock"
    got = find_holder(site, [thread("uploader", frame("/x/socket.py", 1, "send"), frame(m, 24, "flush"))], OUTLINES)
    assert got["holder"]["name"] == "uploader" and got["holder"]["line"] == 24


def test_idle_threads_elsewhere_two_holders_and_unreadable_source_say_unknown(tmp_path):
    ds = tmp_path / "dataset.py"
    ds.write_text(DATASET)
    site = acquire_site([frame(ds, 9, "CachedSamples.__getitem__")], OUTLINES)
    idle = [thread("heartbeat", frame(ds, 18, "idle_elsewhere"), idle="wait (threading.py)")]
    got = find_holder(site, idle, OUTLINES)
    assert got["holder"] is None and got["alive"][0]["name"] == "heartbeat" and "no thread" in got["basis"]
    two = [thread("a", frame(ds, 14, "refresh")), thread("b", frame(ds, 15, "refresh"))]
    got = find_holder(site, two, OUTLINES)
    assert got["holder"] is None and [c["name"] for c in got["candidates"]] == ["a", "b"]
    gone = {"expr": "self.lock", "filename": str(tmp_path / "missing.py"), "line": 9}
    assert find_holder(gone, two, OUTLINES)["holder"] is None


def test_source_is_read_only_as_a_regular_file_of_the_user(tmp_path):
    ds = tmp_path / "dataset.py"
    ds.write_text(DATASET)
    link = tmp_path / "link.py"
    link.symlink_to(ds)
    assert read_source(str(ds)) == DATASET
    assert read_source(str(link)) is None  # never through a link
    fifo = tmp_path / "pipe.py"
    __import__("os").mkfifo(fifo)
    assert read_source(str(fifo)) is None  # never blocks on a FIFO
    other = tmp_path / "theirs.py"
    other.write_text(DATASET)
    __import__("os").chown(other, 12345, 12345)  # root here: another user's file
    assert read_source(str(other), uid=12345) == DATASET
    assert read_source(str(other), uid=23456) is None  # not the target's and not root's: not read
    assert read_source("relative.py") is None


def test_the_fork_record_keeps_no_frame_of_its_callers_alive():
    """The snapshot must leave no reference cycle through the frames above it: those frames hold the
    iterator being built, and a worker forked before the collector ran would inherit that garbage and
    run torch's ``__del__`` on it ("can only test a child process", seen under `dlwatch run`)."""
    import gc
    import threading
    import weakref

    from dlwatch.inproc import forkthreads

    class Payload:
        pass

    def caller() -> "weakref.ref[Payload]":
        payload = Payload()  # stands for the iterator in the frames above the snapshot
        ref = weakref.ref(payload)
        forkthreads.snapshot()
        return ref

    stop = threading.Event()
    other = threading.Thread(target=stop.wait, name="other", daemon=True)  # a second thread to walk
    other.start()
    was = gc.isenabled()
    gc.disable()
    try:
        for _ in range(3):
            assert caller()() is None  # freed as caller returned: by its reference count, not the collector
    finally:
        if was:
            gc.enable()
        stop.set()
        other.join(5)


def test_a_thread_of_a_shipped_example_is_recorded_and_dlwatchs_own_is_not():
    """`pip install .` ships examples/ as dlwatch._examples, inside the package: `dlwatch demo` runs the
    deadlock example from there, and its refresher thread (the lock's holder) must be recorded like any
    program's, while a thread in dlwatch's own code stays out of the record."""
    import os
    import threading

    from dlwatch.inproc import forkthreads

    package = os.path.dirname(os.path.dirname(os.path.abspath(forkthreads.__file__)))
    stop = threading.Event()
    started = []
    for name, filename in (
        ("example-refresher", os.path.join(package, "_examples", "deadlock.py")),
        ("dlwatch-own", os.path.join(package, "inproc", "agent.py")),
    ):
        code = compile("def run(stop):\n    stop.wait(30)\n", filename, "exec")  # frames that name the file
        scope: dict = {}
        exec(code, scope)
        t = threading.Thread(target=scope["run"], args=(stop,), name=name, daemon=True)
        t.start()
        started.append(t)
    try:
        assert all(t.is_alive() for t in started)
        recorded = {t["name"]: t for t in forkthreads.snapshot()}
        assert "example-refresher" in recorded, sorted(recorded)
        files = [f["filename"] for f in recorded["example-refresher"]["frames"]]
        assert os.path.join(package, "_examples", "deadlock.py") in files, files
        assert "dlwatch-own" not in recorded, sorted(recorded)
    finally:
        stop.set()
        for t in started:
            t.join(5)
