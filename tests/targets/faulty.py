"""A loop under watch whose body raises at batch 5.  usage: faulty.py REPORT_DIR [ARGS...]

Extra args are ignored by the loop (tests pass secret-looking ones to check redaction).
Prints BATCHES <n> and the dlwatch warnings it received before re-raising.
"""

import sys
import warnings

from torch.utils.data import DataLoader

import dlwatch
from datasets import Squares

if __name__ == "__main__":
    dl = DataLoader(Squares(64), batch_size=4, num_workers=2)
    seen = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with dlwatch.watch(dl, report_dir=sys.argv[1], poll_interval=0.1):
                for _ in dl:
                    seen += 1
                    if seen == 5:
                        raise ValueError(
                            "step failed: password=hunter2-secret-value "
                            "url=https://alice:pw-secret-value@example.invalid/data"
                        )
        finally:
            print(f"BATCHES {seen}", flush=True)
            for w in caught:
                if "dlwatch" in str(w.message):
                    print(f"WARNING {w.message}", flush=True)
