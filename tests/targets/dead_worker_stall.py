"""A worker SIGKILLed while the loop (in a non-main thread: no SIGCHLD handler of torch's) waits for data.

torch notices the dead worker only at its next 5-second status check; with stall_timeout=2
dlwatch's stall comes first, classified dead-worker. Prints READY <worker pid> before the kill.
"""

import os
import signal
import sys
import threading
import time

from torch.utils.data import DataLoader, Dataset

import dlwatch


class Slow(Dataset):
    def __len__(self):
        return 1000

    def __getitem__(self, i):
        time.sleep(0.05 if i < 8 else 30)  # after the first batches every worker is busy for long
        return i


def train(report_dir):
    dl = DataLoader(Slow(), batch_size=2, num_workers=2)
    try:
        with dlwatch.watch(dl, report_dir=report_dir, poll_interval=0.2, stall_timeout=2):
            it = iter(dl)
            for i, _ in enumerate(it):
                if i == 1:
                    victim = it._workers[0].pid
                    print(f"READY {victim}", flush=True)
                    os.kill(victim, signal.SIGKILL)
    except Exception as exc:
        print(f"FAILED {type(exc).__name__}: {exc}", flush=True)


if __name__ == "__main__":
    t = threading.Thread(target=train, args=(sys.argv[1],))
    t.start()
    t.join()
