"""Advice is judged on what it is about: the same data for the sampler's epoch (not every loader of
the program pooled), a steady pattern for input-bound (not one long pause).

Real programs under `dlwatch run` (one monitor for the whole program: what pooled the loaders).
"""

from __future__ import annotations

import json
import os
import sys
import textwrap

from conftest import run_bounded

SAMPLERS = textwrap.dedent(
    """
    import sys
    import torch
    from torch.utils.data import DataLoader, Dataset
    from torch.utils.data.distributed import DistributedSampler

    class Task(Dataset):
        def __init__(self, n):
            self.n = n
        def __len__(self):
            return self.n
        def __getitem__(self, i):
            return torch.tensor([i])

    def loader(ds):
        return DataLoader(ds, batch_size=4, sampler=DistributedSampler(ds, num_replicas=1, rank=0, shuffle=True))

    if sys.argv[1] == "eight":  # eight validation sets, each its own loader and sampler, each iterated once
        for task in range(8):
            for _ in loader(Task(16 + task)):
                pass
    elif sys.argv[1] == "fresh":  # one dataset, a new loader and sampler each epoch, never set_epoch: same order
        ds = Task(16)
        orders = [[int(b) for batch in loader(ds) for b in batch] for _ in range(3)]
        print("same order:", orders[0] == orders[1] == orders[2])
    print("done")
    """
)


def _run_program(tmp_path, source: str, *args: str) -> tuple[str, list[dict]]:
    script = tmp_path / "program.py"
    script.write_text(source)
    reports = tmp_path / "reports"
    env = {k: v for k, v in os.environ.items() if not k.startswith("DLWATCH_")}
    env["DLWATCH_QUIET"] = "1"
    rc, out, err = run_bounded(
        [sys.executable, "-m", "dlwatch", "run", "--report-dir", str(reports), str(script), *args],
        env=env,
        cwd=str(tmp_path),
        timeout=120,
    )
    assert rc == 0, err[-3000:]
    runs = reports / "runs"
    summaries = [json.loads((runs / d / "summary.json").read_text()) for d in sorted(os.listdir(runs))]
    return out, summaries


def _advice_ids(summaries: list[dict]) -> list[str]:
    return [a["playbook"] for s in summaries for a in s.get("advice") or ()]


def test_different_loaders_each_iterated_once_are_not_one_sampler(tmp_path):
    out, summaries = _run_program(tmp_path, SAMPLERS, "eight")
    assert "done" in out and len(summaries) == 1
    assert len(summaries[0]["iterations"]) == 8  # every loader was watched
    assert "sampler-epoch-not-set" not in _advice_ids(summaries)


def test_one_dataset_reordered_by_a_fresh_sampler_each_epoch_is_advised(tmp_path):
    out, summaries = _run_program(tmp_path, SAMPLERS, "fresh")
    assert "same order: True" in out  # the program's own check: the bug is real
    (advice,) = [a for s in summaries for a in s.get("advice") or () if a["playbook"] == "sampler-epoch-not-set"]
    ev = advice["evidence"]
    assert ev["epochs_started"] == 3 and ev["sampler_epoch_each_epoch"] == [0, 0, 0]
