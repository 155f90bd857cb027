"""Regression tests for issue 17 item 1: `dlwatch run` and DataLoader subclasses that call super().__iter__().

The run hook wraps DataLoader.__iter__; a subclass calling super().__iter__() reaches the hook from
inside its own __iter__, and a hook that called iter(loader) again re-entered the subclass: the
YOLOv5/timm infinite loader crashed at its first batch ("generator already executing") and a subclass
yielding from super().__iter__() ran its __iter__ twice per epoch.  Each test runs program.py's shape
bare and under `dlwatch run`, and checks the program did the same, and was watched.
"""

from __future__ import annotations

import os

import pytest

from transparency.harness import comparable, differences, printed, run_program

pytestmark = pytest.mark.timeout(300)


def _bare_and_run(shape: str, tmp_path):
    bare = run_program("bare", (shape,), str(tmp_path))
    run = run_program("run", (shape,), str(tmp_path))
    assert bare.rc == 0 and shape in bare.traces, bare.stderr[-3000:]
    assert not bare.left and not run.left, (bare.left, run.left)
    assert run.rc == 0, f"exit code {run.rc} under dlwatch run:\n{run.stderr[-3000:]}"
    assert shape in run.traces, run.stderr[-3000:]
    # and dlwatch did watch it: each watched iteration writes a run summary
    summaries = tmp_path / "reports-run" / "runs"
    assert summaries.is_dir() and os.listdir(summaries), "dlwatch run watched no iteration"
    return bare, run


def test_infinite_loader_under_run(tmp_path):
    bare, run = _bare_and_run("infinite-loader", tmp_path)
    expected, got = bare.traces["infinite-loader"], run.traces["infinite-loader"]
    assert len(expected["batches"]) == 15 and expected["escaped"] is None  # three epochs of five batches
    assert got["escaped"] is None, f"the program crashed under dlwatch run: {got['escaped']}"
    assert "generator already executing" not in run.stdout + run.stderr
    diff = differences(comparable(expected), comparable(got))
    assert not diff, "\n".join(diff)


def test_super_iter_subclass_runs_once_under_run(tmp_path):
    bare, run = _bare_and_run("super-iter-subclass", tmp_path)
    logged = [line for line in run.stdout.splitlines() if line.startswith("LoggingLoader.__iter__ call")]
    # two epochs: the subclass's __iter__ ran twice, not four times
    assert logged == ["LoggingLoader.__iter__ call 1", "LoggingLoader.__iter__ call 2"], logged
    got = run.traces["super-iter-subclass"]
    assert got["calls"]["LoggingLoader.__iter__"] == 2 and got["calls"]["LoggingLoader.step"] == 10, got["calls"]
    assert printed(run.stdout) == printed(bare.stdout)
    diff = differences(comparable(bare.traces["super-iter-subclass"]), comparable(got))
    assert not diff, "\n".join(diff)
