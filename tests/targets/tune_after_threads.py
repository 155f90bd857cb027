"""dlwatch.tune in a process that has (or has not) run a parallel region of torch's before the tune.

usage: tune_after_threads.py threads|fresh

``threads`` first runs one large tensor op (as building a model does), so that torch's OpenMP
runtime holds a team of threads a fork does not copy.  The loader's dataset makes a 4 MiB tensor a
sample in whatever process loads it (num_workers=0: the candidate's own).  Prints one JSON line:
whether a fork could use the intra-op threads (before the tune), the loader's own row's status, the
recommendation and the tune's notes.
"""

import json
import sys

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from dlwatch.tuning import forkprobe


class Large(Dataset):
    def __len__(self) -> int:
        return 100_000

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((1 << 20,), float(i))


if __name__ == "__main__":
    if sys.argv[1] == "threads":
        torch.full((1 << 22,), 1.0).sum()
    probe = forkprobe.fork_can_use_intra_op_threads()
    res = dlwatch.tune(DataLoader(Large(), batch_size=4), budget_s=6, max_workers=2)
    own = next(r for r in res.rows if r.config.num_workers == 0 and not r.config.pin_memory)
    print(
        json.dumps(
            {
                "fork_threads_ok": probe,
                "threads": torch.get_num_threads(),
                "own_status": own.status,
                "own_rate": own.batches_per_s,
                "recommended": res.recommended is not None,
                "notes": list(res.notes),
            }
        ),
        flush=True,
    )
