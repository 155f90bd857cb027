"""Real runs whose report.json and summary.json the schema golden test compares.

usage: schema_runs.py MODE REPORT_DIR
  finish     the monitor is SIGKILLed, then the loop body raises: the finisher child writes the
             exception incident and the run summary (dlwatch.monitor.finish)
  exception  a loop body raises at batch 5 while the monitor runs (an exception incident)
  killed     prints READY and loops slowly; the test SIGKILLs this process (an exit incident)
"""

import glob
import os
import signal
import sys
import time

from torch.utils.data import DataLoader

import dlwatch
from datasets import Squares


def sampled(report_dir: str) -> bool:
    for path in glob.glob(os.path.join(report_dir, ".runs", "*", "timeline.jsonl")):
        try:
            with open(path) as f:
                if any('"kind": "sample"' in line and '"system": {' in line for line in f):
                    return True
        except OSError:
            pass
    return False


if __name__ == "__main__":
    mode, report_dir = sys.argv[1], sys.argv[2]
    if mode == "finish":
        dl = DataLoader(Squares(40), batch_size=4, num_workers=0)
        with dlwatch.watch(dl, report_dir=report_dir, poll_interval=0.1) as batches:
            os.kill(batches.monitor_pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while batches._session.monitor.poll() is None and time.monotonic() < deadline:
                time.sleep(0.02)
            for _ in batches:
                _ = 1 / 0
    elif mode == "exception":
        dl = DataLoader(Squares(64), batch_size=4, num_workers=2)
        with dlwatch.watch(dl, report_dir=report_dir, poll_interval=0.1) as batches:
            for i, _ in enumerate(batches):
                if i == 4:
                    raise ValueError("step failed at batch 5")
    elif mode == "killed":
        dl = DataLoader(Squares(10_000, sleep_s=0.01), batch_size=4, num_workers=2)
        started = time.monotonic()
        ready = False
        with dlwatch.watch(dl, report_dir=report_dir, poll_interval=0.1) as batches:
            for _ in batches:
                # READY once the monitor's timeline holds a sample with the system figures (on a
                # loaded machine the monitor's first polls come late), or after 30 s regardless
                if not ready and (sampled(report_dir) or time.monotonic() - started > 30):
                    ready = True
                    print("READY", flush=True)
    else:
        raise SystemExit(f"unknown mode {mode!r}")
