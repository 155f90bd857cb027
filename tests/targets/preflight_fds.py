"""A loader whose batches carry many tensors, under a low fd limit and the file_descriptor strategy.

    python preflight_fds.py REPORT_DIR

Sets its soft RLIMIT_NOFILE to 256 (like `ulimit -n 256`); each batch holds 40 tensors, so
(2 workers x prefetch 2 + 1) x 40 = 200 fds are in flight: above 80% of the limit, below it.
Prints the preflight findings of its run summary as `PREFLIGHT <id> <json evidence>`.
"""

import json
import resource
import sys
import warnings

import torch
import torch.multiprocessing
from torch.utils.data import DataLoader, Dataset

import dlwatch


class ManyTensors(Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        return {f"f{k}": torch.full((2,), float(i)) for k in range(40)}


def main():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))
    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    loader = DataLoader(ManyTensors(), batch_size=2, num_workers=2, prefetch_factor=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with dlwatch.watch(loader, report_dir=sys.argv[1], poll_interval=0.2) as w:
            for batch in w:
                assert len(batch) == 40
    for warning in caught:
        if issubclass(warning.category, dlwatch.DlwatchWarning):
            print(f"WARNING {warning.message}", flush=True)
    for f in w.summary["preflight"]:
        print(f"PREFLIGHT {f['playbook']} {json.dumps(f['evidence'])}", flush=True)
    print("DONE", flush=True)


if __name__ == "__main__":
    main()
