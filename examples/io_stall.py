"""A remote store that accepts connections and never answers: every worker waits on its socket.

The dataset fetches each sample over HTTP from a shard server, through a small
thread pool (as object-store clients do): the worker's main thread waits in
`Future.result()`, a pool thread in the socket read, with a 10-minute client
timeout. Here the server is a local listener that accepts and never replies, as
a store behind a dead load balancer or a hung NFS/FUSE gateway does. Nothing is
deadlocked and nothing uses CPU; the loop just stops. `watch(stall_timeout=3)`
turns the silence into a `stall` incident: classification `io-wait`, playbook
io-stall, naming each worker, the waiting thread, the peer `ip:port` and how long.

This script plays the store and the job scheduler: it runs the silent server,
runs the training in a child process and, once the report is written (or after
45 s), kills the child's whole process group and closes the server.

    python examples/io_stall.py [--report-dir DIR]
"""

import concurrent.futures
import http.client
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import torch
from torch.utils.data import DataLoader, Dataset

import dlwatch
from _common import incidents, parse_args, print_reports

CHILD = "DLWATCH_EXAMPLE_TRAINING_CHILD"
PORT = "DLWATCH_EXAMPLE_STORE_PORT"
GIVE_UP_S = 45.0


class RemoteShards(Dataset):
    """Samples fetched over HTTP from a shard server, through a per-worker thread pool."""

    def __init__(self, host, port):
        self.host, self.port = host, port
        self.pool = None  # created lazily in each worker: thread pools do not survive fork

    def __len__(self):
        return 64

    def _get(self, i):
        conn = http.client.HTTPConnection(self.host, self.port, timeout=600)  # a 10-minute client timeout
        try:
            conn.request("GET", f"/shards/{i:05d}.bin")
            return conn.getresponse().read()
        finally:
            conn.close()

    def __getitem__(self, i):
        if self.pool is None:
            self.pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="fetch")
        payload = self.pool.submit(self._get, i).result()  # no timeout here either
        return torch.frombuffer(bytearray(payload), dtype=torch.uint8)


def train(report_dir, port):
    loader = DataLoader(RemoteShards("127.0.0.1", port), batch_size=4, num_workers=2, collate_fn=lambda xs: xs)
    with dlwatch.watch(loader, report_dir=report_dir, poll_interval=0.2, stall_timeout=3) as batches:
        for _ in batches:
            pass


def silent_server():
    """Accepts every connection and never answers; the caller closes it."""
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    held = []

    def accept():
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return  # closed
            held.append(conn)

    threading.Thread(target=accept, daemon=True).start()
    return srv, held


def supervise(report_dir):
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that `finally` below still cleans up
    before = incidents(report_dir)
    srv, held = silent_server()
    child = None
    try:
        env = dict(os.environ, **{CHILD: "1", PORT: str(srv.getsockname()[1])})
        child = subprocess.Popen([sys.executable, *sys.argv], env=env, start_new_session=True)
        deadline = time.monotonic() + GIVE_UP_S
        while child.poll() is None and time.monotonic() < deadline and not (incidents(report_dir) - before):
            time.sleep(0.2)
        time.sleep(0.3)  # let the monitor finish its one-line notice on stderr
        if child.poll() is None:
            print(
                "training is stuck on the store and the report is written: killing it "
                "(as a scheduler's time limit would)"
            )
    finally:
        if child is not None:
            try:
                os.killpg(child.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            child.wait()
        srv.close()
        for conn in held:
            conn.close()
    print_reports(report_dir, before)


def main():
    args = parse_args(__doc__.splitlines()[0])
    if os.environ.get(CHILD) == "1":
        train(args.report_dir, int(os.environ[PORT]))
    else:
        supervise(args.report_dir)


if __name__ == "__main__":
    main()
