"""The decoder process that fed the workers died: they wait on its queue forever.

The training process starts a decoder (a `multiprocessing.Process`) that fills a queue
with decoded samples; the DataLoader's workers take their samples from that queue with a
plain `queue.get()`, no timeout. After a few batches the decoder is killed (here by the
script, with SIGKILL, as the OOM killer would). The workers drain the queue, then block in
`get()` forever; nothing raises.

The stall incident's top finding is `producer-gone`: the workers wait in a queue get, and
process N (started by the main process) was killed by SIGKILL a few seconds before the
stall; `worker-deadlock` follows with the queue-wait remedy, not the fork-lock one.

Like examples/deadlock.py, this script plays the job scheduler.

    python examples/producer_gone.py [--report-dir DIR]
"""

import multiprocessing
import os
import signal

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import run_hung_training


def decode(queue):
    i = 0
    while True:
        queue.put(bytes(64) + i.to_bytes(8, "little"))  # "decoded" samples; blocks while the queue is full
        i += 1


class FromDecoder(Dataset):
    def __init__(self, queue):
        self.queue = queue

    def __len__(self):
        return 10_000

    def __getitem__(self, i):
        raw = self.queue.get()  # no timeout: waits for the decoder forever
        return torch.full((4,), float(int.from_bytes(raw[-8:], "little")))


def train(report_dir):
    ctx = multiprocessing.get_context("fork")
    queue = ctx.Queue(maxsize=16)
    decoder = ctx.Process(target=decode, args=(queue,), name="decoder", daemon=True)
    decoder.start()
    loader = DataLoader(FromDecoder(queue), batch_size=4, num_workers=2, multiprocessing_context="fork")
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2, stall_timeout=3) as batches:
        for n, _ in enumerate(batches):
            if n == 5:
                os.kill(decoder.pid, signal.SIGKILL)  # the OOM killer, in a real job


if __name__ == "__main__":
    run_hung_training(__doc__.splitlines()[0], train)
