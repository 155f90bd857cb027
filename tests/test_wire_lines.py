"""The hand-written lines of the per-iteration path are the general path's bytes.

dlwatch writes its events through one path (``redact.outbound`` then JSON).  In a process that
has just forked (the training process as its DataLoader workers start, and each worker) that
path touched a hundred pages, each a copy-on-write fault, so three writers take shortcuts:
``_fs.dumps`` (json.dumps's text, written out), ``events.LineFormat`` (a %-template for events
of numbers) and the worker's ``worker_registered`` template.  Each must give the very bytes of
the general path, and fall back to it for anything it was not proven on.
"""

from __future__ import annotations

import json
import os
import random

import pytest

from dlwatch import _fs
from dlwatch.inproc import worker_hook
from dlwatch.wire import events


def _value(r: random.Random, depth: int = 0):
    kind = r.randrange(9 if depth < 4 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return r.choice([True, False])
    if kind == 2:
        return r.choice([0, -1, 7, r.randrange(-(10**20), 10**20)])
    if kind == 3:
        return r.choice(
            [r.random() * 10 ** r.randrange(-30, 30), float("nan"), float("inf"), -float("inf"), -0.0, 1e16, 0.1]
        )
    if kind == 4:  # ASCII, control characters, quotes, backslashes, non-ASCII and lone surrogates
        pool = ['"', "\\", "\n", "\x00", "\x7f", "é", "\u2028", "\ud800", "😀", "a", "%", " "]
        return "".join(r.choice(pool) for _ in range(r.randrange(6)))
    if kind in (5, 6):
        return [_value(r, depth + 1) for _ in range(r.randrange(4))]
    return {str(_value(r, 4)): _value(r, depth + 1) for _ in range(r.randrange(4))}


def test_dumps_is_json_dumps_on_random_plain_data():
    r = random.Random(20261202)  # fixed: the same cases in every run
    for _ in range(5000):
        obj = _value(r)
        assert _fs.dumps(obj) == json.dumps(obj)


def test_dumps_hands_anything_else_to_json():
    class Num(int):
        pass

    for obj in ({1: "int key"}, (1, 2), {"n": Num(3)}, [1.5, (2,)]):
        assert _fs.dumps(obj) == json.dumps(obj)
    with pytest.raises(TypeError):  # what json refuses is refused the same way
        _fs.dumps({"x": object()})


ITER_END = (
    ("iteration", events.INT),
    ("loader", "loader2"),
    ("batches", events.INT),
    ("data_wait_s", events.FLOAT),
    ("worker_pids", events.INTS),
)


def _lines(path):
    with open(path, "rb") as fh:
        return fh.read().splitlines(keepends=True)


def test_line_format_writes_emits_bytes_and_falls_back_for_what_it_was_not_proven_on(tmp_path):
    fmt = events.LineFormat("loader_iter_end", ITER_END)
    assert fmt.template is not None
    path = str(tmp_path / "events.jsonl")
    cases = [
        dict(iteration=3, batches=4, data_wait_s=0.123456, worker_pids=[11, 12]),
        dict(iteration=3, batches=0, data_wait_s=0, worker_pids=[]),  # an int in a float slot: json writes 0 too
        dict(iteration=3, batches=True, data_wait_s=1.0, worker_pids=[1]),  # a bool: json's true
        dict(iteration=3, batches=2, data_wait_s=float("nan"), worker_pids=[1]),  # NaN: json's NaN
        dict(iteration=3, batches=2.5, data_wait_s=1.0, worker_pids=[1]),  # a float in an int slot
        dict(iteration=3, batches=2, data_wait_s=1.0, worker_pids=[1, "x"]),
    ]
    for values in cases:
        assert fmt.emit(path, **values)
    for line, values in zip(_lines(path), cases):
        got = json.loads(line)
        record = {"ts": got["ts"], "event": "loader_iter_end", "pid": os.getpid()}
        record.update(iteration=3, loader="loader2")
        record.update({k: v for k, v in values.items() if k != "iteration"})
        record = {k: record[k] for k in ("ts", "event", "pid", "iteration", "loader", *list(values)[1:])}
        assert line == _fs.json_line(record)


def test_line_format_escapes_its_constants_and_is_not_used_where_redaction_would_change_them(tmp_path):
    odd = events.LineFormat("x%d", [("k%s", 'v%r"é'), ("n", events.INT)])
    assert odd.template is not None
    path = str(tmp_path / "e.jsonl")
    odd.emit(path, n=5)
    got = json.loads(_lines(path)[0])
    assert (got["event"], got["k%s"], got["n"]) == ("x%d", 'v%r"é', 5)
    secret = events.LineFormat("x", [("password", "hunter2"), ("n", events.INT)])  # redaction masks it
    assert secret.template is None
    secret.emit(path, n=1)
    assert b"hunter2" not in _lines(path)[1] and json.loads(_lines(path)[1])["n"] == 1


@pytest.mark.parametrize("start_method", ["fork", "spawn", None])
def test_worker_registered_template_is_emits_line(tmp_path, start_method):
    hook = worker_hook.WorkerHook(None, str(tmp_path / "ev"), str(tmp_path), start_method, 1)
    line = hook._line
    assert line is not None
    dump_dir = os.path.join(str(tmp_path), "dumps")
    for dump_path in (None, os.path.join(dump_dir, f"{os.getpid()}.txt")):
        for crash in (None, "dlwatch", "program", "none"):
            got = line.format(1, 99, dump_path, crash)
            record = {
                "ts": json.loads(got)["ts"],
                "event": "worker_registered",
                "pid": os.getpid(),
                "worker_id": 1,
                "start_method": start_method,
                "ppid": 99,
                "dump_path": dump_path,
                "crash_output": crash,
            }
            assert got == _fs.json_line(record)


def test_worker_registered_template_is_refused_where_redaction_touches_the_path(tmp_path):
    run_dir = tmp_path / "api_key=sk-live-0123456789abcdef0123"
    hook = worker_hook.WorkerHook(None, str(tmp_path / "ev"), str(run_dir), "fork", 1)
    assert hook._line is None  # the worker then emits the general way, redacted
