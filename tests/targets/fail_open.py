"""A watched loop where dlwatch cannot do its part.  usage: fail_open.py WAY FORM

WAY is how monitoring is prevented, for real, before the block:
  cwd-deleted  the working directory is removed under the job (the default report dir is relative)
  no-spawn     the interpreter the monitor would be started from is gone (a venv removed under the job)
  heartbeat    no file may grow past 64 bytes (RLIMIT_FSIZE): the heartbeat cannot be allocated
  as-is        nothing: the test sets up the condition (a full filesystem for the report dir and TMPDIR)
FORM is `plain` (iterate the loader) or `as` (iterate the watched object).

Two epochs of a real DataLoader with two workers.  Prints EPOCH <n> <batches as JSON> per epoch
and, at the end, WARNINGS <n> and each dlwatch warning's text; exits 0 when the loop ended by itself.
"""

import json
import os
import resource
import sys
import tempfile
import warnings

from torch.utils.data import DataLoader

import dlwatch
from datasets import Squares


def prevent(way: str) -> None:
    if way == "cwd-deleted":
        scratch = tempfile.mkdtemp()
        os.chdir(scratch)
        os.rmdir(scratch)
    elif way == "no-spawn":
        sys.executable = os.path.join(tempfile.mkdtemp(), "python-removed")
    elif way == "heartbeat":
        resource.setrlimit(resource.RLIMIT_FSIZE, (64, 64))  # SIGXFSZ: ignored by Python, so EFBIG
    elif way != "as-is":
        raise SystemExit(f"unknown way {way!r}")


if __name__ == "__main__":
    way, form = sys.argv[1], sys.argv[2]
    dl = DataLoader(Squares(16), batch_size=4, num_workers=2)
    prevent(way)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dlwatch.watch(dl, poll_interval=0.1) as batches:
            for epoch in range(2):
                seen = [x.tolist() for x, _ in (batches if form == "as" else dl)]
                print(f"EPOCH {epoch} {json.dumps(seen)}", flush=True)
    mine = [str(w.message) for w in caught if issubclass(w.category, dlwatch.DlwatchWarning)]
    print(f"WARNINGS {len(mine)}")
    for text in mine:
        print(f"WARNING {text}")
