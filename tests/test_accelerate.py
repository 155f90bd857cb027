"""accelerate's prepared loader (a DataLoaderShard wraps the DataLoader and answers `__class__` with its
class): both forms of watch() watch it, and under `dlwatch run` a loader the program watches itself is
watched once.  Real accelerate, real workers, real processes."""

from __future__ import annotations

import json
import os
import sys
import textwrap

import pytest

from conftest import run_bounded

pytest.importorskip("accelerate", reason="accelerate is not installed (pip install accelerate)")

PROGRAM = textwrap.dedent(
    """
    import json, sys
    from torch.utils.data import DataLoader
    from accelerate import Accelerator
    import dlwatch

    prepared = Accelerator(cpu=True).prepare(DataLoader(list(range(40)), batch_size=4, num_workers=2))
    with dlwatch.watch(prepared, report_dir=sys.argv[1]) as w:
        if sys.argv[2] == "plain":
            seen = [b.tolist() for b in prepared]
        else:
            seen = [b.tolist() for b in w]
    print("BATCHES", json.dumps(seen))
    print("SUMMARY", json.dumps((w.summary or {}).get("loop")))
    """
)


def _run(tmp_path, form, *prefix):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_")}
    env["DLWATCH_QUIET"] = "1"
    rc, out, err = run_bounded(
        [sys.executable, *prefix, str(script), str(tmp_path / "watch"), form], env=env, cwd=str(tmp_path), timeout=180
    )
    assert rc == 0, err[-3000:]
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("BATCHES", "SUMMARY")))
    return json.loads(lines["BATCHES"]), json.loads(lines["SUMMARY"]), err


def _summaries(d):
    runs = os.path.join(d, "runs")
    return sorted(os.listdir(runs)) if os.path.isdir(runs) else []


@pytest.mark.parametrize("form", ["plain", "as"])
def test_a_prepared_loader_is_watched_in_both_forms(tmp_path, form):
    batches, loop, err = _run(tmp_path, form)
    assert batches == [list(range(i, i + 4)) for i in range(0, 40, 4)]  # the same batches as bare
    assert loop is not None and loop["batches"] == 10  # watched: every batch counted
    assert "cannot be watched in place" not in err


def test_under_dlwatch_run_a_loader_the_program_watches_is_watched_once(tmp_path):
    batches, loop, err = _run(tmp_path, "as", "-m", "dlwatch", "run", "--report-dir", str(tmp_path / "run"))
    assert loop["batches"] == 10
    assert len(_summaries(str(tmp_path / "watch"))) == 1
    assert _summaries(str(tmp_path / "run")) == []  # dlwatch run left it to the program's own watch
