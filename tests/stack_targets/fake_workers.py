"""A hostile job for `dlwatch attach`: it looks watched, and its fake workers flood their dump files.

Usage: fake_workers.py REPORT_DIR WORKERS MIB

The main process makes a run directory under REPORT_DIR/.runs/ the way dlwatch.watch does
(a heartbeat file it keeps mapped, config.json, events.jsonl registering WORKERS children as
DataLoader workers with their dumps/<pid>.txt), then sleeps.  Each child catches dlwatch's
dump signal (SIGRTMIN+6) and answers it with MIB MiB of faulthandler-shaped text: a thread
3,000 frames deep, a frame with a 100,000-character function name, then thousands of
shallow threads, over and over.  Needs nothing but the standard library (it runs as a second
uid too).  Prints "READY <main pid> <worker pids...>" once everything is in place.
"""

import json
import mmap
import os
import signal
import sys
import time

report_dir, workers, mib = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
run_dir = os.path.join(report_dir, ".runs", f"20260101T000000-{os.getpid()}-fake01")
dumps = os.path.join(run_dir, "dumps")
os.makedirs(dumps, mode=0o700)

UNIT = "".join(
    [
        "Thread 0x00007f0000000001 (most recent call first):\n",
        "".join(f'  File "/srv/data/deep_{i % 7}.py", line {i + 1} in recurse_{"x" * 80}\n' for i in range(3000)),
        f'  File "/srv/data/long.py", line 1 in {"n" * 100_000}\n',
        "".join(
            f"Thread 0x{0x7F0000001000 + i:016x} (most recent call first):\n"
            f'  File "/srv/data/pool.py", line 7 in work\n  File "/usr/lib/python3/threading.py", line 1 in run\n'
            for i in range(3000)
        ),
    ]
).encode()


def flood(_signum, _frame):
    with open(os.path.join(dumps, f"{os.getpid()}.txt"), "ab") as f:
        written = 0
        while written < mib << 20:
            f.write(UNIT)
            written += len(UNIT)


children = []
for i in range(workers):
    pid = os.fork()
    if pid == 0:
        signal.signal(signal.SIGRTMIN + 6, flood)
        open(os.path.join(dumps, f"{os.getpid()}.txt"), "ab").close()
        while True:
            time.sleep(60)
    children.append(pid)

hb_path = os.path.join(run_dir, "heartbeat")
with open(hb_path, "wb") as f:
    f.write(b"\0" * 4096)
hb_fd = os.open(hb_path, os.O_RDWR)
hb = mmap.mmap(hb_fd, 4096)  # attach finds the run directory through this mapping
with open(os.path.join(run_dir, "config.json"), "w") as f:
    json.dump(
        {"pid": os.getpid(), "loader": {"class": "torch.utils.data.DataLoader", "num_workers": workers}, "options": {}},
        f,
    )
with open(os.path.join(run_dir, "events.jsonl"), "w") as f:
    for i, pid in enumerate(children):
        f.write(
            json.dumps(
                {
                    "ts": time.time(),
                    "event": "worker_registered",
                    "pid": pid,
                    "worker_id": i,
                    "start_method": "fork",
                    "dump_path": os.path.join(dumps, f"{pid}.txt"),
                }
            )
            + "\n"
        )
deadline = time.time() + 30
while (
    any(
        not (int(open(f"/proc/{p}/status").read().split("SigCgt:")[1].split()[0], 16) >> (signal.SIGRTMIN + 5)) & 1
        for p in children
    )
    and time.time() < deadline
):
    time.sleep(0.01)  # every child catches the signal before the test may attach
print("READY", os.getpid(), *children, flush=True)
time.sleep(600)
