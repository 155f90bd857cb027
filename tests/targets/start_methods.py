"""Run Squares under watch with a given start method; print a checksum line for comparison."""

import json
import os
import sys

import torch  # noqa: F401
from torch.utils.data import DataLoader

import dlwatch
from datasets import Squares, record_init

if __name__ == "__main__":
    method, report_dir, init_log = sys.argv[1], sys.argv[2], sys.argv[3]
    dl = DataLoader(
        Squares(24), batch_size=4, num_workers=2, multiprocessing_context=method, worker_init_fn=record_init(init_log)
    )
    bare = [(x.tolist(), y.tolist()) for x, y in dl]
    with dlwatch.watch(dl, report_dir=report_dir, poll_interval=0.1) as batches:
        watched = [(x.tolist(), y.tolist()) for x, y in batches]
        with open(os.path.join(batches.run_dir, "events.jsonl")) as f:
            events = [json.loads(line) for line in f]
    # both hooks travel to the workers (pickled under spawn and forkserver) and both fingerprints come back
    stages = sorted(e["stage"] for e in events if e["event"] == "rng_fingerprint")
    print("RESULT " + json.dumps({"same": bare == watched, "n": len(watched), "fingerprints": stages}), flush=True)
