"""Where torch warns about a loader itself, dlwatch keeps the finding and does not say it twice; where
torch cannot see the problem (a CUDA build with no GPU for pin_memory's advice), dlwatch still finds it.

Real DataLoaders with real workers, in fresh processes (the warnings and the affinity are the process's).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

from conftest import run_bounded

PROGRAM = textwrap.dedent(
    """
    import json, os, sys
    import torch
    from torch.utils.data import DataLoader, Dataset
    import dlwatch

    mode = sys.argv[2]
    if mode == "affinity":  # a cluster's cpuset: one CPU, three workers
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:1])
        loader = DataLoader(list(range(24)), batch_size=4, num_workers=3)
    else:  # "cuda-build": torch names cuda as its accelerator, yet has no device (as on a GPU-less node)
        torch.accelerator.current_accelerator = lambda *a, **k: torch.device("cuda")
        torch.accelerator.is_available = lambda: False
        loader = DataLoader(list(range(24)), batch_size=4, num_workers=1, pin_memory=True)
    with dlwatch.watch(loader, report_dir=sys.argv[1], poll_interval=0.2) as w:
        for _ in w:
            pass
    if w.summary is not None:
        print("PREFLIGHT", json.dumps([f["playbook"] for f in w.summary["preflight"]]))
        print("ADVICE", json.dumps([f["playbook"] for f in w.summary["advice"]]))
    """
)


def _run(tmp_path, mode, **extra):
    script = tmp_path / "program.py"
    script.write_text(PROGRAM)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_") and k != "PYTHONWARNINGS"}
    env["DLWATCH_QUIET"] = "1"
    env.update(extra)
    rc, out, err = run_bounded(
        [sys.executable, str(script), str(tmp_path / "reports"), mode], env=env, cwd=str(tmp_path), timeout=120
    )
    assert rc == 0, err[-3000:]
    if extra.get("DLWATCH_DISABLE"):
        return [], [], err
    lines = dict(line.split(" ", 1) for line in out.splitlines() if line.startswith(("PREFLIGHT", "ADVICE")))
    return json.loads(lines["PREFLIGHT"]), json.loads(lines["ADVICE"]), err


def test_too_many_workers_is_said_once_by_torch(tmp_path):
    preflight, advice, err = _run(tmp_path, "affinity")
    _, _, bare = _run(tmp_path, "affinity", DLWATCH_DISABLE="1")
    said = "This DataLoader will create 3 worker processes in total"
    assert err.count(said) == bare.count(said) >= 1  # torch's own, as often as in the bare run
    assert "dlwatch: too-many-workers" not in err  # not a second time
    assert "too-many-workers" in preflight  # the finding stays in the summary


def test_pin_memory_on_a_cuda_build_without_a_gpu(tmp_path):
    preflight, advice, err = _run(tmp_path, "cuda-build")
    assert "no accelerator is found" in err  # torch warns (its own check: is_available() is False)
    assert "pin-memory-without-cuda" in preflight and "pin-memory-without-cuda" in advice
    assert "dlwatch: pin-memory-without-cuda" not in err  # torch said it: no second warning
